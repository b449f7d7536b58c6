"""Input validation: the one place that checks what callers pass in.

It resolves the array namespace, device and dtype policy of ``q, k, v`` into an
:class:`AttentionInputs` record, and checks masks, states, packed-sequence offsets and scalar
options against it. Every check raises a ``TypeError`` or ``ValueError`` naming the argument.
Everything after it receives ``xp`` (an array-API namespace) and arrays known to be consistent.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any, NamedTuple

from .._backend.execution import check_static
from .._backend.namespace import device as device_of
from .._backend.namespace import is_array

if TYPE_CHECKING:
    from .layout import SequenceLayout
from .arrays import (
    broadcast_shapes,
    broadcasts_to,
    check_beside,
    check_device,
    check_floating,
    check_known_shape,
    is_real_number,
    namespace_of,
    other_device,
    work_dtype_for,
)

__all__ = [
    "MASK_CONVERSION",
    "NOT_GIVEN",
    "AttentionInputs",
    "Options",
    "check_coefficient",
    "check_cu_seqlens",
    "check_flag",
    "check_mask",
    "check_matrix_state",
    "check_method",
    "check_options",
    "check_qkv",
    "check_state",
    "check_token_mask",
    "coefficient_values",
    "shown_shape",
]


class AttentionInputs(NamedTuple):
    """What the entry points need to know about validated ``q, k, v``."""

    xp: Any
    device: Any
    dtype: Any  # the inputs' dtype, which the output gets back
    work_dtype: Any  # the dtype the algorithms accumulate in (float32 for half inputs)
    batch_shape: tuple  # the broadcast shape of the leading dimensions of q, k and v

    def to_work_dtype(self, x: Any) -> Any:
        """Cast ``x`` to the accumulation dtype (a no-op for float32 and float64)."""
        return x if x.dtype == self.work_dtype else self.xp.astype(x, self.work_dtype)


def check_qkv(
    q: Any, k: Any, v: Any, *, causal: bool, single_token: bool = False
) -> AttentionInputs:
    """Validate ``q``, ``k``, ``v`` and resolve namespace, device and dtypes.

    ``q`` and ``k`` are ``(..., T, d_k)``, ``v`` is ``(..., T, d_v)``; their leading dimensions
    broadcast against each other (grouped heads: ``q, k`` of ``(B, H, 1, T, d_k)`` against ``v``
    of ``(B, H, G, T, d_v)``) and ``batch_shape`` is the broadcast shape. When ``causal`` the
    query length must equal the key length. With ``single_token`` there is no T axis (one
    decoding step): ``(..., d_k)`` and ``(..., d_v)``.
    """
    qn, kn, vn = names = ("q_t", "k_t", "v_t") if single_token else ("q", "k", "v")
    xp = namespace_of(**{qn: q, kn: k, vn: v})
    device = device_of(q)
    check_device(xp, device, qn, **{kn: k, vn: v})
    core, layout = (1, "(..., d)") if single_token else (2, "(..., T, d)")
    for name, x in zip(names, (q, k, v)):
        check_floating(xp, name, x)
        check_known_shape(name, x)
        if x.ndim < core:
            raise ValueError(
                f"{name} must have at least {core} dimensions {layout}, got shape {tuple(x.shape)}"
            )
    for name, x in ((kn, k), (vn, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {qn} has dtype {q.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{kn} has feature size d_k={k.shape[-1]} but {qn} has d_k={q.shape[-1]}; "
            "they must match"
        )
    if not single_token:
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"v has sequence length {v.shape[-2]} but k has {k.shape[-2]}; they must match"
            )
        if causal and q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"q has sequence length {q.shape[-2]} but k has {k.shape[-2]}; causal attention "
                "needs equal lengths (use linear_attention for cross-attention)"
            )
    leading = {name: tuple(x.shape[:-core]) for name, x in zip(names, (q, k, v))}
    batch_shape = broadcast_shapes(leading)
    return AttentionInputs(xp, device, q.dtype, work_dtype_for(xp, q.dtype), batch_shape)


class Options(NamedTuple):
    """Scalar options after validation, as plain Python numbers."""

    eps: float
    chunk_size: int | None


#: ``check_options``'s marker for "this entry point has no chunk_size".
NOT_GIVEN: Any = object()


def check_flag(name: str, value: Any) -> None:
    """A boolean option must be a Python bool: an array, a string or ``None`` would be truthy or
    falsy by accident, and a JAX tracer (the option passed as an argument of a jitted function)
    has no truth value until the function runs."""
    check_static(name, value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


def check_options(
    *, eps: Any, chunk_size: Any = NOT_GIVEN, inputs: AttentionInputs | None = None
) -> Options:
    """Validate the scalar options shared by the entry points and return them as Python numbers.

    ``eps`` is any real number (``numbers.Real``: Python and NumPy scalars), > 0 and finite;
    given ``inputs`` it must also stay positive and finite in their work dtype (the dtype the
    normalizer is computed in): ``smallest_normal <= eps <= max`` of that dtype. ``chunk_size``
    is any integer (``numbers.Integral``) >= 1, never a bool or ``None``; entry points without
    one leave it out. A JAX tracer for either is an error saying it must be static.
    """
    check_static("eps", eps)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a positive real number, got {type(eps).__name__}")
    eps = float(eps)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if inputs is not None:
        info = inputs.xp.finfo(inputs.work_dtype)
        tiny, huge = float(info.smallest_normal), float(info.max)
        if not tiny <= eps <= huge:
            raise ValueError(
                f"eps must be > 0 and finite in {inputs.work_dtype}, the dtype the normalizer "
                f"is computed in (between {tiny:.6g} and {huge:.6g}), got {eps!r}"
            )
    if chunk_size is NOT_GIVEN:
        return Options(eps, None)
    check_static("chunk_size", chunk_size)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return Options(eps, int(chunk_size))


def check_method(method: Any, methods: Sequence[str]) -> str:
    """Validate a ``method`` name against the allowed ones."""
    check_static("method", method)
    if not isinstance(method, str) or method not in methods:
        raise ValueError(f"method must be one of {tuple(methods)}, got {method!r}")
    return method


def _check_boolean_array(
    inputs: AttentionInputs, mask: Any, name: str, query: str, true_means: str
) -> None:
    """A mask is a boolean array of the inputs' library and device (``query`` names the input
    it is compared with in messages; ``true_means`` says what True selects).

    The rule is the dtype's alone: boolean is accepted, any other dtype is a ``TypeError``
    whose message says how to convert the mask. Values are never read: that would need the
    data, which Dask and JAX under ``jit`` do not have yet, and would wait for the device on
    CuPy or CUDA. So a 0/1 integer mask (a tokenizer's) is refused as well, with the one
    conversion it needs, and an additive float mask (0 to keep, -inf to drop, as many
    attention codes take it) can never be read as anything: converting it by ``!= 0`` would
    invert it.
    """
    check_beside(inputs.xp, inputs.device, name, mask, query=query)
    if not inputs.xp.isdtype(mask.dtype, "bool"):
        raise TypeError(
            f"{name} must be boolean (True for {true_means}), got {mask.dtype}: "
            f"{MASK_CONVERSION.format(name=name)}"
        )


#: How to turn another convention's mask into polylin's: the tail of every mask dtype error.
MASK_CONVERSION = (
    "polylin's masks are boolean, True = real token (a mask selects, it is never added); "
    "convert a 0/1 mask with {name}=(mask != 0) and an additive mask (0 for real tokens, "
    "-inf for padding) with {name}=(mask == 0)"
)


def check_mask(
    inputs: AttentionInputs,
    attention_mask: Any,
    length: int,
    layout: SequenceLayout | None = None,
    *,
    name: str = "attention_mask",
) -> Any:
    """Validate a boolean mask and return it as ``(..., T, 1)`` in the standard layout.

    The rule: a 2-D mask ``(batch, T)`` (what a tokenizer returns) always means the first
    leading axis and the time axis, whatever the layout and number of head axes; any other mask
    has the full rank of ``q`` without its feature axis, in the inputs' layout (time axis at
    ``seq_axis``), with size-1 axes broadcasting. A 1-D ``(T,)`` mask is the full-rank case of
    ``(T, d)`` inputs. Anything else is a ``ValueError`` showing the expected shapes.
    ``layout`` describes the inputs' original layout (``None``: the standard ``(..., T, d)``).
    """
    xp = inputs.xp
    _check_boolean_array(inputs, attention_mask, name, "q", "real tokens")
    check_known_shape(name, attention_mask)
    batch = inputs.batch_shape
    n_lead = len(batch)
    axis = n_lead if layout is None else layout.axis
    # The inputs' shape without the feature axis, in the caller's layout.
    full = (*batch[:axis], length, *batch[axis:])
    shape = tuple(attention_mask.shape)

    def fits(got: tuple, want: tuple, time: int) -> bool:
        return len(got) == len(want) and all(
            g == w if i == time else g in (1, w) for i, (g, w) in enumerate(zip(got, want))
        )

    if n_lead >= 1 and len(shape) == 2:
        if fits(shape, (batch[0], length), 1):
            return xp.reshape(attention_mask, (shape[0], *([1] * (n_lead - 1)), length, 1))
    elif fits(shape, full, axis):
        if axis != n_lead:
            order = (*(i for i in range(n_lead + 1) if i != axis), axis)
            attention_mask = xp.permute_dims(attention_mask, order)
        return attention_mask[..., None]
    if n_lead == 0:
        expected = f"(T,) = {full}"
    elif n_lead == 1 and axis == 1:
        expected = f"(batch, T) = {full} (size-1 axes broadcast)"
    elif n_lead == 1:  # (T, batch, d) inputs: the full-rank mask would be 2-D, read (batch, T)
        expected = (
            f"(batch, T) = {(batch[0], length)} (size-1 axes broadcast): a 2-D mask always "
            "means (batch, T), whatever seq_axis (transpose a (T, batch) mask)"
        )
    else:
        expected = (
            f"(batch, T) = {(batch[0], length)} or the shape of the inputs without their "
            f"feature axis, {full} (size-1 axes broadcast)"
        )
    raise ValueError(f"{name} must have shape {expected}; got {shape}")


def check_token_mask(inputs: AttentionInputs, attention_mask: Any, *, token: str = "q_t") -> Any:
    """Validate the boolean mask of one decoding step; return it as ``(..., 1)``.

    It has the batch shape of the token (``token``: its argument's name; size-1 axes
    broadcast), or is 1-D ``(batch,)`` for the first leading axis, as a 2-D ``(batch, T)``
    mask is for whole sequences.
    """
    xp = inputs.xp
    name = "attention_mask"
    _check_boolean_array(inputs, attention_mask, name, token, "rows that take this token")
    batch = inputs.batch_shape
    shape = tuple(attention_mask.shape)
    if len(batch) >= 1 and len(shape) == 1 and shape[0] in (1, batch[0]):
        return xp.reshape(attention_mask, (shape[0], *([1] * (len(batch) - 1)), 1))
    if len(shape) == len(batch) and all(m in (1, b) for m, b in zip(shape, batch)):
        return attention_mask[..., None]
    raise ValueError(
        f"{name} of a decoding step must have the batch shape of {token}, {batch} (size-1 axes "
        f"broadcast), or be 1-D (batch,) = {batch[:1]}; got {shape}"
    )


def check_state(
    inputs: AttentionInputs,
    state: Any,
    batch_shape: tuple,
    d_phi: int,
    d_v: int,
    *,
    name: str,
    token_shape: tuple | None = None,
) -> tuple[Any, Any]:
    """Return ``(S, z)`` in the work dtype: zeros for ``None``, else the checked state.

    A given state must be in the work dtype already (float32 for 16-bit inputs, else the
    inputs' dtype): a silent cast would lose precision one way, or change the results of a
    higher-precision computation the other. Its leading dimensions broadcast to
    ``batch_shape`` (a state shared by a batch, or by grouped heads): it is returned broadcast,
    a view. Shape errors say what most likely went wrong: a
    decoding token that still has its length-1 T axis (``token_shape``: the shape of ``q_t`` in a
    decoding step), or a state built with another feature map.
    """
    xp = inputs.xp
    if state is None:
        S = xp.zeros((*batch_shape, d_phi, d_v), dtype=inputs.work_dtype, device=inputs.device)
        z = xp.zeros((*batch_shape, d_phi), dtype=inputs.work_dtype, device=inputs.device)
        return S, z
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{name} must be a LinearAttentionState (S, z), got {type(state).__name__}")
    S, z = state
    if namespace_of(**{f"{name}.S": S, f"{name}.z": z}) is not xp:
        raise TypeError(f"{name} must hold arrays of the same library as q")
    for part, x in (("S", S), ("z", z)):
        check_known_shape(f"{name}.{part}", x)
        if other_device(inputs.device, x):
            raise ValueError(
                f"{name}.{part} is on device {device_of(x)} but q is on device {inputs.device}"
            )
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{name}.{part} must have a real floating dtype, got {x.dtype}")
        if x.dtype != inputs.work_dtype:
            raise TypeError(
                f"{name}.{part} has dtype {x.dtype} but inputs of dtype {inputs.dtype} are "
                f"computed in {inputs.work_dtype}; pass a state of that dtype (the state "
                "polylin returns for these inputs is)"
            )
    S_shape, z_shape = tuple(S.shape), tuple(z.shape)
    want = (*batch_shape, d_phi, d_v)
    fits = broadcasts_to
    if not (fits(S_shape, want, 2) and fits(z_shape, (*batch_shape, d_phi), 1)):
        if (
            token_shape is not None
            and token_shape[-2:-1] == (1,)
            and S_shape[:-2] == tuple(token_shape[:-2])
        ):
            raise _token_with_time_axis(token_shape, S_shape)
        if S_shape[:-2] == batch_shape and len(S_shape) == len(want) and S_shape[-1] == d_v:
            if S_shape[-2] != d_phi:
                raise ValueError(
                    f"{name} was built with a feature map of {S_shape[-2]} features, but "
                    f"feature_map gives {d_phi} for these inputs; pass the same feature_map "
                    "that built the state"
                )
        parts = (("S", S_shape, want, 2), ("z", z_shape, (*batch_shape, d_phi), 1))
        for part, got, expected, core in parts:
            if not fits(got, expected, core):
                raise ValueError(
                    f"{name}.{part} must have shape {expected} (leading axes of size 1 "
                    f"broadcast), got {got}"
                )
    if S_shape != want:
        S = xp.broadcast_to(S, want)
    if z_shape != want[:-1]:
        z = xp.broadcast_to(z, want[:-1])
    return S, z


def _token_with_time_axis(token_shape: tuple, state_shape: tuple) -> ValueError:
    """The error for a decoding token that still has its length-1 T axis."""
    return ValueError(
        f"q_t must have shape (..., d) for one token (no T axis), got {token_shape} "
        f"for a state with leading dimensions {state_shape[:-2]}: drop the length-1 T axis "
        "(q_t[..., 0, :], and the same for k_t and v_t)"
    )


def check_matrix_state(
    inputs: AttentionInputs,
    state: Any,
    shape: tuple,
    *,
    name: str,
    token_shape: tuple | None = None,
) -> Any:
    """Return a state that is one array ``S`` (the delta rule's) in the work dtype.

    ``None`` gives zeros of ``shape``; anything else must be an array of the library and device
    of ``q``, in the work dtype (float32 for 16-bit inputs), whose leading dimensions broadcast
    to those of ``shape`` (a state shared by a batch, or by grouped heads): it is returned
    broadcast, a view. ``token_shape`` (the shape of ``q_t`` in a decoding step) lets a shape
    error say that the token still has its length-1 T axis, as :func:`check_state` does.
    """
    xp = inputs.xp
    if state is None:
        return xp.zeros(shape, dtype=inputs.work_dtype, device=inputs.device)
    if isinstance(state, tuple):
        raise TypeError(
            f"{name} must be one array S of shape {shape}, got a {type(state).__name__} "
            "(a tuple such as LinearAttentionState belongs to causal_linear_attention)"
        )
    check_beside(xp, inputs.device, name, state)
    check_floating(xp, name, state)
    if state.dtype != inputs.work_dtype:
        # A silent cast would lose precision one way or change a higher-precision run the other.
        raise TypeError(
            f"{name} has dtype {state.dtype} but inputs of dtype {inputs.dtype} are computed in "
            f"{inputs.work_dtype}; pass a state of that dtype (the one polylin returns)"
        )
    check_known_shape(name, state)
    got = tuple(state.shape)
    if got == shape:
        return state
    if token_shape is not None and token_shape[-2:-1] == (1,) and got[:-2] == token_shape[:-2]:
        raise _token_with_time_axis(token_shape, got)
    if not broadcasts_to(got, shape, 2):
        raise ValueError(
            f"{name} must have shape {shape} (leading axes of size 1 broadcast), got {got}"
        )
    return xp.broadcast_to(state, shape)


def check_coefficient(
    inputs: AttentionInputs,
    x: Any,
    shape: tuple,
    *,
    name: str,
    bounds: tuple[float, float],
    per: str = "token",
    layout: SequenceLayout | None = None,
) -> Any:
    """A per-token scalar (a learning rate) as an array of ``shape`` (work dtype).

    ``x`` is a real number (Python or NumPy scalar), which must lie in ``bounds`` (inclusive),
    or an array of the library, device and dtype of ``q`` that broadcasts to ``shape`` (whose
    last axis is 1, or the number of key channels for a coefficient ``per="key channel"``).
    Array values are used as given: checking them would read data (lazy and accelerator
    backends). ``layout`` is the caller's: shapes in messages are shown in it.
    """
    xp = inputs.xp
    if is_real_number(x):
        low, high = bounds
        value = float(x)
        if not (math.isfinite(value) and low <= value <= high):  # also refuses nan and inf
            raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {x}")
        return xp.full(shape, value, dtype=inputs.work_dtype, device=inputs.device)
    if not is_array(x):
        raise TypeError(f"{name} must be a float or an array, got {type(x).__name__}")
    check_beside(xp, inputs.device, name, x)
    if x.dtype != inputs.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {inputs.dtype}")
    check_known_shape(name, x)
    got = tuple(x.shape)
    if len(got) > len(shape) or not all(
        m in (1, f) for m, f in zip(reversed(got), reversed(shape))
    ):
        raise ValueError(
            f"{name} must broadcast to {shown_shape(layout, shape)} (one value per {per}: last "
            f"axis {shape[-1]}), got {shown_shape(layout, got)}"
        )
    return coefficient_values(inputs, x, shape)


def shown_shape(layout: SequenceLayout | None, shape: tuple) -> tuple:
    """``shape``, a shape in the standard layout, as the caller sees it: in ``layout`` (the
    caller's ``SequenceLayout``; ``None``: the standard layout), for error messages."""
    return tuple(shape) if layout is None else layout.caller_shape(tuple(shape))


def coefficient_values(inputs: AttentionInputs, x: Any, shape: tuple) -> Any:
    """A checked coefficient array (see :func:`check_coefficient`) broadcast to ``shape`` in the
    work dtype: a view where no cast is needed."""
    x = inputs.to_work_dtype(x)
    return x if tuple(x.shape) == shape else inputs.xp.broadcast_to(x, shape)


def check_cu_seqlens(cu_seqlens: Sequence[int], total: int) -> list[int]:
    """Validate offsets ``[0, l1, l1 + l2, ..., total]`` and return them as a list of ints."""
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise TypeError(
            "cu_seqlens must be a sequence of ints [0, l1, l1+l2, ...], "
            f"got {type(cu_seqlens).__name__}"
        )
    offsets = list(cu_seqlens)
    # Integers of any kind (NumPy's, from np.cumsum) are host values: taken as Python ints.
    if not all(isinstance(o, numbers.Integral) and not isinstance(o, bool) for o in offsets):
        raise TypeError(
            "cu_seqlens must contain integers only (Python or NumPy ints, not arrays or floats)"
        )
    offsets = [int(o) for o in offsets]
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the sequence length {total}, got {offsets}"
        )
    if any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return offsets
