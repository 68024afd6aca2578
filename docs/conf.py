"""Sphinx configuration for the attn-ref documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``; run every
executed example: ``python -m sphinx -W -b doctest docs docs/_build/doctest``.
"""

from __future__ import annotations

import doctest
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "_ext"))

from doctest_setup import GLOBAL_SETUP, OPTION_NAMES  # noqa: E402

import attn_ref  # noqa: E402

project = "attn-ref"
author = "attn-ref contributors"
copyright = "attn-ref contributors"
release = version = attn_ref.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "numpydoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    # MathJax 3 copied into _static/mathjax: the pages render their maths offline,
    # with no CDN (the extension sets mathjax_path to the bundled copy).
    "sphinx-mathjax-offline",
    "sphinxcontrib.bibtex",
    "matplotlib.sphinxext.plot_directive",
    "attn_docs",
    "study_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# _static holds files copied as they are (the scaling report, its Markdown table), not pages.
exclude_patterns = ["_build", "_static", "README.md", "Thumbs.db", ".DS_Store"]
nitpicky = False

# --- MyST ---------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# --- autodoc / numpydoc -------------------------------------------------------------
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# --- bibliography -------------------------------------------------------------------
bibtex_bibfiles = ["refs.bib"]
bibtex_default_style = "plain"
bibtex_reference_style = "author_year"

# --- executed examples --------------------------------------------------------------
# Every ``{doctest}`` block of every page runs under ``-b doctest``; a claimed identity
# that does not hold fails the build. tests/test_docs.py runs the same blocks, and the
# docstring examples shown in the API pages, under pytest.
doctest_global_setup = GLOBAL_SETUP
doctest_default_flags = 0
for _name in OPTION_NAMES:
    doctest_default_flags |= getattr(doctest, _name)
# Docstring examples are written for plain doctest (module globals in scope), so they
# run in tests/test_docs.py with those semantics rather than here.
doctest_test_doctest_blocks = ""

# --- plots made at build time from the project's own code ---------------------------
plot_basedir = str(HERE / "plots")
plot_formats = [("png", 110)]
plot_html_show_formats = False
plot_html_show_source_link = False
plot_include_source = False
plot_rcparams = {"figure.dpi": 110, "font.size": 9, "savefig.bbox": "tight"}

# --- intersphinx --------------------------------------------------------------------
# The CI machines build offline, and a remote inventory that cannot be fetched is a
# warning, which -W turns into an error. So an inventory is used only when a genuine
# copy is on disk (docs/_intersphinx/NAME.inv, fetched by
# ``python docs/_ext/fetch_inventories.py`` on a machine with internet access), or
# when ATTN_REF_DOCS_ONLINE=1 asks Sphinx to fetch it. Without one, references to
# Python/NumPy objects render as plain literals instead of links: nothing breaks.
INTERSPHINX_TARGETS = {
    "python": "https://docs.python.org/3",
    "numpy": "https://numpy.org/doc/stable",
    "array-api": "https://data-apis.org/array-api/2024.12",
}
intersphinx_mapping = {}
for _name, _url in INTERSPHINX_TARGETS.items():
    _local = HERE / "_intersphinx" / f"{_name}.inv"
    if _local.is_file():
        intersphinx_mapping[_name] = (_url, str(_local))
    elif os.environ.get("ATTN_REF_DOCS_ONLINE") == "1":
        intersphinx_mapping[_name] = (_url, None)
intersphinx_timeout = 10

# --- HTML ---------------------------------------------------------------------------
html_theme = "furo"
html_title = "attn-ref"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
mathjax3_config = {"tex": {"macros": {"R": r"\mathbb{R}", "E": r"\mathbb{E}"}}}
