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

For each: wall time from submission to the gathered result (inputs shipped from the
client included), each worker's peak RSS (its ``VmHWM``), the load average before and
after (the machine is shared), and the largest difference from NumPy on sub-sampled
rows. ``docs/long_context.md`` tabulates the file.
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
    from attn_ref.dask import compute, local_cluster

    cluster, client = local_cluster(2, threads_per_worker=1, memory_limit=memory_limit)
    try:
        load_before = _load()
        graph = build()
        t0 = time.perf_counter()
        (out,) = compute(graph, client=client, progress=True)
        wall = time.perf_counter() - t0
        load_after = _load()
        peaks = client.run(_vmhwm)
        err = check(out)
    finally:
        client.close()
        cluster.close()
    row = {"problem": name, "wall_s": round(wall, 1),
           "worker_peak_mib": sorted(round(p / 2**20) for p in peaks.values()),
           "max_abs_diff_vs_numpy": float(err), "load_before": load_before, "load_after": load_after,
           "workers": 2, "threads_per_worker": 1, "chunk": CHUNK}
    print(json.dumps(row))
    return row


def measure(path=None, which=("linear", "exact")):
    """Run the measurements (once each) and write them as JSON to ``path``."""
    import dask.array as da

    from attn_ref import linear_attention, softmax_attention
    from attn_ref.dask import dask_linear_attention, dask_softmax_attention

    rows = []
    rng = np.random.default_rng(1)
    if "linear" in which:
        n, heads, d = 2**20, 8, 64
        q, k, v = _inputs(n, heads, d, np.float32)

        def build():
            qd, kd, vd = (da.from_array(x, chunks=(1, heads, 16384, d)) for x in (q, k, v))
            return dask_linear_attention(qd, kd, vd, causal=True)

        rows_i = np.sort(rng.choice(n, 6, replace=False))

        def check(out):
            # row i attends keys 0..i: the non-causal reference on that prefix, in float64
            err = 0.0
            for i in rows_i:
                prefix = (q[..., i:i + 1, :], k[..., :i + 1, :], v[..., :i + 1, :])
                want = linear_attention(*(x.astype(np.float64) for x in prefix))
                err = max(err, float(np.max(np.abs(out[..., i:i + 1, :] - want))))
            return err

        rows.append(_run(f"linear attention, causal, N=2^20, {heads} heads, d={d}, float32", build,
                         check, memory_limit="6GiB")
                    # per row: the 64 x 64 causal products and the state's read-out and update
                    | {"approx_flops": 4.0 * n * heads * (64 * d + d * (d + 1))})
    if "exact" in which:
        n, heads, d = 2**17, 1, 64
        q, k, v = _inputs(n, heads, d, np.float64)

        def build():
            qd, kd, vd = (da.from_array(x, chunks=(1, heads, 4096, d)) for x in (q, k, v))
            return dask_softmax_attention(qd, kd, vd, causal=True)[0]

        rows_i = np.sort(rng.choice(n, 6, replace=False))

        def check(out):
            mask = np.arange(n)[None, :] <= rows_i[:, None]
            want = softmax_attention(q[..., rows_i, :], k, v, mask=mask)
            return float(np.max(np.abs(out[..., rows_i, :] - want)))

        rows.append(_run(f"exact softmax attention, causal, N=2^17, {heads} head, d={d}, float64", build,
                         check, memory_limit="6GiB")
                    # causal: half of Q K^T and P V (the diagonal tiles are computed whole)
                    | {"approx_flops": 2.0 * n * n * heads * d})
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
