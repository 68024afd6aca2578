"""Say why a kernel failed: test known mistake signatures against its output.

When a case fails, :func:`diagnose` tries, in order:

1. **Non-finite values**: NaN/Inf exactly on rows with no key to attend to (a
   fully-masked-row convention mismatch), on large-logit cases (``exp`` without
   subtracting the row maximum), or elsewhere.
2. **Mistake signatures** (:data:`SIGNATURES`): each builds, from the case's rounded
   inputs, the output a specific mistake would produce (scale ``1/d``, causal diagonal
   shifted by one, the other layout, keys and values swapped, a dropped tail key
   block, an online softmax that never rescales its accumulator, a denominator
   epsilon...). The signature whose output the kernel matches - within the case
   tolerance, or 50x closer than the golden - explains the failure.
3. **Where the error lives**: only in the last partial query block, or only in one
   batch entry / head.
4. **Precision**: for a float32/float64 kernel, an error the size of a plain
   float16/bfloat16 implementation's; for a float16/bfloat16 kernel, an error well past
   a plain fp32-accumulating implementation's in its dtype (the ``precision`` column)
   that matches one accumulating ``P V`` and the row sum in the dtype a few keys at a
   time, or grows with ``N`` faster than the plain one's (the kernel is re-run on the
   same case at ``N/4``): "accumulates in low precision".

Extension point: append a :class:`Signature` to :data:`SIGNATURES` (or call
:func:`register_signature`). Its ``candidates(prep)`` yields ``(message, output)``
pairs, ``output`` in the canonical ``(B, H, Nq, dv)`` layout as float64; the gradient
checks and the GQA/window/varlen features add theirs the same way (a window off by
one, a wrong query-head -> kv-head mapping, a varlen boundary leak).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from .features import allowed_matrix, default_scale, sequence_lengths
from .tolerance import LOW_PRECISION, measure

__all__ = ["Signature", "SIGNATURES", "register_signature", "diagnose", "softmax_host"]


@dataclass(frozen=True)
class Signature:
    """A known mistake: ``candidates(prep)`` yields ``(message, output)`` pairs."""

    name: str
    candidates: Callable[..., Iterator]
    exact_only: bool = False  # needs the variant to be exact softmax


SIGNATURES: list[Signature] = []


def register_signature(sig: Signature) -> Signature:
    SIGNATURES.append(sig)
    return sig


# ------------------------------------------------------------------ host softmax pieces


def _scale(prep):
    s = prep.kwargs.get("scale")
    return default_scale(prep.case.d) if s is None else s


_CASE = object()  # "as the case has it"


def _logits(prep, *, scale=None, allowed=_CASE, bias=_CASE):
    a = prep.arrays
    s = (a["q"] @ np.swapaxes(a["k"], -1, -2)) * (_scale(prep) if scale is None else scale)
    b = a.get("bias") if bias is _CASE else bias
    if b is not None:
        s = s + b
    al = allowed_matrix(prep.case, a, prep.kwargs) if allowed is _CASE else allowed
    if al is not None:
        s = np.where(al, s, -np.inf)
    return s


def softmax_host(s, v, *, axis=-1, eps=0.0):
    """``softmax(s, axis) @ v`` in float64; rows with no finite logit give zeros."""
    m = np.max(s, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = np.sum(e, axis=axis, keepdims=True)
    p = e / np.where(den + eps > 0, den + eps, 1.0)
    return p @ v


def _finish(prep, out):
    return prep.apply_semantics(np.broadcast_to(out, prep.golden.shape).astype(np.float64))


def _ref(prep, **changes):
    """The variant's reference in float64 with some arrays/kwargs changed (None removes)."""
    arrays, kwargs = dict(prep.arrays), dict(prep.kwargs)
    for k, v in changes.items():
        target = arrays if k in ("q", "k", "v", "mask", "bias") else kwargs
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    return prep.reference("float64", arrays=arrays, kwargs=kwargs)


# ------------------------------------------------------------------------- signatures


def _scale_sigs(prep):
    d = prep.case.d
    if prep.case.scale is None:
        yield "the logits are scaled by 1/d instead of 1/sqrt(d)", _ref(prep, scale=1.0 / d)
        yield "the logits are not scaled (scale 1 instead of 1/sqrt(d))", _ref(prep, scale=1.0)
    else:
        s = prep.case.scale
        yield ("the scale argument is ignored (the default 1/sqrt(d) is used)",
               _ref(prep, scale=None))
        yield "the scale is applied twice", _ref(prep, scale=s * s)
        yield "the scale is multiplied by 1/sqrt(d) again", _ref(prep, scale=s / math.sqrt(d))


def _causal_matrix(nq, nk, off):
    return (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off)[None, None]


def _causal_sigs(prep):
    c = prep.case
    align = prep.kwargs.get("causal")
    if align:
        yield "the causal mask is ignored", _ref(prep, causal=None)
        if c.nq != c.nk:
            other = "bottom-right" if align == "top-left" else "top-left"
            yield (f"the causal mask is aligned {other} instead of {align} "
                   f"(declare semantics causal='{other}' if that is the kernel's convention)",
                   _ref(prep, causal=other))
        base = 0 if align == "top-left" else c.nk - c.nq
        for shift, words in ((1, "one key too many (j <= i + 1)"), (-1, "the diagonal (j < i)")):
            al = _causal_matrix(c.nq, c.nk, base + shift)
            if "mask" in prep.arrays:
                al = np.logical_and(al, prep.arrays["mask"])
            yield (f"the causal mask is off by one: it lets each query see {words}"
                   if shift > 0 else f"the causal mask is off by one: it hides {words}",
                   softmax_host(_logits(prep, allowed=al), prep.arrays["v"]))
    else:
        for a in ("top-left", "bottom-right"):
            yield f"a causal ({a}) mask is applied although the case is not causal", \
                _ref(prep, causal=a)


def _mask_sigs(prep):
    if "mask" not in prep.arrays:
        return
    m = prep.arrays["mask"]
    yield "the mask is inverted (True read as 'masked out')", _ref(prep, mask=~m)
    yield "the mask is ignored", _ref(prep, mask=None)


def _bias_sigs(prep):
    if "bias" not in prep.arrays:
        return
    b = prep.arrays["bias"]
    yield "the bias is ignored", _ref(prep, bias=None)
    yield "the bias is subtracted instead of added", _ref(prep, bias=-b)
    yield "the bias is multiplied by the scale (added before scaling)", _ref(prep, bias=b * _scale(prep))


def _swap_sigs(prep):
    a = prep.arrays
    if a["k"].shape == a["v"].shape:
        yield "keys and values are swapped", _ref(prep, k=a["v"], v=a["k"])


def _layout_sigs(prep):
    c, a = prep.case, prep.arrays
    if c.nq != c.nk or c.kv_batch is not None or c.batch[1] == 1:
        return
    if any(n in a and a[n].shape[1] != 1 for n in ("mask", "bias")):
        return
    sw = {n: np.swapaxes(a[n], 1, 2) for n in ("q", "k", "v")}
    try:
        out = prep.variant.fn(sw["q"], sw["k"], sw["v"], **prep.kwargs, **prep.params, **prep.options)
    except Exception:
        return
    yield ("the layout is mixed up: (batch, heads, seq, dim) read as (batch, seq, heads, dim) "
           "or the reverse", np.swapaxes(np.asarray(out, dtype=np.float64), 1, 2))


def _tail_sigs(prep):
    c, a = prep.case, prep.arrays
    seen = set()
    for bs in (16, 32, 64, 128, 256):
        j0 = (c.nk // bs) * bs
        if c.nk % bs == 0 or j0 == 0 or j0 in seen:
            continue
        seen.add(j0)
        cut = dict(a)
        cut["k"], cut["v"] = a["k"][..., :j0, :], a["v"][..., :j0, :]
        for n in ("mask", "bias"):
            if n in a and a[n].shape[-1] != 1:
                cut[n] = a[n][..., :j0]
        if prep.kwargs.get("causal") == "bottom-right":
            continue  # truncating keys would move a bottom-right diagonal
        out = prep.reference("float64", arrays=cut)
        yield (f"the last partial key block is dropped: keys {j0}..{c.nk - 1} are ignored "
               f"(block size {bs}, Nk = {c.nk})", out)


def _semantics_sigs(prep):
    if prep.dead_rows is None or not prep.dead_rows.any():
        return
    conv = prep.semantics["fully_masked"]
    raw = prep.reference("float64")
    for other, words in (("zeros", "zeros (PyTorch SDPA, FlashAttention)"),
                         ("mean", "the mean of V (jax.nn.dot_product_attention)")):
        if other == conv:
            continue
        alt = replace(prep, semantics={**prep.semantics, "fully_masked": other})
        yield (f"rows with no key to attend to hold {words}, not {conv}: declare "
               f"fully_masked='{other}' if that is the kernel's convention",
               alt.apply_semantics(np.asarray(raw, dtype=np.float64)))


def _axis_sigs(prep):
    s = _logits(prep)
    yield ("the softmax is taken over the query axis instead of the key axis",
           softmax_host(np.where(np.isfinite(s), s, -np.inf), prep.arrays["v"], axis=-2))


def _eps_sigs(prep):
    s = _logits(prep)
    for eps in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        yield (f"an epsilon of {eps:g} is added to the softmax denominator",
               softmax_host(s, prep.arrays["v"], eps=eps))


def online_no_rescale(s, v, block):
    """Online softmax whose accumulator is never rescaled when the running max grows."""
    m = np.full(s.shape[:-1] + (1,), -np.inf)
    l = np.zeros(s.shape[:-1] + (1,))
    acc = np.zeros(s.shape[:-1] + (v.shape[-1],))
    for j in range(0, s.shape[-1], block):
        sj = s[..., j:j + block]
        m_new = np.maximum(m, sj.max(-1, keepdims=True))
        ms = np.where(np.isfinite(m_new), m_new, 0.0)
        p = np.exp(sj - ms)
        l = l * np.exp(np.where(np.isfinite(m), m, -np.inf) - ms) + p.sum(-1, keepdims=True)
        acc = acc + p @ v[..., j:j + block, :]
        m = m_new
    return acc / np.where(l > 0, l, 1.0)


def _online_sigs(prep):
    s = _logits(prep)
    for bs in (16, 32, 64, 128):
        if prep.case.nk > bs:
            yield (f"online softmax: the output accumulator is not rescaled when the running "
                   f"maximum grows (key block {bs})", online_no_rescale(s, prep.arrays["v"], bs))


for _sig in (
    Signature("semantics", _semantics_sigs),
    Signature("scale", _scale_sigs),
    Signature("causal", _causal_sigs),
    Signature("mask", _mask_sigs),
    Signature("bias", _bias_sigs),
    Signature("swap", _swap_sigs),
    Signature("layout", _layout_sigs),
    Signature("tail", _tail_sigs),
    Signature("axis", _axis_sigs, exact_only=True),
    Signature("epsilon", _eps_sigs, exact_only=True),
    Signature("online", _online_sigs, exact_only=True),
):
    register_signature(_sig)


# ---------------------------------------------- features of modern kernels (GQA, window, ...)


def _window_sigs(prep):
    w = prep.kwargs.get("window")
    if w is None:
        return
    left, right = w
    for side, dl, dr in (("left", 1, 0), ("left", -1, 0), ("right", 0, 1), ("right", 0, -1)):
        bound = left if side == "left" else right
        if bound < 0:
            continue  # an unbounded side cannot be off by one
        new = (left + dl, right + dr)
        words = f"the sliding window's {side} extent is off by one (window {new} instead of {tuple(w)})"
        if bound + dl + dr >= 0:
            yield words, _ref(prep, window=new)
            continue
        # extent 0 - 1: the window also hides the query's own position i + Lk - Lq
        lq, lk = sequence_lengths(prep.case, prep.kwargs)
        i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
        al = (j <= i + lk - lq - 1) if side == "right" else (j >= i + lk - lq + 1)
        if "mask" in prep.arrays:
            al = np.logical_and(al, prep.arrays["mask"])
        yield words, _ref(prep, mask=al)


def _gqa_sigs(prep):
    if not prep.kwargs.get("gqa"):
        return
    a = prep.arrays
    hq, hkv = a["q"].shape[1], a["k"].shape[1]
    g = hq // hkv
    if g > 1 and hkv > 1:
        yield (f"query head h reads key/value head h % Hkv instead of h // (Hq / Hkv) "
               f"(Hq={hq}, Hkv={hkv})",
               _ref(prep, k=np.tile(a["k"], (1, g, 1, 1)), v=np.tile(a["v"], (1, g, 1, 1)), gqa=None))


def _softcap_sigs(prep):
    c = prep.kwargs.get("softcap")
    if c is None:
        return
    s = _scale(prep)
    # c' tanh(s' q.k / c') with the reference's (softcap, scale) = (c', s')
    yield "the soft-cap is ignored", _ref(prep, softcap=None)
    yield "the scale is applied again after the soft-cap", _ref(prep, softcap=c * s, scale=s * s)
    yield "the soft-cap is applied before the scale", _ref(prep, softcap=c * s)


def _varlen_sigs(prep):
    lq, lk = prep.kwargs.get("seqlens_q"), prep.kwargs.get("seqlens_k")
    if lq is None or lk is None:
        return
    from attn_ref.softmax import varlen_attention

    a = prep.arrays

    def pack(x, lens):
        return np.concatenate([np.swapaxes(x[b, :, :n], 0, 1) for b, n in enumerate(lens)])

    kw = {n: prep.kwargs[n] for n in ("window", "softcap") if n in prep.kwargs}
    if "alibi_slopes" in a:
        kw["alibi_slopes"] = a["alibi_slopes"]
    o = varlen_attention(pack(a["q"], lq), pack(a["k"], lk), pack(a["v"], lk),
                         cu_seqlens_q=[0, sum(lq)], cu_seqlens_k=[0, sum(lk)],
                         causal=prep.kwargs.get("causal") or False, scale=_scale(prep), **kw)
    out = np.zeros(prep.golden.shape)
    start = 0
    for b, n in enumerate(lq):
        out[b, :, :n] = np.swapaxes(o[start:start + n], 0, 1)
        start += n
    yield "tokens attend across sequence boundaries (the packed batch is one sequence)", out


for _sig in (
    Signature("window", _window_sigs),
    Signature("gqa", _gqa_sigs),
    Signature("softcap", _softcap_sigs),
    Signature("varlen", _varlen_sigs),
):
    register_signature(_sig)


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
    if prep.case.dist == "large_logits":
        return (f"{what} on large logits: exp() overflows - the row maximum is not subtracted "
                f"before exp")
    idx = tuple(int(i) for i in np.argwhere(rows)[0])
    return f"{what} in {int(rows.sum())} rows, first at (batch, head, query) = {idx}"


def _where(prep, got, tol):
    err = np.abs(got - prep.golden)
    if prep.keep is not None:
        err = np.where(prep.keep, err, 0.0)
    row = err.max(-1)  # (B, H, Nq)
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
    b_bad, h_bad = bad.any((1, 2)), bad.any((0, 2))
    if bad.shape[0] > 1 and b_bad.sum() == 1:
        return f"the error lives only in batch entry {int(np.argmax(b_bad))}"
    if bad.shape[1] > 1 and h_bad.sum() == 1:
        return f"the error lives only in head {int(np.argmax(h_bad))}"
    return None


def _lp_accumulator(block):
    """Online softmax over ``block`` keys at a time: run on a low-precision array, its
    running ``P V`` and row sum are rounded to the dtype after every block."""

    def fn(q, k, v, /, **kw):
        from attn_ref.softmax import online_softmax_attention

        return online_softmax_attention(q, k, v, block_q=1 << 30, block_k=block, **kw)

    return fn


def _low_precision_accumulation(prep, res, rerun):
    """A float16/bfloat16 kernel well past a plain fp32-accumulating implementation."""
    dt = prep.dtype
    # a kernel that rounds like a plain fp32-accumulating one makes about its error
    if not res.precision > 1.5:
        return None
    words = None
    head = (f"the kernel accumulates in low precision: its error is {res.precision:.3g}x that "
            f"of a plain {dt} implementation accumulating in float32")
    if prep.variant.exact:
        best = None
        # (smaller blocks cost seconds per key block on N = 4096 rows in emulated float16)
        for block in (16, 64, 256):
            try:
                with np.errstate(all="ignore"):
                    cand = prep.apply_semantics(prep.reference(dt, fn=_lp_accumulator(block),
                                                               options={}))
            except Exception:
                break
            be = measure(cand, prep.golden, prep.keep).max_err
            off = abs(math.log(res.max_err / be)) if be > 0 and res.max_err > 0 else math.inf
            if off <= math.log(3.0) and (best is None or off < best[0]):
                best = (off, block, be)
        if best is not None:
            words = (f"{head}, the size ({best[2]:.2g}) of one whose P V and row sum are "
                     f"accumulated in {dt} {best[1]} key(s) at a time")
    c = prep.case
    if rerun is not None and c.nk >= 256:
        small = replace(c, nq=max(1, c.nq // 4), nk=max(1, c.nk // 4), tag=c.tag + "-quarter")
        r = rerun(small)
        if r.verdict in ("pass", "fail") and r.precision == r.precision and r.precision > 0:
            grow = res.precision / r.precision
            if grow > 1.25:
                more = (f"its error grows with N faster than a plain implementation's "
                        f"({r.precision:.3g}x at Nk={small.nk}, {res.precision:.3g}x at Nk={c.nk})")
                words = f"{words}; {more}" if words else f"{head}; {more}"
    return words


def _precision(prep, res, rerun):
    if prep.dtype in LOW_PRECISION:
        return _low_precision_accumulation(prep, res, rerun)
    lower = {"float64": ("float32", "bfloat16", "float16"), "float32": ("float16", "bfloat16"),
             "float16": ("bfloat16",), "bfloat16": ()}[prep.dtype]
    words = None
    for dt in lower:
        try:
            base = prep.apply_semantics(prep.reference(dt))
        except Exception:
            continue
        be = measure(base, prep.golden, prep.keep).max_err
        if be > 0 and 0.2 <= res.max_err / be <= 5.0:
            words = (f"the error ({res.max_err:.2g}) is the size a plain {dt} implementation "
                     f"makes ({be:.2g}): computing or accumulating in {dt} (low precision)")
            break
    c = prep.case
    if rerun is not None and c.nk >= 256:
        small = replace(c, nq=max(1, c.nq // 4), nk=max(1, c.nk // 4), tag=c.tag + "-quarter")
        r = rerun(small)
        if r.verdict in ("pass", "fail") and r.max_err == r.max_err and r.max_err > 0:
            grow = res.max_err / r.max_err
            if grow > 1.5:
                more = (f"the error grows with N ({r.max_err:.2g} at Nk={small.nk}, "
                        f"{res.max_err:.2g} at Nk={c.nk}), as low-precision accumulation does")
                words = f"{words}; {more}" if words else more
    return words


def diagnose(prep, got, res, rerun=None) -> str | None:
    """Words explaining why ``got`` (host, canonical layout) failed ``prep``'s case."""
    got = np.asarray(got, dtype=np.float64)
    words = _nonfinite(prep, got)
    if words:
        return words
    best = None
    for sig in SIGNATURES:
        if sig.exact_only and not prep.variant.exact:
            continue
        try:
            for message, cand in sig.candidates(prep):
                # the mistake may change which rows are empty: try the candidate as it is
                # and with the declared convention applied to the case's empty rows
                raw = np.broadcast_to(cand, prep.golden.shape).astype(np.float64)
                for c in (_finish(prep, cand), raw):
                    if measure(c, prep.golden, prep.keep).max_err <= res.tol_max:
                        continue  # the mistake makes no difference on this case
                    m = measure(got, c, prep.keep)
                    if m.nonfinite or m.golden_nonfinite:
                        continue
                    if m.max_err <= max(res.tol_max, res.max_err / 50.0):
                        if best is None or m.max_err < best[0]:
                            best = (m.max_err, message)
        except Exception:  # a signature that cannot be built for this case says nothing
            continue
    if best is not None:
        return best[1]
    for fn in (lambda: _where(prep, got, res.tol_max), lambda: _precision(prep, res, rerun)):
        words = fn()
        if words:
            return words
    return (f"no known mistake explains it: error {res.ratio:.3g}x the tolerance, worst at "
            f"(batch, head, query) = {tuple(res.worst)}")
