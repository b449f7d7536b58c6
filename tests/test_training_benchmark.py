"""benchmarks/training.py: its baselines compute the same attention, its sections run small."""

from __future__ import annotations

import numpy as np
import pytest

from polylin import causal_linear_attention
from polylin.testing import Backend

reason = Backend.TORCH.unavailable_reason()
if reason is not None:
    pytest.skip(f"[torch] {reason}", allow_module_level=True)

torch = Backend.TORCH.module()
from benchmarks import training  # noqa: E402


def _inputs(dtype=torch.float64):
    rng = np.random.default_rng(0)
    return [torch.asarray(rng.standard_normal((2, 128, 16)), dtype=dtype) for _ in range(3)]


def test_plain_chunked_form_is_linear_attention():
    q, k, v = _inputs()
    expected = causal_linear_attention(q, k, v)
    torch.testing.assert_close(training.plain_chunked_torch(q, k, v), expected)
    torch.testing.assert_close(training.polylin_torch_elu(q, k, v), expected)


def test_peers_are_timed_or_skipped_with_a_reason(capsys):
    rows = training.peers([128], 1)
    skipped = rows[0].get("skipped", {})
    timed = rows[-1]
    assert timed["T"] == 128 and timed["polylin_fwd_bwd"] > 0 and "polylin_over_plain" in timed
    for peer in ("fast_transformers", "fla"):
        assert skipped.get(peer) or f"{peer}_fwd_bwd" in timed
    assert '"T": 128' in capsys.readouterr().out


def test_interleaved_reports_wall_and_user_minimums():
    user: dict = {}
    calls = {"a": lambda: sum(range(1000)), "b": lambda: None}
    best = training.interleaved(calls, 3, user)
    assert set(best) == set(user) == {"a", "b"}
    assert all(0 <= user[n] < float("inf") and 0 < best[n] < float("inf") for n in calls)


def test_growth_divides_16k_by_4k_on_both_clocks():
    def row(T, scale):
        times = {f"{n}_fwd_bwd": scale for n in ("polylin", "polylin_torch_elu", "plain")}
        return {"T": T, "d": 64, **times, "user_fwd_bwd": {k: scale / 2 for k in times}}

    growth = training._growth([row(4096, 1.0), row(16384, 4.2)], 64)
    assert growth["polylin_16k_over_4k"] == 4.2 and growth["plain_16k_over_4k_user"] == 4.2
