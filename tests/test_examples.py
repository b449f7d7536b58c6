"""The examples under ``examples/`` run, at tiny sizes, as a user runs them.

- ``char_lm_torch.py`` trains and writes weights, vocabulary, sample and losses; the loss falls;
- ``generate_numpy.py`` prints exactly ``sample.txt`` in a Python where ``import torch`` fails,
  also for the Gated DeltaNet model (``--layer gated-deltanet``), whose blocks are
  ``polylin.torch.GatedDeltaNet``'s;
- ``char_lm_jax.py`` trains the same model: same initial weights and batches, same first loss;
- ``decode_vs_kv_cache.py`` reports a state that stays the same size and a cache that grows;
- bad arguments end with an argparse message (exit status 2), never a traceback.

The scripts run in subprocesses where their environment matters (no PyTorch, JAX's own
configuration), in-process (``main(argv)``) where it does not.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import charlm  # noqa: E402
import decode_vs_kv_cache  # noqa: E402
import generate_numpy  # noqa: E402

TINY = ["--batch", "4", "--context", "24", "--d-model", "16", "--heads", "2", "--layers", "1"]
TINY += ["--threads", "1", "--lr", "1e-2"]
#: The training text is the documentation, so every edit of a page moves the loss curve, and
#: each step's loss is one batch of 96 characters (about +-0.1 between batches): in eight steps
#: the last loss fell by 0.25-0.47 from one version of the pages to the next. Sixteen steps, and
#: the mean of the last four losses (:func:`learned`), fell by 0.54-0.66.
TINY_STEPS = 16


def learned(losses: list[float]) -> bool:
    """The model learns: the mean of the last four losses is 0.3 below the first."""
    return sum(losses[-4:]) / 4 < losses[0] - 0.3


def run_script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *map(str, args)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )


@pytest.fixture(scope="module")
def torch_run(run_once) -> Path:
    """A tiny training run of char_lm_torch.py: its output directory (one run per test run,
    shared by pytest-xdist's workers)."""
    pytest.importorskip("torch")

    def train(out: Path) -> None:
        done = run_script("char_lm_torch.py", "--steps", TINY_STEPS, "--out", out, *TINY)
        assert done.returncode == 0, done.stderr
        assert "loss" in done.stderr  # the progress bar

    return run_once("char-lm-torch", train)


def test_torch_training_writes_weights_vocab_sample_and_losses(torch_run: Path) -> None:
    vocab = charlm.Vocab.load(torch_run / "vocab.json")
    assert vocab == charlm.Vocab.from_text(charlm.training_text())
    weights, n_heads = charlm.load_weights(torch_run / "weights.npz")
    assert n_heads == 2
    assert weights["embed"].shape == (len(vocab), 16)
    assert all(w.dtype == np.float32 for w in weights.values())
    sample = (torch_run / "sample.txt").read_text(encoding="utf-8")
    assert sample.startswith(charlm.PROMPT) and sample.endswith("\n")
    continuation = sample[len(charlm.PROMPT) : -1]
    assert len(continuation) == charlm.SAMPLE_TOKENS and not vocab.unknown(continuation)
    losses = charlm.read_losses(torch_run / "losses.csv")
    assert len(losses) == TINY_STEPS and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(len(vocab)), abs=0.1)  # small initial logits
    assert learned(losses)
    assert (torch_run / "loss.png").stat().st_size > 1000


def torch_blocked_env(tmp_path: Path) -> dict:
    """An environment in which ``import torch`` fails (checked)."""
    blocker = tmp_path / "block_torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class BlockTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked for this test')\n"
        "sys.meta_path.insert(0, BlockTorch())\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
    )
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr
    return env


def test_numpy_generation_reproduces_the_sample_without_torch(torch_run: Path, tmp_path) -> None:
    env = torch_blocked_env(tmp_path)
    done = run_script(
        "generate_numpy.py", torch_run, "--prompt", "The ", "--tokens", "200", env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (torch_run / "sample.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gdn_run(run_once) -> Path:
    """A tiny training run of char_lm_torch.py --layer gated-deltanet: its output directory (one
    run per test run, shared by pytest-xdist's workers)."""
    pytest.importorskip("torch")

    def train(out: Path) -> None:
        done = run_script(
            "char_lm_torch.py", "--steps", TINY_STEPS, "--out", out, "--layer", "gated-deltanet",
            *TINY,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "gated-deltanet layers" in done.stdout

    return run_once("char-lm-gdn", train)


def test_gated_deltanet_model_trains_and_numpy_serves_the_same_text(gdn_run, tmp_path) -> None:
    weights, _ = charlm.load_weights(gdn_run / "weights.npz")
    assert "block0.attn.q_conv1d.weight" in weights and "block0.qkv" not in weights
    losses = charlm.read_losses(gdn_run / "losses.csv")
    assert learned(losses)
    done = run_script("generate_numpy.py", gdn_run, env=torch_blocked_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == (gdn_run / "sample.txt").read_text(encoding="utf-8")


def test_gated_deltanet_blocks_are_polylin_torch_s(gdn_run) -> None:
    """The example's block is polylin.torch.GatedDeltaNet: its weights load by name, and the
    layer gives the example's outputs, whole sequences and one token."""
    torch = pytest.importorskip("torch")
    from polylin.torch import GatedDeltaNet

    weights, n_heads = charlm.load_weights(gdn_run / "weights.npz")
    params = {name: torch.tensor(w, dtype=torch.float64) for name, w in weights.items()}
    d_model = weights["embed"].shape[1]
    layer = GatedDeltaNet(
        hidden_size=d_model, num_heads=n_heads, head_dim=d_model // n_heads, expand_v=1,
        dtype=torch.float64,
    )  # fmt: skip
    prefix = "block0.attn."
    layer.load_state_dict(
        {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
    )
    h = torch.randn(2, 9, d_model, dtype=torch.float64)
    with torch.no_grad():
        out, cache = charlm.gdn_attention(params, 0, h[:, :8], n_heads=n_heads)
        want, layer_cache = layer(h[:, :8], return_cache=True)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        y_t, _ = charlm.gdn_attention(params, 0, h[:, 8], n_heads=n_heads, cache=cache)
        torch.testing.assert_close(y_t, layer.step(h[:, 8], layer_cache)[0], rtol=1e-12, atol=1e-12)


def test_jax_trains_the_same_model(torch_run: Path, tmp_path) -> None:
    pytest.importorskip("jax")
    done = run_script(
        "char_lm_jax.py", "--steps", TINY_STEPS, "--out", tmp_path, "--compare", torch_run, *TINY
    )
    assert done.returncode == 0, done.stderr
    jax_losses = charlm.read_losses(tmp_path / "losses.csv")
    torch_losses = charlm.read_losses(torch_run / "losses.csv")
    # Same initial weights, same first batch: the same loss up to float32 rounding.
    assert jax_losses[0] == pytest.approx(torch_losses[0], abs=1e-5)
    assert learned(jax_losses)
    assert (tmp_path / "loss.png").stat().st_size > 1000


# -- the model itself (NumPy, float64, in-process) -----------------------------------------------
@pytest.fixture(scope="module")
def small_model() -> tuple[dict, int]:
    params = charlm.init_params(11, d_model=12, n_heads=3, n_layers=2, seed=1)
    rng = np.random.default_rng(2)
    # Trained weights are not small: perturb the gains too so every parameter matters.
    return {
        n: (w + 0.3 * rng.standard_normal(w.shape)).astype(np.float64) for n, w in params.items()
    }, 3


def test_decoding_with_step_matches_the_whole_sequence(small_model) -> None:
    params, n_heads = small_model
    tokens = np.random.default_rng(3).integers(0, 11, size=(2, 9))
    whole = charlm.forward(params, tokens, n_heads=n_heads)
    logits, cache = charlm.forward(params, tokens[:, :5], n_heads=n_heads, return_cache=True)
    np.testing.assert_allclose(logits, whole[:, :5], rtol=1e-10, atol=1e-12)
    for t in range(5, 9):
        logits, cache = charlm.decode(params, tokens[:, t], cache, n_heads=n_heads)
        np.testing.assert_allclose(logits, whole[:, t], rtol=1e-10, atol=1e-12)


def test_generate_is_greedy(small_model) -> None:
    params, n_heads = small_model
    prompt = np.array([1, 4, 2])
    tokens, margin = charlm.generate(params, prompt, 6, n_heads=n_heads)
    sequence = list(prompt)
    for token in tokens:  # each new token is the argmax of the whole sequence's last logits
        logits = charlm.forward(params, np.array([sequence]), n_heads=n_heads)[0, -1]
        assert token == int(np.argmax(logits))
        sequence.append(token)
    assert margin > 0


def test_the_model_is_the_same_in_torch_and_numpy(small_model) -> None:
    torch = pytest.importorskip("torch")
    params, n_heads = small_model
    tokens = np.random.default_rng(4).integers(0, 11, size=(2, 7))
    expected = charlm.forward(params, tokens, n_heads=n_heads)
    as_torch = {n: torch.from_numpy(w) for n, w in params.items()}
    got = charlm.forward(as_torch, torch.from_numpy(tokens), n_heads=n_heads).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_cross_entropy_matches_a_reference() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 4, 6)) * 50  # large logits: no overflow
    targets = rng.integers(0, 6, size=(3, 4))
    m = logits.max(axis=-1, keepdims=True)
    log_probs = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
    assert charlm.cross_entropy(logits, targets) == pytest.approx(expected, rel=1e-12)


# -- decoding cost ---------------------------------------------------------------------------------
def test_decode_benchmark_state_stays_fixed_while_the_cache_grows(tmp_path, capsys) -> None:
    argv = ["--max-context", "256", "--points", "3", "--tokens", "2", "--heads", "2"]
    assert decode_vs_kv_cache.main([*argv, "--d-head", "8", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = __import__("json").loads((tmp_path / "decode.json").read_text())["rows"]
    assert [r["context"] for r in rows] == [64, 128, 256]
    for r in rows:
        assert f"{r['context']:>8} |" in printed
        assert r["state_bytes"] == 2 * (8 * 8 + 8) * 4  # heads x (d x d + d) float32
        assert r["kv_cache_bytes"] == 2 * 2 * (r["context"] + 1) * 8 * 4
        assert r["polylin_peak_bytes"] >= r["state_bytes"]
        assert r["softmax_peak_bytes"] >= r["kv_cache_bytes"]
        assert r["polylin_ms_per_token"] > 0 and r["softmax_ms_per_token"] > 0
    assert (tmp_path / "decode.png").stat().st_size > 1000


def test_decode_benchmark_on_torch(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    argv = ["--backend", "torch", "--max-context", "64", "--points", "2", "--tokens", "2"]
    assert (
        decode_vs_kv_cache.main([*argv, "--heads", "1", "--d-head", "4", "--out", str(tmp_path)])
        == 0
    )
    assert "torch; median of 2 tokens" in capsys.readouterr().out
    rows = __import__("json").loads((tmp_path / "decode.json").read_text())["rows"]
    assert [r["state_bytes"] for r in rows] == [(4 * 4 + 4) * 4] * 2
    assert all(r["polylin_peak_bytes"] is None for r in rows)  # tracemalloc sees NumPy only


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_decode_benchmark_computes_attention(backend: str) -> None:
    """Both decoders give the attention they claim: linear attention and exact softmax."""
    if backend == "torch":
        torch = pytest.importorskip("torch")
        grad_enabled, threads = torch.is_grad_enabled(), torch.get_num_threads()
    lib = decode_vs_kv_cache.Library(backend, None)
    if backend == "torch":  # in-process: it must leave PyTorch's global settings alone
        assert (torch.is_grad_enabled(), torch.get_num_threads()) == (grad_enabled, threads)
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((3, 1, 2, 4101, 8), dtype=np.float32)  # > one prefill piece
    context = 4100
    state = decode_vs_kv_cache.prefill_state(
        lib, lib.asarray(k[..., :context, :]), lib.asarray(v[..., :context, :])
    )
    phi = np.where(k > 0, k + 1, np.exp(np.minimum(k, 0))).astype(np.float64)
    np.testing.assert_allclose(
        np.asarray(state.S), phi[..., :context, :].swapaxes(-1, -2) @ v[..., :context, :], rtol=1e-4
    )
    cache_k, cache_v = decode_vs_kv_cache.kv_cache(
        lib, lib.asarray(k[..., :context, :]), lib.asarray(v[..., :context, :]), 1
    )
    out = decode_vs_kv_cache.softmax_decode(
        lib, cache_k, cache_v, context, *(lib.asarray(x[..., context, :]) for x in (q, k, v))
    )
    keys, query = k.astype(np.float64), q[..., context, :, None].astype(np.float64)
    scores = (keys @ query)[..., 0] / np.sqrt(8)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (weights / weights.sum(axis=-1, keepdims=True))[..., None, :] @ v
    np.testing.assert_allclose(np.asarray(out), expected[..., 0, :], rtol=1e-4, atol=1e-6)


# -- bad arguments ---------------------------------------------------------------------------------
def _argparse_error(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: dir"),
        (["{missing}"], "has no weights.npz"),
        (["{dir}", "--prompt", "The 🙂"], "outside the model's vocabulary: '🙂'"),
        (["{dir}", "--prompt", ""], "--prompt must not be empty"),
        (["{dir}", "--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
        (["{dir}", "--tokens", "-3"], "argument --tokens: expected a positive integer, got -3"),
        (["{dir}", "--tokens", "ten"], "argument --tokens: expected a positive integer, got 'ten'"),
    ],
)
def test_generate_numpy_bad_arguments(argv, message, tmp_path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    charlm.save_weights(
        model / "weights.npz",
        charlm.init_params(4, d_model=4, n_heads=1, n_layers=1, seed=0),
        n_heads=1,
    )
    charlm.Vocab("The ").save(model / "vocab.json")
    argv = [a.format(dir=model, missing=tmp_path / "nowhere") for a in argv]
    assert message in _argparse_error(generate_numpy.main, argv, capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--d-model", "10", "--heads", "4"], "--d-model (10) must be a multiple of --heads (4)"),
        (["--lr", "-1"], "argument --lr: expected a positive number, got -1.0"),
    ],
)
@pytest.mark.parametrize("script", ["char_lm_torch", "char_lm_jax"])
def test_training_bad_arguments(script, argv, message, tmp_path, capsys) -> None:
    if script == "char_lm_torch":
        pytest.importorskip("torch")
        argv = [*argv, "--out", str(tmp_path)]
    module = __import__(script)
    assert message in _argparse_error(module.main, argv, capsys)


def test_torch_training_needs_out(capsys) -> None:
    pytest.importorskip("torch")
    import char_lm_torch

    assert "--out" in _argparse_error(char_lm_torch.main, ["--steps", "3"], capsys)


def test_jax_compare_needs_losses(tmp_path, capsys) -> None:
    import char_lm_jax

    err = _argparse_error(char_lm_jax.main, ["--compare", str(tmp_path), "--out", "x"], capsys)
    assert "has no losses.csv" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-context", "0"], "argument --max-context: expected a positive integer, got 0"),
        (["--tokens", "-1"], "argument --tokens: expected a positive integer, got -1"),
        (["--backend", "cupy"], "argument --backend: invalid choice"),
    ],
)
def test_decode_bad_arguments(argv, message, capsys) -> None:
    assert message in _argparse_error(decode_vs_kv_cache.main, argv, capsys)
