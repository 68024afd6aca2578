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

An extra may be asked for by name (:attr:`Extra.request`): a signature that takes
``output_final_state`` is called with ``output_final_state=True``, as fla's kernels are,
and must then return the final state.

Extension point: one :class:`Extra` in :data:`EXTRAS` (``lse``, ``final_state``).

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
    tol_i = 4 (that) + ulp(|lse_i|) in the lse's own dtype, or float32's if it is coarser
            (float64's for float64 kernels): an lse returned in float16 or bfloat16 fails

Absolute, per row. A base-2 lse is off by ``0.44 |lse|``, a scale applied twice by
``(1 - scale) |S|``, a relative bias of ``1e-3`` by ``1e-3 |lse|``: each far outside it.

The final state (recurrent family)
----------------------------------
``S_T (N, H, d_k, d_v)`` whatever the layout of the output (fla's ``K x V``), ``N`` the
batch or the number of packed sequences (``cu_seqlens``); ``(d_k, d_v)`` for ``nd``.
Float32 for float16/bfloat16 kernels, as fla returns it (``supports={"final_state":
"input_dtype"}``: rounded to the input dtype). Golden: the reference's final state in
float64 (longdouble for float64 kernels).

Tolerance, derived (``docs/conformance.md``, "Recurrent kernels"): the state is linear
in ``S_0`` and the values, ``S_T = P_0 S_0 + sum_t w_t v_t^T`` (decay: ``w_t = Lambda_t *
k_t``, ``Lambda_t = exp(sum_{s>t} a_s)``; delta rule: ``w_t = beta_t P_t k_t``, ``P_t`` the
product of the later transitions ``exp(a_s) (I - beta_s k_s k_s^T)``, norm <= 1). With ``u``
the accumulation's unit roundoff (float32's for float16/bfloat16/float32, float64's for
float64), ``M = |P_0| |S_0| + sum_t |w_t| |v_t|^T`` the magnitude of the terms and ``G``
the same sum weighted by ``|log Lambda_t|`` (the decay of each term is ``exp`` of a
cumulative sum of log-gates)::

    |dS_ij| <= (sqrt(T) + d_k) u M_ij     (the sum of T terms, random walk; d_k-term products)
             + sqrt(T) u G_ij              (the cumulative log-gates behind each decay)
    tol_ij = 4 (that) + ulp(|S_ij|) in float32 (float64 for float64 kernels)

With ``qk_l2norm`` in float16/bfloat16, ``q`` and ``k`` may reach the recurrence normalised
and stored in the kernel's dtype (fla's ``l2norm``: float32 inside, output in the input
dtype, before its chunk kernels): a kernel computing that function exactly is off the
golden by what rounding the unit keys does to the state, which the bound above (float32
accumulation of the keys as handed) does not hold. That is measured, not modelled: the
reference in float64 on the keys so rounded, ``S'``, and per sequence and head::

    tol_ij += 2 max_{i,j} |S'_ij - S_ij|

(the maximum over the head's state, because a kernel normalising in float32 rounds an
element the other way where float64 sits on a rounding boundary).

Per element, absolute, ``T`` the length of the element's sequence. A transposed state,
the state before the last token, an ignored initial state are off by ``O(|S|)``; a
relative ``1e-4`` (float32) fails at ``T = 4096``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .report import CaseResult
from .tolerance import (
    FLOAT32_PARAMS,
    LOW_PRECISION,
    MANTISSA_BITS,
    LowPrecisionArray,
    as_dtype,
    normalized_in_dtype,
    plain_array,
    round_to,
    rounding_caveat,
    rounding_cosine,
    ulp,
)

__all__ = ["Extra", "EXTRAS", "register_extra", "extras_of", "requested_keywords", "expected_outputs",
           "split_outputs",
           "extra_results", "lse_golden", "lse_tolerance", "lse_store", "diagnose_lse", "LSE_FUDGE",
           "RECURRENT", "reference_on", "final_state_golden", "state_magnitudes", "final_state_tolerance",
           "diagnose_final_state", "STATE_FUDGE", "delta_rule_without_wy", "without_wy",
           "FLA_CHUNK", "MAMBA2_CHUNK", "fp32_state_form", "chunk_running_sums", "RUNNING_SUM_WINDOWS",
           "gate_running_sums",
           "decays_in_dtype", "l2norm_conventions", "l2norm_roundings",
           "known_roundings", "nearest_rounding",
           "GATE_CLIPS", "GATE_FLUSHES", "FLUSHED_GATE", "gate_mistakes",
           "wy_chunks", "WY_CHUNKS", "BLOCK_SIZES", "boolean_options", "NOT_BOOLEAN_OPTIONS", "named_choices",
           "flipped_option_words"]

#: The online softmax's options that fix its summation order only (its tiles): the forms
#: that compute its function another way (the lse's forward, the one-shot baselines,
#: conformance.judging's fixed tiles) drop them.
BLOCK_SIZES = ("block_q", "block_k")

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
    #: keywords that ask a kernel for this output (``{"output_final_state": True}``, as
    #: fla's kernels take it), passed when its signature names them (or it takes
    #: ``**kwargs`` and declares the extra), unless it declares ``supports={name: False}``
    request: dict = field(default_factory=dict)
    #: ``explain_shape(prep, layout, shape) -> str``: words for a known wrong shape
    explain_shape: Any = None


EXTRAS: dict = {}


def register_extra(extra: Extra) -> Extra:
    EXTRAS[extra.name] = extra
    return extra


def extras_of(variant) -> tuple:
    """The extras a variant defines, in the order a tuple return holds them."""
    return tuple(e for e in EXTRAS.values() if variant.name in e.variants)


def requested_keywords(ctx, prep) -> dict:
    """The keywords that ask the kernel for its extra outputs (:attr:`Extra.request`)."""
    kw = {}
    for e in extras_of(ctx.variant):
        declared = ctx.kernel.outputs.get(e.name)
        if declared is False:
            continue
        for name, val in e.request.items():
            if name in ctx.kernel.accepts or (ctx.kernel.var_kw and declared is not None):
                kw[name] = val
    return kw


def expected_outputs(ctx) -> dict:
    """The kernel's declared extras (``supports=``), plus those its signature was asked
    for (:func:`requested_keywords`): an extra asked for by name must come back, in its
    shape, as a declared one must."""
    asked = {e.name: True for e in extras_of(ctx.variant)
             if e.request and ctx.kernel.outputs.get(e.name) is not False
             and all(n in ctx.kernel.accepts for n in e.request)}
    return {**asked, **ctx.kernel.outputs}


def _shape_words(e, prep, layout, shape):
    words = e.explain_shape(prep, layout, tuple(shape)) if e.explain_shape else ""
    return f": {words}" if words else ""


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
            asked = ", ".join(f"{n}={v!r}" for n, v in e.request.items())
            problems[e.name] = (f"declared supports={{{e.name!r}: {want!r}}}"
                                + (f" or asked for by {asked}" if asked else "")
                                + f" but the kernel returned no {e.name}")
        elif declared_present and not has_shape:
            got = tuple(getattr(x, 'shape', ()))
            problems[e.name] = (f"{e.name} shape {got}, expected {shape} ({layout}; {e.doc})"
                                + _shape_words(e, prep, layout, got))
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
                f"({ctx.layout}; {e.doc})" + _shape_words(e, prep, ctx.layout, x.shape),
                verdict="fail", output=name, **base))
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

    kw = {n: x for n, x in kw.items() if n not in BLOCK_SIZES}
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
    store = lse_store(prep, lse_dtype)
    ulps = np.vectorize(lambda m: ulp(m, store), otypes=[float])(mag) if mag.size else mag
    return LSE_FUDGE * bound + ulps


def lse_store(prep, lse_dtype):
    """The dtype whose ulp the stored lse may be off by: the one it is returned in, but no
    coarser than the accumulation's (float32; float64 for float64 kernels). An lse returned
    in float16 or bfloat16 is off by up to 0.004 ``|lse|`` or 0.03 ``|lse|``, which a split-KV
    merge turns into weights that far off: FlashAttention keeps it in float32."""
    acc = _accumulation(prep.dtype)
    store = lse_dtype.split(".")[-1]
    return store if store in MANTISSA_BITS and MANTISSA_BITS[store] >= MANTISSA_BITS[acc] else acc


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
        res.diagnosis = diagnose_lse(prep, got, golden, tol, keep, convention, dtype=dtype)
    return res


# ---------------------------------------------------------------- the log-sum-exp output
# The lse has its own bug classes: the base of the logarithm, the scale, the value on
# rows that see no key. Each is named only when it reproduces the kernel's lse within the
# per-row tolerance, as conformance.diagnose names a mistake of the output.


def diagnose_lse(prep, got, golden, tol, keep, convention=None, dtype="float64") -> str:
    """Words naming the bug class of a failing ``lse`` (host ``(B, H, Nq)``, canonical);
    ``convention`` the kernel's declared one for rows with no key (``"+inf"``), ``dtype``
    the dtype the kernel returned it in."""
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
        store = dtype.split(".")[-1]
        if store in LOW_PRECISION and lse_store(prep, dtype) != store:
            # within one ulp of the dtype it came in: right but for its storage
            coarse = np.vectorize(lambda m: ulp(m, store), otypes=[float])(np.abs(w))
            if np.all(np.abs(g - w) <= t + coarse):
                named = (f"the lse returned in {store}: its rounding alone (up to "
                         f"{2.0 ** -(MANTISSA_BITS[store] + 1):.2g} |lse|) is past the "
                         f"{_accumulation(prep.dtype)} bound, and a split-KV merge's weights "
                         f"exp(lse_i - lse) are off by as much (FlashAttention returns it in float32)")
        for make, message in ([] if named else candidates):
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


# ------------------------------------------------------ the final state (issue 18)
# The recurrent family (attn_ref.recurrent) returns the state S_T it ends on, which a
# caller hands to the next call (chunked prefill, decoding): a second output, judged
# against the reference's own final state with a bound of its own (module docstring).

#: The variants whose kernels return a final state, as fla's do with
#: ``output_final_state=True``.
RECURRENT = ("retention", "gla", "ssd", "deltanet", "gated_deltanet")
#: The factor over the derived per-element bound of the final state (module docstring).
STATE_FUDGE = 4.0
# chunk sizes the diagnoses try (those of fla's kernels and the usual Triton tiles)
_CHUNKS = (16, 32, 64)


def _segments(prep):
    """The packed sequences ``[(start, end), ...]`` of a case, ``[(0, T)]`` unpacked."""
    cu = prep.kwargs.get("cu_seqlens")
    return list(zip(cu, cu[1:])) if cu is not None else [(0, prep.case.nq)]


def _state_shape(prep, layout):
    b, h = prep.golden.shape[:2]
    cu = prep.kwargs.get("cu_seqlens")
    n = len(cu) - 1 if cu is not None else b
    if layout == "nd":
        return (prep.case.d, prep.case.dv)
    return (n, h, prep.case.d, prep.case.dv)


def _state_canonical(x, layout):
    return x[None, None] if layout == "nd" else x


def _state_shape_words(prep, layout, shape):
    want = tuple(_state_shape(prep, layout))
    if len(shape) == len(want) and shape[:-2] == want[:-2] and shape[-2:] == want[:-3:-1] \
            and want[-1] != want[-2]:
        return ("the state transposed: d_v x d_k, where it is d_k x d_v (fla's layout: S[i, j] "
                "pairs key dim i with value dim j)")
    if prep.kwargs.get("cu_seqlens") is not None and len(shape) == len(want) and \
            shape[1:] == want[1:] and shape[0] == prep.golden.shape[0]:
        return (f"one state per batch entry, not one per packed sequence ({want[0]} sequences "
                f"in cu_seqlens)")
    return ""


def reference_on(prep, dtype, lo, hi, s0, *, cu=None, sliced=True, output=False, arrays=None,
                 options=None):
    """The recurrent reference on tokens ``lo:hi`` of ``prep``'s inputs from the initial
    state ``s0`` (None: zeros), computed in ``dtype``, as host float64: its final state,
    or with ``output=True`` its output. ``cu``: packed sequences of the range;
    ``arrays``: replacements of ``q``, ``k``, ``v``; ``options``: replacements of the
    variant's options. An empty range's state is ``s0``."""
    import array_api_compat.numpy as npx

    T = prep.case.nq
    src = {n: prep.arrays[n] for n in "qkv"} if arrays is None else {**prep.arrays, **arrays}
    arrays = {n: src[n][..., lo:hi, :] if sliced else src[n] for n in "qkv"}
    if hi <= lo:
        shape = arrays["q"].shape[:-2] + (prep.case.d, prep.case.dv)
        return np.zeros(shape) if s0 is None else np.array(s0, dtype=np.float64)
    params = {}
    for n, x in prep.params.items():
        # per-step inputs (gates, beta) are (B, H, T, ...); per-head ones (gamma) are not
        per_step = hasattr(x, "shape") and x.ndim >= 3 and x.shape[2] == T
        params[n] = as_dtype(x[:, :, lo:hi] if per_step and sliced else x, dtype)
    kw = {n: x for n, x in prep.kwargs.items() if n != "cu_seqlens"}
    if cu is not None:
        kw["cu_seqlens"] = cu
    if s0 is not None:
        params["initial_state"] = as_dtype(np.asarray(s0, dtype=np.float64), dtype)
    out = prep.variant.fn(*(as_dtype(arrays[n], dtype) for n in "qkv"), output_final_state=True,
                          **kw, **params, **{**prep.options, **(options or {})},
                          xp=npx)[0 if output else 1]
    return np.asarray(out, dtype=np.float64)


def _initial_rows(prep):
    """The initial state of each packed sequence (or of the batch), None without one."""
    s0 = prep.arrays.get("initial_state")
    if s0 is None:
        return [None] * len(_segments(prep))
    if prep.kwargs.get("cu_seqlens") is None:
        return [s0]
    return [s0[i:i + 1] for i in range(s0.shape[0])]


#: Boolean keywords of the references that are not the variant's function: the case's
#: features (``causal``, ``gqa``) and a request for an extra output.
NOT_BOOLEAN_OPTIONS = ("causal", "gqa", "output_final_state")


def boolean_options(prep):
    """``(name, value)`` of each boolean option of ``prep``'s variant as the case computes
    it: set in ``prep.options`` (the delta rule's ``qk_l2norm``) or the reference's default
    (linear attention's ``normalize``, routing's ``balanced``, Reformer's ``dedup``), the
    keywords of :data:`NOT_BOOLEAN_OPTIONS` aside. The diagnoses try each the other way."""
    out = []
    for n, p in inspect.signature(prep.variant.fn).parameters.items():
        value = prep.options.get(n, p.default)
        if isinstance(value, bool) and n not in NOT_BOOLEAN_OPTIONS:
            out.append((n, value))
    return out


def flipped_option_words(name, value):
    """The diagnosis of a kernel that computes the boolean option ``name`` the other way
    round from the case's ``value`` (output and final state alike)."""
    return f"the kernel computes {name}={not value} where the case asks for {name}={value}"


def named_choices(prep):
    """``(name, value, others)`` for each option of ``prep``'s variant that chooses one of
    the variant's named functions - linear attention's ``feature_map`` (``elu+1``,
    ``relu``, ``identity``), Performer's ``kernel`` (``positive``, ``trigonometric``) -
    with the case's value and the other choices, from attn_ref's own lists. The diagnoses
    try each other choice."""
    from attn_ref.linear.options import FEATURE_MAPS
    from attn_ref.performer import KERNELS

    table = {("linear", "feature_map"): FEATURE_MAPS, ("performer", "kernel"): KERNELS}
    out = []
    for (variant, name), choices in table.items():
        value = prep.options.get(name)
        if prep.variant.name == variant and isinstance(value, str):
            out.append((name, value, tuple(c for c in choices if c != value)))
    return out


def _per_sequence(prep, dtype, ranges, initial=True):
    """States of the reference on ``ranges`` (one ``(lo, hi)`` per packed sequence), each
    from its sequence's initial state (``initial=False``: from zeros), stacked as the
    final state is."""
    rows = _initial_rows(prep)
    return np.concatenate([reference_on(prep, dtype, lo, hi, s0 if initial else None)
                           for (lo, hi), s0 in zip(ranges, rows)], axis=0)


def final_state_golden(prep):
    """The reference final state ``(N, H, d_k, d_v)``: float64 (longdouble for float64
    kernels) values held as float64, computed once per prepared case."""
    if "final_state" not in prep.golden_extras:
        s0 = prep.arrays.get("initial_state")
        prep.golden_extras["final_state"] = reference_on(
            prep, prep.golden_dtype, 0, prep.case.nq, s0, cu=prep.kwargs.get("cu_seqlens"),
            sliced=False)
    return prep.golden_extras["final_state"]


def _step_decay(prep):
    """The decay ``alpha_t`` of a decay variant (retention, GLA, SSD) broadcastable to ``k``
    ``(B, H, T, d_k)``, or None for the delta rule."""
    p, k = prep.params, prep.arrays["k"]
    if "beta" in p:
        return None
    if "gamma" in p:
        gamma = np.asarray(p["gamma"], dtype=np.float64)
        return gamma[..., None, None] if gamma.ndim else gamma
    if "g" in p:
        g = np.exp(np.asarray(p["g"], dtype=np.float64))
        return g if g.ndim == k.ndim else g[..., None]
    return None


def _log_decays(prep, k):
    """Log decay per step ``(B, H, T, e)`` (``e`` = d_k for GLA's gates, else 1)."""
    p = prep.params
    shape = k.shape[:-1] + (1,)
    if "gamma" in p:
        gamma = np.asarray(p["gamma"], dtype=np.float64)
        return np.broadcast_to(np.log(gamma)[..., None, None] if gamma.ndim else np.log(gamma),
                               shape)
    if "g" in p:
        g = np.asarray(p["g"], dtype=np.float64)
        return np.broadcast_to(g, k.shape) if g.ndim == k.ndim else np.broadcast_to(g[..., None], shape)
    return np.zeros(shape)


#: flash-linear-attention's default chunk size: its Triton chunk kernels store each
#: chunk's starting state in the input dtype (fla-core 0.6.0, ``fla/ops/common/
#: chunk_h.py``, ``chunk_fwd_h(..., states_in_fp32=False)``), and form the decays from
#: running sums of the log gates over each chunk (``chunk_local_cumsum``)
FLA_CHUNK = 64
#: Mamba-2's chunk size (``mamba_ssm``'s ``mamba_chunk_scan_combined``, ``chunk_size=256``
#: in its configs): its Triton kernels take the in-chunk decays ``exp(b_i - b_j)`` from
#: running sums over chunks this long (``_chunk_cumsum_fwd``), one of SSD's baselines
MAMBA2_CHUNK = 256


def chunk_running_sums(a, chunk=FLA_CHUNK):
    """``b_t``, the running sum of the log decays ``a`` (``(..., T, e)``) from the start of
    ``t``'s chunk of ``chunk`` steps through ``t`` (fla's ``chunk_local_cumsum``)."""
    out = np.empty_like(a)
    for c0 in range(0, a.shape[-2], chunk):
        out[..., c0:c0 + chunk, :] = np.cumsum(a[..., c0:c0 + chunk, :], axis=-2)
    return out


def _chunk_sum_weights(a, chunk=FLA_CHUNK):
    """The extra weight of step ``t``'s term in ``G`` for a kernel that decays it by
    ``exp(B_C - b_t)``, ``b`` the running sums over ``t``'s chunk (:func:`chunk_running_sums`)
    and ``B_C`` the chunk's total: ``sqrt(m_t / T) |B_C|``.

    The two sums share their first ``t`` additions, whose errors cancel in the difference;
    the ``m_t`` additions after ``t`` in the chunk each err by up to ``u |b_s| <= u |B_C|``,
    a random walk of ``sqrt(m_t) u |B_C|`` (over ``sqrt(T)``: ``G`` is multiplied by
    ``sqrt(T) u``). On fla's draws this is about the bound's own ``|after_t|``; where
    strong gates make ``|B_C|`` large and no decay follows (running sums of -200, a term
    not decayed at all), the chunk form in chunks of 64 erred 1.3 times the bound without
    it, in float32 and float64.
    """
    T = a.shape[-2]
    b = chunk_running_sums(a, chunk)
    out = np.empty_like(a)
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        after = np.arange(c1 - c0 - 1, -1, -1, dtype=np.float64)[:, None]  # m_t
        out[..., c0:c1, :] = np.sqrt(after / T) * np.abs(b[..., c1 - 1:c1, :])
    return out


def _decay_terms(k, v, a, s0):
    """``M, G`` of a decayed sum ``S_T = D S_0 + sum_t diag(L_t) k_t v_t^T`` in closed form:
    ``L_t = exp(sum_{s > t} a_s)``, ``D = exp(sum_s a_s)``; ``G`` weights each term by the
    error of the exponent a chunked kernel forms it with (:func:`_chunk_sum_weights`)."""
    after = np.cumsum(a[..., ::-1, :], axis=-2)[..., ::-1, :] - a  # sum_{s > t} a_s
    w = np.exp(after) * np.abs(k)
    m = np.swapaxes(w, -1, -2) @ np.abs(v)
    weight = np.abs(after) + _chunk_sum_weights(a)
    g = np.swapaxes(weight * w, -1, -2) @ np.abs(v)
    if s0 is not None:
        total = np.sum(a, axis=-2)[..., :, None]  # (..., e, 1)
        m = m + np.exp(total) * np.abs(s0)
        g = g + np.abs(total) * np.exp(total) * np.abs(s0)
    return m, g


def _delta_terms(k, v, a, beta, s0):
    """``M, G`` of the delta rule, ``S_t = (I - beta_t k_t k_t^T) exp(a_t) S_{t-1} + beta_t
    k_t v_t^T``: ``S_T = P_0 S_0 + sum_t w_t v_t^T`` with ``w_t = beta_t P_t k_t`` and
    ``P_t`` the product of the later steps' transitions, built backwards."""
    dk = k.shape[-1]
    run = _chunk_sum_weights(a)
    r = np.broadcast_to(np.eye(dk), k.shape[:-2] + (dk, dk)).copy()
    logr = np.zeros(k.shape[:-2] + (1, 1))
    m = np.zeros(k.shape[:-2] + (dk, v.shape[-1]))
    g = np.zeros_like(m)
    for t in range(k.shape[-2] - 1, -1, -1):
        kt = k[..., t, :]
        w = beta[..., t, None] * (r @ kt[..., :, None])[..., 0]
        outer = np.abs(w)[..., :, None] * np.abs(v[..., t, None, :])
        m += outer
        g += (np.abs(logr) + run[..., t, :][..., None]) * outer
        r = np.exp(a[..., t, :])[..., None] * (r - w[..., :, None] * kt[..., None, :])
        logr = logr + a[..., t, :][..., None]
    if s0 is not None:
        term = np.abs(r) @ np.abs(s0)
        m += term
        g += np.abs(logr) * term
    return m, g


def state_magnitudes(prep):
    """``(M, G, n)``, each shaped as the final state, of the module docstring's bound.

    ``M[i, j]``: the sum of the magnitudes of the terms whose sum is ``S_T[i, j]`` (the
    final state is linear in ``S_0`` and the values: ``S_T = P_0 S_0 + sum_t w_t
    v_t^T``); ``G``: the same sum weighted by each term's ``|log|`` of decay (where an
    error in a cumulative log-gate moves it); ``n``: the length of the sequence.
    """
    import array_api_compat.numpy as npx

    from attn_ref.recurrent import l2_normalize

    batch = prep.golden.shape[:2]
    k = np.broadcast_to(prep.arrays["k"], batch + prep.arrays["k"].shape[2:])
    v = np.broadcast_to(prep.arrays["v"], batch + prep.arrays["v"].shape[2:])
    if prep.options.get("qk_l2norm"):
        k = np.asarray(l2_normalize(np.asarray(k, dtype=np.float64), xp=npx))
    a = _log_decays(prep, k)
    beta = prep.params.get("beta")
    if beta is not None:
        beta = np.broadcast_to(np.asarray(beta, dtype=np.float64), k.shape[:-1])
    ms, gs, ns = [], [], []
    for (lo, hi), s0 in zip(_segments(prep), _initial_rows(prep)):
        sl = (..., slice(lo, hi), slice(None))
        if beta is None:
            m, g = _decay_terms(k[sl], v[sl], a[sl], s0)
        else:
            m, g = _delta_terms(k[sl], v[sl], a[sl], beta[..., lo:hi], s0)
        ms.append(m)
        gs.append(g)
        ns.append(np.full(m.shape, float(hi - lo)))
    return np.concatenate(ms), np.concatenate(gs), np.concatenate(ns)


def _accumulation(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def final_state_tolerance(prep, golden, state_dtype=None):
    """Per-element absolute bound ``(N, H, d_k, d_v)`` of the module docstring.

    The storage term is one ulp of the accumulation's dtype (float32 for float16,
    bfloat16 and float32 kernels, as fla returns its states), or of ``state_dtype`` when
    given (the ``"input_dtype"`` convention: a state returned in the kernel's dtype).
    """
    u = _unit(prep.dtype)
    m, g, n = state_magnitudes(prep)
    bound = u * ((np.sqrt(n) + prep.case.d) * m + np.sqrt(n) * g)
    store = (state_dtype or "").split(".")[-1]
    store = store if store in MANTISSA_BITS else _accumulation(prep.dtype)
    mag = np.abs(golden)
    ulps = np.vectorize(lambda x: ulp(x, store), otypes=[float])(mag) if mag.size else mag
    # the convention's term is measured, not modelled: twice it leaves room for elements a
    # float32 normalisation rounds the other way, and no more (fla's naive delta rules
    # reproduce it: ratio 0.5)
    return STATE_FUDGE * bound + 2 * _normalized_in_dtype(prep, golden) + ulps


def _normalized_in_dtype(prep, golden):
    """The module docstring's ``max |S' - S|`` per sequence and head, broadcast over the
    state (0 unless ``qk_l2norm`` in float16/bfloat16): how far the function of ``q`` and
    ``k`` normalised and stored in the kernel's dtype is from the golden's."""
    if prep.dtype not in LOW_PRECISION or not prep.options.get("qk_l2norm") or not golden.size:
        return 0.0
    unit = {n: normalized_in_dtype(prep.arrays[n], prep.dtype) for n in "qk"}
    rounded = reference_on(prep, prep.golden_dtype, 0, prep.case.nq,
                           prep.arrays.get("initial_state"), cu=prep.kwargs.get("cu_seqlens"),
                           sliced=False, arrays=unit, options={"qk_l2norm": False})
    return np.broadcast_to(np.max(np.abs(rounded - golden), axis=(-2, -1), keepdims=True),
                           golden.shape)


def _state_judge(prep, got, *, dtype="float32", convention=None):
    golden = final_state_golden(prep)
    tol = final_state_tolerance(prep, golden, dtype if convention == "input_dtype" else None)
    finite = np.isfinite(got)
    err = np.where(finite, np.abs(got - golden), 0.0)
    ratios = err / np.maximum(tol, np.finfo(float).tiny)
    ratio = float(np.max(ratios, initial=0.0))
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(ratios), ratios.shape)) \
        if ratios.size else ()
    res = CaseResult(case=prep.case.id, dtype=prep.dtype, output="final_state",
                     max_err=float(np.max(err, initial=0.0)),
                     rms_err=float(np.sqrt(np.mean(err ** 2))) if err.size else 0.0,
                     tol_max=float(tol[worst]) if worst else float("nan"), ratio=ratio,
                     worst=worst[:3])
    bad_golden = int(np.count_nonzero(~np.isfinite(golden)))
    if bad_golden:
        res.verdict = "error"
        res.diagnosis = f"oracle: golden final state has {bad_golden} non-finite values"
        return res
    nonfinite = int(np.count_nonzero(~finite))
    if nonfinite or ratio > 1:
        res.verdict = "fail"
        if nonfinite:
            res.ratio = math.inf
        res.diagnosis = diagnose_final_state(prep, got, golden, tol, dtype)
    return res


# The final state's own bug classes: its layout, which step it is taken at, what happens
# to the initial state and at sequence boundaries, its precision. Each is named only when
# it reproduces the kernel's state (within the tolerance, or all but 1/50 of the error),
# the rule of conformance.diagnose.


#: log gates a kernel may clip its gates at (:func:`gate_mistakes`)
GATE_CLIPS = (-5.0, -10.0)
#: decays ``exp(g)`` below which a kernel may flush them to 0 (:func:`gate_mistakes`)
GATE_FLUSHES = (1e-4, 1e-6)
#: a log gate whose exp() is exactly 0 in every dtype: the stand-in of a decay flushed to
#: 0 (``-inf`` would make a difference of running sums ``-inf - -inf = NaN``)
FLUSHED_GATE = -1e4


def fp32_state_form(name, store_every=None, store_dtype=None, *, normalized_in_dtype=False,
                    final_state=False):
    """The recurrent variant ``name`` as a plain fp32-accumulating kernel in half precision.

    Parameters
    ----------
    name : str
        A variant of :mod:`attn_ref.recurrent` (``"retention"``, ``"gla"``...).
    store_every : int, optional
        Also round the state to the dtype at every ``store_every``-th step, as fla's chunk
        kernels store it between chunks (``FLA_CHUNK``); 1 is a kernel whose state is
        held in the dtype (the mistake :mod:`conformance.diagnose` names).
    store_dtype : str, optional
        The dtype the state is stored in (``"bfloat16"``, ``"float16"``); by default the
        inputs' own.
    normalized_in_dtype : bool
        With ``qk_l2norm=True``: normalise ``q`` and ``k`` in float32 and store them in the
        dtype before the recurrence, as a model that calls fla's ``l2norm`` (float32
        inside, output in the input dtype) before the kernel does.
    final_state : bool
        Return ``(output, final states)``, the states ``(N, H, d_k, d_v)`` as the float64
        values they hold (one per batch entry, or per packed sequence), stored as the
        state is.

    Returns
    -------
    callable
        A function with the reference's signature. On :class:`LowPrecisionArray` inputs
        (``q, k, v``, gates, ``beta``, the initial state, as the dtype holds them) it
        computes the chunk form (chunks of ``FLA_CHUNK``) with the state and products in
        float32 and rounds the output to the dtype once: what ``attn_ref.recurrent``
        computes for half inputs, and fla's kernels. Every setting computes the
        variant's function in exact arithmetic; on other arrays (float64) nothing is
        rounded. ``O(T / C)`` reference calls per sequence (``C = store_every``).
    """

    def form(q, k, v, /, *, xp=None, cu_seqlens=None, initial_state=None, **kw):
        from attn_ref.registry import get

        fn = get(name).fn
        cls = type(q) if isinstance(q, LowPrecisionArray) else None
        rnd = (lambda x: x) if cls is None else cls.round
        store = rnd if store_dtype is None or cls is None else LOW_PRECISION[store_dtype].round
        q, k, v, initial_state, cu_seqlens = (plain_array(x) for x in (q, k, v, initial_state,
                                                                         cu_seqlens))
        kw = {n: plain_array(x) for n, x in kw.items()}
        kw.update(form="chunk", chunk_size=FLA_CHUNK, output_final_state=True, xp=xp)
        if normalized_in_dtype and kw.get("qk_l2norm") and cls is not None:
            from .tolerance import normalized_in_dtype as unit_in_dtype  # the name is the flag's here

            q, k = (np.asarray(unit_in_dtype(x, cls.dtype_name), dtype=np.float32) for x in (q, k))
            kw["qk_l2norm"] = False
        nb, steps = q.ndim - 2, q.shape[-2]  # the time axis follows the batch axes

        def cut(x, a, b):
            per_step = isinstance(x, np.ndarray) and x.ndim > nb and x.shape[nb] == steps
            return x[(slice(None),) * nb + (slice(a, b),)] if per_step else x

        def run(a, b, s):
            """Steps ``a:b`` of one sequence from the state ``s``: its output and state."""
            outs = []
            step = store_every or b - a
            for c in range(a, b, step):
                e = min(c + step, b)
                o, s = fn(cut(q, c, e), cut(k, c, e), cut(v, c, e), initial_state=s,
                          **{n: cut(x, c, e) for n, x in kw.items()})
                s = store(np.asarray(s))
                outs.append(o)
            return np.concatenate(outs, axis=-2), s

        bounds = [0, q.shape[-2]] if cu_seqlens is None else [int(t) for t in cu_seqlens]
        outs, states = [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if initial_state is None:  # q is (1, ...) with packed sequences: one state each
                s0 = np.zeros(q.shape[:nb] + (k.shape[-1], v.shape[-1]), dtype=q.dtype)
            else:
                s0 = initial_state if cu_seqlens is None else initial_state[i:i + 1]
            if a == b:
                states.append(np.asarray(s0))
                continue
            o, s = run(a, b, s0)
            outs.append(o)
            states.append(np.asarray(s))
        if not outs:
            out = xp.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
        else:
            out = rnd(np.concatenate(outs, axis=-2))
            out = out if cls is None else out.view(cls)
        if final_state:
            return out, np.concatenate([np.asarray(s, dtype=np.float64) for s in states], axis=0)
        return out

    form.__name__ = f"{name}_fp32_state" + ("" if store_every is None else
                                            f"_stored_every_{store_every}")
    return form


def gate_mistakes(prep):
    """``(message, prep')`` for each known mistake in the log gates ``g`` that changes them
    on this case: the gates clipped at each of :data:`GATE_CLIPS` (``g < -5`` taken as -5:
    a decay below ``e^-5 = 0.0067`` leaks the state it should erase), and decays below
    each of :data:`GATE_FLUSHES` flushed to 0. ``prep'`` is ``prep`` with those gates, so
    its reference computes what such a kernel does. Nothing for a variant without gates.
    """
    if "g" not in prep.params:
        return

    g = np.asarray(prep.params["g"], dtype=np.float64)
    for lo in GATE_CLIPS:
        if (g < lo).any():
            yield (f"the log gates are clipped at {lo:g}: a decay exp(g) below e^{lo:g} = "
                   f"{math.exp(lo):.2g} is raised to it, so the state it erases leaks on",
                   replace(prep, params={**prep.params, "g": np.maximum(g, lo)}))
    for small in GATE_FLUSHES:
        low = g < math.log(small)
        if low.any():
            yield (f"decays exp(g) below {small:g} are flushed to 0 (log gates below "
                   f"{math.log(small):.3g} taken as -inf): the state they keep a trace of is dropped",
                   replace(prep, params={**prep.params, "g": np.where(low, FLUSHED_GATE, g)}))


def decays_in_dtype(prep):
    """``(message, prep')`` for a float16/bfloat16 kernel holding a per-head decay that
    kernels keep in float32 (:data:`conformance.tolerance.FLOAT32_PARAMS`: retention's
    ``gamma``) in its dtype: ``gamma`` rounded, its log (a slope, ``gamma = exp(-slope)``)
    rounded, or both; each only where it changes ``gamma``. Another function: in
    bfloat16 ``1 - 2^-9`` rounds to 1 (no decay) from the fifth head on. A torch
    retention loop so written failed two outputs (named) and two final states, one of
    them read "the state is held in bfloat16" by the size of its error."""
    if prep.dtype not in LOW_PRECISION:
        return
    dt = prep.dtype
    for name in sorted(FLOAT32_PARAMS & set(prep.params)):
        x = np.asarray(prep.params[name], dtype=np.float64)
        if not np.all(x > 0):
            continue
        from_log = np.exp(round_to(np.log(x), dt))
        seen = [x]
        for how, held in ((f"rounded to {dt}", round_to(x, dt)),
                          (f"as exp of its log rounded to {dt} (a slope held in {dt})", from_log),
                          (f"as exp of its log rounded to {dt}, the exponential rounded too",
                           round_to(from_log, dt))):
            if any(np.array_equal(held, y) for y in seen):
                continue
            seen.append(held)
            yield (f"the decay {name} held in {dt}: {how}, where kernels keep it in float32 (the "
                   f"decays 1 - 2^(-5-h) are not all {dt} numbers; rounded, they are another "
                   f"function)", replace(prep, params={**prep.params, name: held}))


#: windows longer than :data:`FLA_CHUNK` over which :func:`gate_running_sums` takes the
#: running sums (and the whole sequence): the bound takes chunks of ``FLA_CHUNK``
RUNNING_SUM_WINDOWS = (128, 256)


def _running_sums_rounded(a, acc, order):
    """The running sums of ``a (..., T, e)`` along ``T`` as an implementation in ``acc``
    rounds them: ``"rounded"`` each exact sum rounded once (torch's CPU ``cumsum`` of
    float32, which accumulates in double), ``"sequential"`` one addition at a time in ``acc``,
    ``"scan"`` a Hillis-Steele scan in ``acc`` (Triton's ``tl.cumsum``)."""
    if order == "rounded":  # from sums in long double: float64 sums too are rounded once
        return round_to(np.cumsum(a.astype(np.longdouble), axis=-2).astype(np.float64), acc)
    if order == "sequential":
        out, run = np.empty_like(a), np.zeros_like(a[..., :1, :])
        for t in range(a.shape[-2]):
            run = round_to(run + a[..., t:t + 1, :], acc)
            out[..., t:t + 1, :] = run
        return out
    b, shift = a, 1
    while shift < a.shape[-2]:
        b = np.concatenate([b[..., :shift, :], round_to(b[..., shift:, :] + b[..., :-shift, :], acc)],
                           axis=-2)
        shift *= 2
    return b


def gate_running_sums(prep):
    """``(message, prep')`` for kernels that form the decays ``exp(b_i - b_j)`` from running
    sums ``b`` of the log gates over windows longer than :data:`FLA_CHUNK` (each of
    :data:`RUNNING_SUM_WINDOWS` shorter than a sequence, and the whole sequence), rounded
    in the kernel's arithmetic (its dtype; float32 too for float16/bfloat16) in each
    order of :func:`_running_sums_rounded`; a rounding that another order or dtype
    repeats is given once.

    Such a kernel computes the function exactly for the gates ``g'_t = b_t - b_{t-1}``
    (the rounded sums' differences, exact in float64): ``prep'`` is ``prep`` with those
    gates, so its reference computes what the kernel does, but for the kernel's other
    roundings. Each exponent then errs by about an ulp of ``|b_i|``, which grows with
    the window (fla's ``naive_parallel_simple_gla`` takes them over the whole sequence:
    ``long:b1h1-q1000k1000-d64-causal-tl``, float32, failed at 6.7, read "the error grows
    with N"). Nothing where the running sums stay within one chunk of ``FLA_CHUNK``.
    """
    if "g" not in prep.params:
        return
    g = np.asarray(prep.params["g"], dtype=np.float64)
    scalar = g.ndim < 4  # one gate a step, (B, H, T) or broadcast, or GLA's (B, H, T, d_k)
    a = g[..., None] if scalar else g
    segs = _segments(prep)
    longest = max(b - a0 for a0, b in segs)
    if longest <= FLA_CHUNK:
        return
    accs = dict.fromkeys((prep.dtype if prep.dtype not in LOW_PRECISION else "float32", prep.dtype))
    seen = []
    for w in [w for w in RUNNING_SUM_WINDOWS if w < longest] + [longest]:
        where = "the whole sequence" if w == longest else f"windows of {w} steps"
        for acc in accs:
            for order in ("rounded", "sequential", "scan"):
                changed, top = np.empty_like(a), 0.0
                for a0, b0 in segs:
                    for c0 in range(a0, b0, w):
                        c1 = min(c0 + w, b0)
                        run = _running_sums_rounded(a[..., c0:c1, :], acc, order)
                        top = max(top, float(np.max(np.abs(run), initial=0.0)))
                        changed[..., c0:c1, :] = np.diff(run, axis=-2, prepend=0.0)
                if any(np.array_equal(changed, x) for x in seen):
                    continue
                seen.append(changed)
                how = {"rounded": "each rounded once", "sequential": "added one step at a time",
                       "scan": "by a parallel scan"}[order]
                yield (f"the decays exp(b_i - b_j) are formed from running sums b of the log gates "
                       f"over {where} ({how}, in {acc}), not over chunks of {FLA_CHUNK} or from "
                       f"nearer reference points: each exponent errs by about an ulp of |b_i|, "
                       f"which grows with the window (|b| reaches {top:.4g} here); take them per "
                       f"chunk (fla's chunk_local_cumsum) or as sums between the two steps",
                       replace(prep, params={**prep.params,
                                             "g": changed[..., 0] if scalar else changed}))


def _normalised(prep, q, k, words):
    """``(words, prep')``: ``prep`` with ``q`` and ``k`` replaced (float64 values of the
    kernel's normalised ones) and ``qk_l2norm`` off, so that its reference computes on
    them."""
    return words, replace(prep, arrays={**prep.arrays, "q": q, "k": k},
                          options={**prep.options, "qk_l2norm": False})


def l2norm_conventions(prep):
    """``(message, prep')`` for the delta rule's ``qk_l2norm`` taken another way that
    changes this case (another function): ``q`` and ``k`` scaled to unit length,
    ``x / max(|x|, eps)`` (``torch.nn.functional.normalize``, whose ``eps`` is 1e-12),
    where fla's ``l2norm`` divides by ``sqrt(|x|^2 + 1e-6)``: the two differ where
    ``|x|^2`` is not far above 1e-6 (``small_qk`` cases: a kernel so written failed
    float32 at 3.5e4, read "the size a plain bfloat16 implementation makes")."""
    if not {**prep.options, **prep.kwargs}.get("qk_l2norm"):
        return
    q, k = (np.asarray(prep.arrays[n], dtype=np.float64) for n in "qk")
    unit = [x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), 1e-12) for x in (q, k)]
    yield _normalised(prep, *unit, "q and k scaled to unit length, x / max(|x|, eps) "
                      "(torch.nn.functional.normalize), where fla's l2norm (qk_l2norm) takes "
                      "x / sqrt(|x|^2 + 1e-6)")


def l2norm_roundings(prep):
    """``(message, prep')`` for a float16/bfloat16 kernel that normalises ``q`` and ``k``
    (``qk_l2norm``) in the dtype, where fla's ``l2norm`` divides by the float32 norm and
    rounds once (:func:`conformance.tolerance.normalized_in_dtype`, the bound's form):
    ``torch.nn.functional.normalize`` on half tensors (the norm rounded to the dtype,
    then the quotient) and ``x * rsqrt(sum(x * x) + 1e-6)`` in the dtype (each product,
    the sum, the reciprocal square root rounded; the form of HuggingFace's ``l2norm``,
    which HF's gated delta rule applies after its float32 cast). Either scales a whole
    row by one rounding of its norm, half an ulp of the dtype, where the bound takes
    rounding each element alone: a delta rule's state, ``|k|^2`` off 1 at every write,
    failed at 1.1-2.1 (bfloat16, seeds 0-2) reading "no known mistake"."""
    from attn_ref.recurrent.delta import L2NORM_EPS

    if prep.dtype not in LOW_PRECISION or not {**prep.options, **prep.kwargs}.get("qk_l2norm"):
        return
    dt = prep.dtype
    q, k = (np.asarray(prep.arrays[n], dtype=np.float64) for n in "qk")

    def divided(x):  # normalize's x / max(|x|, eps), eps = 1e-12: zero rows stay zero
        norm = round_to(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), dt)
        return round_to(x / np.maximum(norm, 1e-12), dt)

    def rsqrt(x):
        sq = round_to(np.sum(round_to(x * x, dt), axis=-1, keepdims=True), dt)
        return round_to(x * round_to(1.0 / np.sqrt(round_to(sq + L2NORM_EPS, dt)), dt), dt)

    yield _normalised(prep, divided(q), divided(k),
                      f"q and k normalised in {dt}: the norm rounded to {dt} and q, k divided by "
                      f"it (torch.nn.functional.normalize on {dt} tensors), where fla's l2norm "
                      f"divides by the float32 norm and rounds once: every row scaled by one "
                      f"rounding of its norm")
    yield _normalised(prep, rsqrt(q), rsqrt(k),
                      f"q and k normalised in {dt}: x * rsqrt(sum(x * x) + 1e-6) with every step "
                      f"rounded to {dt}, where fla's l2norm computes in float32 and rounds once: "
                      f"every row scaled by the rounding of its norm")


def known_roundings(prep):
    """Roundings of the variant's function that the bound does not take, each as
    ``(message, prep')`` whose reference computes what such a kernel does but for its
    other roundings: :func:`gate_running_sums` and :func:`l2norm_roundings`."""
    yield from gate_running_sums(prep)
    yield from l2norm_roundings(prep)


def nearest_rounding(prep, got, make, keep=None, key=None):
    """``(message, candidate)`` of :func:`known_roundings` whose ``make(prep')`` is
    nearest ``got`` (the largest difference over ``keep`` and ``got``'s finite values), or
    None. One rounding of the kind is named, not each: several orders and dtypes can be
    within the bound of a kernel's output and would read as so many mistakes. With
    ``key``, the candidates are made once per prepared case and kind of output (a
    reference run each, up to 20 of them; the signature and the driver both ask)."""
    store = prep.golden_extras if key is not None else {}
    slot = ("known roundings", key)
    if slot not in store:
        made = []
        for message, changed in known_roundings(prep):
            try:
                made.append((message, np.asarray(make(changed), dtype=np.float64)))
            except Exception:  # a candidate that cannot be built here says nothing
                continue
        store[slot] = made
    ok = np.isfinite(got) if keep is None else np.broadcast_to(keep, got.shape) & np.isfinite(got)
    best = None
    for message, cand in store[slot]:
        if cand.shape != got.shape:
            continue
        off = float(np.max(np.abs(cand - got)[ok], initial=0.0))
        if best is None or off < best[0]:
            best = (off, message, cand)
    return None if best is None else best[1:]


def _state_candidates(prep, golden):
    """``(message, make)`` pairs, ``make()`` the state a mistake would return."""
    segs = _segments(prep)
    dk, dv = prep.case.d, prep.case.dv
    packed = prep.kwargs.get("cu_seqlens") is not None
    out = []
    if dk == dv:
        out.append(("the state transposed: d_v x d_k, where it is d_k x d_v (fla's layout: "
                    "S[i, j] pairs key dim i with value dim j)", lambda: np.swapaxes(golden, -1, -2)))
    if "initial_state" in prep.arrays:
        def zero_start():
            return _per_sequence(prep, "float64", segs, initial=False)
        out += [
            ("the initial state ignored: the final state is the one from S_0 = 0", zero_start),
            ("the initial state not decayed: S_0 added to the final state as it came in, "
             "not carried through the steps' decays (and delta-rule updates)",
             lambda: zero_start() + prep.arrays["initial_state"]),
        ]
    if packed:
        first = _initial_rows(prep)[0]
        out.append(("the state not reset at the packed sequences' boundaries (cu_seqlens): each "
                    "sequence starts from the previous one's final state",
                    lambda: np.concatenate([reference_on(prep, "float64", 0, hi, first)
                                            for _, hi in segs], axis=0)))
    for message, changed in [*l2norm_conventions(prep), *decays_in_dtype(prep)]:
        out.append((message, lambda changed=changed: _per_sequence(changed, "float64", segs)))
    decay = _step_decay(prep)
    if decay is not None:
        out.append(("the gate applied after the update (S_t = diag(alpha_t) (S_{t-1} + k_t^T v_t): "
                    "the current token decays too)",
                    lambda: np.concatenate([reference_on(prep, "float64", lo, hi, s0, arrays={
                        "k": prep.arrays["k"] * decay}) for (lo, hi), s0 in zip(segs, _initial_rows(prep))])))
    for c in _CHUNKS:
        if all(hi - lo <= c for lo, hi in segs):
            continue

        def not_carried(c=c):
            # each sequence's last chunk from S = 0, or from its initial state where that
            # chunk is its first (the state enters a sequence's first chunk as the output's
            # candidate has it: an audit's packed sequence of 15 tokens read "no known mistake")
            parts = []
            for (lo, hi), s0 in zip(segs, _initial_rows(prep)):
                start = lo + c * ((hi - lo - 1) // c)
                parts.append(reference_on(prep, "float64", start, hi, s0 if start == lo else None))
            return np.concatenate(parts, axis=0)
        out.append((f"the state not carried across chunks of {c}: the final state is the last "
                    f"chunk's alone, from S = 0", not_carried))
    if "beta" in prep.params:
        for c in wy_chunks(prep):
            out.append((f"the WY correction dropped (chunks of {c}): each chunk writes U = T beta V "
                        f"instead of U - W S, its corrections computed as if it started from S = 0",
                        lambda c=c: without_wy(prep, c)[1]))
    for message, changed in gate_mistakes(prep):
        out.append((message, lambda changed=changed: _per_sequence(changed, "float64", segs)))
    for name, value in boolean_options(prep):
        flipped = replace(prep, options={**prep.options, name: not value})
        out.append((flipped_option_words(name, value),
                    lambda flipped=flipped: _per_sequence(flipped, "float64", segs)))
    out.append(("the state before the last token's update (S_{T-1}: the last step not written "
                "back)", lambda: _per_sequence(prep, "float64", [(lo, hi - 1) for lo, hi in segs])))
    for c in _CHUNKS:
        if all((hi - lo) % c == 0 for lo, hi in segs):
            continue
        out.append((f"the state at the last chunk boundary (chunks of {c}): the tokens after the "
                    f"last full chunk not added",
                    lambda c=c: _per_sequence(prep, "float64",
                                              [(lo, lo + c * ((hi - lo) // c)) for lo, hi in segs])))
    for c in _CHUNKS:
        if all(hi - lo <= c for lo, hi in segs) and "initial_state" not in prep.arrays:
            continue

        def undecayed(c=c):
            # the state carried into the last chunk added without that chunk's decay
            starts = [lo + c * ((hi - lo - 1) // c) for lo, hi in segs]
            carried = _per_sequence(prep, "float64", [(lo, s) for (lo, _), s in zip(segs, starts)])
            rest = _per_sequence(prep, "float64", [(s, hi) for (_, hi), s in zip(segs, starts)],
                                 initial=False)
            return carried + rest
        out.append((f"the carried state not decayed over the last chunk (chunks of {c}): the decay "
                    f"of the last chunk not applied to the state it starts from", undecayed))
    return out


# The delta rule without its WY correction: a mistake named on the output
# (conformance.diagnose) and on the final state (below), and planted by conformance.mutants.


def delta_rule_without_wy(q, k, v, beta, g, s0, *, chunk, scale):
    """The (gated) delta rule's chunk form with the WY correction dropped, on host float64.

    One sequence: ``q, k (..., T, d_k)``, ``v (..., T, d_v)``, ``beta, g (..., T)`` (log
    decays, zeros for DeltaNet), ``s0 (..., d_k, d_v)``. Each chunk of ``chunk`` steps
    writes the values ``U = (I + A)^{-1} (beta V)`` (``A`` the strictly lower
    ``beta_i k_i . k_j`` decayed) instead of ``U - W S``: its corrections are computed as
    if the chunk started from ``S = 0``, while its queries still read the carried ``S``
    and the state is handed on with these ``U``. Returns ``(o (..., T, d_v), S_T)``.
    ``O(T C (d_k + d_v) + T d_k d_v)`` time. The mistake of
    the mutant ``"WY correction dropped"`` of :mod:`conformance.mutants`; see :doc:`/recurrent`.
    """
    T = q.shape[-2]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    S = s0
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(c0 + chunk, T))
        qc, kc, vc, bc = q[..., sl, :], k[..., sl, :], v[..., sl, :], beta[..., sl]
        b = np.cumsum(g[..., sl], axis=-1)
        n = qc.shape[-2]
        low = np.tril(np.ones((n, n), dtype=bool))
        with np.errstate(over="ignore"):  # masked to -inf before exp: nothing overflows
            d = np.exp(np.where(low, b[..., :, None] - b[..., None, :], -np.inf))
        a = np.tril(bc[..., :, None] * (kc @ np.swapaxes(kc, -1, -2)) * d, -1)
        u = np.linalg.solve(np.eye(n) + a, bc[..., :, None] * vc)  # no "- W S"
        out[..., sl, :] = scale * (((qc @ np.swapaxes(kc, -1, -2)) * d) @ u
                                   + np.exp(b)[..., None] * (qc @ S))
        S = np.exp(b[..., -1:, None]) * S + np.swapaxes(
            kc * np.exp(b[..., -1:] - b)[..., None], -1, -2) @ u
    return out, S


def without_wy(prep, chunk):
    """:func:`delta_rule_without_wy` on ``prep``'s rounded inputs, each packed sequence from
    its own initial state: ``(output (B, H, T, d_v), final states (N, H, d_k, d_v))``."""
    from attn_ref.recurrent.delta import L2NORM_EPS

    a, p = prep.arrays, prep.params
    q, k, v = a["q"], a["k"], a["v"]
    if {**prep.options, **prep.kwargs}.get("qk_l2norm"):
        q, k = (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS) for x in (q, k))
    beta = np.broadcast_to(np.asarray(p["beta"], dtype=np.float64), q.shape[:-1])
    g = np.broadcast_to(np.asarray(p.get("g", 0.0), dtype=np.float64), q.shape[:-1])
    cu, s0 = prep.kwargs.get("cu_seqlens"), a.get("initial_state")
    segs = list(zip(cu, cu[1:])) if cu is not None else [(0, prep.case.nq)]
    rows = [s0] if cu is None else [None if s0 is None else s0[i:i + 1] for i in range(len(segs))]
    outs, finals = [], []
    for (lo, hi), s in zip(segs, rows):
        s = np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1])) if s is None else s
        o, s = delta_rule_without_wy(q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :],
                                     beta[..., lo:hi], g[..., lo:hi], s, chunk=chunk,
                                     scale=prep.scale)
        outs.append(o)
        finals.append(s)
    return np.concatenate(outs, axis=-2), np.concatenate(finals, axis=0)


#: chunk sizes a dropped WY correction is tried at: fla's kernels' and the usual tiles
WY_CHUNKS = (16, 32, 64)


def wy_chunks(prep):
    """The chunk sizes at which dropping the WY correction changes ``prep``'s case: the
    correction ``W S`` is zero in a chunk entered with ``S = 0``, so a case needs a chunk
    after the first of a sequence, or an initial state."""
    cu = prep.kwargs.get("cu_seqlens")
    longest = int(max(np.diff(cu))) if cu is not None else prep.case.nq
    first = prep.options.get("chunk_size")
    sizes = list(dict.fromkeys(([first] if first else []) + list(WY_CHUNKS)))
    split = [c for c in sizes if longest > c]
    # every size that holds each sequence in one chunk gives the same output: one of them
    whole = [c for c in sizes if longest <= c][:1] if "initial_state" in prep.arrays else []
    return split + whole


def _state_in_half_words(prep, got, golden, err):
    """A float16/bfloat16 kernel's final state whose error (``err``) is the size of one held
    in a half dtype and rounded at every step (within a factor of 3; of the dtype and
    bfloat16, the nearer): the bound takes a float32 state. The output's diagnosis names
    such a state from its own error; the final state read "no known mistake of the final
    state explains it" (a torch GLA loop rounding its state to bfloat16 at every step:
    25 of 25 rows). The size alone cannot tell it from a mistake of that size: named only
    where the two errors share a direction
    (:func:`conformance.tolerance.rounding_cosine`)."""
    if prep.dtype not in LOW_PRECISION or err <= 0:
        return None
    best = None
    for store in dict.fromkeys((prep.dtype, "bfloat16")):
        form = fp32_state_form(prep.variant.name, 1, store, final_state=True)
        held = {}

        def fn(*a, form=form, held=held, **kw):
            out, held["state"] = form(*a, **kw)
            return out

        try:
            prep.reference(prep.dtype, fn=fn)
        except Exception:  # a form that cannot run here says nothing
            continue
        state = held.get("state")
        if state is None or state.shape != golden.shape:
            continue
        be = float(np.max(np.abs(state - golden), initial=0.0))
        off = abs(math.log(err / be)) if be > 0 else math.inf
        if off <= math.log(3.0) and (best is None or off < best[0]):
            best = (off, store, be, state)
    if best is None:
        return None
    _, store, be, state = best
    cos, least = rounding_cosine(got - golden, state - golden)
    if cos < least:
        # the size alone: a retention kernel holding gamma in bfloat16 errs that much too
        # (cosine -0.04), and was named so before its own candidate joined
        return None
    return (f"the state is held in {store}, rounded at every step: its error ({err:.2g}) is the "
            f"size such a state makes ({be:.2g}) and shares its direction (cosine {cos:.2f}), "
            f"where the bound takes a float32 state (fla's chunk kernels store it in the dtype "
            f"only between chunks of {FLA_CHUNK})")


def diagnose_final_state(prep, got, golden, tol, state_dtype=None) -> str:
    """Words naming the bug class of a failing final state (host, canonical layout);
    ``state_dtype`` the dtype the kernel returned it in."""
    finite = np.isfinite(got)
    if not np.all(finite):
        return f"{int(np.count_nonzero(~finite))} NaN/Inf value(s) in the final state"
    err = float(np.max(np.abs(got - golden), initial=0.0))
    store = (state_dtype or "").split(".")[-1]
    acc = _accumulation(prep.dtype)
    if store in MANTISSA_BITS and MANTISSA_BITS[store] < MANTISSA_BITS[acc]:
        lowered = f"the final state is returned in {store}, below the {acc} it accumulates in"
        if prep.dtype in LOW_PRECISION:
            lowered += (" (fla returns float32 states; declare supports={'final_state': "
                        "'input_dtype'} if the rounding is intended)")
        rounded = np.asarray(round_to(golden, store), dtype=np.float64)
        if np.all(np.abs(got - rounded) <= tol + np.abs(rounded - golden)):
            return lowered + ": precision below the dtype"

    def fits(c):
        if np.all(np.abs(golden - c) <= tol):
            return False  # the mistake changes nothing on this case
        off = np.abs(got - c)
        return bool(np.all(off <= tol)) or float(np.max(off)) <= err / 50

    named = []
    for message, make in _state_candidates(prep, golden):
        try:
            cand = make()
        except Exception:  # a candidate that cannot be built here says nothing
            continue
        if cand.shape == golden.shape and fits(cand):
            named.append(message)
    if named:
        # mistakes that give the same state on this case cannot be told apart: name each
        return named[0] if len(named) == 1 else (
            " - or ".join(named[:3]) + " (these mistakes give the same final state on this case)")
    # a rounding, not another function: of the running sums' roundings, the nearest alone
    near = nearest_rounding(prep, got, lambda c: _per_sequence(c, "float64", _segments(prep)),
                            key="final_state")
    if near is not None and fits(near[1]):
        return near[0].replace("the decays exp(b_i - b_j) are", "the state's decays exp(B - b_t) are", 1)
    words = _state_in_half_words(prep, got, golden, err)
    if words:
        return words
    lower = {"float64": ("float32",), "float32": ()}.get(prep.dtype, ())
    for dt in lower:
        try:
            base = _per_sequence(prep, dt, _segments(prep))
        except Exception:
            continue
        be = float(np.max(np.abs(base - golden)))
        # a float32 loop can err several times less than the chunked float32 reference
        # (measured: fla's naive GLA at 1/5 of it); an error of that order, far above the
        # dtype's own rounding, is the float32 computation - or a mistake of that relative
        # size, which only a shared direction rules out
        if be > 0 and 0.05 <= err / be <= 5.0:
            cos, least = rounding_cosine(got - golden, base - golden)
            return (f"the state computes in {dt}: its error ({err:.2g}) is the size a plain {dt} "
                    f"implementation makes ({be:.2g}), precision below the dtype"
                    + rounding_caveat(cos, least)
                    + (f" (and is returned in {store})" if store == dt else ""))
    i = np.unravel_index(np.argmax(np.abs(got - golden) / np.maximum(tol, np.finfo(float).tiny)),
                         golden.shape)
    return (f"final state off by up to {err:.3g} (tolerance there {float(tol[i]):.3g} at "
            f"(sequence, head, i, j) = {tuple(int(x) for x in i)}); no known mistake of the final "
            f"state explains it")


register_extra(Extra(
    name="final_state", variants=RECURRENT, shape=_state_shape, canonical=_state_canonical,
    judge=_state_judge,
    doc="the final state is (N, H, d_k, d_v) whatever the layout of the output, N the batch or "
        "the number of packed sequences (cu_seqlens), (d_k, d_v) for nd",
    request={"output_final_state": True}, explain_shape=_state_shape_words,
    conventions={"input_dtype": "the state returned in the kernel's own dtype (float16/bfloat16), "
                                "rounded from its float32 accumulation; fla returns float32"},
))
