"""benchmarks/jax_gated.py: its lax.scan baseline is the gated recurrence; a case runs small."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polylin.testing import Backend

reason = Backend.JAX.unavailable_reason()
if reason is not None:
    pytest.skip(f"[jax] {reason}", allow_module_level=True)

from benchmarks import jax_gated  # noqa: E402


def _loop(q, k, v, g):
    """The gated recurrence in float64: S = diag(exp(g_t)) S + k_t v_t^T, o_t = S^T q_t (no
    gate: g = 0)."""
    g = np.broadcast_to(0.0 if g is None else g, q.shape)
    S = np.zeros((*q.shape[:-2], q.shape[-1], v.shape[-1]))
    out = []
    for t in range(q.shape[-2]):
        S = np.exp(g[..., t, :, None]) * S + k[..., t, :, None] * v[..., t, None, :]
        out.append(np.einsum("...c,...cv->...v", q[..., t, :], S))
    return np.stack(out, axis=-2)


@pytest.mark.parametrize("gate", jax_gated.GATES)
def test_scan_baseline_is_the_gated_recurrence(gate):
    q, k, v, g, _ = jax_gated.inputs(24, gate)
    out = np.asarray(jax_gated.scan_attention(q, k, v, g), dtype=np.float64)
    as64 = [None if x is None else np.asarray(x, dtype=np.float64) for x in (q, k, v, g)]
    np.testing.assert_allclose(out, _loop(*as64), rtol=1e-5, atol=1e-6)


def test_inputs_have_the_gate_shapes_of_gla():
    q, _, _, scalar, _ = jax_gated.inputs(8, "scalar")
    _, _, _, channel, _ = jax_gated.inputs(8, "channel")
    assert q.shape == (2, 4, 8, 64) and scalar.shape == (2, 4, 8, 1)
    assert channel.shape == (2, 4, 8, 64)
    assert float(scalar.max()) < 0 and float(channel.min()) > -1.0  # logsigmoid / 16


def test_a_small_run_records_compile_and_steady_times(tmp_path, capsys):
    out = tmp_path / "jax.json"
    small = ["--lengths", "16", "--gates", "none", "scalar", "--repeats", "1"]
    rows = jax_gated.main([*small, "--recurrent-max-len", "0", "--json", str(out)])
    assert [row["gate"] for row in rows] == ["none", "scalar"]
    for row in rows:
        assert row["T"] == 16 and "recurrent_forward_ms" not in row  # above recurrent-max-len
        for form in ("chunked", "scan"):
            for pass_ in ("forward", "grad"):
                assert row[f"{form}_{pass_}_ms"] > 0 and row[f"{form}_compile_{pass_}_s"] > 0
        assert row["scan_over_chunked_forward"] > 0
    saved = json.loads(out.read_text())
    assert saved["cases"] == rows and "load_average_after" in saved["machine"]
    assert '"T": 16' in capsys.readouterr().out
