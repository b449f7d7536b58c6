"""The selective scan (Mamba-1): entry points.

A diagonal state per channel and state index, ``h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t``,
``y_t = C_t . h_t + D x_t``, with ``A`` of shape ``(channels, N)``: the decay varies along the
channel and the state axis. See ``docs/selective_scan.md`` for the math and the forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

from ._backend.namespace import device as device_of
from ._backend.ops import nonpositive
from ._forms.common.scan import default_scan_chunk
from ._forms.selective.chunked import selective_chunked
from ._forms.selective.quadratic import selective_quadratic
from ._forms.selective.recurrent import selective_recurrent, selective_step
from ._inputs.arrays import (
    broadcast_shapes,
    check_device,
    check_floating,
    check_known_shape,
    namespace_of,
    work_dtype_for,
)
from ._inputs.defaults import DEFAULT_EPS
from ._inputs.layout import DEFAULT_SEQ_AXIS, standard_layout
from ._inputs.prepare import finish
from ._inputs.sequences import run_sequences
from ._inputs.steps import PlanCache, PreparedStep
from ._inputs.validation import (
    AttentionInputs,
    check_flag,
    check_matrix_state,
    check_method,
    check_options,
)
from ._typing import Array
from .activations import silu, softplus

__all__ = [
    "SELECTIVE_METHODS", "prepare_selective_scan_step", "selective_scan", "selective_scan_step"
]  # fmt: skip

#: The algorithms of :func:`selective_scan`; they compute the same function.
SELECTIVE_METHODS = ("chunked", "recurrent", "quadratic")


class _Checked(NamedTuple):
    """The checked arguments of a selective scan (sequence or step)."""

    inputs: AttentionInputs
    A: Any  # (..., D, N), work dtype, values above 0 taken as 0
    D: Any | None  # (..., D), work dtype
    dt_bias: Any | None  # (..., D), work dtype
    channels: int
    state_size: int


def _check(
    x: Any,
    dt: Any,
    A: Any,
    B: Any,
    C: Any,
    *,
    D: Any,
    z: Any,
    dt_bias: Any,
    dt_softplus: Any,
    token: bool,
) -> _Checked:
    """Check the arguments of :func:`selective_scan` (``token=False``, arrays in the standard
    layout) or of :func:`selective_scan_step` (``token=True``), naming them as the caller
    does."""
    suffix = "_t" if token else ""
    seq = {f"x{suffix}": x, f"dt{suffix}": dt, f"B{suffix}": B, f"C{suffix}": C}
    if z is not None:
        seq["z"] = z
    params = {"A": A, **({} if D is None else {"D": D})}
    if dt_bias is not None:
        params["dt_bias"] = dt_bias
    xp = namespace_of(**seq, **params)
    device = device_of(x)
    others = {**seq, **params}
    del others[f"x{suffix}"]
    check_device(xp, device, f"x{suffix}", **others)
    core = 1 if token else 2
    for name, a in {**seq, **params}.items():
        check_floating(xp, name, a)
        check_known_shape(name, a)
        need = (2 if name == "A" else 1) if name in params else core
        if a.ndim < need:
            shape = "(..., D, N)" if name == "A" else "(..., d)" if need == 1 else "(..., T, d)"
            raise ValueError(
                f"{name} must have at least {need} dimensions {shape}, got {tuple(a.shape)}"
            )
    for name, a in seq.items():
        if a.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {a.dtype} but x{suffix} has dtype {x.dtype}")
    channels, state_size = x.shape[-1], B.shape[-1]
    for name, a in {**seq, **params}.items():
        if name in (f"x{suffix}", f"B{suffix}", "A"):
            continue
        width, what = (state_size, "N of B") if name[0] == "C" else (channels, "D of x")
        if a.shape[-1] != width:
            raise ValueError(f"{name} has last axis {a.shape[-1]}; it must be {width}, {what}")
    if tuple(A.shape[-2:]) != (channels, state_size):
        raise ValueError(
            f"A must have shape (..., D, N) = (..., {channels}, {state_size}) (the channels of "
            f"x, the state size of B), got {tuple(A.shape)}"
        )
    if not token:
        length = x.shape[-2]
        for name, a in seq.items():
            if a.shape[-2] != length:
                raise ValueError(
                    f"{name} has sequence length {a.shape[-2]} but x has {length}; they must match"
                )
    leading = {name: tuple(a.shape[:-core]) for name, a in seq.items()}
    leading["A"] = tuple(A.shape[:-2])
    leading |= {name: tuple(a.shape[:-1]) for name, a in params.items() if name != "A"}
    batch = broadcast_shapes(leading)
    check_flag("dt_softplus", dt_softplus)
    inputs = AttentionInputs(xp, device, x.dtype, work_dtype_for(xp, x.dtype), batch)
    A = nonpositive(xp, inputs.to_work_dtype(A))
    D, dt_bias = (None if a is None else inputs.to_work_dtype(a) for a in (D, dt_bias))
    return _Checked(inputs, A, D, dt_bias, channels, state_size)


def _time_steps(xp: Any, dt: Any, bias: Any | None, dt_softplus: bool) -> Any:
    """``softplus(dt + bias)`` (as asked), values below 0 taken as 0: a decay never amplifies
    the state (the gradient is 0 there)."""
    if bias is not None:
        dt = dt + bias
    if dt_softplus:
        dt = softplus(dt)
    return -nonpositive(xp, -dt)


def selective_scan(
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    /,
    *,
    D: Array | None = None,
    z: Array | None = None,
    dt_bias: Array | None = None,
    dt_softplus: bool = False,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: Array | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Array | tuple[Array, Array]:
    r"""The selective scan of Mamba-1: a diagonal state per channel and state index.

    For channels ``d`` and state indices ``n``::

        h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] x_t[d] B_t[n]
        y_t[d]    = (sum_n C_t[n] h_t[d, n] + D[d] x_t[d]) * silu(z_t[d])

    (``dt`` after ``dt_bias`` and ``dt_softplus``; without ``D`` or ``z`` their terms are
    left out). This is what transformers' Mamba, FalconMamba, Jamba and Zamba layers compute
    and mamba_ssm's ``selective_scan_fn``, in polylin's layout: the time axis second to last,
    the channels last. Every method computes the same function (to round-off); see the docs
    page "The selective scan (Mamba-1)".

    Parameters
    ----------
    x : array
        The input, shape ``(..., T, D)``: D channels, any number of leading dimensions.
    dt : array
        The time steps, the shape of ``x`` (leading dimensions broadcast), its dtype;
        ``dt >= 0`` after ``dt_bias`` and ``dt_softplus`` (values below 0 are taken as 0).
    A : array
        The state matrix, ``(D, N)`` or ``(..., D, N)`` (leading dimensions broadcast against
        the inputs', e.g. one per head), any real floating dtype (cast to the work dtype);
        ``A <= 0`` (Mamba's ``-exp(A_log)``; values above 0 are taken as 0, so a decay never
        amplifies the state).
    B, C : array
        The input and output projections of the state, ``(..., T, N)``, shared by every
        channel, the dtype of ``x``.
    D : array, optional
        The skip weights, ``(D,)`` or ``(..., D)``, any real floating dtype.
    z : array, optional
        The gate, the shape of ``x``: the output is multiplied by ``silu(z)``.
    dt_bias : array, optional
        Added to ``dt`` first, ``(D,)`` or ``(..., D)``, any real floating dtype.
    dt_softplus : bool
        Apply ``softplus`` to ``dt + dt_bias``.
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: a scan in two levels, about ``2 sqrt(T)`` steps over arrays of
        ``sqrt(T)`` tokens, O(T D N) work. ``"recurrent"``: one state update per token (the
        reference for the state). ``"quadratic"``: every output from every earlier token,
        O(T^2 D N) time and memory (tests, short sequences).
    chunk_size : int, optional
        Chunk length of the chunked form (any integer >= 1); default about ``sqrt(T)``, a
        power of two in ``[16, 256]``.
    initial_state : array, optional
        The state ``h`` to continue from, ``(..., D, N)`` in the work dtype (the inputs'
        broadcast leading dimensions without T; size-1 axes broadcast). With ``cu_seqlens``
        one per sequence: ``(..., S, D, N)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        True for real tokens: ``(batch, T)`` or the shape of ``x`` without its channel axis
        (size-1 axes broadcast), as for :func:`~polylin.causal_linear_attention`. A masked
        token neither writes to nor decays the state and its output is 0; its inputs are never
        read (they may be NaN).
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis;
        each starts from its own state.
    seq_axis : int
        The axis of T in ``x``, ``dt``, ``B``, ``C`` and ``z`` (default -2: ``(..., T, d)``);
        ``seq_axis=1`` with 3-D inputs is the same as the default. The output keeps the
        layout.

    Returns
    -------
    array or (array, array)
        ``y``, the shape of ``x`` (the broadcast leading dimensions), same library, device and
        dtype; with ``return_state`` also the final state ``(..., D, N)`` (float32 for 16-bit
        inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, ``dt``, ``B``, ``C`` or ``z`` of
        another dtype than ``x``, a state not in the work dtype, options of the wrong type.
    ValueError
        Mismatched shapes or devices, an unknown method, ``chunk_size < 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import selective_scan
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((2, 2, 50, 6))
    >>> B, C = rng.standard_normal((2, 2, 50, 4))
    >>> A = -np.exp(rng.standard_normal((6, 4)))
    >>> y, h = selective_scan(x, dt, A, B, C, dt_softplus=True, return_state=True)
    >>> y.shape, h.shape
    ((2, 50, 6), (2, 6, 4))
    >>> ref = selective_scan(x, dt, A, B, C, dt_softplus=True, method="recurrent")
    >>> bool(np.allclose(y, ref))
    True
    """
    layout, x, dt, B, C = standard_layout(seq_axis, x=x, dt=dt, B=B, C=C)
    z = layout.per_token_to_standard("z", z)
    checked = _check(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, token=False
    )
    check_method(method, SELECTIVE_METHODS)
    if chunk_size is not None:
        check_options(eps=DEFAULT_EPS, chunk_size=chunk_size)
    check_flag("return_state", return_state)
    inputs, packed = checked.inputs, cu_seqlens is not None
    xp = inputs.xp
    arrays = [inputs.to_work_dtype(a) for a in (x, dt, B, C, *(() if z is None else (z,)))]

    def per_channel(a: Any | None) -> Any | None:  # (..., D) against (..., [S,] T, D)
        if a is None:
            return None
        return a[..., None, None, :] if packed and a.ndim > 1 else a[..., None, :]

    A_work = checked.A[..., None, :, :] if packed and checked.A.ndim > 2 else checked.A
    skip, bias = per_channel(checked.D), per_channel(checked.dt_bias)

    def algorithm(arrays: list[Any], h: Any, keep: Any | None) -> tuple[Any, Any]:
        x, dt, B, C, *gate = arrays
        dt = _time_steps(xp, dt, bias, dt_softplus)
        if keep is not None:  # softplus(0 + bias) is not 0: masked steps are selected again
            dt = xp.where(keep, dt, 0.0)
        if method == "chunked":
            size = default_scan_chunk(x.shape[-2]) if chunk_size is None else int(chunk_size)
            y, h = selective_chunked(xp, x, dt, A_work, B, C, h, chunk_size=size)
        else:
            form = selective_recurrent if method == "recurrent" else selective_quadratic
            y, h = form(xp, x, dt, A_work, B, C, h)
        if skip is not None:
            y = y + x * skip
        if gate:
            y = y * silu(gate[0])
        return y, h

    return run_sequences(
        inputs,
        layout,
        arrays,
        algorithm,
        length=x.shape[-2],
        state_shape=(checked.channels, checked.state_size),
        initial_state=initial_state,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
    )


def selective_scan_step(
    x_t: Array,
    dt_t: Array,
    A: Array,
    B_t: Array,
    C_t: Array,
    state: Array | None = None,
    /,
    *,
    D: Array | None = None,
    z: Array | None = None,
    dt_bias: Array | None = None,
    dt_softplus: bool = False,
) -> tuple[Array, Array]:
    """One token of the selective scan: update the state, read it with ``C_t``.

    Cost and memory are O(D N) whatever the position; a state returned by
    :func:`selective_scan` continues here exactly (transformers'
    ``mamba_selective_state_update``, mamba_ssm's ``selective_state_update``).

    Parameters
    ----------
    x_t, dt_t : array
        The input and time step of the new token, ``(..., D)``.
    A : array
        ``(D, N)`` or ``(..., D, N)``, ``<= 0`` (values above 0 are taken as 0).
    B_t, C_t : array
        ``(..., N)``, the dtype of ``x_t``.
    state : array, optional
        The state before this token, ``(..., D, N)`` in the work dtype; ``None`` starts from
        zeros.
    D : array, optional
        The skip weights, ``(D,)`` or ``(..., D)``, any real floating dtype.
    z : array, optional
        The gate, the shape of ``x_t``: the output is multiplied by ``silu(z)``.
    dt_bias : array, optional
        Added to ``dt_t`` first, ``(D,)`` or ``(..., D)``, any real floating dtype.
    dt_softplus : bool
        Apply ``softplus`` to ``dt_t + dt_bias``.

    Returns
    -------
    y_t : array
        ``(..., D)``, same library, device and dtype as ``x_t``.
    state : array
        The state after this token (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state not in the work dtype.
    ValueError
        Mismatched shapes or devices.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import selective_scan, selective_scan_step
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((2, 10, 6))
    >>> B, C = rng.standard_normal((2, 10, 4))
    >>> A = -np.exp(rng.standard_normal((6, 4)))
    >>> y, h = selective_scan(x[:6], dt[:6], A, B[:6], C[:6], dt_softplus=True, return_state=True)
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     y_t, h = selective_scan_step(x[t], dt[t], A, B[t], C[t], h, dt_softplus=True)
    ...     outputs.append(y_t)
    >>> whole = selective_scan(x, dt, A, B, C, dt_softplus=True)
    >>> bool(np.allclose(np.stack(outputs), whole[6:]))
    True
    """
    args = (x_t, dt_t, A, B_t, C_t, state, D, z, dt_bias)
    plan, _ = _PLANS.plan(partial(_plan_step, dt_softplus=dt_softplus), args, (dt_softplus,))
    return _run_step(plan, *args)


#: :func:`selective_scan_step`'s checks run once per signature of its arguments and options.
_PLANS = PlanCache()


class _StepPlan(NamedTuple):
    """What :func:`selective_scan_step`'s checks found, for one signature of its arguments
    (``A``, ``D`` and ``dt_bias`` are arrays of every call: converted at every call)."""

    inputs: AttentionInputs
    state_shape: tuple  # (..., D, N)
    dt_softplus: bool


def _plan_step(
    x_t: Array,
    dt_t: Array,
    A: Array,
    B_t: Array,
    C_t: Array,
    state: Array | None,
    D: Array | None,
    z: Array | None,
    dt_bias: Array | None,
    *,
    dt_softplus: Any,
) -> tuple[_StepPlan, None]:
    """Check every argument of :func:`selective_scan_step` (the ``plan`` of its
    :class:`~polylin.PreparedStep`)."""
    checked = _check(
        x_t, dt_t, A, B_t, C_t, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, token=True
    )
    inputs = checked.inputs
    shape = (*inputs.batch_shape, checked.channels, checked.state_size)
    check_matrix_state(inputs, state, shape, name="state", token_shape=tuple(x_t.shape))
    return _StepPlan(inputs, shape, dt_softplus), None


def _run_step(
    plan: _StepPlan,
    x_t: Array,
    dt_t: Array,
    A: Array,
    B_t: Array,
    C_t: Array,
    state: Array | None,
    D: Array | None,
    z: Array | None,
    dt_bias: Array | None,
    *,
    checked: None = None,
) -> tuple[Array, Array]:
    """:func:`selective_scan_step`'s arithmetic on arguments of the plan's signature."""
    inputs = plan.inputs
    xp = inputs.xp
    work = inputs.to_work_dtype
    if state is None:
        h = xp.zeros(plan.state_shape, dtype=inputs.work_dtype, device=inputs.device)
    else:
        h = state if tuple(state.shape) == plan.state_shape else xp.broadcast_to(
            state, plan.state_shape)  # fmt: skip
    x, dt, B, C = (work(a) for a in (x_t, dt_t, B_t, C_t))
    dt = _time_steps(xp, dt, None if dt_bias is None else work(dt_bias), plan.dt_softplus)
    y, h = selective_step(xp, x, dt, nonpositive(xp, work(A)), B, C, h)
    if D is not None:
        y = y + x * work(D)
    if z is not None:
        y = y * silu(work(z))
    return finish(inputs, y, None), h


def prepare_selective_scan_step(*, dt_softplus: bool = False) -> PreparedStep:
    """:func:`selective_scan_step` for a decoding loop: checked once, then arithmetic only.

    The returned function is called like :func:`selective_scan_step` without
    ``dt_softplus``, ``prepared(x_t, dt_t, A, B_t, C_t, state=None, *, D=None, z=None,
    dt_bias=None)``, and returns the same ``(y_t, state)``, equal to the last bit. Its first
    call checks everything :func:`selective_scan_step` checks; later calls whose arrays have
    the same library, shape, dtype and device as the call before skip the checks. Any other
    call is checked again: errors are :func:`selective_scan_step`'s.

    Parameters
    ----------
    dt_softplus : bool
        As in :func:`selective_scan_step`; checked at the first call.

    Returns
    -------
    PreparedStep
        A callable ``(x_t, dt_t, A, B_t, C_t, state=None, /, *, D=None, z=None,
        dt_bias=None)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import prepare_selective_scan_step, selective_scan
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((2, 10, 6))
    >>> B, C = rng.standard_normal((2, 10, 4))
    >>> A = -np.exp(rng.standard_normal((6, 4)))
    >>> decode, h, outputs = prepare_selective_scan_step(dt_softplus=True), None, []
    >>> for t in range(10):
    ...     y_t, h = decode(x[t], dt[t], A, B[t], C[t], h)
    ...     outputs.append(y_t)
    >>> bool(np.allclose(np.stack(outputs), selective_scan(x, dt, A, B, C, dt_softplus=True)))
    True
    """
    names = ("x_t", "dt_t", "A", "B_t", "C_t", "state", "D", "z", "dt_bias")
    return PreparedStep(
        partial(_plan_step, dt_softplus=dt_softplus), _run_step, name="selective_scan_step",
        names=names, required=5, positional_only=6, positional=6,
    )  # fmt: skip
