"""The diagnosis of one failed case (:func:`diagnose`): non-finite values, the mistake
signatures, where the error lives, precision; the order and the rule are the package
docstring's."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..extras import FLA_CHUNK, RECURRENT, fp32_state_form
from ..ties import kmeans_margins
from ..tolerance import (
    LOGITS_IN_DTYPE,
    LOW_PRECISION,
    MANTISSA_BITS,
    host_dtype,
    measure,
    ratios,
    round_to,
    rounding_caveat,
    rounding_cosine,
)
from .base import (
    SIGNATURES,
    compared,
    host_logits,
    nearest_output_rounding,
    reproduces,
)
from .modern import eager_softmax

# ------------------------------------------------ the softmax as exp(s - logsumexp(s))


def _lse_softmax(prep, res, got):
    """The softmax computed as ``exp(S - logsumexp(S))`` (trax,
    HuggingFace's Reformer ``LocalSelfAttention``, ``log_softmax(S).exp()``), named when
    that form (:func:`conformance.judging.lse_form`, NumPy, the kernel's dtype) errs on
    this case at least 0.8 of the tolerance and the kernel's max and RMS errors are both
    within 2x of its: ``S - lse`` rounds at ``|lse|``, a relative error ``eps |lse|`` of
    the weights that the max-shifted softmax does not make (docs/conformance.md, "The
    softmax as exp(s - logsumexp)"). Matched by size, not value by value: the roundings
    of ``S`` differ from kernel to kernel, and the failures are often of the RMS bound.
    In float16/bfloat16 the form runs with every step in the dtype (the log-sum-exp
    rounded to it) and must share the kernel's direction too (:func:`rounding_cosine`).
    """
    from ..judging import LSE_VARIANTS, lse_form, verdict_of
    from ..long import is_long

    if prep.variant.name not in LSE_VARIANTS or is_long(prep.case):
        return None  # a long case's N x N logits would not fit
    form, box = lse_form(prep.variant.name), {}
    half = prep.dtype in LOW_PRECISION

    def with_lse(*args, **kw):
        out, box["lse"] = form(*args, return_lse=True, **kw)
        return out

    try:
        with np.errstate(all="ignore"):
            # in float16/bfloat16 every step in the dtype, the log-sum-exp rounded to it
            # (HuggingFace's Reformer attentions and trax on half tensors)
            out = prep.apply_semantics(prep.reference(prep.dtype, fn=with_lse,
                                                      xp=LOGITS_IN_DTYPE if half else None))
            m = measure(out, prep.golden, prep.keep)
    except Exception:  # a form that cannot be built for this case says nothing
        return None
    near = all(0 < e and 1 / 2 <= k / e <= 2 for k, e in ((res.max_err, m.max_err), (res.rms_err, m.rms_err)))
    if m.nonfinite or not near or verdict_of(m, res.tol_max, res.tol_rms)[2] < 0.8:
        return None
    if half:
        # and by direction: the log-sum-exp rounds once to the dtype, the same way in the
        # kernel and the form, and scales its row; a float16 accumulator of P V or of the
        # row sum errs by as much (5 of its 8 failing standard cases) in another direction
        ok = compared(prep, got)
        cos, least = rounding_cosine(np.where(ok, got - prep.golden, 0.0),
                                     np.where(ok, out - prep.golden, 0.0))
        if not cos >= least:
            return None
    lse = np.asarray(box["lse"], dtype=np.float64)
    top = float(np.max(np.abs(lse[np.isfinite(lse)]), initial=0.0))
    where = (f"{prep.dtype}, the log-sum-exp rounded to it" if half else prep.dtype)
    return ("softmax as exp(s - logsumexp): loses |lse| eps relative; a max-shifted softmax passes "
            f"(exp(s - max) / sum; that form in {where} errs {m.max_err:.2g} max, {m.rms_err:.2g} RMS "
            f"here, the kernel {res.max_err:.2g}, {res.rms_err:.2g}; |lse| up to {top:.3g})")


# --------------------------------------------------------------------------- diagnose


def _nonfinite(prep, got):
    gfin = np.isfinite(prep.golden)
    bad = gfin & ~np.isfinite(got)
    if prep.keep is not None:
        bad &= prep.keep
    if not bad.any():
        return None
    rows = bad.any(-1)
    what = "NaN" if np.isnan(got[bad]).all() else "NaN/Inf"
    if prep.dead_rows is not None and prep.dead_rows.any() and not (rows & ~prep.dead_rows).any():
        return (f"{what} exactly on the rows with no key to attend to; the kernel was declared "
                f"fully_masked='{prep.semantics['fully_masked']}' (return that, or declare "
                f"fully_masked='excluded')")
    compared = (gfin if prep.keep is None else gfin & prep.keep).any(-1)
    words = _exp_range(prep, rows, compared) or _decay_ratio_range(prep, rows, compared)
    if words:
        return f"{what}: {words}"
    idx = tuple(int(i) for i in np.argwhere(rows)[0])
    return f"{what} in {int(rows.sum())} rows, first at (batch, head, query) = {idx}"


def _plain_softmax(prep):
    """True when :func:`host_logits` is the case's exact logit matrix (softmax features only)."""
    return prep.variant.exact and prep.case.needs <= {
        "mask", "bias", "causal", "scale", "broadcast", "value_dim", "noncontiguous"}


def _exp_range(prep, rows, compared):
    """Which range fault of ``exp()`` gives exactly the non-finite ``rows``, in words.

    Without the row maximum subtracted, ``exp`` overflows (``inf / inf``) on a row whose
    largest logit exceeds ``ln(max)`` of the arithmetic's dtype, and underflows to 0 on
    every key (``0 / 0``) on a row whose largest logit is below ``ln`` of its smallest
    subnormal; subtracting a maximum larger than the row's own (that of a whole tile of
    queries) underflows the same way. Each fault predicts a set of rows; it is named
    only when the kernel's non-finite rows are exactly that set, up to rows within
    rounding of a threshold (and rows that underflow without the maximum subtracted,
    which a kernel guarding its division by zero returns finite).
    """
    if not _plain_softmax(prep):
        return None
    s = host_logits(prep)
    s = np.broadcast_to(s, rows.shape + s.shape[-1:])
    fin = np.isfinite(s)
    top = np.max(np.where(fin, s, -np.inf), axis=-1)  # -inf on rows with no key
    live = fin.any(-1)
    size = np.max(np.where(fin, np.abs(s), 0.0), axis=-1)
    nq = rows.shape[-1]
    # Q K^T itself overflowing a low-precision dtype: a row with a +inf logit gives
    # inf - inf = NaN; the unscaled products, or the logits with the scale folded in first
    a = prep.arrays
    qk = np.broadcast_to(a["q"] @ np.swapaxes(a["k"], -1, -2), s.shape)
    for dt in (np.dtype(np.float16),):
        fmax, eps = float(np.finfo(dt).max), float(np.finfo(dt).eps)
        for what, x in (("q.k (before the scale)", qk), ("the scaled logits", s)):
            big = np.max(np.where(fin, x, -np.inf), axis=-1)
            must, may = big > fmax * (1 + 16 * eps), np.abs(big - fmax) <= fmax * 16 * eps
            must, may = must & compared, may & compared
            if must.any() and not (must & ~rows).any() and not (rows & ~must & ~may).any():
                return (f"Q K^T overflows {dt}: {what} exceed its largest value {fmax:g} in "
                        f"{int((must & rows).sum())} rows (+inf, then inf - inf) - the logits "
                        f"are computed in {dt}")
    for dt in dict.fromkeys((np.dtype(host_dtype(prep.dtype)), np.dtype(np.float32),
                             np.dtype(np.float64))):
        fi = np.finfo(dt)
        hi, lo = math.log(float(fi.max)), math.log(float(fi.smallest_subnormal)) - math.log(2.0)
        margin = 1.0 + 16 * float(fi.eps) * size  # rounding of the logits in dt

        def consistent(must, may):
            # every row of ``must`` is non-finite, and no row outside ``must | may``
            must, may = must & compared, (may | ~live) & compared
            return rows.any() and not (must & ~rows).any() and not (rows & ~must & ~may).any()

        over, under = top > hi + margin, live & (top < lo - margin)
        near = (np.abs(top - hi) <= margin) | (np.abs(top - lo) <= margin)
        # inf / inf is always NaN; 0 / 0 is NaN only where the division is unguarded
        if consistent(over, under | near):
            parts = []
            if (over & rows).any():
                parts.append(f"exp() overflows on large logits ({int((over & rows).sum())} rows "
                             f"have a logit above ln(max {dt}) = {hi:.4g})")
            if (under & rows).any():
                parts.append(f"0/0 from underflow: every exp() of {int((under & rows).sum())} "
                             f"rows underflows to 0 (all their logits are below ln of the "
                             f"smallest {dt} = {lo:.4g}) and their sum is 0")
            return "; ".join(parts) + " - the row maximum is not subtracted before exp"
        for bq in (nq, 128, 64, 32, 16):
            if bq > nq or (bq < nq and nq <= 16):
                continue
            pad = -nq % bq
            t = np.pad(top, [(0, 0)] * (top.ndim - 1) + [(0, pad)], constant_values=-np.inf)
            t = t.reshape(t.shape[:-1] + (-1, bq)).max(-1, keepdims=True)
            tile = np.broadcast_to(t, t.shape[:-1] + (bq,)).reshape(t.shape[:-2] + (-1,))[..., :nq]
            gap = top - tile  # <= 0
            if consistent(live & (gap < lo - margin), np.abs(gap - lo) <= margin):
                n = int((rows & live).sum())
                where = "all queries of the head" if bq == nq else f"blocks of {bq} queries"
                return (f"0/0 from underflow: the maximum subtracted before exp() is not each "
                        f"row's own but the maximum over {where}, so every exp() of {n} rows "
                        f"whose logits lie more than {-lo:.4g} below it underflows to 0 and "
                        f"their sum is 0 (arithmetic in {dt})")
    return None


#: chunk sizes of :func:`_decay_ratio_range` (and the whole sequence)
RATIO_CHUNKS = (16, 32, 64, 128, 256)


def _decay_ratio_range(prep, rows, compared):
    """Non-finite ``rows`` of a recurrent kernel that forms a decay ``exp(G_i - G_j)`` as
    ``exp(G_i) / exp(G_j)`` (or ``exp(G_i) exp(-G_j)``), ``G`` the running sums of the log
    gates over a chunk (or the whole sequence), in words.

    ``exp(G)`` underflows to 0 once ``G`` is below ``ln`` of the dtype's smallest number,
    and the diagonal's ``0 / 0`` makes that row NaN (the rows after it in the chunk too,
    since ``G`` only falls); ``1 / exp(G_j)`` overflows from about ``-ln(max)``, which
    makes a row non-finite or not depending on ``|k|``. Named only when the kernel's
    non-finite rows are every row of the first kind and none outside the second, for
    some chunk size and arithmetic dtype.
    """
    if prep.variant.family != "recurrent" or "g" not in prep.params:
        return None
    from ..extras import chunk_running_sums

    g = np.asarray(prep.params["g"], dtype=np.float64)
    g = g if g.ndim == rows.ndim + 1 else g[..., None]  # (B, H, T, d_k or 1)
    g = np.broadcast_to(g, rows.shape + g.shape[-1:])
    cu = prep.kwargs.get("cu_seqlens")
    segs = list(zip(cu, cu[1:])) if cu is not None else [(0, rows.shape[-1])]
    for dt in dict.fromkeys((np.dtype(host_dtype(prep.dtype)), np.dtype(np.float32),
                             np.dtype(np.float64))):
        fi = np.finfo(dt)
        lo, hi = math.log(float(fi.smallest_subnormal)) - math.log(2.0), math.log(float(fi.max))
        for c in RATIO_CHUNKS + (rows.shape[-1],):
            run = np.concatenate([chunk_running_sums(g[..., a:b, :], c) for a, b in segs], axis=-2)
            low = np.min(run, axis=-1)
            margin = 1.0 + 16 * float(fi.eps) * np.abs(low)
            must, may = (low < lo - margin) & compared, (low < -hi + 8.0) & compared
            if must.any() and not (must & ~rows).any() and not (rows & ~must & ~may).any():
                where = "the whole sequence" if c >= rows.shape[-1] else f"chunks of {c}"
                return (f"the decay computed as exp(G_i) / exp(G_j), G the running sums of the "
                        f"log gates over {where}, instead of exp(G_i - G_j): exp(G) underflows "
                        f"to 0 in {dt} on {int(must.sum())} rows whose running sum is below "
                        f"{lo:.4g} (ln of its smallest number), and 0 / 0 there")
    return None


def _span(idx) -> str:
    """``[0, 2, 3, 4, 7]`` as ``"0, 2..4, 7"``."""
    out, idx = [], [int(i) for i in idx]
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if j == i else f"{idx[i]}..{idx[j]}")
        i = j + 1
    return ", ".join(out)


def _row_errors(prep, got):
    """Each output row's largest error over the compared values, ``(B, H, Nq)``; a row
    with a NaN or infinity is infinite."""
    err = np.abs(got - prep.golden)
    if prep.keep is not None:
        err = np.where(prep.keep, err, 0.0)
    return np.where(np.isfinite(err), err, np.inf).max(-1)


def _where(prep, got, tol, by_row=False):
    """Where the error lives, when that is a fact worth stating (measured, not guessed).

    ``tol``: the case's bound, or each row's (``(B, H, Nq)``, with ``by_row``: a kernel
    within the case's bounds that fails some rows' own, :attr:`Prepared.tol_rows`)."""
    row = _row_errors(prep, got)  # (B, H, Nq)
    bad = row > tol
    if not bad.any():
        return None
    nq = prep.case.nq
    rows = np.nonzero(bad.any((0, 1)))[0]
    r0 = int(rows.min())
    for bs in (256, 128, 64, 32, 16):
        if r0 > 0 and r0 % bs == 0 and nq % bs and r0 == (nq // bs) * bs:
            return (f"the error lives only in the last partial query block: rows {r0}..{nq - 1} "
                    f"(block size {bs})")
    if by_row:
        words = _few_rows(row, tol, nq)
        if words:
            return words
    # some batch entries or heads are wrong and every other one is within tolerance
    nb, nh = bad.shape[0], bad.shape[1]
    b_bad, h_bad = np.nonzero(bad.any((1, 2)))[0], np.nonzero(bad.any((0, 2)))[0]
    parts = []
    if nb > 1 and len(b_bad) < nb:
        parts.append(f"batch {'entry' if len(b_bad) == 1 else 'entries'} {_span(b_bad)} "
                     f"(of B = {nb})")
    if nh > 1 and len(h_bad) < nh:
        parts.append(f"{'head' if len(h_bad) == 1 else 'heads'} {_span(h_bad)} (of H = {nh})")
    if not parts:
        return None
    sel = np.zeros(bad.shape[:2], bool)
    sel[np.ix_(b_bad, h_bad)] = True
    slice_err = row.max(-1)  # (B, H)
    if slice_err[~sel].max(initial=0.0) > slice_err[sel].max() / 10:
        # the rest is only just within tolerance: noise (low precision) that happens to
        # cross the line on some slices, not a mistake confined to them
        return None
    words = ("the output is wrong only on " + " and ".join(parts)
             + "; the other batch entries and heads are within tolerance, ten times closer")
    if np.all(got[sel] == 0) and np.any(prep.golden[sel] != 0):
        words += "; the output there is all zeros (never written)"
    return words + _kmeans_tie(prep, bad.any(2))


#: a failure confined to a few query rows is named so when they are at most this share of
#: the rows and every other row errs at most ``FEW_ROWS_SLACK`` of its own bound
FEW_ROWS_SHARE, FEW_ROWS_SLACK = 0.25, 0.5


def _rows_beyond_the_case(prep, got):
    """A failure beyond the case's bound on a few query rows, every other row well within
    its own bound (:func:`_few_rows` on :attr:`Prepared.tol_rows`); else None. Tried after
    the named roundings: SDPA's last query row 5 % off on the float16 N = 1000 causal
    case exceeds the case's bound 8.7 times and read "no known mistake explains it",
    where HuggingFace's float32 softmax in float64, wrong on two rows of a large-logit
    case, is named by its rounding."""
    if prep.tol_rows is None:
        return None
    return _few_rows(_row_errors(prep, got), prep.tol_rows, prep.case.nq)


def _few_rows(row, tol, nq):
    """"Wrong only on query rows ..." for a kernel whose rows' largest errors ``row`` exceed
    some rows' own bounds (``tol``, ``(B, H, Nq)``) while the others are well within
    theirs; else None."""
    bad = row > tol
    rows = np.nonzero(bad.any((0, 1)))[0]
    if not len(rows) or len(rows) > FEW_ROWS_SHARE * nq:
        # no row beyond its own bound (the case's RMS bound failed alone), or many
        return None
    ratio = ratios(row, tol)
    if ratio[~bad].max(initial=0.0) > FEW_ROWS_SLACK:
        return None
    words = (f"the output is wrong only on query {'row' if len(rows) == 1 else 'rows'} "
             f"{_span(rows)} (of Nq = {nq})")
    b_bad, h_bad = np.nonzero(bad.any((1, 2)))[0], np.nonzero(bad.any((0, 2)))[0]
    if bad.shape[0] > 1 and len(b_bad) < bad.shape[0]:
        words += f", batch {'entry' if len(b_bad) == 1 else 'entries'} {_span(b_bad)} (of B = {bad.shape[0]})"
    if bad.shape[1] > 1 and len(h_bad) < bad.shape[1]:
        words += f", {'head' if len(h_bad) == 1 else 'heads'} {_span(h_bad)} (of H = {bad.shape[1]})"
    return (words + f"; every other row errs at most {ratio[~bad].max(initial=0.0):.2g} of its own "
            f"bound")


def _known_rounding(prep, got):
    """A recurrent kernel that fails as one of the roundings the bound does not take
    fails (:func:`conformance.diagnose.base.nearest_output_rounding`: decays from running sums over a
    window longer than fla's chunks, ``q`` and ``k`` normalised in a half dtype): that
    rounding fails this case too, and the kernel is within the case's bounds of it
    (largest, RMS and each row's). The signatures name a mistake past the case's largest
    error only, or one leaving 1/50 of the kernel's error; a rounding rounds otherwise by
    that much. fla's ``naive_parallel_simple_gla`` failed
    ``chunks:b2h2-q100k100-d32-causal-tl`` at 1.02 of a row's bound (float32, seed 1),
    and a GLA kernel in windows of 256 steps ``long:b1h1-q1000k1000-d64-causal-tl`` at 2.8
    of a row's bound and past the RMS bound (float32, seed 1): both read "no known
    mistake explains it"."""
    if prep.variant.family != "recurrent":
        return None
    near = nearest_output_rounding(prep, got)
    if near is None:
        return None
    message, cand = near
    own = measure(cand, prep.golden, prep.keep, prep.tol_rows)
    if own.max_err <= prep.tol_max and own.rms_err <= prep.tol_rms and not own.row_ratio > 1.0:
        return None  # the rounding passes this case: it explains nothing
    off = measure(got, cand, prep.keep, prep.tol_rows)
    if off.nonfinite or off.max_err > prep.tol_max or off.rms_err > prep.tol_rms or off.row_ratio > 1.0:
        return None
    return message


def _kmeans_heads(prep, got, tol, words):
    """For a failure of a clustered variant not confined to some heads (one head, or all
    of them), described by ``words``: a clause saying every failing head has a k-means
    near tie (:func:`_kmeans_tie`), where that is so and ``words`` do not say it; else
    ``""``. Before it such a failure read only "grows with N faster than a plain
    implementation's", which sends a kernel author after an accumulator alone."""
    if "k-means" in words:
        return ""
    bad = _row_errors(prep, got) > tol  # (B, H, Nq)
    if not bad.any():
        return ""
    clause = _kmeans_tie(prep, bad.any(2))
    return "; every failing head" + clause.removeprefix("; each of these") if clause else ""


def _kmeans_tie(prep, bad_heads):
    """A clause for failures on some heads of a clustered variant whose every failing
    head has a k-means assignment within the dtype's rounding
    (:func:`conformance.ties.kmeans_margins`): there a correct kernel may cluster
    otherwise, and the oracle judges one flip per clustering, not two; else ``""``."""
    ratio = kmeans_margins(prep)
    if ratio is None:
        return ""
    ratio = np.broadcast_to(ratio, bad_heads.shape)[bad_heads]
    if not np.all(ratio <= 1.0):
        return ""
    return (f"; each of these has a k-means assignment within {prep.dtype}'s rounding of "
            f"its distances (the closest at {float(np.min(ratio)):.2g} of the bound): a kernel "
            f"that rounds one the other way clusters otherwise and computes another "
            f"function; the oracle judges each such assignment made the other way alone, "
            f"not two of them in one clustering (docs/conformance.md, Near ties)")


def _lp_accumulator(block):
    """Online softmax over ``block`` keys at a time: run on a low-precision array, its
    running ``P V`` and row sum are rounded to the dtype after every block."""

    def fn(q, k, v, /, **kw):
        from attn_ref.softmax import online_softmax_attention

        return online_softmax_attention(q, k, v, block_q=1 << 30, block_k=block, **kw)

    return fn


#: a float16/bfloat16 output rounded toward zero: at least this share of the elements that
#: differ from the golden rounded to nearest are smaller in magnitude than the golden
#: (about half for a kernel that rounds to nearest), over at least TOWARD_ZERO_MIN of them
TOWARD_ZERO_SHARE, TOWARD_ZERO_MIN = 0.9, 64


def _rounded_toward_zero(prep, got):
    """A float16/bfloat16 kernel whose output is stored by truncation (the low bits of its
    float32 result dropped, as ``uint16_t(bits >> 16)`` does for bfloat16) instead of
    rounded to nearest: nearly every element that is not the golden's nearest value is
    smaller in magnitude than the golden. Its error is at most one ulp, but biased: 0.58
    ulp RMS against rounding's 0.29, which the RMS bound catches on rows of near-equal
    outputs and which "accumulates in low precision" used to be named for."""
    ok = compared(prep, got) & (prep.golden != 0)
    g, w = got[ok], prep.golden[ok]
    moved = g != round_to(w, prep.dtype)
    if np.count_nonzero(moved) < TOWARD_ZERO_MIN:
        return None
    # a rounding of an accurate result: within one ulp of the golden everywhere (an
    # output shrunk by a factor of several ulps is a mistake of its own)
    one_ulp = 2.0 ** (np.floor(np.log2(np.abs(w))) - MANTISSA_BITS[prep.dtype])
    if np.any(np.abs(g - w) > 1.01 * one_ulp):
        return None
    inward = np.abs(g[moved]) < np.abs(w[moved])
    share = float(np.mean(inward))
    if share < TOWARD_ZERO_SHARE:
        return None
    return (f"the output is rounded toward zero (truncated) to {prep.dtype}, not to nearest: "
            f"{share:.0%} of the {int(np.count_nonzero(moved))} elements that are not the "
            f"golden's nearest {prep.dtype} value are smaller in magnitude than the golden "
            f"(a float32 result stored by dropping its low bits)")


def _low_precision_accumulation(prep, res, rerun, got):
    """A float16/bfloat16 kernel well past a plain fp32-accumulating implementation."""
    dt = prep.dtype
    # a kernel that rounds like a plain fp32-accumulating one makes about its error
    if not res.precision > 1.5:
        return None
    words = None
    head = (f"the kernel accumulates in low precision: its error is {res.precision:.3g}x that "
            f"of a plain {dt} implementation accumulating in float32")
    if prep.variant.name in RECURRENT:
        words = _low_precision_state(prep, res, head, got)
    if prep.variant.exact:
        # (smaller blocks cost seconds per key block on N = 4096 rows in emulated float16)
        best = _nearest_within_3x(prep, res.max_err, (
            (block, lambda block=block: prep.reference(dt, fn=_lp_accumulator(block), options={}))
            for block in (16, 64, 256)), stop_at_error=True)
        if best is not None:
            words = (f"{head}, the size ({best[1]:.2g}) of one whose P V and row sum are "
                     f"accumulated in {dt} {best[0]} key(s) at a time")
    grown = _at_quarter_length(prep, rerun, "precision")
    if grown is not None and res.precision / grown[0] > 1.25:
        more = (f"its error grows with N faster than a plain implementation's "
                f"({grown[0]:.3g}x at Nk={grown[1]}, {res.precision:.3g}x at Nk={prep.case.nk})")
        # growth alone names no cause: a decay lost every 1024 steps grows too (98.8x a
        # plain bfloat16 GLA at T = 4096, 'accumulates in low precision' before)
        words = f"{words}; {more}" if words else (
            f"its error is {res.precision:.3g}x that of a plain {dt} implementation "
            f"accumulating in float32, and {more.replace('its error grows', 'it grows', 1)}; "
            f"no low-precision accumulator tried "
            f"reproduces it")
    return words


def _low_precision_state(prep, res, head, got):
    """A recurrent kernel whose error is the size of one that stores its state in a half
    dtype and rounds it at every step (within a factor of 3), where the baseline's
    implementations keep it in float32 or store it once per chunk of ``FLA_CHUNK``.

    Such a state errs on every row past the first steps: where the sequence has a last
    partial chunk of ``FLA_CHUNK``, the kernel's error before it must be as large a part
    of its error (within 3x) as the candidate's is of the candidate's. A mistake at the
    chunk boundary is not: a decay applied twice there, T = 65, erred 0.31 on row 64 and
    0.031 before it (a bfloat16 state 0.11 and 0.11), and read "keeps its recurrent state
    in bfloat16"."""
    dt = prep.dtype
    outs = {}
    everything = f"{dt}, every operation in it too"

    def run(store):
        # the variant's own chunk form on the emulated arrays rounds every operation and
        # the state to the dtype (a module run in bfloat16: MiniMax's lightning attention)
        fn = None if store == everything else fp32_state_form(prep.variant.name, 1, store)
        outs[store] = prep.reference(dt, fn=fn)
        return outs[store]

    best = _nearest_within_3x(prep, res.max_err, (
        (store, lambda store=store: run(store))
        for store in dict.fromkeys((dt, "bfloat16", everything))), stop_at_error=False)
    if best is None:
        return None
    r0 = prep.case.nq // FLA_CHUNK * FLA_CHUNK
    if 0 < r0 < prep.case.nq and best[0] in outs:
        def before_share(out):
            err = np.abs(np.asarray(prep.apply_semantics(out), np.float64) - prep.golden)
            if prep.keep is not None:
                err = np.where(prep.keep, err, 0.0)
            err = np.where(np.isfinite(err), err, np.inf)
            whole = float(err.max())
            return float(err[..., :r0, :].max()) / whole if whole > 0 else 1.0
        if before_share(got) < before_share(outs[best[0]]) / 3:
            return None
    return (f"{head}, the size ({best[1]:.2g}) of one that keeps its recurrent state in "
            f"{best[0]}, rounded at every step (accumulate the state in float32; fla's chunk "
            f"kernels store it in the dtype only between chunks of {FLA_CHUNK})")


def _nearest_within_3x(prep, err, tries, *, stop_at_error):
    """``(label, its max error)`` of the candidate implementation whose maximum error is
    nearest the kernel's ``err`` (log scale), if within a factor of 3; else None.

    ``tries``: ``(label, run)`` pairs, ``run()`` the candidate's output on ``prep``. A
    candidate that raises is skipped, or ends the search with ``stop_at_error``.
    """
    best = None
    for label, run in tries:
        try:
            with np.errstate(all="ignore"):
                cand = prep.apply_semantics(run())
        except Exception:
            if stop_at_error:
                break
            continue
        be = measure(cand, prep.golden, prep.keep).max_err
        off = abs(math.log(err / be)) if be > 0 and err > 0 else math.inf
        if off <= math.log(3.0) and (best is None or off < best[0]):
            best = (off, label, be)
    return None if best is None else best[1:]


def _at_quarter_length(prep, rerun, metric):
    """``(value, Nk)`` of a result's ``metric`` (``"max_err"``, ``"precision"``) when the
    kernel is re-run on the same case at a quarter of its lengths; None where it cannot
    be (no re-run, Nk < 256, no positive finite value)."""
    c = prep.case
    if rerun is None or c.nk < 256:
        return None
    small = replace(c, nq=max(1, c.nq // 4), nk=max(1, c.nk // 4), tag=c.tag + "-quarter")
    r = rerun(small)
    value = getattr(r, metric)
    if r.verdict in ("pass", "fail") and value == value and value > 0:
        return value, small.nk
    return None


def _precision(prep, res, rerun, got):
    """A float32/float64 kernel whose error is the size a plain implementation in a lower
    dtype makes (0.2x to 5x; of several, the nearest on a log scale, or the one whose
    error it shares the direction of). Only a shared direction
    (:func:`conformance.tolerance.rounding_cosine`) names that dtype's rounding outright:
    a mistake of a small factor (beta or a projection 1 % off in float32) makes an error
    of bfloat16's size too, and a real implementation in the dtype rounds in another
    order than the reference, so the size alone names both, and says it cannot tell.
    A float16/bfloat16 kernel: :func:`_low_precision_accumulation`."""
    if prep.dtype in LOW_PRECISION:
        return _rounded_toward_zero(prep, got) or _low_precision_accumulation(prep, res, rerun, got)
    lower = {"float64": ("float32", "bfloat16", "float16"),
             "float32": ("float16", "bfloat16")}[prep.dtype]
    keep = np.ones(prep.golden.shape, bool) if prep.keep is None else prep.keep
    err = np.where(keep, got - prep.golden, 0.0)
    sized = []

    def size_up(base, name):
        # a candidate within 0.2x to 5x of the kernel's error, and whether the two errors
        # point apart (no shared direction)
        be = measure(base, prep.golden, prep.keep).max_err
        if be > 0 and 0.2 <= res.max_err / be <= 5.0:
            cos, least = rounding_cosine(err, np.where(keep, base - prep.golden, 0.0))
            sized.append((cos < least, abs(math.log(res.max_err / be)), name, be, cos, least))

    for dt in lower:
        try:
            base = prep.apply_semantics(prep.reference(dt))
        except Exception:
            continue
        size_up(base, dt)
    emulated = (eager_softmax(prep, "float64") if prep.dtype == "float64" and prep.variant.exact
                else None)
    if emulated is not None and not any(not apart for apart, *_ in sized):
        # a float32 softmax between float64 logits and a float64 P V: smaller than a
        # plain float32 implementation's error, often below a fifth of it; never named
        # over a lower dtype whose error the kernel's shares the direction of
        size_up(prep.apply_semantics(emulated[0]), "float32 softmax")
    words, caveat = None, ""
    if sized:
        _, _, dt, be, cos, least = min(sized)
        caveat = rounding_caveat(cos, least)
        if dt == "float32 softmax":
            words = (f"the error ({res.max_err:.2g}) is the size a softmax computed in float32 "
                     f"between float64 logits and a float64 P V makes ({be:.2g}): the weights in "
                     f"float32 (HuggingFace's eager attention: softmax(..., dtype=torch.float32))"
                     + caveat)
        else:
            words = (f"the error ({res.max_err:.2g}) is the size a plain {dt} implementation makes "
                     f"({be:.2g}): computing or accumulating in {dt} (low precision)" + caveat)
    grown = _at_quarter_length(prep, rerun, "max_err")
    if grown is not None and res.max_err / grown[0] > 1.5:
        more = f"the error grows with N ({grown[0]:.2g} at Nk={grown[1]}, {res.max_err:.2g} at " \
               f"Nk={prep.case.nk})"
        words = (f"{words}; {more}" + ("" if caveat else ", as low-precision accumulation does")
                 if words else more)
    return words


def diagnose(prep, got, res, rerun=None) -> str | None:
    """Words explaining why ``got`` (host, canonical layout) failed ``prep``'s case."""
    got = np.asarray(got, dtype=np.float64)
    words = _nonfinite(prep, got)
    if words:
        return words
    best, hits = None, []
    # fits last: they cost many reference runs, and are skipped once a mistake without a
    # parameter reproduces the output; each fit runs otherwise, since factors on several
    # parameters can give the same output (beta, the scale and the output at T = 1)
    for sig in sorted(SIGNATURES, key=lambda sig: sig.fit):
        if sig.exact_only and not prep.variant.exact:
            continue
        if sig.fit and any(r <= res.tol_max and not fit for r, _, fit in hits):
            continue
        try:
            found = sig.candidates(prep, got) if sig.needs_output else sig.candidates(prep)
            for message, cand in found:
                r = reproduces(prep, got, cand, res.max_err, sig.functional)
                if r is not None:
                    hits.append((r, message, sig.fit))
                    if best is None or r < best[0]:
                        best = (r, message)
        except Exception:  # a signature that cannot be built for this case says nothing
            continue
    if best is not None:
        # mistakes that all reproduce the output within tolerance cannot be told apart on
        # this case (causal ignored and the other alignment with one query): name each
        same = list(dict.fromkeys(m for r, m, _ in sorted(hits) if r <= res.tol_max and m != best[1]))
        if best[0] > res.tol_max or not same:
            return best[1]
        return (" - or ".join([best[1]] + same[:2])
                + " (these mistakes give the same output on this case)")
    # within the case's bounds, failing some rows' own (Tolerance.row_bounds): where is
    # told by those
    by_row = prep.tol_rows is not None and res.max_err <= res.tol_max and res.rms_err <= res.tol_rms
    order = (lambda: _lse_softmax(prep, res, got),
             lambda: _where(prep, got, prep.tol_rows if by_row else res.tol_max, by_row),
             lambda: _precision(prep, res, rerun, got))
    if prep.variant.name in RECURRENT and prep.dtype in LOW_PRECISION:
        # a state kept in the dtype errs most on the heads of longest memory: "wrong only
        # on heads 1..7" would be a true measurement that names no mistake
        order = order[::-1]
    # a rounding the kernel is within the bounds of, named before measurements that it
    # explains ("grows with N", "accumulates in low precision")
    order = (lambda: _known_rounding(prep, got),) + order
    if not by_row:
        order += (lambda: _rows_beyond_the_case(prep, got),)
    for fn in order:
        words = fn()
        if words:
            return words + _kmeans_heads(prep, got, res.tol_max, words)
    words = (f"no known mistake explains it: error {res.ratio:.3g}x the tolerance, worst at "
             f"(batch, head, query) = {tuple(res.worst)}")
    return words + _kmeans_heads(prep, got, res.tol_max, words)
