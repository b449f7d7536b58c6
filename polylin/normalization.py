"""RMSNorm, with the output gate of Gated DeltaNet, GLA, KDA and Mamba-2 blocks; the group
norm of RWKV-7's block."""

from __future__ import annotations

import math
from typing import Any

from ._backend.namespace import array_namespace
from ._inputs.arrays import broadcasts_to, namespace_of, work_dtype_for
from ._inputs.validation import check_flag, check_options
from ._typing import Array
from .activations import sigmoid, silu

__all__ = ["GATE_ACTIVATIONS", "group_norm", "rms_norm"]

#: The gate activations of :func:`rms_norm` (``"swish"`` is ``"silu"``).
GATE_ACTIVATIONS = ("silu", "swish", "sigmoid")


def rms_norm(
    x: Array,
    weight: Array | None = None,
    /,
    *,
    gate: Array | None = None,
    eps: float = 1e-5,
    activation: str = "silu",
    norm_before_gate: bool = True,
) -> Array:
    r"""RMSNorm over the last axis, optionally gated: ``x / rms(x) * weight * act(gate)``.

    ``rms(x) = sqrt(mean(x^2) + eps)`` over the last axis. With ``gate`` the result is
    multiplied by ``act(gate)`` after the norm (flash-linear-attention's ``FusedRMSNormGated``,
    the output norm of Gated DeltaNet, GLA and KDA), or, with ``norm_before_gate=False``,
    ``x * act(gate)`` is normalized (Mamba-2's ``RMSNormGated``). Half-precision inputs are
    normalized in float32 and cast back.

    Parameters
    ----------
    x : array
        ``(..., d)``. To normalize groups of channels separately (Mamba-2's ``n_groups``),
        reshape to ``(..., groups, d // groups)`` and the weight to ``(groups, d // groups)``.
    weight : array, optional
        Broadcastable to the shape of ``x`` (it may not enlarge it), usually ``(d,)``;
        ``None``: no scale.
    gate : array, optional
        The shape of ``x``.
    eps : float
        Added to the mean square; > 0 and finite.
    activation : {"silu", "swish", "sigmoid"}
        The gate's activation (``"swish"`` is ``"silu"``; KDA uses ``"sigmoid"``).
    norm_before_gate : bool
        ``True``: ``norm(x) * weight * act(gate)``; ``False``: ``norm(x * act(gate)) * weight``.

    Returns
    -------
    array
        The shape, library and dtype of ``x``.

    Raises
    ------
    TypeError
        Non-arrays, arrays of several libraries, non-floating or mismatched dtypes, an ``eps``
        that is not a real number, a ``norm_before_gate`` that is not a bool.
    ValueError
        ``eps`` not > 0 and finite, an unknown activation, a gate of another shape than ``x``,
        a weight that does not broadcast to the shape of ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import rms_norm
    >>> x = np.array([[3.0, -4.0]])                 # rms = sqrt((9 + 16) / 2)
    >>> rms_norm(x, eps=1e-12).round(4)
    array([[ 0.8485, -1.1314]])
    >>> gate = np.array([[0.0, 50.0]])               # silu(0) = 0, silu(50) = 50
    >>> rms_norm(x, np.array([1.0, 2.0]), gate=gate, eps=1e-12).round(4)
    array([[   0.    , -113.1371]])
    """
    arrays = {"x": x}
    if weight is not None:
        arrays["weight"] = weight
    if gate is not None:
        arrays["gate"] = gate
    xp = namespace_of(**arrays)
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    for name, value in arrays.items():
        if value.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but x has dtype {x.dtype}")
    if gate is not None and tuple(gate.shape) != tuple(x.shape):
        raise ValueError(
            f"gate must have the shape of x, {tuple(x.shape)}; got {tuple(gate.shape)}"
        )
    if weight is not None and not broadcasts_to(tuple(weight.shape), tuple(x.shape), 0):
        raise ValueError(
            f"weight must broadcast to the shape of x, {tuple(x.shape)}, usually (d,) = "
            f"{tuple(x.shape[-1:])}; got {tuple(weight.shape)}"
        )
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    eps = check_options(eps=eps).eps
    if not math.isfinite(eps):
        raise ValueError(f"eps must be > 0 and finite, got {eps}")
    check_flag("norm_before_gate", norm_before_gate)
    work = work_dtype_for(xp, x.dtype)

    def cast(a: Any) -> Any:
        return a if a.dtype == work else xp.astype(a, work)

    y = cast(x)
    act = sigmoid if activation == "sigmoid" else silu
    if gate is not None and not norm_before_gate:
        y = y * act(cast(gate))
    y = y / xp.sqrt(xp.mean(y * y, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * cast(weight)
    if gate is not None and norm_before_gate:
        y = y * act(cast(gate))
    return y if y.dtype == x.dtype else array_namespace(y).astype(y, x.dtype)


def group_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    /,
    *,
    num_groups: int,
    eps: float = 1e-5,
) -> Array:
    r"""Group norm over the last axis: each group of channels to mean 0 and variance 1.

    The last axis (``C`` channels) splits into ``num_groups`` consecutive groups of
    ``C // num_groups``; each is normalized by its own mean and (biased) variance,
    ``(x - mean) / sqrt(var + eps)``, then ``* weight + bias`` per channel. This is
    ``torch.nn.GroupNorm`` on ``(N, C)`` inputs (RWKV-7's output norm, one group per head).
    Half-precision inputs are normalized in float32 and cast back.

    Parameters
    ----------
    x : array
        ``(..., C)``.
    weight, bias : array, optional
        ``(C,)``, the dtype of ``x``; ``None``: no scale, no shift.
    num_groups : int
        Number of groups; must divide ``C``.
    eps : float
        Added to the variance; > 0 and finite.

    Returns
    -------
    array
        The shape, library and dtype of ``x``.

    Raises
    ------
    TypeError
        Non-arrays, arrays of several libraries, non-floating or mismatched dtypes, an ``eps``
        that is not a real number.
    ValueError
        ``num_groups`` not a positive divisor of ``C``, ``weight`` or ``bias`` not of shape
        ``(C,)``, ``eps`` not > 0 and finite.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import group_norm
    >>> x = np.array([[1.0, 3.0, 10.0, 30.0]])       # two groups of two channels
    >>> group_norm(x, num_groups=2, eps=1e-12).round(4)
    array([[-1.,  1., -1.,  1.]])
    >>> group_norm(x, np.array([1.0, 1.0, 2.0, 2.0]), np.zeros(4), num_groups=2, eps=1e-12)
    array([[-1.,  1., -2.,  2.]])
    """
    arrays = {"x": x}
    if weight is not None:
        arrays["weight"] = weight
    if bias is not None:
        arrays["bias"] = bias
    xp = namespace_of(**arrays)
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    for name, value in arrays.items():
        if value.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but x has dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError("x must have a channel axis (..., C), got a 0-D array")
    channels = x.shape[-1]
    if (
        isinstance(num_groups, bool)
        or not isinstance(num_groups, int)
        or num_groups < 1
        or channels % num_groups
    ):
        raise ValueError(
            f"num_groups must be a positive int dividing x's last axis ({channels}), got "
            f"{num_groups!r}"
        )
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and tuple(value.shape) != (channels,):
            raise ValueError(
                f"{name} must have shape (C,) = ({channels},), got {tuple(value.shape)}"
            )
    eps = check_options(eps=eps).eps
    if not math.isfinite(eps):
        raise ValueError(f"eps must be > 0 and finite, got {eps}")
    work = work_dtype_for(xp, x.dtype)

    def cast(a: Any) -> Any:
        return a if a.dtype == work else xp.astype(a, work)

    lead = tuple(x.shape[:-1])
    y = xp.reshape(cast(x), (*lead, num_groups, channels // num_groups))
    y = y - xp.mean(y, axis=-1, keepdims=True)
    y = y / xp.sqrt(xp.mean(y * y, axis=-1, keepdims=True) + eps)
    y = xp.reshape(y, (*lead, channels))
    if weight is not None:
        y = y * cast(weight)
    if bias is not None:
        y = y + cast(bias)
    return y if y.dtype == x.dtype else array_namespace(y).astype(y, x.dtype)
