"""Deliberately broken kernels: the oracle's own test.

Each :class:`Mutant` is a NumPy float32 kernel with one classic mistake, and the words
its diagnosis should contain. The oracle must fail every one of them; ``catch_rate``
runs the catalogue and reports how many were caught and how many were diagnosed right::

    python -m conformance.mutants               # quick suite, seed 0
    python -m conformance.mutants standard      # the standard suite
    python -m conformance.mutants quick 20      # seeds 0..19

Extension point: append to :data:`MUTANTS` (the gradient checks add broken backward
passes, the GQA/window/chunk/varlen features their mutants, each with its expected words).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .extras import RECURRENT
from .tolerance import UNTOLD

__all__ = ["Mutant", "MUTANTS", "STRUCTURAL", "correct_kernel", "catch_rate", "structural_cases",
           "VARIANT_CHANGES", "VARIANT_KERNELS", "reformer_mutant_kernel", "routing_kernel",
           "synthesizer_kernel", "variant_kernel", "variant_mutants", "first_failure",
           "FINAL_STATE_CHANGES", "final_state_mutants", "GATE_CHANGES", "RECURRENT_CHANGES",
           "RECURRENT_VARIANTS",
           "catch_table", "MUTANT_CAUSES", "NO_CAUSE", "precision_loss_kernel", "precision_mutants",
           "classify_diagnosis", "audit_diagnoses",
           "fp32_accumulating_kernel", "low_precision_accumulating_kernel"]


def _allowed(nq, nk, causal, mask, shift=0):
    al = None
    if causal:
        off = (0 if causal in (True, "top-left") else nk - nq) + shift
        al = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off
    if mask is not None:
        al = mask if al is None else (al & mask)
    return al


def _kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None, dtype=None,
            scale_rule=None, shift=0, axis=-1, max_sub=True, eps=0.0, nan_rows=False,
            drop_tail=None, no_rescale=None, invert_mask=False, ignore=()):
    out_dtype = q.dtype
    ct = np.dtype(dtype) if dtype is not None else q.dtype
    q, k, v = q.astype(ct), k.astype(ct), v.astype(ct)
    d = q.shape[-1]
    if scale is None or "scale" in ignore:
        scale = 1.0 / math.sqrt(d) if scale_rule is None else scale_rule(d)
    if drop_tail is not None and k.shape[-2] % drop_tail:
        j0 = (k.shape[-2] // drop_tail) * drop_tail
        k, v = k[..., :j0, :], v[..., :j0, :]
        mask = None if mask is None else mask[..., :j0]
        bias = None if bias is None else bias[..., :j0]
    s = (q @ np.swapaxes(k, -1, -2)) * ct.type(scale)
    if bias is not None and "bias" not in ignore:
        s = s + bias.astype(ct)
    if invert_mask and mask is not None:
        mask = ~mask
    al = _allowed(q.shape[-2], k.shape[-2], None if "causal" in ignore else causal,
                  None if "mask" in ignore else mask, shift)
    if al is not None:
        s = np.where(al, s, -np.inf)
    if no_rescale:
        from .diagnose import online_no_rescale

        return online_no_rescale(s.astype(np.float64), v.astype(np.float64),
                                 no_rescale).astype(out_dtype)
    m = np.max(s, axis=axis, keepdims=True) if max_sub else np.zeros_like(s[..., :1])
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    den = np.sum(e, axis=axis, keepdims=True)
    if nan_rows:
        p = e / den
    else:
        p = e / np.where(den + eps > 0, den + eps, 1)
    return (p @ v).astype(out_dtype)


def correct_kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    """A correct NumPy kernel (``causal`` takes "top-left"/"bottom-right"); mutants derive from it."""
    return _kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)


def _mut(**knobs):
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        return _kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, **knobs)

    return kernel


def _wrong_dtype(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    return correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale).astype(np.float64)


def _inplace_q(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    q *= (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale  # the mistake
    return _kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=1.0)


def _layout_mixed(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    # declared (B, H, N, d) but computed as if (B, N, H, d)
    sw = [np.swapaxes(x, 1, 2) for x in (q, k, v)]
    return np.swapaxes(_kernel(*sw, causal=causal, scale=scale), 1, 2)


def _wrong_alignment(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    flip = {"top-left": "bottom-right", "bottom-right": "top-left"}.get(causal, causal)
    return correct_kernel(q, k, v, mask=mask, bias=bias, causal=flip, scale=scale)


@dataclass
class Mutant:
    name: str
    kernel: Any
    expect: str  # words the diagnosis should contain
    options: dict = field(default_factory=dict)  # extra verify() keywords
    variant: str = "softmax"  # the registered variant the kernel claims to compute


MUTANTS: list[Mutant] = [
    Mutant("scale 1/d", _mut(scale_rule=lambda d: 1.0 / d), "1/d instead of 1/sqrt(d)"),
    Mutant("no scale", _mut(scale_rule=lambda d: 1.0), "not scaled"),
    Mutant("scale argument ignored", _mut(ignore=("scale",)), "scale argument is ignored"),
    Mutant("causal off by one", _mut(shift=1), "off by one"),
    Mutant("causal ignored", _mut(ignore=("causal",)), "causal mask is ignored"),
    Mutant("causal alignment flipped", _wrong_alignment, "aligned"),
    Mutant("inverted mask", _mut(invert_mask=True), "inverted"),
    Mutant("mask ignored", _mut(ignore=("mask",)), "mask is ignored"),
    Mutant("softmax over the wrong axis", _mut(axis=-2), "query axis"),
    Mutant("no max-subtraction", _mut(max_sub=False), "row maximum is not subtracted"),
    Mutant("low-precision accumulation", _mut(dtype="float16"), "float16"),
    Mutant("online softmax without rescaling", _mut(no_rescale=16), "not rescaled"),
    Mutant("dropped tail key block", _mut(drop_tail=16), "last partial key block"),
    Mutant("keys and values swapped", lambda q, k, v, *, mask=None, bias=None, causal=False,
           scale=None: correct_kernel(q, v, k, mask=mask, bias=bias, causal=causal, scale=scale),
           "swapped"),
    Mutant("bias ignored", _mut(ignore=("bias",)), "bias is ignored"),
    Mutant("bias added twice", lambda q, k, v, *, mask=None, bias=None, causal=False, scale=None:
           correct_kernel(q, k, v, mask=mask, bias=None if bias is None else 2 * bias,
                          causal=causal, scale=scale), "bias is added twice"),
    Mutant("wrong output dtype", _wrong_dtype, "output dtype"),
    Mutant("in-place write into q", _inplace_q, "modified its input 'q'"),
    Mutant("NaN for fully masked rows", _mut(nan_rows=True), "no key to attend to"),
    Mutant("layout mixed up", _layout_mixed, "layout is mixed up"),
    Mutant("denominator epsilon 1e-3", _mut(eps=1e-3), "epsilon of 0.001"),
]



# ------------------------------------------ features of modern kernels (GQA, window, ...)


def _modern(mistake):
    """A NumPy kernel taking GQA, windows, Llama 4's chunks, soft-capping and lengths
    (attn_ref's reference run on NumPy) with one ``mistake``."""

    def kernel(q, k, v, *, mask=None, causal=False, scale=None, gqa=False, window=None, chunk=None,
               softcap=None, seqlens_q=None, seqlens_k=None):
        from attn_ref.softmax import softmax_attention, varlen_attention

        kw = dict(mask=mask, causal=causal, scale=scale, gqa=gqa, window=window, chunk=chunk,
                  softcap=softcap, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
        if mistake.startswith("chunk") and chunk is not None:
            kw.update(_chunk_mistake(mistake, chunk, q.shape[-2], k.shape[-2], seqlens_q, seqlens_k, mask))
        if mistake in ("window left", "window right") and window is not None:
            left, right = window
            kw["window"] = (left + 1 if mistake == "window left" and left >= 0 else left,
                            right - 1 if mistake == "window right" and right > 0 else right)
        if mistake == "gqa modulo" and gqa:
            g = q.shape[1] // k.shape[1]
            k, v, kw["gqa"] = np.tile(k, (1, g, 1, 1)), np.tile(v, (1, g, 1, 1)), False
        if mistake == "softcap scale twice" and softcap is not None:
            s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            kw.update(softcap=softcap * s, scale=s * s)  # s * c tanh(s q.k / c)
        if mistake == "varlen leak" and seqlens_q is not None:
            def pack(x, lens):
                return np.concatenate([np.swapaxes(x[b, :, :n], 0, 1) for b, n in enumerate(lens)])

            o = varlen_attention(pack(q, seqlens_q), pack(k, seqlens_k), pack(v, seqlens_k),
                                 cu_seqlens_q=[0, sum(seqlens_q)], cu_seqlens_k=[0, sum(seqlens_k)],
                                 causal=causal, scale=scale, window=window, softcap=softcap)
            out, start = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype), 0
            for b, n in enumerate(seqlens_q):
                out[b, :, :n] = np.swapaxes(o[start:start + n], 0, 1)
                start += n
            return out
        return np.asarray(softmax_attention(q, k, v, **kw), dtype=q.dtype)

    return kernel


def _chunk_mistake(mistake, c, nq, nk, seqlens_q, seqlens_k, mask):
    """The options a kernel with Llama 4's chunks done wrong passes the reference instead."""
    if mistake == "chunk plus one":
        return {"chunk": c + 1}
    if mistake == "chunk ignored":
        return {"chunk": None}
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    lq = np.reshape(seqlens_q if seqlens_q is not None else nq, (-1, 1, 1, 1))
    lk = np.reshape(seqlens_k if seqlens_k is not None else nk, (-1, 1, 1, 1))
    if mistake == "chunk local":  # the chunk of the query's own index, no cache offset
        al = i // c == j // c
    else:  # "chunk from end": chunks counted backwards from each sequence's last key
        pos = i + lk - lq
        al = (lk - 1 - pos) // c == (lk - 1 - j) // c
    return {"chunk": None, "mask": al if mask is None else al & mask}


def _feature_cases(name):
    from .catalogue import CATALOGUE

    return [c for c in CATALOGUE["standard"] if name in c.needs and c.nk <= 256]


MUTANTS += [
    Mutant("window left extent off by one", _modern("window left"), "left extent is off by one",
           {"cases": _feature_cases("window")}),
    Mutant("window right extent off by one", _modern("window right"), "right extent is off by one",
           {"cases": _feature_cases("window")}),
    Mutant("chunk size off by one", _modern("chunk plus one"), "chunk size is off by one",
           {"cases": _feature_cases("chunk")}),
    Mutant("chunking ignored", _modern("chunk ignored"), "chunking is ignored",
           {"cases": _feature_cases("chunk")}),
    Mutant("chunks from the query's index", _modern("chunk local"),
           "chunks are measured from the query's own index", {"cases": _feature_cases("chunk")}),
    Mutant("chunks from the last key", _modern("chunk from end"),
           "chunks are measured from the last key backwards", {"cases": _feature_cases("chunk")}),
    Mutant("GQA head h -> kv head h % Hkv", _modern("gqa modulo"), "h % Hkv",
           {"cases": _feature_cases("gqa")}),
    Mutant("varlen leak across sequences", _modern("varlen leak"), "across sequence boundaries",
           {"cases": _feature_cases("seqlens_q")}),
    Mutant("softcap: scale applied twice", _modern("softcap scale twice"),
           "scale is applied again after the soft-cap", {"cases": _feature_cases("softcap")}),
]


# ------------------------------------------------------------------ structural mutants
# Right on the shapes their author tried, wrong past them: on batch entries >= 2, on
# heads >= 4, on keys past a fixed buffer (issue 14). The standard suite must fail
# each; their cases are the standard ones that reach those indices and lengths. Then
# mistakes whose error is small or non-finite, which diagnoses used to mislabel as
# precision or overflow: a scale 1 % off, keys padded and not masked, 0/0 underflow.


def _batch_clamped(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    """Batch entries >= 2 read the keys and values of entry 1 (a grid written for two)."""
    if k.shape[0] > 2:
        idx = np.minimum(np.arange(k.shape[0]), 1)
        k, v = k[idx], v[idx]
    return correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)


def _heads_wrapped(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    """Head h >= 4 reads the keys and values of head h % 4 (a head stride for four)."""
    if k.shape[1] > 4:
        idx = np.arange(k.shape[1]) % 4
        k, v = k[:, idx], v[:, idx]
    return correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)


def _key_buffer(length):
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        # the visibility the full-length kernel computes, then only the keys the buffer
        # holds: keys length..Nk-1 are never loaded
        al = _allowed(q.shape[-2], k.shape[-2], causal, mask)
        inside = np.arange(k.shape[-2]) < length
        al = inside if al is None else al & inside
        return _kernel(q, k, v, mask=al, bias=bias, scale=scale)

    kernel.__name__ = f"key_buffer_{length}"
    return kernel


def _scaled(factor):
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return _kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=s * factor)

    kernel.__name__ = f"scale_times_{factor:g}"
    return kernel


def _unmasked_padding(q, k, v, *, mask=None, bias=None, causal=False, scale=None, block=64):
    """Keys and values padded with zeros to a multiple of ``block``; the padding is
    never masked, so every row's softmax counts the extra keys (logit 0)."""
    nq, nk = q.shape[-2], k.shape[-2]
    pad = -nk % block
    al = _allowed(nq, nk, causal, mask)
    if pad == 0:
        return _kernel(q, k, v, mask=al, bias=bias, scale=scale)
    al = np.ones((nq, nk), dtype=bool) if al is None else al
    al = np.concatenate([al, np.ones(al.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    k = np.concatenate([k, np.zeros(k.shape[:-2] + (pad, k.shape[-1]), k.dtype)], axis=-2)
    v = np.concatenate([v, np.zeros(v.shape[:-2] + (pad, v.shape[-1]), v.dtype)], axis=-2)
    if bias is not None:
        bias = np.concatenate([bias, np.zeros(bias.shape[:-1] + (pad,), bias.dtype)], axis=-1)
    return _kernel(q, k, v, mask=al, bias=bias, scale=scale)


def _tile_max(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    """The maximum subtracted before exp() is the whole (Nq, Nk) tile's, not each row's:
    rows far below it underflow on every key and divide 0 by 0."""
    ct = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * ct.type(scale)
    if bias is not None:
        s = s + bias.astype(ct)
    al = _allowed(q.shape[-2], k.shape[-2], causal, mask)
    if al is not None:
        s = np.where(al, s, -np.inf)
    m = np.max(s, axis=(-2, -1), keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    # rows with no key are zeros, as declared; the others divide by their sum as it is
    live = np.ones(s.shape[:-1] + (1,), bool) if al is None else np.any(
        np.broadcast_to(al, s.shape), axis=-1, keepdims=True)
    den = np.where(live, np.sum(e, axis=-1, keepdims=True), 1)
    return ((e / den) @ v).astype(q.dtype)


def structural_cases():
    """The standard cases past two batch entries, four heads or 1024 keys."""
    from .catalogue import CATALOGUE

    return [c for c in CATALOGUE["standard"]
            if c.family is None
            and not c.needs - {"mask", "bias", "causal", "scale", "broadcast", "value_dim"}
            and (c.batch[0] > 2 or c.batch[1] > 4 or c.nk > 1024)]


STRUCTURAL: list[Mutant] = [
    Mutant("wrong on batch entries >= 2", _batch_clamped, "wrong only on batch entr"),
    Mutant("wrong on heads >= 4", _heads_wrapped, "wrong only on head"),
    Mutant("keys past a buffer of 1024 dropped", _key_buffer(1024),
           "keys beyond the first 1024 are ignored"),
    Mutant("keys past a buffer of 2048 dropped", _key_buffer(2048),
           "keys beyond the first 2048 are ignored"),
]
MUTANTS += [replace(m, options={"cases": structural_cases(), **m.options}) for m in STRUCTURAL]
def _read_as_contiguous(x):
    # the classic stride bug: x's memory from its first element on, in row-major order
    base = x if x.base is None else x.base
    offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return np.ndarray(x.shape, x.dtype, buffer=base, offset=offset)


def _ignores_strides(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    return _kernel(*map(_read_as_contiguous, (q, k, v)), mask=mask, bias=bias, causal=causal,
                   scale=scale)


MUTANTS += [
    Mutant("inputs read as if contiguous", _ignores_strides, "as if contiguous",
           {"cases": _feature_cases("noncontiguous")}),
]
MUTANTS += [
    Mutant("scale 1 % too large", _scaled(1.01), "logit scale is 1 % too large"),
    Mutant("zero padding not masked", _unmasked_padding, "padded with zeros from Nk"),
    Mutant("maximum over the tile, not the row", _tile_max, "0/0 from underflow"),
]


# ------------------------------------- float16/bfloat16: accumulating in the kernel's dtype


def _blockwise(q, k, v, mask, causal, scale, block, acc_dtype, row_sum_in_dtype=None):
    """Softmax attention over key blocks; ``acc_dtype`` holds the running ``P V`` (and row
    sum) between blocks; the logits, exponentials and products inside a block are float32."""
    dt = q.dtype
    row_sum_dtype = acc_dtype if row_sum_in_dtype is None else row_sum_in_dtype
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.astype(np.float32) @ np.swapaxes(k, -1, -2).astype(np.float32)) * np.float32(scale)
    al = _allowed(nq, nk, causal, mask)
    if al is not None:
        s = np.where(al, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(np.float32)
    acc = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc_dtype)
    den = np.zeros(q.shape[:-1] + (1,), dtype=row_sum_dtype)
    for j0 in range(0, nk, block):
        p = np.exp(s[..., j0:j0 + block] - m)  # float32
        # P rounded to the kernel dtype for the product, as FlashAttention does
        part = p.astype(dt).astype(np.float32) @ v[..., j0:j0 + block, :].astype(np.float32)
        acc = (acc.astype(np.float32) + part).astype(acc_dtype)
        den = (den.astype(np.float32) + np.sum(p, axis=-1, keepdims=True)).astype(row_sum_dtype)
    den = den.astype(np.float32)
    return (acc.astype(np.float32) / np.where(den > 0, den, 1)).astype(dt)


def fp32_accumulating_kernel(q, k, v, *, mask=None, causal=False, scale=None, block=64):
    """A correct float16 kernel: key blocks of ``block``, running ``P V`` and row sum in
    float32, ``P`` rounded to float16 for the product (FlashAttention's recipe)."""
    return _blockwise(q, k, v, mask, causal, scale, block, np.float32)


def low_precision_accumulating_kernel(q, k, v, *, mask=None, causal=False, scale=None,
                                      block=16, sums=("pv", "row_sum")):
    """The mistake: as :func:`fp32_accumulating_kernel` but the running sums named in
    ``sums`` (``"pv"``: ``P V``; ``"row_sum"``: the softmax denominator) are accumulated
    in the kernel's own dtype, ``block`` keys at a time; the others in float32."""
    unknown = set(sums) - {"pv", "row_sum"}
    if unknown:
        raise ValueError(f"sums must name 'pv' and/or 'row_sum', got {sorted(unknown)}")
    return _blockwise(q, k, v, mask, causal, scale, block,
                      q.dtype if "pv" in sums else np.float32,
                      row_sum_in_dtype=q.dtype if "row_sum" in sums else np.float32)


# ------------------------------------------------ variant mutants: every registered variant
# For each variant three kernels that compute a slightly different function: the output
# times 1.01, a 1 % (or off-by-one) change of a feature map or parameter, and a variant
# parameter ignored. Each must fail the standard suite in float64 and float32: an
# oracle whose tolerance for a variant is the distance to another function passes them.


def variant_kernel(variant, change=None, *, factor=None):
    """The variant's reference as a NumPy kernel, with one ``change`` to its arguments.

    ``change(q, k, v, kw) -> (q, k, v, kw)`` edits the call (``kw`` is a copy of the
    keywords the oracle passed); it may return a fifth item, ``run(fn, q, k, v, kw) ->
    out``, that makes the call instead (to repack the inputs, or to replace one step of
    the algorithm). ``factor`` multiplies the output. The kernel has the reference's
    signature, so it receives the variant's parameters and options.
    """
    import inspect

    from attn_ref.registry import get

    fn = get(variant).fn

    def kernel(q, k, v, **kw):
        kw = dict(kw)
        run = None
        if change is not None:
            q, k, v, kw, *rest = change(q, k, v, kw)
            run = rest[0] if rest else None
        out = fn(q, k, v, **kw) if run is None else run(fn, q, k, v, kw)
        if factor is None:
            return out
        if isinstance(out, tuple):  # (output, final state): the output alone is scaled
            return ((out[0] * factor).astype(out[0].dtype),) + out[1:]
        return (out * factor).astype(out.dtype)

    kernel.__signature__ = inspect.signature(fn)
    kernel.__name__ = f"{variant}_mutant"
    return kernel


def _set(**values):
    """A change that sets keywords: ``value(current, q, k, v)`` for each name."""

    def change(q, k, v, kw):
        for name, val in values.items():
            kw[name] = val(kw.get(name), q, k, v)
        return q, k, v, kw

    return change


def _drop(*names):
    def change(q, k, v, kw):
        for name in names:
            kw.pop(name, None)
        return q, k, v, kw

    return change


def _scaled_logits(factor, default):
    """The logit scale times ``factor``; ``default(d)`` when the case gives none."""
    return _set(scale=lambda s, q, k, v: factor * (default(q.shape[-1]) if s is None else s))


def _elu_plus(c):
    def phi(x):
        return np.where(x > 0, x, np.expm1(np.minimum(x, 0))) + x.dtype.type(c)

    return lambda current, q, k, v: phi


def _times(factor):
    return lambda x, q, k, v: (x * factor).astype(x.dtype)


def _plus(n):
    return lambda x, q, k, v: x + n


def _shared_values(q, k, v, kw):
    kw["v_weight"] = kw.get("k_weight")
    return q, k, v, kw


# The recurrent family (issue 18): the mistakes of chunked linear-attention kernels.


def _gate_after_update(q, k, v, kw):
    """The decay applied after the write, ``S_t = diag(alpha_t) (S_{t-1} + k_t^T v_t)``:
    the current token decays too, which is the correct recurrence with ``alpha_t k_t``."""
    if "gamma" in kw:
        gamma = kw["gamma"]
        a = np.asarray(gamma, dtype=k.dtype)[..., None, None]
    else:
        g = np.asarray(kw["g"])
        a = np.exp(g) if g.shape == k.shape else np.exp(g)[..., None]
    return q, (k * a).astype(k.dtype), v, kw


_STEP_INPUTS = ("g", "beta")


def _steps_cut(kw, lo, hi):
    """``kw`` with the per-step inputs (gates, ``beta``: ``(B, H, T, ...)``) cut to ``lo:hi``."""
    out = dict(kw)
    for name in _STEP_INPUTS:
        x = out.get(name)
        if x is not None and getattr(x, "ndim", 0) >= 3:
            out[name] = x[:, :, lo:hi]
    return out


def _sequences(q, kw):
    """``(ranges, initial states)`` of a call: its packed sequences (``cu_seqlens``) with
    one initial state each, or the whole length with the whole initial state."""
    cu, s0 = kw.get("cu_seqlens"), kw.get("initial_state")
    if cu is None:
        return [(0, q.shape[-2])], [s0]
    cu = [int(x) for x in cu]
    return list(zip(cu, cu[1:])), [None if s0 is None else s0[i:i + 1] for i in range(len(cu) - 1)]


def _state_on(fn, q, k, v, kw, lo, hi, s0):
    """The reference's state after tokens ``lo:hi`` from ``s0`` (``s0``, or zeros, if empty)."""
    if hi <= lo:
        return np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]), q.dtype) if s0 is None else s0
    rest = {n: x for n, x in _steps_cut(kw, lo, hi).items()
            if n not in ("cu_seqlens", "initial_state", "output_final_state")}
    sl = (..., slice(lo, hi), slice(None))
    return fn(q[sl], k[sl], v[sl], initial_state=s0, output_final_state=True, **rest)[1]


def _state_not_carried(chunk):
    """The state reset to zero at every chunk of ``chunk`` steps of each sequence (the
    sequence's initial state enters its first chunk only)."""

    def change(q, k, v, kw):
        def run(fn, q, k, v, kw):
            rest = {n: x for n, x in kw.items()
                    if n not in ("cu_seqlens", "initial_state", "output_final_state")}
            outs, finals = [], []
            for (a, b), s0 in zip(*_sequences(q, kw)):
                s = s0
                for c0 in range(a, b, chunk):
                    c1 = min(c0 + chunk, b)
                    sl = (..., slice(c0, c1), slice(None))
                    o, s = fn(q[sl], k[sl], v[sl], initial_state=s if c0 == a else None,
                              output_final_state=True, **_steps_cut(rest, c0, c1))
                    outs.append(o)
                finals.append(s)
            o = np.concatenate(outs, axis=-2)
            return (o, np.concatenate(finals, axis=0)) if kw.get("output_final_state") else o

        return q, k, v, kw, run

    return change


def _not_reset_at_boundaries(q, k, v, kw):
    """Packed sequences run as one: the state (and its decay) flows from each sequence into
    the next instead of restarting from that sequence's initial state at ``cu_seqlens``."""

    def run(fn, q, k, v, kw):
        ranges, rows = _sequences(q, kw)
        if kw.get("cu_seqlens") is None:
            return fn(q, k, v, **kw)
        rest = {n: x for n, x in kw.items() if n not in ("cu_seqlens", "initial_state")}
        ret = fn(q, k, v, initial_state=rows[0], **rest)
        if not kw.get("output_final_state"):
            return ret
        finals = [_state_on(fn, q, k, v, kw, 0, hi, rows[0]) for _, hi in ranges]
        return ret[0], np.concatenate(finals, axis=0)

    return q, k, v, kw, run


def _final_state_change(make):
    """A kernel whose output is right and whose final state is ``make(fn, q, k, v, kw,
    ranges, rows, state)`` instead of ``state``."""

    def change(q, k, v, kw):
        def run(fn, q, k, v, kw):
            ret = fn(q, k, v, **kw)
            if not kw.get("output_final_state"):
                return ret
            ranges, rows = _sequences(q, kw)
            return ret[0], make(fn, q, k, v, kw, ranges, rows, ret[1])

        return q, k, v, kw, run

    return change


def _transposed_state(fn, q, k, v, kw, ranges, rows, state):
    return np.ascontiguousarray(np.swapaxes(state, -1, -2))


def _state_before_last_token(fn, q, k, v, kw, ranges, rows, state):
    return np.concatenate([_state_on(fn, q, k, v, kw, lo, hi - 1, s0)
                           for (lo, hi), s0 in zip(ranges, rows)], axis=0)


def _state_without_initial(fn, q, k, v, kw, ranges, rows, state):
    return np.concatenate([_state_on(fn, q, k, v, kw, lo, hi, None) for lo, hi in ranges], axis=0)


#: Mistakes in the final state alone (the output is right): ``(name, change, words the
#: final_state row's diagnosis must contain)``. Each must fail the final_state row of the
#: standard suite in float32 and float64, the output rows passing.
FINAL_STATE_CHANGES = (
    ("final state transposed (d_v x d_k)", _final_state_change(_transposed_state), "transposed"),
    ("final state before the last token's update", _final_state_change(_state_before_last_token),
     "before the last token"),
    ("final state from an ignored initial state", _final_state_change(_state_without_initial),
     "initial state ignored"),
)


def final_state_mutants(variant: str) -> list:
    """The :data:`FINAL_STATE_CHANGES` of a recurrent variant, as :class:`Mutant` objects."""
    return [Mutant(f"{variant}: {name}", variant_kernel(variant, change), words, variant=variant)
            for name, change, words in FINAL_STATE_CHANGES]


def _delta_without_wy(q, k, v, kw):
    """The delta rule's chunk form with the WY correction dropped: the values written in a
    chunk are ``U = T_c V`` instead of ``U - W S``, as if each chunk started from ``S = 0``
    when it corrects, while the queries still read the carried state
    (:func:`conformance.extras.delta_rule_without_wy`)."""
    from .extras import delta_rule_without_wy

    def one(q, k, v, beta, g, S, kw):
        scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        return delta_rule_without_wy(q, k, v, beta, g, S, chunk=kw.get("chunk_size", 64),
                                     scale=scale)

    def run(fn, q, k, v, kw):
        out_dtype = q.dtype
        q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        beta = np.broadcast_to(np.asarray(kw["beta"], dtype=np.float64), q.shape[:-1])
        g = kw.get("g")
        g = np.zeros(q.shape[:-1]) if g is None else np.broadcast_to(
            np.asarray(g, dtype=np.float64), q.shape[:-1])
        if kw.get("qk_l2norm"):
            q, k = (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6) for x in (q, k))
        outs, finals = [], []
        for (lo, hi), s0 in zip(*_sequences(q, kw)):
            S = np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1])) if s0 is None else \
                np.asarray(s0, dtype=np.float64)
            o, S = one(q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], beta[..., lo:hi],
                       g[..., lo:hi], S, kw)
            outs.append(o)
            finals.append(S)
        out = np.concatenate(outs, axis=-2).astype(out_dtype)
        if kw.get("output_final_state"):
            return out, np.concatenate(finals, axis=0).astype(np.float32 if out_dtype in (
                np.float16, np.float32) else out_dtype)
        return out

    return q, k, v, kw, run


def _gates_clipped(lo):
    """The log gates clipped at ``lo``: a decay below ``e^lo`` raised to it."""
    return _set(g=lambda g, q, k, v: np.maximum(g, g.dtype.type(lo)))


def _gates_flushed(small):
    """Decays ``exp(g)`` below ``small`` flushed to 0, in a kernel that multiplies the
    state by each step's decay (the reference's recurrent form, with the log gate
    :data:`conformance.extras.FLUSHED_GATE`, whose exp() is 0): in running sums of log
    gates that stand-in would cost float32 digits the flush itself does not."""
    from .extras import FLUSHED_GATE

    def change(q, k, v, kw):
        g = kw["g"]
        kw["g"] = np.where(np.exp(np.asarray(g, dtype=np.float64)) < small,
                           g.dtype.type(FLUSHED_GATE), g)
        kw["form"] = "recurrent"
        return q, k, v, kw

    return change


def _decay_as_ratio(chunk):
    """GLA / SSD in chunks of ``chunk`` whose in-chunk decay ``exp(b_i - b_j)`` is formed as
    ``exp(b_i) / exp(b_j)`` from the running sums ``b`` of the log gates over the chunk: the
    same function in exact arithmetic, ``0 / 0`` once ``exp(b)`` underflows. The state's
    hand-over between chunks is formed correctly, so only the output is wrong."""

    def change(q, k, v, kw):
        def run(fn, q, k, v, kw):
            dt = q.dtype
            scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
            g = np.asarray(kw["g"], dtype=dt)
            g = np.broadcast_to(g if g.ndim == q.ndim else g[..., None], k.shape)
            mt = functools.partial(np.swapaxes, axis1=-1, axis2=-2)
            outs, finals = [], []
            with np.errstate(all="ignore"):
                for (lo, hi), s0 in zip(*_sequences(q, kw)):
                    S = (np.zeros(q.shape[:-2] + (k.shape[-1], v.shape[-1]), dt) if s0 is None
                         else np.asarray(s0, dtype=dt))
                    for c0 in range(lo, hi, chunk):
                        sl = (..., slice(c0, min(c0 + chunk, hi)), slice(None))
                        qc, kc, vc = q[sl], k[sl], v[sl]
                        b = np.cumsum(g[sl], axis=-2)
                        e = np.exp(b)
                        n = qc.shape[-2]
                        scores = np.where(np.tril(np.ones((n, n), bool)), (qc * e) @ mt(kc / e), 0)
                        outs.append((scale * ((qc * e) @ S + scores @ vc)).astype(dt))
                        last = b[..., -1:, :]
                        S = S * mt(np.exp(last)) + mt(kc * np.exp(last - b)) @ vc
                    finals.append(S)
            out = np.concatenate(outs, axis=-2)
            if not kw.get("output_final_state"):
                return out
            return out, np.concatenate(finals, axis=0).astype(
                np.float32 if dt in (np.float16, np.float32) else dt)

        return q, k, v, kw, run

    return change


#: Mistakes in the log gates (the variants that take them): ``(words, change, variants)``.
#: Each computes the reference's function on fla's draws (log gates above about -4.5) and
#: fails the strong-gate cases (:func:`conformance.catalogue.case_gates`).
GATE_CHANGES = (
    ("log gates clipped at -5", _gates_clipped(-5.0), ("gla", "ssd", "gated_deltanet")),
    ("decays exp(g) below 1e-4 flushed to 0", _gates_flushed(1e-4),
     ("gla", "ssd", "gated_deltanet")),
    ("decay as exp(b_i) / exp(b_j) in chunks of 64", _decay_as_ratio(64), ("gla", "ssd")),
)


def _linformer_shared(q, k, v, kw):
    kw["f_proj"] = kw.get("e_proj")
    return q, k, v, kw


def _softmax_scale(d):
    return 1.0 / math.sqrt(d)


def _nq(name):
    """``name`` set to the number of queries (one segment / landmark / cluster each)."""
    return _set(**{name: lambda x, q, k, v: q.shape[-2]})


def reformer_mutant_kernel(*, look_back=True, dedup=True, average=False):
    """Reformer LSH attention by dense per-round masks, with one of its classic mistakes:
    no look-back chunk, pairs found twice counted twice, or the rounds averaged instead
    of weighted by their log-sum-exp. Buckets and chunks are attn_ref's (the mistake is
    in what is done with them)."""

    def kernel(q, k, v, *, rotations, chunk_size, causal=False, self_logit=-5e4, scale=None, xp=None):
        from attn_ref.hashing import lsh_buckets, lsh_chunks

        dt = q.dtype
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]).astype(np.float64) for x in (q, k, v))
        n = q.shape[-2]
        scale = (1 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0) if scale is None else scale
        _, chunk = lsh_chunks(lsh_buckets(k, np.asarray(rotations, dtype=np.float64)), chunk_size)
        n_chunks = -(-n // chunk_size)
        ci, cj = chunk[..., :, :, None], chunk[..., :, None, :]  # (..., H, N, N)
        mult = (cj == ci).astype(np.float64)  # slots of key j in query i's round window
        if look_back:
            mult = mult + (cj == (ci - 1) % n_chunks)
        found = mult.sum(axis=-3, keepdims=True)
        s = np.einsum("...id,...jd->...ij", q, k)[..., None, :, :] * scale
        if self_logit is not None:
            s = np.where(np.eye(n, dtype=bool), self_logit, s)
        if causal:
            mult = mult * np.tril(np.ones((n, n)))
        with np.errstate(divide="ignore"):
            s = s + np.log(mult) - (np.log(np.where(found > 0, found, 1.0)) if dedup else 0.0)
        m = np.max(s, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m)
        den = e.sum(-1, keepdims=True)
        out = (e @ v[..., None, :, :]) / np.where(den > 0, den, 1.0)  # (..., H, N, dv)
        with np.errstate(divide="ignore"):
            lse = m + np.log(den)
        w = np.exp(lse - np.max(lse, axis=-3, keepdims=True))  # as exact as the reference's
        w = np.full(lse.shape, 1.0 / lse.shape[-3]) if average else w / w.sum(axis=-3, keepdims=True)
        return np.sum(out * w, axis=-3).astype(dt)

    return kernel


def _sinkhorn_unmasked_sort(q, k, v, *, sort_logits, block_size, n_iters=8, temperature=0.75, causal=False,
                            scale=None, xp=None):
    """Causal Sinkhorn attention whose sort matrix is not masked to earlier blocks (the
    local block still is): a future block leaks into the past through the sort."""
    from attn_ref.sorting import block_sorted_attention, sinkhorn_sort_matrix

    p = sinkhorn_sort_matrix(sort_logits, n_iters=n_iters, temperature=temperature)
    return block_sorted_attention(q, k, v, p, block_size=block_size, causal=bool(causal), scale=scale)


def _sinkhorn_unbalanced(q, k, v, *, sort_logits, block_size, n_iters=8, temperature=0.75, causal=False,
                         scale=None, xp=None):
    """Sinkhorn attention with no balancing step: ``P = exp(R / temperature)``, rows not
    normalised."""
    from attn_ref.sorting import sinkhorn_attention

    return sinkhorn_attention(q, k, v, sort_logits=sort_logits, block_size=block_size, n_iters=0,
                              temperature=temperature, causal=causal, scale=scale)




#: variant -> ((words, change) for the 1 % perturbation, (words, change) for the
#: ignored parameter); the output-times-1.01 mutant is built for every variant
VARIANT_CHANGES: dict[str, tuple] = {
    "softmax": (("logit scale x 1.01", _scaled_logits(1.01, _softmax_scale)),
                ("scale argument ignored", _drop("scale"))),
    "online_softmax": (("logit scale x 1.01", _scaled_logits(1.01, _softmax_scale)),
                       ("scale argument ignored", _drop("scale"))),
    "compressed": (("key compression weights x 1.01", _set(k_weight=_times(1.01))),
                   ("v_weight ignored (k_weight compresses the values too)", _shared_values)),
    "linear": (("feature map elu+1.01 instead of elu+1", _set(feature_map=_elu_plus(1.01))),
               ("causal argument ignored", _drop("causal"))),
    "retention": (("decay applied after the update", _gate_after_update),
                  ("state not carried across chunks of 16", _state_not_carried(16))),
    "gla": (("gate applied after the update", _gate_after_update),
            ("state not carried across chunks of 16", _state_not_carried(16))),
    "ssd": (("decay applied after the update", _gate_after_update),
            ("state not carried across chunks of 16", _state_not_carried(16))),
    "deltanet": (("WY correction dropped (U instead of U - W S)", _delta_without_wy),
                 ("state not carried across chunks of 16", _state_not_carried(16))),
    "gated_deltanet": (("WY correction dropped (U instead of U - W S)", _delta_without_wy),
                       ("state not carried across chunks of 16", _state_not_carried(16))),
    "linformer": (("key projection E x 1.01", _set(e_proj=_times(1.01))),
                  ("f_proj ignored (E projects the values too)", _linformer_shared)),
    "performer": (("random projection x 1.01", _set(projection=_times(1.01))),
                  ("scale argument ignored", _drop("scale"))),
    "pooled": (("one segment too many", _set(num_segments=_plus(1))),
               ("num_segments ignored (no pooling)", _nq("num_segments"))),
    "query_reduced": (("one segment too many", _set(num_segments=_plus(1))),
                      ("num_segments ignored (no pooling)", _nq("num_segments"))),
    "nystrom": (("one landmark too few", _set(num_landmarks=_plus(-1))),
                ("pinv_iterations ignored (one iteration)", _set(pinv_iterations=lambda *a: 1))),
    "clustered": (("one cluster too few", _set(num_clusters=_plus(-1))),
                  ("num_clusters ignored (one cluster per query)", _nq("num_clusters"))),
    "clustered_topk": (("top-k one key short", _set(topk=_plus(-1))),
                       ("topk ignored (no top-k correction)", _set(topk=lambda *a: None))),
    "block_sparse": (("logit scale x 1.01", _scaled_logits(1.01, _softmax_scale)),
                     ("layout ignored (every block attends)",
                      _set(layout=lambda x, q, k, v: tuple(tuple(True for _ in r) for r in x)))),
    "local": (("window one key wider", _set(window=_plus(1))),
              ("scale argument ignored", _drop("scale"))),
    "longformer": (("window one key wider", _set(window=_plus(1))),
                   ("global_tokens ignored", _set(global_tokens=lambda *a: ()))),
    "bigbird": (("window one block wider", _set(window=_plus(1))),
                ("random_blocks ignored", _set(random_blocks=lambda *a: 0))),
    "strided": (("stride one longer", _set(stride=_plus(1))),
                ("scale argument ignored", _drop("scale"))),
    "fixed": (("summary one key longer", _set(summary=_plus(1))),
              ("scale argument ignored", _drop("scale"))),
    # routing: four centroids in the registry's parameters; dropping one makes every
    # cluster ceil(N / 3) tokens wide and moves the tokens of the dropped one
    "routing": (("one centroid dropped", _set(centroids=lambda x, q, k, v: x[..., :-1, :])),
                ("causal argument ignored (no mask inside a cluster)", _drop("causal"))),
    "synthesizer_dense": (("first layer W1 x 1.01", _set(w1=_times(1.01))),
                          ("causal argument ignored", _drop("causal"))),
    "synthesizer_random": (("random logits R x 1.01", _set(r=_times(1.01))),
                           ("causal argument ignored", _drop("causal"))),
    # registered with alpha = 1/4: the swap gives 3/4 to R (at 1/2 it would change nothing)
    "synthesizer_random_mix": (("dot-product scale x 1.01", _scaled_logits(1.01, _softmax_scale)),
                               ("mixing weight swapped (1 - alpha on R)",
                                _set(alpha=lambda a, q, k, v: 1.0 - a))),
    "reformer": (("chunks one position longer", _set(chunk_size=_plus(1))),
                 ("self_logit ignored (a token attends to itself)", _set(self_logit=lambda *a: None))),
    "sinkhorn": (("sort logits x 1.01", _set(sort_logits=_times(1.01))),
                 ("temperature ignored (1)", _set(temperature=lambda *a: 1.0))),
}


# ---------------------------------------------------- routing: mistakes inside the routing


def routing_kernel(mistake=None):
    """Routing attention on NumPy, by its defining form (the masked softmax each cluster
    implies), correct with ``mistake=None`` and otherwise with one mistake in the routing:

    * ``"second nearest"`` (plain routing): each query goes to its second-nearest centroid;
    * ``"unnormalised"``: tokens ranked by ``mu . x`` instead of ``mu . x / |x|``;
    * ``"skips nearest"`` (balanced): each centroid's top-w starts one token late.
    """

    def kernel(q, k, v, *, centroids, cluster_size=None, balanced=True, causal=False, scale=None):
        import array_api_compat.numpy as xp

        from attn_ref.routing import prepare_routing, unit_rows
        from attn_ref.softmax import attention_weights

        _, batch, align, scale, wq, wk = prepare_routing(q, k, v, centroids, cluster_size, balanced,
                                                         causal, scale, xp)
        unit = (lambda x: x) if mistake == "unnormalised" else (lambda x: unit_rows(xp, x))
        sq, sk = (np.broadcast_to(centroids @ np.swapaxes(unit(x), -1, -2),
                                  batch + (centroids.shape[-2], x.shape[-2])) for x in (q, k))
        causal = align or False
        if not balanced:
            # nearest: the least |mu|^2 - 2 mu . x_hat (the oracle draws centroids of
            # unequal lengths here, on which the largest mu . x_hat is another centroid)
            sq2 = np.sum(centroids * centroids, axis=-1)[..., :, None]
            dq, dk = sq2 - 2 * sq, sq2 - 2 * sk
            place = 1 if mistake == "second nearest" and sq.shape[-2] > 1 else 0
            cq = np.argsort(dq, axis=-2, kind="stable")[..., place, :]
            ck = np.argmin(dk, axis=-2)
            mask = cq[..., :, None] == ck[..., None, :]
            return np.asarray(attention_weights(q, k, mask=mask, causal=causal, scale=scale,
                                                xp=xp) @ v, dtype=q.dtype)
        skip = 1 if mistake == "skips nearest" else 0

        def chosen(s, w):
            rank = np.argsort(np.argsort(-s, axis=-1, kind="stable"), axis=-1, kind="stable")
            return (rank >= skip) & (rank < w + skip)

        inq, ink = chosen(sq, wq), chosen(sk, wk)
        mask = inq[..., :, None] & ink[..., None, :]
        qc = np.broadcast_to(q[..., None, :, :], batch + (centroids.shape[-2],) + q.shape[-2:])
        p = attention_weights(qc, k[..., None, :, :], mask=mask, causal=causal, scale=scale, xp=xp)
        count = np.maximum(inq.sum(-2), 1)[..., None].astype(q.dtype)
        return np.asarray((np.sum(p, axis=-3) / count) @ v, dtype=q.dtype)

    kernel.__name__ = f"routing_{(mistake or 'correct').replace(' ', '_')}"
    return kernel


def synthesizer_kernel(mistake, dense):
    """A Synthesizer on NumPy (dense or random), correct with ``mistake=None``, otherwise
    with one mistake: ``"no relu"`` (the dense MLP is linear) or ``"query axis"`` (the
    softmax normalises each key's column)."""

    def logits_of(q, w1, b1, w2, b2):
        hidden = q @ w1 + b1
        return (hidden if mistake == "no relu" else np.maximum(hidden, 0)) @ w2 + b2

    def finish(q, k, v, b, alpha, causal, scale):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        s = alpha * b + (1 - alpha) * scale * (q @ np.swapaxes(k, -1, -2))
        al = _allowed(q.shape[-2], k.shape[-2], causal, None)
        if al is not None:
            s = np.where(al, s, -np.inf)
        axis = -2 if mistake == "query axis" else -1
        m = np.max(s, axis=axis, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(m), m, 0))
        den = np.sum(e, axis=axis, keepdims=True)
        return ((e / np.where(den > 0, den, 1)) @ v).astype(q.dtype)

    if dense:
        def kernel(q, k, v, *, w1, b1, w2, b2, alpha=1.0, causal=False, scale=None):
            return finish(q, k, v, logits_of(q, w1, b1, w2, b2), alpha, causal, scale)
    else:
        def kernel(q, k, v, *, r, r2=None, alpha=1.0, causal=False, scale=None):
            return finish(q, k, v, r if r2 is None else r @ np.swapaxes(r2, -1, -2), alpha, causal,
                          scale)

    kernel.__name__ = f"synthesizer_{(mistake or 'correct').replace(' ', '_')}"
    return kernel


#: variant -> ((words, kernel, reference options), ...): mutants beyond the three of
#: :data:`VARIANT_CHANGES`, for mistakes no change of the reference's arguments makes;
#: the options select the function they claim (``{"balanced": False}``: plain routing)
VARIANT_KERNELS: dict[str, tuple] = {
    "routing": (("each query routed to its second-nearest centroid (plain routing)",
                 routing_kernel("second nearest"), {"balanced": False}),
                ("routing by mu . x, not mu . x / |x|", routing_kernel("unnormalised"), {}),
                ("each centroid skips its nearest token", routing_kernel("skips nearest"), {})),
    "synthesizer_dense": (("relu missing in the dense MLP", synthesizer_kernel("no relu", True), {}),
                          ("softmax over the query axis", synthesizer_kernel("query axis", True), {})),
    "synthesizer_random": (("softmax over the query axis", synthesizer_kernel("query axis", False),
                            {}),),
    "reformer": (("look-back chunk missing", reformer_mutant_kernel(look_back=False), {}),
                 ("pairs found in several rounds not de-duplicated", reformer_mutant_kernel(dedup=False),
                  {}),
                 ("rounds averaged, not weighted by their log-sum-exp",
                  reformer_mutant_kernel(average=True), {})),
    "sinkhorn": (("Sinkhorn rows not normalised (0 iterations)", _sinkhorn_unbalanced, {}),
                 ("causal mask on the sort matrix missing", _sinkhorn_unmasked_sort, {})),
    # the delta rule's write strength 1 % off: an error of the size of bfloat16 rounding
    # on the longer cases, which the diagnosis must not call precision
    "deltanet": (("beta x 1.01", variant_kernel("deltanet", _set(beta=_times(1.01))), {}),),
    "gated_deltanet": (("beta x 1.01", variant_kernel("gated_deltanet", _set(beta=_times(1.01))),
                        {}),),
}

#: The recurrent family's mistakes beyond :data:`VARIANT_CHANGES` (issue 18), changes of
#: the reference's call as there: the state carried from one packed sequence into the
#: next, and the initial state dropped (output and final state from ``S_0 = 0``).
RECURRENT_CHANGES = (
    ("decay not reset at a sequence boundary in varlen (state carried into the next packed "
     "sequence)", _not_reset_at_boundaries),
    ("initial state ignored", _drop("initial_state")),
)
#: The recurrent family, as the oracle lists it (:data:`conformance.extras.RECURRENT`).
RECURRENT_VARIANTS = RECURRENT


#: The words of the right diagnosis of a variant mutant (by the words of its mistake; the
#: alternatives separated by " | "); a mistake not listed has no signature, and its right
#: diagnosis is "no known mistake explains it". A factor on every q . k (a key projection,
#: the key compression) gives the output of a logit scale off by it, on every case.
MUTANT_CAUSES = {
    "output x 1.01": "the output is 1 % too large",
    "window one block wider": "the window one block wider than declared",
    "logit scale x 1.01": "the logit scale is 1 % too large",
    "dot-product scale x 1.01": "the logit scale is 1 % too large",
    "key compression weights x 1.01": "the logit scale is 1 % too large",
    "key projection E x 1.01": "the logit scale is 1 % too large",
    "scale argument ignored": "the scale argument is ignored",
    "causal argument ignored": "the causal mask is ignored",
    "causal argument ignored (no mask inside a cluster)": "the causal mask is ignored",
    "decay applied after the update": "applied after the update",
    "gate applied after the update": "applied after the update",
    "state not carried across chunks of 16": "not carried across chunks of 16",
    "WY correction dropped (U instead of U - W S)": "the WY correction dropped",
    "softmax over the query axis": "over the query axis",
    "beta x 1.01": "beta is 1 % too large",
    # named by the LSHSelfAttention convention's signature (HuggingFace, reformer-pytorch)
    "pairs found in several rounds not de-duplicated": "counted as often as found",
    RECURRENT_CHANGES[0][0]: "not reset at the packed sequences' boundaries",
    "initial state ignored": "the initial state is ignored | the initial state ignored",
    "log gates clipped at -5": "clipped at -5",
    "decays exp(g) below 1e-4 flushed to 0": "below 0.0001 are flushed to 0",
    "decay as exp(b_i) / exp(b_j) in chunks of 64": "exp(G_i) / exp(G_j)",
}


def variant_mutants(variant: str) -> list[Mutant]:
    """The three mutants of a registered variant, and those of :data:`VARIANT_KERNELS`
    (and :data:`RECURRENT_CHANGES` for the recurrent family), each expecting the words
    of :data:`MUTANT_CAUSES` (or none); KeyError if it has none declared."""
    if variant not in VARIANT_CHANGES:
        raise KeyError(f"variant {variant!r} has no mutants: add its 1 % perturbation and "
                       f"its ignored parameter to conformance.mutants.VARIANT_CHANGES")
    (pert, pchange), (ign, ichange) = VARIANT_CHANGES[variant]

    def mutant(words, kernel, options=None):
        return Mutant(f"{variant}: {words}", kernel, MUTANT_CAUSES.get(words, ""), options or {},
                      variant=variant)

    return [mutant("output x 1.01", variant_kernel(variant, factor=1.01)),
            mutant(pert, variant_kernel(variant, pchange)),
            mutant(ign, variant_kernel(variant, ichange))] + [
        mutant(words, kernel, {"options": opts} if opts else None)
        for words, kernel, opts in VARIANT_KERNELS.get(variant, ())] + [
        mutant(words, variant_kernel(variant, change))
        for words, change in (RECURRENT_CHANGES if variant in RECURRENT_VARIANTS else ())] + [
        mutant(words, variant_kernel(variant, change))
        for words, change, names in GATE_CHANGES if variant in names]


def first_failure(m: Mutant, dtype="float32", suite="standard", seed=0, least_values=0):
    """Run ``m`` case by case, cheapest first, up to its first value failure; only cases
    whose output has at least ``least_values`` values (``B H Nq dv``).

    Returns ``(result, cases_run)``; ``result`` is None when every case passed (or was
    not applicable, or the kernel raised: an error is no evidence the values are caught).
    """
    from .catalogue import cases
    from .oracle import verify

    ran = 0
    for case in sorted(cases(m.variant, suite), key=lambda c: (c.size, c.id)):
        if math.prod(case.batch) * case.nq * case.dv < least_values:
            continue
        rep = verify(m.kernel, m.variant, backend="numpy", dtypes=(dtype,), seed=seed,
                     cases=[case], causal="both", supports={"broadcast": True},
                     diagnose=False, progress=False, **m.options)
        ran += 1
        fails = [r for r in rep.results if r.verdict == "fail"]
        if fails:
            return fails[0], ran
    return None, ran


def catch_table(mutants, dtypes=("float32", "float64"), suite="standard", seed=0, out=sys.stdout):
    """One line per mutant and dtype: the first failing case (:func:`first_failure`), then
    that case re-run with diagnoses, every failing row's output and diagnosis printed.
    Returns ``[(mutant name, dtype, failing rows)]`` (an empty list of rows: missed)."""
    from .catalogue import cases
    from .oracle import verify

    table = []
    for m in mutants:
        for dt in dtypes:
            res, ran = first_failure(m, dt, suite, seed)
            rows = []
            if res is not None:
                case = [c for c in cases(m.variant, suite) if c.id == res.case]
                rep = verify(m.kernel, m.variant, backend="numpy", dtypes=(dt,), seed=seed,
                             cases=case, causal="both", supports={"broadcast": True},
                             progress=False, **m.options)
                rows = [r for r in rep.results if r.verdict == "fail"]
            table.append((m.name, dt, rows))
            said = "; ".join(f"{r.output}: {r.diagnosis}" for r in rows)
            print(f"{m.name:<60} {dt:<8} " + (f"caught on {res.case} -> {said}" if rows
                                               else f"MISSED ({ran} cases)"), file=out)
    return table


# ------------------------------------------- the diagnosis audit: never a wrong cause named


def precision_loss_kernel(variant, dtype):
    """The variant's reference computed in ``dtype`` (``"bfloat16"``, ``"float16"``,
    ``"float32"``) and cast back to the input dtype: a correct kernel whose only fault is
    its precision (the low dtypes round every intermediate, as
    :class:`conformance.tolerance.LowPrecisionArray` does)."""
    import inspect

    import array_api_compat.numpy as xnp

    from attn_ref.registry import get

    from .tolerance import as_dtype, param_dtype

    fn = get(variant).fn

    def kernel(q, k, v, **kw):
        out_dtype = q.dtype
        q, k, v = (as_dtype(np.asarray(x, dtype=np.float64), dtype) for x in (q, k, v))
        kw = {n: as_dtype(np.asarray(x, dtype=np.float64) if x.dtype.kind == "f" else x,
                          param_dtype(n, dtype)) if isinstance(x, np.ndarray) else x
              for n, x in kw.items()}
        with np.errstate(all="ignore"):
            out = fn(q, k, v, xp=xnp, **kw)
        back = lambda x: np.asarray(np.asarray(x).view(np.ndarray) if isinstance(x, np.ndarray)  # noqa: E731
                                    else x, dtype=np.float32).astype(out_dtype)
        return tuple(back(x) for x in out) if isinstance(out, tuple) else back(out)

    kernel.__signature__ = inspect.signature(fn)
    kernel.__name__ = f"{variant}_in_{dtype}"
    return kernel


def precision_mutants(variant: str) -> list[Mutant]:
    """The variant's reference run in bfloat16, float16 and float32 and cast back
    (:func:`precision_loss_kernel`); each expects its dtype named as the cause (a float32
    one fails only float64 cases)."""
    return [Mutant(f"{variant}: computed in {dt}", precision_loss_kernel(variant, dt),
                   f"PRECISION {dt}", variant=variant) for dt in ("bfloat16", "float16", "float32")]


#: How a diagnosis that names no cause begins: no explanation; a fault of the call; only
#: where the error lives or how it grows with N (measurements).
NO_CAUSE = ("no known mistake explains it", "kernel raised", "output shape",
            "the output is wrong only on", "the error lives only in", "the error grows with N")


def _precision_words(dtype):
    """What a diagnosis naming computation in ``dtype`` as the cause says."""
    return (f"a plain {dtype} implementation makes", f"the state computes in {dtype}",
            f"accumulating in {dtype}")


def classify_diagnosis(words: str, expect: str) -> str:
    """``"right"`` (the diagnosis contains ``expect``, or one of its alternatives
    separated by ``" | "``), ``"honest"`` (it names no cause - :data:`NO_CAUSE`, a final
    state no known mistake explains - or says it cannot tell a lower dtype's rounding
    from a mistake, :data:`conformance.tolerance.UNTOLD`) or ``"wrong"`` (it
    names a cause that is not the mutant's). ``expect`` ``"PRECISION dt"``: computing in
    ``dt`` (or low-precision accumulation) is the right cause."""
    if expect.startswith("PRECISION "):
        dt = expect.split()[1]
        right = _precision_words(dt) + ("as low-precision accumulation does",)
        if any(w in words for w in right):
            return "right"
    elif expect and any(e in words for e in expect.split(" | ")):
        return "right"
    if UNTOLD in words:
        return "honest"  # a lower dtype's rounding or a mistake: it says it cannot tell
    if words.startswith(NO_CAUSE) or (words.startswith("final state off by")
                                      and words.endswith("no known mistake of the final state "
                                                         "explains it")):
        return "honest"
    return "wrong"


#: The audit also diagnoses each mutant's first failing case with at least this many
#: output values: on a length-1 case's four, rounding cannot be told from a mistake.
AUDIT_VALUES = 256


def audit_diagnoses(mutants, dtypes=("float32", "float64"), suite="standard", seed=0,
                    out=sys.stdout):
    """Each mutant's diagnoses on its first failing case (:func:`first_failure`) and on
    its first with at least :data:`AUDIT_VALUES` output values, every failing row
    classified by :func:`classify_diagnosis`. Prints one line per row; returns
    ``[(mutant name, dtype, case, output, class, diagnosis)]`` (class ``"missed"`` when
    no case fails)."""
    from .catalogue import cases
    from .oracle import verify

    rows = []
    for m in mutants:
        for dt in dtypes:
            if m.expect == f"PRECISION {dt}":
                continue  # computed in the case's own dtype: a correct kernel
            res, _ = first_failure(m, dt, suite, seed)
            if res is None:
                new = [(m.name, dt, "-", "-", "missed", "")]
            else:
                failing = [res.case]
                big, _ = first_failure(m, dt, suite, seed, least_values=AUDIT_VALUES)
                if big is not None and big.case != res.case:
                    failing.append(big.case)
                rep = verify(m.kernel, m.variant, backend="numpy", dtypes=(dt,), seed=seed,
                             cases=[c for c in cases(m.variant, suite) if c.id in failing],
                             causal="both", supports={"broadcast": True}, progress=False,
                             **m.options)
                new = [(m.name, dt, r.case, r.output, classify_diagnosis(r.diagnosis, m.expect),
                        r.diagnosis) for r in rep.failures]
            for name, _, case_id, output, cls, words in new:
                print(f"{cls.upper():<7} {name:<60} {dt:<8} {case_id} {output}: {words}",
                      file=out, flush=True)
            rows += new
    return rows


def run_mutant(m: Mutant, suite="quick", seed=0):
    from .oracle import verify

    opts = {"causal": "both", "supports": {"broadcast": True}, **m.options}
    return verify(m.kernel, m.variant, backend="numpy", suite=suite, seed=seed, **opts)


def catch_rate(suite="quick", seed=0, out=sys.stdout):
    """Run every mutant; print one line each; return ``(caught, diagnosed, total)``."""
    caught = diagnosed = 0
    for m in MUTANTS:
        rep = run_mutant(m, suite, seed)
        fails = rep.failures
        hit = [r for r in fails if m.expect in r.diagnosis]
        caught += bool(fails)
        diagnosed += bool(hit)
        words = (hit or fails or [None])[0]
        print(f"{m.name:<34} {'caught' if fails else 'MISSED':<7} "
              f"{len(fails):>3} failing cases  diagnosis {'right' if hit else 'other'}: "
              f"{words.diagnosis if words else '-'}"[:220], file=out)
    n = len(MUTANTS)
    print(f"caught {caught}/{n}, diagnosed {diagnosed}/{n} ({suite} suite, seed {seed})", file=out)
    return caught, diagnosed, n


def main(argv=None):
    """``python -m conformance.mutants [SUITE] [SEEDS]``: catch rate over seeds 0..SEEDS-1;
    ``python -m conformance.mutants recurrent [VARIANT...]``: the recurrent family's catch
    table (:func:`catch_table`) on the standard suite, float32 and float64."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "audit":
        rows = audit_diagnoses([m for name in (argv[1:] or VARIANT_CHANGES)
                                for m in variant_mutants(name) + precision_mutants(name) + (
                                    final_state_mutants(name) if name in RECURRENT_VARIANTS
                                    else [])])
        counts = {c: sum(r[4] == c for r in rows) for c in ("right", "honest", "wrong", "missed")}
        print(", ".join(f"{n} {c}" for c, n in counts.items()) + f" of {len(rows)} rows")
        return 1 if counts["wrong"] else 0
    if argv and argv[0] == "recurrent":
        table = catch_table([m for name in (argv[1:] or RECURRENT_VARIANTS)
                             for m in variant_mutants(name) + final_state_mutants(name)])
        return 0 if all(rows for _, _, rows in table) else 1
    suite = argv[0] if argv else "quick"
    seeds = int(argv[1]) if len(argv) > 1 else 1
    if seeds < 1:
        raise SystemExit(f"SEEDS is how many seeds to run (0..SEEDS-1), at least 1; got {seeds}")
    totals = [0, 0, 0]
    for seed in range(seeds):
        for i, x in enumerate(catch_rate(suite, seed)):
            totals[i] += x
    c, d, n = totals
    print(f"overall: caught {c}/{n} ({100 * c / n:.0f}%), diagnosed {d}/{n} ({100 * d / n:.0f}%) "
          f"over {seeds} seed(s)")
    return 0 if c == n else 1


if __name__ == "__main__":
    sys.exit(main())
