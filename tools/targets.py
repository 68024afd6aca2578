"""The speed and memory figures the issues name, measured in one run on this machine.

    python tools/targets.py linear   [--ns 1024,4096,16384,65536] [--reps 5] [--fla PATH]
    python tools/targets.py backward [--n 4096] [--mem-n 16384] [--reps 3]

NumPy float32, 8 heads, d = 64, inputs from ``default_rng(0)``. Times are in-process
medians of wall-clock seconds; run with ``OPENBLAS_NUM_THREADS=1`` for single-thread
figures. The matmul rate that sets the floor is measured in the same run, with the
same threads. asv (``asv_benches/``) tracks the same costs across commits; this
script answers "does this commit meet the target here, now".

``linear``: non-causal time against the floor ``4 N H d^2 / matmul rate``, causal
(chunked) against non-causal, the fitted exponent of time in ``N``, peak extra memory
of causal at the largest N (tracemalloc; NumPy reports its buffers to it) against the
``N H d dv`` floats of a naive prefix sum, and with ``--fla naive.py`` (the file
``fla/ops/linear_attn/naive.py`` of flash-linear-attention) its
``naive_chunk_linear_attn`` on PyTorch CPU at N = 16384, interleaved with ours.

``backward``: the blockwise softmax backward on NumPy against PyTorch's CPU SDPA
backward, and the peak extra memory of the backward at ``--mem-n``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import tracemalloc

import numpy as np

H, D = 8, 64


def _median_time(f, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _inputs(n, count=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((H, n, D), dtype=np.float32) for _ in range(count)]


def matmul_rate(reps=7, size=2048):
    a = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    return 2 * size**3 / _median_time(lambda: a @ a, reps)


def _peak_extra(f):
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    f()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def linear(args):
    from attn_ref import linear_attention

    ns = [int(n) for n in args.ns.split(",")]
    rate = matmul_rate()
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"float32 matmul 2048^3: {rate / 1e9:.1f} GFLOP/s (median of 7), BLAS threads: {threads}")
    fla = None
    if args.fla:
        import torch

        spec = importlib.util.spec_from_file_location("fla_naive", args.fla)
        fla = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fla)
    non, cau = [], []
    for n in ns:
        q, k, v = _inputs(n)
        floor = 4 * n * H * D * D / rate
        t_non = _median_time(lambda q=q, k=k, v=v: linear_attention(q, k, v), args.reps)
        t_cau = _median_time(lambda q=q, k=k, v=v: linear_attention(q, k, v, causal=True), args.reps)
        non.append(t_non)
        cau.append(t_cau)
        line = (f"N={n:6d}  floor {floor * 1e3:7.1f} ms | non-causal {t_non * 1e3:8.1f} ms "
                f"({t_non / floor:5.2f}x floor) | causal {t_cau * 1e3:8.1f} ms "
                f"({t_cau / t_non:4.2f}x non-causal)")
        if fla is not None and n == 16384:
            # fla's layout is (batch, time, heads, d)
            bthd = [torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2))[None]) for x in (q, k, v)]
            with torch.no_grad():
                t_fla = _median_time(lambda bthd=bthd: fla.naive_chunk_linear_attn(*bthd), args.reps)
            line += f" | fla naive_chunk {t_fla * 1e3:8.1f} ms (causal/fla {t_cau / t_fla:4.2f})"
        print(line, flush=True)
    if len(ns) > 2:
        for name, t in (("non-causal", non), ("causal", cau)):
            e = np.polyfit(np.log(ns), np.log(t), 1)[0]
            print(f"fitted exponent of time in N ({name}, N = {ns[0]}..{ns[-1]}): {e:.3f}")
    n = ns[-1]
    q, k, v = _inputs(n)
    peak = _peak_extra(lambda: linear_attention(q, k, v, causal=True))
    print(f"peak extra memory, causal, N={n}: {peak / 2**20:.1f} MiB (output "
          f"{n * H * D * 4 / 2**20:.0f} MiB; naive prefix sum N H d dv floats: "
          f"{n * H * D * D * 4 / 2**20:.0f} MiB)")


def backward(args):
    import array_api_compat.numpy as xp
    import torch

    from attn_ref.grad import online_softmax_attention, online_softmax_forward

    q, k, v, do = _inputs(args.n, 4)
    out, lse = online_softmax_forward(q, k, v, xp=xp)
    t_np = _median_time(lambda: online_softmax_attention(q, k, v, do, out=out, lse=lse, xp=xp), args.reps)
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    tdo = torch.from_numpy(do)

    def sdpa_backward():
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
        t = time.perf_counter()
        o.backward(tdo)
        return time.perf_counter() - t

    t_sdpa = float(np.median([sdpa_backward() for _ in range(args.reps)]))
    print(f"N={args.n}: blockwise backward (NumPy) {t_np:.3f} s | torch SDPA backward (CPU, "
          f"{torch.get_num_threads()} threads) {t_sdpa:.3f} s | ratio {t_np / t_sdpa:.2f}")
    n = args.mem_n
    q, k, v, do = _inputs(n, 4)
    out, lse = online_softmax_forward(q, k, v, xp=xp)
    grads = 3 * n * H * D * 4
    peak = _peak_extra(lambda: online_softmax_attention(q, k, v, do, out=out, lse=lse, xp=xp))
    print(f"peak extra memory of the backward, N={n}: {peak / 2**20:.1f} MiB, of which the gradients "
          f"{grads / 2**20:.0f} MiB (one N x N float32 matrix: {H * n * n * 4 / 2**20:.0f} MiB)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    lin = sub.add_parser("linear", help="issue 3: linear attention against the floor, causal, fla")
    lin.add_argument("--ns", default="1024,4096,16384,65536")
    lin.add_argument("--reps", type=int, default=5)
    lin.add_argument("--fla", metavar="NAIVE_PY", help="path of fla/ops/linear_attn/naive.py")
    bwd = sub.add_parser("backward", help="issue 8: blockwise backward against torch SDPA")
    bwd.add_argument("--n", type=int, default=4096)
    bwd.add_argument("--mem-n", type=int, default=16384)
    bwd.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    {"linear": linear, "backward": backward}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
