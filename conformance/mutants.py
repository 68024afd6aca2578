"""Deliberately broken kernels: the oracle's own test.

Each :class:`Mutant` is a NumPy float32 kernel with one classic mistake, and the words
its diagnosis should contain. The oracle must fail every one of them; ``catch_rate``
runs the catalogue and reports how many were caught and how many were diagnosed right::

    python -m conformance.mutants               # quick suite, seed 0
    python -m conformance.mutants standard      # the standard suite
    python -m conformance.mutants quick 20      # seeds 0..19

Extension point: append to :data:`MUTANTS` (the gradient checks add broken backward
passes, the GQA/window/varlen features their mutants, each with its expected words).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

__all__ = ["Mutant", "MUTANTS", "STRUCTURAL", "correct_kernel", "catch_rate", "structural_cases"]


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
    Mutant("wrong output dtype", _wrong_dtype, "output dtype"),
    Mutant("in-place write into q", _inplace_q, "modified its input 'q'"),
    Mutant("NaN for fully masked rows", _mut(nan_rows=True), "no key to attend to"),
    Mutant("layout mixed up", _layout_mixed, "layout is mixed up"),
    Mutant("denominator epsilon 1e-3", _mut(eps=1e-3), "epsilon of 0.001"),
]



# ------------------------------------------ features of modern kernels (GQA, window, ...)


def _modern(mistake):
    """A NumPy kernel taking GQA, windows, soft-capping and lengths (attn_ref's reference
    run on NumPy) with one ``mistake``."""

    def kernel(q, k, v, *, mask=None, causal=False, scale=None, gqa=False, window=None,
               softcap=None, seqlens_q=None, seqlens_k=None):
        from attn_ref.softmax import softmax_attention, varlen_attention

        kw = dict(mask=mask, causal=causal, scale=scale, gqa=gqa, window=window, softcap=softcap,
                  seqlens_q=seqlens_q, seqlens_k=seqlens_k)
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


def _feature_cases(name):
    from .catalogue import CATALOGUE

    return [c for c in CATALOGUE["standard"] if name in c.needs and c.nk <= 256]


MUTANTS += [
    Mutant("window left extent off by one", _modern("window left"), "left extent is off by one",
           {"cases": _feature_cases("window")}),
    Mutant("window right extent off by one", _modern("window right"), "right extent is off by one",
           {"cases": _feature_cases("window")}),
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
            if not c.needs - {"mask", "bias", "causal", "scale", "broadcast", "value_dim"}
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
MUTANTS += [
    Mutant("scale 1 % too large", _scaled(1.01), "logit scale is 1 % too large"),
    Mutant("zero padding not masked", _unmasked_padding, "padded with zeros from Nk"),
    Mutant("maximum over the tile, not the row", _tile_max, "0/0 from underflow"),
]


def run_mutant(m: Mutant, suite="quick", seed=0):
    from .oracle import verify

    opts = {"causal": "both", "supports": {"broadcast": True}, **m.options}
    return verify(m.kernel, "softmax", backend="numpy", suite=suite, seed=seed, **opts)


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
    """``python -m conformance.mutants [SUITE] [SEEDS]``: catch rate over seeds 0..SEEDS-1."""
    argv = sys.argv[1:] if argv is None else argv
    suite = argv[0] if argv else "quick"
    seeds = int(argv[1]) if len(argv) > 1 else 1
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
