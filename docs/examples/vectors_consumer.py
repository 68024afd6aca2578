"""A consumer of attn-ref's exported test vectors that uses nothing of attn-ref.

This is the loop a C++/CUDA/Rust test runs, written with NumPy and ``json`` only so that
the docs build can execute it: read ``manifest.json``, load each case's arrays, run the
kernel with every option the manifest gives, and compare with the golden output under
the case's own bounds. ``my_kernel`` below is a plain softmax attention that accumulates
in float32 (float64 for float64 cases), as a CUDA kernel does; replace it with a call
into yours.

Run: ``python vectors_consumer.py VECTOR_DIR`` (exit status 1 if a case fails).
"""

import json
import math
import os
import sys

import numpy as np


def widen(x, dtype):
    """File array -> computable NumPy array (bfloat16 is stored as uint16 bit patterns)."""
    if dtype == "bfloat16" and x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


def round_bf16(x):
    """float32 -> nearest bfloat16 (ties to even), kept in float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def to_bhnd(x, layout):
    """The manifest's layout -> (B, H, N, d)."""
    if layout == "bnhd":
        return np.swapaxes(x, 1, 2)
    if layout == "nd":
        return x[None, None]
    return x


def my_kernel(q, k, v, *, mask, bias, causal, scale, gqa, window, chunk, softcap, alibi_slopes,
              dropout_p, dropout_mask, seqlens_q, seqlens_k, acc):
    """Softmax attention with FlashAttention's options, on (B, H, N, d) arrays, in ``acc``."""
    q, k, v = (x.astype(acc) for x in (q, k, v))
    b, h, nq, _ = q.shape
    nk = k.shape[-2]
    if gqa:  # query head i uses kv head i // (Hq / Hkv)
        g = h // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = (q @ np.swapaxes(k, -1, -2)) * acc(scale)
    if softcap:  # on the scaled logits, before bias and ALiBi
        s = acc(softcap) * np.tanh(s / acc(softcap))
    if bias is not None:
        s = s + bias.astype(acc)
    lq = np.asarray(seqlens_q if seqlens_q is not None else [nq] * b).reshape(b, 1, 1, 1)
    lk = np.asarray(seqlens_k if seqlens_k is not None else [nk] * b).reshape(b, 1, 1, 1)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    pos = i + lk - lq  # query i sits at key position i + Lk - Lq (bottom-right)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=acc).reshape(-1, h, 1, 1)
        s = s - slopes * np.abs(pos - j).astype(acc)
    ok = (i < lq) & (j < lk)
    if mask is not None:
        ok = ok & mask
    if causal == "top-left":
        ok = ok & (j <= i)
    elif causal == "bottom-right":
        ok = ok & (j <= pos)
    if window is not None:
        left, right = window
        if left >= 0:
            ok = ok & (j >= pos - left)
        if right >= 0:
            ok = ok & (j <= pos + right)
    if chunk is not None:  # Llama 4's chunks of absolute positions, from key 0
        ok = ok & (pos // chunk == j // chunk)
    s = np.where(ok, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    den = np.sum(p, axis=-1, keepdims=True)
    p = p / np.where(den > 0, den, 1)  # a row with no key gives zeros
    if dropout_mask is not None:
        p = p * dropout_mask / acc(1 - dropout_p)
    return p @ v


def run_case(entry, z, layout):
    dt = entry["dtype"]
    acc = np.float64 if dt == "float64" else np.float32
    opts = entry.get("options", {})
    arr = {n: widen(z[n], dt) for n in z.files}
    q, k, v = (to_bhnd(arr[n], layout) for n in ("q", "k", "v"))
    out = my_kernel(
        q, k, v, mask=arr.get("mask"), bias=arr.get("bias"), causal=entry["causal"],
        scale=entry["scale"], gqa=opts.get("gqa", False), window=opts.get("window"),
        chunk=opts.get("chunk"), softcap=opts.get("softcap"), alibi_slopes=arr.get("alibi_slopes"),
        dropout_p=opts.get("dropout_p", 0.0), dropout_mask=arr.get("dropout_mask"),
        seqlens_q=opts.get("seqlens_q"), seqlens_k=opts.get("seqlens_k"), acc=acc)
    # the kernel returns its output in the case dtype
    out = round_bf16(out) if dt == "bfloat16" else out.astype(dt)
    golden = to_bhnd(arr["golden"], layout)
    compare = to_bhnd(arr["compare"], layout)
    got = out.astype(np.float64)
    if not np.all(np.isfinite(got[compare])):
        return False, math.inf, math.inf
    err = np.abs(got - np.where(compare, golden, 0.0))[compare]
    max_err = float(err.max()) if err.size else 0.0
    rms = float(np.sqrt(np.mean(err * err))) if err.size else 0.0
    ok = max_err <= entry["tol_max_abs"] and rms <= entry["tol_rms"]
    return ok, max_err, rms


def main(directory):
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["format"] == "attn-ref-vectors" and manifest["variant"] == "softmax"
    failed = 0
    for entry in manifest["cases"]:
        with np.load(os.path.join(directory, entry["file"]), allow_pickle=False) as z:
            ok, max_err, rms = run_case(entry, z, manifest["layout"])
        if not ok:
            failed += 1
            print(f"FAIL {entry['id']} {entry['dtype']}: max {max_err:.3g} "
                  f"(bound {entry['tol_max_abs']:.3g}), rms {rms:.3g} (bound {entry['tol_rms']:.3g})")
    n = len(manifest["cases"])
    print(f"{n - failed} passed, {failed} failed")
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1]) else 0)
