"""The ``attn-ref`` command line.

Each subcommand is a pair of functions, ``<name>_arguments(parser)`` and
``<name>_command(args) -> exit status``, listed once in :data:`COMMANDS`. Adding a
subcommand is: write the two functions, add one line to ``COMMANDS``.

``attn-ref verify``
    With no kernel (the README's main job): every registered ``attn_ref`` variant, on
    every installed backend, in float32 and float64 (JAX under ``jax.jit``, on
    :func:`jit_cases` in :data:`JIT_DTYPES` only), on each case of the ``quick`` suite
    it can take, against the golden - the reference itself in float64/longdouble on
    NumPy - in worker processes (:func:`_work_units`). With ``MODULE:FUNCTION``: that
    kernel (see :func:`conformance.verify`).
``attn-ref export-vectors DIR``
    Test vectors for kernels in other languages (:mod:`conformance.vectors`).
``attn-ref check-results VECTORS RESULTS [--no-final-state] [--no-grads] [--json PATH]``
    The outputs such a kernel wrote back, judged and diagnosed as ``verify`` judges a
    kernel it calls (:func:`conformance.vectors.check_results`): the report's table,
    one row per case and output. A results file that is missing or cannot be read is
    a row of its case; ``--no-final-state`` says the kernel returns no final state (the
    recurrent variants' ``final_state`` rows are then n/a, where a file without one
    fails otherwise); ``--no-grads`` likewise for the gradient rows of vectors exported
    with ``--grads``.
``attn-ref scaling``
    Exponents of time and memory in ``N`` from asv results (:mod:`asv_benches.scaling`).

Exit status: 0 when everything checked passed; 1 when a kernel failed, errored, or
passed no case (``export-vectors``: wrote none); 2 for a usage error - a kernel or
backward that cannot be found or imported, an unknown variant, option, feature
declaration, case id or backend, an option value the variant refuses, a ``VECTORS``
directory that is missing or holds no valid attn-ref vectors - reported on one line
(``--traceback`` adds the traceback); 130 when Ctrl-C stopped ``verify`` (after
printing the partial report).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import sys
import traceback

__all__ = ["main", "COMMANDS", "reference_kernel", "UsageError", "EXIT_PASS", "EXIT_FAIL",
           "EXIT_USAGE"]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake in the command line itself: one line on stderr, exit status 2."""


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
    """``variant.fn`` as a kernel on ``backend`` (jit-compiled on JAX), same signature.

    On JAX each distinct shape, dtype and static option is one XLA compilation; they
    are compiled without LLVM's expensive passes (:data:`JAX_COMPILER_OPTIONS`).
    Nothing else of the process changes: the built-in job keeps its compilations in
    the persistent cache of :func:`jax_cache_dir` while it runs them
    (:func:`jax_compilation_cache`).
    """
    fn = variant.fn
    if backend.name != "jax":
        return fn
    import jax

    cache = {}
    options = {**JAX_COMPILER_OPTIONS, **(JAX_RECURRENT_OPTIONS if variant.family == "recurrent"
                                          else {})}

    def kernel(q, k, v, **kw):
        arrays = {n: x for n, x in kw.items() if hasattr(x, "shape")}
        if any(isinstance(x, jax.core.Tracer) for x in (q, k, v, *arrays.values())):
            # Inside a caller's trace (the oracle's jax.vjp for --grads, a user's jit):
            # XLA takes compiler options only at the top level ("compiler_options can
            # only be passed to top-level jax.jit" failed every gradient case), and the
            # caller's compilation covers this call.
            return fn(q, k, v, **kw)
        static = tuple(sorted((n, x) for n, x in kw.items() if n not in arrays))
        if static not in cache:
            def call(q, k, v, arrays, static=static):
                return fn(q, k, v, **arrays, **dict(static))

            # XLA's module (and the cache entry) named after the reference, not "lambda"
            call.__name__ = call.__qualname__ = getattr(fn, "__name__", "kernel")
            cache[static] = jax.jit(call, compiler_options=options)
        return cache[static](q, k, v, arrays)

    kernel.__signature__ = inspect.signature(fn)
    kernel.__name__ = getattr(fn, "__name__", "kernel")
    # reports name a kernel by its qualified name: the reference's, not this wrapper's
    kernel.__qualname__ = getattr(fn, "__qualname__", kernel.__name__)
    kernel.__module__ = getattr(fn, "__module__", None)
    return kernel


#: XLA options of the references' JAX compilations. A reference runs each shape a
#: few times on small inputs, so compile time, not run time, is the cost: XLA's
#: compiler took 65% of the built-in job's time with a cold cache (cProfile), and
#: these options cut the CPU time of the JAX part by 38% (softmax, online_softmax,
#: bigbird, clustered in float32 and float64). They make the compiled code slower,
#: not different in what it is asked to compute. XLA's backend optimisation level 0
#: was one of them until 2 December 2026: under it softmax's soft-capped large logits
#: (the standard suite's ``softcap:...-large_logits-softcap50``) erred 1.11x the RMS
#: bound in float32, our own reference failing our own oracle; without it the built-in
#: job's cold run took 15.2-15.5 s against 10.8-11.3 s (two interleaved pairs, empty
#: cache, quiet 2-core machine).
JAX_COMPILER_OPTIONS = {"xla_llvm_disable_expensive_passes": True}

#: XLA options added for the recurrent family: the legacy fusion emitters. Their chunk
#: forms once handed the state over in a loop that XLA's CPU fusion recomputed in every
#: fusion reading a state (~n^2/2 multiplies for n chunks); under jax.jit they now scan
#: (attn_ref.recurrent.common.chunk_states, the delta rule's affine maps), with no such
#: chain. The option still cuts compile time 3-5x: CPU seconds to compile at T = 1000
#: (C = 16, H = 2, d = 16, float32) with JAX_COMPILER_OPTIONS alone -> with this added,
#: load ~10 on 2 cores: retention 0.48 -> 0.14, GLA 0.89 -> 0.19, SSD 0.52 -> 0.17,
#: DeltaNet 1.40 -> 0.28, Gated DeltaNet 1.60 -> 0.33 (the loop's code: 2.1 -> 0.70,
#: 3.5 -> 1.4, 3.3 -> 1.2, 5.0 -> 1.3, 10.2 -> 3.0). The compiled code runs 1.2-2.5x
#: slower (a few ms at T = 1000), which a reference run a few times per shape does not
#: notice (the test of this option checks that a GLA case still passes).
JAX_RECURRENT_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def jax_cache_dir() -> str:
    """Directory of the persistent JAX compilation cache ("" when it is off).

    ``ATTN_REF_JAX_CACHE`` sets it (an empty value turns the cache off); the default
    is ``$XDG_CACHE_HOME/attn-ref/jax``, i.e. ``~/.cache/attn-ref/jax``. Deleting the
    directory only costs the next run its compilations.
    """
    path = os.environ.get("ATTN_REF_JAX_CACHE")
    if path is not None:
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attn-ref", "jax")


@contextlib.contextmanager
def jax_compilation_cache():
    """JAX's persistent compilation cache at :func:`jax_cache_dir`, every compilation
    kept, for the duration; JAX's settings as they were afterwards.

    The built-in job compiles ~50 references' shapes; kept between runs they cost a
    second run only their tracing and lowering. The cache is JAX's process-wide
    setting, so it is turned on only around the job's own compilations: a caller of
    :func:`reference_kernel` (the test suite, a user's process) keeps its own setting.
    Turned on for a whole process, with the threshold at 0 s, it had also written every
    eager operation's compilation there (the test suite: 2,125 files, 22 MB, in the
    user's home). An empty ``ATTN_REF_JAX_CACHE`` turns it off.
    """
    path = jax_cache_dir()
    if not path:
        yield
        return
    import jax

    try:
        from jax.experimental.compilation_cache import compilation_cache
        saved = {name: getattr(jax.config, name) for name in _JAX_CACHE_SETTINGS}
    except (ImportError, AttributeError):  # a jax without them simply compiles again
        yield
        return
    # JAX opens the cache's folder once, at the first compilation that finds one set, and
    # keeps it: reset_cache() on the way in and out, so that the folder is this job's.
    _set_jax_cache(jax, compilation_cache, {_JAX_CACHE_SETTINGS[0]: path,
                                            _JAX_CACHE_SETTINGS[1]: 0.0})
    try:
        yield
    finally:
        _set_jax_cache(jax, compilation_cache, saved)


#: JAX's settings of the persistent cache that :func:`jax_compilation_cache` sets:
#: its folder and the least compile time of an entry kept.
_JAX_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


def _set_jax_cache(jax, compilation_cache, values):
    for name, value in values.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


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
    p.add_argument("kernel", nargs="?", help="MODULE:FUNCTION of the kernel; omit it for the "
                   "built-in job: every registered attn_ref function on every installed "
                   "backend (numpy, array_api_strict, torch, jax under jax.jit; cupy with a "
                   "GPU), float32 and float64, the quick suite's cases (14: batch/heads, "
                   "Nq != Nk both ways, length 1, causal both alignments, masks, fully masked "
                   "rows, bias, scale, large logits) that each can take, against itself in "
                   "float64/longdouble on NumPy. On JAX (under jax.jit, where every case "
                   "shape is a compilation) it runs two cases per function (unequal lengths, "
                   "causal) in float32 only: the JAX rows check that a reference traces under "
                   "jit and keeps float32 in x64 mode, the same code path in either dtype, "
                   "and float64 arithmetic is checked on the other three backends (--backend "
                   "jax, --suite or --case runs every case on JAX in both dtypes, --dtype the "
                   "dtypes given). JAX compilations are cached in $ATTN_REF_JAX_CACHE, "
                   "default $XDG_CACHE_HOME/attn-ref/jax")
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
    p.add_argument("--suite", default=None, choices=("quick", "standard", "exhaustive", "long"),
                   help="default standard (quick for the built-in job); long: N up to 16384, "
                        "goldens on Dask with a progress bar (the dask extra)")
    p.add_argument("--dask-scheduler", metavar="ADDRESS", default=None,
                   help="compute long goldens on this distributed scheduler "
                        "(tcp://host:8786; default: threads in this process)")
    p.add_argument("--case", action="append", default=None, metavar="ID",
                   help="run only this case, its id as the table prints it (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=None, metavar="NAME=VALUE",
                   help="an option of the variant's function, e.g. feature_map=identity, "
                        "normalize=True (repeatable; VALUE is read as a Python literal when it "
                        "is one, else as a string)")
    p.add_argument("--supports", action="append", metavar="FEATURE[=PARAM|false|always]",
                   help="override signature detection or declare a subset, e.g. broadcast, "
                        "mask=attn_mask, bias=false, causal=always, cross=false, "
                        "head_dims=64,128, max_seq_len=4096")
    p.add_argument("--deterministic", action="store_true", help="call twice, require equal output")
    p.add_argument("--time-limit", type=float, default=60.0,
                   help="seconds per kernel call; a call still running then is stopped and "
                        "fails as timed out (default 60)")
    p.add_argument("--json", metavar="PATH", help="write the report(s) as JSON")
    p.add_argument("--jobs", "-j", type=int, default=None,
                   help="built-in job: worker processes (default one per CPU; 1 runs in this "
                        "process)")
    p.add_argument("--show-na", action="store_true", help="list not-applicable cases too")
    p.add_argument("--grads", action="store_true",
                   help="also check dq, dk, dv (torch autograd / jax.vjp of the kernel), one row each")
    p.add_argument("--backward", metavar="MODULE:FUNCTION", default=None,
                   help="the kernel's explicit backward(q, k, v, do, **kw) -> (dq, dk, dv); "
                        "implies --grads")
    p.add_argument("--traceback", action="store_true",
                   help="print the traceback of each distinct exception the kernel raised (and "
                        "of a usage error)")
    _semantics_args(p)


class _Traced:
    """A kernel that keeps the traceback of every exception it raises (``--traceback``).

    Signature, name and module are the kernel's own (``functools.update_wrapper``), so
    feature detection and the report see the kernel, not this wrapper.
    """

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.tracebacks = []

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except Exception as exc:
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            self.tracebacks.append("".join(traceback.format_exception(type(exc), exc, tb)))
            raise


def _usage(exc, show_traceback=False) -> int:
    """One line on stderr (the whole traceback with ``--traceback``); exit status 2."""
    if show_traceback:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    # KeyError's str() quotes its message: take the message itself
    text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    print(f"attn-ref: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _chosen_cases(ids):
    """The cases named by ``--case`` (None: the whole suite)."""
    if not ids:
        return None
    from .catalogue import CATALOGUE

    known = {}
    for todo in CATALOGUE.values():
        for c in todo:
            known.setdefault(c.id, c)
    missing = [i for i in ids if i not in known]
    if missing:
        import difflib

        near = difflib.get_close_matches(missing[0], list(known), n=3, cutoff=0.6)
        raise UsageError(f"unknown case id {missing[0]!r}"
                         + (f"; did you mean {', '.join(near)}?" if near else
                            "; ids are printed in the first column of the table"))
    return [known[i] for i in dict.fromkeys(ids)]


def _type_mismatch_hint(report, kernel) -> str:
    """A hint when every case that ran failed on the kernel's input or output type."""
    ran = [r for r in report.results if r.verdict != "n/a" and r.output == "out"]
    if not ran or any(r.verdict == "pass" for r in ran):
        return ""
    marks = ("kernel raised TypeError", "kernel raised AttributeError", "output is a ")
    if not all(r.diagnosis.startswith(marks) for r in ran):
        return ""
    import types

    fn = kernel.fn if isinstance(kernel, _Traced) else kernel
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    libs = sorted({m.__name__.split(".")[0] for m in vars(mod).values()
                   if isinstance(m, types.ModuleType)} & {"torch", "jax", "cupy"}) if mod else []
    guess = (f"; its module imports {', '.join(libs)}: try --backend {libs[0]}" if libs else "")
    return (f"hint: every case failed on the type of the arrays passed to or returned by the "
            f"kernel; it may expect another array library than {report.backend!r}: pass "
            f"--backend torch, jax, cupy or array_api_strict{guess}")


def verify_command(args) -> int:
    import numpy as np

    from . import backends as B
    from .calling import KernelNotFound, load_kernel, parse_options, parse_supports
    from .oracle import Interrupted, session, verify
    from .tolerance import MANTISSA_BITS

    if args.kernel is None:
        return _verify_builtin(args)
    dtypes = tuple(args.dtype or ["float32"])
    variants, backends = args.variant or ["softmax"], args.backend or ["numpy"]
    try:
        bad = [dt for dt in dtypes if dt not in MANTISSA_BITS]
        if bad:
            raise UsageError(f"--dtype must be among {', '.join(MANTISSA_BITS)}, got {bad[0]!r}")
        kernel = load_kernel(args.kernel)
        backward = load_kernel(args.backward, "backward") if args.backward else None
        options = parse_options(args.option)
        supports = parse_supports(args.supports)
        todo = _chosen_cases(args.case)
        # every argument checked before the first case runs
        for variant in variants:
            for backend in backends:
                sess = session(kernel, variant, backend=backend, layout=args.layout,
                               supports=supports, options=options, backward=backward,
                               time_limit=args.time_limit, **_semantics(args))
                for dt in dtypes:
                    sess.to_kernel(np.zeros(1), dt)
    except (UsageError, KernelNotFound, B.BackendUnavailable, KeyError, TypeError,
            ValueError) as exc:
        return _usage(exc, args.traceback)
    if args.traceback:
        kernel = _Traced(kernel)
        backward = _Traced(backward) if backward is not None else None
    reports = []
    try:
        long_goldens = _dask_scheduler(args.dask_scheduler)
    except (ImportError, OSError, TimeoutError) as exc:
        return _usage(UsageError(f"--dask-scheduler {args.dask_scheduler}: {type(exc).__name__}: {exc}"))
    try:
        with long_goldens:
            for variant in variants:
                for backend in backends:
                    rep = verify(kernel, variant, backend=backend, dtypes=dtypes,
                                 layout=args.layout, suite=args.suite or "standard",
                                 seed=args.seed, supports=supports,
                                 deterministic=args.deterministic, time_limit=args.time_limit,
                                 grads=args.grads, backward=backward, options=options,
                                 cases=todo, **_semantics(args))
                    print(rep.table(show_na=args.show_na))
                    hint = _type_mismatch_hint(rep, kernel)
                    if hint:
                        print(hint)
                    reports.append(rep)
    except Interrupted as exc:  # Ctrl-C: what ran so far, and the status of an interrupt
        print(exc.report.table(show_na=args.show_na))
        reports.append(exc.report)
        _write_json(args.json, reports)
        return INTERRUPTED
    if args.traceback:
        _print_tracebacks(kernel, "kernel")
        if backward is not None:
            _print_tracebacks(backward, "backward")
    _write_json(args.json, reports)
    return EXIT_PASS if reports and all(r.passed for r in reports) else EXIT_FAIL


def _dask_scheduler(address):
    """A context in which long goldens run on the scheduler at ``address`` (None: threads)."""
    import contextlib

    if address is None:
        return contextlib.nullcontext()
    from distributed import Client

    from .long import dask_settings

    client = Client(address, timeout=30)
    print(f"long goldens on {address}; dashboard {client.dashboard_link}")
    stack = contextlib.ExitStack()
    stack.callback(client.close)
    stack.enter_context(dask_settings(client=client))
    return stack


def _print_tracebacks(traced, what):
    seen = list(dict.fromkeys(traced.tracebacks))
    if not seen:
        return
    print(f"\n{what} tracebacks: {len(traced.tracebacks)} calls raised, {len(seen)} distinct")
    for i, text in enumerate(seen, 1):
        print(f"--- {what} traceback {i} of {len(seen)}")
        print(text.rstrip())


#: Exit status after Ctrl-C (128 + SIGINT, as shells report it): never 0.
INTERRUPTED = 130


def _write_json(path, reports):
    if not path:
        return
    import json

    with open(path, "w", encoding="utf-8") as f:
        json.dump([r.to_dict() for r in reports] if len(reports) != 1 else reports[0].to_dict(),
                  f, indent=1)
        f.write("\n")


def _verify_jobs(jobs) -> int:
    """Worker processes of the built-in job: ``--jobs``, else one per CPU; 1 = this process."""
    if jobs is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    return jobs


#: Seconds a worker needs to import JAX before its first JAX unit (1.2-1.5 s of CPU on
#: the 2-core machine, quiet). A worker that has not imported JAX takes a JAX unit only
#: when the ones left would keep the JAX workers busy longer than that (:func:`_run_units`).
JAX_IMPORT_S = 2.0


def _is_jax(unit) -> bool:
    return any(b == "jax" for _, b in unit)


def _next_unit(has_jax, jax_left, other_left, jax_workers, paces):
    """The unit a free worker takes next, popped from ``jax_left`` or ``other_left``.

    ``has_jax``: the worker has imported JAX; ``jax_workers``: how many have;
    ``paces``: seconds of the JAX units run so far by a worker that had JAX imported.
    None: it stays idle, since importing JAX would take longer than the JAX workers
    need for what is left.
    """
    if jax_left and has_jax:
        return jax_left.pop(0)
    if other_left:
        return other_left.pop(0)
    if not jax_left:
        return None
    pace = sum(paces) / len(paces) if paces else None
    if jax_workers and pace is not None and \
            len(jax_left) * pace / jax_workers <= JAX_IMPORT_S + pace:
        return None
    return jax_left.pop(0)


def _run_units(units, settings, jobs, on_done):
    """Run the units of :func:`_work_units` on ``jobs`` spawned worker processes.

    ``on_done(unit, results)`` is called in this process as each unit finishes. Each
    worker is a pool of one process, so the job decides which worker runs what: the
    first ``jobs`` units start one per worker, then each free worker takes what
    :func:`_next_unit` gives it. That keeps the imports few: torch in one worker, JAX
    in as many as shorten the job (from a warm compilation cache the JAX units take
    0.1-0.5 s each, and a second worker importing JAX for the last few of them only
    made the job longer).
    """
    import concurrent.futures as cf
    import multiprocessing
    import threading
    import time

    # spawn, not fork: a forked child would inherit JAX's and torch's threads
    ctx = multiprocessing.get_context("spawn")
    pools = [cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_worker_init)
             for _ in range(jobs)]
    jax_left = [u for u in units[jobs:] if _is_jax(u)]
    other_left = [u for u in units[jobs:] if not _is_jax(u)]
    has_jax = [False] * jobs
    paces = []  # seconds of each JAX unit a worker ran after its first
    running = {}
    closing = []  # threads shutting down the pools of workers with nothing more to run

    def start(w, unit):
        running[pools[w].submit(_verify_tasks, unit, settings)] = (w, unit, time.perf_counter())

    try:
        for w, unit in enumerate(units[:jobs]):
            start(w, unit)
        while running:
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                w, unit, t0 = running.pop(fut)
                got = fut.result()
                if _is_jax(unit):
                    if has_jax[w]:
                        paces.append(time.perf_counter() - t0)
                    has_jax[w] = True
                on_done(unit, got)
                unit = _next_unit(has_jax[w], jax_left, other_left, sum(has_jax), paces)
                if unit is not None:
                    start(w, unit)
                else:  # nothing more for it: let it exit while the others work
                    closing.append(threading.Thread(target=pools[w].shutdown))
                    closing[-1].start()
    except BaseException:
        for pool in pools:  # Ctrl-C reached the workers too; nothing left to wait for
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    # Every pool is shut down with wait=True (in a thread of its own for the workers that
    # finished early) and joined here: a pool left to the interpreter's exit, after a
    # shutdown(wait=False), races CPython's exit handler (it wakes the pool's manager
    # thread through a pipe that thread may be closing: "OSError: [Errno 9] Bad file
    # descriptor" after the report, in about one run of three on 3.11).
    for t in closing:
        t.join()
    for pool in pools:
        pool.shutdown()


def _worker_init():
    """Settings of a built-in job worker, made before it imports NumPy, torch or JAX.

    The job runs one worker per CPU, so a library's own thread pool only makes the
    workers compete for the cores: on a loaded 2-core machine the torch rows (28
    references, both dtypes, one process) took 7.4 s of CPU with torch's default
    threads and 2.5 s with ``OMP_NUM_THREADS=1``. A value the user set wins.
    """
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def _verify_tasks(tasks, settings) -> dict:
    """``{(variant, backend): reports}`` of the tasks, in one process (a worker's call).

    A backend that cannot be loaded here gives its reason, a string, in place of
    the reports, so only the workers that run a backend's tasks ever import it. The
    goldens are cached in the process (:func:`conformance.judging.prepare`), so the
    backends of one variant share them when they are tasks of one call.
    """
    from . import backends as B

    out = {}
    for name, backend_name in tasks:
        try:
            B.load(backend_name)
        except B.BackendUnavailable as exc:
            out[name, backend_name] = str(exc)
            continue
        out[name, backend_name] = _verify_task(name, backend_name,
                                               settings["dtypes"][backend_name], settings)
    return out


def _verify_task(name, backend_name, dtypes, settings) -> list:
    """The reports of one reference on one backend, one per dtype."""
    from attn_ref.registry import get

    from . import backends as B
    from .oracle import verify

    v, be = get(name), B.load(backend_name)
    sem = {"causal": _causal_convention(v.fn), **settings["semantics"]}
    kernel = reference_kernel(v, be)
    todo = settings["cases"]
    if todo is None and backend_name == "jax" and settings.get("jit_subset") and dtypes:
        todo = jit_cases(name, dtypes[0])
    with jax_compilation_cache() if backend_name == "jax" else contextlib.nullcontext():
        return [verify(kernel, name, backend=backend_name, dtypes=(dt,), suite=settings["suite"],
                       seed=settings["seed"], supports={"broadcast": True}, progress=False,
                       time_limit=settings["time_limit"], options=settings["options"],
                       cases=todo, **sem)
                for dt in dtypes]


#: The quick-suite cases the built-in job runs on JAX, by tag, in order of preference.
#: Every case shape is a compilation under ``jax.jit`` (about 0.3 s of CPU cold, 0.09 s
#: from the persistent cache: tracing and lowering), and the 14 cases x 2 dtypes x 28
#: references were 365 compilations, most of the job. The rows of one reference on JAX
#: differ from its NumPy rows only by what JAX's tracing and XLA do to the same code, so
#: two shapes per reference keep what the JAX rows prove (the function traces under
#: ``jit``, with the keys and queries of unequal length and a causal mask); every quick
#: case still runs on NumPy, array-api-strict and PyTorch, and ``attn-ref verify
#: --backend jax`` (or ``--suite quick`` given explicitly) runs them all on JAX. The
#: subset applies to the job with no ``--suite``, ``--backend`` or ``--case``.
JIT_CASE_TAGS = ("cross", "causal", "basic")
JIT_CASES_PER_REFERENCE = 2

#: The dtypes of the JAX rows in the job with no ``--suite``, ``--backend``, ``--case``
#: or ``--dtype``. A JAX row checks what only JAX can get wrong: that the reference
#: traces under ``jax.jit`` (no Python branch on a traced value, no in-place write, no
#: host conversion) and what XLA computes from the trace. The references take the same
#: code path in both dtypes (they branch on shapes and options, never on the dtype), and
#: float32 is where a dtype slip shows: JAX runs in x64 mode, so a constant built
#: without ``dtype=`` is float64 and promotes a float32 computation, which the output's
#: dtype check catches. Float64 arithmetic is checked on NumPy, array-api-strict and
#: PyTorch, whose float64 rows JAX in x64 mode would only repeat; dropping JAX's float64
#: rows halves the job's compilations (51 instead of 102). ``--dtype float64`` or
#: ``--backend jax`` runs them.
JIT_DTYPES = ("float32",)


def jit_cases(name, dtype="float32") -> list:
    """The cases of :data:`JIT_CASE_TAGS` that reference ``name`` can take, at most
    :data:`JIT_CASES_PER_REFERENCE`: the first case of each tag first, then the rest in
    tag order (a causal-only reference takes causal cases only).

    Whether a case applies is found by preparing it in ``dtype`` (the dtype the job
    runs, so the golden computed here is the one its row uses)."""
    from .catalogue import cases
    from .features import NotApplicable
    from .judging import prepare

    quick = cases(name, "quick")
    ranked = [c for t in JIT_CASE_TAGS for c in quick if c.tag == t]
    firsts = [c for i, c in enumerate(ranked) if i == 0 or ranked[i - 1].tag != c.tag]
    chosen = []
    for c in firsts + [c for c in ranked if c not in firsts]:
        try:
            prepare(c, name, dtype)
        except NotApplicable:
            continue
        chosen.append(c)
        if len(chosen) == JIT_CASES_PER_REFERENCE:
            break
    return chosen


def _work_units(vs, names):
    """The built-in job cut into calls for the workers, in the order they are submitted.

    Every backend but JAX is in one call, variant by variant (NumPy, array-api-strict,
    PyTorch, CuPy of one variant in a row): a worker computes a golden once and every
    backend of the variant uses it (the three NumPy-like backends took 5.3 s of CPU as
    three calls, 3.0 s as one), and only one worker imports torch. Each JAX variant is
    a call of its own: JAX's compilations are the longest part and are shared out. The
    first JAX variant goes first, the other backends' call second, the rest of JAX
    after: on two workers one starts on JAX while the other runs everything else, then
    takes JAX variants too.
    """
    rank = {"numpy": 0, "array_api_strict": 1, "torch": 2, "cupy": 3}
    rest = sorted((b for b in names if b != "jax"), key=lambda n: rank.get(n, len(rank)))
    jax_units = [[(v.name, "jax")] for v in vs] if "jax" in names else []
    others = [[(v.name, b) for v in vs for b in rest]] if rest else []
    return jax_units[:1] + others + jax_units[1:]


def _verify_builtin(args) -> int:
    """Every registered variant x installed backend x dtype, as one table."""
    from attn_ref.registry import get, variants

    from . import backends as B
    from .calling import parse_options
    from .judging import with_options
    from .report import Progress

    if args.backward or args.grads:
        return _usage(UsageError("--grads/--backward check a kernel's gradients: name the "
                                 "kernel (MODULE:FUNCTION)"))
    try:
        vs = [get(n) for n in args.variant] if args.variant else variants()
        options = parse_options(args.option)
        for v in vs:  # checked before the first case runs; --option applies to every variant
            with_options(v, options)
        todo = _chosen_cases(args.case)
        jobs = _verify_jobs(args.jobs)
        unknown = [n for n in args.backend or () if n not in B.BACKENDS]
        if unknown:
            raise UsageError(f"unknown backend {unknown[0]!r}; known: {', '.join(B.BACKENDS)}")
    except (UsageError, KeyError, TypeError, ValueError) as exc:
        return _usage(exc, args.traceback)
    names = args.backend or list(B.BACKENDS)
    dtypes = args.dtype or ["float32", "float64"]
    suite = args.suite or "quick"
    # no suite, backend or case asked for: JAX runs jit_cases only, and without --dtype
    # in JIT_DTYPES only
    jit_subset = not (args.suite or args.backend or args.case)
    dtypes_of = {b: [dt for dt in dtypes if dt in JIT_DTYPES]
                 if b == "jax" and jit_subset and not args.dtype else list(dtypes)
                 for b in names}
    settings = dict(suite=suite, seed=args.seed, time_limit=args.time_limit, options=options,
                    cases=todo, semantics=_semantics(args), jit_subset=jit_subset,
                    dtypes=dtypes_of)
    prog = Progress()
    done = {}
    units = _work_units(vs, names)
    total = len(vs) * sum(len(d) for d in dtypes_of.values())

    def finished(unit, got):
        done.update(got)
        prog.update(sum(len(d) for d in done.values() if not isinstance(d, str)), total,
                    " ".join(unit[-1]))

    jobs = min(jobs, len(units))
    if jobs > 1:
        # Workers import the backends; this process imports neither torch nor JAX.
        try:
            _run_units(units, settings, jobs, finished)
        except KeyboardInterrupt:
            prog.done()
            print("attn-ref verify: interrupted", file=sys.stderr)
            return INTERRUPTED
    else:
        for unit in units:
            finished(unit, _verify_tasks(unit, settings))
    # a backend is skipped when it could not be loaded (its tasks hold the reason)
    skipped = {b: got for (_, b), got in done.items() if isinstance(got, str)}
    avail = [b for b in names if b not in skipped]
    rows, reports = [], []
    for name, bname in [(v.name, b) for v in vs for b in avail]:
        for dt, rep in zip(dtypes_of[bname], done[name, bname]):
            reports.append(rep)
            rows.append((name, bname, dt, rep))
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
    for n, why in skipped.items():
        print(f"skipped backend {n}: {why}")
    failed = [(n, b, d, r) for n, b, d, r in rows if not r.passed]
    for name, bname, dt, rep in failed:
        print(f"\n{name} on {bname} in {dt}:")
        print(rep.table())
    ok = bool(rows) and not failed
    fewer = [f"{b} {', '.join(dtypes_of[b]) or 'none'} only" for b in avail
             if dtypes_of[b] != list(dtypes)]
    print(f"\n{'all passed' if ok else f'{len(failed)} of {len(rows)} combinations FAILED'}: "
          f"{len(vs)} functions x {len(avail)} backends x {len(dtypes)} dtypes"
          + (f" ({'; '.join(fewer)}: see attn-ref verify --help)" if fewer else ""))
    _write_json(args.json, reports)
    return 0 if ok else 1


# --------------------------------------------------------------------- export-vectors


def export_vectors_arguments(p):
    p.add_argument("directory", help="output directory (created)")
    p.add_argument("--variant", default="softmax")
    p.add_argument("--dtype", action="append", default=None, help="repeatable; default float32")
    p.add_argument("--layout", default="bhnd", choices=("bhnd", "bnhd", "nd"))
    p.add_argument("--suite", default="standard", choices=("quick", "standard", "exhaustive", "long"),
                   help="long: N up to 16384, goldens on Dask, each file with golden_lse too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grads", action="store_true",
                   help="also write do and the golden gradients golden_dq, golden_dk, golden_dv")
    p.add_argument("--option", action="append", default=None, metavar="NAME=VALUE",
                   help="an option of the variant's function (as for verify; repeatable); "
                        "recorded in the manifest")
    p.add_argument("--case", action="append", default=None, metavar="ID",
                   help="write only this case (repeatable)")
    _semantics_args(p)


def export_vectors_command(args) -> int:
    from .calling import parse_options
    from .judging import parse_semantics, with_options
    from .tolerance import MANTISSA_BITS
    from .vectors import export_vectors

    dtypes = tuple(args.dtype or ["float32"])
    try:
        options = parse_options(args.option)
        variant = with_options(args.variant, options)
        todo = _chosen_cases(args.case)
        parse_semantics(_semantics(args))
        bad = [dt for dt in dtypes if dt not in MANTISSA_BITS]
        if bad:
            raise UsageError(f"--dtype must be among {', '.join(MANTISSA_BITS)}, got {bad[0]!r}")
    except (UsageError, KeyError, TypeError, ValueError) as exc:
        return _usage(exc)
    manifest = export_vectors(args.directory, variant, dtypes=dtypes, layout=args.layout,
                              suite=args.suite, seed=args.seed, grads=args.grads, cases=todo,
                              **_semantics(args))
    n = len(manifest["cases"])
    print(f"wrote {n} cases and manifest.json to {args.directory}")
    return 0 if n else 1


# ---------------------------------------------------------------------- check-results


def check_results_arguments(p):
    p.add_argument("vectors", help="directory written by export-vectors (manifest.json and the "
                                   ".npz files)")
    p.add_argument("results", help="directory of the kernel's results: RESULTS/<file> per case, "
                                   "an .npz with out, out_dtype and, for the recurrent variants, "
                                   "final_state (see conformance.vectors)")
    p.add_argument("--no-final-state", action="store_true",
                   help="the kernel returns no final state: the recurrent variants' final_state "
                        "rows are n/a instead of failing where a results file has none")
    p.add_argument("--no-grads", action="store_true",
                   help="the kernel computes no gradients: the gradient rows of vectors exported "
                        "with --grads are n/a instead of failing where a results file has none")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--show-na", action="store_true", help="list not-applicable rows too")


def check_results_command(args) -> int:
    from .vectors import check_results

    try:
        report = check_results(args.vectors, args.results,
                               final_state=not args.no_final_state, grads=not args.no_grads)
    except (TypeError, ValueError) as exc:
        # a results file's problems are rows of the report: what raises is the vectors
        return _usage(exc)
    print(report.table(show_na=args.show_na))
    _write_json(args.json, [report])
    return EXIT_PASS if report.passed else EXIT_FAIL


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
    "check-results": (check_results_arguments, check_results_command,
                      "judge the outputs a kernel wrote back for exported vectors"),
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
