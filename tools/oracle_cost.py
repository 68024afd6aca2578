"""What the oracle itself costs: ``verify`` per suite and dtype, and the golden at long Nk.

    python tools/oracle_cost.py verify [--suites quick,standard,exhaustive,long]
                                       [--dtypes float16,bfloat16,float32,float64] [--grads]
    python tools/oracle_cost.py golden [--nks 16384,65536] [--nq 256]

``verify``: one whole process per (suite, dtype), as a kernel author runs it,
``python -m conformance.cli verify tests.test_conformance_calibration:sdpa
--backend torch --suite S --dtype D`` (PyTorch's SDPA with a mask and a bias, the
calibration peer of ``tests/``), run from the repository root; ``--grads`` adds the
CLI's ``--grads`` (its gradients judged too, by torch autograd). Prints the wall time
(imports included), the process's CPU time and the number of cases that passed, failed
and were n/a (from ``--json``).

``golden``: the time of :func:`conformance.judging.prepare` (inputs, golden, baseline
and tolerance of one case) for exact softmax at ``Nq`` queries against ``Nk`` keys,
one head, d = 64: the float64 golden of a float32 kernel and the longdouble golden of a
float64 kernel. A case with ``Nq * Nk`` above ``conformance.long.LONG_THRESHOLD`` has
its golden computed on Dask in float64, whatever the kernel's dtype; the table says
which path each size took. ``/proc/loadavg`` is printed before each figure: the
machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = "tests.test_conformance_calibration:sdpa"


def _load():
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def verify_cost(suites, dtypes, grads=False):
    print(f"{'suite':<11} {'dtype':<9} {'wall s':>7} {'cpu s':>7} {'pass':>5} {'fail':>5} "
          f"{'n/a':>5}  load")
    for suite in suites:
        for dtype in dtypes:
            load = _load()
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "report.json")
                cmd = [sys.executable, "-m", "conformance.cli", "verify", KERNEL, "--backend",
                       "torch", "--suite", suite, "--dtype", dtype, "--json", out] + (
                    ["--grads"] if grads else [])
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t = time.perf_counter()
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                wall = time.perf_counter() - t
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                if not os.path.exists(out):
                    print(f"{suite:<11} {dtype:<9} failed to run (exit {proc.returncode}):\n"
                          + proc.stderr[-2000:])
                    continue
                with open(out) as fh:
                    data = json.load(fh)
            reports = data if isinstance(data, list) else [data]
            counts = {"pass": 0, "fail": 0, "n/a": 0}
            for rep in reports:
                for verdict, count in rep["counts"].items():
                    counts["pass" if verdict == "pass" else "n/a" if verdict == "n/a"
                           else "fail"] += count
            print(f"{suite:<11} {dtype:<9} {wall:7.1f} {cpu:7.1f} {counts['pass']:5d} "
                  f"{counts['fail']:5d} {counts['n/a']:5d}  {load}", flush=True)


def golden_cost(nks, nq):
    from conformance.catalogue import Case
    from conformance.judging import prepare
    from conformance.long import LONG_THRESHOLD

    print(f"{'Nq':>6} {'Nk':>7} {'kernel':<8} {'golden':<14} {'seconds':>8}  load")
    for nk in nks:
        for dtype, golden in (("float32", "float64"), ("float64", "longdouble")):
            case = Case("cost", (1, 1), nq, nk, 64, 64)
            path = "float64, Dask" if nq * nk > LONG_THRESHOLD else golden
            load = _load()
            t = time.perf_counter()
            prepare(case, "softmax", dtype)
            print(f"{nq:6d} {nk:7d} {dtype:<8} {path:<14} {time.perf_counter() - t:8.2f}  {load}",
                  flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify")
    v.add_argument("--suites", default="quick,standard,exhaustive,long")
    v.add_argument("--dtypes", default="float16,bfloat16,float32,float64")
    v.add_argument("--grads", action="store_true", help="judge the gradients too")
    g = sub.add_parser("golden")
    g.add_argument("--nks", default="16384,65536")
    g.add_argument("--nq", type=int, default=256)
    args = p.parse_args(argv)
    if args.cmd == "verify":
        verify_cost(args.suites.split(","), args.dtypes.split(","), args.grads)
    else:
        golden_cost([int(n) for n in args.nks.split(",")], args.nq)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
