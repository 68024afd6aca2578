"""The committed scaling results as small multiples: one column per family of variants.

Read at build time from ``docs/_static/scaling_results.json`` by
:mod:`asv_benches.scaling` (the ``attn-ref scaling`` report). In one panel every
variant has its own colour; one-shot softmax is drawn in grey in every panel, so each
family is read against the same quadratic reference.
"""

from pathlib import Path

import matplotlib.pyplot as plt

from asv_benches import scaling
from attn_ref import registry

# The plot directive runs this file with its own folder as the working directory
# (and without __file__).
results = scaling.load_results(str(Path.cwd().parent / "_static" / "scaling_results.json"))
baseline = results.baseline

GROUPS = {  # column title -> registry families (peers: the series that are not variants)
    "exact: softmax, online softmax, peers": ("softmax", "peer"),
    "fewer keys or queries": ("lowrank", "compressed", "reduced"),
    "kernelised: linear, Performer": ("linear", "performer"),
    "sparse patterns": ("sparse",),
    "hashing, routing, sorting, synthesised": ("hashing", "routing", "sorting", "synthesizer"),
    "recurrent (chunk forms)": ("recurrent",),
}


def family(name):
    try:
        return registry.get(name).family
    except (KeyError, ValueError):
        return "peer"


def points(s, kind):
    # Memory is measured above the baseline of the loaded backend; every torch series
    # shares the torch baseline (as in the attn-ref scaling report).
    backend = "torch" if s.backend.startswith("torch") else s.backend
    base = baseline.get(backend, 0.0) if kind == "peakmem" else 0.0
    pts = sorted((n, v - base) for n, v in s.points.items() if v - base > 0)
    return list(zip(*pts)) if pts else None


fig, axes = plt.subplots(2, len(GROUPS), figsize=(19, 6.2), sharex=True, sharey="row")
reference = {kind: next((s for s in results.series if s.name == "softmax" and s.kind == kind), None)
             for kind in ("time", "peakmem")}
for col, (title, families) in enumerate(GROUPS.items()):
    series = sorted((s for s in results.series if family(s.name) in families),
                    key=lambda s: (s.name, s.backend))
    names = sorted({(s.name, s.backend) for s in series})
    colours = {nb: plt.get_cmap("tab10")(i) for i, nb in enumerate(names)}
    for row, kind in enumerate(("time", "peakmem")):
        ax = axes[row, col]
        ref = reference[kind]
        if ref is not None and "softmax" not in families and points(ref, kind):
            xs, ys = points(ref, kind)
            ax.plot(xs, ys, color="0.75", lw=2.5, label="softmax (reference)")
        for s in series:
            if s.kind != kind or not points(s, kind):
                continue
            xs, ys = points(s, kind)
            ax.plot(xs, ys, "--" if s.peer else "-", marker="o", ms=3, color=colours[(s.name, s.backend)],
                    label=f"{s.name} ({s.backend})" if s.peer else s.name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        if row == 0:
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=6.5, loc="upper left")
        else:
            ax.set_xlabel("N")
axes[0, 0].set_ylabel("time per call [s]")
axes[1, 0].set_ylabel("peak memory - baseline [bytes]")
fig.tight_layout()
