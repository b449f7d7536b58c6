"""The rules of the house (docs/contributing.md, "The house"), read from the code with ``ast``.

Floors, from the ground up: ``_backend`` (namespace, device, native ops, execution questions),
``_forms`` (the math of each family), ``_inputs`` (everything between the caller and the math),
the public building blocks and faces; the outer rings ``torch``, ``flax``, ``compat`` (and the
tools ``testing``, ``__main__``) on top. Each import is read where it is written, at module level or
inside a function, ``if TYPE_CHECKING:`` included: a cycle that only type checkers see is still
a cycle for the reader.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "polylin"

#: The rings above the core: they may use polylin's public names only.
OUTER = ("torch", "flax", "compat")
#: Tools of the library that sit beside the outer rings (they may import any floor).
TOOLS = ("testing", "__main__")
#: What each floor of the core may import from polylin (its own floor always).
FLOORS = {
    "_backend": {"_typing"},
    "_forms": {"_backend", "_typing"},
    "activations": {"_backend", "_typing"},
    "feature_maps": {"_backend", "_typing"},
    "_inputs": {"_backend", "_typing", "feature_maps"},
    "convolution": {"_inputs", "_backend", "_typing", "activations"},
    "normalization": {"_inputs", "_backend", "_typing", "activations"},
}
#: Array libraries: the core imports none (rule 1 of ARCHITECTURE.md), not even the PyTorch
#: autograd registration, which takes the torch that made its tensor.
ARRAY_LIBRARIES = {"numpy", "torch", "cupy", "jax", "jaxlib", "flax", "dask", "array_api_strict"}
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 150


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The module (within polylin, dotted, '' for the package) that ``node`` imports from."""
    if node.level == 0:
        name = node.module or ""
        if name != "polylin" and not name.startswith("polylin."):
            return None
        return name.removeprefix("polylin").removeprefix(".")
    base = module.split(".") if module else []
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, *([node.module] if node.module else [])])


@cache
def _imports() -> dict[str, list[tuple[str, str, int]]]:
    """For each module: (imported polylin module, imported name, line) for every import.

    ``from . import x`` of a submodule ``x`` counts as importing module ``x``.
    """
    modules = _modules()
    found: dict[str, list[tuple[str, str, int]]] = {}
    for module, path in modules.items():
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if target is None:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    if sub in modules:
                        edges.append((sub, "", node.lineno))
                    else:
                        edges.append((target, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("polylin."):
                        edges.append((alias.name.removeprefix("polylin."), "", node.lineno))
        found[module] = edges
    return found


def _external(path: Path) -> set[str]:
    """The top-level names of the non-polylin modules that ``path`` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - {"polylin"}


def _ring(module: str) -> str:
    return module.split(".")[0] if module else ""


def _is_core(module: str) -> bool:
    return _ring(module) not in (*OUTER, *TOOLS)


def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split(".") if part)


def test_no_import_cycle() -> None:
    graph = {m: {t for t, _, _ in edges if t != m} for m, edges in _imports().items()}
    cycles = []
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_core_never_imports_the_outer_rings() -> None:
    bad = [
        f"polylin.{m} (line {line}) imports polylin.{t}"
        for m, edges in _imports().items()
        if _is_core(m)
        for t, _, line in edges
        if not _is_core(t)
    ]
    assert not bad, "\n".join(bad)


def test_floors_import_only_what_is_below_them() -> None:
    bad = [
        f"polylin.{m} (line {line}) imports polylin.{t}"
        for m, edges in _imports().items()
        if _ring(m) in FLOORS
        for t, _, line in edges
        if _ring(t) not in {_ring(m), *FLOORS[_ring(m)]}
    ]
    assert not bad, "\n".join(bad)


def test_outer_rings_use_public_names_only() -> None:
    bad = []
    for m, edges in _imports().items():
        if _ring(m) not in OUTER:
            continue
        for target, name, line in edges:
            if _ring(target) == _ring(m):
                continue  # inside its own ring
            if not _is_public(target) or name.startswith("_"):
                shown = f"polylin.{target}" + (f".{name}" if name else "")
                bad.append(f"polylin.{m} (line {line}) uses {shown}")
    assert not bad, "\n".join(bad)


def test_core_imports_no_array_library() -> None:
    bad = {
        m: sorted(_external(path) & ARRAY_LIBRARIES)
        for m, path in _modules().items()
        if _is_core(m)
    }
    bad = {m: libs for m, libs in bad.items() if libs}
    assert not bad, bad


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines without its docstring (the documentation is not the logic)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


@pytest.mark.parametrize("module", sorted(_modules()))
def test_modules_and_functions_are_short(module: str) -> None:
    path = _modules()[module]
    source = path.read_text()
    lines = source.count("\n")
    assert lines <= MAX_MODULE_LINES, f"polylin.{module}: {lines} lines"
    long = [
        f"{node.name} ({_code_lines(node)} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _code_lines(node) > MAX_FUNCTION_LINES
    ]
    assert not long, f"polylin.{module}: " + ", ".join(long)


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The reader of imports is not blind: a relative import of a private module is found."""
    source = "from .._inputs.validation import check_flag\nfrom ..attention import step\n"
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ImportFrom)
    target = _resolve("torch.gla", PACKAGE / "torch" / "gla.py", node)
    assert target == "_inputs.validation" and not _is_public(target)
    assert _is_public("attention") and not _is_core("torch.gla") and _is_core("attention")
