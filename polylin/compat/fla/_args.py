"""fla's argument conventions translated to polylin's (below :mod:`polylin.compat.fla`).

fla takes ``(B, T, H, d)`` inputs with ``HV`` value heads (a multiple of the ``H`` query/key
heads, each query/key head serving ``HV // H`` consecutive value heads), states
``(N, HV, d_k, d_v)`` and packed sequences as an integer array of offsets with ``B == 1``.
polylin takes any leading dimensions and broadcasts them: queries and keys become
``(B, T, H, 1, d)``, values and gates ``(B, T, H, G, .)`` (reshapes, never copies), and with
``cu_seqlens`` the batch axis of size 1 is dropped and polylin's state holds the sequences on
its own axis, ``(H, G, N, d_k, d_v)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...interop import array_namespace, check_floating, is_array, is_real_number, work_dtype_for

__all__ = [
    "FlaHeads",
    "check_inputs",
    "common_dtype",
    "default_scale",
    "describe",
    "in_common_dtype",
    "offsets_of",
    "pop_chunk_size",
    "reject",
    "reject_head_first",
    "state_v_first_alias",
    "warn_head_first",
]

#: fla's own error for the removed ``head_first`` argument (raised, as fla raises it).
HEAD_FIRST_MESSAGE = "head_first has been removed. Inputs must be in `[B, T, H, ...]` format."


def reject_head_first(kwargs: dict[str, Any]) -> None:
    """fla raises ``DeprecationWarning`` for any ``head_first`` argument: so do we."""
    if "head_first" in kwargs:
        raise DeprecationWarning(HEAD_FIRST_MESSAGE)


def check_inputs(op: str, **arrays: Any) -> None:
    """Check a twin's array arguments, by fla's names, before anything is computed.

    Each array (each part of a tuple ``initial_state``) must have a real floating dtype: the
    check and message of polylin's core functions, a ``TypeError`` naming the argument. fla's
    kernels compute in floating point; an integer array would otherwise be promoted beside
    floating ones and, as the first argument, give the output its integer dtype (truncated).
    Numbers (a ``scale``) and ``None`` pass. The first argument (``q``, RWKV-7's ``r``) is
    then checked for the head-first layout (:func:`warn_head_first`).
    """
    for name, x in arrays.items():
        parts = enumerate(x) if isinstance(x, tuple) else ((None, x),)
        for i, part in parts:
            if is_array(part) and not is_real_number(part):
                check_floating(array_namespace(part), name if i is None else f"{name}[{i}]", part)
    first, x = next(iter(arrays.items()))
    warn_head_first(op, first, x)


def warn_head_first(op: str, name: str, x: Any) -> None:
    """Warn (a ``UserWarning``) when ``x``, read as fla's ``(B, T, H, K)``, has ``1 < T < H``.

    fla's ops take ``(B, T, H, K)``; a head-first ``(B, H, T, K)`` array has that shape and
    gives a wrong answer without an error. fla warned on the same test (``T < H``); one-token
    calls (``T == 1``, a decoding step) are exempt, whatever their number of heads.
    """
    if not is_array(x) or x.ndim != 4:
        return
    T, H = x.shape[1], x.shape[2]
    if isinstance(T, int) and isinstance(H, int) and 1 < T < H:
        warnings.warn(
            f"polylin.compat.fla.{op}: {name} of shape {tuple(x.shape)} reads as fla's "
            f"(B, T, H, K) with T={T} tokens < H={H} heads: this looks like a head-first "
            "(B, H, T, K) input, which fla's ops do not take (computed as given, it gives a "
            "wrong answer). Pass every input as (B, T, H, ...): x.transpose(1, 2) in PyTorch, "
            "xp.permute_dims(x, (0, 2, 1, 3)) in any array-API library. A sequence that is "
            "truly shorter than its number of heads is computed right as it is.",
            UserWarning,
            stacklevel=4,
        )


def describe(x: Any) -> str:
    """A value as an error message shows it: an array by its shape, anything else by repr."""
    if is_array(x) and not is_real_number(x):
        return f"an array of shape {tuple(x.shape)}"
    return repr(x)


def state_v_first_alias(kwargs: dict[str, Any], state_v_first: bool) -> bool:
    """fla's deprecated ``transpose_state_layout`` spelling of ``state_v_first``."""
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    if state_v_first:
        raise ValueError(
            "Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`."
        )
    warnings.warn(
        "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
        DeprecationWarning,
        stacklevel=3,
    )
    return bool(kwargs.pop("transpose_state_layout"))


def pop_chunk_size(
    op: str, kwargs: dict[str, Any], allowed: tuple[int, ...] | None, default: int = 64
) -> int:
    """fla's ``chunk_size`` keyword (``default`` when absent), checked as fla checks it.

    ``allowed=None``: any power of 2.
    """
    chunk_size = kwargs.pop("chunk_size", None)
    if chunk_size is None:
        return default
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` of {op} must be a positive int, got {chunk_size!r}.")
    if allowed is None:
        if chunk_size & (chunk_size - 1):
            raise ValueError(f"`chunk_size` must be a power of 2, got {chunk_size}.")
    elif chunk_size not in allowed:
        raise ValueError(f"`chunk_size` of {op} must be one of {allowed}, got {chunk_size}.")
    return chunk_size


def reject(op: str, kwargs: dict[str, Any] | None = None, **given: tuple[Any, Any]) -> None:
    """Raise ``NotImplementedError`` naming every argument polylin does not support.

    ``given`` maps an argument's name to ``(value, default)``: an argument left at its default
    is accepted. Every name left in ``kwargs`` (fla's ``**kwargs``) is unsupported.
    """
    names = [name for name, (value, default) in given.items() if not _is_default(value, default)]
    names += [name for name, value in (kwargs or {}).items() if not _is_default(value, None)]
    if names:
        listed = ", ".join(f"`{name}`" for name in names)
        raise NotImplementedError(
            f"polylin.compat.fla.{op} does not support {listed} (polylin computes the plain "
            "op; pass the precomputed inputs instead, or leave these at their defaults)"
        )


def _is_default(value: Any, default: Any) -> bool:
    if default is None or isinstance(default, bool):
        return value is default or (default is False and value is None)
    return bool(value == default)


def offsets_of(cu_seqlens: Any, cu_seqlens_cpu: Any = None) -> list[int] | None:
    """fla's ``cu_seqlens`` (an integer array or a sequence) as Python ints, read once.

    ``cu_seqlens_cpu``, fla's host copy, is read instead when given (no device round trip).
    """
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    if source is None:
        return None
    if is_array(source):
        xp = array_namespace(source)
        if source.ndim != 1 or not xp.isdtype(source.dtype, "integral"):
            raise TypeError(
                "cu_seqlens must be a 1-D integer array of offsets [0, l1, l1+l2, ...], got "
                f"shape {tuple(source.shape)} and dtype {source.dtype}"
            )
        to_list = getattr(source, "tolist", None)
        # One transfer for the libraries that have one; the standard's element access otherwise.
        values = to_list() if callable(to_list) else [source[i] for i in range(source.shape[0])]
        return [int(value) for value in values]
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return list(source)  # polylin's own check names wrong elements
    raise TypeError(
        f"cu_seqlens must be an integer array or a sequence, got {type(source).__name__}"
    )


def default_scale(scale: float | None, d_k: int) -> float:
    """fla's ``scale=None``: ``d_k ** -0.5``."""
    return d_k**-0.5 if scale is None else float(scale)


def common_dtype(xp: Any, *arrays: Any) -> Any:
    """The dtype every array is computed in: the widest of them (fla's gates are often float32
    beside bfloat16 inputs; polylin wants one dtype)."""
    return xp.result_type(*[x for x in arrays if is_array(x)])


def in_common_dtype(xp: Any, *arrays: Any) -> tuple[Any, list[Any]]:
    """The :func:`common_dtype` of ``arrays`` and the arrays cast to it (``None`` kept)."""
    dtype = common_dtype(xp, *arrays)
    return dtype, [xp.astype(x, dtype) if is_array(x) and x.dtype != dtype else x for x in arrays]


class FlaHeads(NamedTuple):
    """Reshapes between fla's layout and polylin's broadcast layout for one call."""

    xp: Any
    batch: int
    heads: int  # H, the query/key heads
    groups: int  # G = HV // H, the value heads per query/key head
    varlen: bool
    d_k: int  # K, the key channels
    d_v: int  # V, the value channels
    n_states: int  # N, the states: the batch, or the sequences of cu_seqlens

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, offsets: list[int] | None, initial_state: Any) -> FlaHeads:
        """Check fla's shape rules (fla's own messages) for ``q, k, v`` of fla's layout."""
        xp = array_namespace(q)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not is_array(x) or x.ndim != 4:
                shape = tuple(getattr(x, "shape", ()))
                raise ValueError(f"{name} must have shape [B, T, H, d] (fla's layout), got {shape}")
        B, _, H, _ = q.shape
        if k.shape[2] != H:
            raise ValueError(
                "q and k must have the same number of heads, "
                f"but got q.shape[2]={H} and k.shape[2]={k.shape[2]}"
            )
        HV = v.shape[2]
        if HV % H != 0:
            raise ValueError(
                f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by "
                f"num_heads (H={H}), but got HV % H = {HV % H}"
            )
        if offsets is not None:
            if B != 1:
                raise ValueError(
                    f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`. "
                    "Please flatten variable-length inputs before processing."
                )
            if is_array(initial_state) and initial_state.shape[0] != len(offsets) - 1:
                raise ValueError(
                    "The number of initial states is expected to be equal to the number of input "
                    f"sequences, i.e., {len(offsets) - 1} rather than {initial_state.shape[0]}."
                )
        n_states = B if offsets is None else len(offsets) - 1
        return cls(xp, B, H, HV // H, offsets is not None, k.shape[3], v.shape[3], n_states)

    @property
    def seq_axis(self) -> int:
        return 0 if self.varlen else 1

    def _lead(self, x: Any) -> Any:
        return x[0, ...] if self.varlen else x

    def query_key(self, x: Any) -> Any:
        """``(B, T, H, d)`` -> ``(B, T, H, 1, d)`` (``(T, H, 1, d)`` with ``cu_seqlens``)."""
        B, T, H, d = x.shape
        return self._lead(self.xp.reshape(x, (B, T, H, 1, d)))

    def per_key_head(self, x: Any, name: str) -> Any:
        """A per-key-channel input ``(B, T, H, K)`` (fla's ``a``, ``b``, ``gk``) -> the layout of
        :meth:`query_key`, shared by the ``HV // H`` value heads of each key head."""
        if not is_array(x):
            return x
        if x.ndim != 4 or x.shape[2] != self.heads or x.shape[3] != self.d_k:
            raise ValueError(
                f"{name} must have shape [B, T, H, K] with H = {self.heads} key heads and "
                f"K = {self.d_k} key channels, got {tuple(x.shape)}"
            )
        return self.query_key(x)

    def per_value_head(self, x: Any, name: str, *, channels: bool = False) -> Any:
        """``(B, T, HV, w)`` or ``(B, T, HV)`` (then ``w = 1``) -> ``(B, T, H, G, w)``. A gate
        (``channels``) has ``w`` 1 or K; ``beta`` 1; ``v`` any."""
        if not is_array(x):
            return x
        given = tuple(x.shape)
        if x.ndim == 3:
            x = self.xp.reshape(x, (*x.shape, 1))
        widths = (1, self.d_k) if channels else (1,) if name == "beta" else None
        HV = self.heads * self.groups
        if x.ndim != 4 or x.shape[2] != HV or (widths is not None and x.shape[3] not in widths):
            if channels:
                what = f"[B, T, HV] or [B, T, HV, K] with HV = {HV} value heads, K = {self.d_k}"
            elif name == "beta":
                what = f"[B, T, HV] with HV = {HV} value heads"
            else:
                what = f"[B, T, HV, d] with HV = {HV} value heads"
            raise ValueError(f"{name} must have shape {what}, got {given}")
        B, T, _, w = x.shape
        return self._lead(self.xp.reshape(x, (B, T, self.heads, self.groups, w)))

    def output(self, o: Any) -> Any:
        """polylin's ``(B, T, H, G, d_v)`` output -> fla's ``(B, T, HV, d_v)``."""
        if self.varlen:
            T, H, G, d_v = o.shape
            return self.xp.reshape(o, (1, T, H * G, d_v))
        B, T, H, G, d_v = o.shape
        return self.xp.reshape(o, (B, T, H * G, d_v))

    def state_in(self, state: Any, work_dtype: Any, *, v_first: bool = False) -> Any:
        """fla's ``(N, HV, d_k, d_v)`` state -> polylin's, in the work dtype (its shape checked
        in fla's terms: ``N`` is the batch, or the number of sequences of ``cu_seqlens``)."""
        if state is None:
            return None
        HV = self.heads * self.groups
        want = (self.n_states, HV, self.d_v, self.d_k) if v_first else (
            self.n_states, HV, self.d_k, self.d_v
        )  # fmt: skip
        if not is_array(state) or tuple(state.shape) != want:
            layout = "[N, HV, V, K] (state_v_first)" if v_first else "[N, HV, K, V]"
            got = tuple(state.shape) if is_array(state) else type(state).__name__
            raise ValueError(f"initial_state must have shape {layout} = {want}, got {got}")
        xp = self.xp
        if v_first:
            state = xp.matrix_transpose(state)
        if state.dtype != work_dtype:
            state = xp.astype(state, work_dtype)
        N, HV, d_k, d_v = state.shape
        state = xp.reshape(state, (N, self.heads, HV // self.heads, d_k, d_v))
        return xp.permute_dims(state, (1, 2, 0, 3, 4)) if self.varlen else state

    def state_out(self, state: Any, *, v_first: bool = False) -> Any:
        """polylin's final state -> fla's ``(N, HV, d_k, d_v)``."""
        xp = self.xp
        if self.varlen:
            state = xp.permute_dims(state, (2, 0, 1, 3, 4))
        N, H, G, d_k, d_v = state.shape
        state = xp.reshape(state, (N, H * G, d_k, d_v))
        return xp.matrix_transpose(state) if v_first else state

    def normalizer_in(self, z: Any, work_dtype: Any) -> Any:
        """fla's key sum ``(N, 1, H, d_k)`` -> polylin's ``z`` ``(B, H, 1, d_k)``."""
        want = (self.n_states, 1, self.heads, self.d_k)
        if not is_array(z) or tuple(z.shape) != want:
            got = tuple(z.shape) if is_array(z) else type(z).__name__
            raise ValueError(
                f"the key sum of initial_state (its second part) must have shape [N, 1, H, K] = "
                f"{want}, got {got}"
            )
        xp = self.xp
        if z.dtype != work_dtype:
            z = xp.astype(z, work_dtype)
        N, _, H, d_k = z.shape
        z = xp.reshape(z, (N, H, 1, d_k))
        return xp.permute_dims(z, (1, 2, 0, 3)) if self.varlen else z

    def normalizer_out(self, z: Any) -> Any:
        """polylin's ``z`` -> fla's key sum ``(N, 1, H, d_k)``."""
        xp = self.xp
        if self.varlen:
            z = xp.permute_dims(z, (2, 0, 1, 3))
        N, H, _, d_k = z.shape
        return xp.reshape(z[:, :, :1, :], (N, 1, H, d_k))

    def zeros_state(self, n_states: int, d: tuple[int, ...], work_dtype: Any, dev: Any) -> Any:
        """Zeros of polylin's state shape with trailing ``d`` (``(d_k,)``: a normalizer)."""
        H, G = self.heads, self.groups
        lead = (H, G, n_states) if self.varlen else (self.batch, H, G)
        return self.xp.zeros((*lead, *d), dtype=work_dtype, device=dev)


def work_dtype(xp: Any, dtype: Any) -> Any:
    """polylin's accumulation dtype for inputs of ``dtype`` (float32 for 16-bit inputs)."""
    return work_dtype_for(xp, dtype)
