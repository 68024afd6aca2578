"""The speed history of the key benchmarks: one asv results file per commit, one machine.

``asv run HASHFILE:commits.txt`` (README, "Benchmark history") benchmarks each listed
commit of the project with the suite of the working tree and writes one results file
per commit, ``asv_results/<machine>/<commit>-<env>.json``. This module reads one
machine's files, orders them by commit date and reports each key benchmark's time
across the commits: which commits moved it, by how much, and a plot.

Results of different machines are never mixed: asv keeps a folder per machine name,
and :func:`load_history` reads one folder. A time measured on another CPU, or with
other threads, says nothing about a commit's change, only about the machine.

The commits' subjects come from ``asv_results/commits.json`` (written by
``python -m asv_benches.history --write-commits``, from ``git log``), so that the docs
build where no git history is at hand (an sdist).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
from dataclasses import dataclass, field

from .scaling import load_results

__all__ = ["KEY_VARIANTS", "PEERS", "MOVE", "History", "load_history", "moves",
           "HEADER", "table_rows", "format_table", "plot", "write_commits", "main"]

#: The variants whose history the docs show: the two exact forms, linear attention and
#: one sub-quadratic variant per family (NumPy, ``(8, N, 64)`` float32).
KEY_VARIANTS = ("online_softmax", "softmax", "linear", "performer", "linformer",
                "compressed", "nystrom", "local", "bigbird", "clustered", "routing",
                "synthesizer_dense", "reformer", "sinkhorn", "gla", "ssd",
                "gated_deltanet")
#: Peers drawn as flat references: their code does not change with the project's
#: commits, so their spread across commits is the run's own noise.
PEERS = (("torch_sdpa", "torch"), ("numpy_oneshot", "numpy"))
#: A change by more than this factor between consecutive commits counts as a move.
#: The peers, whose code is the same at every commit, move by up to 1.2x in the
#: committed run (the noise of single processes on a shared 2-core machine).
MOVE = 1.3

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "asv_results")


@dataclass
class History:
    """One machine's results: commits in date order and ``(name, backend, N) -> times``."""

    machine: str
    commits: list  # [(hash, date in ms)], oldest first
    series: dict = field(default_factory=dict)  # (name, backend, n) -> {hash: seconds}
    subjects: dict = field(default_factory=dict)  # hash -> one-line subject


def load_history(results_dir=RESULTS_DIR, machine=None, env=None) -> History:
    """Read the results files of one machine folder under ``results_dir``, one environment.

    ``machine`` defaults to the only folder there; with several, it must be named
    (results of two machines are never drawn on one axis). ``env`` (an asv environment
    name, the part of a file name after the commit) defaults to the one with the most
    files: a run in an ``existing`` environment (the scaling report's) installs another
    build of the dependencies and is not a point of the same history.
    """
    # a machine folder with no results file (``asv machine`` alone, or a --dry-run) is
    # no history
    machines = sorted(d for d in os.listdir(results_dir)
                      if os.path.isdir(os.path.join(results_dir, d))
                      and any(f.endswith(".json") and f != "machine.json"
                              for f in os.listdir(os.path.join(results_dir, d))))
    if machine is None:
        if len(machines) != 1:
            raise ValueError(f"results of {len(machines)} machines under {results_dir!r} "
                             f"({', '.join(machines) or 'none'}): name one with machine=")
        machine = machines[0]
    folder = os.path.join(results_dir, machine)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no results of machine {machine!r} under {results_dir!r}")
    files = [f for f in sorted(os.listdir(folder)) if f.endswith(".json") and f != "machine.json"]
    envs = {}
    for f in files:
        envs.setdefault(f.split("-", 1)[1][:-len(".json")], []).append(f)
    if not envs:
        raise FileNotFoundError(f"no results files under {folder!r}")
    if env is None:
        env = max(envs, key=lambda e: len(envs[e]))
    if env not in envs:
        raise ValueError(f"no results of environment {env!r} under {folder!r} ({', '.join(envs)})")
    hist = History(machine, [])
    for f in envs[env]:
        res = load_results(os.path.join(folder, f))
        commit = res.meta["commit_hash"]
        hist.commits.append((commit, res.meta["date"] or 0))
        for s in res.series:
            if s.kind != "time":
                continue
            for n, value in s.points.items():
                hist.series.setdefault((s.name, s.backend, n), {})[commit] = value
    hist.commits.sort(key=lambda c: c[1])
    path = os.path.join(results_dir, "commits.json")
    if os.path.isfile(path):
        with open(path) as fh:
            hist.subjects = json.load(fh)
    return hist


def moves(hist: History, key, factor=MOVE):
    """The commits after which ``key``'s time changed by more than ``factor``, and stayed.

    Yields ``(commit, before, after)``: ``after`` (the time at ``commit``) differs from
    ``before`` (at the previous commit that measured it, passing over lone outliers)
    by more than ``factor``, and
    the next commit that measured it (if any) is also more than ``factor`` from
    ``before`` on the same side; at the newest commit, with nothing after it to
    confirm, the change must exceed ``factor`` squared. A lone outlier of a noisy
    process is not a move, and neither is a variant's first appearance.
    """
    times = hist.series.get(key, {})
    seq = [(c, times[c]) for c, _ in hist.commits if c in times]
    level = seq[0][1] if seq else None  # the last time that was not a lone outlier
    for i in range(1, len(seq)):
        commit, after = seq[i]
        ratio = after / level
        if max(ratio, 1 / ratio) <= factor:
            level = after
            continue
        if i + 1 < len(seq):
            nxt = seq[i + 1][1] / level
            if not (nxt > factor if ratio > 1 else nxt < 1 / factor):
                continue  # an outlier: the level stays
        elif max(ratio, 1 / ratio) <= factor**2:
            continue
        yield commit, level, after
        level = after


def _subject(hist, commit, width=70):
    text = hist.subjects.get(commit, "")
    return text if len(text) <= width else text[:width - 1] + "..."


def _fmt(seconds):
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


HEADER = ("benchmark", "first measured", "last measured", "moved by (commit: before -> after)")


def table_rows(hist: History, n=4096, *, factor=MOVE) -> list:
    """Each key benchmark at ``n``: name, first and last time (commit), its moves."""
    keys = [(v, "numpy", n) for v in KEY_VARIANTS] + [(p, b, n) for p, b in PEERS]
    rows = []
    for key in keys:
        times = hist.series.get(key)
        if not times:
            continue
        measured = [c for c, _ in hist.commits if c in times]
        first, last = measured[0], measured[-1]
        moved = "; ".join(f"{c[:7]} {_subject(hist, c)}: {_fmt(a)} -> {_fmt(b)}"
                          for c, a, b in moves(hist, key, factor)) or "-"
        name = key[0] if key[0] in KEY_VARIANTS else f"{key[0]} (peer, {key[1]})"
        rows.append((name, f"{_fmt(times[first])} ({first[:7]})",
                     f"{_fmt(times[last])} ({last[:7]})", moved))
    return rows


def format_table(hist: History, n=4096, *, factor=MOVE) -> str:
    """:func:`table_rows` as a Markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|---" * len(HEADER) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(hist, n, factor=factor)]
    return "\n".join(lines)


def plot(hist: History, ax, n=4096, variants=KEY_VARIANTS):
    """Draw each key benchmark's time at ``n`` against the commits (log scale) on ``ax``."""
    import matplotlib.pyplot as plt

    xs = {c: i for i, (c, _) in enumerate(hist.commits)}
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(variants):
        times = hist.series.get((name, "numpy", n), {})
        pts = sorted((xs[c], t) for c, t in times.items() if c in xs and math.isfinite(t))
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, color=cmap(i % 20), label=name)
    for (name, backend), style in zip(PEERS, ("--", ":")):
        times = hist.series.get((name, backend, n), {})
        pts = sorted((xs[c], t) for c, t in times.items() if c in xs)
        if pts:
            ax.plot(*zip(*pts), ls=style, color="0.4", label=f"{name} (peer)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(hist.commits)))
    ax.set_xticklabels([c[:7] for c, _ in hist.commits], rotation=60, fontsize=7)
    ax.set_ylabel(f"seconds at N = {n}")
    ax.grid(True, which="both", alpha=0.3)


def write_commits(results_dir=RESULTS_DIR, repo=None):
    """Write ``commits.json``: each benchmarked commit's subject line, from ``git log``."""
    hashes = set()
    for machine in os.listdir(results_dir):
        folder = os.path.join(results_dir, machine)
        if not os.path.isdir(folder):
            continue
        for f in os.listdir(folder):
            if f.endswith(".json") and f != "machine.json":
                with open(os.path.join(folder, f)) as fh:
                    hashes.add(json.load(fh)["commit_hash"])
    repo = repo or os.path.dirname(os.path.abspath(results_dir))
    subjects = {h: subprocess.run(["git", "-C", repo, "log", "-1", "--format=%s", h],
                                  check=True, capture_output=True, text=True).stdout.strip()
                for h in sorted(hashes)}
    with open(os.path.join(results_dir, "commits.json"), "w") as fh:
        json.dump(subjects, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return subjects


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asv_benches.history", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=RESULTS_DIR, help="asv results directory")
    p.add_argument("--machine", help="machine folder (default: the only one)")
    p.add_argument("--env", help="asv environment name (default: the one with the most files)")
    p.add_argument("-n", type=int, default=4096, help="sequence length of the table")
    p.add_argument("--write-commits", action="store_true",
                   help="write commits.json (subjects from git log) first")
    args = p.parse_args(argv)
    if args.write_commits:
        write_commits(args.results)
    print(format_table(load_history(args.results, args.machine, args.env), args.n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
