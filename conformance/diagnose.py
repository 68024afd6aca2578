"""Say why a kernel failed: test known mistake signatures against its output.

When a case fails, :func:`diagnose` tries, in order:

1. **Non-finite values**: NaN/Inf exactly on rows with no key to attend to (a
   fully-masked-row convention mismatch); or exactly on the rows where ``exp()``
   overflows (largest logit above ``ln(max)`` of the dtype) or underflows on every key
   (``0/0``: all logits below ``ln`` of the smallest subnormal, or far below a maximum
   taken over a tile of queries instead of the row), or where ``Q K^T`` itself exceeds
   float16's range (logits computed in float16); or elsewhere (rows counted).
2. **Mistake signatures** (:data:`SIGNATURES`): each builds, from the case's rounded
   inputs, the output a specific mistake would produce (scale ``1/d``, a scale off by a
   fitted factor, causal diagonal shifted by one, the other layout, keys and values
   swapped, a dropped tail key block, keys past a fixed buffer ignored, zero padding
   left unmasked, an online softmax that never rescales its accumulator, a
   denominator epsilon, Nystromformer's pseudo-inverse started from the other
   ``pinv_init``, strided views read as if contiguous (:mod:`conformance.noncontiguous`)...).
3. **Where the error lives**: only in the last partial query block, or only on some
   batch entries / heads (named), every other one within tolerance and ten times
   closer than the worst (so that rounding noise crossing the line on a few slices
   is not mistaken for a confined mistake).
4. **Precision**: for a float32/float64 kernel, an error the size of a plain
   float16/bfloat16 implementation's; for a float16/bfloat16 kernel, an error well past
   a plain fp32-accumulating implementation's in its dtype (the ``precision`` column)
   that matches one accumulating ``P V`` and the row sum in the dtype a few keys at a
   time, or (the recurrent family) one holding its state in the dtype or in bfloat16,
   rounded at every step: "accumulates in low precision". An error that grows with
   ``N`` faster than the plain one's (the kernel is re-run on the same case at ``N/4``)
   is said too, as a measurement: growth alone names no cause (a decay lost every 1024
   steps grows as well). For the
   recurrent family in float16/bfloat16 this comes before (3): a state held in the
   dtype errs most on the heads of longest memory, which (3) would report alone.

The rule: a diagnosis names a mistake only when the mistake reproduces what the kernel
did. For a signature (2) that is: the mistake changes the output on this case (its
output is off the golden by more than the tolerance), and the kernel's output is within
the case tolerance of the mistake's, or the mistake explains all but 1/50 of the
kernel's error (``max|got - mistake| <= max|got - golden| / 50``); a mistake whose
output is off by more than the RMS bound only, within the max bound, must explain all but
1/50 of it in both norms (a plain-precision difference such as logits rounded in the
dtype fails the RMS bound alone), or, for a signature whose mistakes change the function
and never only its rounding (``Signature.functional``: the log gates'), be within both
bounds of the kernel's output and leave at most half its RMS error; of several, the
closest is named, and with it every other that reproduces the output within tolerance
(they cannot be told apart on this case). For non-finite values (1), the rows the fault predicts must be
exactly the kernel's non-finite rows (up to rows within rounding of a threshold, and
``0/0`` rows a kernel that guards its division returns finite).
Localisations (3) are measurements, stated only when true. A mistake that explains
less is never named: the failure is then reported as unexplained, with its size and
place.

Extension point: append a :class:`Signature` to :data:`SIGNATURES` (or call
:func:`register_signature`). Its ``candidates(prep)`` yields ``(message, output)``
pairs, ``output`` in the canonical ``(B, H, Nq, dv)`` layout as float64; the gradient
checks and the GQA/window/chunk/varlen features add theirs the same way (a window off by
one, a chunk size off by one or chunks on the wrong positions, a wrong query-head ->
kv-head mapping, a varlen boundary leak).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from .calling import reference_features
from .extras import RECURRENT
from .features import allowed_matrix, sequence_lengths
from .judging import FLA_CHUNK, fp32_state_form, option_names
from .layouts import from_layout
from .noncontiguous import KINDS, contiguous_reads, host_views, view_kind
from .tolerance import (
    LOW_PRECISION,
    MANTISSA_BITS,
    host_dtype,
    measure,
    round_to,
    rounding_caveat,
    rounding_cosine,
)

__all__ = ["Signature", "SIGNATURES", "register_signature", "diagnose", "softmax_host"]


@dataclass(frozen=True)
class Signature:
    """A known mistake: ``candidates(prep)`` yields ``(message, output)`` pairs.

    With ``needs_output=True`` it is called ``candidates(prep, got)``: a mistake with a
    continuous parameter (a scale off by some percent) fits it to the kernel's output.
    """

    name: str
    candidates: Callable[..., Iterator]
    exact_only: bool = False  # needs the variant to be exact softmax
    needs_output: bool = False
    # a costly fit, skipped once another mistake reproduces the output within tolerance
    fit: bool = False
    # every candidate is another function, never another rounding of this one: a kernel
    # within tolerance of it in both norms names it also where it fails the RMS bound alone
    # (in bfloat16 a gate clipped at -5 fails that bound only, and its own rounding is far
    # more than 1/50 of its error)
    functional: bool = False


SIGNATURES: list[Signature] = []


def register_signature(sig: Signature) -> Signature:
    SIGNATURES.append(sig)
    return sig


# ------------------------------------------------------------------ host softmax pieces


_CASE = object()  # "as the case has it"


def _logits(prep, *, scale=None, allowed=_CASE, bias=_CASE):
    a = prep.arrays
    s = (a["q"] @ np.swapaxes(a["k"], -1, -2)) * (prep.scale if scale is None else scale)
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
    yield "the bias is multiplied by the scale (added before scaling)", _ref(prep, bias=b * prep.scale)
    # an additive mask that carries the bias (HuggingFace's attention_mask) added again
    yield "the bias is added twice", _ref(prep, bias=2 * b)


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


def _strided_sigs(prep):
    # the kernel's layout is not known here: a view read as contiguous in the other
    # layout gives other arrays, so only the layout the kernel was run in can reproduce
    c = prep.case
    if view_kind(c) is None:
        return
    layouts = ("bhnd", "bnhd") + (("nd",) if c.batch == (1, 1) and c.kv_batch is None else ())
    for layout in layouts:
        reads = contiguous_reads(*host_views(c, prep.arrays, layout))
        for size in range(1, len(reads) + 1):
            for names in itertools.combinations(sorted(reads, key="qkv".index), size):
                what = ", ".join(names)
                yield (f"reads {what} as if contiguous (ignores the strides of "
                       f"{'its view' if size == 1 else 'their views'}: {KINDS[view_kind(c)]})",
                       _ref(prep, **{n: from_layout(reads[n], layout) for n in names}))


# Fixed key buffers a kernel may have been written for (shared memory, a KV cache
# page set): keys past one are never loaded. Powers of two from 512 up; shorter cuts
# are the tail blocks below, and a buffer that coincides with one is named with it.
KEY_BUFFERS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TAIL_BLOCKS = (16, 32, 64, 128, 256)


def _keys_cuts(prep, j0):
    """The reference with keys ``j0..Nk-1`` ignored: ``(words, output)`` pairs."""
    c, a = prep.case, prep.arrays
    if "mask" in reference_features(prep.variant):
        # hidden by a mask, a bottom-right diagonal stays where the full key length puts
        # it (a buffer cuts the keys a kernel loads, not its indexing)
        al = allowed_matrix(c, a, prep.kwargs)
        inside = np.arange(c.nk) < j0
        al = np.broadcast_to(inside, (1, 1, c.nq, c.nk)) if al is None else al & inside
        yield "", _ref(prep, mask=np.ascontiguousarray(al))
    cut = dict(a)
    cut["k"], cut["v"] = a["k"][..., :j0, :], a["v"][..., :j0, :]
    for n in ("mask", "bias"):
        if n in a and a[n].shape[-1] != 1:
            cut[n] = a[n][..., :j0]
    if prep.kwargs.get("causal") == "bottom-right":
        # the keys cut before the kernel places its diagonal: it moves by Nk - j0
        yield (f", and the causal diagonal is placed for Nk = {j0}",
               prep.reference("float64", arrays=cut))
    elif "mask" not in reference_features(prep.variant):
        yield "", prep.reference("float64", arrays=cut)


def _dropped_keys_sigs(prep, got):
    nk = prep.case.nk
    why: dict[int, list] = {}
    for bs in TAIL_BLOCKS:
        j0 = (nk // bs) * bs
        if nk % bs == 0 or j0 == 0 or j0 in why:
            continue
        why[j0] = [f"the last partial key block is dropped: keys {j0}..{nk - 1} are ignored "
                   f"(block size {bs}, Nk = {nk})"]
    for length in KEY_BUFFERS:
        if length < nk:
            why.setdefault(length, []).append(
                f"keys beyond the first {length} are ignored (a fixed key buffer of {length}; "
                f"keys {length}..{nk - 1} of Nk = {nk} never count)")
    err = measure(got, prep.golden, prep.keep).max_err
    found = []
    for j0, words in sorted(why.items()):
        for extra, out in _keys_cuts(prep, j0):
            r = _reproduces(prep, got, out, err)
            if r is not None:
                found.append((r, j0, " - or ".join(words) + extra, out))
    if not found:
        return
    # several cuts can give the same output (peaked rows whose weight lies before all
    # of them): name each, the closest first, rather than pick one the data cannot
    found.sort(key=lambda f: f[0])
    words = [found[0][2]] + [w for _, j0, w, _ in found[1:] if j0 != found[0][1]]
    tail = "" if len(words) == 1 else " (these cuts give the same output on this case)"
    yield " - or ".join(words) + tail, found[0][3]


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


# Blocks a kernel may pad the keys to: zero keys and values appended and never masked
# give every row extra terms exp(0 - max) in its denominator - an error that shrinks
# as the row's largest logit grows, and looks like rounding on peaked rows.
PAD_BLOCKS = (16, 32, 64, 128, 256)


def _padding_sigs(prep):
    s = _logits(prep)
    v = prep.arrays["v"]
    nk = prep.case.nk
    padded: dict[int, list] = {}
    for bs in PAD_BLOCKS:
        if nk % bs:
            padded.setdefault(nk + (-nk % bs), []).append(str(bs))
    lead = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
    for n, blocks in padded.items():
        pad = n - nk
        s_pad = np.concatenate([np.broadcast_to(s, lead + s.shape[-2:]),
                                np.zeros(lead + (s.shape[-2], pad))], axis=-1)
        v_pad = np.concatenate([np.broadcast_to(v, lead + v.shape[-2:]),
                                np.zeros(lead + (pad, v.shape[-1]))], axis=-2)
        of = blocks[0] if len(blocks) == 1 else ", ".join(blocks[:-1]) + " or " + blocks[-1]
        yield (f"the keys are padded with zeros from Nk = {nk} to {n} (a multiple of {of}) and "
               f"the padding is not masked: every row's softmax counts {pad} extra keys of "
               f"logit 0", softmax_host(s_pad, v_pad))


# A scale off by a small factor (a rounded or mistyped 1/sqrt(d), log2(e) folded in
# twice or not at all) is fitted, not guessed: the factor a with the reference at
# scale a*s closest to the kernel's output. Larger factors are the named mistakes of
# _scale_sigs (1/d, no scale, scale squared); this one covers 0.8 <= a <= 1.25. The
# delta rule's beta and the output itself are fitted the same way: a mistake of a
# small factor makes an error of the size of low-precision rounding, and must be told
# apart from it by what it is, a consistent factor.
SCALE_FIT_RANGE = (0.8, 1.25)


def _compared(prep, got):
    """Where a fit compares the kernel's output with the golden: the kept positions
    where both are finite."""
    keep = np.ones(prep.golden.shape, bool) if prep.keep is None else prep.keep
    return keep & np.isfinite(prep.golden) & np.isfinite(got)


def _fit_factor(prep, got, at):
    """The factor ``a`` in :data:`SCALE_FIT_RANGE` (not 1) whose output ``at(a)`` is
    closest to ``got`` (Gauss-Newton on the scalar, the output being smooth in it) and
    that output; None when there is none."""
    ok = _compared(prep, got)
    lo, hi = SCALE_FIT_RANGE[0] * 0.9, SCALE_FIT_RANGE[1] * 1.1
    a, f, h = 1.0, at(1.0), 1e-4
    for _ in range(4):
        jac = (at(a + h) - f) / h
        den = float(np.sum(np.where(ok, jac * jac, 0.0)))
        if not den > 0:
            return None
        step = float(np.sum(np.where(ok, jac * (got - f), 0.0))) / den
        if abs(step) < 1e-6:
            break
        a = min(max(a + step, lo), hi)
        f = at(a)
    if not SCALE_FIT_RANGE[0] <= a <= SCALE_FIT_RANGE[1] or abs(a - 1.0) < 1e-6:
        return None
    return a, f


def _off_by(a):
    return f"{100 * abs(a - 1):.2g} % too {'large' if a > 1 else 'small'}"


def _scale_fit_sigs(prep, got):
    if "scale" not in reference_features(prep.variant):
        return
    s0 = prep.scale
    fit = _fit_factor(prep, got, lambda a: _finish(prep, _ref(prep, scale=s0 * a)))
    if fit is None:
        return
    a, f = fit
    yield (f"the logit scale is {_off_by(a)}: the output matches scale {s0 * a:.6g} where the "
           f"case's is {s0:.6g} (a factor of {a:.5g}: the scale, or whatever multiplies every "
           f"q . k by it - q, k or a projection of them)", f)


def _beta_fit_sigs(prep, got):
    """The delta rule's write strength ``beta`` off by a small factor (fitted)."""
    if prep.variant.family != "recurrent" or "beta" not in prep.params:
        return
    beta = np.asarray(prep.params["beta"], dtype=np.float64)

    def at(a):
        return _finish(prep, replace(prep, params={**prep.params, "beta": beta * a})
                       .reference("float64"))

    fit = _fit_factor(prep, got, at)
    if fit is not None:
        yield (f"beta is {_off_by(fit[0])}: the output matches the delta rule's beta times "
               f"{fit[0]:.5g}", fit[1])


#: The fewest compared values on which one factor on the output is named: on fewer (a
#: length-1 case's four) rounding one scalar to bfloat16 is a common factor too.
FACTOR_VALUES = 16


def _output_factor_sigs(prep, got):
    """Every output value the golden's times one factor: a consistent ratio (a factor on
    the output, fitted by least squares), not rounding, which has no common direction."""
    ok = _compared(prep, got)
    if np.count_nonzero(ok) < FACTOR_VALUES:
        return
    g = np.where(ok, prep.golden, 0.0)
    den = float(np.sum(g * g))
    if not den > 0:
        return
    a = float(np.sum(g * np.where(ok, got, 0.0))) / den
    if SCALE_FIT_RANGE[0] <= a <= SCALE_FIT_RANGE[1] and abs(a - 1.0) >= 1e-6:
        yield (f"the output is {_off_by(a)}: every value is {a:.5g}x the reference's (a "
               f"consistent ratio: a factor applied to the output)", prep.golden * a)


for _sig in (
    Signature("semantics", _semantics_sigs),
    Signature("scale", _scale_sigs),
    Signature("causal", _causal_sigs),
    Signature("mask", _mask_sigs),
    Signature("bias", _bias_sigs),
    Signature("swap", _swap_sigs),
    Signature("layout", _layout_sigs),
    Signature("noncontiguous", _strided_sigs),
    Signature("dropped keys", _dropped_keys_sigs, needs_output=True),
    Signature("axis", _axis_sigs, exact_only=True),
    Signature("epsilon", _eps_sigs, exact_only=True),
    Signature("online", _online_sigs, exact_only=True),
    Signature("unmasked padding", _padding_sigs, exact_only=True),
    Signature("scale factor", _scale_fit_sigs, needs_output=True, fit=True),
    Signature("beta factor", _beta_fit_sigs, needs_output=True, fit=True),
    Signature("output factor", _output_factor_sigs, needs_output=True, fit=True),
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


def _chunk_sigs(prep):
    """Llama 4's chunked attention done wrong: the chunk size off by one, chunking ignored,
    and chunks placed on other positions than the absolute ones (query ``i`` at
    ``i + Lk - Lq``, chunks counted from key 0 of each sequence)."""
    c = prep.kwargs.get("chunk")
    if c is None:
        return
    for other in (c + 1, c - 1):
        if other >= 1:
            yield f"the chunk size is off by one (chunk {other} instead of {c})", _ref(prep, chunk=other)
    yield (f"chunking is ignored (chunk {c} declared: every key the other masks allow is attended)",
           _ref(prep, chunk=None))
    case = prep.case
    lq, lk = sequence_lengths(case, prep.kwargs)
    i, j = np.arange(case.nq)[:, None], np.arange(case.nk)[None, :]
    pos = i + lk - lq  # the queries' absolute positions
    wrong = (
        ("the chunks are measured from the query's own index i instead of its absolute position "
         "i + Lk - Lq (the cache offset left out of the chunk)", i // c == j // c),
        ("the chunks are measured from the last key backwards (the last chunk ends at key Lk - 1) "
         "instead of from position 0", (lk - 1 - pos) // c == (lk - 1 - j) // c),
        ("the chunks are counted from the padded start of a left-padded batch instead of each "
         "sequence's first token (HuggingFace's left_padding correction left out)",
         (pos + case.nk - lk) // c == (j + case.nk - lk) // c),
    )
    for words, al in wrong:
        if "mask" in prep.arrays:
            al = np.logical_and(al, prep.arrays["mask"])
        yield words, _ref(prep, chunk=None, mask=al)


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
    s = prep.scale
    # c' tanh(s' q.k / c') with the reference's (softcap, scale) = (c', s')
    yield "the soft-cap is ignored", _ref(prep, softcap=None)
    yield "the scale is applied again after the soft-cap", _ref(prep, softcap=c * s, scale=s * s)
    yield "the soft-cap is applied before the scale", _ref(prep, softcap=c * s)
    if "bias" in prep.arrays or "alibi_slopes" in prep.arrays:
        yield ("the soft-cap is applied after the bias/ALiBi (it caps the biased logits)",
               _capped_after_bias(prep, c, s))


def _eager_softmax(prep, dtype):
    """HuggingFace's ``eager_attention_forward`` on ``dtype`` tensors, emulated on the host.

    The logits are a tensor operation each - ``q.k``, the scale, the soft-cap's divide,
    ``tanh`` and multiply, the bias - rounded to ``dtype`` after every step, then
    ``softmax(..., dtype=torch.float32)``, ``P`` back in ``dtype``, ``P V``. Returns
    ``(output, steps)``, ``steps`` naming the roundings of the logits; None where the
    case has ALiBi or dropout, which that function does not take."""
    a, c = prep.arrays, prep.kwargs.get("softcap")
    if "alibi_slopes" in a or "dropout_mask" in a:
        return None

    def rnd(x):
        return round_to(x, dtype)

    q, k, v = a["q"], a["k"], a["v"]
    if prep.kwargs.get("gqa"):
        k, v = (np.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    s = rnd(rnd(q @ np.swapaxes(k, -1, -2)) * prep.scale)
    steps = ["q.k", "the scale"]
    if c is not None:
        s = rnd(rnd(np.tanh(rnd(s / c))) * c)
        steps.append("the soft-cap's divide, tanh and multiply")
    if "bias" in a:
        s = rnd(s + a["bias"])
        steps.append("the bias")
    al = allowed_matrix(prep.case, a, prep.kwargs)
    if al is not None:
        s = np.where(al, s, -np.inf)
    # float32 softmax, P rounded to the dtype. Half-dtype logits: the float64 softmax
    # rounded once gives the same P but where a float32 rounding lands on a tie of the
    # dtype. Float64 logits: taken to float32 first, as softmax(..., dtype=float32) does.
    if dtype not in LOW_PRECISION:
        s = s.astype(np.float32)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, s.dtype.type(0)))
    den = np.sum(e, axis=-1, keepdims=True)
    p = rnd((e / np.where(den > 0, den, 1)).astype(np.float64))
    return rnd(p @ v), steps


def _logits_in_dtype_sigs(prep):
    """A float16/bfloat16 kernel whose logits are rounded to its dtype after every step
    (:func:`_eager_softmax`) before a float32 softmax. The plain implementations of the
    baseline keep the logits in float32 (:func:`attn_ref.softmax.tiles.logit_dtype`);
    with a soft-cap of ``c`` each rounding there is ``c`` times the dtype's epsilon."""
    if prep.dtype not in LOW_PRECISION:
        return
    emulated = _eager_softmax(prep, prep.dtype)
    if emulated is not None:
        out, steps = emulated
        yield (f"the logits are rounded to {prep.dtype} after every step ({', '.join(steps)}) "
               f"before a float32 softmax, where a plain implementation keeps them in float32 "
               f"(HuggingFace's eager attention on {prep.dtype} tensors)", out)


def _alibi_sigs(prep):
    """ALiBi's other forms: attention-gym's signed distance (FlexAttention's usual
    ``score_mod``), the sign flipped, distances from the top-left corner."""
    slopes = prep.arrays.get("alibi_slopes")
    if slopes is None:
        return
    lq, lk = sequence_lengths(prep.case, prep.kwargs)
    i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
    m = np.asarray(slopes, dtype=np.float64).reshape((1, -1, 1, 1))

    def as_bias(add):
        # the ALiBi term replaced by a bias at the same place in the pipeline (after the cap)
        a = {n: x for n, x in prep.arrays.items() if n != "alibi_slopes"}
        a["bias"] = a.get("bias", 0.0) + add
        return prep.reference("float64", arrays=a, kwargs=dict(prep.kwargs))

    yield ("ALiBi as the signed distance + slope (j - i) (attention-gym's generate_alibi_bias, "
           "the usual FlexAttention score_mod: score + slope * (kv_idx - q_idx)), not "
           "-slope |i + Lk - Lq - j|: the same function under a causal mask, another one where "
           "a query sees later keys (it favours them, the farther the more); no option: for "
           "non-causal attention use -slope * abs(q_idx + Lk - Lq - kv_idx)", as_bias(m * (j - i)))
    yield ("ALiBi with the opposite sign (+slope |i + Lk - Lq - j|: distant keys favoured)",
           as_bias(m * np.abs(i + lk - lq - j)))
    if prep.case.nq != prep.case.nk or "seqlens_k" in prep.kwargs or "seqlens_q" in prep.kwargs:
        yield ("ALiBi distances from the top-left corner (-slope |i - j|), not from query i's key "
               "position i + Lk - Lq of its sequence", as_bias(-m * np.abs(i - j)))


def _option_factor_sigs(prep, got):
    """The ALiBi slopes or the soft-cap off by a factor (a slope table or cap constant
    rounded, copied wrong): fitted as the scale is, else named as low precision."""
    slopes, cap = prep.arrays.get("alibi_slopes"), prep.kwargs.get("softcap")
    if slopes is not None:
        def at(a):
            arrays = {**prep.arrays, "alibi_slopes": np.asarray(slopes) * a}
            return _finish(prep, prep.reference("float64", arrays=arrays, kwargs=dict(prep.kwargs)))
        fit = _fit_factor(prep, got, at)
        if fit is not None:
            yield f"the ALiBi slopes are {_off_by(fit[0])} (a factor of {fit[0]:.5g})", fit[1]
    if cap is not None:
        fit = _fit_factor(prep, got, lambda a: _finish(prep, _ref(prep, softcap=cap * a)))
        if fit is not None:
            yield (f"the soft-cap is {_off_by(fit[0])}: c tanh(s / c) with c = {cap * fit[0]:.6g} "
                   f"where the case's is {cap:.6g}", fit[1])


def _capped_after_bias(prep, c, s):
    """The output of ``c tanh((s q.k + bias + alibi) / c)``: the reference fed, with no
    cap and no slopes, the bias that turns its ``s q.k + bias`` into those logits."""
    a = dict(prep.arrays)
    q, k = a["q"], a["k"]
    if prep.kwargs.get("gqa"):
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    z = s * (q @ np.swapaxes(k, -1, -2))
    add = a.get("bias", 0.0)
    slopes = a.pop("alibi_slopes", None)
    if slopes is not None:
        lq, lk = sequence_lengths(prep.case, prep.kwargs)
        i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
        add = add - np.asarray(slopes, dtype=np.float64).reshape(1, -1, 1, 1) * np.abs(i + lk - lq - j)
    a["bias"] = c * np.tanh((z + add) / c) - z
    kwargs = {n: x for n, x in prep.kwargs.items() if n != "softcap"}
    return prep.reference("float64", arrays=a, kwargs=kwargs)


def _varlen_sigs(prep):
    lq, lk = prep.kwargs.get("seqlens_q"), prep.kwargs.get("seqlens_k")
    if lq is None or lk is None:
        return
    from attn_ref.softmax import varlen_attention

    a = prep.arrays

    def pack(x, lens):
        return np.concatenate([np.swapaxes(x[b, :, :n], 0, 1) for b, n in enumerate(lens)])

    kw = {n: prep.kwargs[n] for n in ("window", "chunk", "softcap") if n in prep.kwargs}
    if "alibi_slopes" in a:
        kw["alibi_slopes"] = a["alibi_slopes"]
    o = varlen_attention(pack(a["q"], lq), pack(a["k"], lk), pack(a["v"], lk),
                         cu_seqlens_q=[0, sum(lq)], cu_seqlens_k=[0, sum(lk)],
                         causal=prep.kwargs.get("causal") or False, scale=prep.scale, **kw)
    out = np.zeros(prep.golden.shape)
    start = 0
    for b, n in enumerate(lq):
        out[b, :, :n] = np.swapaxes(o[start:start + n], 0, 1)
        start += n
    yield "tokens attend across sequence boundaries (the packed batch is one sequence)", out


def _recurrent_sigs(prep):
    """The recurrent family's state mistakes (issue 18): an initial state dropped, packed
    sequences whose state is not restarted at their boundaries, the gate applied after the
    update (the current token decays too), the state reset at every chunk."""
    if prep.variant.family != "recurrent":
        return
    a, kw = prep.arrays, prep.kwargs
    s0, cu = a.get("initial_state"), kw.get("cu_seqlens")
    if s0 is not None:
        arrays = {n: x for n, x in a.items() if n != "initial_state"}
        yield ("the initial state is ignored (the output computed from S_0 = 0)",
               prep.reference("float64", arrays=arrays))
    if cu is not None:
        arrays = dict(a) if s0 is None else {**a, "initial_state": s0[:1]}
        yield ("the state is not reset at the packed sequences' boundaries (cu_seqlens): each "
               "sequence starts from the previous one's state, decay included",
               prep.reference("float64", arrays=arrays,
                              kwargs={n: x for n, x in kw.items() if n != "cu_seqlens"}))
    from .extras import reference_on

    p = prep.params
    decay = None
    if "gamma" in p:
        gamma = np.asarray(p["gamma"], dtype=np.float64)
        decay = gamma[..., None, None] if gamma.ndim else gamma
    elif "g" in p and "beta" not in p:
        g = np.exp(np.asarray(p["g"], dtype=np.float64))
        decay = g if g.ndim == a["k"].ndim else g[..., None]
    if decay is not None:
        yield ("the gate is applied after the update (S_t = diag(alpha_t) (S_{t-1} + k_t^T v_t): "
               "the current token decays too)",
               prep.reference("float64", arrays={**a, "k": a["k"] * decay}))
    T = prep.case.nq
    segs = list(zip(cu, cu[1:])) if cu is not None else [(0, T)]
    rows = [s0] if cu is None else [None if s0 is None else s0[i:i + 1] for i in range(len(segs))]
    for c in (16, 32, 64):
        if all(hi - lo <= c for lo, hi in segs):
            break
        # each chunk from S = 0 (a sequence's initial state enters its first chunk only)
        out = np.concatenate([reference_on(prep, "float64", c0, min(c0 + c, hi),
                                           s if c0 == lo else None, output=True)
                              for (lo, hi), s in zip(segs, rows) for c0 in range(lo, hi, c)],
                             axis=-2)
        yield f"the state is not carried across chunks of {c} (reset to 0 at each chunk)", out
    # a chunked kernel whose grid covers the full chunks only: each sequence's last partial
    # chunk is never computed and its outputs stay zero. Chunk sizes that cut at the same
    # tokens give one output, named once with every size.
    cuts: dict[tuple, list] = {}
    for c in (16, 32, 64):
        cut = tuple((lo + (hi - lo) // c * c, hi) for lo, hi in segs if (hi - lo) % c)
        if cut:
            cuts.setdefault(cut, []).append(c)
    for cut, sizes in cuts.items():
        out = np.array(prep.reference("float64"), dtype=np.float64)
        for lo, hi in cut:
            out[..., lo:hi, :] = 0.0
        where = ", ".join(f"{lo}..{hi - 1}" for lo, hi in cut)
        yield (f"the last partial chunk of each sequence is dropped (chunks of "
               f"{' or '.join(map(str, sizes))}): the outputs of tokens {where} are zero", out)


def _gate_sigs(prep):
    """Mistakes in the log gates (:func:`conformance.extras.gate_mistakes`): clipped, or
    their decays flushed to 0 below a threshold."""
    if prep.variant.family != "recurrent":
        return
    from .extras import gate_mistakes

    for message, changed in gate_mistakes(prep):
        yield message, changed.reference("float64")


def _wy_sigs(prep):
    """The delta rule's chunk form without the WY correction
    (:func:`conformance.extras.delta_rule_without_wy`), at the chunk sizes of
    :func:`conformance.extras.wy_chunks`."""
    if prep.variant.family != "recurrent" or "beta" not in prep.params:
        return
    from .extras import without_wy, wy_chunks

    for c in wy_chunks(prep):
        yield (f"the WY correction dropped (chunks of {c}): each chunk writes U = T beta V instead "
               f"of U - W S, its delta-rule corrections computed as if it started from S = 0 "
               f"while its queries read the carried state", without_wy(prep, c)[0])


def _pinv_init_sigs(prep):
    """Nystromformer's pseudo-inverse started from the other convention of ``pinv_init``
    (:func:`attn_ref.reduced.iterative_pinv`): after 6 iterations the start still shows.
    One scale for the whole batch couples its matrices, so only a case with two or more
    (batch entries or heads) tells the two apart."""
    if "pinv_init" not in option_names(prep.variant):
        return
    if prep.options.get("pinv_init", "matrix") == "matrix":
        yield ("the pseudo-inverse started from a batch-global scale (HuggingFace's "
               "init_option='original', lucidrains' nystrom-attention): pass "
               "options={'pinv_init': 'global'}",
               prep.reference("float64", options={**prep.options, "pinv_init": "global"}))
    else:
        yield ("the pseudo-inverse started from a scale per matrix (Razavi et al.'s start, "
               "HuggingFace's init_option other than 'original'), not from the declared "
               "batch-global one: drop options={'pinv_init': 'global'}",
               prep.reference("float64", options={**prep.options, "pinv_init": "matrix"}))


def _pinv_iterations_sigs(prep):
    """Nystromformer's pseudo-inverse iterated once more or once less than declared
    (``pinv_iterations``, 6 by default): a loop bound off by one. Each iteration changes
    ``Z`` by the previous one's residual, so the two counts differ wherever the iteration
    has not converged - at ``m == N`` too, where one more iteration moves the output
    towards exact softmax, HuggingFace's convention there (:func:`_nystrom_exact_sigs`)."""
    if prep.variant.name != "nystrom":
        return
    declared = prep.options.get("pinv_iterations", 6)
    if declared is None:
        return
    for n in (declared - 1, declared + 1):
        if n >= 1:
            yield (f"the pseudo-inverse is iterated {n} times instead of {declared} (a loop "
                   f"bound off by one): pass options={{'pinv_iterations': {n}}} if that is "
                   f"the kernel's count",
                   prep.reference("float64", options={**prep.options, "pinv_iterations": n}))


for _sig in (
    Signature("window", _window_sigs),
    Signature("chunk", _chunk_sigs),
    Signature("gqa", _gqa_sigs),
    Signature("softcap", _softcap_sigs),
    Signature("logits in the dtype", _logits_in_dtype_sigs, exact_only=True),
    Signature("alibi", _alibi_sigs),
    Signature("alibi or soft-cap factor", _option_factor_sigs, needs_output=True, fit=True),
    Signature("varlen", _varlen_sigs),
    Signature("recurrent", _recurrent_sigs),
    Signature("wy", _wy_sigs),
    Signature("gates", _gate_sigs, functional=True),
    Signature("pinv init", _pinv_init_sigs),
    Signature("pinv iterations", _pinv_iterations_sigs),
):
    register_signature(_sig)


# ------------------------------------------- conventions of widely used third-party code
# Each is another function than the registered variant, which the kernel computes on
# purpose: the diagnosis names the package and says how the function differs, so that a
# user does not hunt for a rounding bug (tests/test_conformance_thirdparty.py).


def _host_favor(x, w, over_rows, eps, scale):
    """performer-pytorch's ``softmax_kernel`` (google-research's FAVOR+ code) in float64:
    ``(exp(W x - |x|^2/2 - c) + eps) / sqrt(m)`` of ``x = sqrt(scale) q``, ``c`` the
    maximum of ``W x`` over each row's features (queries) or over every key and feature
    of the batch entry and head (``over_rows``, keys)."""
    x = x * math.sqrt(scale)
    u = x @ w.T
    c = np.max(u, axis=(-1, -2) if over_rows else -1, keepdims=True)
    return (np.exp(u - np.sum(x * x, axis=-1, keepdims=True) / 2 - c) + eps) / math.sqrt(w.shape[0])


#: the feature floors of the FAVOR+ code in use: performer-pytorch's ``softmax_kernel``
#: (1e-4) and google-research's ``numerical_stabilizer`` (1e-6)
FEATURE_FLOORS = (1e-4, 1e-6)


def _favor_floor(eps):
    """performer-pytorch's features in words, up to the source it names (parenthesis open)."""
    return (f"FAVOR+ features floored after the stabiliser, (exp(W x - |x|^2/2 - max W x) + "
            f"{eps:g}) / sqrt(m) (performer-pytorch's softmax_kernel, eps={eps:g}")


def _performer_eps_sigs(prep):
    """FAVOR+ features with a floor added after the stabiliser
    (:func:`attn_ref.performer_attention`'s ``feature_eps``), or without the declared
    one; causal, performer-pytorch's form, which has no option: its key stabiliser is
    taken over every key, and its denominator is ``q . (cumsum k + 1e-6)``."""
    if prep.variant.name != "performer" or prep.options.get("kernel", "positive") != "positive":
        return
    if prep.options.get("stabilize", True) and not prep.options.get("feature_eps", 0.0):
        # exp(W x - |x|^2/2) without max W x subtracted first: the same function in real
        # arithmetic, but every feature of a row of large |x| underflows in float32 (the
        # one-hot case), where the stabilised features do not (a floor is relative to
        # the stabiliser: without one there is none)
        acc = "float64" if prep.dtype == "float64" else "float32"
        yield (f"FAVOR+ features without the stabiliser: exp(W x - |x|^2/2) computed in {acc} "
               f"underflows on rows of large |x|, where the reference subtracts max W x first "
               f"(options={{'stabilize': False}} is that function)",
               prep.reference(acc, options={**prep.options, "stabilize": False}))
    declared = prep.options.get("feature_eps", 0.0)
    causal = prep.kwargs.get("causal") not in (None, False)
    if declared and not causal:
        yield (f"features without the declared floor feature_eps={declared:g} (FAVOR+ as the "
               f"paper defines it): drop options={{'feature_eps': {declared:g}}}",
               prep.reference("float64", options={**prep.options, "feature_eps": 0.0}))
        return
    if not causal:
        for eps in FEATURE_FLOORS:
            yield (f"{_favor_floor(eps)}; google-research's FAVOR+ code): pass "
                   f"options={{'feature_eps': {eps:g}}}",
                   prep.reference("float64", options={**prep.options, "feature_eps": eps}))
        return
    if prep.case.nq != prep.case.nk:
        return
    a, w = prep.arrays, np.asarray(prep.params["projection"], dtype=np.float64)
    for eps in FEATURE_FLOORS:
        fq = _host_favor(a["q"], w, False, eps, prep.scale)
        fk = _host_favor(a["k"], w, True, eps, prep.scale)
        att = np.tril(fq @ np.swapaxes(fk, -1, -2))
        den = np.sum(fq * (np.cumsum(fk, axis=-2) + 1e-6), -1, keepdims=True)
        yield (f"{_favor_floor(eps)}), in its "
               f"causal form: the key stabiliser is the maximum over every key, future ones "
               f"included, and the denominator q . (cumsum k + 1e-6); another function, which "
               f"attn_ref does not define (a later key changes an earlier output)",
               att @ a["v"] / den)


def _generalized_kernel_sigs(prep):
    """performer-pytorch's ``generalized_attention=True``: features ``relu(W x) + 0.001`` of
    ``x = sqrt(scale) q`` (``generalized_kernel``, ``kernel_epsilon=0.001``), normalised
    linear attention on them: a kernel of its own, no estimator of softmax."""
    if prep.variant.name != "performer" or prep.kwargs.get("causal") not in (None, False):
        return
    a, w = prep.arrays, np.asarray(prep.params["projection"], dtype=np.float64)
    root = math.sqrt(prep.scale)
    fq, fk = (np.maximum((a[n] * root) @ w.T, 0.0) + 1e-3 for n in ("q", "k"))
    yield ("features relu(W x) + 0.001 (performer-pytorch's generalized_attention=True, "
           "generalized_kernel): linear attention with a ReLU random-feature kernel, another "
           "function than FAVOR+'s estimate of softmax, not registered in attn_ref",
           (fq @ (np.swapaxes(fk, -1, -2) @ a["v"])) / (fq @ np.sum(fk, axis=-2)[..., None]))


def _efficient_attention_sigs(prep):
    """Shen et al.'s efficient attention, ``softmax_d(Q) softmax_N(K)^T V`` (softmax of
    each query over its features, of the keys over the sequence), as lucidrains'
    linear-attention-transformer computes it (times ``d**-0.5``): no kernel feature map
    of :func:`attn_ref.linear_attention`, so no option of the ``linear`` variant."""
    if prep.variant.family != "linear" or prep.kwargs.get("causal") not in (None, False):
        return
    a = prep.arrays
    eq = np.exp(a["q"] - np.max(a["q"], axis=-1, keepdims=True))
    eq = eq / np.sum(eq, axis=-1, keepdims=True)
    ek = np.exp(a["k"] - np.max(a["k"], axis=-2, keepdims=True))
    ek = ek / np.sum(ek, axis=-2, keepdims=True)
    out = eq @ (np.swapaxes(ek, -1, -2) @ a["v"])
    for factor, words in ((prep.case.d ** -0.5, " times d**-0.5 (linear-attention-transformer's "
                                                 "linear_attn)"), (1.0, "")):
        yield ("efficient attention (Shen et al.): softmax of each query over its features and "
               "of the keys over the sequence, softmax_d(Q) softmax_N(K)^T V" + words + "; not a "
               "feature map of linear attention, which normalises phi(q) . phi(k) by its row "
               "sum: another function, not registered in attn_ref", out * factor)


def _window_padding_sigs(prep):
    """lucidrains' local-attention with ``autopad=True`` and no key mask: the sequence is
    zero-padded to a multiple of the window, and a non-causal window near the end reaches
    zero keys of logit 0 that only a key mask would hide."""
    if prep.variant.name != "local" or prep.kwargs.get("causal") not in (None, False):
        return
    w = prep.kwargs.get("window", prep.options.get("window"))
    n = prep.case.nk
    if not w or n % w == 0 or prep.case.nq != n:
        return
    size = n + (-n % w)
    s = (prep.arrays["q"] @ np.swapaxes(prep.arrays["k"], -1, -2)) * prep.scale
    lead = s.shape[:-2]
    s = np.concatenate([s, np.zeros(lead + (n, size - n))], axis=-1)
    v = prep.arrays["v"]
    v = np.concatenate([v, np.zeros(v.shape[:-2] + (size - n, v.shape[-1]))], axis=-2)
    near = np.abs(np.arange(n)[:, None] - np.arange(size)[None, :]) <= w
    yield (f"the keys are zero-padded from N = {n} to {size} (a multiple of the window, "
           f"{w}) and the padding is attended where a window reaches it (lucidrains' "
           f"local-attention with autopad=True and no key mask: pass mask=)",
           softmax_host(np.where(near, s, -np.inf), v))


def _nystrom_exact_sigs(prep):
    """HuggingFace's ``NystromformerSelfAttention`` computes exact softmax attention when
    ``num_landmarks`` equals the sequence length (its ``segment_means_seq_len``), where the
    reference still runs the iterative pseudo-inverse, which has not converged."""
    if prep.variant.name != "nystrom" or prep.params.get("num_landmarks") != prep.case.nk:
        return
    yield ("exact softmax attention where num_landmarks == N (HuggingFace's "
           "NystromformerSelfAttention skips the Nystrom approximation there; the reference "
           "runs the 6-step iterative pseudo-inverse at every m): declare such cases "
           "unsupported (supports={'cases': ...})", softmax_host(_logits(prep), prep.arrays["v"]))


def _nystrom_front_padded_sigs(prep):
    """lucidrains' nystrom-attention pads the sequence at the front with zero tokens to a
    multiple ``m l`` of the landmarks (``l = ceil(N / m)``) and takes each landmark as the
    mean of ``l`` consecutive tokens; with its key mask the zero tokens are left out
    (``segments="front-padded"`` of :func:`attn_ref.nystrom_attention`), without it they
    are averaged in and attended as keys of logit 0 (no option: a misuse). The default
    segments are the ``m`` balanced ones; the two agree when ``m`` divides ``N``."""
    if prep.variant.name != "nystrom" or prep.case.nq != prep.case.nk:
        return
    import array_api_compat.numpy as xnp

    from attn_ref.reduced import iterative_pinv

    m, n = prep.params["num_landmarks"], prep.case.nk
    size = -(-n // m)
    pad = m * size - n
    if pad == 0:
        return
    declared = prep.options.get("segments", "balanced")
    if declared == "front-padded":
        yield ("landmarks of m balanced segments (attn_ref's default), not of the declared "
               "front-padded ones: drop options={'segments': 'front-padded'}",
               prep.reference("float64", options={**prep.options, "segments": "balanced"}))
    elif pad < size:
        yield ("landmarks of the sequence zero-padded at the front to a multiple of m, the "
               f"padding masked (lucidrains' nystrom-attention, N = {n} not a multiple of "
               f"m = {m}): pass options={{'segments': 'front-padded'}}",
               prep.reference("float64", options={**prep.options, "segments": "front-padded"}))
    a = prep.arrays
    z = lambda x: np.concatenate([np.zeros(x.shape[:-2] + (pad, x.shape[-1])), x], -2)  # noqa: E731
    q, k, v = z(a["q"] * prep.scale), z(a["k"]), z(a["v"])
    ql = q.reshape(q.shape[:-2] + (m, size, q.shape[-1])).mean(-2)
    kl = k.reshape(k.shape[:-2] + (m, size, k.shape[-1])).mean(-2)
    k1 = softmax_host(q @ np.swapaxes(kl, -1, -2), np.eye(m))
    k2 = softmax_host(ql @ np.swapaxes(kl, -1, -2), np.eye(m))
    zinv = iterative_pinv(k2, iterations=prep.options.get("pinv_iterations", 6) or 6,
                          pinv_init=prep.options.get("pinv_init", "matrix"), xp=xnp)
    out = (k1 @ zinv @ softmax_host(ql @ np.swapaxes(k, -1, -2), v))[..., pad:, :]
    yield ("landmarks of the sequence zero-padded at the front to a multiple of m, the padding "
           "unmasked: averaged into the landmarks and attended as keys (lucidrains' "
           f"nystrom-attention without its key mask, N = {n} not a multiple of m = {m}; no "
           "option computes this: pass it a mask)", out)


for _sig in (
    Signature("performer eps", _performer_eps_sigs),
    Signature("performer generalized kernel", _generalized_kernel_sigs),
    Signature("efficient attention", _efficient_attention_sigs),
    Signature("window padding", _window_padding_sigs),
    Signature("nystrom exact at m == N", _nystrom_exact_sigs),
    Signature("nystrom front-padded landmarks", _nystrom_front_padded_sigs),
):
    register_signature(_sig)


# ------------------------------------- BigBird and Reformer conventions (transformers)


def _bigbird_sigs(prep):
    """BigBird's global blocks at both ends (``last_global_blocks`` of
    :func:`attn_ref.sparse.bigbird_attention`: google-research's and HuggingFace's ITC
    layout) against the declared ones; and HuggingFace's ``BigBirdBlockSparseAttention``
    in ``eval()``, whose random blocks are a constant all-zero list: each of a row's
    ``r`` random blocks is block 0 again, so block 0's keys enter the softmax ``1 + r``
    times (its logits raised by ``log(1 + r)``) in every row that is not global."""
    if prep.variant.name != "bigbird" or prep.kwargs.get("causal") not in (None, False):
        return
    from attn_ref.sparse import bigbird_mask

    o = {"window": 1, "global_blocks": 1, "random_blocks": 1, **prep.options}
    declared = o.get("last_global_blocks", 0)
    if declared == 0:
        yield ("the last block is global too, rows and columns, and the random blocks are drawn "
               "past it (the ITC layout of google-research's BigBird and HuggingFace's "
               "BigBirdBlockSparseAttention: global blocks first and last): pass "
               "options={'last_global_blocks': 1}",
               prep.reference("float64", options={**prep.options, "last_global_blocks": 1}))
    else:
        yield (f"the last {declared} block(s) not global (the declared last_global_blocks="
               f"{declared} missing): drop options={{'last_global_blocks': {declared}}}",
               prep.reference("float64", options={**prep.options, "last_global_blocks": 0}))
    r, B, n = o["random_blocks"], o["block_size"], prep.case.nk
    if not r:
        return
    for lg in sorted({declared, 1}):
        keep = np.asarray(bigbird_mask(n, block_size=B, window=o["window"], global_blocks=o["global_blocks"],
                                       random_blocks=0, last_global_blocks=lg, xp=np))
        nb = -(-n // B)
        rows = np.arange(n) // B
        plain = (rows >= o["global_blocks"]) & (rows < nb - lg)  # rows that are not global
        extra = np.where(plain[:, None] & (np.arange(n)[None, :] < B), math.log(1 + r), 0.0)
        how = "" if lg == declared else ", and the last block global (pass options={'last_global_blocks': 1})"
        yield (f"every random block is block 0 again, its keys counted 1 + r = {1 + r} times in each "
               f"row that is not global (HuggingFace's BigBirdBlockSparseAttention in eval(): "
               f"'During inference (eval) no randomness', its random blocks a constant all-zero "
               f"list{how}); another function, which attn_ref does not define: run it with "
               f"num_random_blocks' draw replaced by the layout's random blocks",
               softmax_host(_logits(prep, allowed=keep) + extra, prep.arrays["v"]))


def _bigbird_window_sigs(prep):
    """BigBird's sliding window one block wider or narrower than declared (``window``
    blocks on each side). On short cases it can give the output of the last block made
    global (a window that reaches the last block), and the two are then named together."""
    if prep.variant.name != "bigbird":
        return
    w = {"window": 1, **prep.options}["window"]
    for other, how in ((w + 1, "wider"), (w - 1, "narrower")):
        if other >= 0:
            yield (f"the window one block {how} than declared (window={other}, declared {w})",
                   prep.reference("float64", options={**prep.options, "window": other}))


def _reformer_sigs(prep):
    """The Reformer's look-back over the rounds as one sequence and its pairs counted as
    often as found (``look_back`` and ``dedup`` of
    :func:`attn_ref.hashing.reformer_attention`), against the declared ones: trax,
    HuggingFace's ``LSHSelfAttention`` and reformer-pytorch sort all rounds as one
    sequence; HuggingFace and reformer-pytorch's default do not de-duplicate."""
    if prep.variant.name != "reformer":
        return
    declared = {"look_back": prep.options.get("look_back", "round"), "dedup": prep.options.get("dedup", True)}
    say = {("look_back", "sequence"): "the first chunk of each round looks back at the last chunk of the "
                                      "round before (the rounds sorted as one sequence: trax, "
                                      "HuggingFace's LSHSelfAttention, reformer-pytorch)",
           ("look_back", "round"): "the first chunk of each round looks back at the same round's last chunk",
           ("dedup", False): "a pair found in several rounds (or twice in a window) counted as often as "
                             "found, not once (HuggingFace's LSHSelfAttention, reformer-pytorch's "
                             "allow_duplicate_attention=True)",
           ("dedup", True): "each pair counted once however often found (the duplicate correction)"}
    other = {"look_back": {"round": "sequence", "sequence": "round"}, "dedup": {True: False, False: True}}
    for names in (("look_back", "dedup"), ("look_back",), ("dedup",)):
        change = {n: other[n][declared[n]] for n in names}
        what = "; ".join(say[(n, change[n])] for n in names)
        yield (f"{what}: pass options={change!r}",
               prep.reference("float64", options={**prep.options, **change}))


def _reformer_weights_sigs(prep):
    """The rounds combined with ``exp(lse_r - logsumexp_r lse)`` in the kernel's dtype and
    not divided by their sum (trax, HuggingFace's ``LSHSelfAttention``, reformer-pytorch):
    the weights then err by ``|lse| eps``, which is large where a round's log-sum-exp is
    (``self_logit`` for a token alone in its windows, large logits)."""
    if prep.variant.name != "reformer" or prep.dtype not in ("float32", "float64"):
        return
    from attn_ref.hashing import reformer_rounds

    t = np.dtype(prep.dtype)

    def unnormalised(q, k, v, /, *, xp, **kw):
        o, lse = reformer_rounds(q, k, v, xp=xp, **kw)
        lse = np.asarray(lse).astype(t)
        top = np.max(lse, axis=-2, keepdims=True)
        with np.errstate(invalid="ignore"):
            total = top + np.log(np.sum(np.exp(lse - top), axis=-2, keepdims=True))
            w = np.exp(lse - total)
        return np.sum(np.asarray(o) * np.nan_to_num(w)[..., None].astype(np.float64), axis=-3)

    yield ("the rounds combined with weights exp(lse_r - logsumexp(lse)) computed in the kernel's dtype "
           "and not divided by their sum (HuggingFace's LSHSelfAttention, trax, reformer-pytorch): they "
           "err by |lse| eps, large where a round's log-sum-exp is (a token alone in its windows has "
           "lse = self_logit; large logits); another computation than the reference's normalised "
           "weights, less accurate, not another function: no option",
           prep.reference("float64", fn=unnormalised))


for _sig in (
    Signature("bigbird global blocks and eval draw", _bigbird_sigs),
    Signature("bigbird window width", _bigbird_window_sigs),
    Signature("reformer round weights", _reformer_weights_sigs),
    Signature("reformer look-back and duplicates", _reformer_sigs),
):
    register_signature(_sig)


# ------------------------------------------------ the softmax as exp(s - logsumexp(s))


def _lse_softmax(prep, res):
    """The softmax computed as ``exp(S - logsumexp(S))`` in float32 or float64 (trax,
    HuggingFace's Reformer ``LocalSelfAttention``, ``log_softmax(S).exp()``), named when
    that form (:func:`conformance.judging.lse_form`, NumPy, the kernel's dtype) errs on
    this case at least 0.8 of the tolerance and the kernel's max and RMS errors are both
    within 2x of its: ``S - lse`` rounds at ``|lse|``, a relative error ``eps |lse|`` of
    the weights that the max-shifted softmax does not make (docs/conformance.md, "The
    softmax as exp(s - logsumexp)"). Matched by size, not value by value: the roundings
    of ``S`` differ from kernel to kernel, and the failures are often of the RMS bound.
    """
    from .judging import LSE_VARIANTS, lse_form, verdict_of
    from .long import is_long

    if (prep.variant.name not in LSE_VARIANTS or prep.dtype not in ("float32", "float64")
            or is_long(prep.case)):  # a long case's N x N logits would not fit
        return None
    form, box = lse_form(prep.variant.name), {}

    def with_lse(*args, **kw):
        out, box["lse"] = form(*args, return_lse=True, **kw)
        return out

    try:
        with np.errstate(all="ignore"):
            m = measure(prep.apply_semantics(prep.reference(prep.dtype, fn=with_lse)), prep.golden, prep.keep)
    except Exception:  # a form that cannot be built for this case says nothing
        return None
    near = all(0 < e and 1 / 2 <= k / e <= 2 for k, e in ((res.max_err, m.max_err), (res.rms_err, m.rms_err)))
    if m.nonfinite or not near or verdict_of(m, res.tol_max, res.tol_rms)[2] < 0.8:
        return None
    lse = np.asarray(box["lse"], dtype=np.float64)
    top = float(np.max(np.abs(lse[np.isfinite(lse)]), initial=0.0))
    return ("softmax as exp(s - logsumexp): loses |lse| eps relative; a max-shifted softmax passes "
            f"(exp(s - max) / sum; that form in {prep.dtype} errs {m.max_err:.2g} max, {m.rms_err:.2g} RMS "
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
    """True when :func:`_logits` is the case's exact logit matrix (softmax features only)."""
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
    s = _logits(prep)
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
    from .extras import chunk_running_sums

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


def _where(prep, got, tol):
    """Where the error lives, when that is a fact worth stating (measured, not guessed)."""
    err = np.abs(got - prep.golden)
    if prep.keep is not None:
        err = np.where(prep.keep, err, 0.0)
    err = np.where(np.isfinite(err), err, np.inf)
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
    return words


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
    ok = _compared(prep, got) & (prep.golden != 0)
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

    def run(store):
        outs[store] = prep.reference(dt, fn=fp32_state_form(prep.variant.name, 1, store))
        return outs[store]

    best = _nearest_within_3x(prep, res.max_err, (
        (store, lambda store=store: run(store)) for store in dict.fromkeys((dt, "bfloat16"))),
        stop_at_error=False)
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
    emulated = (_eager_softmax(prep, "float64") if prep.dtype == "float64" and prep.variant.exact
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


# A named mistake leaves at most this fraction of the kernel's error unexplained (when
# its output is not within the case tolerance of the kernel's outright).
UNEXPLAINED = 1 / 50


def _reproduces(prep, got, cand, err=None, functional=False):
    """How closely a mistake's output ``cand`` reproduces the kernel's ``got``.

    The rule of the module docstring: None unless the mistake changes the output of
    this case (it is off the golden by more than the tolerance) and the kernel's output
    is within ``max(tolerance, UNEXPLAINED * kernel error)`` of it; else the largest
    difference. A mistake within the max bound, past the RMS one, must leave
    ``UNEXPLAINED`` of the kernel's error in both norms, or (``functional``: a change of
    function, never of rounding) be within both bounds of the kernel's output and leave
    at most half its RMS error. The mistake may change which rows are empty, so the
    candidate is tried as it is and with the declared convention applied to the case's
    empty rows.
    """
    if err is None:
        err = measure(got, prep.golden, prep.keep).max_err
    best = None
    raw = np.broadcast_to(cand, prep.golden.shape).astype(np.float64)
    for c in (_finish(prep, cand), raw):
        off = measure(c, prep.golden, prep.keep)
        if off.max_err <= prep.tol_max and off.rms_err <= prep.tol_rms:
            continue  # the mistake makes no difference on this case
        m = measure(got, c, prep.keep)
        if m.nonfinite or m.golden_nonfinite:
            continue
        if off.max_err <= prep.tol_max:
            # a mistake within the max bound, past the RMS one, is named only when it
            # leaves at most UNEXPLAINED of the kernel's error in both norms: within the
            # max bound, any small error would be "within tolerance of it"
            rms = measure(got, prep.golden, prep.keep).rms_err
            if (m.max_err <= err * UNEXPLAINED and m.rms_err <= rms * UNEXPLAINED) or (
                    functional and m.max_err <= prep.tol_max and m.rms_err <= prep.tol_rms
                    and m.rms_err <= rms / 2):
                best = m.max_err if best is None else min(best, m.max_err)
        elif m.max_err <= max(prep.tol_max, err * UNEXPLAINED):
            best = m.max_err if best is None else min(best, m.max_err)
    return best


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
                r = _reproduces(prep, got, cand, res.max_err, sig.functional)
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
    order = (lambda: _lse_softmax(prep, res), lambda: _where(prep, got, res.tol_max),
             lambda: _precision(prep, res, rerun, got))
    if prep.variant.name in RECURRENT and prep.dtype in LOW_PRECISION:
        # a state kept in the dtype errs most on the heads of longest memory: "wrong only
        # on heads 1..7" would be a true measurement that names no mistake
        order = order[::-1]
    for fn in order:
        words = fn()
        if words:
            return words
    return (f"no known mistake explains it: error {res.ratio:.3g}x the tolerance, worst at "
            f"(batch, head, query) = {tuple(res.worst)}")
