r"""What the built pages show a reader where math is concerned.

MathJax typesets only the TeX inside the math elements that Sphinx writes (``<span class="math">``
holding ``\(...\)``, ``<div class="math">`` holding ``\[...\]``); everything else on a page is
shown as written. So:

- outside the math elements no page holds TeX: no ``\_``, no command such as ``\frac{``,
  ``\top`` or ``\operatorname``, no delimiter ``\(``: the reader would see the backslashes;
- inside them no text-mode command (``\text{}``, ``\texttt{}``, ``\mbox{}``, ...) holds ``\_``:
  MathJax 3 shows text-mode content literally, so ``\text{a\_lr}`` renders as "a\_lr"
  (``\texttt{a_lr}`` renders "a_lr"; in math mode, ``\mathrm{a\_lr}``, ``\_`` is an underscore);
- the guide's pages write their formulas as math, not as inline code: an inline ``<code>`` with
  a TeX-style subscript in braces (``S_{t-1}``) or a power written ``^T``, ``^(...)`` or ``^{...}``
  is a formula shown as source. (The API pages are left out: their text is the docstrings', where
  plain-text formulas are the convention.)

The site is the one ``make test`` builds before pytest (``POLYLIN_DOCS_HTML``); without that
variable the tests build the docs themselves, offline, with warnings as errors.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_docs_site import Element, parse_html

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HIDDEN = ("script", "style", "template", "noscript")
TEX_COMMANDS = (
    "frac|dfrac|tfrac|text|textrm|texttt|textit|textbf|textsf|mathrm|mathbf|mathcal|mathtt|mathit"
    "|mathbb|boldsymbol|operatorname|sum|prod|int|sqrt|exp|log|top|cdot|odot|otimes|times|dots"
    "|ldots|cdots|left|right|big|Big|bigl|bigr|begin|end|alpha|beta|gamma|Gamma|delta|kappa"
    "|lambda|phi|sigma|omega|hat|tilde|bar|le|leq|ge|geq|ne|infty|in|to|mapsto|leftarrow|quad|qquad"
)
# \_ , \name{ , a known command standing alone, or a math delimiter
RAW_TEX = re.compile(rf"\\_|\\[A-Za-z]+\{{|\\(?:{TEX_COMMANDS})(?![A-Za-z])|\\[()\[\]]")
TEXT_MODE_UNDERSCORE = re.compile(r"\\(?:text[a-z]*|mbox|hbox)\s*\{[^{}]*\\_[^{}]*\}")
CODE_FORMULA = re.compile(r"_\{|\^T|\^\(|\^\{")


# -- the checks, as functions of one parsed page ---------------------------------------------------
def _is_math(element: Element) -> bool:
    return "math" in element.classes()


def text_outside_math(element: Element) -> list[str]:
    """The text pieces a reader sees as written: all but scripts, styles and math elements."""
    if element.tag in HIDDEN or _is_math(element):
        return []
    pieces = ["".join(element.text)]
    for child in element.children:
        pieces += text_outside_math(child)
    return pieces


def raw_tex_outside_math(page: Element) -> list[tuple[str, str]]:
    r"""Each ``\_``, TeX command or delimiter outside the math elements, and its context."""
    found = []
    for piece in text_outside_math(page):
        for match in RAW_TEX.finditer(piece):
            context = piece[max(0, match.start() - 30) : match.end() + 20]
            found.append((match.group(), " ".join(context.split())))
    return found


def escaped_underscores_in_text_mode(page: Element) -> list[str]:
    r"""Each ``\text{...\_...}`` (or another text-mode command) inside a math element."""
    found = []
    for math in page.find_all(cls="math"):
        found += TEXT_MODE_UNDERSCORE.findall(math.visible_text())
    return found


def _inline_code(element: Element, in_pre: bool = False) -> list[str]:
    if element.tag in HIDDEN or _is_math(element):
        return []
    in_pre = in_pre or element.tag == "pre"
    found = [element.visible_text()] if element.tag == "code" and not in_pre else []
    for child in element.children:
        found += _inline_code(child, in_pre)
    return found


def formulas_in_inline_code(page: Element) -> list[str]:
    """The inline ``<code>`` texts (not code blocks) that read as formulas."""
    return [text for text in _inline_code(page) if CODE_FORMULA.search(text)]


# -- the site ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built HTML: ``POLYLIN_DOCS_HTML`` (set by ``make test``), else a fresh build."""
    built = os.environ.get("POLYLIN_DOCS_HTML")
    if built:
        path = Path(built)
        assert (path / "index.html").is_file(), f"POLYLIN_DOCS_HTML={built}: no built site there"
        return path
    pytest.importorskip("sphinx", reason="the docs tools are not installed (the docs extra)")
    out = tmp_path_factory.mktemp("html")
    command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q"]
    command += ["-b", "html", str(DOCS), str(out)]
    env = {**os.environ, "POLYLIN_DOCS_OFFLINE": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"the docs build failed:\n{result.stdout}\n{result.stderr}"
    return out


def _pages(site: Path) -> dict[str, Element]:
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)
    assert len(pages) > 20, f"only {len(pages)} pages under {site}"
    return {str(p.relative_to(site)): parse_html(p.read_text()) for p in pages}


def _guide_pages(site: Path) -> dict[str, Element]:
    """The guide's pages written in docs/*.md, but the changelog and the API reference."""
    names = {p.stem for p in DOCS.glob("*.md")} - {"changelog", "api"}
    pages = {f"{name}.html": parse_html((site / f"{name}.html").read_text()) for name in names}
    assert "layers.html" in pages and "from_fla.html" in pages, sorted(pages)
    return pages


def test_no_page_shows_tex_outside_math(site: Path) -> None:
    found = {
        name: hits for name, page in _pages(site).items() if (hits := raw_tex_outside_math(page))
    }
    assert not found, f"TeX shown as written, outside the math elements: {found}"


def test_no_text_mode_command_escapes_an_underscore(site: Path) -> None:
    pages = _pages(site)
    assert sum(len(page.find_all(cls="math")) for page in pages.values()) > 100
    found = {
        name: hits
        for name, page in pages.items()
        if (hits := escaped_underscores_in_text_mode(page))
    }
    assert not found, f"\\_ inside a text-mode command renders as a backslash: {found}"


def test_guide_pages_typeset_their_formulas_as_math(site: Path) -> None:
    pages = _guide_pages(site)
    found = {name: hits for name, page in pages.items() if (hits := formulas_in_inline_code(page))}
    assert not found, f"formulas written as inline code: {found}"
    for name in ("layers.html", "from_fla.html", "dplr.html"):
        assert pages[name].find_all(cls="math"), f"{name} has no math element"


def test_the_rendering_checks_catch_what_they_look_for() -> None:
    r"""Each check finds its fault on a small page and passes the same content written right."""
    bad = parse_html(
        '<html><body><p>rate <span class="math notranslate nohighlight">'
        "\\(\\beta_t = \\hat\\kappa_t \\odot \\text{a\\_lr}_t\\)</span> and \\frac{1}{2} of a\\_lr"
        ' and \\top</p><div class="math">\\[\\mbox{x\\_y} + 1\\]</div>'
        "<p><code>S_t = exp(g_t) S_{t-1}</code> <code>o_t = S_t^T q_t</code></p>"
        "<pre><code>S_{t-1} in a code block</code></pre>"
        '<script>var tex = "\\\\frac{a}{b}";</script></body></html>'
    )
    assert [tex for tex, _ in raw_tex_outside_math(bad)] == ["\\frac{", "\\_", "\\top"]
    assert escaped_underscores_in_text_mode(bad) == ["\\text{a\\_lr}", "\\mbox{x\\_y}"]
    assert formulas_in_inline_code(bad) == ["S_t = exp(g_t) S_{t-1}", "o_t = S_t^T q_t"]

    good = parse_html(
        '<html><body><p>rate <span class="math notranslate nohighlight">'
        "\\(\\beta_t = \\hat\\kappa_t \\odot \\texttt{a_lr}_t + \\mathrm{a\\_lr}\\)</span> and"
        " <code>a_lr</code>, <code>x_t</code>, <code>K ** -0.5</code></p>"
        '<div class="math">\\[S_t = e^{g_t} S_{t-1} + k_t v_t^\\top\\]</div>'
        "<pre>print(&quot;a\\nb&quot;)</pre></body></html>"
    )
    assert raw_tex_outside_math(good) == []
    assert escaped_underscores_in_text_mode(good) == []
    assert formulas_in_inline_code(good) == []
