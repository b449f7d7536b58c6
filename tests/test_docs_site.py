"""The built documentation site, read as a reader's browser reads it.

- No page loads a script or a stylesheet from the network: every ``<script src>`` and
  ``<link href>`` is a file of the site, and the math renderer (MathJax, bundled by
  ``docs/conf.py``) is among them.
- No page has an empty navigation sidebar: every page lists the site's pages.
- In headless Chromium (Debian's ``chromium``; skipped with the reason where it is absent, and
  installed by ``make browser``, a step of ``make test``), a page with math renders it: the text
  the reader sees holds no TeX delimiter, and a screenshot is taken; the longest API title
  wraps in a 700-pixel window, and code of at most 100 columns fits the article at 1280.

The site is the one ``make test`` builds just before pytest (``POLYLIN_DOCS_HTML`` names it);
without that variable the tests build the docs themselves into a temporary folder, offline, with
warnings as errors, as ``make docs`` does.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from .test_docs import _conf_literal  # the settings of docs/conf.py, read without running it

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MATH_PAGE = "concepts.html"  # inline and display math, an aligned block
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
NO_BROWSER = "headless Chromium is not installed (Debian: apt-get install chromium; make browser)"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}


# -- a small HTML tree -------------------------------------------------------------------------
@dataclass
class Element:
    """One element of a parsed page: its tag, attributes, children and direct text."""

    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def iter(self):
        yield self
        for child in self.children:
            yield from child.iter()

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find_all(self, tag: str | None = None, *, cls: str | None = None, id: str | None = None):
        return [
            e
            for e in self.iter()
            if (tag is None or e.tag == tag)
            and (cls is None or cls in e.classes())
            and (id is None or e.attrs.get("id") == id)
        ]

    def visible_text(self) -> str:
        """The text a reader sees: everything but scripts, styles and templates."""
        if self.tag in ("script", "style", "template", "noscript"):
            return ""
        return "".join(self.text) + "".join(c.visible_text() for c in self.children)


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data):
        self.stack[-1].text.append(data)


def parse_html(text: str) -> Element:
    """Parse a page into an :class:`Element` tree."""
    builder = _TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.root


# -- the checks, as functions of one page ------------------------------------------------------
def remote_references(page: Element) -> list[str]:
    """Every ``<script src>`` and ``<link href>`` of ``page`` that points off the site."""
    found = [e.attrs.get("src", "") for e in page.find_all("script")]
    found += [e.attrs.get("href", "") for e in page.find_all("link")]
    return [url for url in found if re.match(r"^\s*(https?:)?//", url, re.I)]


def empty_navigation(page: Element) -> list[str]:
    """The navigation sidebars of ``page`` that hold no link, by their title."""
    empty = []
    for sidebar in page.find_all(id="pst-primary-sidebar"):
        for nav in sidebar.find_all("nav"):
            if not [a for a in nav.find_all("a") if a.attrs.get("href")]:
                title = nav.find_all(cls="bd-links__title")
                label = nav.attrs.get("aria-label", "nav")
                empty.append(title[0].visible_text().strip() if title else label)
        if not [a for a in sidebar.find_all("a") if a.attrs.get("href")]:
            empty.append("primary sidebar")
    return empty


def raw_tex(text: str) -> list[str]:
    r"""The TeX delimiters ``\(``, ``\)``, ``\[``, ``\]`` left in a page's visible text."""
    return re.findall(r"\\[()\[\]]", text)


# -- the site ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(run_once) -> Path:
    """The built HTML: ``POLYLIN_DOCS_HTML`` (set by ``make test``), else a fresh build (one per
    test run, shared by pytest-xdist's workers)."""
    built = os.environ.get("POLYLIN_DOCS_HTML")
    if built:
        path = Path(built)
        assert (path / "index.html").is_file(), f"POLYLIN_DOCS_HTML={built}: no built site there"
        return path
    pytest.importorskip("sphinx", reason="the docs tools are not installed (the docs extra)")

    def build(out: Path) -> None:
        command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q"]
        command += ["-b", "html", str(DOCS), str(out)]
        env = {**os.environ, "POLYLIN_DOCS_OFFLINE": "1"}
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"the docs build failed:\n{result.stdout}\n{result.stderr}"

    return run_once("docs-html", build)


def _pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)


def _local(page: Path, url: str) -> Path:
    """The file a relative ``url`` of ``page`` names (its query and fragment dropped)."""
    return (page.parent / url.split("?")[0].split("#")[0]).resolve()


def test_no_page_loads_a_remote_script_or_stylesheet(site: Path) -> None:
    pages = _pages(site)
    assert len(pages) > 20, f"only {len(pages)} pages under {site}"
    remote = {
        str(p.relative_to(site)): urls
        for p in pages
        if (urls := remote_references(parse_html(p.read_text())))
    }
    assert not remote, f"pages that load from the network: {remote}"


def test_every_local_script_and_stylesheet_exists(site: Path) -> None:
    missing = []
    for page in _pages(site):
        tree = parse_html(page.read_text())
        urls = [e.attrs["src"] for e in tree.find_all("script") if e.attrs.get("src")]
        urls += [
            e.attrs["href"]
            for e in tree.find_all("link")
            if "stylesheet" in e.attrs.get("rel", "") or e.attrs.get("as") == "script"
        ]
        for url in urls:
            if not _local(page, url).is_file():
                missing.append(f"{page.relative_to(site)}: {url}")
    assert not missing, "references to files the site lacks:\n" + "\n".join(missing)


def test_math_pages_load_the_bundled_mathjax(site: Path) -> None:
    mathjax = site / "_static" / Path(str(_conf_literal("mathjax_path")))
    assert mathjax.is_file() and mathjax.stat().st_size > 100_000, mathjax
    for relative in _conf_literal("MATHJAX_FILES"):  # type: ignore[attr-defined]
        assert (mathjax.parent / relative).exists(), f"MathJax file missing: {relative}"
    assert list((mathjax.parent / "output/chtml/fonts/woff-v2").glob("*.woff")), "no web fonts"
    math_pages = 0
    for page in _pages(site):
        tree = parse_html(page.read_text())
        if not tree.find_all(cls="math"):
            continue
        math_pages += 1
        scripts = [
            _local(page, e.attrs["src"]) for e in tree.find_all("script") if "src" in e.attrs
        ]
        assert mathjax.resolve() in scripts, f"{page.relative_to(site)} has math but no MathJax"
    assert math_pages >= 5, f"only {math_pages} pages with math"


def test_no_page_has_an_empty_navigation_sidebar(site: Path) -> None:
    guide = {p.stem for p in DOCS.glob("*.md")}
    problems = {}
    for page in _pages(site):
        tree = parse_html(page.read_text())
        if empty := empty_navigation(tree):
            problems[str(page.relative_to(site))] = empty
        sidebars = tree.find_all(id="pst-primary-sidebar")
        if page.parent == site and page.stem in guide:
            assert sidebars, f"{page.name} has no navigation sidebar"
            links = {
                a.attrs["href"].split("#")[0].removesuffix(".html")
                for a in sidebars[0].find_all("a")
                if a.attrs.get("href", "").endswith(".html")
            }
            unlisted = guide - links - {page.stem, "index"}
            assert not unlisted, f"the sidebar of {page.name} does not list {sorted(unlisted)}"
    assert not problems, f"empty navigation sidebars: {problems}"


def test_the_checks_catch_what_they_look_for() -> None:
    """The page checks fail on a remote script, an empty sidebar and raw TeX."""
    page = parse_html(
        '<html><head><script src="https://cdn.example/mathjax.js"></script>'
        '<link rel="stylesheet" href="//fonts.example/a.css"><link href="_static/a.css">'
        '</head><body><div id="pst-primary-sidebar"><nav class="bd-docs-nav">'
        '<p class="bd-links__title">Section Navigation</p></nav></div>'
        '<p>x <span class="math">\\(O(T)\\)</span></p><script>var s = "\\(";</script></body></html>'
    )
    assert remote_references(page) == ["https://cdn.example/mathjax.js", "//fonts.example/a.css"]
    assert empty_navigation(page) == ["Section Navigation", "primary sidebar"]
    assert raw_tex(page.visible_text()) == ["\\(", "\\)"]


# -- in a browser ------------------------------------------------------------------------------
def _browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip(NO_BROWSER)


def _chromium(
    browser: str, url: str, *args: str, profile: Path, width: int = 1280
) -> subprocess.CompletedProcess:
    """Run headless Chromium on ``url`` with no network access beyond the page's own files."""
    flags = [
        "--headless",
        "--no-sandbox",  # root in CI
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--window-size={width},1000",
        "--virtual-time-budget=20000",  # let MathJax load, typeset and fetch its fonts
    ]
    return subprocess.run(
        [browser, *flags, *args, url], capture_output=True, text=True, timeout=180
    )


# Appended to a copy of a page: after load, one line per title and code block of the article,
# "TAG scrollWidth clientWidth longest-line-in-characters", in an element the test reads back.
MEASURE = """<script>window.addEventListener("load", () => {
  const rows = [];
  document.querySelectorAll(".bd-article h1, .bd-article pre").forEach((e) => {
    const longest = Math.max(...e.textContent.split("\\n").map((line) => line.length));
    rows.push([e.tagName, e.scrollWidth, e.clientWidth, longest].join(" "));
  });
  const out = document.createElement("pre");
  out.id = "polylin-measure";
  out.textContent = rows.join("\\n");
  document.body.appendChild(out);
});</script>"""


def _measure(
    browser: str, page: Path, width: int, profile: Path
) -> list[tuple[str, int, int, int]]:
    """The widths of ``page``'s titles and code blocks in a window ``width`` pixels wide."""
    probe = page.with_name(f"_probe_{page.name}")  # beside the page: its relative links work
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    try:
        dom = _chromium(browser, probe.as_uri(), "--dump-dom", profile=profile, width=width)
    finally:
        probe.unlink()
    (out,) = parse_html(dom.stdout).find_all(id="polylin-measure")
    rows = [line.split() for line in out.visible_text().splitlines() if line.strip()]
    return [(tag, int(scroll), int(client), int(longest)) for tag, scroll, client, longest in rows]


def test_long_titles_wrap_and_code_fits(site: Path, tmp_path: Path) -> None:
    """API titles wrap in a narrow window; 100-column code fits the article at 1280 pixels."""
    browser = _browser()
    api = sorted((site / "api" / "generated").glob("*.html"), key=lambda p: len(p.stem))
    longest_title = api[-1]
    titles = _measure(browser, longest_title, 700, tmp_path / "profile")
    assert [r for r in titles if r[0] == "H1"], f"no title measured on {longest_title.name}"
    cut = [r for r in titles if r[0] == "H1" and r[1] > r[2] + 1]
    assert not cut, f"{longest_title.name}: the title does not wrap at 700 px: {cut}"
    for name in ("performance.html", "delta_rule.html", "from_softmax.html"):
        blocks = _measure(browser, site / name, 1280, tmp_path / "profile")
        code = [r for r in blocks if r[0] == "PRE" and r[3] <= 100]
        assert code, f"no code block measured on {name}"
        clipped = [r for r in code if r[1] > r[2] + 1]
        assert not clipped, f"{name}: code of at most 100 columns scrolls at 1280 px: {clipped}"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_math_renders_in_a_browser(site: Path, tmp_path: Path) -> None:
    """Chromium shows the rendered formulas of a math page, not their TeX; and a screenshot."""
    browser = _browser()
    page = site / MATH_PAGE
    built = parse_html(page.read_text())
    formulas = len(built.find_all(cls="math"))
    assert formulas > 10 and raw_tex(built.visible_text()), "the built page has no TeX to render"

    dom = _chromium(browser, page.as_uri(), "--dump-dom", profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = parse_html(dom.stdout)
    body = rendered.find_all("body")
    assert body, f"Chromium returned no page: {dom.stdout[:500]}"
    assert not raw_tex(body[0].visible_text()), "raw TeX left on the page: MathJax did not run"
    containers = rendered.find_all("mjx-container")
    assert len(containers) >= formulas, f"{len(containers)} typeset formulas of {formulas}"

    shot = tmp_path / "concepts.png"
    result = _chromium(browser, page.as_uri(), f"--screenshot={shot}", profile=tmp_path / "profile")
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    assert _png_size(shot) == (1280, 1000)
    assert shot.stat().st_size > 20_000, "a blank screenshot"
    if os.environ.get("POLYLIN_DOCS_SCREENSHOT"):  # keep it to look at
        shutil.copy(shot, os.environ["POLYLIN_DOCS_SCREENSHOT"])


def test_the_browser_check_sees_unrendered_math(tmp_path: Path) -> None:
    """Without MathJax the same check finds the TeX: it can fail."""
    browser = _browser()
    page = tmp_path / "raw.html"
    page.write_text('<html><body><p>cost <span class="math">\\(O(T)\\)</span></p></body></html>')
    dom = _chromium(browser, page.as_uri(), "--dump-dom", profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    (body,) = parse_html(dom.stdout).find_all("body")
    assert raw_tex(body.visible_text()) == ["\\(", "\\)"]
