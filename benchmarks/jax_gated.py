"""JAX on the CPU: linear attention's compile time and steady state, forward and gradient.

Without a gate, with a scalar gate per token (simple GLA, Mamba-2) and with a per-channel gate
(GLA), ``normalize=False``, identity feature map, float32, batch x heads = 8, d = 64, this times
under ``jax.jit``:

- ``chunked``: ``polylin.causal_linear_attention(method="chunked")``, the default (on the CPU
  the policy runs its forward as a scan over the tokens and its gradient as the chunked form's:
  ``polylin._backend.execution.scans_tokens``);
- ``recurrent``: polylin's per-token form (a Python loop over the tokens, unrolled into the
  compiled program: timed up to ``--recurrent-max-len`` only);
- ``scan``: the recurrence a JAX user writes by hand, one ``jax.lax.scan`` step per token.

Each is compiled once (``jit(f).lower(...).compile()``, timed: the compile time) and then called
``--repeats`` times in alternation with the others, each timed call right after an untimed one
of its own (the steady state: the median). The gradient
is ``jit(grad(sum(f(q, k, v, g) * w)))`` with respect to q, k, v and the gate. Every form is
first checked against the chunked one (float32, within 1e-3 of the output's scale).

    python benchmarks/jax_gated.py [--lengths 1024 4096] [--repeats 5] [--json out.json]

One JSON line per case goes to stdout; ``--json`` writes them all with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

BATCH, HEADS, D = 2, 4, 64
GATES = ("none", "scalar", "channel")
FORMS = ("chunked", "recurrent", "scan")


def scan_attention(q: Any, k: Any, v: Any, log_decay: Any) -> Any:
    """The gated recurrence as a plain ``jax.lax.scan`` over the tokens (no normalizer)."""
    import jax
    import jax.numpy as jnp

    per_token = [q, k, v] + ([] if log_decay is None else [jnp.broadcast_to(log_decay, q.shape)])

    def token(S, x):
        q_t, k_t, v_t, *g_t = x
        if g_t:
            S = jnp.exp(g_t[0])[..., :, None] * S
        S = S + k_t[..., :, None] * v_t[..., None, :]
        return S, jnp.einsum("...c,...cv->...v", q_t, S)

    S0 = jnp.zeros((*q.shape[:-2], q.shape[-1], v.shape[-1]), q.dtype)
    _, out = jax.lax.scan(token, S0, tuple(jnp.moveaxis(x, -2, 0) for x in per_token))
    return jnp.moveaxis(out, 0, -2)


def _form(name: str):
    from polylin import causal_linear_attention
    from polylin.feature_maps import identity

    if name == "scan":
        return scan_attention

    def polylin_form(q, k, v, g):
        return causal_linear_attention(q, k, v, identity, log_decay=g, normalize=False, method=name)

    return polylin_form


def inputs(T: int, gate: str, seed: int = 0) -> tuple[Any, ...]:
    """q, k, v of shape (2, 4, T, 64), a gate in (-1/16, 0) (``None`` for ``"none"``), and an
    output cotangent."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (BATCH, HEADS, T, D)
    q, k, v, w = (jnp.asarray(rng.standard_normal(shape) / 8, dtype=jnp.float32) for _ in "qkvw")
    if gate == "none":
        return q, k, v, None, w
    width = 1 if gate == "scalar" else D
    x = rng.standard_normal((BATCH, HEADS, T, width))
    g = jnp.asarray(-np.logaddexp(0.0, -x) / 16, dtype=jnp.float32)  # logsigmoid / 16, as GLA
    return q, k, v, g, w


def compiled(fn, args: tuple[Any, ...]) -> tuple[Any, float]:
    """``jax.jit(fn)`` lowered and compiled for ``args``, and the seconds that took."""
    import jax

    start = time.perf_counter()
    program = jax.jit(fn).lower(*args).compile()
    return program, time.perf_counter() - start


def case(T: int, gate: str, *, repeats: int, recurrent_max_len: int) -> dict[str, Any]:
    """Compile and time every form of one (T, gate) case, forward and gradient."""
    import jax
    import jax.numpy as jnp

    q, k, v, g, w = inputs(T, gate)
    forms = [f for f in FORMS if f != "recurrent" or T <= recurrent_max_len]
    row: dict[str, Any] = {"T": T, "gate": gate, "d": D, "batch_heads": BATCH * HEADS}
    programs = {}
    reference = None
    for name in forms:
        fn = _form(name)

        def loss(q, k, v, g, fn=fn):
            return jnp.sum(fn(q, k, v, g) * w)

        forward, row[f"{name}_compile_forward_s"] = compiled(fn, (q, k, v, g))
        gradient, row[f"{name}_compile_grad_s"] = compiled(
            jax.grad(loss, argnums=(0, 1, 2) if g is None else (0, 1, 2, 3)), (q, k, v, g)
        )
        out = forward(q, k, v, g).block_until_ready()
        if reference is None:
            reference = out
        error = float(jnp.max(jnp.abs(out - reference)) / jnp.max(jnp.abs(reference)))
        assert error < 1e-3, f"{name} differs from chunked by {error:.1e} (T={T}, {gate})"
        jax.block_until_ready(gradient(q, k, v, g))  # first call outside the timings
        programs[f"{name}_forward"] = lambda p=forward: p(q, k, v, g).block_until_ready()
        programs[f"{name}_grad"] = lambda p=gradient: jax.block_until_ready(p(q, k, v, g))
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(repeats):  # alternate, so that a load change hits every form alike
        for name, call in programs.items():
            # Once untimed first: the call before (a scan's gradient keeps a state per token,
            # hundreds of MiB) frees memory that the next call's first run pays to map again;
            # timed straight after it, polylin's forward measured 2-4x its own steady state.
            call()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        row[f"{name}_ms"] = round(statistics.median(ts) * 1e3, 3)
    for name in forms:
        for pass_ in ("forward", "grad"):
            row[f"{name}_compile_{pass_}_s"] = round(row[f"{name}_compile_{pass_}_s"], 3)
    for pass_ in ("forward", "grad"):
        row[f"scan_over_chunked_{pass_}"] = round(
            row[f"scan_{pass_}_ms"] / row[f"chunked_{pass_}_ms"], 3
        )
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--gates", nargs="+", choices=GATES, default=list(GATES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--recurrent-max-len",
        type=int,
        default=256,
        help="time polylin's recurrent form up to this T (it unrolls: compile grows with T)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import jax

    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(machine), flush=True)
    rows = []
    for T in args.lengths:
        for gate in args.gates:
            row = case(T, gate, repeats=args.repeats, recurrent_max_len=args.recurrent_max_len)
            print(json.dumps(row), flush=True)
            rows.append(row)
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "cases": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
