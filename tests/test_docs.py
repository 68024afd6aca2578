"""The documentation's claims, executed in the ordinary test run.

Every ``{doctest}`` block of every page in ``docs/`` runs here exactly as Sphinx's
doctest builder runs it (one namespace per page, the setup of
``docs/_ext/doctest_setup.py``), and so does every docstring example of every public
module of ``attn_ref`` and ``conformance`` (with plain doctest semantics: the
module's globals are in scope). A change in the library that falsifies a page fails
here even when nobody builds the docs.
"""

from __future__ import annotations

import doctest
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from doctest_setup import GLOBAL_SETUP, OPTION_NAMES  # noqa: E402

FLAGS = 0
for _name in OPTION_NAMES:
    FLAGS |= getattr(doctest, _name)

# A MyST fenced directive: ```{name} ... ``` (three or more backticks, same count to close).
_FENCE = re.compile(r"^(?P<fence>`{3,})\{(?P<name>[\w-]+)\}[^\n]*\n(?P<body>.*?)^(?P=fence)\s*$",
                    re.M | re.S)
_SPHINX_ONLY = {"testcode", "testoutput", "testsetup", "testcleanup", "doctest-group"}


def pages():
    # The pages Sphinx reads (docs/conf.py excludes _build and _static).
    return sorted(p for p in DOCS.rglob("*.md")
                  if not {"_build", "_static", "generated"} & set(p.relative_to(DOCS).parts))


def doctest_blocks(path):
    """``[(lineno, source)]`` of the ``{doctest}`` blocks of a page, options stripped."""
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        name = m.group("name")
        assert name not in _SPHINX_ONLY, (
            f"{path.name}: use {{doctest}} blocks only, so that pytest runs them too "
            f"(found {{{name}}})"
        )
        if name != "doctest":
            continue
        body = "".join(line for line in m.group("body").splitlines(keepends=True)
                       if not line.startswith(":"))
        out.append((text.count("\n", 0, m.start("body")) + 1, body))
    return out


PAGES_WITH_EXAMPLES = [p for p in pages() if doctest_blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples(page):
    globs = {}
    exec(GLOBAL_SETUP, globs)
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for lineno, source in doctest_blocks(page):
        test = parser.get_doctest(source, globs, f"{page.name}:{lineno}", str(page), lineno)
        runner.run(test, clear_globs=False)
        globs = test.globs  # the next block of the page continues in this namespace
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {page.name} failed"


def _public_modules():
    names = []
    for package in ("attn_ref", "conformance"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(p.startswith("_") for p in parts[1:]):
                continue
            names.append(".".join(parts))
    return names


def _docstring_tests(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, name) if t.examples]


MODULES_WITH_EXAMPLES = [m for m in _public_modules() if _docstring_tests(m)]


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_docstring_examples(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _docstring_tests(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_every_page_has_an_executed_example_or_is_navigation():
    # A derivation page whose identities are not executed is exactly what these docs
    # promise not to have.
    navigation = {"index.md", "bibliography.md", "building.md", "comparison.md",
                  "conformance.md", "attn_ref.md", "notation.md", "guide.md"}
    missing = [p.name for p in pages() if p.name not in navigation and p.parent.name != "api"
               and not doctest_blocks(p)]
    assert not missing, f"pages without executed examples: {missing}"


def test_citations_resolve():
    keys = set(re.findall(r"^@\w+\{([^,]+),", (DOCS / "refs.bib").read_text(), re.M))
    cited = set()
    for p in pages():
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", p.read_text()):
            cited.update(k.strip() for k in group.split(","))
    assert cited, "no citations found: the pattern is out of date"
    assert cited <= keys, f"cited but not in refs.bib: {sorted(cited - keys)}"


def test_error_bounds_hold_where_claimed():
    # docs/bounds.md's table: every bound that is stated to hold holds on the measured
    # inputs. Linformer's Theorem 1 (relative to |Pw|) is the one the page reports as
    # not met at N = 512 with the proof's k; if that changes, the page must too.
    import error_bounds

    rows = error_bounds.rows()
    assert len(rows) >= 8
    assert {b.method for b in rows if b.holds is False} == {"Linformer, Thm 1"}
    assert any(b.holds is None and "no bound" in b.statement for b in rows)  # Nystrom


def test_equation_references_name_their_page():
    # An equation number alone is ambiguous across pages (MyST numbers them per page),
    # so a reference to another page's equation must link that page right after it.
    labels = {}
    for p in pages():
        for label in re.findall(r"^\$\$ \((eq-[\w-]+)\)", p.read_text(), re.M):
            labels[label] = p.name
    assert labels, "no equation labels found: the pattern is out of date"
    bad = []
    for p in pages():
        text = p.read_text()
        for m in re.finditer(r"\{eq\}`(eq-[\w-]+)`", text):
            home = labels.get(m.group(1))
            if home and home != p.name and f"]({home})" not in text[m.end():m.end() + 40]:
                bad.append(f"{p.name}: {m.group(1)} (defined on {home})")
    assert not bad, f"references to another page's equation without its page: {bad}"


def test_math_is_bundled_for_offline_reading():
    # The site must not load MathJax from a CDN: an offline reader would see raw TeX.
    import importlib.util

    conf = (DOCS / "conf.py").read_text()
    assert '"sphinx-mathjax-offline"' in conf
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    assert spec is not None, "the docs extra's sphinx-mathjax-offline is not installed"
    bundled = Path(spec.origin).parent / "static" / "mathjax" / "tex-chtml.js"
    assert bundled.is_file()


def test_pages_hold_no_control_characters():
    # A page written through a Python string that was not raw turns TeX's \t, \b into a
    # tab and a backspace ("$\times$" into "$<TAB>imes$"): the formula renders as text.
    # Found on 3 December 2026 on twelve lines of conformance.md and reduction.md.
    bad = []
    for p in pages():
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"[\x00-\x09\x0b-\x1f\x7f]", line):
                bad.append(f"{p.name}:{n}: {line.strip()[:60]!r}")
    assert not bad, bad
