"""Long-context goldens on Dask (:mod:`attn_ref.dask`): asv cases and the committed measurement.

asv (``LongContext``): exact softmax and linear attention (causal and not) of ``HEADS``
heads of ``HEAD_DIM`` in float32, the sequence in chunks of 2048 rows, on Dask's
threaded scheduler, ``N`` = 4096 and 16384: the graph's overhead and the merge tree
at sizes asv can repeat.

``python -m asv_benches.long_context --measure`` runs the two sizes the issue asks for
on a ``distributed.LocalCluster`` of 2 worker processes (1 thread each), one fresh
cluster per problem, and writes ``docs/_static/long_context.json``:

* linear attention, causal, ``N = 2^20``, 8 heads, ``d = 64``, float32;
* exact softmax attention, causal, ``N = 2^17``, 1 head, ``d = 64``, float64.

The inputs are drawn on the workers (``dask.array.random``), and the timed graph ends
in a few sampled rows and ``max |out|`` (which needs every chunk), so nothing large
crosses to the client. For each: wall time of that graph, each worker's peak RSS (its
``VmHWM``), the load average before and after (the machine is shared), and the largest
difference from NumPy, in float64, on the sampled rows (inputs gathered afterwards, not
timed). ``docs/long_context.md`` tabulates the file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from ._common import HEAD_DIM, HEADS

__all__ = ["LongContext", "measure", "main"]

CHUNK = 2048


def _inputs(n, heads, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, heads, n, d)).astype(dtype) for _ in range(3)]


class LongContext:
    """One Dask computation of a long-context golden, threaded scheduler."""

    params = [["exact", "exact_causal", "linear", "linear_causal"], [4096, 16384]]
    param_names = ["kind", "N"]
    timeout = 600
    number = 1
    repeat = 3

    def setup(self, kind, n):
        try:
            import dask.array as da
        except ImportError:
            raise NotImplementedError("the dask extra is not installed") from None
        from attn_ref.dask import dask_linear_attention, dask_softmax_attention

        q, k, v = (da.from_array(x, chunks=(1, HEADS, CHUNK, HEAD_DIM))
                   for x in _inputs(n, HEADS, HEAD_DIM, np.float32))
        causal = kind.endswith("causal")
        if kind.startswith("exact"):
            self.graph = dask_softmax_attention(q, k, v, causal=causal)[0]
        else:
            self.graph = dask_linear_attention(q, k, v, causal=causal)

    def time_compute(self, kind, n):
        self.graph.compute(scheduler="threads")

    def peakmem_compute(self, kind, n):
        self.graph.compute(scheduler="threads")


# ---------------------------------------------------------------- the committed measurement


def _vmhwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _load():
    return [round(x, 2) for x in os.getloadavg()]


def _run(name, build, check, *, memory_limit):
    """One problem on a fresh 2-process LocalCluster: ``build()`` gives the graphs to time,
    ``check(client, results)`` the largest difference from NumPy (not timed)."""
    from attn_ref.dask import compute, local_cluster

    cluster, client = local_cluster(2, threads_per_worker=1, memory_limit=memory_limit)
    try:
        load_before = _load()
        graphs = build()
        t0 = time.perf_counter()
        results = compute(*graphs, client=client, progress=True)
        wall = time.perf_counter() - t0
        load_after = _load()
        peaks = client.run(_vmhwm)
        err = check(client, results)
    finally:
        client.close()
        cluster.close()
    row = {"problem": name, "wall_s": round(wall, 1),
           "worker_peak_mib": sorted(round(p / 2**20) for p in peaks.values()),
           "max_abs_diff_vs_numpy": float(err), "load_before": load_before, "load_after": load_after,
           "workers": 2, "threads_per_worker": 1}
    print(json.dumps(row), flush=True)
    return row


def _random_inputs(n, heads, d, dtype, chunk, seed):
    """q, k, v drawn on the workers (nothing shipped from the client), chunked by head and rows."""
    import dask.array as da

    rng = da.random.default_rng(seed)
    return [rng.standard_normal((1, heads, n, d), chunks=(1, 1, chunk, d), dtype=dtype)
            for _ in range(3)]


def measure(path=None, which=("linear", "exact"), *, linear_n=2**20, exact_n=2**17):
    """Run the measurements (once each) and write them as JSON to ``path``.

    The timed graph ends in the sampled rows and ``max |out|`` (which needs every
    chunk): the whole output is never gathered, at ``N = 2^20`` it is 2 GiB.
    """
    import dask.array as da

    from attn_ref import linear_attention, softmax_attention
    from attn_ref.dask import dask_linear_attention, dask_softmax_attention

    rows = []
    rng = np.random.default_rng(1)
    if "linear" in which:
        n, heads, d, chunk = linear_n, 8, 64, min(16384, linear_n)
        rows_i = np.sort(rng.choice(n, 4, replace=False))

        def build_linear():
            q, k, v = _random_inputs(n, heads, d, np.float32, chunk, seed=0)
            out = dask_linear_attention(q, k, v, causal=True)
            return out[..., rows_i, :], da.max(da.abs(out))

        def check_linear(client, results):
            from attn_ref.dask import compute

            got = results[0]
            err = 0.0
            for h in (0, heads - 1):  # row i attends keys 0..i: non-causal on that prefix, float64
                q, k, v = _random_inputs(n, heads, d, np.float32, chunk, seed=0)
                qh, kh, vh = compute(q[0, h], k[0, h], v[0, h], client=client)
                for r, i in enumerate(rows_i):
                    want = linear_attention(*(x.astype(np.float64) for x in (
                        qh[i:i + 1], kh[:i + 1], vh[:i + 1])))
                    err = max(err, float(np.max(np.abs(got[0, h, r] - want[0]))))
            return err

        rows.append(_run(f"linear attention, causal, N=2^{n.bit_length() - 1}, {heads} heads, d={d}, float32",
                         build_linear, check_linear, memory_limit="4GiB")
                    # per row: the 64 x 64 causal products, the state's read-out and update
                    | {"approx_flops": 4.0 * n * heads * (64 * d + d * (d + 1)), "chunk": chunk})
    if "exact" in which:
        n, heads, d, chunk = exact_n, 1, 64, min(4096, exact_n)
        rows_i = np.sort(rng.choice(n, 6, replace=False))

        def build_exact():
            q, k, v = _random_inputs(n, heads, d, np.float64, chunk, seed=1)
            out = dask_softmax_attention(q, k, v, causal=True)[0]
            return out[..., rows_i, :], da.max(da.abs(out))

        def check_exact(client, results):
            from attn_ref.dask import compute

            q, k, v = compute(*_random_inputs(n, heads, d, np.float64, chunk, seed=1), client=client)
            mask = np.arange(n)[None, :] <= rows_i[:, None]
            want = softmax_attention(q[..., rows_i, :], k, v, mask=mask)
            return float(np.max(np.abs(results[0] - want)))

        name = f"exact softmax attention, causal, N=2^{n.bit_length() - 1}, {heads} head, d={d}, float64"
        rows.append(_run(name, build_exact, check_exact, memory_limit="4GiB")
                    # causal: half of Q K^T and P V (the diagonal tiles are computed whole)
                    | {"approx_flops": 2.0 * n * n * heads * d, "chunk": chunk})
    result = {"machine": f"{platform.node()}, {os.cpu_count()} CPUs (shared with other jobs)",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python -m asv_benches.long_context --measure", "rows": rows}
    if path:
        old = {}
        if os.path.exists(path):
            with open(path) as f:
                old = {r["problem"]: r for r in json.load(f).get("rows", [])}
        old.update({r["problem"]: r for r in rows})
        result["rows"] = list(old.values())
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measure", action="store_true", help="run the committed measurement")
    p.add_argument("--only", choices=("linear", "exact"), default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "_static",
                                                 "long_context.json"))
    args = p.parse_args(argv)
    if args.measure:
        measure(args.out, (args.only,) if args.only else ("linear", "exact"))


if __name__ == "__main__":
    main()
