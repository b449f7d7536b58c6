"""Dask: lazy results, chunks along batch/heads processed independently, chunks along T, and a
real ``distributed.LocalCluster`` of two worker processes (plus the scale-out run's smoke test).

The cross-backend suite (tests/test_attention.py) already runs every case on single-chunk Dask
arrays; here the inputs are split into several Dask chunks along each axis.
"""

from __future__ import annotations

import json
from itertools import pairwise

import numpy as np
import pytest

import polylin
from polylin import (
    LinearAttentionState,
    causal_linear_attention,
    linear_attention,
    masked_kernel_attention,
    step,
)
from polylin.testing import Backend

from .reference import masked_kernel

try:
    import dask
    import dask.array as da
except ImportError:  # every test here takes the dask backend, which skips with the reason
    dask = da = None

# Each test is generated for the dask backend alone (and skips with its reason where Dask cannot
# run); the entry points are called as written: these tests check laziness themselves.
pytestmark = [pytest.mark.only_backend(Backend.DASK), pytest.mark.eager]


@pytest.fixture(autouse=True)
def _dask_backend(backend):
    return backend


def _qkv(rng, lead, t, d_k=6, d_v=5):
    return (
        rng.standard_normal((*lead, t, d_k)),
        rng.standard_normal((*lead, t, d_k)),
        rng.standard_normal((*lead, t, d_v)),
    )


def _refuse_to_compute(dsk, keys, **kwargs):
    raise AssertionError("a Dask graph was computed inside a polylin call")


def _tracked(x: np.ndarray, chunks, log: list, tag: str):
    """``x`` as a Dask array whose blocks append ``(tag, chunk location)`` to ``log`` when
    they are evaluated."""

    def record(block, block_info=None):
        log.append((tag, tuple(block_info[0]["chunk-location"])))
        return block

    return da.from_array(x, chunks=chunks).map_blocks(record, dtype=x.dtype)


def test_every_entry_point_is_lazy(rng):
    """No computation happens inside a call: the scheduler that would run it raises."""
    arrays = _qkv(rng, (2, 3), 20)
    log: list = []
    q, k, v = (_tracked(a, (1, 1, 8, -1), log, n) for a, n in zip(arrays, "qkv"))
    mask = da.from_array(rng.random((2, 3, 20)) > 0.3, chunks=(1, 1, 8))
    with dask.config.set(scheduler=_refuse_to_compute):
        results = {
            f"causal-{m}": causal_linear_attention(q, k, v, method=m, chunk_size=4)
            for m in polylin.METHODS
        }
        out, state = causal_linear_attention(
            q, k, v, chunk_size=4, attention_mask=mask, return_state=True
        )
        results["masked"] = out
        results["state.S"], results["state.z"] = state
        results["continued"] = causal_linear_attention(q, k, v, initial_state=state)
        results["varlen"] = causal_linear_attention(q, k, v, cu_seqlens=[0, 7, 20])
        results["linear"] = linear_attention(q, k, v, attention_mask=mask)
        results["kernel"] = masked_kernel_attention(q, k, v)
        o_t, step_state = step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
        results["step"], results["step.S"] = o_t, step_state.S
    assert log == []  # no input block was ever evaluated
    for name, x in results.items():
        assert isinstance(x, da.Array), name
    # And they are right once computed.
    expected = masked_kernel(*arrays)
    for m in polylin.METHODS:
        np.testing.assert_allclose(results[f"causal-{m}"].compute(), expected, rtol=0, atol=1e-10)
    assert log  # now the inputs were evaluated
    np.testing.assert_allclose(
        results["masked"].compute(),
        masked_kernel(*arrays, mask=np.asarray(mask)),
        rtol=0,
        atol=1e-10,
    )


@pytest.mark.parametrize("method", polylin.METHODS)
def test_batch_and_head_chunks_are_independent(method, rng):
    """Chunks along batch/heads stay chunks of the output, and computing one output chunk
    evaluates only the matching input chunks (so chunks run in parallel, one task chain each)."""
    lead, t = (3, 4), 24
    arrays = _qkv(rng, lead, t)
    log: list = []
    chunks = (1, 2, -1, -1)
    q, k, v = (_tracked(a, chunks, log, n) for a, n in zip(arrays, "qkv"))
    out = causal_linear_attention(q, k, v, method=method, chunk_size=8)
    assert out.chunks[:2] == q.chunks[:2] == ((1, 1, 1), (2, 2))
    with dask.config.set(scheduler="synchronous"):
        block = out.blocks[2, 1].compute()
    assert sorted(set(log)) == [(n, (2, 1, 0, 0)) for n in "kqv"]
    np.testing.assert_allclose(
        block, masked_kernel(*(a[2:3, 2:4] for a in arrays)), rtol=0, atol=1e-10
    )
    # The graph grows linearly with the number of chunks: no all-to-all step between them.
    more = [da.from_array(np.concatenate([a, a], axis=0), chunks=chunks) for a in arrays]
    n_tasks = len(causal_linear_attention(*more, method=method, chunk_size=8).dask)
    assert n_tasks <= 2 * len(out.dask) + 10


# The quadratic form's T x T scores multiply the chunks of T-chunked inputs: Dask says so.
@pytest.mark.filterwarnings("ignore::dask.array.PerformanceWarning")
@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.parametrize("t_chunk", [5, 16, 24, 50])
def test_sequence_chunks(method, t_chunk, rng):
    """Inputs chunked along T (smaller, equal to, a multiple of, and not a multiple of
    chunk_size): the state's prefix sum crosses Dask chunks."""
    t = 50 if method == "recurrent" else 70
    arrays = _qkv(rng, (2,), t)
    xs = [da.from_array(a, chunks=(1, t_chunk, -1)) for a in arrays]
    out, state = causal_linear_attention(*xs, method=method, chunk_size=8, return_state=True)
    assert isinstance(out, da.Array) and isinstance(state.S, da.Array)
    np.testing.assert_allclose(out.compute(), masked_kernel(*arrays), rtol=0, atol=1e-10)
    _, expected = causal_linear_attention(*arrays, return_state=True)
    np.testing.assert_allclose(state.S.compute(), expected.S, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(state.z.compute(), expected.z, rtol=1e-12, atol=1e-10)


def test_sequence_chunks_with_mask_state_and_varlen(rng):
    t = 60
    arrays = _qkv(rng, (2, 2), t)
    xs = [da.from_array(a, chunks=(1, 2, 16, -1)) for a in arrays]
    mask = rng.random((2, 2, t)) > 0.3
    out = causal_linear_attention(
        *xs, chunk_size=8, attention_mask=da.from_array(mask, chunks=(1, 2, 16))
    )
    np.testing.assert_allclose(out.compute(), masked_kernel(*arrays, mask=mask), rtol=0, atol=1e-10)
    # Continue from the state of a prefix: prefix and rest are themselves chunked along T.
    cut = 23
    _, prefix = causal_linear_attention(*(x[..., :cut, :] for x in xs), return_state=True)
    assert isinstance(prefix, LinearAttentionState)
    rest = causal_linear_attention(*(x[..., cut:, :] for x in xs), initial_state=prefix)
    np.testing.assert_allclose(
        rest.compute(), masked_kernel(*arrays)[..., cut:, :], rtol=0, atol=1e-10
    )
    offsets = [0, 9, 30, t]
    out = causal_linear_attention(*xs, chunk_size=8, cu_seqlens=offsets).compute()
    for a, b in pairwise(offsets):
        piece = [x[..., a:b, :] for x in arrays]
        np.testing.assert_allclose(out[..., a:b, :], masked_kernel(*piece), atol=1e-10)


def test_linear_attention_chunked_keys(rng):
    q = rng.standard_normal((3, 13, 6))
    k = rng.standard_normal((3, 40, 6))
    v = rng.standard_normal((3, 40, 4))
    out = linear_attention(
        da.from_array(q, chunks=(1, 5, -1)),
        da.from_array(k, chunks=(2, 7, -1)),
        da.from_array(v, chunks=(2, 7, -1)),
    )
    np.testing.assert_allclose(
        out.compute(), masked_kernel(q, k, v, causal=False), rtol=0, atol=1e-10
    )


def test_unknown_chunk_sizes_raise_a_clear_error(rng):
    x = da.from_array(rng.standard_normal((4, 10, 3)), chunks=(2, -1, -1))
    unknown = x[x[:, 0, 0] > -np.inf]  # boolean indexing: Dask no longer knows the batch size
    assert np.isnan(unknown.shape[0])
    with pytest.raises(ValueError, match=r"q has unknown dimensions .*compute_chunk_sizes"):
        causal_linear_attention(unknown, unknown, unknown)
    with pytest.raises(ValueError, match=r"k has unknown dimensions"):
        linear_attention(x, unknown, unknown)
    known = unknown.compute_chunk_sizes()
    np.testing.assert_allclose(
        causal_linear_attention(known, known, known).compute(),
        causal_linear_attention(*(x.compute(),) * 3),
        rtol=0,
        atol=1e-12,
    )


# -- a real distributed cluster -------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed", reason="dask.distributed is not installed")
    import logging

    with distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        memory_limit="1GB",
        dashboard_address=":0",  # any free port: other clusters may hold 8787
        silence_logs=logging.ERROR,
    ) as local:
        yield local


@pytest.fixture
def client(cluster):
    from distributed import Client

    with Client(cluster) as c:
        yield c


def test_distributed_cluster_matches_reference(client, rng):
    """Inputs made lazily on the workers, chunked along batch and T, computed on two worker
    processes; every output chunk is compared with the float64 reference."""
    shape, chunks = (4, 2, 40, 6), (1, 2, 16, -1)
    seeded = da.random.RandomState(7)
    q, k, v = (seeded.standard_normal(shape, chunks=chunks) for _ in range(3))
    out = causal_linear_attention(q, k, v, chunk_size=8)
    persisted = client.persist(out)
    from distributed import futures_of, wait

    wait(persisted)
    holders = {w for ws in client.who_has(persisted).values() for w in ws}
    assert len(holders) == 2  # both worker processes computed output chunks
    got = persisted.compute()
    inputs = [np.asarray(x.compute()) for x in (q, k, v)]
    np.testing.assert_allclose(got, masked_kernel(*inputs), rtol=0, atol=1e-10)
    assert len(futures_of(persisted)) == 4 * len(out.chunks[2])

    # The other methods, with a state, reduced on the workers.
    for method in ("recurrent", "quadratic"):
        small = [x[..., :20, :] for x in (q, k, v)]
        o, state = causal_linear_attention(*small, method=method, return_state=True)
        total = client.compute(o.sum(axis=(-2, -1))).result()
        np.testing.assert_allclose(
            total,
            masked_kernel(*(x[..., :20, :] for x in inputs)).sum(axis=(-2, -1)),
            rtol=1e-12,
        )
        np.testing.assert_allclose(
            client.compute(state.z).result(),
            causal_linear_attention(*(x[..., :20, :] for x in inputs), return_state=True)[1].z,
            rtol=1e-12,
        )


def test_scaleout_quick_on_running_cluster(cluster, tmp_path, capsys):
    """``run.py dask --quick --scheduler ADDRESS``: the path a multi-machine cluster takes."""
    from benchmarks.run import main

    rc = main(
        ["dask", "--quick", "--scheduler", cluster.scheduler_address, "--out", str(tmp_path)]
    )
    assert rc == 0
    results = json.loads((tmp_path / "dask-scaleout-quick.json").read_text())
    (run_,) = results["runs"]
    assert run_["workers"] == 2 and run_["workers_alive_at_end"] == 2
    assert run_["tokens_per_s"] > 0 and run_["seconds"] > 0
    assert run_["first_chunk_max_rel_error"] < 1e-5  # float32 against an eager NumPy run
    assert "chunks done" in capsys.readouterr().out  # progress lines


@pytest.mark.slow
def test_scaleout_quick_local_cluster(tmp_path):
    """``run.py dask --quick`` on a local cluster it starts (one worker: the two-worker path is
    the running cluster's above); its checksum is that of the same graph computed here."""
    from benchmarks.dask_scaleout import QUICK, build_graph
    from benchmarks.run import main

    assert main(["dask", "--quick", "--workers", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "dask-scaleout-quick.json").read_text())
    (one,) = results["runs"]
    assert one["workers"] == 1
    sums, _ = build_graph(**QUICK, chunk_size=64, dtype="float32", seed=0)
    expected = float(sums.compute(scheduler="threads").sum())
    assert one["checksum"] == pytest.approx(expected, rel=1e-6)
    assert results["input_bytes"] == 3 * 2 * 4 * 512 * 16 * 4
    assert one["spilled_bytes"] == 0 and one["workers_alive_at_end"] == 1
    assert one["cores_busy"] > 0 and one["eager_numpy_tokens_per_s"] > 0
    assert [row["workers"] for row in results["summary"]] == [1]
