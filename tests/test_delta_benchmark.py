"""benchmarks/delta_rule.py: its peers compute polylin's function, its sections run small."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import delta_rule  # noqa: E402

PEERS = ["transformers_gdn", "transformers_kda", "fla_naive_gdn", "fla_naive_kda"]


@pytest.mark.parametrize("name", PEERS)
def test_each_peer_equals_polylin(name):
    """transformers' and fla's pure-PyTorch chunked forms (scale d ** -0.5, layout (B, T, H, d))
    give polylin's output to float32 round-off, for a scalar gate (GDN) and per channel (KDA)."""
    found, skipped = delta_rule.peer_calls()
    if name not in found:
        pytest.skip(f"{name}: {skipped[name]}")
    assert delta_rule.check_peer(name, delta_rule.peer(found[name])) < 1e-5


def test_a_wrong_peer_is_refused():
    def wrong(q, k, v, g, beta, chunk_size):
        return v, None

    with pytest.raises(AssertionError, match="differs from polylin"):
        delta_rule.check_peer("wrong_kda", delta_rule.peer(wrong))


def test_peers_run_small_at_each_size():
    """The peers section times polylin and every peer found, checked first, at the size asked;
    sizes parse as ``T:d[:kinds]``."""
    assert delta_rule.peer_size("4096:64") == (4096, 64, ("gdn", "kda"))
    assert delta_rule.peer_size("16384:128:gdn") == (16384, 128, ("gdn",))
    result = delta_rule.peers(1, length=64, d=32, kinds=("gdn",))
    found = [name for name in result["errors"]]
    assert all(name.endswith("_gdn") for name in found)
    for name in ["polylin_gdn", *found]:
        for mode in ("fwd", "fwd_bwd"):
            assert result["seconds"][f"{name}_{mode}"]["wall"] > 0


def test_block_sizes_run_small(monkeypatch):
    """benchmarks/blocks.py times one configuration per process; in-process it runs small.
    Its budgets and PyTorch's threads are the process's: put back for the tests after it."""
    import torch

    import polylin._forms.delta.chunked as delta
    import polylin._forms.linear.chunked as linear
    from benchmarks import blocks

    monkeypatch.setattr(delta, "BLOCK_ROWS", delta.BLOCK_ROWS)
    monkeypatch.setattr(linear, "BLOCK_BYTES", linear.BLOCK_BYTES)
    threads = torch.get_num_threads()
    try:
        for kind in ("forward", "fwd+bwd"):
            for form in ("gdn", "gla"):
                timed = blocks.child(1, 64, kind, 128, d=8, calls=1, form=form)
                assert timed["ms"] > 0 and timed["sys_ms"] >= 0
    finally:
        torch.set_num_threads(threads)


def test_peak_memory_runs_small():
    out = delta_rule.peak_memory(length=256)
    for layout in ("grouped", "repeated"):
        assert out[f"{layout}_saved_MiB"] > 0 and out[f"{layout}_MiB"] >= 0
