"""What the entry points of the recurrences share (linear attention, the delta rule, the
generalized delta rule): per-token coefficients in the standard layout, log decays, and one run
over a plain batch, a padding mask or packed sequences.

An algorithm is a function ``algorithm(arrays, S, keep)`` of the per-token arrays (standard
layout), the state and the mask of real tokens (``(..., T, 1)`` booleans, or ``None``) that
returns ``(out, S)``. :func:`run_sequences` validates the state, builds ``keep`` from
``attention_mask`` or ``cu_seqlens`` (packing the sequences into a padded batch), selects every
per-token array to 0 at masked tokens (for these recurrences zero inputs and a zero log decay
leave the state exactly as it was), runs the algorithm, zeroes the masked outputs and restores
the caller's layout and dtype. An algorithm reads ``keep`` only where it makes values that are
not zero at zero inputs (linear attention's feature map: ``phi(0)`` is not 0).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, NamedTuple

from .._backend.compiled_step import CompiledStep, compiled_step
from .._backend.denormals import flushing_denormals
from .._backend.execution import check_static
from .._backend.fused import StepRows
from .._backend.namespace import is_array
from .._backend.ops import nonpositive
from .gates import check_log_decay, log_decay_values
from .layout import SequenceLayout
from .prepare import finish
from .steps import PER_CALL
from .validation import AttentionInputs, check_cu_seqlens, check_mask, check_matrix_state
from .varlen import length_mask, pack, unpack

__all__ = [
    "StepPlan",
    "check_scale",
    "log_decay_shape",
    "planned_compiled",
    "planned_decay",
    "run_compiled",
    "run_sequences",
    "shaped_log_decay",
    "step_decay",
    "step_state",
    "used_as_given",
]

#: ``algorithm(arrays, S, keep) -> (out, S)``: one form on validated arrays (module docstring).
Algorithm = Callable[[list[Any], Any, Any], tuple[Any, Any]]

#: ``check_state(initial_state, leading) -> S``: the state validated for the leading dimensions
#: ``leading`` (the batch's, and the number of sequences with ``cu_seqlens``).
StateCheck = Callable[[Any, tuple], Any]


def check_scale(scale: Any) -> float:
    """The output scale: a finite real number, static under ``jax.jit``; as a Python float."""
    check_static("scale", scale)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def shaped_log_decay(
    inputs: AttentionInputs,
    log_decay: Any,
    shape: tuple,
    *,
    channels: int | None = None,
    layout: SequenceLayout | None = None,
    clamp: bool = True,
) -> Any | None:
    """A log decay as an array of ``shape`` (last axis 1) in the work dtype, or ``None``.

    The policy of every entry point (:func:`polylin._inputs.gates.check_log_decay`): a number above
    0 is an error, array values above 0 are taken as 0. With ``channels`` (``d_k``) an array whose
    last axis has that size is one decay per key channel: the result then has ``channels`` as its
    last axis. ``shape`` is ``(..., T, 1)``, or ``(..., 1)`` for one decoding step. ``clamp``
    false leaves values above 0 to the form (see ``check_log_decay``).
    """
    length = None if len(shape) == len(inputs.batch_shape) + 1 else shape[-2]
    g = check_log_decay(
        inputs,
        log_decay,
        length=length,
        d_phi=1 if channels is None else channels,
        layout=layout,
        channels=None if channels is None else "d_k",
        clamp=clamp,
    )
    return None if g is None else _explicit_channels(inputs, g, shape)


def _explicit_channels(inputs: AttentionInputs, g: Any, shape: tuple) -> Any:
    shape = (*shape[:-1], g.shape[-1])
    return g if tuple(g.shape) == shape else inputs.xp.broadcast_to(g, shape)


class StepPlan(NamedTuple):
    """What the checks of a matrix-state decoding step found, for one signature of its
    arguments (see ``_inputs.steps``): the per-call arguments that are numbers are converted
    once."""

    inputs: AttentionInputs
    scale: float
    state_shape: tuple  # (..., d_k, d_v)
    decay: Any  # exp(log_decay) of a number log_decay, None, or PER_CALL for an array
    coefficients: tuple  # per coefficient: its array for a number, None for an array
    qk_l2norm: bool = False
    #: Every per-call array is used as given: it is in the work dtype and has the shape its
    #: conversion gives (no cast, reshape or broadcast), as in a model's decoding loop.
    as_given: bool = False
    #: PyTorch, arrays as given with the state's leading dimensions or broadcasting against
    #: them: what ``_backend.fused.fused_delta_step(rows=)`` needs, found once; else ``None``.
    fused_rows: StepRows | None = None
    #: NumPy arrays or PyTorch CPU tensors as given, the kernels installed: the step on a
    #: compiled kernel for this signature (``_backend.compiled_step``); else ``None``.
    compiled: Any = None


def used_as_given(inputs: AttentionInputs, *arrays: tuple[Any, tuple | None]) -> bool:
    """:attr:`StepPlan.as_given` for checked ``(argument, converted shape)`` pairs (``None``
    for a shape that a conversion changes); arguments that are not arrays are converted once,
    in the plan, and do not count. A log decay may have another floating dtype than ``q``:
    each array's own dtype must be the work dtype."""
    work = inputs.work_dtype
    return inputs.dtype == work and all(
        shape is not None and x.dtype == work and tuple(x.shape) == shape
        for x, shape in arrays
        if is_array(x)
    )


def log_decay_shape(log_decay: Any, per_token: tuple) -> tuple | None:
    """The shape that :func:`step_decay` gives a checked ``log_decay`` of one step
    (``per_token``: the shape of a per-token gate, ``(..., 1)``) if it is an array that needs
    no reshape; else ``None``."""
    if not is_array(log_decay) or log_decay.ndim == 0:
        return None
    return (*per_token[:-1], log_decay.shape[-1])


def planned_decay(inputs: AttentionInputs, log_decay: Any, g: Any | None) -> Any:
    """:attr:`StepPlan.decay` for a checked ``log_decay`` and its checked array ``g``."""
    if is_array(log_decay):
        return PER_CALL
    return None if g is None else inputs.xp.exp(g)


def step_decay(plan: StepPlan, log_decay: Any) -> Any | None:
    """The decay factor ``exp(g_t)`` of one step (``None``: no decay) of a checked
    ``log_decay``."""
    if plan.decay is not PER_CALL:
        return plan.decay
    inputs = plan.inputs
    if plan.as_given:
        return inputs.xp.exp(nonpositive(inputs.xp, log_decay))
    per_token = (*plan.state_shape[:-2], 1)
    g = _explicit_channels(inputs, log_decay_values(inputs, log_decay, explicit=1), per_token)
    return inputs.xp.exp(g)


def planned_compiled(
    name: str, tokens: list[Any], log_decay: Any, decay: Any, state: Any, state_shape: tuple,
    *, as_given: bool, **options: Any,
) -> CompiledStep | None:
    """:attr:`StepPlan.compiled` for a step of kernel ``name`` whose checked arguments are
    used as given, with a state of the plan's shape: ``tokens`` the kernel's per-token arrays
    (the plan's arrays for numbers), ``decay`` the plan's (:func:`planned_decay`)."""
    if not as_given or state is None or tuple(state.shape) != state_shape:
        return None
    per_call = decay is PER_CALL
    given = log_decay if per_call else decay
    return compiled_step(name, tokens, given, state, log=per_call, **options)


def run_compiled(plan: StepPlan, tokens: list[Any], log_decay: Any, state: Any) -> Any:
    """The plan's compiled step on this call's arrays, or ``None`` where it has none or the
    call cannot run on it (:class:`~polylin._backend.compiled_step.CompiledStep`)."""
    if plan.compiled is None:
        return None
    return plan.compiled(tokens, log_decay if plan.decay is PER_CALL else plan.decay, state)


def step_state(plan: StepPlan, state: Any) -> Any:
    """The checked state (broadcast to the plan's shape, a view, where its leading dimensions
    are shared), or zeros of the plan's shape for ``None``."""
    if state is not None:
        if tuple(state.shape) == plan.state_shape:
            return state
        return plan.inputs.xp.broadcast_to(state, plan.state_shape)
    inputs = plan.inputs
    return inputs.xp.zeros(plan.state_shape, dtype=inputs.work_dtype, device=inputs.device)


def run_sequences(
    inputs: AttentionInputs,
    layout: SequenceLayout,
    arrays: list[Any],
    algorithm: Algorithm,
    *,
    length: int,
    state_shape: tuple | None = None,
    check_state: StateCheck | None = None,
    initial_state: Any,
    attention_mask: Any,
    cu_seqlens: Sequence[int] | None,
    return_state: bool,
) -> Any:
    """Validate the state and the mask or offsets, run, and return ``out`` or ``(out, S)``.

    ``arrays`` are ``(..., T, d)`` in the standard layout, or ``(..., 1, d)`` for one value
    shared by every token (a number ``log_decay``). The state is a matrix of ``state_shape``
    after the leading dimensions (``(d_k, d_v)``), or what ``check_state`` makes of
    ``initial_state`` (a :class:`~polylin.LinearAttentionState`). With ``cu_seqlens`` the
    sequences are packed into a padded batch (one state per sequence, leading ``(..., N)``).
    """
    xp, batch = inputs.xp, inputs.batch_shape
    if check_state is None:

        def check_state(initial_state: Any, leading: tuple) -> Any:
            shape = (*leading, *(state_shape or ()))
            return check_matrix_state(inputs, initial_state, shape, name="initial_state")

    keep = None
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass attention_mask or cu_seqlens, not both")
        offsets = check_cu_seqlens(cu_seqlens, length)
        max_len = max(b - a for a, b in pairwise(offsets))
        S = check_state(initial_state, (*batch, len(offsets) - 1))
        keep = length_mask(xp, offsets, max_len, inputs.device)[..., None]
        arrays = [
            pack(xp, x, offsets, max_len) if x.shape[-2] == length else x[..., None, :, :]
            for x in arrays
        ]
    else:
        S = check_state(initial_state, batch)
        if attention_mask is not None:
            mask = check_mask(inputs, attention_mask, length, layout)
            keep = mask if xp.isdtype(mask.dtype, "bool") else mask != 0
    if keep is not None:
        # Selection, not multiplication: padding may hold NaN, and its inputs are never read.
        # A value shared by every token becomes the masked tokens' 0 and the others' value.
        arrays = [xp.where(keep, x, 0.0) for x in arrays]
    with flushing_denormals(arrays[0]):  # a strong decay's subnormal factors, at full speed
        out, S = algorithm(arrays, S, keep)
    if keep is not None:
        out = xp.where(keep, out, 0.0)
    if cu_seqlens is not None:
        out = unpack(xp, out, offsets)
    if length == 0 and initial_state is not None:  # never hand back the caller's own arrays
        S = _copied(xp, S)
    out = layout.restore(finish(inputs, out, None))
    return (out, S) if return_state else out


def _copied(xp: Any, S: Any) -> Any:
    """A copy of a state: an array, or a tuple of arrays (a ``LinearAttentionState``)."""
    if isinstance(S, tuple):
        return type(S)(*(xp.asarray(part, copy=True) for part in S))
    return xp.asarray(S, copy=True)
