"""Sphinx extension for the attn-ref docs.

* API pages are generated at build time, one per public module of ``attn_ref`` and
  ``conformance``, so a module added by any engineer is documented without editing
  the docs (``docs/api/generated/``, not committed).
* ``variant-table``: the comparison table of every variant registered in
  :mod:`attn_ref.registry`, rendered from the registry at build time, so the table
  cannot drift from the code.
* ``variant-error-table``: each variant's implied attention matrix against softmax's,
  computed at build time by :func:`attn_ref.diagnostics.compare_variants`.
* ``error-bound-table``: each method's known error bound next to the error measured
  at build time (``error_bounds.py``, also run by ``tests/test_docs.py``).
* ``variant-choice-table PATH``: the "which variant when" table: exactness, causal
  support, the time and memory measured in the committed results at one ``N``, and
  the implied-matrix error, per registered variant.
* ``scaling-table PATH``: the fitted exponents of the committed asv results, analysed
  at build time by :mod:`asv_benches.scaling` (the ``attn-ref scaling`` report).
* ``history-table DIR``: the committed asv history (one machine's results per
  commit), each key benchmark's first and last time and the commits that moved it
  (:mod:`asv_benches.history`).
* Blocks between ``<!-- if-exists: PATH -->`` and ``<!-- end-if -->`` are kept only
  when ``PATH`` (relative to ``docs/``) exists: pages that other parts of the project
  produce (the conformance page, the measured scaling plot) are linked as soon as they
  are committed, and the build does not fail before.
"""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

PACKAGES = ("attn_ref", "conformance")

_IF_EXISTS = re.compile(
    r"^<!-- if-exists: (?P<path>\S+) -->\n(?P<body>.*?)^<!-- end-if -->\n", re.M | re.S
)


def _public_modules(root: Path, package: str) -> list[str]:
    """Dotted names of the public modules of ``package`` (no leading underscore)."""
    base = root / package
    out = [package]
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]  # a subpackage documents itself under its own name
        if len(parts) == 1 or any(p.startswith("_") for p in parts[1:]):
            continue
        out.append(".".join(parts))
    return out


def generate_api_pages(app):
    """Write ``api/generated/<module>.rst`` for every public module."""
    srcdir = Path(app.srcdir)
    outdir = srcdir / "api" / "generated"
    outdir.mkdir(parents=True, exist_ok=True)
    wanted = {}
    for package in PACKAGES:
        for mod in _public_modules(srcdir.parent, package):
            # reStructuredText, not MyST: the section titles of module docstrings then
            # stay implicit targets, so two modules may share one (no duplicate label).
            title = f"``{mod}``"
            wanted[f"{mod}.rst"] = f"{title}\n{'=' * len(title)}\n\n.. automodule:: {mod}\n   :members:\n"
    for stale in list(outdir.glob("*.md")) + list(outdir.glob("*.rst")):
        if stale.name not in wanted:
            stale.unlink()
    for name, text in wanted.items():
        path = outdir / name
        # Rewrite only on change, so incremental builds stay incremental.
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)


def keep_if_exists(app, docname, source):
    srcdir = Path(app.srcdir)

    def repl(m):
        return m.group("body") if (srcdir / m.group("path")).exists() else ""

    source[0] = _IF_EXISTS.sub(repl, source[0])


def _table(header, rows, widths):
    table = nodes.table(classes=["variant-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for w in widths:
        group += nodes.colspec(colwidth=w)

    def row(cells):
        r = nodes.row()
        for c in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text="") if c == "" else _cell(c)
            r += entry
        return r

    thead = nodes.thead()
    thead += row(header)
    group += thead
    tbody = nodes.tbody()
    for cells in rows:
        tbody += row(cells)
    group += tbody
    return table


def _cell(text):
    para = nodes.paragraph()
    if text.startswith("`") and text.endswith("`"):
        para += nodes.literal(text=text.strip("`"))
    else:
        para += nodes.Text(text)
    return para


class VariantTable(SphinxDirective):
    """The comparison table of every registered variant."""

    has_content = False

    def run(self):
        from attn_ref import registry

        self.env.note_dependency(registry.__file__)
        header = ["variant", "family", "exact", "causal", "time", "memory", "what it computes"]
        rows = []
        for v in registry.variants():
            rows.append([
                f"`{v.name}`",
                f"`{v.family}`",
                "exact" if v.exact else "approximate",
                "yes" if v.causal else "no",
                f"`{v.time}`",
                f"`{v.memory}`",
                v.summary,
            ])
        return [_table(header, rows, [14, 10, 10, 7, 12, 12, 35])]


class VariantErrorTable(SphinxDirective):
    """Relative error of every variant's implied matrix, next to the best rank-k error.

    Options: ``n`` (sequence length), ``d`` (head dimension), ``seed``.
    """

    has_content = False
    option_spec = {"n": int, "d": int, "seed": int}

    def run(self):
        import numpy as np

        from attn_ref.diagnostics import compare_variants
        from attn_ref.random import standard_normal

        n, d = self.options.get("n", 64), self.options.get("d", 16)
        seed = self.options.get("seed", 0)
        q = standard_normal((n, d), seed=seed, xp=np)
        k = standard_normal((n, d), seed=seed + 1, xp=np)
        header = ["variant", "rank of its matrix", "relative error", "best rank-k error, same k"]
        rows = [[f"`{r.name}`", str(r.rank), f"{r.relative_error:.3f}",
                 f"{r.relative_best_error:.3f}"] for r in compare_variants(q, k, seed=seed)]
        return [_table(header, rows, [16, 10, 12, 16])]


class ErrorBoundTable(SphinxDirective):
    """Each method's error bound next to the error measured at build time (``error_bounds``)."""

    has_content = False

    def run(self):
        import error_bounds

        self.env.note_dependency(error_bounds.__file__)
        header = ["method", "statement", "source", "bound here", "measured here", "met"]
        verdict = {True: "yes", False: "no", None: "-"}
        rows = [[b.method, b.statement, b.source, b.bound, b.measured, verdict[b.holds]]
                for b in error_bounds.rows()]
        return [_table(header, rows, [14, 30, 14, 14, 18, 5])]


class VariantChoiceTable(SphinxDirective):
    """Per registered variant: exactness, causal support, measured time and memory at one
    ``N`` (from the committed asv results), and the implied-matrix error at ``N = 64``.

    Argument: the results file, relative to ``docs/``. Option ``n``: the sequence length
    at which time and memory are read (default 8192, the largest every variant ran).
    """

    required_arguments = 1
    option_spec = {"n": int}

    def run(self):
        import numpy as np

        from asv_benches import scaling
        from attn_ref import registry
        from attn_ref.diagnostics import compare_variants
        from attn_ref.random import standard_normal

        path = Path(self.env.srcdir) / self.arguments[0]
        self.env.note_dependency(str(path))
        self.env.note_dependency(registry.__file__)
        n = self.options.get("n", 8192)
        results = scaling.load_results(str(path))
        series = {(s.name, s.kind): s for s in results.series if not s.peer}
        base = results.baseline
        q = standard_normal((64, 16), seed=0, xp=np)
        k = standard_normal((64, 16), seed=1, xp=np)
        error = {r.name: r.relative_error for r in compare_variants(q, k, seed=0)}

        def measured(name, kind):
            s = series.get((name, kind))
            if s is None or n not in s.points:
                return "-"
            if kind == "time":
                return f"{s.points[n]:.2f} s"
            return f"{(s.points[n] - base.get(s.backend, 0.0)) / 2**30:.2f} GiB"

        def largest(name):
            s = series.get((name, "time"))
            return str(max(s.points)) if s and s.points else "-"

        header = ["variant", "exact", "causal", f"time, N = {n}", f"memory, N = {n}",
                  "largest N run", "rel. error of implied P (N = 64)"]
        rows = []
        for v in registry.variants():
            rows.append([f"`{v.name}`", "yes" if v.exact else "no", "yes" if v.causal else "no",
                         measured(v.name, "time"), measured(v.name, "peakmem"), largest(v.name),
                         f"{error[v.name]:.2f}" if v.name in error else "-"])
        return [_table(header, rows, [14, 6, 6, 10, 10, 8, 12])]


class ScalingTable(SphinxDirective):
    """The ``attn-ref scaling`` report of an asv results file, as a table and notes."""

    required_arguments = 1

    def run(self):
        from asv_benches import scaling

        path = Path(self.env.srcdir) / self.arguments[0]
        self.env.note_dependency(str(path))
        results = scaling.load_results(str(path))
        rows = scaling.analyse(results)
        p = results.meta.get("params") or {}
        commit = (results.meta.get("commit_hash") or "?")[:8]
        intro = nodes.paragraph(text=(
            f"asv results of commit {commit} on machine {p.get('machine', '?')} "
            f"({p.get('cpu', '?')}, {p.get('num_cpu', '?')} CPUs); exponents fitted over the "
            "largest sizes measured, analytic exponent in parentheses; peak memory above the "
            "loaded-backend baseline; ratios are times at the largest N both ran. /roofline: "
            "time over the method's least work at the rates of _static/roofline_rates.json, "
            f"{scaling.load_rates()[1].get('note', 'not measured')}."))
        out = [intro, _table(list(scaling.HEADER), [list(r) for r in scaling.table_rows(rows)],
                             [16, 8, 10, 10, 6, 8, 9, 7, 7, 7, 7])]
        notes = [f"{r.name} / {r.backend}: {n}" for r in rows for n in r.notes]
        if notes:
            out.append(nodes.paragraph(
                text="Where the measurement disagrees with the analytic cost, or cannot be fitted:"))
            items = nodes.bullet_list()
            for n in notes:
                item = nodes.list_item()
                item += nodes.paragraph(text=n)
                items += item
            out.append(items)
        else:
            out.append(nodes.paragraph(text="Every fitted exponent agrees with the analytic cost."))
        return out


class HistoryTable(SphinxDirective):
    """The committed asv history (``asv_results/``): each key benchmark across commits."""

    required_arguments = 1  # the results directory, relative to the docs folder
    option_spec = {"n": int}

    def run(self):
        from asv_benches import history

        path = Path(self.env.srcdir) / self.arguments[0]
        hist = history.load_history(str(path))
        for f in sorted(path.rglob("*.json")):
            self.env.note_dependency(str(f))
        n = self.options.get("n", 4096)
        first, last = hist.commits[0][0][:7], hist.commits[-1][0][:7]
        intro = nodes.paragraph(text=(
            f"asv results of {len(hist.commits)} commits ({first} to {last}) on machine "
            f"{hist.machine}, NumPy float32, 8 heads, d = 64, N = {n}; a move is a change by "
            f"more than {history.MOVE}x between consecutive commits that the next commit "
            f"confirms (at the newest, more than {history.MOVE ** 2:.2f}x)."))
        return [intro, _table(list(history.HEADER),
                              [list(r) for r in history.table_rows(hist, n)], [14, 14, 14, 40])]


def setup(app):
    app.connect("builder-inited", generate_api_pages)
    app.connect("source-read", keep_if_exists)
    app.add_directive("variant-table", VariantTable)
    app.add_directive("variant-error-table", VariantErrorTable)
    app.add_directive("scaling-table", ScalingTable)
    app.add_directive("history-table", HistoryTable)
    app.add_directive("error-bound-table", ErrorBoundTable)
    app.add_directive("variant-choice-table", VariantChoiceTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
