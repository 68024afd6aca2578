"""``attn-ref scaling``: how each variant's time and memory grow with ``N``, from asv.

Reads one asv results file (``asv_results/<machine>/<commit>-<env>.json``, written by
``asv run`` with the suite in ``asv_benches/``) and reports, per variant and backend:

* the fitted exponent ``p`` of time ``~ N^p`` and of peak memory ``~ N^p`` (least
  squares on log-log over the largest ``--fit-points`` sizes, where fixed costs no
  longer dominate; the memory fit subtracts the peak of a process that only loaded
  the backend, ``peers.Baseline``);
* the time and peak memory at the largest ``N`` measured;
* the ratio to the native peers at the largest ``N`` both ran: PyTorch's
  ``scaled_dot_product_attention`` on the same kind of device, the plain NumPy
  one-shot implementation, and the floor (analytic FLOPs over the backend's
  measured matmul rate) where the FLOP count is plain;
* the ratio to the variant's own roofline: the least work of the method under its
  benchmark configuration (GEMM FLOPs, exponentials, elementwise operations, bytes:
  ``asv_benches/costs.py``, ``WORK``) at the rates measured by
  ``tools/targets.py rates`` (``--rates``; default the committed
  ``docs/_static/roofline_rates.json``, whose metadata says where and under what load);
* where a fitted exponent disagrees with the analytic cost registered in
  :mod:`attn_ref.registry` (``Variant.time`` / ``Variant.memory``).

It also draws both series on log-log axes (PNG). The analytic memory cost is the
*extra* memory; the measured peak also holds the ``O(N d)`` inputs and output, so
the exponent it is held against is ``max(1, analytic)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from dataclasses import dataclass, field

from . import _common
from .costs import cost_exponent, variant_work

__all__ = [
    "cost_exponent",
    "fit_exponent",
    "Series",
    "Row",
    "load_results",
    "load_rates",
    "roofline_seconds",
    "find_results",
    "analyse",
    "format_table",
    "plot",
    "add_arguments",
    "command",
    "main",
]

DEFAULT_RESULTS = "asv_results"
COMMITTED_RESULTS = os.path.join("docs", "_static", "scaling_results.json")
COMMITTED_RATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "docs", "_static", "roofline_rates.json")
TOLERANCE = 0.3  # exponents within this of the analytic one agree

def fit_exponent(ns, values, *, baseline=0.0, points=4):
    """Least-squares slope of ``log(value - baseline)`` against ``log N``.

    Uses the ``points`` largest ``N`` whose value exceeds ``baseline``; returns None
    with fewer than 3 such points (a slope through two is not a fit).
    """
    pairs = sorted((n, v - baseline) for n, v in zip(ns, values)
                   if v is not None and math.isfinite(v) and v - baseline > 0)
    pairs = pairs[-points:]
    if len(pairs) < 3:
        return None
    xs = [math.log(n) for n, _ in pairs]
    ys = [math.log(v) for _, v in pairs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


# ------------------------------------------------------------------- asv results


@dataclass
class Series:
    """One curve: ``kind`` (``"time"`` s or ``"peakmem"`` bytes) of ``name`` on ``backend``."""

    kind: str
    name: str
    backend: str
    points: dict = field(default_factory=dict)  # N -> value
    peer: bool = False


@dataclass
class Results:
    series: list
    matmul: dict  # target -> GFLOP/s
    baseline: dict  # backend -> bytes
    meta: dict


def _unquote(s):
    s = str(s)
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


def _column(data, name):
    cols = data.get("result_columns", ["result", "params"])
    return cols.index(name) if name in cols else None


def _combos(entry, data):
    """Yield ``(param tuple, value)`` for one benchmark entry of a results file."""
    if isinstance(entry, list):
        res = entry[_column(data, "result")]
        params = entry[_column(data, "params")] or []
    else:  # results format 1
        res, params = entry.get("result"), entry.get("params", [])
    if res is None:
        return
    if not params:
        yield (), res[0] if isinstance(res, list) else res
        return
    for combo, value in zip(itertools.product(*params), res):
        yield tuple(_unquote(p) for p in combo), value


def find_results(path=DEFAULT_RESULTS, machine=None):
    """The results file at ``path``, or the newest one under a results directory."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no asv results at {path!r} (run `asv run` first, or pass "
                                f"--results {COMMITTED_RESULTS})")
    found = []
    for mdir in sorted(os.listdir(path)):
        full = os.path.join(path, mdir)
        if not os.path.isdir(full) or (machine and mdir != machine):
            continue
        for f in os.listdir(full):
            if f.endswith(".json") and f != "machine.json":
                p = os.path.join(full, f)
                try:
                    with open(p) as fh:
                        date = json.load(fh).get("date") or 0
                except (OSError, ValueError):
                    continue
                found.append((date, p))
    if not found:
        raise FileNotFoundError(f"no asv results files under {path!r}"
                                + (f" for machine {machine!r}" if machine else ""))
    return max(found)[1]


def load_results(path) -> Results:
    """Parse one asv results file into series, matmul rates and memory baselines."""
    with open(path) as fh:
        data = json.load(fh)
    series = {}
    matmul, baseline = {}, {}

    def add(kind, name, backend, n, value, peer=False):
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return
        s = series.setdefault((kind, name, backend), Series(kind, name, backend, peer=peer))
        s.points[int(n)] = float(value)

    for bench, entry in data.get("results", {}).items():
        cls, _, method = bench.rpartition(".")
        cls = cls.rsplit(".", 1)[-1]
        kind = method.split("_", 1)[0]
        for combo, value in _combos(entry, data):
            if cls == "Attention" and kind in ("time", "peakmem"):
                add(kind, combo[0], combo[1], combo[2], value)
            elif cls == "TorchSDPA" and kind in ("time", "peakmem"):
                add(kind, "torch_sdpa", _sdpa_backend(combo[0]), combo[1], value, peer=True)
            elif cls == "JaxDotProductAttention" and kind in ("time", "peakmem"):
                add(kind, "jax_dpa", "jax", combo[1], value, peer=True)
            elif cls == "NumpyOneShot" and kind in ("time", "peakmem"):
                add(kind, "numpy_oneshot", "numpy", combo[0], value, peer=True)
            elif value is None or not math.isfinite(float(value)):
                continue  # failed (None) or skipped (NaN)
            elif cls == "Matmul":
                matmul[combo[0]] = float(value)
            elif cls == "Baseline":
                baseline[combo[0]] = float(value)
    meta = {k: data.get(k) for k in ("commit_hash", "env_name", "date", "params")}
    return Results(list(series.values()), matmul, baseline, meta)


def _sdpa_backend(config):
    """``cpu-float32`` (torch's choice: the fused kernel) -> ``torch``; a forced CPU
    kernel, ``cpu-math-float32`` -> ``torch-math``; a GPU one keeps its name."""
    if config == "cpu-float32":
        return "torch"
    if config.startswith("cpu-"):
        return "torch-" + config.split("-")[1]
    return f"torch-{config}"


def load_rates(path=None):
    """``(rates, meta)`` of a ``tools/targets.py rates --json`` file; ``({}, {})`` if absent.

    ``rates`` is ``{backend: {gemm_flops, exp, elementwise, bandwidth}}`` per second.
    """
    path = COMMITTED_RATES if path is None else path
    if not path or not os.path.exists(path):
        return {}, {}
    with open(path) as fh:
        data = json.load(fh)
    return data.get("rates", {}), data.get("meta", {})


# -------------------------------------------------------------------------- report


@dataclass
class Row:
    name: str
    backend: str
    peer: bool
    time_exp: float | None
    mem_exp: float | None
    analytic_time: str
    analytic_memory: str
    analytic_time_exp: float | None
    analytic_mem_exp: float | None
    n_max: int | None
    t_max: float | None
    mem_max: float | None
    vs_sdpa: tuple | None = None  # (ratio, N)
    vs_numpy: tuple | None = None
    vs_floor: tuple | None = None
    vs_roofline: tuple | None = None
    notes: list = field(default_factory=list)


_PEER_COSTS = {"torch_sdpa": ("O(N^2 d)", "O(N)"), "numpy_oneshot": ("O(N^2 d)", "O(N^2)"),
               "jax_dpa": ("O(N^2 d)", "O(N^2)")}

# The plain FLOP counts (see asv_benches/_common.py): per head, Q K^T + P V, or
# K^T V + Q (K^T V).
_FLOPS = {"O(N^2 d)": lambda n, d: 4 * n * n * d, "O(N d^2)": lambda n, d: 4 * n * d * d}


def _memory_backend(backend):
    return "torch" if backend.startswith("torch") else backend


def _ratio(mine, other):
    common = sorted(set(mine.points) & set(other.points)) if other else []
    if not common:
        return None
    n = common[-1]
    return mine.points[n] / other.points[n], n


def _costs(name, registry_costs):
    if name in registry_costs:
        return registry_costs[name]
    return _PEER_COSTS.get(name, ("?", "?"))


def registry_costs() -> dict:
    """``{variant: (time, memory)}`` from :mod:`attn_ref.registry`."""
    from attn_ref.registry import variants

    return {v.name: (v.time, v.memory) for v in variants()}


def benchmark_costs() -> dict:
    """``{variant: (time, memory)}`` under the benchmark suite's configurations.

    The suite runs each variant with its paper's parameters (``BENCH_CONFIGS`` in
    ``asv_benches/_common.py``), and some of those grow with ``N`` (a pooling stride's
    ``N / s`` segments, a strided pattern's ``l ~ sqrt(N)``), which changes the order
    the measurement should show.
    """
    from attn_ref.registry import variants

    return {v.name: _common.benchmark_costs(v) for v in variants()}


def roofline_seconds(name, n, rates, *, heads=8, d=64):
    """Roofline time of variant ``name`` at ``n`` under its benchmark configuration at
    ``rates`` (one backend's), or None without a count, a configuration or rates."""
    config = _common.BENCH_CONFIGS.get(name)
    if config is None or not rates:
        return None
    work = variant_work(name, n, config.describe(n), d=d, heads=heads)
    return None if work is None else work.seconds(rates)


def analyse(results: Results, *, costs=None, points=4, tolerance=TOLERANCE, heads=8, d=64,
            rates=None):
    """One :class:`Row` per (variant or peer, backend), with disagreements in ``notes``.

    ``costs`` (``{name: (time, memory)}``) defaults to :func:`benchmark_costs`, the
    costs under which the suite measured, else :func:`registry_costs`. ``rates``
    (``{backend: rates}``) defaults to the committed ``roofline_rates.json``.
    """
    if costs is None:
        costs = benchmark_costs() or registry_costs()
    if rates is None:
        rates = load_rates()[0]
    by = {(s.kind, s.name, s.backend): s for s in results.series}
    keys = sorted({(s.name, s.backend, s.peer) for s in results.series},
                  key=lambda k: (k[2], k[0], k[1]))
    rows = []
    for name, backend, peer in keys:
        t = by.get(("time", name, backend))
        m = by.get(("peakmem", name, backend))
        tc, mc = _costs(name, costs)
        base = results.baseline.get(_memory_backend(backend), 0.0)
        row = Row(
            name=name, backend=backend, peer=peer,
            time_exp=fit_exponent(list(t.points), list(t.points.values()), points=points) if t else None,
            mem_exp=(fit_exponent(list(m.points), list(m.points.values()), baseline=base,
                                  points=points) if m else None),
            analytic_time=tc, analytic_memory=mc,
            analytic_time_exp=cost_exponent(tc), analytic_mem_exp=cost_exponent(mc),
            n_max=max(t.points) if t and t.points else None,
            t_max=t.points[max(t.points)] if t and t.points else None,
            mem_max=(m.points[max(m.points)] - base) if m and m.points else None,
        )
        if t and not peer:
            gpu = backend not in ("numpy", "torch", "jax")
            sdpa = by.get(("time", "torch_sdpa", "torch-cuda-float32" if gpu else "torch"))
            row.vs_sdpa = _ratio(t, sdpa)
            row.vs_numpy = _ratio(t, by.get(("time", "numpy_oneshot", "numpy")))
        flops = _FLOPS.get(" ".join(tc.split()))
        rate = results.matmul.get("torch-cuda-float32" if backend.startswith("torch-cuda-float32")
                                  else backend)
        if t and t.points and flops and rate:
            n = max(t.points)
            floor = heads * flops(n, d) / (rate * 1e9)
            row.vs_floor = (t.points[n] / floor, n)
        if t and t.points and not peer:
            n = max(t.points)
            roof = roofline_seconds(name, n, rates.get(backend), heads=heads, d=d)
            if roof:
                row.vs_roofline = (t.points[n] / roof, n)
        _judge(row, tolerance)
        rows.append(row)
    return rows


def _judge(row: Row, tolerance):
    if row.time_exp is None:
        row.notes.append("time: too few sizes to fit")
    elif row.analytic_time_exp is None:
        row.notes.append(f"time: cost {row.analytic_time} names no N; measured N^{row.time_exp:.2f}")
    elif abs(row.time_exp - row.analytic_time_exp) > tolerance:
        row.notes.append(f"time disagrees: measured N^{row.time_exp:.2f}, analytic "
                         f"{row.analytic_time} = N^{row.analytic_time_exp:g}")
    if row.mem_exp is None:
        if row.mem_max is not None:
            row.notes.append("memory: too few sizes above the baseline to fit")
        return
    if row.analytic_mem_exp is None:
        row.notes.append(f"memory: cost {row.analytic_memory} names no N; "
                         f"measured N^{row.mem_exp:.2f}")
        return
    want = max(1.0, row.analytic_mem_exp)
    if abs(row.mem_exp - want) > tolerance:
        row.notes.append(f"memory disagrees: measured N^{row.mem_exp:.2f}, analytic "
                         f"{row.analytic_memory} (+ O(N) inputs) = N^{want:g}")


def _fmt_exp(e, analytic):
    if e is None:
        return "-"
    a = "?" if analytic is None else f"{analytic:g}"
    return f"{e:.2f} ({a})"


def _fmt_time(s):
    if s is None:
        return "-"
    for unit, f in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if s >= f:
            return f"{s / f:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _fmt_bytes(b):
    if b is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt_ratio(r):
    return "-" if r is None else f"{r[0]:.3g}x@{r[1]}"


HEADER = ("variant", "backend", "time exp (analytic)", "mem exp (analytic)", "N max",
          "time", "peak-base", "/SDPA", "/NumPy", "/floor", "/roofline")


def table_rows(rows):
    return [(r.name + (" [peer]" if r.peer else ""), r.backend,
             _fmt_exp(r.time_exp, r.analytic_time_exp),
             _fmt_exp(r.mem_exp, None if r.analytic_mem_exp is None else max(1.0, r.analytic_mem_exp)),
             "-" if r.n_max is None else str(r.n_max), _fmt_time(r.t_max), _fmt_bytes(r.mem_max),
             _fmt_ratio(r.vs_sdpa), _fmt_ratio(r.vs_numpy), _fmt_ratio(r.vs_floor),
             _fmt_ratio(r.vs_roofline))
            for r in rows]


def format_table(rows, results: Results | None = None, *, markdown=False) -> str:
    """The report as text (aligned columns) or a Markdown table, notes below it."""
    body = table_rows(rows)
    lines = []
    if results is not None:
        p = results.meta.get("params") or {}
        commit = (results.meta.get("commit_hash") or "?")[:8]
        lines.append(f"asv results: commit {commit}, env {results.meta.get('env_name')}, machine "
                     f"{p.get('machine', '?')} ({p.get('cpu', '?')}, {p.get('num_cpu', '?')} CPUs)")
        if results.matmul:
            rates = ", ".join(f"{k} {v:.3g}" for k, v in sorted(results.matmul.items()))
            lines.append(f"float32 matmul rate (GFLOP/s): {rates}")
        lines.append("")
    if markdown:
        lines.append("| " + " | ".join(HEADER) + " |")
        lines.append("|" + "---|" * len(HEADER))
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
                  for i, h in enumerate(HEADER)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(HEADER, widths)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    notes = [f"- {r.name} / {r.backend}: {n}" for r in rows for n in r.notes]
    lines.append("")
    lines.append("Exponents are fitted over the largest sizes measured; memory is the peak "
                 "minus the backend's loaded-process baseline. Ratios are times at the "
                 "largest N both ran; /floor is time over analytic FLOPs at the matmul rate; "
                 "/roofline is time over the method's least work (GEMM, exp, elementwise, "
                 "memory traffic: asv_benches/costs.py) at the rates of tools/targets.py rates "
                 "(the committed docs/_static/roofline_rates.json says where and under what load).")
    if notes:
        lines.append("")
        lines.append("Where the measurement disagrees with the analytic cost, or cannot be fitted:")
        lines += notes
    else:
        lines.append("Every fitted exponent agrees with the analytic cost.")
    return "\n".join(lines)


def plot(results: Results, path, *, title=None):
    """Log-log plot of time and peak memory (minus baseline) against N; writes ``path``.

    Peers are dashed; grey guides of slope 1 and 2 start at the lowest point of each
    panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    names = sorted({(s.name, s.backend) for s in results.series})
    cmap = plt.get_cmap("tab10")
    markers = "os^vD<>ph*"
    style = {nb: (cmap(i % 10), markers[(i // 10) % len(markers)]) for i, nb in enumerate(names)}
    for ax, kind, label in ((axes[0], "time", "time per call [s]"),
                            (axes[1], "peakmem", "peak memory - loaded baseline [bytes]")):
        drawn = []
        for s in sorted(results.series, key=lambda s: (s.name, s.backend)):
            if s.kind != kind or not s.points:
                continue
            base = results.baseline.get(_memory_backend(s.backend), 0.0) if kind == "peakmem" else 0
            pts = sorted((n, v - base) for n, v in s.points.items() if v - base > 0)
            if not pts:
                continue
            xs, ys = zip(*pts)
            colour, marker = style[(s.name, s.backend)]
            ax.plot(xs, ys, "--" if s.peer else "-", marker=marker, ms=4, color=colour,
                    label=f"{s.name} ({s.backend})")
            drawn += pts
        ax.set_xlabel("N (sequence length); 8 heads, d = 64, float32")
        ax.set_ylabel(label)
        if not drawn:
            ax.text(0.5, 0.5, f"no {kind} results", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        n0, n1 = min(n for n, _ in drawn), max(n for n, _ in drawn)
        y0 = min(v for _, v in drawn)
        for p, ls in ((1, ":"), (2, "-.")):
            ax.plot([n0, n1], [y0, y0 * (n1 / n0) ** p], ls, color="0.55", lw=0.9)
            ax.annotate(f"~N^{p}", (n1, y0 * (n1 / n0) ** p), fontsize=8, color="0.4",
                        textcoords="offset points", xytext=(3, 0))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylim(y0 / 2, max(v for _, v in drawn) * 3)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    rows = max(1, math.ceil(len(labels) / 4))
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, min(0.4, 0.035 * rows + 0.02), 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ CLI


def add_arguments(p):
    p.add_argument("--results", default=None,
                   help=f"asv results file or directory (default {DEFAULT_RESULTS}, else the "
                        f"committed {COMMITTED_RESULTS})")
    p.add_argument("--machine", default=None, help="asv machine name to read (default: any)")
    p.add_argument("--plot", default="scaling.png", metavar="PNG",
                   help="where to write the log-log plot ('' for none; default scaling.png)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the table as Markdown")
    p.add_argument("--title", default=None,
                   help="plot title (default: the commit of the results); say where it was measured")
    p.add_argument("--rates", default=None, metavar="JSON",
                   help="roofline rates of `python tools/targets.py rates --json` (default the "
                        "committed docs/_static/roofline_rates.json)")
    p.add_argument("--fit-points", type=int, default=4,
                   help="fit over this many of the largest sizes (default 4)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"largest exponent difference that still agrees (default {TOLERANCE})")


def command(args) -> int:
    path = args.results
    if path is None:
        path = DEFAULT_RESULTS if os.path.exists(DEFAULT_RESULTS) else COMMITTED_RESULTS
    try:
        path = find_results(path, args.machine)
    except FileNotFoundError as exc:
        print(f"attn-ref scaling: {exc}")
        return 2
    results = load_results(path)
    if not results.series:
        print(f"attn-ref scaling: {path} holds no time_/peakmem_ results of asv_benches")
        return 2
    rates, rates_meta = load_rates(args.rates)
    rows = analyse(results, points=args.fit_points, tolerance=args.tolerance, rates=rates)
    print(f"results: {path}")
    if rates_meta:
        print(f"roofline rates: {args.rates or COMMITTED_RATES} ({rates_meta.get('date')}, "
              f"{rates_meta.get('note')})")
    print(format_table(rows, results))
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(format_table(rows, results, markdown=True) + "\n")
    if args.plot:
        commit = (results.meta.get("commit_hash") or "?")[:8]
        plot(results, args.plot,
             title=args.title or f"attn-ref scaling, asv results of commit {commit}")
        print(f"plot: {args.plot}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attn-ref scaling", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return command(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
