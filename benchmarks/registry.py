"""The implementations the benchmarks can time, by name, and how each is timed.

An :class:`Implementation` knows which array libraries it runs on, how to build the function it
times from a :class:`Setup` (backend, dtype, chunk size, device), how its time grows with T,
whether it is a per-token loop (timed at short lengths, extrapolated beyond), and whether it
computes the same function as polylin (then its output is compared with polylin's). Both the
CPU sweep (``benchmarks/cpu.py``) and the GPU run (``benchmarks/gpu.py``) take their
implementations from :data:`REGISTRY`; :func:`make_call` turns one into a zero-argument call in
either mode of :data:`MODES`:

- ``forward``: the call itself;
- ``forward+backward``: ``out.sum().backward()`` with PyTorch (fresh leaves, gradients reset
  before each call), ``jax.jit(jax.grad(...))`` of ``sum(out)`` with JAX; other libraries have
  no autograd.

Adding an implementation is one decorated function (see ``benchmarks/README.md``)::

    @register("decay", description="polylin's gated form", order=1)
    def _decay(setup):
        return functools.partial(polylin.some_entry_point, chunk_size=setup.chunk_size)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from polylin import causal_linear_attention, delta_rule_attention
from polylin.testing import Backend

from . import baselines

__all__ = ["MODES", "REGISTRY", "Implementation", "Setup", "Skip", "make_call", "register"]

MODES = ("forward", "forward+backward")


class Skip(Exception):
    """An implementation cannot run this measurement; the message says why."""


@dataclass(frozen=True)
class Setup:
    """What an implementation is built for."""

    backend: Backend
    dtype: str = "float32"
    chunk_size: int = 64
    dim: int = 64
    on_gpu: bool = False


Builder = Callable[[Setup], Callable[..., Any]]


@dataclass(frozen=True)
class Implementation:
    """One thing the benchmarks time; see the module docstring."""

    name: str
    build: Builder
    description: str
    libraries: tuple[str, ...] | None = None  # None: every array library
    order: int = 1  # growth of the time in T (1: linear, 2: quadratic)
    loop: bool = False  # a per-token Python loop
    compare: bool = True  # computes polylin's function: outputs are compared
    to_layout: Callable[[Any], Any] | None = None  # inputs to its layout, outside the timer
    from_layout: Callable[[Any], Any] | None = None  # its output back to (..., H, T, D)
    #: extra arrays (gates, beta, ...) made from (setup, [q, k, v]) outside the timer, passed
    #: after q, k, v (and differentiated too in forward+backward)
    extra_inputs: Callable[[Setup, list[Any]], list[Any]] | None = None

    def unavailable(self, backend: Backend) -> str | None:
        """Why this implementation cannot run on ``backend``, or ``None``."""
        if self.libraries is not None and backend.value.split(":")[0] not in self.libraries:
            return f"{self.name} runs on {', '.join(self.libraries)} only"
        return None


REGISTRY: dict[str, Implementation] = {}


def register(name: str, *, description: str, **options: Any) -> Callable[[Builder], Builder]:
    """Add the decorated builder to :data:`REGISTRY` under ``name``."""

    def add(build: Builder) -> Builder:
        if name in REGISTRY:
            raise ValueError(f"implementation {name!r} is registered twice")
        REGISTRY[name] = Implementation(name, build, description, **options)
        return build

    return add


def make_call(impl: Implementation, setup: Setup, xs: list[Any], mode: str) -> Callable[[], Any]:
    """A zero-argument call that runs ``impl`` on ``xs`` in ``mode``; raises :class:`Skip`."""
    reason = impl.unavailable(setup.backend)
    if reason is not None:
        raise Skip(reason)
    fn = impl.build(setup)
    if impl.extra_inputs is not None:
        xs = [*xs, *impl.extra_inputs(setup, xs)]
    if impl.to_layout is not None:
        xs = [impl.to_layout(x) for x in xs]
    if mode == "forward":
        return lambda: fn(*xs)
    if mode != "forward+backward":
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if setup.backend in (Backend.TORCH, Backend.TORCH_CUDA):
        leaves = [x.detach().clone().requires_grad_(True) for x in xs]

        def torch_backward() -> Any:
            for x in leaves:
                x.grad = None
            fn(*leaves).sum().backward()
            return leaves[0].grad

        return torch_backward
    if setup.backend in (Backend.JAX, Backend.JAX_CUDA):
        import jax

        # under jit, as training code runs it (compiled in the untimed warm-up call)
        grad = jax.jit(jax.grad(lambda *a: jax.numpy.sum(fn(*a)), argnums=tuple(range(len(xs)))))
        return lambda: jax.block_until_ready(grad(*xs))[0]
    raise Skip(f"{setup.backend} has no autograd: forward only")


# --------------------------------------------------------------------------------------------
# the implementations


@register("chunked", description="polylin's default path (causal_linear_attention)")
def _chunked(setup: Setup) -> Callable[..., Any]:
    return functools.partial(causal_linear_attention, chunk_size=setup.chunk_size)


@contextlib.contextmanager
def _float32_matmul_precision(precision: str) -> Iterator[None]:
    """Set torch's float32 matmul precision for a block and restore the caller's setting."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@register(
    "chunked_tf32",
    libraries=("torch",),
    description="the chunked path with TF32 matmuls for the call only (float32, CUDA)",
)
def _chunked_tf32(setup: Setup) -> Callable[..., Any]:
    if setup.dtype != "float32" or not setup.on_gpu:
        raise Skip("TF32 applies to float32 matmuls on CUDA only")

    def forward(q: Any, k: Any, v: Any) -> Any:
        with _float32_matmul_precision("high"):
            return causal_linear_attention(q, k, v, chunk_size=setup.chunk_size)

    return forward


@register("plain", description="a plain, unblocked chunked form in array-API code")
def _plain(setup: Setup) -> Callable[..., Any]:
    return functools.partial(baselines.plain_chunked, chunk_size=setup.chunk_size)


@register("quadratic", order=2, description="polylin's masked kernel (T x T) form")
def _quadratic(setup: Setup) -> Callable[..., Any]:
    return functools.partial(causal_linear_attention, method="quadratic")


@register("recurrent", loop=True, description="polylin's per-token form")
def _recurrent(setup: Setup) -> Callable[..., Any]:
    return functools.partial(causal_linear_attention, method="recurrent")


@register(
    "seed",
    libraries=("torch",),
    loop=True,
    description="the original per-token PyTorch loop, as written",
)
def _seed(setup: Setup) -> Callable[..., Any]:
    def forward(q: Any, k: Any, v: Any) -> Any:
        lead, (T, d_v) = q.shape[:-2], v.shape[-2:]
        flat = [x.reshape(-1, *x.shape[-2:]) for x in (q, k, v)]
        return baselines.seed_loop(*flat).reshape(*lead, T, d_v)

    return forward


@register(
    "sdpa",
    libraries=("torch",),
    order=2,
    compare=False,
    description="PyTorch's causal softmax attention (a different function, timed only)",
)
def _sdpa(setup: Setup) -> Callable[..., Any]:
    if not setup.on_gpu:
        return baselines.sdpa
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Never the math fallback on the GPU: it builds the T x T matrix.
    errors = []
    probe = torch.ones(1, 1, 64, setup.dim, device="cuda", dtype=getattr(torch, setup.dtype))
    for name, kernel in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with warnings.catch_warnings(), sdpa_kernel([kernel]):
                warnings.simplefilter("ignore")
                baselines.sdpa(probe, probe, probe)
        except RuntimeError as exc:
            errors.append(f"{name}: {str(exc).splitlines()[0][:120]}")
            continue

        def forward(q: Any, k: Any, v: Any, kernel: Any = kernel) -> Any:
            with sdpa_kernel([kernel]):
                return baselines.sdpa(q, k, v)

        forward.variant = name  # type: ignore[attr-defined]
        return forward
    raise Skip("no SDPA kernel without the T x T matrix: " + "; ".join(errors))


@register(
    "fla_chunk",
    libraries=("torch",),
    to_layout=baselines.to_fla_layout,
    from_layout=baselines.to_fla_layout,
    description="flash-linear-attention's chunk_linear_attn (Triton) with elu + 1",
)
def _fla_chunk(setup: Setup) -> Callable[..., Any]:
    try:
        chunk_linear_attn, _ = baselines.load_fla("cuda" if setup.on_gpu else "cpu")
    except ImportError as exc:
        raise Skip(str(exc)) from None
    return functools.partial(baselines.fla_chunk, chunk_linear_attn)


# -- decay and gating (issue 14): polylin's gated forms, a different function (not compared) --
def _gates(width: str) -> Callable[[Setup, list[Any]], list[Any]]:
    """Log decays in (-inf, 0] made from the keys outside the timer: one per token
    (``width="token"``, shape ``(..., T, 1)``) or one per channel (``(..., T, d)``)."""

    def make(setup: Setup, xs: list[Any]) -> list[Any]:
        import array_api_compat

        k = xs[1]
        xp = array_api_compat.array_namespace(k)
        source = k[..., :1] if width == "token" else k
        return [-0.1 * xp.abs(source)]

    return make


def _gated(method: str) -> Builder:
    def build(setup: Setup) -> Callable[..., Any]:
        def forward(q: Any, k: Any, v: Any, log_decay: Any) -> Any:
            return causal_linear_attention(
                q, k, v, method=method, chunk_size=setup.chunk_size, log_decay=log_decay,
                normalize=False,
            )  # fmt: skip

        return forward

    return build


for _width in ("token", "channel"):
    register(
        f"decay_{_width}",
        compare=False,
        extra_inputs=_gates(_width),
        description=f"polylin's chunked form with a log decay per {_width}, normalize=False",
    )(_gated("chunked"))
    register(
        f"recurrent_decay_{_width}",
        loop=True,
        compare=False,
        extra_inputs=_gates(_width),
        description=f"polylin's per-token form with a log decay per {_width}, normalize=False",
    )(_gated("recurrent"))


# --------------------------------------------------------------------------------------------
# the delta rule (a different function: timed, not compared with causal_linear_attention)


def _delta_beta(setup: Setup, qkv: list[Any]) -> list[Any]:
    """``beta_t = 0.5 / |k_t|^2``: each step a contraction whatever the keys' scale."""
    import array_api_compat

    k = qkv[1]
    xp = array_api_compat.array_namespace(k)
    return [0.5 / xp.sum(k * k, axis=-1, keepdims=True)]


def _delta_beta_and_decay(setup: Setup, qkv: list[Any]) -> list[Any]:
    """``beta`` as above and a per-token log decay of -0.01 (Gated DeltaNet)."""
    (beta,) = _delta_beta(setup, qkv)
    import array_api_compat

    xp = array_api_compat.array_namespace(beta)
    return [
        beta,
        xp.full(beta.shape, -0.01, dtype=beta.dtype, device=array_api_compat.device(beta)),
    ]


@register(
    "delta",
    compare=False,
    extra_inputs=_delta_beta,
    description="the delta rule, chunked (delta_rule_attention)",
)
def _delta(setup: Setup) -> Callable[..., Any]:
    return functools.partial(delta_rule_attention, chunk_size=setup.chunk_size)


@register(
    "delta_gated",
    compare=False,
    extra_inputs=_delta_beta_and_decay,
    description="the gated delta rule, chunked, per-token decay",
)
def _delta_gated(setup: Setup) -> Callable[..., Any]:
    def forward(q: Any, k: Any, v: Any, beta: Any, log_decay: Any) -> Any:
        return delta_rule_attention(q, k, v, beta, log_decay=log_decay, chunk_size=setup.chunk_size)

    return forward


@register(
    "delta_recurrent",
    loop=True,
    compare=False,
    extra_inputs=_delta_beta,
    description="the delta rule, one state update per token",
)
def _delta_recurrent(setup: Setup) -> Callable[..., Any]:
    return functools.partial(delta_rule_attention, method="recurrent")
