"""The speed and memory figures the issues name, measured in one run on this machine.

    python tools/targets.py linear   [--ns 1024,4096,16384,65536] [--reps 5] [--fla PATH] [--cpu]
                                     [--pool] [--pool-ns 1024,4096] [--phases] [--gemm-rows 0,64,128]
                                     [--buffered]
    python tools/targets.py backward [--n 4096] [--mem-n 16384] [--reps 3]
    python tools/targets.py rates    [--backends numpy,torch] [--json PATH]
    python tools/targets.py recurrent [--n 16384] [--fla-n 2048] [--grad-n 2048] [--reps 3]
    python tools/targets.py softmax  [--n 4096] [--reps 5] [--block-q 512 --block-k 1024]
                                     [--tiles 1024x1024,...] [--pool-ns 64,128,256] [--passes]
    python tools/targets.py roofline [--n 65536] [--reps 1] [--variants a,b] [--backend numpy]

NumPy float32, 8 heads, d = 64, inputs from ``default_rng(0)``. Times are in-process
medians of wall-clock seconds; run with ``OPENBLAS_NUM_THREADS=1`` for single-thread
figures. The matmul rate that sets the floor is measured in the same run, with the
same threads. asv (``asv_benches/``) tracks the same costs across commits; this
script answers "does this commit meet the target here, now".

``linear``: non-causal time against the floor ``4 N H d^2 / matmul rate`` and against
its roofline (``asv_benches/costs.py`` ``WORK["linear"]`` at the NumPy rates of
``rates``, measured in the same run), causal (chunked) against non-causal (the two
interleaved after one untimed call each, with the system CPU time of each call: the
kernel's work for the process, such as clearing and compacting the huge pages of a
fresh output), the fitted exponent of time in ``N``, peak extra memory of causal at
the largest N (tracemalloc; NumPy reports its buffers to it) against the ``N H d dv``
floats of a naive prefix sum, and with ``--fla naive.py`` (the file ``fla/ops/linear_attn/naive.py`` of
flash-linear-attention) its ``naive_chunk_linear_attn`` on PyTorch CPU at N = 16384, interleaved with ours.

``--pool`` times the largest N with and without the heads split among the CPUs, each
worker's BLAS on one thread (``attn_ref.linear.engine.POOL_MIN_ROWS`` forced each way),
interleaved; ``--pool-ns`` does the same at each of several N, non-causal and causal (the
smallest N that gains sets the threshold); ``--gemm-rows 0,64,128``
times the non-causal call with ``attn_ref.linear.engine.GEMM_ROWS`` at each (0: one GEMM per
block), interleaved, wall and CPU seconds. ``--phases`` times
each phase of the non-causal block loop at the largest N (feature maps, the ``[V | 1]``
copy, the fold and read GEMMs in ``attn_ref.linear.engine.GEMM_ROWS``-row chunks as the library
takes them, the output write, the division) summed over the blocks,
with the page faults each took (on NumPy a fresh block-sized array often costs more in
page faults than in arithmetic), next to the whole call and each phase's share of the
roofline.

``backward``: the blockwise softmax backward on NumPy against PyTorch's CPU SDPA
backward, and the peak extra memory of the backward at ``--mem-n``.

``softmax``: ``online_softmax_attention`` at ``--n`` on torch tensors and on NumPy
arrays against PyTorch's ``scaled_dot_product_attention`` on 4-D ``(1, H, N, d)`` inputs
(its default CPU path, the fused flash kernel) and with each CPU kernel forced (flash,
math), every row with time / SDPA-default and time / roofline (``online_softmax``'s
least work in ``asv_benches/costs.py`` at the rates ``rates`` measures, in the same
run; the roofline at the old one-caller rates and the GEMM floor at each library's own
``a @ a`` rate are printed beside). The calls are interleaved, one of each per
repetition, and the medians reported with ``/proc/loadavg`` before and after. The NumPy
form is also timed with its heads pool forced on and off (``heads pool``, ``no pool``:
BLAS's own threads; ``attn_ref.softmax.online.POOL_MIN_LOGITS``), with ``--pool-ns``
at several N (the threshold's measurement) and, with ``--tiles``, both forms at
other tile sizes; ``--passes`` times each operation of the tile loop (logits GEMM, row
maximum, shift, ``exp``, ``P [V | 1]`` GEMM) summed over the tiles, next to its share
of the roofline.

``roofline``: every registered variant whose cost under its benchmark configuration
is below ``N^2`` (``asv_benches/_common.py``, ``BENCH_CONFIGS``; the same inputs and
arguments as asv's ``variants.Attention``), one call each at ``--n`` after an untimed
one, against its roofline (``asv_benches/costs.py``, ``WORK``) at the rates measured
in the same run, sorted by the ratio; ``/proc/loadavg`` before and after.

``rates``: the four rates of the roofline (``asv_benches/costs.py``, ``Work``) per
backend: float32 GEMM (2048^3), ``exp`` and an elementwise product on a 64 Ki-element
array that stays in cache, written into a preallocated output (the rate a tiled kernel
can reach; a fresh 16M output costs page faults instead), and memory bandwidth (a
256 MiB copy, bytes read plus written). Each is the machine's all-core rate: the better
of one caller on the library's own threads and one caller per CPU at once, each held
to one thread (``_best_rate``; both are printed). An implementation that runs its
exponentials on every core (the heads pools) could otherwise come in under a roofline
that counted them at one core's rate. ``--json`` writes them with the machine, the time and the load average
(``docs/_static/roofline_rates.json`` is what the scaling report reads); rates taken
on a loaded machine are marked so, and are lower bounds of the machine's.

``recurrent``: the chunk form of each recurrent variant (retention, gla, ssd, deltanet,
gated_deltanet) at ``--n`` with its benchmark configuration (``asv_benches/_common.py``
``BENCH_CONFIGS``: chunk size, gates drawn as fla's tests draw them), against its
roofline (``asv_benches/costs.py`` ``WORK`` at the NumPy rates measured in the same
run), and, at ``--fla-n`` (fla's naive loops take about a minute each at 16384 on a
loaded 2-core machine), ours against flash-linear-attention's naive reference on torch
CPU (``fla/ops/<op>/naive.py`` of the installed fla-core: the recurrent loops; for
retention fla's only naive form, the masked ``T x T`` product), interleaved variant by
variant; then at ``--grad-n`` the chunked backward (``attn_ref.grad.recurrent``,
``form="chunk"``) against the token loop (``form="recurrent"``); ``--chunk-sizes``
adds each variant at other chunk sizes, each against the roofline at its own ``C``
(which grows with ``C``: a lower ratio at a larger ``C`` is not a faster call). Times and rates are
CPU seconds of this process (``time.process_time``; wall seconds are shown beside):
on a shared machine wall time measures the other jobs too. Run it single-threaded
(``OPENBLAS_NUM_THREADS=1``: on a loaded machine OpenBLAS's threads wait on each other,
tens of times slower) and from the repository root with ``PYTHONPATH=.`` so that this
checkout's ``attn_ref`` is the one timed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
import tracemalloc

import numpy as np

# asv_benches and tests (the recurrent subcommand's configurations and fla's naive files)
# are read from this checkout, whatever the working directory.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H, D = 8, 64


def _median_time(f, reps, clock=time.perf_counter):
    times = []
    for _ in range(reps):
        t = clock()
        f()
        times.append(clock() - t)
    return float(np.median(times))


def _inputs(n, count=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((H, n, D), dtype=np.float32) for _ in range(count)]


def matmul_rate(reps=7, size=2048, clock=time.perf_counter):
    a = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    return 2 * size**3 / _median_time(lambda: a @ a, reps, clock)


def _peak_extra(f):
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    f()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def linear(args):
    from asv_benches.costs import linear_causal_work, variant_work
    from attn_ref import linear_attention

    ns = [int(n) for n in args.ns.split(",")]
    print(f"load before: {_loadavg()}", flush=True)
    # --cpu: CPU seconds of this process, for a shared machine (with OPENBLAS_NUM_THREADS=1,
    # as ``recurrent`` does: the time the call's own work took, not the other jobs')
    clock = time.process_time if args.cpu else time.perf_counter
    detail = {}
    rates = _rates_numpy(7, clock=clock, detail=detail)
    old = one_caller_rates({"numpy": rates}, {"numpy": detail})["numpy"]
    rate = rates["gemm_flops"]
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"float32 matmul 2048^3: {rate / 1e9:.1f} GFLOP/s (median of 7), BLAS threads: {threads}; "
          f"exp in cache {rates['exp'] / 1e9:.2f} Gelem/s, multiply {rates['elementwise'] / 1e9:.2f} "
          f"Gelem/s, copy {rates['bandwidth'] / 1e9:.1f} GB/s (each the better of one caller and one "
          f"per CPU at once; one caller: exp {old['exp'] / 1e9:.2f}, multiply "
          f"{old['elementwise'] / 1e9:.2f}, GEMM {old['gemm_flops'] / 1e9:.1f})")
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
        # Interleaved after one untimed call each: the first call of a process faults in
        # memory the later ones reuse, and the kernel's stalls (below) hit both alike.
        system = {}
        med = _interleaved({"non": lambda q=q, k=k, v=v: linear_attention(q, k, v),
                            "cau": lambda q=q, k=k, v=v: linear_attention(q, k, v, causal=True)},
                           args.reps, clock, kernel=system)
        t_non, t_cau = med["non"], med["cau"]
        non.append(t_non)
        cau.append(t_cau)
        work = variant_work("linear", n, {}, d=D, heads=H)
        roof = work.seconds(rates)
        roof_c = linear_causal_work(n, D, heads=H).seconds(rates)
        line = (f"N={n:6d}  floor {floor * 1e3:7.1f} ms | roofline {roof * 1e3:7.1f} ms (at one caller's "
                f"rates {work.seconds(old) * 1e3:7.1f}) | non-causal "
                f"{t_non * 1e3:8.1f} ms ({t_non / floor:5.2f}x floor, {t_non / roof:5.2f}x roofline) | "
                f"causal {t_cau * 1e3:8.1f} ms ({t_cau / t_non:4.2f}x non-causal; its own roofline "
                f"{roof_c * 1e3:.1f} ms, {roof_c / roof:4.2f}x non-causal's: {t_cau / roof_c:4.2f}x) | "
                f"system CPU {system['non'] * 1e3:.0f} / {system['cau'] * 1e3:.0f} ms")
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
    if args.pool:
        _linear_pool(q, k, v, args.reps)
    if args.buffered:
        _linear_buffered(q, k, v, args.reps, variant_work("linear", n, {}, d=D, heads=H).seconds(rates))
    if args.gemm_rows:
        _linear_gemm_rows(q, k, v, [int(r) for r in args.gemm_rows.split(",")], args.reps)
    if args.pool_ns:
        for which in ("linear", "linear causal"):
            pool_sweep([int(x) for x in args.pool_ns.split(",")], args.reps, which)
    if args.phases:
        _linear_phases(q, k, v, args.block_size, args.reps, rates, clock)
    print(f"load after: {_loadavg()}")


def _linear_pool(q, k, v, reps):
    """``linear_attention`` with and without its heads split among the CPUs, each worker's
    BLAS on one thread (``attn_ref.linear.engine.POOL_MIN_ROWS`` forced to 1 and to never),
    interleaved, wall-clock medians."""
    from attn_ref import linear_attention
    from attn_ref.linear import engine as linear

    def with_rows(causal, threshold):
        # 1: the heads on the pool (BLAS on one thread per worker); 1 << 62: never
        def run():
            saved, linear.POOL_MIN_ROWS = linear.POOL_MIN_ROWS, threshold
            try:
                linear_attention(q, k, v, causal=causal)
            finally:
                linear.POOL_MIN_ROWS = saved
        return run

    med = _interleaved({"non-causal, no pool": with_rows(False, 1 << 62),
                        "non-causal, heads on the pool": with_rows(False, 1),
                        "causal, no pool": with_rows(True, 1 << 62),
                        "causal, heads on the pool": with_rows(True, 1)}, reps)
    print(f"N={q.shape[-2]}, interleaved, medians of {reps} (wall): "
          + " | ".join(f"{name} {t * 1e3:.1f} ms" for name, t in med.items()))


def _buffered_linear(q, k, v, block=512, rows=128):
    """Non-causal elu+1 linear attention as ``attn_ref.linear`` takes it (blocks of
    ``block`` rows, GEMMs in ``rows``-row chunks, ``[V | 1]``, the heads in one
    contiguous group per CPU), written in plain NumPy with every block's arrays made
    once and reused through ``out=``, which the array API standard lacks: no fresh array
    per operation, no page faults after the first block. The same operations in the same
    order, so the same bits; what NumPy's one-pass-per-operation execution reaches
    without allocation, the ceiling of any array-API form of this loop."""
    from concurrent.futures import ThreadPoolExecutor

    import array_api_compat.numpy as xp

    from attn_ref._common import cpu_count, row_groups
    from attn_ref.linear import DEFAULT_EPS, safe_denominator

    n, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]

    def features(x, zero, m, e, r):
        np.minimum(x, zero, out=m)
        np.exp(m, out=e)
        np.maximum(x, zero, out=r)
        e += r
        return e

    def run(group):
        a, b = group
        qh, kh, vh = q[a:b], k[a:b], v[a:b]
        h = b - a
        zero = np.zeros((h, block, d), q.dtype)
        m, e, r = np.empty_like(zero), np.empty_like(zero), np.empty_like(zero)
        v1 = np.ones((h, block, dv + 1), q.dtype)
        chunks = np.empty((h, block // rows, dv + 1, d), q.dtype)
        state_t = np.zeros((h, dv + 1, d), q.dtype)
        for lo in range(0, n, block):
            fk = features(kh[:, lo:lo + block], zero, m, e, r)
            v1[..., :dv] = vh[:, lo:lo + block]
            np.matmul(np.swapaxes(v1.reshape(h, -1, rows, dv + 1), -1, -2),
                      fk.reshape(h, -1, rows, d), out=chunks)
            state_t += chunks.sum(axis=1)
        state = np.ascontiguousarray(np.swapaxes(state_t, -1, -2))
        out = np.empty((h, n, dv), q.dtype)
        read = np.empty((h, block // rows, rows, dv + 1), q.dtype)
        for lo in range(0, n, block):
            fq = features(qh[:, lo:lo + block], zero, m, e, r)
            np.matmul(fq.reshape(h, -1, rows, d), state[:, None], out=read)
            num_den = read.reshape(h, block, dv + 1)
            den = num_den[..., dv:]
            np.multiply(num_den[..., :dv], 1.0 / safe_denominator(xp, den, DEFAULT_EPS),
                        out=out[:, lo:lo + block])
        return out

    assert n % block == 0 and block % rows == 0
    groups = row_groups(q.shape[0])
    if len(groups) < 2 or cpu_count() < 2:
        return run((0, q.shape[0]))
    with ThreadPoolExecutor(len(groups)) as pool:
        return np.concatenate(list(pool.map(run, groups)))


def _linear_buffered(q, k, v, reps, roof):
    """``linear_attention`` (non-causal) next to :func:`_buffered_linear`, interleaved."""
    from attn_ref import linear_attention

    ours = linear_attention(q, k, v)
    mine = _buffered_linear(q, k, v)
    same = bool(np.array_equal(ours, mine))
    med = _interleaved({"attn_ref": lambda: linear_attention(q, k, v),
                        "NumPy with out= buffers": lambda: _buffered_linear(q, k, v)}, reps)
    print(f"N={q.shape[-2]} non-causal, interleaved, medians of {reps} (wall; the same bits: {same}): "
          + " | ".join(f"{name} {t * 1e3:.1f} ms ({t / roof:.2f}x roofline)" for name, t in med.items()))


def _linear_gemm_rows(q, k, v, choices, reps):
    """Non-causal ``linear_attention`` with ``attn_ref.linear.engine.GEMM_ROWS`` set to each of
    ``choices`` (0: one GEMM per block, as before the chunks), interleaved; medians of
    wall and process CPU seconds (CPU counts BLAS's threads too, spinning included)."""
    from attn_ref import linear_attention
    from attn_ref.linear import engine as linear

    def with_rows(r):
        def run():
            saved, linear.GEMM_ROWS = linear.GEMM_ROWS, (r if r > 0 else q.shape[-2] + 1)
            try:
                linear_attention(q, k, v)
            finally:
                linear.GEMM_ROWS = saved
        return run

    calls = {r: with_rows(r) for r in choices}
    for f in calls.values():
        f()
    wall, cpu = {r: [] for r in calls}, {r: [] for r in calls}
    for _ in range(reps):
        for r, f in calls.items():
            t, c = time.perf_counter(), time.process_time()
            f()
            wall[r].append(time.perf_counter() - t)
            cpu[r].append(time.process_time() - c)
    print(f"N={q.shape[-2]} non-causal by GEMM rows per chunk (0: one GEMM per block), interleaved, "
          f"medians of {reps}: " + " | ".join(
              f"{r}: {np.median(wall[r]) * 1e3:.1f} ms wall, {np.median(cpu[r]) * 1e3:.1f} ms CPU"
              for r in calls))


def pool_sweep(ns, reps, which):
    """``which`` ("softmax": ``online_softmax_attention``; "linear", "linear causal":
    ``linear_attention``) on NumPy at each ``N`` of ``ns`` (8 heads, d = 64), with its
    heads on the pool (the threshold forced to 1) and without (forced to never),
    interleaved: the smallest ``N`` that gains sets the threshold
    (``attn_ref.softmax.online.POOL_MIN_LOGITS``, ``attn_ref.linear.engine.POOL_MIN_ROWS``)."""
    import array_api_compat.numpy as xnp

    from attn_ref import linear_attention, online_softmax_attention
    from attn_ref.linear import engine as linear
    from attn_ref.softmax import online

    module, name = (online, "POOL_MIN_LOGITS") if which == "softmax" else (linear, "POOL_MIN_ROWS")
    never = float("inf") if which == "softmax" else 1 << 62
    print(f"{which}: heads pool against none, interleaved, medians of {reps}; load {_loadavg()}")
    for n in ns:
        q, k, v = _inputs(n)

        def call(threshold, q=q, k=k, v=v):
            def run():
                saved = getattr(module, name)
                setattr(module, name, threshold)
                try:
                    if which == "softmax":
                        online_softmax_attention(q, k, v, xp=xnp)
                    else:
                        linear_attention(q, k, v, causal=which == "linear causal")
                finally:
                    setattr(module, name, saved)
            return run

        med = _interleaved({"pool": call(1), "none": call(never)}, reps)
        size = H * n * n if which == "softmax" else H * 2 * n
        print(f"  N={n:6d} ({'logits' if which == 'softmax' else 'rows'} {size}): pool "
              f"{med['pool'] * 1e3:9.2f} ms | none {med['none'] * 1e3:9.2f} ms | "
              f"none/pool {med['none'] / med['pool']:5.2f}", flush=True)


def _minor_faults():
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _linear_phases(q, k, v, block, reps, rates, clock):
    """Time each phase of non-causal ``linear_attention`` (elu+1) summed over the blocks,
    with the page faults each takes: the operations of ``attn_ref.linear``'s block loop
    (``_stream``), re-spelled here with NumPy so that each can be timed; the medians of
    ``reps`` runs, next to the whole call's, and each phase's share of the roofline."""
    import array_api_compat.numpy as xp

    from asv_benches.costs import variant_work
    from attn_ref import linear_attention
    from attn_ref.linear import DEFAULT_EPS, safe_denominator
    from attn_ref.linear.engine import GEMM_ROWS

    h, n, d = q.shape
    names = ("phi(K): min, exp", "phi(K): + max", "[V | 1] copy", "fold GEMM", "phi(Q): min, exp",
             "phi(Q): + max", "read GEMM", "output write", "times 1 / den (in place)")
    # As the library: GEMM_ROWS-row chunks of each block (at d = dv = 64 the rows are
    # GEMM_ROWS itself), the fold transposed ([V | 1]^T phi(K)) and summed over the chunks.
    crows = GEMM_ROWS if block > GEMM_ROWS and block % GEMM_ROWS == 0 else None

    def chunks(x):
        return x if crows is None else x.reshape(x.shape[:-2] + (x.shape[-2] // crows, crows, x.shape[-1]))
    runs, zeros = [], {}
    for _ in range(reps):
        spent, faults = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        last = [clock(), _minor_faults()]

        def tick(name, spent=spent, faults=faults, last=last):
            t, f = clock(), _minor_faults()
            spent[name] += t - last[0]
            faults[name] += f - last[1]
            last[:] = [t, f]

        def phi(x, lo, hi, first, tick=tick):
            """elu + 1 of rows lo:hi as the reference computes it, its two passes timed
            as names[first] and names[first + 1]."""
            # full-size and made once per shape, as attn_ref.linear's on NumPy
            shape = x[:, lo:hi].shape
            if shape not in zeros:
                zeros[shape] = np.zeros(shape, dtype=x.dtype)
            zero = zeros[shape]
            f = np.exp(np.minimum(x[:, lo:hi], zero))
            tick(names[first])
            f += np.maximum(x[:, lo:hi], zero)
            tick(names[first + 1])
            return f

        v1 = np.ones((h, block, d + 1), dtype=v.dtype)
        state = None
        last[:] = [clock(), _minor_faults()]
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            fk = phi(k, lo, hi, 0)
            v1[:, :hi - lo, :d] = v[:, lo:hi]
            tick(names[2])
            if crows is not None and hi - lo == block:
                ds = np.sum(np.matrix_transpose(chunks(v1)) @ chunks(fk), axis=-3)
            else:
                ds = np.matrix_transpose(v1[:, :hi - lo]) @ fk
            if state is None:
                state = ds
            else:
                state += ds
            tick(names[3])
        state = np.ascontiguousarray(np.matrix_transpose(state))
        out = np.empty((h, n, d), dtype=v.dtype)
        last[:] = [clock(), _minor_faults()]
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            fq = phi(q, lo, hi, 4)
            if crows is not None and hi - lo == block:
                o = (chunks(fq) @ state[:, None]).reshape(h, hi - lo, d + 1)
            else:
                o = fq @ state
            tick(names[6])
            out[:, lo:hi] = o[..., :d]
            tick(names[7])
            rows = out[:, lo:hi]
            rows *= 1.0 / safe_denominator(xp, o[..., d:], DEFAULT_EPS)
            tick(names[8])
        runs.append((spent, faults))
        f0, t0 = _minor_faults(), clock()
        linear_attention(q, k, v, block_size=block)
        runs[-1] += (clock() - t0, _minor_faults() - f0)
    pairs, elems = h * n * d, h * n * d
    share = {names[0]: elems / rates["elementwise"] + elems / rates["exp"],
             names[1]: elems / rates["elementwise"], names[2]: 0.0,
             names[3]: 2 * pairs * (d + 1) / rates["gemm_flops"],
             names[4]: elems / rates["elementwise"] + elems / rates["exp"],
             names[5]: elems / rates["elementwise"],
             names[6]: 2 * pairs * (d + 1) / rates["gemm_flops"],
             names[7]: 0.0, names[8]: elems / rates["elementwise"]}
    roof = variant_work("linear", n, {}, d=d, heads=h).seconds(rates)
    med = {name: float(np.median([r[0][name] for r in runs])) for name in names}
    print(f"phases of non-causal linear_attention at N={n}, blocks of {block} rows, medians of {reps} "
          f"on one thread (total {sum(med.values()) * 1e3:.1f} ms; the call itself, as the default "
          f"runs it (the heads pool from attn_ref.linear.engine.POOL_MIN_ROWS rows) "
          f"{np.median([r[2] for r in runs]) * 1e3:.1f} ms, {int(np.median([r[3] for r in runs]))} "
          f"page faults; roofline {roof * 1e3:.1f} ms, of which memory alone "
          f"{4 * pairs * 4 / rates['bandwidth'] * 1e3:.1f} ms)")
    for name in names:
        fl = int(np.median([r[1][name] for r in runs]))
        print(f"    {name:18s} {med[name] * 1e3:8.1f} ms | page faults {fl:7d} | roofline share "
              f"{share[name] * 1e3:6.1f} ms")


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


_CACHE_ELEMS = 1 << 16  # 256 KiB of float32: in L2 on any recent core
_STREAM_BYTES = 256 << 20


def _workers():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _together(calls, reps, clock):
    """Median seconds (on ``clock``) for ``calls``, one thread each, to all run once,
    started together: the machine's rate when every core works (NumPy's ufuncs and
    BLAS, PyTorch's operators release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        def once():
            for f in [pool.submit(c) for c in calls]:
                f.result()
        once()  # warm: threads started, pages touched
        return _median_time(once, reps, clock)


def _best_rate(one, one_work, calls, call_work, reps, clock, hold, detail=None, name=None):
    """The better of two ways to use the machine, in units of work per second: ``one``
    (a function doing ``one_work``) in this thread with the library's own threads, and
    ``calls`` (one function per CPU, ``call_work`` each) on one thread per CPU at once,
    inside ``hold()`` (the library held to one thread of its own). The better rate is
    the roofline's: an implementation may run either way, and the roofline must stay a
    lower bound of its time whichever it takes. ``detail[name]`` (when given) gets both:
    ``(one caller, one per CPU)``."""
    single = one_work / _median_time(one, reps, clock)
    with hold():
        spread = len(calls) * call_work / _together(calls, reps, clock)
    if detail is not None:
        detail[name] = (single, spread)
    return max(single, spread)


def _streaming_rates(reps, exp, mul, copy, make, hold, clock=time.perf_counter, detail=None):
    """All-core rates of one library: in-cache ``exp`` and multiply (elements/s, written
    into a preallocated output) and the copy bandwidth (bytes/s, read + write), each the
    better of one caller (the library's own threads) and one caller per CPU at once
    (:func:`_best_rate`). ``make(n)`` makes a float32 vector of ``n`` ones; each caller
    works on vectors of its own (``_CACHE_ELEMS``: in its core's cache) and copies its
    own slice of one ``_STREAM_BYTES`` copy.

    With ``clock=time.process_time`` (CPU seconds of the process, all its threads) the
    rates are per CPU second, one core's: the right ones for CPU-time figures."""
    inner = 200
    workers = _workers()

    def many(op, x, y, out):
        def run():
            for _ in range(inner):
                op(x, y, out)
        return run

    def vectors():
        x = make(_CACHE_ELEMS) * 0.25  # exp of 0.25: no special case, the ordinary path
        return x, x * 2, make(_CACHE_ELEMS)

    rates = {}
    for name, op in (("exp", lambda x, y, out: exp(x, out=out)),
                     ("elementwise", lambda x, y, out: mul(x, y, out=out))):
        mine = [vectors() for _ in range(workers)]
        work = inner * _CACHE_ELEMS
        rates[name] = _best_rate(many(op, *mine[0]), work, [many(op, *m) for m in mine], work,
                                 reps, clock, hold, detail, name)
    n = _STREAM_BYTES // 4
    src, dst = make(n), make(n)
    cuts = [n * i // workers for i in range(workers + 1)]
    slices = [(dst[a:b], src[a:b]) for a, b in zip(cuts, cuts[1:])]
    rates["bandwidth"] = _best_rate(lambda: copy(dst, src), 2 * _STREAM_BYTES,
                                    [lambda d=d, s=s: copy(d, s) for d, s in slices],
                                    2 * _STREAM_BYTES / workers, reps, clock, hold, detail,
                                    "bandwidth")
    return rates


_GEMM = 2048


def _gemm_rate(matmul, make, reps, clock, hold, detail=None):
    """Float32 GEMM FLOP/s, ``_GEMM``-cubed products: the better of one product on the
    library's threads and one product per CPU at once, each on one thread
    (:func:`_best_rate`)."""
    mats = [make() for _ in range(_workers())]
    work = 2 * _GEMM**3
    return _best_rate(lambda: matmul(mats[0]), work, [lambda a=a: matmul(a) for a in mats], work,
                      reps, clock, hold, detail, "gemm_flops")


def _numpy_one_thread():
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, "blas")


def _rates_numpy(reps, clock=time.perf_counter, detail=None):
    rng = np.random.default_rng(1)

    def make(n):
        return np.ones(n, dtype=np.float32)

    gemm = _gemm_rate(lambda a: a @ a,
                      lambda: rng.standard_normal((_GEMM, _GEMM), dtype=np.float32),
                      reps, clock, _numpy_one_thread, detail)
    rates = _streaming_rates(reps, np.exp, np.multiply, np.copyto, make, _numpy_one_thread, clock,
                             detail)
    return {"gemm_flops": gemm, **rates}


class _TorchOneThread:
    """``torch.set_num_threads(1)`` for the duration, then the count before."""

    def __enter__(self):
        import torch

        self.saved = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.saved)


def _rates_torch(reps, detail=None):
    import torch

    threads = torch.get_num_threads()
    gemm = _gemm_rate(lambda a: a @ a, lambda: torch.randn(_GEMM, _GEMM), reps, time.perf_counter,
                      _TorchOneThread, detail)
    rates = _streaming_rates(reps, torch.exp, torch.mul, lambda dst, src: dst.copy_(src),
                             lambda n: torch.ones(n), _TorchOneThread, detail=detail)
    return {"gemm_flops": gemm, **rates, "threads": threads}


def roofline_rates(backends=("numpy", "torch"), reps=7, detail=None) -> dict:
    """``{backend: {gemm_flops, exp, elementwise, bandwidth}}`` per second, measured here,
    each the machine's all-core rate (:func:`_best_rate`): the roofline (``Work.seconds``)
    adds the kinds of work at these rates, so no implementation, however it spreads its
    work over the cores, can come in under it. ``detail`` (a dict, optional) gets
    ``{backend: {rate: (one caller, one per CPU)}}``: the first is what the roofline used
    before it took the better of the two."""
    measure = {"numpy": _rates_numpy, "torch": _rates_torch}
    unknown = sorted(set(backends) - set(measure))
    if unknown:
        raise ValueError(f"backends must be among {sorted(measure)}, got {unknown}")
    if detail is None:
        return {b: measure[b](reps) for b in backends}
    return {b: measure[b](reps, detail=detail.setdefault(b, {})) for b in backends}


def one_caller_rates(rates, detail):
    """``rates`` with each measured rate replaced by its one-caller value (``detail``
    of :func:`roofline_rates`): the rates the roofline took before it counted every
    core's exponentials, for a side-by-side."""
    return {b: {**r, **{k: v[0] for k, v in detail.get(b, {}).items()}} for b, r in rates.items()}


def rates(args):
    import json
    import platform

    load_before = os.getloadavg()
    detail = {}
    measured = roofline_rates(args.backends.split(","), args.reps, detail=detail)
    load_after = os.getloadavg()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    loaded = max(load_before[0], load_after[0]) > 0.5 * cpus
    meta = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpus": cpus, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg_1min": [round(load_before[0], 2), round(load_after[0], 2)],
            "command": f"python tools/targets.py rates --backends {args.backends} --reps {args.reps}",
            "method": ("each rate the better of one caller on the library's own threads and one "
                       "caller per CPU at once, each on one thread (all-core rates)"),
            "one_caller_and_per_cpu": {b: {k: [float(x) for x in v] for k, v in d.items()}
                                       for b, d in detail.items()},
            "quiet": not loaded,
            "note": ("measured on a loaded machine (1-min load average above half the CPUs): "
                     "the rates are low and the ratios to the roofline high" if loaded else
                     "measured on a quiet machine")}
    for b, r in measured.items():
        print(f"{b:6s} GEMM {r['gemm_flops'] / 1e9:7.1f} GFLOP/s | exp in cache "
              f"{r['exp'] / 1e9:5.2f} Gelem/s | multiply in cache {r['elementwise'] / 1e9:5.2f} "
              f"Gelem/s | copy {r['bandwidth'] / 1e9:5.1f} GB/s")
        print("       (one caller | one per CPU at once: " + ", ".join(
            f"{k} {a / 1e9:.2f} | {c / 1e9:.2f}" for k, (a, c) in detail[b].items()) + ")")
    print(f"load average (1 min) before/after: {meta['loadavg_1min']} on {cpus} CPUs"
          + ("" if meta["quiet"] else "  -- LOADED: not quotable"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rates": measured}, fh, indent=1)
            fh.write("\n")
        print(f"wrote {args.json}")


def _fla_module(family):
    """``fla/ops/<family>/naive.py`` of the installed fla-core (``tests.helpers``, run from
    the repository root), or None when it is not installed."""
    from tests.helpers import fla_naive_module

    try:
        return fla_naive_module(family)
    except ImportError:
        return None


def _recurrent_call(name, n):
    """``(run, fla_run)``: our chunk form on NumPy and fla's naive one on torch, same inputs."""
    import array_api_compat.numpy as xp

    from asv_benches._common import BENCH_CONFIGS
    from attn_ref.registry import get

    variant = get(name)
    config = BENCH_CONFIGS[name]
    options, sizes = config.resolve(n)
    q, k, v = _inputs(n)
    extra = config.arrays(n, D, {**options, **sizes}, seed=0, dtype=xp.float32, device="cpu", xp=xp)
    kw = {**options, **extra}

    def run():
        return variant.fn(q, k, v, **kw)

    def fla_run():
        import torch

        from tests.helpers import FLA_NAIVE

        family, fn, layout = FLA_NAIVE[name]
        mod = _fla_module(family)
        qq, kk = q, k
        if kw.get("qk_l2norm"):  # fla's naive loops take q, k as given: normalised here, untimed
            qq, kk = (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6) for x in (q, k))

        def t(x):  # ours (H, T, ...) -> fla's (1, H, T, ...) or (1, T, H, ...)
            x = torch.from_numpy(np.ascontiguousarray(x))[None]
            return x.transpose(1, 2).contiguous() if layout == "bthd" else x

        args = [t(qq), t(kk), t(v)]
        if name == "gla":
            args.append(t(extra["g"]))
        elif name == "ssd":
            args.append(t(extra["g"]))
        elif name == "deltanet":
            args.append(t(extra["beta"]))
        elif name == "gated_deltanet":
            args += [t(extra["beta"]), t(extra["g"])]
        f = getattr(mod, fn)

        def call():
            with torch.no_grad():
                return f(*args)
        return call

    return run, fla_run, kw


def _recurrent_vjp(name, n):
    """``(chunked, token_loop)``: the VJP of ``name`` at ``n`` by each backward."""
    from asv_benches._common import BENCH_CONFIGS
    from attn_ref.registry import get

    vjp = get(name).vjp
    _, _, kw = _recurrent_call(name, n)
    q, k, v, do = _inputs(n, 4)
    c = BENCH_CONFIGS[name].resolve(n)[0]["chunk_size"]
    kw = {**kw, "chunk_size": c}
    return (lambda: vjp(q, k, v, do, **kw, form="chunk"),
            lambda: vjp(q, k, v, do, **kw, form="recurrent"))


def recurrent(args):
    from asv_benches._common import BENCH_CONFIGS
    from asv_benches.costs import variant_work

    cpu = time.process_time
    names = args.variants.split(",")
    load0 = os.getloadavg()
    rate = _rates_numpy(args.reps, clock=cpu)
    print(f"numpy rates (CPU time): GEMM {rate['gemm_flops'] / 1e9:.1f} GFLOP/s | exp "
          f"{rate['exp'] / 1e9:.2f} Gelem/s | multiply {rate['elementwise'] / 1e9:.2f} Gelem/s | "
          f"copy {rate['bandwidth'] / 1e9:.1f} GB/s | BLAS threads "
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}", flush=True)
    have_fla = args.fla_n > 0 and importlib.util.find_spec("fla") is not None
    if have_fla:
        import torch

        # One thread, as our BLAS: CPU seconds of a spinning thread pool are not work.
        torch.set_num_threads(1)
        print(f"fla naive: torch {torch.__version__} CPU, {torch.get_num_threads()} thread", flush=True)
    print("times are medians of CPU seconds (wall seconds in brackets); roofline from the CPU-time "
          "rates above")
    print(f"{'variant':15s} {'C':>4s} {'T':>6s} {'time s':>16s} {'roofline s':>10s} {'ratio':>6s}"
          + (f" | T={args.fla_n}: ours s     fla s      fla/ours" if have_fla else ""))
    for name in names:
        run, _, kw = _recurrent_call(name, args.n)
        t = _median_time(run, args.reps, cpu)
        wall = _median_time(run, 1)
        w = variant_work(name, args.n, BENCH_CONFIGS[name].describe(args.n), d=D, heads=H)
        roof = w.seconds(rate)
        line = (f"{name:15s} {kw['chunk_size']:4d} {args.n:6d} {t:7.3f} [{wall:6.2f}] {roof:10.3f} "
                f"{t / roof:6.2f}")
        if have_fla:
            small, fla_call, _ = _recurrent_call(name, args.fla_n)
            t_small = _median_time(small, args.reps, cpu)
            f = fla_call()
            t_fla = _median_time(f, 1, cpu)
            line += f" | {t_small:14.3f} {t_fla:9.2f} {t_fla / t_small:10.1f}"
        print(line, flush=True)
    if args.chunk_sizes:
        from attn_ref.registry import get

        print(f"chunk size sweep at T = {args.n}: CPU seconds (median of {args.reps}) / roofline "
              f"at that C = ratio")
        for name in names:
            _, _, kw = _recurrent_call(name, args.n)
            q, k, v = _inputs(args.n)
            cells = []
            for c in (int(x) for x in args.chunk_sizes.split(",")):
                t = _median_time(functools.partial(get(name).fn, q, k, v, **{**kw, "chunk_size": c}),
                                 args.reps, cpu)
                values = {**BENCH_CONFIGS[name].describe(args.n), "chunk_size": c}
                roof = variant_work(name, args.n, values, d=D, heads=H).seconds(rate)
                cells.append(f"C={c}: {t:.3f}/{roof:.3f}={t / roof:.2f}")
            print(f"{name:15s} " + "  ".join(cells), flush=True)
    if args.grad_n > 0:
        print(f"backward (VJP) at T = {args.grad_n}, CPU seconds: chunked | token loop | ratio")
        for name in names:
            chunked, loop = _recurrent_vjp(name, args.grad_n)
            t_c = _median_time(chunked, args.reps, cpu)
            t_l = _median_time(loop, 1, cpu)
            print(f"{name:15s} {t_c:8.3f} | {t_l:8.3f} | {t_l / t_c:6.1f}", flush=True)
    load1 = os.getloadavg()
    print(f"load average (1/5/15 min) before {[round(x, 2) for x in load0]}, after "
          f"{[round(x, 2) for x in load1]}, on {os.cpu_count()} CPUs")


def _loadavg():
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _interleaved(calls, reps, clock=time.perf_counter, kernel=None):
    """``{name: median seconds}`` of ``calls`` (``{name: f}``), one call of each per
    repetition, so that a change of load hits every row alike; one untimed warm-up each.
    ``kernel``: a dict that receives ``{name: median seconds of system CPU time}``."""
    import resource

    for f in calls.values():
        f()
    times = {name: [] for name in calls}
    system = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            s = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            t = clock()
            f()
            times[name].append(clock() - t)
            system[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - s)
    if kernel is not None:
        kernel.update({name: float(np.median(t)) for name, t in system.items()})
    return {name: float(np.median(t)) for name, t in times.items()}


def softmax(args):
    import array_api_compat.numpy as xnp
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from asv_benches.costs import variant_work
    from attn_ref import online_softmax_attention

    n = args.n
    print(f"load before: {_loadavg()}", flush=True)
    detail = {}
    rates = roofline_rates(("numpy", "torch"), reps=5, detail=detail)
    old = one_caller_rates(rates, detail)
    work = variant_work("online_softmax", n, {}, d=D, heads=H)
    roof = {b: work.seconds(r) for b, r in rates.items()}
    for b, r in rates.items():
        print(f"{b:6s} GEMM {r['gemm_flops'] / 1e9:6.1f} GFLOP/s | exp {r['exp'] / 1e9:5.2f} Gelem/s | "
              f"elementwise {r['elementwise'] / 1e9:5.2f} Gelem/s | roofline at N={n}: "
              f"{roof[b] * 1e3:6.1f} ms (all-core rates; at one caller's rates, GEMM "
              f"{old[b]['gemm_flops'] / 1e9:.1f}, exp {old[b]['exp'] / 1e9:.2f}, elementwise "
              f"{old[b]['elementwise'] / 1e9:.2f}: {work.seconds(old[b]) * 1e3:6.1f} ms)")
    # The GEMM floor alone: Q K^T and P V at the measured matmul rate (one caller, the
    # library's own threads, as SDPA runs them)
    for b in rates:
        floor = work.gemm_flops / detail[b]["gemm_flops"][0]
        print(f"{b:6s} GEMM floor {work.gemm_flops / 1e9:.1f} GFLOP at its a @ a rate "
              f"{detail[b]['gemm_flops'][0] / 1e9:.1f} GFLOP/s: {floor * 1e3:6.1f} ms")
    q, k, v = _inputs(n)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    q4, k4, v4 = (x[None] for x in (tq, tk, tv))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    blocks = {"block_q": args.block_q, "block_k": args.block_k}

    def forced(backend):
        def run():
            with sdpa_kernel(backend):
                sdpa(q4, k4, v4)
        return run

    calls = {
        "SDPA-4D default": lambda: sdpa(q4, k4, v4),
        "SDPA-4D flash": forced(SDPBackend.FLASH_ATTENTION),
        "SDPA-4D math": forced(SDPBackend.MATH),
        "online softmax, torch": lambda: online_softmax_attention(tq, tk, tv, **blocks),
        "online softmax, NumPy": lambda: online_softmax_attention(q, k, v, **blocks, xp=xnp),
    }
    from attn_ref.softmax import online

    def numpy_pool(threshold):
        # the heads on the pool with BLAS on one thread per worker (1: every call), or
        # none (inf: one call on BLAS's own threads), whatever the default
        def run():
            saved, online.POOL_MIN_LOGITS = online.POOL_MIN_LOGITS, threshold
            try:
                online_softmax_attention(q, k, v, **blocks, xp=xnp)
            finally:
                online.POOL_MIN_LOGITS = saved
        return run

    calls["online softmax, NumPy, heads pool"] = numpy_pool(1)
    calls["online softmax, NumPy, no pool"] = numpy_pool(float("inf"))
    for tiles in filter(None, args.tiles.split(",")):
        bq, bk = (int(x) for x in tiles.split("x"))
        calls[f"online softmax, torch, {bq}x{bk}"] = (
            lambda bq=bq, bk=bk: online_softmax_attention(tq, tk, tv, block_q=bq, block_k=bk))
        calls[f"online softmax, NumPy, {bq}x{bk}"] = (
            lambda bq=bq, bk=bk: online_softmax_attention(q, k, v, block_q=bq, block_k=bk, xp=xnp))
    with torch.no_grad():
        med = _interleaved(calls, args.reps)
    base = med["SDPA-4D default"]
    print(f"N={n}, H={H}, d={D}, float32, torch threads {torch.get_num_threads()}, "
          f"tiles {args.block_q}x{args.block_k}, median of {args.reps} interleaved repetitions")
    for name, t in med.items():
        b = "numpy" if "NumPy" in name else "torch"
        print(f"  {name:38s} {t * 1e3:8.1f} ms | /SDPA-4D {t / base:5.2f} | "
              f"/roofline({b}) {t / roof[b]:5.2f}")
    if args.pool_ns:
        pool_sweep([int(x) for x in args.pool_ns.split(",")], args.reps, "softmax")
    if args.passes:
        with torch.no_grad():
            for name, arrays, xp in (("torch", (tq, tk, tv), None), ("numpy", (q, k, v), xnp)):
                _softmax_passes(name, *arrays, args.block_q, args.block_k, rates[name], xp)
    print(f"load after: {_loadavg()}")


def _softmax_passes(name, q, k, v, block_q, block_k, rate, xp=None):
    """Time each operation of the online softmax's tile loop, summed over the tiles, on
    one thread of control (no pool): the same operations as
    ``attn_ref.softmax.online._query_block`` on the default path (scale folded, no mask),
    in the library's groups of heads (``GROUP_TILE_LOGITS`` on NumPy, ``TORCH_TILE_LOGITS``
    on torch), the row sums from ``P [V | 1]`` on NumPy and from a pass elsewhere, each
    against its share of the roofline at ``rate``."""
    import array_api_compat

    from attn_ref._common import numpy_backed
    from attn_ref.softmax.online import GROUP_TILE_LOGITS, TORCH_TILE_LOGITS
    from attn_ref.softmax.tiles import transposed_copy

    xp = xp or array_api_compat.array_namespace(q)
    h, n, d = q.shape
    ones_column = numpy_backed(q)
    most = GROUP_TILE_LOGITS if ones_column else TORCH_TILE_LOGITS
    per_group = min(h, max(1, most // (min(block_q, n) * min(block_k, n))))
    q = q * (d ** -0.5)
    kt = transposed_copy(xp, k)
    if ones_column:
        v = xp.concat((v, xp.ones((h, n, 1), dtype=v.dtype)), axis=-1)
    spent = dict.fromkeys(("logits GEMM", "row max", "shift (in place)", "exp", "P V GEMM",
                           "row sums", "rescale acc"), 0.0)

    clock = time.perf_counter
    for h0 in range(0, h, per_group):
        hs = slice(h0, h0 + per_group)
        for q0 in range(0, n, block_q):
            qb, m, acc, lsum = q[hs, q0:q0 + block_q, :], None, None, None
            for k0 in range(0, n, block_k):
                t0 = clock()
                s = qb @ kt[hs, :, k0:k0 + block_k]
                t1 = clock()
                bm = xp.max(s, axis=-1, keepdims=True)
                mn = bm if m is None else xp.maximum(m, bm)
                t2 = clock()
                s -= mn
                t3 = clock()
                p = xp.exp(s)
                del s
                t4 = clock()
                pv = p @ v[hs, k0:k0 + block_k, :]
                t5 = clock()
                ps = None if ones_column else xp.sum(p, axis=-1, keepdims=True)
                t6 = clock()
                alpha = None if m is None else xp.exp(m - mn)
                acc = pv if m is None else acc * alpha + pv
                if ps is not None:
                    lsum = ps if m is None else lsum * alpha + ps
                m = mn
                t7 = clock()
                for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
                    spent[key] += dt
    pairs = h * n * n
    roof = {"logits GEMM": 2 * pairs * d / rate["gemm_flops"],
            "P V GEMM": 2 * pairs * d / rate["gemm_flops"],
            "row max": pairs / rate["elementwise"], "shift (in place)": pairs / rate["elementwise"],
            "exp": pairs / rate["exp"], "row sums": 0.0, "rescale acc": 0.0}
    total = sum(spent.values())
    print(f"  {name}: passes of the tile loop, {block_q}x{block_k} tiles, {per_group} head(s) at a time, "
          f"one thread of control, row sums {'in P [V | 1]' if ones_column else 'as a pass'} "
          f"(total {total * 1e3:.1f} ms; roofline {sum(roof.values()) * 1e3:.1f} ms)")
    for key, t in spent.items():
        print(f"    {key:18s} {t * 1e3:8.1f} ms | roofline share {roof[key] * 1e3:7.1f} ms")


def roofline(args):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from asv_benches import _common as bench
    from asv_benches.costs import cost_exponent
    from asv_benches.scaling import roofline_seconds

    n, backend = args.n, args.backend
    print(f"load before: {_loadavg()}", flush=True)
    rates = roofline_rates((backend,), reps=5)[backend]
    print(f"{backend}: GEMM {rates['gemm_flops'] / 1e9:.1f} GFLOP/s | exp {rates['exp'] / 1e9:.2f} "
          f"Gelem/s | elementwise {rates['elementwise'] / 1e9:.2f} Gelem/s | copy "
          f"{rates['bandwidth'] / 1e9:.1f} GB/s", flush=True)
    wanted = set(args.variants.split(",")) if args.variants else None
    rows = []
    for v in bench.registry().variants():
        time_cost = bench.benchmark_costs(v)[0]
        e = cost_exponent(time_cost)
        if (wanted is not None and v.name not in wanted) or (wanted is None and (e is None or e >= 2)):
            continue
        try:
            case = bench.VariantCase(v.name, backend, n)
        except NotImplementedError as exc:
            print(f"  {v.name:24s} skipped: {exc}", flush=True)
            continue
        try:
            case.run()
        except MemoryError as exc:  # a configuration past this machine (routing's gathers)
            print(f"  {v.name:24s} skipped: out of memory at N={n} ({exc})", flush=True)
            del case
            continue
        t = _median_time(case.run, args.reps)
        roof = roofline_seconds(v.name, n, rates, heads=H, d=D)
        ratio = t / roof if roof else float("nan")
        rows.append((ratio, v.name, t, roof, time_cost))
        print(f"  {v.name:24s} {t * 1e3:9.1f} ms | roofline {roof * 1e3 if roof else float('nan'):8.1f} ms"
              f" | {ratio:6.2f}x | {time_cost}", flush=True)
        del case
    print(f"N={n}, H={H}, d={D}, float32, {backend}, median of {args.reps} after one untimed call; "
          f"sorted by time / roofline:")
    for ratio, name, t, roof, _ in sorted(rows, key=lambda r: -r[0]):
        print(f"  {name:24s} {ratio:6.2f}x  ({t * 1e3:.1f} ms / {roof * 1e3:.1f} ms)")
    print(f"load after: {_loadavg()}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    lin = sub.add_parser("linear", help="issue 3: linear attention against the floor, causal, fla")
    lin.add_argument("--ns", default="1024,4096,16384,65536")
    lin.add_argument("--reps", type=int, default=5)
    lin.add_argument("--fla", metavar="NAIVE_PY", help="path of fla/ops/linear_attn/naive.py")
    lin.add_argument("--cpu", action="store_true", help="CPU seconds of this process instead of wall "
                     "seconds (rates and times), for a shared machine; use with OPENBLAS_NUM_THREADS=1")
    lin.add_argument("--pool", action="store_true", help="also time the largest N with the heads "
                     "split among the CPUs (attn_ref.linear.engine.POOL_MIN_ROWS), interleaved")
    lin.add_argument("--pool-ns", default="", help="also time the heads pool against none at "
                     "each of these N, e.g. 256,1024,4096 (the threshold's measurement)")
    lin.add_argument("--buffered", action="store_true", help="also time non-causal at the largest N "
                     "next to the same loop in plain NumPy with out= buffers (the same bits)")
    lin.add_argument("--phases", action="store_true", help="time each phase of the non-causal "
                     "block loop at the largest N, with its page faults")
    lin.add_argument("--block-size", type=int, default=512, help="rows per block of --phases")
    lin.add_argument("--gemm-rows", default="", help="also time non-causal at the largest N with "
                     "attn_ref.linear.engine.GEMM_ROWS at each of these (0: one GEMM per block), "
                     "e.g. 0,64,128")
    bwd = sub.add_parser("backward", help="issue 8: blockwise backward against torch SDPA")
    bwd.add_argument("--n", type=int, default=4096)
    bwd.add_argument("--mem-n", type=int, default=16384)
    bwd.add_argument("--reps", type=int, default=3)
    rt = sub.add_parser("rates", help="issue 15: GEMM, exp, elementwise and memory rates (roofline)")
    rt.add_argument("--backends", default="numpy,torch")
    rt.add_argument("--reps", type=int, default=7)
    rt.add_argument("--json", metavar="PATH", help="write the rates with the machine and load")
    rec = sub.add_parser("recurrent", help="issue 18: recurrent chunk forms against their "
                         "roofline and fla's naive loops")
    rec.add_argument("--n", type=int, default=16384)
    rec.add_argument("--fla-n", type=int, default=2048, help="T of the fla comparison (0: none)")
    rec.add_argument("--grad-n", type=int, default=2048, help="T of the backward timing (0: none)")
    rec.add_argument("--reps", type=int, default=3)
    rec.add_argument("--variants", default="retention,gla,ssd,deltanet,gated_deltanet")
    rec.add_argument("--chunk-sizes", default="", help="also time each variant at these chunk "
                     "sizes against the roofline at each (e.g. 32,64,128,256)")
    sm = sub.add_parser("softmax", help="issue 15: online softmax against SDPA-4D and its roofline")
    sm.add_argument("--n", type=int, default=4096)
    sm.add_argument("--reps", type=int, default=5)
    sm.add_argument("--block-q", type=int, default=512)
    sm.add_argument("--block-k", type=int, default=1024)
    sm.add_argument("--tiles", default="", help="more tile sizes to time, e.g. 1024x1024,256x512")
    sm.add_argument("--pool-ns", default="", help="also time the NumPy form's heads pool against "
                    "none at each of these N, e.g. 64,128,256 (the threshold's measurement)")
    sm.add_argument("--passes", action="store_true", help="time each operation of the tile loop")
    rf = sub.add_parser("roofline", help="issue 15: each sub-quadratic variant against its roofline")
    rf.add_argument("--n", type=int, default=65536)
    rf.add_argument("--reps", type=int, default=1)
    rf.add_argument("--backend", default="numpy", choices=("numpy", "torch"))
    rf.add_argument("--variants", default=None, help="comma-separated names (default: every "
                    "variant below N^2 under its benchmark configuration)")
    args = p.parse_args(argv)
    {"linear": linear, "backward": backward, "rates": rates, "recurrent": recurrent,
     "softmax": softmax, "roofline": roofline}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
