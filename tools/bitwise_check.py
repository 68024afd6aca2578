"""Every registered variant's output (and VJP), saved or compared bit for bit on NumPy.

    PYTHONPATH=. python tools/bitwise_check.py save    /tmp/before.npz
    PYTHONPATH=. python tools/bitwise_check.py compare /tmp/before.npz

(``PYTHONPATH`` picks the checkout to test: the script's own folder, not the current
one, comes first on ``sys.path``.)

For a refactor that must not change behaviour: ``save`` on the commit before, ``compare``
on the commit after. Each variant runs on fixed seeded float64 inputs of a few sizes
(square, ``Nq < Nk`` and ``Nq > Nk`` where the variant allows it, a batch of two heads),
non-causal and, where supported, causal with both alignments; the VJP gets a seeded
cotangent. A few calls outside the registry's defaults exercise the option paths the
defaults miss (varlen packing, grouped-query heads, the quadratic and chunked linear
orders, sparse masks). A call that raises records its exception's type and message,
which must match too. ``compare`` exits 1 and lists every key that differs (missing,
extra, different shape, dtype or any bit).
"""

from __future__ import annotations

import sys

import numpy as np

import attn_ref
from attn_ref import registry

# (Nq, Nk) per shape; self-attention variants take only the square ones.
SIZES = [(16, 16), (33, 33), (12, 40), (40, 12)]
BATCH = (2, 3)
D, DV = 8, 5


def _vjp_of(variant):
    vjp = getattr(variant, "vjp", None)
    if vjp is not None:
        return vjp
    from attn_ref import grad

    return getattr(grad, "VJPS", {}).get(variant.name)


def _arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def _record(out, key, fn, *args, **kwargs):
    """Store ``fn(*args, **kwargs)`` under ``key``: an array, a dict of arrays, or the exception."""
    try:
        res = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - an error is behaviour too
        out[f"{key}!error"] = np.asarray(f"{type(e).__name__}: {e}")
        return
    if isinstance(res, dict):
        for name, val in sorted(res.items()):
            out[f"{key}.{name}"] = np.asarray(val)
    elif isinstance(res, tuple):
        for i, val in enumerate(res):
            out[f"{key}.{i}"] = np.asarray(val)
    else:
        out[key] = np.asarray(res)


def _causal_modes(variant, nq, nk):
    modes = [False]
    if variant.causal:
        modes.append(True)
        if nq != nk:
            modes.append("bottom-right")
    return modes


def _variant_results(out):
    for seed, variant in enumerate(registry.variants()):
        vjp = _vjp_of(variant)
        for nq, nk in SIZES:
            if variant.self_attention and nq != nk:
                continue
            q, k, v, do = _arrays(
                1000 + 10 * seed + nq, (*BATCH, nq, D), (*BATCH, nk, D), (*BATCH, nk, DV), (*BATCH, nq, DV)
            )
            extra = variant.extra(seed, nq, nk, D, DV, dtype=np.float64, device="cpu", xp=np)
            for causal in _causal_modes(variant, nq, nk):
                kw = dict(extra)
                if causal is not False:
                    kw["causal"] = causal
                key = f"{variant.name}/{nq}x{nk}/causal={causal}"
                _record(out, f"{key}/out", variant.fn, q, k, v, **kw)
                if variant.weights is not None:
                    _record(out, f"{key}/weights", variant.weights, q, k, **kw)
                if vjp is not None:
                    _record(out, f"{key}/vjp", vjp, q, k, v, do, **kw)


def _extra_results(out):
    from attn_ref import grad, sparse

    q, k, v, do = _arrays(7, (2, 4, 20, D), (2, 2, 28, D), (2, 2, 28, DV), (2, 4, 20, DV))
    slopes = np.asarray([0.5, 0.25, 0.1, 0.05])
    lens = dict(seqlens_q=np.asarray([20, 13]), seqlens_k=np.asarray([17, 28]))
    for causal in (False, True, "bottom-right"):
        gqa = dict(causal=causal, gqa=True, window=(5, 3), softcap=3.0, alibi_slopes=slopes)
        gqa_blocks = dict(gqa, block_q=6, block_k=7)
        kwl = dict(lens, causal=causal, gqa=True)
        for key, fn, args, kw in (
            ("softmax_gqa/{}/out", attn_ref.softmax_attention, (q, k, v), gqa),
            ("online_gqa/{}/out", attn_ref.online_softmax_attention, (q, k, v), gqa_blocks),
            ("softmax_gqa/{}/vjp", grad.softmax_attention, (q, k, v, do), gqa),
            ("online_gqa/{}/vjp", grad.online_softmax_attention, (q, k, v, do), gqa_blocks),
            ("softmax_lens/{}/out", attn_ref.softmax_attention, (q, k, v), kwl),
            (
                "online_lens/{}/out",
                attn_ref.online_softmax_attention,
                (q, k, v),
                dict(kwl, block_q=8, block_k=5),
            ),
            ("online_lens/{}/vjp", grad.online_softmax_attention, (q, k, v, do), kwl),
        ):
            _record(out, key.format(causal), fn, *args, **kw)

    # Packed variable-length sequences.
    qp, kp, vp, dop = _arrays(8, (30, 4, D), (37, 2, D), (37, 2, DV), (30, 4, DV))
    cq, ck = np.asarray([0, 7, 7, 30]), np.asarray([0, 12, 20, 37])
    for causal in (False, True):
        for online in (False, True):
            kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal, online=online, block_q=4, block_k=6)
            _record(out, f"varlen/{causal}/{online}/out", attn_ref.varlen_attention, qp, kp, vp, **kw)
            _record(out, f"varlen/{causal}/{online}/vjp", grad.varlen_attention, qp, kp, vp, dop, **kw)

    # Linear attention's orders and alignments.
    q, k, v, do = _arrays(9, (2, 19, D), (2, 26, D), (2, 26, DV), (2, 19, DV))
    for order in ("linear", "quadratic"):
        for causal in (False, True, "bottom-right"):
            kw = dict(order=order, causal=causal, chunk_size=5)
            _record(out, f"linear/{order}/{causal}/out", attn_ref.linear_attention, q, k, v, **kw)
            _record(out, f"linear/{order}/{causal}/vjp", grad.linear_attention, q, k, v, do, **kw)
    _record(out, "linear_state", attn_ref.linear_attention_state, k, v)

    # Sparse masks and local attention with a block size.
    for n in (13, 32):
        _record(out, f"local_mask/{n}", sparse.local_mask, n, window=2, dilation=2, xp=np)
        _record(out, f"strided_mask/{n}", sparse.strided_mask, n, stride=4, xp=np)
        _record(out, f"fixed_mask/{n}", sparse.fixed_mask, n, stride=4, summary=2, xp=np)
        _record(out, f"global_mask/{n}", sparse.global_mask, n, global_tokens=(0, 5), xp=np)
        _record(out, f"bigbird_mask/{n}", sparse.bigbird_mask, n, block_size=4, xp=np)
        q, k, v, do = _arrays(10 + n, (2, n, D), (2, n, D), (2, n, DV), (2, n, DV))
        for causal in (False, True):
            kw = dict(window=3, block_size=4, dilation=1, causal=causal)
            _record(out, f"local_block/{n}/{causal}/out", attn_ref.local_attention, q, k, v, **kw)
            _record(out, f"local_block/{n}/{causal}/vjp", grad.local_attention, q, k, v, do, **kw)


def compute():
    out = {}
    _variant_results(out)
    _extra_results(out)
    return out


def _same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def main(argv):
    if len(argv) != 2 or argv[0] not in ("save", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    res = compute()
    print(f"attn_ref from {attn_ref.__file__}")
    if argv[0] == "save":
        np.savez(argv[1], **res)
        print(f"saved {len(res)} arrays to {argv[1]}")
        return 0
    with np.load(argv[1]) as f:
        ref = {name: f[name] for name in f.files}
    bad = [f"missing: {n}" for n in sorted(set(ref) - set(res))]
    bad += [f"extra: {n}" for n in sorted(set(res) - set(ref))]
    bad += [f"differs: {n}" for n in sorted(set(ref) & set(res)) if not _same(ref[n], res[n])]
    errors = sum(n.endswith("!error") for n in res)
    if bad:
        print("\n".join(bad))
        print(f"{len(bad)} of {len(ref)} arrays differ")
        return 1
    print(f"all {len(ref)} arrays bitwise identical ({errors} of them recorded errors)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
