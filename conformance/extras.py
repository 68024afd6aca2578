"""Outputs of a kernel besides the attention output: what each one is, its golden, its
tolerance and the bug classes its diagnosis names.

How a kernel returns them
-------------------------
* the output alone: nothing else is checked;
* a tuple ``(out, extra_1, extra_2, ...)``: extras by position, named by the variant's
  order (softmax: ``("lse",)``, as FlashAttention's ``(out, softmax_lse)``);
* a dict ``{"out": out, "lse": lse, ...}``: extras by name.

An extra is checked when the kernel declares it (``supports={"lse": True}``: one that is
missing or of the wrong shape then fails), when a dict names it, or when a tuple holds
an array of exactly its shape at its position. ``supports={"lse": False}`` never checks
it (a tuple's second element that is something else, attention weights say). Each
checked extra is one report row (``output="lse"``) with its own tolerance; a fault in it
fails the row, never the output's.

Extension point: one :class:`Extra` in :data:`EXTRAS` (issue 18's recurrent kernels
will add ``final_state``).

The log-sum-exp
---------------
``lse_i = log sum_j exp(S_ij)`` over the keys row ``i`` may attend (scaled, soft-capped,
biased logits, before dropout), natural log; ``-inf`` (``log 0``) on a row that sees no
key, which is what a split-KV merge needs (a ``+inf`` partial would take over every
row it is merged into; FlashAttention 2 stores ``+inf`` in its final lse there). Shape
``(B, H, Nq)`` in the ``bhnd`` and ``bnhd`` layouts (FlashAttention's
``softmax_lse`` is head-major whatever the layout of ``out``), ``(Nq,)`` in ``nd``.
Its golden is :func:`attn_ref.grad.online_softmax_forward`'s lse in float64
(``np.longdouble`` for a float64 kernel).

Tolerance, derived (``docs/conformance.md``, "The log-sum-exp"): with ``u`` the unit
roundoff of the accumulation (float32's for float16/bfloat16/float32 kernels, which
accumulate logits and sums in float32 as FlashAttention does; float64's for float64),
``lse`` moves by at most the largest error of a logit it averages over, plus the
relative error of the sum of exponentials, plus its own rounding::

    |dlse_i| <= d u scale ||q_i|| max_j ||k_j||    (the dot products, Cauchy-Schwarz)
              + u (|lse_i| + max |bias|)           (rounding of the logits themselves)
              + sqrt(Nk) u                         (the sum of Nk exponentials, random walk)
    tol_i = 4 (that) + ulp(|lse_i|) in the lse's own dtype

Absolute, per row. A base-2 lse is off by ``0.44 |lse|``, a scale applied twice by
``(1 - scale) |S|``, a relative bias of ``1e-3`` by ``1e-3 |lse|``: each far outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .report import CaseResult
from .tolerance import MANTISSA_BITS, ulp

__all__ = ["Extra", "EXTRAS", "register_extra", "extras_of", "split_outputs", "extra_results",
           "lse_golden", "lse_tolerance", "diagnose_lse", "LSE_FUDGE"]

#: The factor over the derived per-row bound (module docstring).
LSE_FUDGE = 4.0


@dataclass(frozen=True)
class Extra:
    """One extra output: its name, the variants that define it, and how to judge it.

    ``shape(prep, layout)`` is the shape the kernel returns, ``canonical(x, layout)``
    maps it to the canonical layout; ``judge(prep, got, dtype=...)`` takes it there (host
    float64; ``dtype`` the kernel array's own) and returns a :class:`CaseResult`.
    """

    name: str
    variants: tuple
    shape: Any
    canonical: Any
    judge: Any
    doc: str = ""
    #: conventions a kernel may declare instead of ``True`` (``supports={"lse": "+inf"}``),
    #: each with what it means; the judge gets the declared one as ``convention=``
    conventions: dict = field(default_factory=dict)


EXTRAS: dict = {}


def register_extra(extra: Extra) -> Extra:
    EXTRAS[extra.name] = extra
    return extra


def extras_of(variant) -> tuple:
    """The extras a variant defines, in the order a tuple return holds them."""
    return tuple(e for e in EXTRAS.values() if variant.name in e.variants)


def split_outputs(ret, variant, declared: dict, prep, layout):
    """``(out, extras, problems)`` of what a kernel returned.

    ``extras`` maps an extra's name to the kernel's array (checked later);
    ``problems`` maps it to why a declared extra cannot be checked (a fail row).
    """
    known = extras_of(variant)
    extras, problems = {}, {}
    if isinstance(ret, dict):
        if "out" not in ret:
            return None, {}, {"out": f"the kernel returned a dict without 'out' (keys {sorted(ret)})"}
        out, found = ret["out"], {e.name: ret[e.name] for e in known if e.name in ret}
        by_name = True
    elif isinstance(ret, tuple):
        out = ret[0] if ret else None
        found = {e.name: ret[i + 1] for i, e in enumerate(known) if i + 1 < len(ret)}
        by_name = False
    else:
        out, found, by_name = ret, {}, False
    for e in known:
        want = declared.get(e.name)
        if want is False:
            continue
        x = found.get(e.name)
        shape = tuple(e.shape(prep, layout))
        has_shape = hasattr(x, "shape") and tuple(x.shape) == shape
        declared_present = want is not None and want is not False
        if declared_present and x is None:
            problems[e.name] = (f"declared supports={{{e.name!r}: {want!r}}} but the kernel returned "
                                f"no {e.name}")
        elif declared_present and not has_shape:
            problems[e.name] = (f"{e.name} shape {tuple(getattr(x, 'shape', ()))}, expected {shape} "
                                f"({layout}; {e.doc})")
        elif x is not None and (has_shape or by_name):
            extras[e.name] = x
    return out, extras, problems


def extra_results(ctx, prep, extras: dict, problems: dict, host: dict, base: dict) -> list:
    """One report row per checked extra (``host``: each read back to NumPy)."""
    rows = []
    for name, why in problems.items():
        rows.append(CaseResult.error(why, verdict="fail", output=name, **base))
    for name in extras:
        e = EXTRAS[name]
        x = host[name]
        if x is None or isinstance(x, str):
            rows.append(CaseResult.error(x or f"{name} could not be read", verdict="fail",
                                         output=name, **base))
            continue
        if tuple(x.shape) != tuple(e.shape(prep, ctx.layout)):
            rows.append(CaseResult.error(
                f"{name} shape {tuple(x.shape)}, expected {tuple(e.shape(prep, ctx.layout))} "
                f"({ctx.layout}; {e.doc})", verdict="fail", output=name, **base))
            continue
        try:
            got = e.canonical(np.asarray(x, dtype=np.float64), ctx.layout)
        except (TypeError, ValueError) as exc:
            rows.append(CaseResult.error(f"{name} is not numeric: {exc}", verdict="fail",
                                         output=name, **base))
            continue
        convention = ctx.kernel.outputs.get(name)
        res = e.judge(prep, got, dtype=str(x.dtype),
                      convention=convention if isinstance(convention, str) else None)
        res.shapes = base.get("shapes", {})
        rows.append(res)
    return rows


# ---------------------------------------------------------------- the log-sum-exp


def _lse_shape(prep, layout):
    b, h, nq = prep.golden.shape[:3]
    return (nq,) if layout == "nd" else (b, h, nq)


def _lse_canonical(x, layout):
    return x[None, None] if layout == "nd" else x


def _forward_lse(q, k, v, /, **kw):
    from attn_ref.grad.softmax import online_softmax_forward

    kw.pop("block_q", None), kw.pop("block_k", None)
    return online_softmax_forward(q, k, v, **kw)[1]


def lse_golden(prep, **kwargs):
    """The reference lse ``(B, H, Nq)``: float64 (longdouble for float64 kernels) values
    held as float64, ``-inf`` on rows that see no key."""
    if not kwargs and "lse" in prep.golden_extras:
        return prep.golden_extras["lse"]  # computed with the output (a long case, on Dask)
    kw = {**prep.kwargs, **kwargs}
    lse = prep.reference(prep.golden_dtype, kwargs=kw, fn=_forward_lse)
    # online_softmax_forward keeps FlashAttention's backward convention (+inf) on empty rows
    return np.where(np.isposinf(lse), -np.inf, np.asarray(lse, dtype=np.float64))


def _unit(dtype: str) -> float:
    """Unit roundoff of the accumulation: float32's for float16/bfloat16/float32."""
    return 2.0 ** -(max(MANTISSA_BITS[dtype], MANTISSA_BITS["float32"]) + 1)


def lse_tolerance(prep, golden, lse_dtype="float64"):
    """Per-row absolute bound ``(B, H, Nq)`` of the module docstring."""
    u = _unit(prep.dtype)
    q, k = prep.arrays["q"], prep.arrays["k"]
    d = q.shape[-1]
    qn = np.linalg.norm(q, axis=-1)
    kmax = float(np.max(np.linalg.norm(k, axis=-1))) if k.size else 0.0
    bias = prep.arrays.get("bias")
    bmax = float(np.max(np.abs(bias[np.isfinite(bias)]), initial=0.0)) if bias is not None else 0.0
    nk = k.shape[-2]
    mag = np.where(np.isfinite(golden), np.abs(golden), 0.0)
    qn = np.broadcast_to(qn, golden.shape) if qn.ndim == golden.ndim else np.max(qn)
    bound = d * u * prep.scale * qn * kmax + u * (mag + bmax) + math.sqrt(max(nk, 1)) * u
    store = lse_dtype.split(".")[-1] if lse_dtype.split(".")[-1] in MANTISSA_BITS else "float32"
    ulps = np.vectorize(lambda m: ulp(m, store), otypes=[float])(mag) if mag.size else mag
    return LSE_FUDGE * bound + ulps


def _lse_judge(prep, got, *, dtype="float64", convention=None):
    golden = lse_golden(prep)
    keep = None if prep.keep is None else np.broadcast_to(prep.keep, prep.golden.shape)[..., 0]
    keep = np.ones(golden.shape, bool) if keep is None else keep
    tol = lse_tolerance(prep, golden, dtype)
    empty = keep & np.isneginf(golden)
    full = keep & np.isfinite(golden)
    bad_golden = int(np.count_nonzero(keep & np.isnan(golden) | keep & np.isposinf(golden)))
    err = np.where(full & np.isfinite(got), np.abs(got - np.where(full, golden, 0.0)), 0.0)
    ratio_rows = np.where(full, err / np.maximum(tol, np.finfo(float).tiny), 0.0)
    nonfinite = int(np.count_nonzero(full & ~np.isfinite(got)))
    # -inf = log 0 on rows that see no key, or +inf where the kernel declares FlashAttention
    # 2's final-lse convention (supports={"lse": "+inf"})
    empty_ok = np.isposinf(got) if convention == "+inf" else np.isneginf(got)
    empty_wrong = int(np.count_nonzero(empty & ~empty_ok))
    ratio = float(np.max(ratio_rows, initial=0.0))
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(ratio_rows), ratio_rows.shape)) \
        if ratio_rows.size else ()
    res = CaseResult(case=prep.case.id, dtype=prep.dtype, output="lse",
                     max_err=float(np.max(err, initial=0.0)),
                     rms_err=float(np.sqrt(np.mean(err[full] ** 2))) if full.any() else 0.0,
                     tol_max=float(tol[worst]) if worst else float("nan"),
                     ratio=ratio, worst=worst)
    if bad_golden:
        res.verdict, res.diagnosis = "error", f"oracle: golden lse has {bad_golden} NaN/+inf values"
        return res
    if nonfinite or empty_wrong or ratio > 1:
        res.verdict = "fail"
        if nonfinite or empty_wrong:
            res.ratio = math.inf
        res.diagnosis = diagnose_lse(prep, got, golden, tol, keep, convention)
    return res


# ---------------------------------------------------------------- the log-sum-exp output
# The lse has its own bug classes: the base of the logarithm, the scale, the value on
# rows that see no key. Each is named only when it reproduces the kernel's lse within the
# per-row tolerance, as conformance.diagnose names a mistake of the output.


def diagnose_lse(prep, got, golden, tol, keep, convention=None) -> str:
    """Words naming the bug class of a failing ``lse`` (host ``(B, H, Nq)``, canonical);
    ``convention`` the kernel's declared one for rows with no key (``"+inf"``)."""
    words = []
    empty = keep & np.isneginf(golden)
    full = keep & np.isfinite(golden)
    e = got[empty]
    wrong_inf = (
        (np.isneginf(e), "-inf on {n} row(s) that see no key, where the kernel declares "
         "supports={{'lse': '+inf'}} (FlashAttention 2's convention)")
        if convention == "+inf" else
        (np.isposinf(e), "+inf on {n} row(s) that see no key: FlashAttention 2's final-lse "
         "convention (declare supports={{'lse': '+inf'}} if intended); the reference is "
         "log 0 = -inf, which a split-KV merge needs (a +inf partial takes over every row it "
         "is merged into)"))
    expected = "+inf" if convention == "+inf" else "-inf = log 0"
    for bad, what in (
        wrong_inf,
        (np.isnan(e), "NaN on {n} row(s) that see no key: log(0/0) or exp(-inf + inf) "
         "(the -inf row maximum not replaced before exp(S - m))"),
        (np.isfinite(e), "a finite lse on {n} row(s) that see no key, expected " + expected +
         " (a guarded log, or the -inf maximum replaced by 0 and kept)"),
    ):
        if np.any(bad):
            words.append(what.format(n=int(np.count_nonzero(bad))))
    nonfinite = full & ~np.isfinite(got)
    if np.any(nonfinite):
        words.append(f"{int(np.count_nonzero(nonfinite))} NaN/Inf lse value(s) on rows that see keys")
    sel = full & np.isfinite(got)
    g, w, t = got[sel], golden[sel], tol[sel]

    def fits(c):
        return g.size > 0 and bool(np.all(np.abs(g - c) <= t)) and not bool(np.all(np.abs(w - c) <= t))

    if g.size and not np.all(np.abs(g - w) <= t):
        scale = prep.scale
        candidates = [
            (lambda: w * math.log2(math.e), "lse in base 2 (log2 sum 2^(S log2 e) = lse / ln 2): the "
             "exp2 domain of the kernel not converted back (multiply by ln 2)"),
            (lambda: lse_golden(prep, scale=scale * scale)[sel],
             f"the scale applied twice: logits scale^2 q.k (scale = {scale:.4g})"),
            (lambda: lse_golden(prep, scale=1.0)[sel], "no scale applied to the logits (scale = 1)"),
            (lambda: w * math.log(2), "lse multiplied by ln 2 (a base-2 lse converted twice)"),
        ]
        named = None
        for make, message in candidates:
            try:
                if fits(make()):
                    named = message
                    break
            except Exception:  # a candidate that cannot be built here says nothing
                continue
        if named is None and np.all(np.abs(w) > 0):
            r = float(np.median(g / w))
            if r != 1 and fits(w * r):
                named = (f"a systematic relative bias of {r - 1:+.3g} (lse x {r:.6g}: a constant such "
                         "as ln 2 or log2 e rounded to low precision, or a scale off by that factor)")
        if named is None:
            c = float(np.median(g - w))
            if c != 0 and fits(w + c):
                named = f"a constant offset of {c:+.4g} on every row (log Nk, or a shift not undone)"
        if named is None:
            i = np.argmax(np.abs(g - w) / np.maximum(t, np.finfo(float).tiny))
            named = (f"lse off by up to {float(np.max(np.abs(g - w))):.3g} (tolerance there "
                     f"{float(t[i]):.3g}); no known lse mistake explains it")
        words.append(named)
    return "; ".join(words) or "lse fails (no finite row to compare)"


register_extra(Extra(
    name="lse", variants=("softmax", "online_softmax"), shape=_lse_shape,
    canonical=_lse_canonical, judge=_lse_judge,
    doc="the row log-sum-exp is (B, H, Nq), head-major, or (Nq,) for nd",
    conventions={"+inf": "+inf, not -inf = log 0, on rows that see no key (FlashAttention 2's "
                         "final lse)"},
))
