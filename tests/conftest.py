"""Test configuration: library settings, and one ``backend`` fixture over every driver.

Settings are made here, explicitly, never by the drivers: JAX runs with ``jax_enable_x64`` on
(XLA's optimizations off: the arrays are tiny; float32 matmuls at full precision, not TF32),
array-api-strict with :data:`polylin.testing.STRICT_FLAGS`.

``backend`` is generated for every selected driver (``POLYLIN_BACKENDS=numpy,torch`` narrows
the set; unusable ones skip with the reason), plus ``jax:x32`` (JAX with x64 off, as users run
it by default) for every test that takes a ``dtype`` parameter. Only valid combinations are
generated: a ``dtype`` the backend lacks (array-api-strict's float16, NumPy's bfloat16, float64
under ``jax:x32``) is never collected. Markers, in the style of array-api-extra:

- ``@pytest.mark.skip_backend(Backend.DASK, ..., reason="...")``: not generated for those;
- ``@pytest.mark.only_backend(Backend.TORCH, ...)``: generated for those alone;
- ``@pytest.mark.not_generated(reason, **params)``: the combinations whose parameters all take
  the given values (a value or a list of values; backends by id) are not generated;
- ``@pytest.mark.eager``: the entry points run as the test calls them (no automatic jit on
  JAX, no compute guard on Dask);
- ``@pytest.mark.slow_grid(cover=("method",), prefer={"case": "ragged"})``: a grid whose full
  product runs in ``make test-slow`` (``pytest -m slow``). ``make test`` runs every combination
  on the cheap eager CPU backends (``full_on``: NumPy, PyTorch and array-api-strict unless
  given) and, on each other backend (JAX, which compiles every new shape; Dask; the GPUs), a
  covering subset: the fewest combinations (greedily) in which every value of each parameter
  named in ``cover`` occurs (one combination if none is named), taken first from those
  matching ``prefer`` (a value or a list of values per parameter). The rest is marked
  ``slow``: together the two runs check the whole grid, and every test runs on every backend in
  ``make test``. Without a ``backend`` parameter the subset is taken over all of the test's
  combinations.

A backend that cannot run here (no GPU, a library not installed) is skipped with the reason by
a ``skip`` mark given at collection, so that its tests skip before any fixture is set up.

On JAX and Dask, the public functions of polylin that a test module imports by name run as
users run them: on JAX under ``jax.jit`` (arrays traced, every other argument static; compiled
programs are reused across tests), except ``method="recurrent"``, a Python loop over T that jit
would unroll into a program the size of the sequence (``tests/test_jax.py`` covers it under jit
at short T); on Dask, a call that computes the graph more than once raises
(``array_api_extra.testing.lazy_xp_function``; once: FAVOR+ persists its projection).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from array_api_extra.testing import lazy_xp_function, patch_lazy_xp_functions

import polylin
from polylin.testing import STRICT_FLAGS, Backend, selected_backends

#: The test-only id of JAX with x64 off.
JAX_X32 = "jax:x32"

#: Where a ``slow_grid`` test runs its whole grid in ``make test``: the eager CPU backends, on
#: which a small case costs a few milliseconds (JAX compiles each new shape, Dask builds graphs).
FULL_GRID_BACKENDS = ("numpy", "torch", "array_api_strict")


def _selection() -> tuple[list[Backend], bool]:
    """The drivers named in ``$POLYLIN_BACKENDS`` (all by default), and whether ``jax:x32`` is."""
    names = os.environ.get("POLYLIN_BACKENDS", "")
    if not names.strip():
        return list(Backend), True
    x32 = JAX_X32 in [n.strip() for n in names.split(",")]
    rest = ",".join(n for n in names.split(",") if n.strip() != JAX_X32)
    return selected_backends(names=rest) if rest.strip() else [], x32


BACKENDS, WITH_X32 = _selection()

#: polylin's public functions: run under jit on JAX, checked lazy on Dask.
ENTRY_POINTS = [f for f in map(polylin.__dict__.get, polylin.__all__) if inspect.isfunction(f)]
# Dask: at most one computation inside a call: FAVOR+ persists its projection (a cached constant,
# polylin._backend.execution.materialized) when it is first built. tests/test_dask.py checks
# that the default path computes nothing at all. JAX: see _under_jit.
for _entry_point in ENTRY_POINTS:
    lazy_xp_function(_entry_point, jax_jit=False, allow_dask_compute=1)

_JIT_CACHE: dict[Any, Callable[..., Any]] = {}


def _under_jit(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` under ``jax.jit`` with its JAX arrays traced and every other argument static."""
    import jax

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        traced = tuple(isinstance(x, jax.Array) for x in leaves)
        if kwargs.get("method") == "recurrent" or not any(traced):
            return func(*args, **kwargs)
        static = tuple(None if t else x for x, t in zip(leaves, traced))
        key = (func, treedef, traced, static)
        try:
            compiled = _JIT_CACHE.get(key)
        except TypeError:  # an unhashable option (a feature map object): run it as is
            return func(*args, **kwargs)
        if compiled is None:

            def program(*arrays: Any) -> Any:
                given = iter(arrays)
                full = [next(given) if t else x for x, t in zip(static, traced)]
                a, kw = jax.tree.unflatten(treedef, full)
                return func(*a, **kw)

            compiled = _JIT_CACHE[key] = jax.jit(program)
        return compiled(*(x for x, t in zip(leaves, traced) if t))

    return call


@contextlib.contextmanager
def _jit_entry_points(module: Any) -> Iterator[None]:
    """Replace the entry points ``module`` imported by name with :func:`_under_jit` versions."""
    names = [n for n, v in vars(module).items() if any(v is f for f in ENTRY_POINTS)]
    saved = {n: getattr(module, n) for n in names}
    try:
        for n in names:
            setattr(module, n, _under_jit(saved[n]))
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "skip_backend(*backends, reason): do not generate the backend fixture for these"
    )
    config.addinivalue_line(
        "markers", "only_backend(*backends, reason): generate the backend fixture for these only"
    )
    config.addinivalue_line(
        "markers", "not_generated(reason, **params): drop the combinations with these values"
    )
    config.addinivalue_line(
        "markers", "eager: call the entry points as written (no jax.jit, no Dask compute guard)"
    )
    config.addinivalue_line(
        "markers",
        "slow_grid(cover=(), prefer={}, full_on=FULL_GRID_BACKENDS): the full grid on full_on, a "
        "covering subset of the values of cover on other backends; the rest is marked slow",
    )
    # Wherever JAX is installed, selected or not: a few tests call it directly.
    with contextlib.suppress(ImportError):
        import jax

        jax.config.update("jax_enable_x64", True)
        # The tests' arrays are tiny: compiling dominates, and XLA's optimizations would
        # cost more than they save (about 15% of the JAX tests' time).
        jax.config.update("jax_disable_most_optimizations", True)
        # float32 matmuls at full precision, as torch is pinned below: on a GPU, JAX's
        # default runs them in TF32 (docs/gpu.md); polylin itself never changes it.
        jax.config.update("jax_default_matmul_precision", "highest")
    if Backend.ARRAY_API_STRICT in BACKENDS:
        with contextlib.suppress(ImportError):
            import array_api_strict

            array_api_strict.set_array_api_strict_flags(**STRICT_FLAGS)


def _marked(metafunc: pytest.Metafunc, name: str) -> set[Backend] | None:
    marks = list(metafunc.definition.iter_markers(name))
    if not marks:
        return None
    return {b for mark in marks for b in mark.args}


def _parametrizes_backend_itself(metafunc: pytest.Metafunc) -> bool:
    """A test whose own ``parametrize`` names ``backend`` (a plain value, not the fixture)."""
    return _names_backend_itself(metafunc.definition)


def _argnames(mark: pytest.Mark) -> tuple[str, ...]:
    """The names a ``parametrize`` mark gives values to."""
    names = mark.args[0] if mark.args else mark.kwargs["argnames"]
    if isinstance(names, str):
        return tuple(n.strip() for n in names.split(",") if n.strip())
    return tuple(names)


def _names_backend_itself(node: pytest.Item) -> bool:
    return any("backend" in _argnames(mark) for mark in node.iter_markers("parametrize"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames or _parametrizes_backend_itself(metafunc):
        return
    only, skip = _marked(metafunc, "only_backend"), _marked(metafunc, "skip_backend") or set()
    ids = [b.value for b in BACKENDS if (only is None or b in only) and b not in skip]
    jax_ok = (only is None or Backend.JAX in only) and Backend.JAX not in skip
    if WITH_X32 and jax_ok and "dtype" in metafunc.fixturenames:
        ids.append(JAX_X32)
    metafunc.parametrize("backend", ids, ids=ids, indirect=True)


def _dtypes(backend_id: str) -> list[str]:
    if backend_id == JAX_X32:
        return [d for d in Backend.JAX.float_dtypes() if d != "float64"]
    return Backend(backend_id).float_dtypes()


def _generated(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    backend_id, dtype = params.get("backend"), params.get("dtype")
    if isinstance(backend_id, str) and isinstance(dtype, str):
        if dtype not in _dtypes(backend_id):
            return False  # a dtype the backend lacks
    for mark in item.iter_markers("not_generated"):
        wanted = {k: v if isinstance(v, (list, tuple)) else [v] for k, v in mark.kwargs.items()}
        wanted.pop("reason", None)
        if all(k in params and params[k] in v for k, v in wanted.items()):
            return False
    return True


def _covering(group: list[pytest.Item], mark: pytest.Mark) -> list[pytest.Item]:
    """Greedily, few items of ``group`` in which every value of the parameters that ``mark``
    covers occurs: each step takes the first item (those matching ``prefer`` first) that covers
    the most values not yet covered; then the items the others cover are dropped (the last
    first)."""
    cover, prefer = mark.kwargs.get("cover", ()), mark.kwargs.get("prefer", {})
    prefer = {k: v if isinstance(v, (list, tuple)) else [v] for k, v in prefer.items()}
    params = [item.callspec.params for item in group]  # type: ignore[attr-defined]
    for name in [*cover, *prefer]:
        if name not in params[0]:
            raise ValueError(f"{group[0].nodeid}: slow_grid names {name!r}, not a parameter")
    order = sorted(
        range(len(group)), key=lambda i: not all(params[i][k] in v for k, v in prefer.items())
    )
    wanted = [{(name, repr(params[i][name])) for name in cover} for i in range(len(group))]
    uncovered = set().union(*wanted)
    chosen = [order[0]] if not uncovered else []
    while uncovered:
        best = max(order, key=lambda i: len(wanted[i] & uncovered))
        chosen.append(best)
        uncovered -= wanted[best]
    for i in sorted(chosen, key=order.index, reverse=True):  # drop what the others cover
        others = [wanted[j] for j in chosen if j != i]
        if others and wanted[i] <= set().union(*others):
            chosen.remove(i)
    return [group[i] for i in chosen]


def _mark_slow_grids(items: list[pytest.Item]) -> None:
    """Mark ``slow`` the combinations of ``slow_grid`` tests beyond the default run's subset."""
    groups: dict[tuple[Any, str | None], list[pytest.Item]] = {}
    for item in items:
        mark = item.get_closest_marker("slow_grid")
        if mark is None or not hasattr(item, "callspec"):
            continue
        backend_id = item.callspec.params.get("backend")
        if not isinstance(backend_id, str) or _names_backend_itself(item):
            backend_id = None
        elif backend_id in mark.kwargs.get("full_on", FULL_GRID_BACKENDS):
            continue
        key = (getattr(item, "function", None), backend_id)
        groups.setdefault(key, []).append(item)
    for group in groups.values():
        mark = group[0].get_closest_marker("slow_grid")
        assert mark is not None
        default = set(map(id, _covering(group, mark)))
        for item in group:
            if id(item) not in default:
                item.add_marker(pytest.mark.slow)


def _skip_unusable_backends(items: list[pytest.Item]) -> None:
    """A ``skip`` mark on the items of a backend that cannot run here: they skip before any
    fixture (the ``backend`` fixture would skip them too, after the fixtures before it)."""
    for item in items:
        backend_id = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
        if not isinstance(backend_id, str) or _names_backend_itself(item):
            continue
        b = Backend.JAX if backend_id == JAX_X32 else Backend(backend_id)
        reason = b.unavailable_reason()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"[{backend_id}] {reason}"))


@pytest.hookimpl(tryfirst=True)  # before -m selects: slow_grid marks some items slow
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the combinations that do not exist (or are marked not to be generated), mark the
    ``slow_grid`` combinations beyond the default subset slow, and skip unusable backends."""
    keep, drop = [], []
    for item in items:
        (keep if _generated(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    _mark_slow_grids(items)
    _skip_unusable_backends(items)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Every selected backend; unusable ones skip with the reason."""
    backend_id: str = request.param
    b = Backend.JAX if backend_id == JAX_X32 else Backend(backend_id)
    reason = b.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[{backend_id}] {reason}")
    with contextlib.ExitStack() as stack:
        if backend_id == JAX_X32:
            import jax

            stack.enter_context(jax.enable_x64(False))
        eager = request.node.get_closest_marker("eager") is not None
        if b in (Backend.JAX, Backend.JAX_CUDA) and not eager:
            stack.enter_context(_jit_entry_points(request.module))
        if b is Backend.DASK and not eager:
            stack.enter_context(patch_lazy_xp_functions(request, xp=b.namespace()))
        yield b


@pytest.fixture(autouse=True, scope="session")
def _float32_matmuls_at_full_precision() -> Iterator[None]:
    """GPU float32 cross-checks run without TF32 (see docs/gpu.md): pin torch's float32 matmul
    precision to "highest" for the session, restoring the caller's setting afterwards. polylin
    itself never changes it; tests/test_gpu_device.py shows what TF32 does to the results."""
    if Backend.TORCH_CUDA not in BACKENDS or Backend.TORCH_CUDA.unavailable_reason() is not None:
        yield
        return
    torch = Backend.TORCH_CUDA.module()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="session")
def run_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``run_once(name, build)``: a folder that ``build(folder)`` fills once per test run.

    With pytest-xdist, the first worker to ask builds it under the run's shared temporary folder
    while the others wait for it (a file lock), then all read it: a costly module fixture (a
    docs build, a training run, a fresh interpreter's report) runs once, not once per worker
    that has one of its tests. A build that fails leaves nothing behind, and the next worker to
    ask builds again (and fails the same way, in its own tests).
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, so each worker builds its own
        fcntl = None  # type: ignore[assignment]
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER") and fcntl is not None:
        root = root.parent  # the run's folder, above every worker's own

    def once(name: str, build: Callable[[Path], None]) -> Path:
        folder, done = root / f"once-{name}", root / f"once-{name}.done"
        with open(root / f"once-{name}.lock", "w") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file closes
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                done.touch()
        return folder

    return once


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)
