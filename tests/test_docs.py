"""The documentation is tested: docstring examples, the code on the pages, numpydoc validation.

- Every ``>>>`` example in a docstring under ``polylin/`` runs and its output is compared
  (``doctest``, with ELLIPSIS and NORMALIZE_WHITESPACE).
- Every ``python`` (or ``pycon``) fenced code block on a page ``docs/*.md`` runs, in order, in one
  namespace per page: a block with ``>>>`` prompts is a doctest (output compared), any other block
  is executed as a script (its ``assert`` statements are the checks). A MyST comment line directly
  above a fence gates the block:

  - ``% requires: cupy`` (any :class:`polylin.testing.Backend` value, comma separated): the block
    is a separate test that runs where that backend is usable and is skipped with the reason
    elsewhere;
  - ``% skip-test: <reason>``: the block is shown but never run (say why).

- Every public name passes numpydoc validation with the checks configured in ``docs/conf.py``
  (read from that file, so the docs build and this test enforce the same rules).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import io
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import polylin
import polylin.feature_maps
import polylin.testing
from polylin.testing import Backend

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
RUN_LANGUAGES = {"python", "pycon", "py"}


# -- docstring examples ------------------------------------------------------------------------
def _polylin_modules() -> list[str]:
    names = ["polylin"]
    names += [m.name for m in pkgutil.walk_packages(polylin.__path__, prefix="polylin.")]
    return sorted(names)


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in _polylin_modules():
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional layer package whose library is absent (torch, flax)
            continue
        tests += [t for t in finder.find(module, name) if t.examples]
    return sorted(tests, key=lambda t: t.name)


DOCSTRING_TESTS = _docstring_tests()


def _run_doctest(test: doctest.DocTest) -> None:
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    result = runner.run(test, out=report.write, clear_globs=False)
    if result.failed:
        pytest.fail(f"{result.failed} of {result.attempted} examples failed:\n{report.getvalue()}")


@pytest.mark.parametrize("test", DOCSTRING_TESTS, ids=[t.name for t in DOCSTRING_TESTS])
def test_docstring_examples(test: doctest.DocTest) -> None:
    _run_doctest(test)


def _public_objects() -> dict[str, object]:
    """The names the API reference documents, each with its object."""
    objects = {
        f"polylin.{name}": getattr(polylin, name)
        for name in polylin.__all__
        if name not in ("__version__", "feature_maps", "activations")
    }
    for name in polylin.feature_maps.__all__:
        objects[f"polylin.feature_maps.{name}"] = getattr(polylin.feature_maps, name)
    for name in polylin.activations.__all__:
        objects[f"polylin.activations.{name}"] = getattr(polylin.activations, name)
    objects["polylin.testing.Backend"] = Backend
    import polylin.blocks as blocks

    for name in blocks.__all__:
        objects[f"polylin.blocks.{name}"] = getattr(blocks, name)
    try:
        import polylin.flax as flax_layers
    except ImportError:  # no flax here: its layers are not importable
        pass
    else:
        for name in flax_layers.__all__:
            layer = getattr(flax_layers, name)
            objects[f"polylin.flax.{name}"] = layer
            for method in ("__call__", "step", "from_torch_state_dict", "load_state_dict"):
                if method in vars(layer):
                    objects[f"polylin.flax.{name}.{method}"] = getattr(layer, method)
    try:
        import polylin.torch as layers
    except ImportError:  # no PyTorch here: the layers cannot be imported, their page is skipped
        return objects
    for name in layers.__all__:
        objects[f"polylin.torch.{name}"] = getattr(layers, name)
    for name in ("LinearAttention", "GatedDeltaNet", "GatedLinearAttention", "Mamba2",
                 "RWKV7Attention"):
        for method in ("forward", "step", "log_decay"):
            if method in vars(getattr(layers, name)):
                objects[f"polylin.torch.{name}.{method}"] = getattr(getattr(layers, name), method)
    return objects


PUBLIC = _public_objects()
PUBLIC_CALLABLES = sorted(name for name, obj in PUBLIC.items() if callable(obj))


@pytest.mark.parametrize("name", PUBLIC_CALLABLES)
def test_public_callable_has_a_runnable_example(name: str) -> None:
    """Every public function, class and feature map shows at least one ``>>>`` example."""
    finder = doctest.DocTestFinder(recurse=False)
    examples = [ex for t in finder.find(PUBLIC[name], name) for ex in t.examples]
    assert len(examples) >= 2, f"{name}: its docstring needs a >>> example that shows a result"


def test_api_page_lists_every_public_name() -> None:
    """docs/api.md names every public object (feature maps come from ``__all__`` at build time)."""
    text = (DOCS / "api.md").read_text()
    assert "%FEATURE_MAPS%" in text
    for name in PUBLIC:
        if name.startswith("polylin.feature_maps."):
            continue
        short = name.rsplit(".", 1)[-1]
        for layers in ("polylin.torch.", "polylin.flax."):  # a layer and its methods
            if name.startswith(layers):
                short = name.removeprefix(layers)
        assert re.search(rf"^\s+{re.escape(short)}$", text, re.M), f"{name} missing from api.md"


# -- numpydoc validation -----------------------------------------------------------------------
def _conf_literal(name: str) -> object:
    """A literal assignment from docs/conf.py, read without executing the file."""
    tree = ast.parse((DOCS / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise LookupError(f"docs/conf.py does not set {name}")


def _validation_targets() -> list[str]:
    excludes = [re.compile(p) for p in _conf_literal("numpydoc_validation_exclude")]
    names = list(PUBLIC)
    # The driver's own members are documented on its page; the docs build validates them too.
    return sorted(n for n in names if not any(p.search(n) for p in excludes))


@pytest.mark.parametrize("name", _validation_targets())
def test_numpydoc_validation(name: str) -> None:
    validate = pytest.importorskip("numpydoc.validate")
    checks = validate.get_validation_checks(_conf_literal("numpydoc_validation_checks"))
    overrides = _conf_literal("numpydoc_validation_overrides")
    report = validate.validate(name)
    errors = [
        f"{code}: {msg}"
        for code, msg in report["errors"]
        if code in checks
        and not (code in overrides and re.search(overrides[code], report["docstring"]))
    ]
    assert not errors, f"{name} docstring:\n  " + "\n  ".join(errors)


# -- code on the pages -------------------------------------------------------------------------
@dataclass
class Block:
    """One fenced code block of a Markdown page."""

    page: Path
    lineno: int  # line of the first code line, 1-based
    code: str
    requires: list[Backend] = field(default_factory=list)
    skip_reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.lineno}"


_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")
_MARKER = re.compile(r"^%\s*(requires|skip-test)\s*:\s*(.+?)\s*$")


def parse_blocks(page: Path) -> list[Block]:
    """The runnable (python/pycon) fenced code blocks of ``page``, with their gating markers."""
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.groups()
        start = i + 1
        end = start
        while end < len(lines) and not (
            lines[end].startswith(fence[0] * len(fence)) and not lines[end].strip(fence[0]).strip()
        ):
            end += 1
        if language in RUN_LANGUAGES:
            block = Block(page, start + 1, "\n".join(lines[start:end]) + "\n")
            marker = _MARKER.match(lines[i - 1]) if i > 0 else None
            if marker and marker.group(1) == "requires":
                block.requires = [Backend(n.strip()) for n in marker.group(2).split(",")]
            elif marker:
                block.skip_reason = marker.group(2)
            blocks.append(block)
        i = end + 1
    return blocks


def run_block(block: Block, namespace: dict) -> None:
    """Run one block in ``namespace``: as a doctest if it has prompts, else as a script."""
    if re.search(r"^\s*>>>", block.code, re.M):
        test = doctest.DocTestParser().get_doctest(
            block.code, namespace, block.id, str(block.page), block.lineno - 1
        )
        _run_doctest(test)
        namespace.update(test.globs)  # the DocTest ran on a copy; later blocks see its names
    else:
        # Pad so that tracebacks point at the line of the page.
        source = "\n" * (block.lineno - 1) + block.code
        exec(compile(source, str(block.page), "exec"), namespace)


PAGES = sorted(DOCS.glob("*.md"))
BLOCKS = {page.name: parse_blocks(page) for page in PAGES}
UNGATED_PAGES = [
    p for p in PAGES if any(not b.requires and not b.skip_reason for b in BLOCKS[p.name])
]
GATED = [b for p in PAGES for b in BLOCKS[p.name] if b.requires]


@pytest.mark.parametrize("page", UNGATED_PAGES, ids=[p.name for p in UNGATED_PAGES])
def test_page_examples(page: Path) -> None:
    """The page's code blocks run top to bottom and every shown output matches."""
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    for block in BLOCKS[page.name]:
        if not block.requires and not block.skip_reason:
            run_block(block, namespace)


@pytest.mark.parametrize(
    "block", GATED, ids=[f"{b.id}-{'-'.join(x.value for x in b.requires)}" for b in GATED]
)
def test_page_examples_needing_a_backend(block: Block) -> None:
    """A block marked ``% requires: <backend>`` runs wherever that backend is usable (its id
    names the backends, so that a GPU check's ``-k BACKEND`` selects it)."""
    for backend in block.requires:
        reason = backend.unavailable_reason()
        if reason is not None:
            pytest.skip(f"[{backend}] {reason} ({block.id})")
    namespace: dict = {"__name__": f"docs.{block.page.stem}"}
    for earlier in BLOCKS[block.page.name]:
        if earlier.lineno >= block.lineno:
            break
        if not earlier.requires and not earlier.skip_reason:
            run_block(earlier, namespace)
    run_block(block, namespace)


def test_block_parser_finds_code_and_markers(tmp_path: Path) -> None:
    """The parser sees python blocks and their markers, and ignores other languages."""
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n```sh\nmake test\n```\n\n% requires: cupy\n"
        "```python\nimport cupy\n```\n\n% skip-test: slow\n````pycon\n>>> 1 + 1\n2\n````\n"
    )
    blocks = parse_blocks(page)
    assert [(b.lineno, b.code) for b in blocks] == [
        (4, "x = 1\n"),
        (13, "import cupy\n"),
        (18, ">>> 1 + 1\n2\n"),
    ]
    assert blocks[1].requires == [Backend.CUPY] and blocks[2].skip_reason == "slow"


def test_a_wrong_output_on_a_page_fails(tmp_path: Path) -> None:
    """The page runner really compares output: a wrong expected value is a failure."""
    page = tmp_path / "page.md"
    page.write_text("```python\n>>> 1 + 1\n3\n```\n")
    (block,) = parse_blocks(page)
    with pytest.raises(pytest.fail.Exception, match="1 of 1 examples failed"):
        run_block(block, {})
    page.write_text("```python\nassert 1 + 1 == 3\n```\n")
    (block,) = parse_blocks(page)
    with pytest.raises(AssertionError):
        run_block(block, {})


def test_index_links_every_page() -> None:
    """The index's "Where to go next" list and its toctrees name every page."""
    text = (DOCS / "index.md").read_text()
    for page in PAGES:
        if page.name != "index.md":
            assert f"]({page.name})" in text, f"index.md does not link {page.name}"
            in_toctree = re.search(rf"^{re.escape(page.stem)}$", text, re.M)
            assert in_toctree, f"no toctree of index.md has {page.stem}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_pages_hold_no_control_characters(page: Path) -> None:
    """A backslash escape lost on the way into a page (``\\b`` of ``\\big``, ``\\t`` of
    ``\\top``) leaves a control character that MathJax renders as nonsense, without a warning."""
    text = page.read_text(encoding="utf-8")
    bad = sorted({f"{ord(c):#04x}" for c in text if ord(c) < 32 and c not in "\n"})
    assert not bad, f"{page.name} holds control characters {bad}"
