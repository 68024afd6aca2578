"""The ``attn-ref`` command line.

Each subcommand is a pair of functions, ``<name>_arguments(parser)`` and
``<name>_command(args) -> exit status``, listed once in :data:`COMMANDS`. Adding a
subcommand is: write the two functions, add one line to ``COMMANDS``.

``attn-ref verify``
    With no kernel: every registered ``attn_ref`` variant, on every installed backend,
    in float32 and float64, against the golden (the README's main job). With
    ``MODULE:FUNCTION``: that kernel (see :func:`conformance.verify`).
``attn-ref export-vectors DIR``
    Test vectors for kernels in other languages (:mod:`conformance.vectors`).
``attn-ref scaling``
    Exponents of time and memory in ``N`` from asv results (:mod:`asv_benches.scaling`).

The exit status is 0 only if everything checked passed.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

__all__ = ["main", "COMMANDS", "reference_kernel"]


# ------------------------------------------------------------------------ shared bits


def _semantics_args(p):
    p.add_argument("--fully-masked", choices=("zeros", "mean", "excluded"), default=None,
                   help="output of a query row with no key to attend to (default zeros)")
    p.add_argument("--causal", choices=("top-left", "bottom-right", "both"), default=None,
                   help="alignment of the kernel's causal=True when Nq != Nk (default top-left); "
                        "'both' = it takes the strings 'top-left'/'bottom-right'")


def _semantics(args) -> dict:
    out = {}
    if args.fully_masked:
        out["fully_masked"] = args.fully_masked
    if args.causal:
        out["causal"] = args.causal
    return out


def reference_kernel(variant, backend):
    """``variant.fn`` as a kernel on ``backend`` (jit-compiled on JAX), same signature."""
    fn = variant.fn
    if backend.name != "jax":
        return fn
    import jax

    _jax_compilation_cache(jax)

    cache = {}

    def kernel(q, k, v, **kw):
        arrays = {n: x for n, x in kw.items() if hasattr(x, "shape")}
        static = tuple(sorted((n, x) for n, x in kw.items() if n not in arrays))
        if static not in cache:
            cache[static] = jax.jit(lambda q, k, v, arrays: fn(q, k, v, **arrays, **dict(static)))
        return cache[static](q, k, v, arrays)

    kernel.__signature__ = inspect.signature(fn)
    kernel.__name__ = getattr(fn, "__name__", "kernel")
    kernel.__module__ = getattr(fn, "__module__", None)
    return kernel


def _jax_compilation_cache(jax):
    """Keep compiled references between runs (the built-in job compiles hundreds of shapes).

    ``ATTN_REF_JAX_CACHE`` sets the directory; an empty value turns the cache off.
    """
    path = os.environ.get("ATTN_REF_JAX_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "attn-ref", "jax"))
    if not path:
        return
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    except Exception:  # an older jax without these options simply compiles again
        return


def _causal_convention(fn) -> str:
    """'both' when ``fn`` takes causal="bottom-right" (attn_ref style), else 'top-left'."""
    import numpy as np

    x = np.zeros((2, 2)), np.zeros((3, 2)), np.zeros((3, 2))
    try:
        fn(*x, causal="bottom-right")
        return "both"
    except Exception:
        return "top-left"


# ----------------------------------------------------------------------------- verify


def verify_arguments(p):
    p.add_argument("kernel", nargs="?", help="MODULE:FUNCTION of the kernel; omit to verify "
                   "every built-in reference on every installed backend")
    p.add_argument("--variant", action="append", default=None,
                   help="attn_ref variant name (repeatable; default: softmax, or all for the "
                        "built-in job)")
    p.add_argument("--backend", action="append", default=None,
                   help="library the kernel takes (numpy, torch, jax, cupy, array_api_strict); "
                        "built-in job: default all installed")
    p.add_argument("--dtype", action="append", default=None,
                   help="float16, bfloat16, float32, float64 (repeatable; default float32, "
                        "built-in job float32 and float64)")
    p.add_argument("--layout", default="bhnd", choices=("bhnd", "bnhd", "nd"))
    p.add_argument("--suite", default=None, choices=("quick", "standard", "exhaustive"),
                   help="default standard (quick for the built-in job)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--supports", action="append", metavar="FEATURE[=PARAM|false]",
                   help="override signature detection, e.g. broadcast, mask=attn_mask, bias=false")
    p.add_argument("--deterministic", action="store_true", help="call twice, require equal output")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per call")
    p.add_argument("--json", metavar="PATH", help="write the report(s) as JSON")
    p.add_argument("--show-na", action="store_true", help="list not-applicable cases too")
    p.add_argument("--grads", action="store_true",
                   help="also check dq, dk, dv (torch autograd / jax.vjp of the kernel), one row each")
    _semantics_args(p)


def verify_command(args) -> int:
    if args.kernel is None:
        return _verify_builtin(args)
    from .calling import load_kernel, parse_supports
    from .oracle import verify

    kernel = load_kernel(args.kernel)
    reports = []
    for variant in args.variant or ["softmax"]:
        for backend in args.backend or ["numpy"]:
            rep = verify(kernel, variant, backend=backend, dtypes=tuple(args.dtype or ["float32"]),
                         layout=args.layout, suite=args.suite or "standard", seed=args.seed,
                         supports=parse_supports(args.supports), deterministic=args.deterministic,
                         time_limit=args.time_limit, grads=args.grads, **_semantics(args))
            print(rep.table(show_na=args.show_na))
            reports.append(rep)
    _write_json(args.json, reports)
    return 0 if reports and all(r.passed for r in reports) else 1


def _write_json(path, reports):
    if not path:
        return
    import json

    with open(path, "w", encoding="utf-8") as f:
        json.dump([r.to_dict() for r in reports] if len(reports) != 1 else reports[0].to_dict(),
                  f, indent=1)
        f.write("\n")


def _verify_builtin(args) -> int:
    """Every registered variant x installed backend x dtype, as one table."""
    from attn_ref.registry import variants

    from . import backends as B
    from .oracle import verify
    from .report import Progress

    vs = variants()
    if args.variant:
        vs = [v for v in vs if v.name in args.variant]
    names = args.backend or list(B.BACKENDS)
    avail, skipped = [], []
    for n in names:
        try:
            avail.append(B.load(n))
        except B.BackendUnavailable as exc:
            skipped.append((n, str(exc)))
    dtypes = args.dtype or ["float32", "float64"]
    suite = args.suite or "quick"
    rows, reports = [], []
    prog = Progress()
    total, i = len(vs) * len(avail) * len(dtypes), 0
    for v in vs:
        sem = {"causal": _causal_convention(v.fn), **_semantics(args)}
        for be in avail:
            kernel = reference_kernel(v, be)
            for dt in dtypes:
                i += 1
                prog.update(i, total, f"{v.name} {be.name} {dt}")
                rep = verify(kernel, v.name, backend=be.name, dtypes=(dt,), suite=suite,
                             seed=args.seed, supports={"broadcast": True}, progress=False,
                             time_limit=args.time_limit, **sem)
                reports.append(rep)
                rows.append((v.name, be.name, dt, rep))
    prog.done()
    print(f"attn-ref verify: every reference against the golden ({suite} suite, seed {args.seed})")
    hdr = f"{'function':<18} {'backend':<17} {'dtype':<8} {'cases':>7} {'max err':>9} " \
          f"{'tolerance':>9} {'ratio':>6}  result"
    print(hdr)
    print("-" * len(hdr))
    for name, bname, dt, rep in rows:
        c = rep.counts
        w = rep.worst()
        ran = c["pass"] + c["fail"] + c["error"]
        me = f"{w.max_err:9.2e}" if w and w.max_err == w.max_err else f"{'-':>9}"
        tol = f"{w.tol_max:9.2e}" if w and w.tol_max == w.tol_max else f"{'-':>9}"
        ratio = f"{w.ratio:6.2f}" if w and w.ratio == w.ratio and w.ratio != float("inf") else \
            f"{'inf' if w else '-':>6}"
        print(f"{name:<18} {bname:<17} {dt:<8} {c['pass']:>3}/{ran:<3} {me} {tol} {ratio}  "
              f"{'pass' if rep.passed else 'FAIL'}")
    for n, why in skipped:
        print(f"skipped backend {n}: {why}")
    failed = [(n, b, d, r) for n, b, d, r in rows if not r.passed]
    for name, bname, dt, rep in failed:
        print(f"\n{name} on {bname} in {dt}:")
        print(rep.table())
    ok = bool(rows) and not failed
    print(f"\n{'all passed' if ok else f'{len(failed)} of {len(rows)} combinations FAILED'}: "
          f"{len(vs)} functions x {len(avail)} backends x {len(dtypes)} dtypes")
    _write_json(args.json, reports)
    return 0 if ok else 1


# --------------------------------------------------------------------- export-vectors


def export_vectors_arguments(p):
    p.add_argument("directory", help="output directory (created)")
    p.add_argument("--variant", default="softmax")
    p.add_argument("--dtype", action="append", default=None, help="repeatable; default float32")
    p.add_argument("--layout", default="bhnd", choices=("bhnd", "bnhd", "nd"))
    p.add_argument("--suite", default="standard", choices=("quick", "standard", "exhaustive"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grads", action="store_true",
                   help="also write do and the golden gradients golden_dq, golden_dk, golden_dv")
    _semantics_args(p)


def export_vectors_command(args) -> int:
    from .vectors import export_vectors

    manifest = export_vectors(args.directory, args.variant, dtypes=tuple(args.dtype or ["float32"]),
                              layout=args.layout, suite=args.suite, seed=args.seed,
                              grads=args.grads, **_semantics(args))
    n = len(manifest["cases"])
    print(f"wrote {n} cases and manifest.json to {args.directory}")
    return 0 if n else 1


# ---------------------------------------------------------------------------- scaling


# The scaling report lives with the benchmarks (asv_benches/scaling.py): it reads asv
# results, which exist only in a checkout of the repository.


def _scaling_module():
    try:
        import asv_benches.scaling as scaling
    except ImportError:
        return None
    return scaling


def scaling_arguments(p):
    scaling = _scaling_module()
    if scaling is not None:
        scaling.add_arguments(p)


def scaling_command(args) -> int:
    scaling = _scaling_module()
    if scaling is None:
        print("attn-ref scaling: needs a checkout of attn-ref (asv_benches/ on the path); "
              "run it from the repository root", file=sys.stderr)
        return 2
    return scaling.command(args)


# ------------------------------------------------------------------------------- main

# name -> (add arguments, run, one-line help)
def study_arguments(p):
    p.add_argument("--out", default="study-out", help="folder for study_results.json and the PNGs")
    p.add_argument("--sentences", type=int, default=240, help="reference sentences (default 240)")
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per config (median)")
    p.add_argument("--layers", choices=("all", "middle", "none"), default="all",
                   help="one-layer-at-a-time swaps for every config, each variant's middle budget, or none")
    p.add_argument("--no-plots", action="store_true", help="write the JSON only")


def study_command(args) -> int:
    from attn_ref.models import study

    results = study.run_study(args.out, sentences=args.sentences, repeats=args.repeats,
                              layers={"all": True, "none": False}.get(args.layers, args.layers),
                              plots=not args.no_plots)
    print(results["verdict"]["text"])
    print(f"wrote {args.out}/study_results.json in {results['run']['seconds']:.0f} s")
    return 0


COMMANDS = {
    "verify": (verify_arguments, verify_command,
               "check a kernel (or every built-in reference) against the golden"),
    "export-vectors": (export_vectors_arguments, export_vectors_command,
                       "write test vectors (.npz + manifest.json) for other languages"),
    "scaling": (scaling_arguments, scaling_command,
                "fitted growth of time and memory in N from asv results, with a log-log plot"),
    "study": (study_arguments, study_command,
              "all-MiniLM-L6-v2: attention spectra and each variant's fidelity (needs .[model])"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attn-ref", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, run, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add(p)
        p.set_defaults(run=run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
