"""The library's own CPU kernels: token loops compiled by Numba, where it is installed.

A decoding step of an eager library is a dozen operations, each a pass over the state or a
few microseconds of dispatch; a compiled loop makes one pass and one call. Each kernel here
runs one recurrence over ``T`` tokens of ``n`` independent states, reading the state it is
given and writing a new one (the caller's state is never written), in the input's precision (its
results agree with the array-API step's to rounding; the order of the sums differs):

- :func:`delta_tokens`: ``S' = diag(a) S``, ``e = beta (v - S'^T k)``, ``S_t = S' + k e^T``,
  ``o = S_t^T q`` (the gated delta rule, KDA);
- :func:`linear_tokens`: ``S_t = diag(a) S + k v^T``, ``z_t = a z + k``, ``o = S_t^T q``
  (linear attention with a scalar or per-channel decay: RetNet, GLA, Mamba-2's scan);
- :func:`dplr_tokens`: ``S_t = diag(a) S + b (a'^T S) + k v^T``, ``o = S_t^T q`` (RWKV-7).

A head's first token reads the caller's state and writes the result's; the tokens after it
update the result in place, its row ``i`` read and written through one array, so that the
compiler sees them to be one (two arrays holding the same memory cannot be proven apart, and
such a loop stays unvectorized: GLA's loop at 32 heads x 64, T = 512, 70 ms against 16 ms),
and a head's state is one buffer in the core's cache, not two. The results and the loops'
scratch rows start at multiples of 64 bytes (:func:`aligned_empty`; NumPy's arrays are
at multiples of 16), so that a row of 16 float32 is one cache line, not two, and the output
half a page from the values that the same loop reads. Multiply-adds may be fused
(``fastmath={"contract"}``, nothing reassociated: 11 ms). The delta rules' loops sum the next
token's read of the state (``S'^T k``, RWKV-7's ``a^T S``) in the pass that writes the state,
each new entry added as it is written:
a token is one pass over its state, not two (the same sums in the same order, so the same bits;
0.82-0.95x the two-pass loop's time at T = 512). The functions are plain Python over arrays (a
reference anyone can read), sharing their pieces (a token's step, its gates, the weighted
read of a state, the decay-and-add with its read-out), and are compiled with ``numba.njit`` at
their first use (:func:`kernel`; cached on disk where the package folder or Numba's cache
folder is writable). The decay factors ``exp(min(g, 0))`` of log decays are one compiled pass
too (:func:`exp_gates`, float32: 0.3x the time of NumPy's). Numba is optional:
without it, or with the environment variable ``POLYLIN_COMPILED=0``, :func:`compiled_tokens`
answers ``None`` and the array-API forms run.
Only NumPy arrays and PyTorch CPU tensors without a gradient to record qualify
(:func:`compiled_tokens`): Numba reads them as NumPy arrays that share their memory. The
kernels read the per-token arrays where the caller laid them out, token-major or head-major,
rows shared by the states (a broadcast array's) once for all (:class:`_Layout`). Over
token-major arrays the states of a token row that :data:`ACROSS_BYTES` holds run token by
token together, so that each token's rows are read in the order they lie in memory while the
states stay in the core's cache (one state at a time, each token's row a page or more from
the last: above :data:`HEAD_MAJOR_BYTES` such arrays are copied head-major). Linear
attention's loop sums the normalizers only where they divide the output, and a long call's
states are split between threads (:data:`PART_SIZE`).
This module imports no array library (rule 1 of ARCHITECTURE.md): a tensor's NumPy view is
made by the tensor's own library, and the results are allocated by the NumPy that the arrays'
views show to be imported.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from .execution import compiling, torch_transforming
from .namespace import loaded_numpy, torch_module, torch_namespace_of

__all__ = [
    "aligned_empty",
    "compiled_available",
    "compiled_tokens",
    "decay_factors",
    "delta_tokens",
    "dplr_tokens",
    "exp_gates",
    "in_parts",
    "kernel",
    "kernel_threads",
    "linear_tokens",
    "numba_module",
    "numpy_views",
]

#: Set to ``0`` to run the array-API forms where a compiled kernel would run.
ENVIRONMENT = "POLYLIN_COMPILED"


def delta_tokens(
    q: Any, k: Any, v: Any, beta: Any, decay: Any, S: Any, out: Any, S_out: Any, width: int,
    lo: int, hi: int,
) -> None:
    """The gated delta rule over ``T`` tokens for the states ``lo`` to ``hi``: ``q, k``
    ``(P, T, Q, m)``, ``v`` ``(P, T, Q, c)``, ``beta`` ``(P, T, Q, 1)``, ``decay`` ``exp(g)``
    ``(P, T, Q, m or 1)`` (ones for no decay), each axis of length 1 shared (:func:`_row`);
    state ``h`` is token row ``(h // Q, h % Q)``. ``S`` ``(n, m, c)`` read; ``out`` ``(P, T, Q,
    c)`` and ``S_out`` written. Up to ``width`` states of a token row run token by token
    together (:data:`ACROSS_BYTES`), each with its own scratch rows."""
    _by_tokens(_delta_token, (q, k, v, beta, decay, out), k, decay, S, S_out, width, lo, hi)


def _delta_token(
    source: Any, state: Any, arrays: tuple, error: Any, ahead: Any, p: int, t: int, r: int
) -> None:
    """Token ``t`` of :func:`delta_tokens` (``arrays``: its ``q, k, v, beta, decay, out``) from
    ``source`` into ``state`` (in place where ``source`` is ``None``), ``error`` holding its
    read ``S'^T k``; ``ahead`` gets the next token's."""
    q, k, v, beta, decay, out = arrays
    gates, key, value = _row(decay, p, t, r), _row(k, p, t, r), _row(v, p, t, r)
    b = _row(beta, p, t, r)[0]
    for j in range(error.shape[0]):
        error[j] = b * (value[j] - error[j])
    if t + 1 < out.shape[1]:
        _decay_and_add(
            source, state, out[p, t, r], gates, key, _row(q, p, t, r), error, ahead=ahead,
            ahead_weights=_row(k, p, t + 1, r), ahead_gates=_row(decay, p, t + 1, r),
        )  # fmt: skip
    else:
        _decay_and_add(source, state, out[p, t, r], gates, key, _row(q, p, t, r), error)


def linear_tokens(
    q: Any, k: Any, v: Any, decay: Any, S: Any, z: Any, out: Any, S_out: Any, z_out: Any,
    den: Any, width: int, lo: int, hi: int,
) -> None:
    """Linear attention over ``T`` tokens for the states ``lo`` to ``hi``: ``q, k, v, decay``
    as for :func:`delta_tokens`, ``S`` ``(n, m, c)`` and ``z`` ``(n, m)`` read; ``out``
    ``(P, T, Q, c)`` (the numerators ``S_t^T q``), ``S_out``, ``z_out`` and ``den``
    ``(P, T, Q, 1)`` (the normalizers ``z_t^T q``; ``None``: not computed) written."""
    T, Q = out.shape[1:3]
    width = max(1, min(Q, hi - lo, width))
    first = lo
    while first < hi:
        last = _block_end(first, hi, Q, width)
        for t in range(T):
            for h in range(first, last):
                p, r = h // Q, h % Q
                if t == 0:
                    _linear_token(S[h], z[h], S_out[h], z_out[h], q, k, v, decay, out, den, p,
                                  0, r)  # fmt: skip
                else:
                    _linear_token(None, None, S_out[h], z_out[h], q, k, v, decay, out, den,
                                  p, t, r)  # fmt: skip
        first = last


def _linear_token(
    source: Any, z_source: Any, state: Any, z_state: Any, q: Any, k: Any, v: Any, decay: Any,
    out: Any, den: Any, p: int, t: int, r: int,
) -> None:
    """Token ``t`` of :func:`linear_tokens` from ``source`` and ``z_source`` into ``state`` and
    ``z_state`` (in place where they are ``None``). Without normalizers (``den`` ``None``) the
    keys' sum ``z`` is a loop of its own after the state's: in the state's loop its store and
    the normalizer's sum make GLA's loop at 32 x 64, T = 512, 1.2x longer."""
    gates, key, query = _row(decay, p, t, r), _row(k, p, t, r), _row(q, p, t, r)
    value = _row(v, p, t, r)
    o = out[p, t, r]
    if den is None:
        _decay_and_add(source, state, o, gates, key, query, value)
        _decay_keys(z_source, z_state, gates, key)
    elif z_source is None:
        den[p, t, r, 0] = _decay_and_add(source, state, o, gates, key, query, value, z_state,
                                         z_state)  # fmt: skip
    else:
        den[p, t, r, 0] = _decay_and_add(source, state, o, gates, key, query, value, z_source,
                                         z_state)  # fmt: skip


def _decay_keys(z_source: Any, z_state: Any, gates: Any, key: Any) -> None:
    """``z_state = diag(gates) z_source + key`` (in place where ``z_source`` is ``None``)."""
    if z_source is None:
        for i in range(key.shape[0]):
            z_state[i] = key[i] + _gate(gates, i) * z_state[i]
    else:
        for i in range(key.shape[0]):
            z_state[i] = key[i] + _gate(gates, i) * z_source[i]


def dplr_tokens(
    q: Any, k: Any, v: Any, a: Any, b: Any, decay: Any, S: Any, out: Any, S_out: Any,
    width: int, lo: int, hi: int,
) -> None:
    """The generalized delta rule over ``T`` tokens for the states ``lo`` to ``hi``: ``q, k,
    a, b`` ``(P, T, Q, m)``, ``v`` ``(P, T, Q, c)``, ``decay`` as for :func:`delta_tokens`,
    ``S`` ``(n, m, c)`` read; ``out`` ``(P, T, Q, c)`` and ``S_out`` written. ``a^T S`` is
    read before the decay."""
    _by_tokens(_dplr_token, (q, k, v, a, b, decay, out), a, None, S, S_out, width, lo, hi)


def _dplr_token(
    source: Any, state: Any, arrays: tuple, read: Any, ahead: Any, p: int, t: int, r: int
) -> None:
    """Token ``t`` of :func:`dplr_tokens` (``arrays``: its ``q, k, v, a, b, decay, out``), as
    :func:`_delta_token`, ``read`` its ``a^T S``; ``ahead`` gets the next token's."""
    q, k, v, a, b, decay, out = arrays
    gates, key, query = _row(decay, p, t, r), _row(k, p, t, r), _row(q, p, t, r)
    value, o, low = _row(v, p, t, r), out[p, t, r], _row(b, p, t, r)
    if t + 1 < out.shape[1]:
        _dplr_rows(source, state, o, gates, key, query, value, low, read, ahead,
                   _row(a, p, t + 1, r))  # fmt: skip
    else:
        _dplr_rows(source, state, o, gates, key, query, value, low, read)


def _by_tokens(
    token: Any, arrays: tuple, weights: Any, gates: Any, S: Any, S_out: Any, width: int, lo: int,
    hi: int,
) -> None:
    """The delta rules' loop over the states ``lo`` to ``hi`` and their tokens: ``token(source,
    state, arrays, now, then, p, t, r)`` for each (:func:`_delta_token`, :func:`_dplr_token`;
    ``arrays`` end with ``out``, its ``v`` third), up to ``width`` states of a token row token by
    token together, each with two scratch rows: ``now`` holds the token's read of the state,
    ``then`` gets the next token's. The first read is ``S^T weights`` (each weight times its
    gate where ``gates`` are given)."""
    out, v = arrays[-1], arrays[2]
    T, Q = out.shape[1:3]
    width = max(1, min(Q, hi - lo, width))
    now_rows, then_rows = _scratch(v, width), _scratch(v, width)
    first = lo
    while first < hi:
        last = _block_end(first, hi, Q, width)
        for t in range(T):
            for h in range(first, last):
                p, r, now, then = h // Q, h % Q, now_rows[h - first], then_rows[h - first]
                if t == 0:
                    if gates is None:
                        _read(S[h], _row(weights, p, 0, r), now)
                    else:
                        _read(S[h], _row(weights, p, 0, r), now, _row(gates, p, 0, r))
                    token(S[h], S_out[h], arrays, now, then, p, 0, r)
                else:
                    token(None, S_out[h], arrays, now, then, p, t, r)
            now_rows, then_rows = then_rows, now_rows
        first = last


# The kernels' shared pieces: plain functions that the kernels call, compiled by Numba in their
# place before the first kernel compiles (:func:`_compile_pieces`).


def _scratch(v: Any, rows: int) -> Any:
    """New rows ``(rows, c)`` for the values ``v`` ``(P, T, Q, c)``, of their dtype, starting at
    an address that is a multiple of :data:`ALIGNMENT` (Numba's own arrays are at multiples of
    32 bytes)."""
    width = v.shape[3]
    buffer = _NUMPY.empty(rows * width + ALIGNMENT // v.itemsize, v.dtype)
    start = (-buffer.ctypes.data % ALIGNMENT) // v.itemsize
    return buffer[start : start + rows * width].reshape(rows, width)


def _block_end(first: int, hi: int, Q: int, width: int) -> int:
    """The end of the block of states from ``first`` that run together: at most ``width``,
    within ``hi`` and within the token row of ``first``."""
    return min(hi, (first // Q + 1) * Q, first + width)


def _row(x: Any, p: int, t: int, r: int) -> Any:
    """Token ``t``'s row of state ``(p, r)`` in the per-token array ``x`` ``(P, T, Q, width)``,
    whose axes of length 1 are shared (the decay of every token, keys shared by every head)."""
    P, T, Q = x.shape[:3]
    return x[p if P > 1 else 0, t if T > 1 else 0, r if Q > 1 else 0]


def _gate(gates: Any, i: int) -> Any:
    """Key channel ``i``'s factor in ``gates`` (one factor shared by every channel)."""
    return gates[i if gates.shape[0] > 1 else 0]


def _read(source: Any, weights: Any, into: Any, gates: Any = None) -> None:
    """``into = source^T weights``: the rows of the state ``(m, c)`` weighted and summed (each
    weight times its gate, where ``gates`` are given)."""
    into[:] = 0
    for i in range(source.shape[0]):
        weight, row = weights[i], source[i]
        if gates is not None:
            weight = _gate(gates, i) * weight
        for j in range(into.shape[0]):
            into[j] += weight * row[j]


def _decay_and_add(
    source: Any, state: Any, out: Any, gates: Any, key: Any, query: Any, value: Any,
    z_source: Any = None, z_state: Any = None, ahead: Any = None, ahead_weights: Any = None,
    ahead_gates: Any = None,
) -> Any:
    """``state = diag(gates) source + key value^T`` and ``out = state^T query``, row by row:
    each row written once and read once more for the output while it is in registers;
    ``source`` ``None``: in place, ``state = diag(gates) state + key value^T`` (module
    docstring). With linear attention's normalizer ``z`` also ``z_state = diag(gates)
    z_source + key``, and ``z_state^T query`` returned (its sum in the same loop: a loop of its
    own waited on each addition, GLA's loop 1.13-1.22x slower). With ``ahead``, also the next
    token's read ``ahead = state^T (ahead_gates * ahead_weights)`` (:func:`_read` of the new
    state, the same sums in the same order), so that a token costs one pass over its state,
    not two."""
    out[:] = 0
    if ahead is not None:
        ahead[:] = 0
    total = 0 * out[0]
    for i in range(state.shape[0]):
        gate, ki, qi = _gate(gates, i), key[i], query[i]
        if z_state is not None:
            z_state[i] = ki + gate * z_source[i]
            total += qi * z_state[i]
        new = state[i]
        if source is None:  # one array read and written: the compiler sees that it is one
            row = new
        else:
            row = source[i]
        if ahead is None:  # two loops: a test of ahead inside one left it 1.4x slower
            for j in range(value.shape[0]):
                x = gate * row[j] + ki * value[j]
                new[j] = x
                out[j] += qi * x
        else:
            wi = _gate(ahead_gates, i) * ahead_weights[i]
            for j in range(value.shape[0]):
                x = gate * row[j] + ki * value[j]
                new[j] = x
                out[j] += qi * x
                ahead[j] += wi * x
    return total


def _dplr_rows(
    source: Any, state: Any, out: Any, gates: Any, key: Any, query: Any, value: Any, low: Any,
    read: Any, ahead: Any = None, ahead_weights: Any = None,
) -> None:
    """RWKV-7's ``state = diag(gates) source + low read^T + key value^T`` and ``out = state^T
    query``, row by row (``source`` ``None``: in place); with ``ahead``, also the next token's
    ``ahead = state^T ahead_weights`` (as :func:`_decay_and_add`)."""
    out[:] = 0
    if ahead is not None:
        ahead[:] = 0
    for i in range(state.shape[0]):
        gate, bi, ki, qi = _gate(gates, i), low[i], key[i], query[i]
        new = state[i]
        if source is None:
            row = new
        else:
            row = source[i]
        if ahead is None:
            for j in range(value.shape[0]):
                x = (gate * row[j] + bi * read[j]) + ki * value[j]
                new[j] = x
                out[j] += qi * x
        else:
            wi = ahead_weights[i]
            for j in range(value.shape[0]):
                x = (gate * row[j] + bi * read[j]) + ki * value[j]
                new[j] = x
                out[j] += qi * x
                ahead[j] += wi * x


def exp_gates(g: Any, out: Any, constants: Any) -> None:
    """``out = exp(min(g, 0))`` over the float32 arrays ``g`` and ``out`` ``(n,)``: the decay
    factors of log decays, as the kernels read them. ``constants``: :data:`EXP_CONSTANTS` as
    float32 (typed constants: a float literal would make Numba compute in float64).

    With ``y = min(g, 0)``, ``n = round(y / ln 2)`` and ``r = y - n ln 2`` (``|r| <= ln 2 / 2``,
    ``ln 2`` in two parts so that ``n ln 2`` is exact), ``exp(y) = 2^n exp(r)``: ``exp(r)`` by
    Cephes' ``expf`` polynomial, ``2^n`` the bits ``(n + 127) << 23`` of an int32 read as a
    float32 (:func:`_float_from_bits`). Within 1.4 x 2^-24 of ``exp`` (NumPy's float32
    ``exp``: 3.4 x 2^-24), vectorized by the compiler (the loop has no calls and no memory but
    its arrays): 0.28 ms for 2^20 gates on one Zen 4 core, against 0.88 ms for NumPy's
    ``exp(minimum(g, 0))``. ``g`` below ``log`` of float32's least normal number (-87.33)
    gives 0 (as a subnormal flushed to zero), NaN stays NaN."""
    zero, low, log2e, shifter, ln2_hi = (constants[0], constants[1], constants[2],
                                         constants[3], constants[4])  # fmt: skip
    ln2_lo, one, bias, exponent = constants[5], constants[6], constants[7], constants[8]
    c0, c1, c2, c3, c4, c5 = (constants[9], constants[10], constants[11], constants[12],
                              constants[13], constants[14])  # fmt: skip
    for j in range(g.shape[0]):
        x = g[j]
        y = x if x < zero else zero  # NaN too: put back below
        y = y if y > low else low
        n = (y * log2e + shifter) - shifter  # rounded to an integer by the shifter
        r = (y - n * ln2_hi) - n * ln2_lo
        p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
        power = _float_from_bits(_NUMPY.int32((n + bias) * exponent))  # 2^n
        e = (p * r * r + r + one) * power
        e = e if x > low else zero
        out[j] = e if x == x else x


def _float_from_bits(bits: Any) -> Any:
    """The float32 whose bits are the int32 ``bits``; compiled, one bit cast in a register
    (:func:`_bit_cast`). 2^n written to an int32 buffer and read back as float32 ran 2.5x
    slower where the buffer's address and the gates' alias in the processor's store
    forwarding (0.28 ms against 1.4-3.5 ms for 2^20 gates, by heap layout, on a Zen 4 core)."""
    return bits.view(_NUMPY.float32)


#: The fewest gates that :func:`decay_factors` hands to :func:`exp_gates` (for fewer, a scalar
#: gate per head, NumPy's two calls cost less than the compiled one's).
EXP_BLOCK = 256

#: The NumPy module in :func:`exp_gates`: the one loaded, set where the kernel is compiled
#: (Numba imports NumPy).
_NUMPY: Any = None

#: :func:`exp_gates`' constants: 0, the least exponent, log2(e), the rounding shifter
#: 1.5 x 2^23, ln 2 in two parts, 1, float32's exponent bias and its bits' place, then the
#: polynomial's coefficients (Cephes' ``expf``).
EXP_CONSTANTS = (
    0.0, -87.33, 1.44269504, 12582912.0, 0.693359375, -2.12194440e-4, 1.0, 127.0, 8388608.0,
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1,
)  # fmt: skip


def decay_factors(g: Any) -> Any:
    """``exp(min(g, 0))`` of the NumPy array ``g`` (a new array): float32 on
    :func:`exp_gates` where Numba runs (:func:`compiled_available`) and ``g`` has at least
    :data:`EXP_BLOCK` entries, else NumPy's ``exp(minimum(g, 0))``."""
    numpy: Any = loaded_numpy()  # g is a NumPy array
    run = _exp_kernel() if g.dtype == numpy.float32 and g.size >= EXP_BLOCK else None
    if run is None:
        factors = numpy.minimum(g, 0.0)
        return numpy.exp(factors, out=factors)
    out = numpy.empty(g.shape, dtype=g.dtype)
    run(numpy.ascontiguousarray(g).reshape(-1), out.reshape(-1), _exp_constants(numpy))
    return out


@cache
def _exp_kernel() -> Callable[..., None] | None:
    """:func:`exp_gates` compiled, or ``None`` without Numba."""
    global _NUMPY
    numba = numba_module()
    if numba is None:
        return None
    _NUMPY = loaded_numpy()
    globals()["_float_from_bits"] = numba.njit(inline="always")(_bit_cast(numba))
    return numba.njit(cache=True, nogil=True, fastmath={"contract"})(exp_gates)


def _bit_cast(numba: Any) -> Callable[..., Any]:
    """:func:`_float_from_bits` for Numba: an intrinsic that reads an int32's bits as a float32
    (LLVM's ``bitcast``; Numba has no cast of a number's bits of its own)."""
    from llvmlite import ir

    @numba.extending.intrinsic
    def float_from_bits(typing: Any, bits: Any) -> Any:
        if bits != numba.types.int32:
            return None
        return numba.types.float32(bits), lambda _, b, __, args: b.bitcast(args[0], ir.FloatType())

    return lambda bits: float_from_bits(bits)


@cache
def _exp_constants(numpy: Any) -> Any:
    """:data:`EXP_CONSTANTS` as float32 (read only)."""
    constants = numpy.array(EXP_CONSTANTS, dtype=numpy.float32)
    constants.flags.writeable = False
    return constants


_PIECES = ("_by_tokens", "_scratch", "_block_end", "_row", "_gate", "_read", "_decay_and_add",
           "_dplr_rows", "_delta_token", "_dplr_token", "_linear_token", "_decay_keys")  # fmt: skip
#: Compiled apart (see :func:`_compile_pieces`); ``_linear_token`` also so that its test of
#: ``den`` is decided where it compiles for ``den`` of ``None``.
_LOOPS = ("_read", "_decay_and_add", "_dplr_rows", "_linear_token", "_decay_keys")


_KERNELS: dict[str, Callable[..., None]] = {
    "delta": delta_tokens,
    "linear": linear_tokens,
    "dplr": dplr_tokens,
}


@cache
def numba_module() -> Any | None:
    """Numba, or ``None`` where it is not installed or ``POLYLIN_COMPILED=0`` (read once)."""
    if os.environ.get(ENVIRONMENT, "1").strip() == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


def compiled_available() -> bool:
    """Whether the compiled kernels run (Numba installed, ``POLYLIN_COMPILED`` not ``0``)."""
    return numba_module() is not None


@cache
def kernel(name: str) -> Callable[..., None] | None:
    """The kernel ``name`` (``"delta"``, ``"linear"``, ``"dplr"``) compiled by Numba (no Python
    objects, the GIL released), or ``None`` where Numba is not there (:func:`compiled_available`).
    Each dtype compiles once per process, or once per machine where the cache folder is
    writable."""
    numba = numba_module()
    if numba is None:
        return None
    _compile_pieces(numba)
    return numba.njit(cache=True, nogil=True, fastmath={"contract"})(_KERNELS[name])


@cache
def _compile_pieces(numba: Any) -> None:
    """Put the kernels' shared pieces (:data:`_PIECES`) in this module compiled by ``numba``,
    in place of their plain functions: Numba resolves a kernel's global names when it compiles
    it, and calls compiled functions only. Compiled apart (not inlined into the kernel's Numba
    code, which took GLA's loop from 20 to 25-28 ms), they run as fast as the loops written
    out. Called from Python the compiled pieces do what the plain ones do."""
    global _NUMPY
    _NUMPY = loaded_numpy()
    for name in _PIECES:
        inline = "never" if name in _LOOPS else "always"
        globals()[name] = numba.njit(inline=inline, fastmath={"contract"})(globals()[name])


def numpy_views(S: Any, arrays: list[Any]) -> list[Any] | None:
    """NumPy arrays sharing the memory of ``S`` and ``arrays``: NumPy arrays themselves, or
    PyTorch CPU tensors' views where no gradient is recorded (not traced by ``torch.compile``,
    not in a ``torch.func`` transform); all of one dtype, float32 or float64. ``None``
    otherwise. A decoding step pays this at every token: a tensor's own ``numpy()`` checks its
    device, and the views' dtypes are compared, instead of each tensor's attributes."""
    numpy = loaded_numpy()
    if numpy is None:
        return None
    given = [S, *arrays]
    if type(S) is not numpy.ndarray:
        if torch_namespace_of(S) is None or torch_transforming(S):
            return None
        torch = torch_module()
        if not all(isinstance(x, torch.Tensor) for x in given):  # another library
            return None
        if torch.is_grad_enabled() and any(x.requires_grad for x in given):
            return None
        try:  # raises for another device or dtype, and where grad is required (under no_grad)
            given = [x.numpy() for x in given]
        except (RuntimeError, TypeError):
            given = [x.detach() for x in given]
            if not all(x.is_cpu and x.dtype in (torch.float32, torch.float64) for x in given):
                return None
            given = [x.numpy() for x in given]
    dtype = given[0].dtype
    if dtype.char not in "fd" or not all(
        type(x) is numpy.ndarray and x.dtype == dtype for x in given
    ):  # fmt: skip
        return None
    return given


def compiled_tokens(
    name: str, tokens: list[Any], decay: Any | None, S: Any, z: Any | None = None, *,
    step: bool, log: bool = False, scale: float = 1.0, scale_output: bool = False,
    eps: float | None = None,
) -> tuple[Any, ...] | None:
    """Kernel ``name`` (:func:`kernel`) over the per-token arrays ``tokens`` (in the kernel's
    order: ``q, k, v`` and ``beta`` or ``a, b``) and ``decay`` (``exp(g)``, or ``None``) from
    the state ``S`` ``(..., m, c)`` (and ``z`` ``(..., m)`` for ``"linear"``). ``log``:
    ``decay`` is the log decay ``g`` itself, its factors ``exp(min(g, 0))`` computed here
    (:func:`decay_factors`: one compiled pass in float32). ``scale`` multiplies ``q`` (the
    first token array), or ``out`` where ``scale_output``; with ``eps`` (``"linear"``), ``out``
    is divided by ``den + eps`` (linear attention's normalization). Both on the NumPy views,
    so that no operation of PyTorch's runs on the sequence around the loop: one on a large
    tensor wakes PyTorch's OpenMP threads, which then spin for milliseconds on the cores that
    the loop's parts need (``docs/performance.md``, "Compiled token loops").

    For one token (``step``) the arrays are ``(..., width)``, else ``(..., T, width)`` (the
    decay's ``T`` may be 1: shared by the tokens); their leading dimensions broadcast to the
    state's. Returns, in the caller's library, ``(out, S_T)``, for ``"linear"`` ``(out, S_T,
    z_T, den)`` with the normalizers ``den`` ``(..., 1)`` or ``(..., T, 1)`` (a sequence
    without ``eps``: ``None``, not computed); ``None`` where the kernels do not run: Numba
    missing or turned off, another library or device, a gradient to record, another dtype, or
    leading dimensions that do not broadcast to the state's.

    The kernels read the tokens in the caller's order: where ``q`` is a view of arrays laid
    out token-major (``(B, T, H, d)`` seen as ``(B, H, T, d)``, as the public functions'
    ``seq_axis`` makes them), the tokens are read there, not copied head-major, and ``out`` is
    written token-major too (returned as the same kind of view)."""
    if compiling(S):  # traced by torch.compile: the graph's own operations
        return None
    run = kernel(name)
    if run is None:
        return None
    given = [*tokens] if decay is None else [*tokens, decay]
    if z is not None:
        if tuple(z.shape) != tuple(S.shape[:-1]):
            return None
        given.append(z)
    views = numpy_views(S, given)
    if views is None:
        return None
    numpy: Any = loaded_numpy()  # imported: views were made
    state, dtype = views[0], views[0].dtype
    m, c = state.shape[-2:]
    width = max(1, ACROSS_BYTES // (m * c * dtype.itemsize))  # states run together
    # laid out as the values are (q and k may be shared by the states: broadcast)
    layout = _Layout(numpy, state.shape[:-2], 1 if step else tokens[0].shape[-2], views[3],
                     step, width > 1)  # fmt: skip
    n, T = layout.n, layout.T
    flat: list[Any] = []
    for i, x in enumerate(views[1 : len(tokens) + 1 + (decay is not None)]):
        shared = i == len(tokens) and not step and x.shape[-2] == 1  # a decay for every token
        flat.append(layout.read(x, 1 if shared else T))
        if flat[-1] is None:
            return None
    if log and decay is not None:
        flat[-1] = decay_factors(flat[-1])
    if scale != 1.0 and not scale_output:
        flat[0] = flat[0] * scale  # a new array: flat[0] may be the caller's
    if not step and flat[2].ctypes.data % ALIGNMENT:  # v: read in every row's inner loop
        values, flat[2] = flat[2], aligned_empty(numpy, flat[2].shape, dtype)
        flat[2][...] = values
    if decay is None:
        flat.append(numpy.ones((1, 1, 1, 1), dtype=dtype))
    flat.append(numpy.ascontiguousarray(state.reshape(n, m, c)))
    results = [layout.empty(c, dtype, None if step else flat[2]),
               aligned_empty(numpy, (n, m, c), dtype)]
    if z is not None:  # the normalizers where they divide the output (or for a step)
        flat.append(numpy.ascontiguousarray(views[-1].reshape(n, m)))
        den = layout.empty(1, dtype) if step or eps is not None else None
        results += [aligned_empty(numpy, (n, m), dtype), den]
    parts = min(n, kernel_threads(state is not S), n * T * m * c // PART_SIZE)
    if parts > 1:
        in_parts(run, [*flat, *results, width], n, parts)
    else:
        run(*flat, *results, width, 0, n)
    if scale != 1.0 and scale_output:
        results[0] *= scale
    if eps is not None and z is not None:
        results[0] /= results[3] + eps
    results[0], results[1] = layout.given(results[0]), results[1].reshape(state.shape)
    if z is not None:
        results[2] = results[2].reshape(state.shape[:-1])
        if results[3] is not None:
            results[3] = layout.given(results[3])
    if state is not S:  # PyTorch: tensors sharing the results' memory
        from_numpy = torch_module().from_numpy
        return tuple(None if x is None else from_numpy(x) for x in results)
    return tuple(results)


class _Layout:
    """How the kernels see the per-token arrays of states of leading dimensions ``lead``:
    ``(P, T, Q, width)``, the state ``h`` being token row ``(h // Q, h % Q)``.

    Head-major (``Q = 1``) for one token, for arrays laid out ``(..., T, width)`` and for
    arrays of more than :data:`HEAD_MAJOR_BYTES` whose states the kernel updates one at a time
    (not ``together``, :data:`ACROSS_BYTES`; copied); token-major where the values ``v`` are a
    view of an array whose last ``after`` leading dimensions follow the token axis in memory
    (``(B, T, H, d)`` seen as ``(B, H, T, d)``: ``after = 1``, ``Q = H``), so that the
    caller's arrays are read where they are. Axes of length 1 that the states share (a
    broadcast array's) stay of length 1: the kernels read them for every state."""

    def __init__(
        self, numpy: Any, lead: tuple[int, ...], T: int, v: Any, step: bool, together: bool
    ) -> None:
        self.numpy, self.lead, self.T, self.step = numpy, lead, T, step
        self.n = math.prod(lead)
        copied = step or (v.nbytes > HEAD_MAJOR_BYTES and not together)
        self.split = len(lead) - (0 if copied else _token_major(numpy, v, lead))
        self.Q = math.prod(lead[self.split :])

    def read(self, x: Any, rows: int) -> Any | None:
        """``x`` ``(..., rows, width)`` (``(..., width)`` for one token) as the kernels read
        it: C-contiguous ``(P, rows, Q, width)``, a copy only where it is laid out otherwise or
        broadcast; ``None`` where its leading dimensions do not broadcast to the states'."""
        numpy, lead, width = self.numpy, self.lead, x.shape[-1]
        want = lead if self.step else (*lead, rows)
        if x.shape[:-1] != want:
            if not broadcasts(x.shape[:-1], want):
                return None
            x = numpy.broadcast_to(x, (*want, width))
        if not self.step:
            x = numpy.moveaxis(x, -2, self.split)
        x = x.reshape(self.n // self.Q, rows, self.Q, width)  # a copy where no view is
        if x.strides[0] == 0 and x.shape[0] > 1:  # shared by the states: read once, not copied
            x = x[:1]
        if x.strides[2] == 0 and x.shape[2] > 1:
            x = x[:, :, :1]
        return numpy.ascontiguousarray(x)

    def empty(self, width: int, dtype: Any, apart: Any = None) -> Any:
        """A result the kernels write, ``(P, T, Q, width)`` (``apart``: see
        :func:`aligned_empty`)."""
        shape = (self.n // self.Q, self.T, self.Q, width)
        return aligned_empty(self.numpy, shape, dtype, apart)

    def given(self, x: Any) -> Any:
        """A result ``(P, T, Q, width)`` as the caller's ``(..., T, width)`` (a view)."""
        lead, width = self.lead, x.shape[-1]
        if self.step:
            return x.reshape(*lead, width)
        x = x.reshape(*lead[: self.split], self.T, *lead[self.split :], width)
        return self.numpy.moveaxis(x, self.split, -2)


#: The byte multiple at which the kernels' results and scratch arrays start: a cache line, so
#: that a row of 16 float32 is one line, not two. NumPy puts its arrays at multiples of 16
#: bytes; at others GLA's loop at 32 heads x 64, T = 512, ran 1.8x longer on a Zen 4 core
#: (every 512-bit load and store of the state and output rows split across two lines).
ALIGNMENT = 64
#: A page of memory: a load whose address differs from an earlier store's by a multiple of it
#: waits on that store (its last 12 bits are compared first).
PAGE = 4096


def aligned_empty(numpy: Any, shape: tuple[int, ...], dtype: Any, apart: Any = None) -> Any:
    """An uninitialized C-contiguous ``numpy`` array starting at a multiple of
    :data:`ALIGNMENT` bytes (a view of a slightly larger one); with ``apart`` (an array), half
    a page from its start in the addresses' last 12 bits."""
    size, itemsize = math.prod(shape), numpy.dtype(dtype).itemsize
    page = 0 if apart is None else PAGE
    buffer = numpy.empty(size + (ALIGNMENT + page) // itemsize, dtype=dtype)
    at = buffer.ctypes.data
    want = ALIGNMENT if apart is None else PAGE
    target = 0 if apart is None else (apart.ctypes.data + PAGE // 2) % PAGE
    start = ((target - at) % want) // itemsize
    return buffer[start : start + size].reshape(shape)


#: The bytes of states that a kernel updates token by token together (``width`` states of a
#: token row): in token-major arrays a token's rows of the states lie side by side, read in
#: the order they lie in memory, while the states stay in the core's cache (a Zen 4 core's
#: second level holds 1 MiB). GLA's and RWKV-7's loops at 32 x 64, T = 512, took 0.84-0.88x
#: the time of one state after another, the gated delta rule's at 32 x 128 0.85x (8 at once).
ACROSS_BYTES = 1 << 19


#: The size above which a token-major array is read from a head-major copy where the kernel
#: updates one state at a time (each state above :data:`ACROSS_BYTES`): a head's token rows
#: then lie a page or more apart in arrays larger than the caches, each row a miss that the
#: prefetchers do not see coming (the gated delta rule at 16 x 64, T = 4096, 16 MiB per
#: array, Zen 4: 0.73-0.74x the time with the copies; at T = 512, 2 MiB, 1.01-1.04x; RWKV-7 at
#: 32 x 64, T = 512, 4 MiB, 1.14x; at 32 x 128, T = 1024, 16 MiB, 1.00x).
HEAD_MAJOR_BYTES = 1 << 23


def _token_major(numpy: Any, q: Any, lead: tuple[int, ...]) -> int:
    """How many of the leading dimensions ``lead`` of ``q`` ``(*lead, T, d)`` follow its token
    axis in memory (0 where it is C-contiguous as it is, or laid out otherwise)."""
    if q.flags.c_contiguous or q.shape[:-2] != lead:
        return 0
    for after in range(1, len(lead) + 1):
        if numpy.moveaxis(q, -2, len(lead) - after).flags.c_contiguous:
            return after
    return 0


#: The least work (states' entries times tokens) that each thread of a kernel's call gets:
#: handing a part to another thread and waiting for it takes some microseconds.
PART_SIZE = 1 << 22


def kernel_threads(tensors: bool) -> int:
    """The threads a kernel's call may run on: PyTorch's (``torch.get_num_threads()``) for
    tensors, Numba's (``NUMBA_NUM_THREADS``, by default the cores) for NumPy arrays."""
    if tensors:
        return int(torch_module().get_num_threads())
    numba: Any = numba_module()  # installed: a kernel runs
    return int(numba.config.NUMBA_NUM_THREADS)


def in_parts(run: Callable[..., None], args: list[Any], n: int, parts: int) -> None:
    """``run(*args, lo, hi)`` for ``parts`` consecutive ranges of the ``n`` states, all but the
    first on the pool's threads (each call releases the GIL): the states are independent."""
    first, *rest = itertools.pairwise([n * i // parts for i in range(parts + 1)])
    pool = _pool(parts - 1)
    waiting = [pool.submit(run, *args, lo, hi) for lo, hi in rest]
    run(*args, *first)
    for future in waiting:
        future.result()


_POOL: dict[int, ThreadPoolExecutor] = {}  # by process: a forked child starts its own
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """This process's threads for :func:`in_parts`, at least ``workers`` of them."""
    pid = os.getpid()
    with _POOL_LOCK:
        pool = _POOL.get(pid)
        if pool is None or pool._max_workers < workers:
            if pool is not None:
                pool.shutdown(wait=False)
            _POOL.clear()
            pool = _POOL[pid] = ThreadPoolExecutor(workers, thread_name_prefix="polylin")
        return pool


def broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether the leading dimensions ``shape`` broadcast to ``to`` (never the other way)."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(shape[::-1], to[::-1]))
