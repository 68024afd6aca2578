"""Signatures of the classic mistakes of exact softmax and of every variant: the scale,
the causal mask, masks and biases, swapped or transposed inputs, dropped keys, the
softmax's axis and epsilon, an online softmax that never rescales, unmasked padding, and
the fitted factors (scale, beta, output)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np

from ..calling import reference_features
from ..features import allowed_matrix
from ..layouts import from_layout
from ..noncontiguous import KINDS, contiguous_reads, host_views, view_kind
from ..tolerance import (
    MANTISSA_BITS,
    measure,
)
from .base import (
    SCALE_FIT_RANGE,
    Signature,
    compared,
    finish,
    fit_factor,
    host_logits,
    off_by,
    ref_with,
    reproduces,
    softmax_host,
)

# ------------------------------------------------------------------------- signatures


def _scale_sigs(prep):
    d = prep.case.d
    if prep.case.scale is None:
        yield "the logits are scaled by 1/d instead of 1/sqrt(d)", ref_with(prep, scale=1.0 / d)
        yield "the logits are not scaled (scale 1 instead of 1/sqrt(d))", ref_with(prep, scale=1.0)
    else:
        s = prep.case.scale
        yield ("the scale argument is ignored (the default 1/sqrt(d) is used)",
               ref_with(prep, scale=None))
        yield "the scale is applied twice", ref_with(prep, scale=s * s)
        yield "the scale is multiplied by 1/sqrt(d) again", ref_with(prep, scale=s / math.sqrt(d))


def _causal_matrix(nq, nk, off):
    return (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off)[None, None]


def _causal_sigs(prep):
    c = prep.case
    align = prep.kwargs.get("causal")
    if align:
        yield "the causal mask is ignored", ref_with(prep, causal=None)
        if c.nq != c.nk:
            other = "bottom-right" if align == "top-left" else "top-left"
            yield (f"the causal mask is aligned {other} instead of {align} "
                   f"(declare semantics causal='{other}' if that is the kernel's convention)",
                   ref_with(prep, causal=other))
        base = 0 if align == "top-left" else c.nk - c.nq
        for shift, words in ((1, "one key too many (j <= i + 1)"), (-1, "the diagonal (j < i)")):
            al = _causal_matrix(c.nq, c.nk, base + shift)
            if "mask" in prep.arrays:
                al = np.logical_and(al, prep.arrays["mask"])
            yield (f"the causal mask is off by one: it lets each query see {words}"
                   if shift > 0 else f"the causal mask is off by one: it hides {words}",
                   softmax_host(host_logits(prep, allowed=al), prep.arrays["v"]))
    else:
        for a in ("top-left", "bottom-right"):
            yield f"a causal ({a}) mask is applied although the case is not causal", \
                ref_with(prep, causal=a)


def _mask_sigs(prep):
    if "mask" not in prep.arrays:
        return
    m = prep.arrays["mask"]
    yield "the mask is inverted (True read as 'masked out')", ref_with(prep, mask=~m)
    yield "the mask is ignored", ref_with(prep, mask=None)


def _bias_sigs(prep):
    if "bias" not in prep.arrays:
        return
    b = prep.arrays["bias"]
    yield "the bias is ignored", ref_with(prep, bias=None)
    yield "the bias is subtracted instead of added", ref_with(prep, bias=-b)
    yield "the bias is multiplied by the scale (added before scaling)", ref_with(prep, bias=b * prep.scale)
    # an additive mask that carries the bias (HuggingFace's attention_mask) added again
    yield "the bias is added twice", ref_with(prep, bias=2 * b)


def _swap_sigs(prep):
    a = prep.arrays
    if a["k"].shape == a["v"].shape:
        yield "keys and values are swapped", ref_with(prep, k=a["v"], v=a["k"])


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


def _misread_sigs(prep):
    """One input read through the wrong index arithmetic, as a C/CUDA kernel reading a raw
    buffer does: ``(B, N, H, d)`` memory indexed as ``(B, H, N, d)`` or the reverse (the
    heads and sequence axes swapped by a stride), or a head's ``(N, d)`` matrix indexed
    column-major, ``x[c N + n]`` for ``x[n d + c]``. Each is a permutation of the input's
    elements, a function of the buffer, not of the values: an independent audit's C
    kernels with such reads failed as "no known mistake"."""
    for name in ("q", "k", "v"):
        x = prep.arrays[name]
        b, h, n, d = x.shape
        if h > 1 and n > 1:
            bnhd = np.reshape(np.swapaxes(x, 1, 2), (b, h, n, d))
            bhnd = np.swapaxes(np.reshape(x, (b, n, h, d)), 1, 2)
            yield (f"{name} is read with its heads and sequence axes swapped: (B, N, H, d) memory "
                   "indexed as (B, H, N, d)", ref_with(prep, **{name: bnhd}))
            yield (f"{name} is read with its heads and sequence axes swapped: (B, H, N, d) memory "
                   "indexed as (B, N, H, d)", ref_with(prep, **{name: bhnd}))
        if n > 1 and d > 1:
            yield (f"{name} is read column-major: each head's (N, d) matrix indexed as x[c N + n] "
                   "for x[n d + c]", ref_with(prep, **{name: np.swapaxes(
                       np.reshape(x, (b, h, d, n)), -1, -2)}))


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
                       ref_with(prep, **{n: from_layout(reads[n], layout) for n in names}))


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
        yield "", ref_with(prep, mask=np.ascontiguousarray(al))
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
            r = reproduces(prep, got, out, err)
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
    s = host_logits(prep)
    yield ("the softmax is taken over the query axis instead of the key axis",
           softmax_host(np.where(np.isfinite(s), s, -np.inf), prep.arrays["v"], axis=-2))


def _eps_sigs(prep):
    s = host_logits(prep)
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
    s = host_logits(prep)
    for bs in (16, 32, 64, 128):
        if prep.case.nk > bs:
            yield (f"online softmax: the output accumulator is not rescaled when the running "
                   f"maximum grows (key block {bs})", online_no_rescale(s, prep.arrays["v"], bs))


# Blocks a kernel may pad the keys to: zero keys and values appended and never masked
# give every row extra terms exp(0 - max) in its denominator - an error that shrinks
# as the row's largest logit grows, and looks like rounding on peaked rows.
PAD_BLOCKS = (16, 32, 64, 128, 256)


def _padding_sigs(prep):
    s = host_logits(prep)
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


def _scale_fit_sigs(prep, got):
    if "scale" not in reference_features(prep.variant):
        return
    s0 = prep.scale
    fit = fit_factor(prep, got, lambda a: finish(prep, ref_with(prep, scale=s0 * a)))
    if fit is None:
        return
    a, f = fit
    yield (f"the logit scale is {off_by(a)}: the output matches scale {s0 * a:.6g} where the "
           f"case's is {s0:.6g} (a factor of {a:.5g}: the scale, or whatever multiplies every "
           f"q . k by it - q, k or a projection of them)", f)


def _beta_fit_sigs(prep, got):
    """The delta rule's write strength ``beta`` off by a small factor (fitted)."""
    if prep.variant.family != "recurrent" or "beta" not in prep.params:
        return
    beta = np.asarray(prep.params["beta"], dtype=np.float64)

    def at(a):
        return finish(prep, replace(prep, params={**prep.params, "beta": beta * a})
                       .reference("float64"))

    fit = fit_factor(prep, got, at)
    if fit is not None:
        yield (f"beta is {off_by(fit[0])}: the output matches the delta rule's beta times "
               f"{fit[0]:.5g}", fit[1])


#: The fewest compared values on which one factor on the output is named: on fewer (a
#: length-1 case's four) rounding one scalar to bfloat16 is a common factor too.
FACTOR_VALUES = 16


def _output_factor_sigs(prep, got):
    """Every output value the golden's times one factor: a consistent ratio (a factor on
    the output, fitted by least squares), not rounding, which has no common direction.

    A change of function (``functional``): named also where the kernel fails the RMS
    bound alone, when within both bounds of the factor's output with at most half its RMS
    error left - a factor off 1 by more than the dtype's epsilon, so that a bias of the
    rounding (toward zero: at most one ulp) is no factor. Before, SDPA's output x 1.004 in
    float16 read "the kernel accumulates in low precision", its rounding far more than
    :data:`~conformance.diagnose.base.UNEXPLAINED` of its error."""
    ok = compared(prep, got)
    if np.count_nonzero(ok) < FACTOR_VALUES:
        return
    g = np.where(ok, prep.golden, 0.0)
    den = float(np.sum(g * g))
    if not den > 0:
        return
    a = float(np.sum(g * np.where(ok, got, 0.0))) / den
    if SCALE_FIT_RANGE[0] <= a <= SCALE_FIT_RANGE[1] and \
            abs(a - 1.0) >= max(1e-6, 2.0 ** -MANTISSA_BITS.get(prep.dtype, 52)):
        yield (f"the output is {off_by(a)}: every value is {a:.5g}x the reference's (a "
               f"consistent ratio: a factor applied to the output)", prep.golden * a)


#: this module's signatures, in the order they are tried (registered by the package)
CLASSIC = (
    Signature("semantics", _semantics_sigs),
    Signature("scale", _scale_sigs),
    Signature("causal", _causal_sigs),
    Signature("mask", _mask_sigs),
    Signature("bias", _bias_sigs),
    Signature("swap", _swap_sigs),
    Signature("layout", _layout_sigs),
    Signature("misread input", _misread_sigs),
    Signature("noncontiguous", _strided_sigs),
    Signature("dropped keys", _dropped_keys_sigs, needs_output=True),
    Signature("axis", _axis_sigs, exact_only=True),
    Signature("epsilon", _eps_sigs, exact_only=True),
    Signature("online", _online_sigs, exact_only=True),
    Signature("unmasked padding", _padding_sigs, exact_only=True),
    Signature("scale factor", _scale_fit_sigs, needs_output=True, fit=True),
    Signature("beta factor", _beta_fit_sigs, needs_output=True, fit=True),
    Signature("output factor", _output_factor_sigs, needs_output=True, fit=True, functional=True),
)
