"""The elementwise linear recurrence and RG-LRU (RecurrentGemma, Griffin): entry points.

``h_t = a_t * h_{t-1} + x_t`` elementwise, ``a_t = exp(log_a_t)`` with ``log_a_t <= 0``: a
state of one number per channel. :func:`linear_scan` computes it for any decay and input;
:func:`rg_lru` adds RG-LRU's gating (``log_a_t = -c softplus(Lambda) sigmoid(r_t)``, the input
``sqrt(1 - a_t^2) sigmoid(i_t) x_t``, a reset at document starts) on the same forms. See
``docs/rg_lru.md`` for the math and the forms.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from ._backend.execution import check_static
from ._backend.namespace import device as device_of
from ._backend.ops import nonpositive
from ._forms.common.scan import default_scan_chunk
from ._forms.elementwise.chunked import scan_chunked
from ._forms.elementwise.quadratic import scan_quadratic
from ._forms.elementwise.recurrent import scan_recurrent, scan_step
from ._inputs.arrays import (
    broadcast_shapes,
    broadcasts_to,
    check_beside,
    check_device,
    check_floating,
    check_known_shape,
    namespace_of,
    work_dtype_for,
)
from ._inputs.layout import DEFAULT_SEQ_AXIS, SequenceLayout, standard_layout
from ._inputs.prepare import finish
from ._inputs.sequences import run_sequences
from ._inputs.validation import (
    AttentionInputs,
    check_flag,
    check_matrix_state,
    check_method,
    check_options,
)
from ._typing import Array
from .activations import sigmoid, softplus

__all__ = [
    "LINEAR_SCAN_METHODS",
    "RG_LRU_C",
    "linear_scan",
    "linear_scan_step",
    "rg_lru",
    "rg_lru_step",
]

#: The algorithms of :func:`linear_scan` and :func:`rg_lru`; they compute the same function.
LINEAR_SCAN_METHODS = ("chunked", "recurrent", "quadratic")

#: RG-LRU's constant ``c`` in ``log a_t = -c softplus(Lambda) r_t`` (Griffin, RecurrentGemma).
RG_LRU_C = 8.0

#: ``prepare(arrays, keep) -> (x, log_a)``: the scan's input and log decay from the per-token
#: arrays (standard layout, work dtype), masked tokens selected to ``(0, 0)`` where ``keep``.
Prepare = Callable[[list[Any], Any], tuple[Any, Any]]


def _check(
    seq: dict[str, Any], params: dict[str, Any], *, token: bool, same_dtype: tuple[str, ...]
) -> tuple[AttentionInputs, int]:
    """Check the per-token arrays ``seq`` (the first is the input ``x``; standard layout, or
    one token ``(..., D)`` with ``token``) and the per-channel ``params`` ``(..., D)``, naming
    them as the caller does; the arrays named in ``same_dtype`` must have the input's dtype,
    the others any real floating dtype. Returns the inputs' facts and the channel count."""
    first, x = next(iter(seq.items()))
    everything = {**seq, **params}
    xp = namespace_of(**everything)
    device = device_of(x)
    check_device(xp, device, first, **{n: a for n, a in everything.items() if n != first})
    core = 1 if token else 2
    for name, a in everything.items():
        check_floating(xp, name, a)
        check_known_shape(name, a)
        need = 1 if name in params else core
        if a.ndim < need:
            shape = "(..., d)" if need == 1 else "(..., T, d)"
            raise ValueError(
                f"{name} must have at least {need} dimensions {shape}, got {tuple(a.shape)}"
            )
    for name in same_dtype:
        if seq[name].dtype != x.dtype:
            raise TypeError(f"{name} has dtype {seq[name].dtype} but {first} has dtype {x.dtype}")
    channels = x.shape[-1]
    for name, a in everything.items():
        if a.shape[-1] not in (channels, 1) or (name in params and a.shape[-1] != channels):
            one = "" if name in params else " or 1"
            raise ValueError(
                f"{name} has last axis {a.shape[-1]}; it must be {channels} (the channels of "
                f"{first}){one}"
            )
    if not token:
        for name, a in seq.items():
            if a.shape[-2] != x.shape[-2]:
                raise ValueError(
                    f"{name} has sequence length {a.shape[-2]} but {first} has {x.shape[-2]}; "
                    "they must match"
                )
    leading = {name: tuple(a.shape[:-core]) for name, a in seq.items()}
    leading |= {name: tuple(a.shape[:-1]) for name, a in params.items()}
    batch = broadcast_shapes(leading)
    return AttentionInputs(xp, device, x.dtype, work_dtype_for(xp, x.dtype), batch), channels


def _scan_sequences(
    inputs: AttentionInputs,
    layout: SequenceLayout,
    arrays: list[Any],
    prepare: Prepare,
    *,
    channels: int,
    method: Any,
    chunk_size: Any,
    initial_state: Any,
    return_state: Any,
    attention_mask: Any,
    cu_seqlens: Sequence[int] | None,
) -> Any:
    """Check the options, run the chosen form over a plain batch, a padding mask or packed
    sequences (:func:`polylin._inputs.sequences.run_sequences`), and return ``h`` or
    ``(h, state)``."""
    check_method(method, LINEAR_SCAN_METHODS)
    if chunk_size is not None:
        check_options(eps=1.0, chunk_size=chunk_size)
    check_flag("return_state", return_state)
    xp = inputs.xp
    length = arrays[0].shape[-2]

    def algorithm(arrays: list[Any], h: Any, keep: Any | None) -> tuple[Any, Any]:
        x, g = prepare(arrays, keep)
        shape = broadcast_shapes({"x": tuple(x.shape), "log_a": tuple(g.shape)})
        shape = (*broadcast_shapes({"state": tuple(h.shape[:-1]), "x": shape[:-2]}), *shape[-2:])
        x, g = (a if tuple(a.shape) == shape else xp.broadcast_to(a, shape) for a in (x, g))
        if method == "chunked":
            size = default_scan_chunk(x.shape[-2]) if chunk_size is None else int(chunk_size)
            return scan_chunked(xp, x, g, h, chunk_size=size)
        form = scan_recurrent if method == "recurrent" else scan_quadratic
        return form(xp, x, g, h)

    return run_sequences(
        inputs,
        layout,
        [inputs.to_work_dtype(a) for a in arrays],
        algorithm,
        length=length,
        check_state=lambda state, leading: _vector_state(
            inputs, state, (*leading, channels), name="initial_state"
        ),
        initial_state=initial_state,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
    )


def _vector_state(inputs: AttentionInputs, state: Any, shape: tuple, *, name: str) -> Any:
    """A state of one value per channel, ``shape`` ``(..., D)``: ``None`` gives zeros; an array
    must be of the inputs' library, device and work dtype, its leading axes broadcasting to
    ``shape``'s (a state shared by a batch: returned broadcast, a view)."""
    if state is None or isinstance(state, tuple):  # the matrix check's message for a tuple
        return check_matrix_state(inputs, state, shape, name=name)
    xp = inputs.xp
    check_beside(xp, inputs.device, name, state, query="x")
    check_floating(xp, name, state)
    if state.dtype != inputs.work_dtype:
        raise TypeError(
            f"{name} has dtype {state.dtype} but inputs of dtype {inputs.dtype} are computed in "
            f"{inputs.work_dtype}; pass a state of that dtype (the one polylin returns)"
        )
    check_known_shape(name, state)
    got = tuple(state.shape)
    if got == shape:
        return state
    if not broadcasts_to(got, shape, 1):
        raise ValueError(
            f"{name} must have shape {shape} (leading axes of size 1 broadcast), got {got}"
        )
    return xp.broadcast_to(state, shape)


def _state(inputs: AttentionInputs, state: Any, channels: int) -> Any:
    return _vector_state(inputs, state, (*inputs.batch_shape, channels), name="state")


def linear_scan(
    x: Array,
    log_a: Array,
    /,
    *,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: Array | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Array | tuple[Array, Array]:
    r"""The elementwise linear recurrence ``h_t = exp(log_a_t) * h_{t-1} + x_t``.

    One state value per channel, every channel on its own: the scan of RG-LRU
    (RecurrentGemma's ``_rnn_scan``), of LRU and of diagonal state-space layers. The output is
    every state ``h_t``. Every method computes the same function (to round-off); see the docs
    page "RG-LRU and the elementwise linear recurrence".

    Parameters
    ----------
    x : array
        The input added at every token, ``(..., T, D)``: D channels, any leading dimensions.
    log_a : array
        The log decays, ``(..., T, D)`` or ``(..., T, 1)`` (one per token, shared by the
        channels); leading dimensions broadcast; any real floating dtype (cast to the work
        dtype). ``log_a <= 0``: values above 0 are taken as 0, so a decay never amplifies the
        state; ``-inf`` drops the state exactly (a reset).
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: a scan in two levels, about ``2 sqrt(T)`` steps over arrays of
        ``sqrt(T)`` tokens, O(T D) work. ``"recurrent"``: one state update per token.
        ``"quadratic"``: every state from every earlier token, O(T^2 D) time and memory
        (tests, short sequences).
    chunk_size : int, optional
        Chunk length of the chunked form (any integer >= 1); default about ``sqrt(T)``, a
        power of two in ``[16, 256]``.
    initial_state : array, optional
        The state to continue from, ``(..., D)`` in the work dtype (the inputs' broadcast
        leading dimensions without T; size-1 or missing leading axes broadcast). With
        ``cu_seqlens`` one per sequence: ``(..., S, D)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        True for real tokens: ``(batch, T)`` or the shape of ``x`` without its channel axis,
        as for :func:`~polylin.causal_linear_attention`. A masked token neither writes to nor
        decays the state and its output is 0; its inputs are never read (they may be NaN).
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis;
        each starts from its own state.
    seq_axis : int
        The axis of T in ``x`` and ``log_a`` (default -2: ``(..., T, D)``). The output keeps
        the layout.

    Returns
    -------
    array or (array, array)
        ``h``, every state, the shape of ``x`` (the broadcast leading dimensions), same
        library, device and dtype; with ``return_state`` also the last state ``(..., D)``
        (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state not in the work dtype,
        options of the wrong type.
    ValueError
        Mismatched shapes or devices, an unknown method, ``chunk_size < 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import linear_scan
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 50, 6))
    >>> log_a = -np.exp(rng.standard_normal((2, 50, 6)))
    >>> h, last = linear_scan(x, log_a, return_state=True)
    >>> h.shape, last.shape
    ((2, 50, 6), (2, 6))
    >>> bool(np.allclose(h[:, -1], last))
    True
    >>> h1 = np.exp(log_a[:, 1]) * x[:, 0] + x[:, 1]
    >>> bool(np.allclose(h[:, 1], h1))
    True
    """
    layout, x, log_a = standard_layout(seq_axis, x=x, log_a=log_a)
    inputs, channels = _check({"x": x, "log_a": log_a}, {}, token=False, same_dtype=())
    xp = inputs.xp

    def prepare(arrays: list[Any], keep: Any | None) -> tuple[Any, Any]:
        x, g = arrays  # masked tokens are (0, 0) already: no decay, nothing added
        return x, nonpositive(xp, g)

    return _scan_sequences(
        inputs, layout, [x, log_a], prepare, channels=channels, method=method,
        chunk_size=chunk_size, initial_state=initial_state, return_state=return_state,
        attention_mask=attention_mask, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def linear_scan_step(
    x_t: Array, log_a_t: Array, state: Array | None = None, /
) -> tuple[Array, Array]:
    """One token of :func:`linear_scan`: ``h_t = exp(log_a_t) * state + x_t``.

    A state returned by :func:`linear_scan` continues here exactly.

    Parameters
    ----------
    x_t : array
        The input of the new token, ``(..., D)``.
    log_a_t : array
        Its log decay, ``(..., D)`` or ``(..., 1)``, any real floating dtype, ``<= 0``
        (values above 0 are taken as 0; ``-inf`` drops the state).
    state : array, optional
        The state before this token, ``(..., D)`` in the work dtype (size-1 or missing
        leading axes broadcast); ``None`` starts from zeros.

    Returns
    -------
    h_t : array
        The new state in the dtype of ``x_t``.
    state : array
        The new state in the work dtype (float32 for 16-bit inputs), to pass on.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state not in the work dtype.
    ValueError
        Mismatched shapes or devices.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import linear_scan, linear_scan_step
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 10, 6))
    >>> log_a = -np.exp(rng.standard_normal((2, 10, 6)))
    >>> _, h = linear_scan(x[:, :6], log_a[:, :6], return_state=True)
    >>> for t in range(6, 10):
    ...     h_t, h = linear_scan_step(x[:, t], log_a[:, t], h)
    >>> bool(np.allclose(h_t, linear_scan(x, log_a)[:, -1]))
    True
    """
    inputs, channels = _check({"x_t": x_t, "log_a_t": log_a_t}, {}, token=True, same_dtype=())
    xp = inputs.xp
    h = _state(inputs, state, channels)
    x, g = (inputs.to_work_dtype(a) for a in (x_t, log_a_t))
    h = scan_step(xp, x, nonpositive(xp, g), h)
    return finish(inputs, h, None), h


def _check_c(c: Any) -> float:
    check_static("c", c)
    if isinstance(c, bool) or not isinstance(c, numbers.Real):
        raise TypeError(f"c must be a real number, got {type(c).__name__}")
    if not (math.isfinite(float(c)) and float(c) > 0):
        raise ValueError(f"c must be > 0 and finite, got {c}")
    return float(c)


def _rg_lru_gates(
    xp: Any, x: Any, i_gate: Any, r_gate: Any, param: Any, c: float, reset: Any | None
) -> tuple[Any, Any]:
    """RG-LRU's scan input and log decay: ``log_a = -c softplus(Lambda) sigmoid(r)`` and
    ``sqrt(1 - a^2) sigmoid(i) x``; at a reset ``log_a = -inf`` and the input unscaled.

    ``1 - a^2 = -expm1(2 log_a)``: exact where ``a`` is near 1 (``1 - exp`` would cancel)."""
    g = -c * softplus(param) * sigmoid(r_gate)
    gated = sigmoid(i_gate) * x
    scaled = xp.sqrt(-xp.expm1(2.0 * g)) * gated
    if reset is None:
        return scaled, g
    return xp.where(reset, gated, scaled), xp.where(reset, -math.inf, g)


def _check_reset(inputs: AttentionInputs, reset: Any, shape: tuple, name: str) -> Any:
    """``reset`` as booleans: an array of the inputs' library and device, the shape of ``x``
    with a channel axis of 1 or D (leading axes broadcast)."""
    xp = inputs.xp
    if namespace_of(**{name: reset}) is not xp:
        raise TypeError(f"{name} must be an array of the same library as x")
    check_device(xp, inputs.device, "x", **{name: reset})
    if not xp.isdtype(reset.dtype, "bool"):
        raise TypeError(f"{name} must be a boolean array, got dtype {reset.dtype}")
    check_known_shape(name, reset)
    fits = reset.ndim == len(shape) and reset.shape[-1] in (1, shape[-1])
    core = 1 if len(shape) == len(inputs.batch_shape) + 1 else 2
    if fits and core == 2:
        fits = reset.shape[-2] == shape[-2]
    if fits:
        lead = {"x": inputs.batch_shape, name: tuple(reset.shape[:-core])}
        fits = broadcast_shapes(lead) == inputs.batch_shape
    if not fits:
        raise ValueError(
            f"{name} must have the shape of x {shape} with a channel axis of 1 or {shape[-1]} "
            f"(leading axes of size 1 broadcast), got {tuple(reset.shape)}"
        )
    return reset


def rg_lru(
    x: Array,
    input_gate: Array,
    recurrent_gate: Array,
    recurrent_param: Array,
    /,
    *,
    c: float = RG_LRU_C,
    reset: Array | None = None,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: Array | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Array | tuple[Array, Array]:
    r"""RG-LRU, the real-gated linear recurrent unit of Griffin and RecurrentGemma.

    With ``r_t = sigmoid(recurrent_gate_t)``, ``i_t = sigmoid(input_gate_t)`` and
    ``Lambda = recurrent_param``::

        log a_t = -c * softplus(Lambda) * r_t
        h_t     = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)

    elementwise over the channels; at a ``reset`` token ``h_t = i_t * x_t`` (the state is
    dropped and the input is not scaled), as transformers' ``RecurrentGemmaRglru`` does at
    position 0. The gates are the pre-activations (the outputs of the layer's block-diagonal
    linear maps). The scan is :func:`linear_scan`'s, any method.

    Parameters
    ----------
    x : array
        The input, ``(..., T, D)``.
    input_gate, recurrent_gate : array
        The gates' pre-activations, the shape of ``x`` (leading dimensions broadcast), its
        dtype.
    recurrent_param : array
        ``Lambda``, ``(D,)`` or ``(..., D)``, any real floating dtype.
    c : float
        The constant of the decay, > 0 (8 in Griffin and RecurrentGemma).
    reset : array of bool, optional
        True where a document starts, the shape of ``x`` with a channel axis of 1 or D
        (transformers: ``position_ids[..., None] == 0``).
    method : {"chunked", "recurrent", "quadratic"}
        As for :func:`linear_scan`.
    chunk_size : int, optional
        As for :func:`linear_scan`.
    initial_state : array, optional
        The state to continue from, ``(..., D)`` in the work dtype (size-1 or missing leading
        axes broadcast); with ``cu_seqlens`` ``(..., S, D)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        True for real tokens, as for :func:`linear_scan`: a masked token leaves the state
        alone, outputs 0 and is never read.
    cu_seqlens : sequence of int, optional
        Offsets of packed independent sequences, each from its own state.
    seq_axis : int
        The axis of T in the per-token arrays (default -2).

    Returns
    -------
    array or (array, array)
        ``h``, every state, the shape of ``x``, same library, device and dtype; with
        ``return_state`` also the last state ``(..., D)`` (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, gates of another dtype than
        ``x``, a non-boolean ``reset``, a state not in the work dtype, options of the wrong
        type.
    ValueError
        Mismatched shapes or devices, ``c <= 0``, an unknown method, ``chunk_size < 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import rg_lru
    >>> rng = np.random.default_rng(0)
    >>> x, i_gate, r_gate = rng.standard_normal((3, 2, 40, 8))
    >>> Lambda = rng.standard_normal(8)
    >>> h, last = rg_lru(x, i_gate, r_gate, Lambda, return_state=True)
    >>> h.shape, last.shape
    ((2, 40, 8), (2, 8))
    >>> a = np.exp(-8.0 * np.logaddexp(0, Lambda) / (1 + np.exp(-r_gate[:, 0])))
    >>> h0 = np.sqrt(1 - a**2) * x[:, 0] / (1 + np.exp(-i_gate[:, 0]))
    >>> bool(np.allclose(h[:, 0], h0))
    True
    """
    per_token = {"x": x, "input_gate": input_gate, "recurrent_gate": recurrent_gate}
    if reset is not None:
        per_token["reset"] = reset
    layout, *moved = standard_layout(seq_axis, **per_token)
    x, input_gate, recurrent_gate = moved[:3]
    inputs, channels = _check(
        {"x": x, "input_gate": input_gate, "recurrent_gate": recurrent_gate},
        {"recurrent_param": recurrent_param},
        token=False,
        same_dtype=("input_gate", "recurrent_gate"),
    )
    xp, constant = inputs.xp, _check_c(c)
    arrays = [x, input_gate, recurrent_gate]
    if reset is not None:
        flags = _check_reset(inputs, moved[3], tuple(x.shape), "reset")
        arrays.append(xp.astype(flags, inputs.work_dtype))
    param = inputs.to_work_dtype(recurrent_param)
    if cu_seqlens is not None and param.ndim > 1:  # (..., D) against (..., S, T, D)
        param = param[..., None, :]
    param = param[..., None, :]

    def prepare(arrays: list[Any], keep: Any | None) -> tuple[Any, Any]:
        x, i_gate, r_gate, *flags = arrays
        starts = flags[0] != 0.0 if flags else None
        b, g = _rg_lru_gates(xp, x, i_gate, r_gate, param, constant, starts)
        if keep is not None:  # the gates of a zeroed token are not 0: select again
            b, g = xp.where(keep, b, 0.0), xp.where(keep, g, 0.0)
        return b, g

    return _scan_sequences(
        inputs, layout, arrays, prepare, channels=channels, method=method,
        chunk_size=chunk_size, initial_state=initial_state, return_state=return_state,
        attention_mask=attention_mask, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def rg_lru_step(
    x_t: Array,
    input_gate_t: Array,
    recurrent_gate_t: Array,
    recurrent_param: Array,
    state: Array | None = None,
    /,
    *,
    c: float = RG_LRU_C,
    reset: Array | None = None,
) -> tuple[Array, Array]:
    """One token of :func:`rg_lru`: update the state by one gated step.

    A state returned by :func:`rg_lru` continues here exactly (transformers'
    ``RecurrentGemmaRglru`` in decoding).

    Parameters
    ----------
    x_t, input_gate_t, recurrent_gate_t : array
        The new token's input and gate pre-activations, ``(..., D)``, one dtype.
    recurrent_param : array
        ``Lambda``, ``(D,)`` or ``(..., D)``, any real floating dtype.
    state : array, optional
        The state before this token, ``(..., D)`` in the work dtype (size-1 or missing
        leading axes broadcast); ``None`` starts from zeros.
    c : float
        The constant of the decay, > 0.
    reset : array of bool, optional
        True where this token starts a document, ``(..., 1)`` or ``(..., D)``.

    Returns
    -------
    h_t : array
        The new state in the dtype of ``x_t``.
    state : array
        The new state in the work dtype (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state not in the work dtype.
    ValueError
        Mismatched shapes or devices, ``c <= 0``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import rg_lru, rg_lru_step
    >>> rng = np.random.default_rng(0)
    >>> x, i_gate, r_gate = rng.standard_normal((3, 2, 10, 8))
    >>> Lambda = rng.standard_normal(8)
    >>> _, h = rg_lru(x[:, :6], i_gate[:, :6], r_gate[:, :6], Lambda, return_state=True)
    >>> for t in range(6, 10):
    ...     h_t, h = rg_lru_step(x[:, t], i_gate[:, t], r_gate[:, t], Lambda, h)
    >>> bool(np.allclose(h_t, rg_lru(x, i_gate, r_gate, Lambda)[:, -1]))
    True
    """
    inputs, channels = _check(
        {"x_t": x_t, "input_gate_t": input_gate_t, "recurrent_gate_t": recurrent_gate_t},
        {"recurrent_param": recurrent_param},
        token=True,
        same_dtype=("input_gate_t", "recurrent_gate_t"),
    )
    xp, constant = inputs.xp, _check_c(c)
    if reset is not None:
        reset = _check_reset(inputs, reset, tuple(x_t.shape), "reset")
    h = _state(inputs, state, channels)
    x, i_gate, r_gate, param = (
        inputs.to_work_dtype(a) for a in (x_t, input_gate_t, recurrent_gate_t, recurrent_param)
    )
    b, g = _rg_lru_gates(xp, x, i_gate, r_gate, param, constant, reset)
    h = scan_step(xp, b, g, h)
    return finish(inputs, h, None), h
