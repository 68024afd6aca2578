"""``verify``: run a kernel over the cases of a suite and judge each output.

The flow for one case and one dtype:

1. :func:`conformance.judging.prepare`: rounded inputs, golden output, tolerance and
   the declared semantics (cached, shared with the pytest plugin and the vectors);
2. the kernel call in its library, dtype and layout, guarded by
   :func:`conformance.calling.call_kernel` (exceptions and ``SystemExit`` are error
   rows, a call past ``time_limit`` is stopped, ``KeyboardInterrupt`` ends the run
   with :class:`Interrupted`); checks of library, dtype, device, shape, unchanged
   inputs, optional determinism;
3. the values against the tolerance; on failure, :mod:`conformance.diagnose`.

Kernel calling convention
-------------------------
``kernel(q, k, v, **kw)`` with ``q``, ``k``, ``v`` in the chosen layout and ``kw``
holding only what the case needs and the signature declares: ``mask``/``attn_mask``,
``bias``/``attn_bias``, ``causal``/``is_causal``, ``scale``/``softmax_scale`` (see
:data:`conformance.features.FEATURES`), plus the variant's parameters (always passed by
the reference's names) and options (passed when the signature has them). A kernel may
return a tuple ``(out, lse, ...)`` or a dict ``{"out": ..., "lse": ...}``: the output
and its extra outputs, each judged on its own row (:mod:`conformance.extras`). A
recurrent kernel (fla's convention) gets its gates and ``beta`` by name,
``initial_state`` and ``cu_seqlens`` in the cases that have them, and
``output_final_state=True`` when its signature takes it: it returns ``(o, final_state)``.
The cases of a family (``Case.family``) run for that family's variants only.
``verify(supports={...})`` overrides detection: ``{"mask": "my_mask_arg", "bias": False, "broadcast": True}``.

Extension points
----------------
* Conventions: :data:`conformance.judging.SEMANTICS`.
* Outputs: the forward output is ``"out"``; ``verify(grads=True)`` adds the gradient
  rows of :mod:`conformance.grads`, each judged by the same
  :func:`conformance.tolerance.measure` and reported on its own row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import backends as B
from .calling import (
    KernelSpec,
    aliased_input,
    applicable,
    call_kernel,
    changed_input,
    check_container,
    check_time_limit,
    kernel_kwargs,
    same,
    snapshot,
)
from .catalogue import Case
from .catalogue import cases as _cases
from .diagnose import diagnose
from .extras import (
    expected_outputs,
    extra_results,
    extras_of,
    requested_keywords,
    split_outputs,
)
from .features import NotApplicable
from .grads import grad_results
from .judging import BASE_KEYS, parse_semantics, prepare, variant_of, with_options
from .layouts import LAYOUTS, from_layout, to_layout
from .long import dask_settings, is_long
from .noncontiguous import host_views, kernel_views
from .report import CaseResult, Progress, Report
from .tolerance import MANTISSA_BITS

__all__ = ["verify", "session", "Session", "run_case", "search", "Interrupted"]


@dataclass
class Session:
    """A kernel ready to run: its spec, backend, layout, semantics and checks."""

    kernel: KernelSpec
    variant: Any
    backend: Any  # Backend, or (to_kernel, to_host) pair
    device: Any
    layout: str
    semantics: dict
    tolerance: Any
    deterministic: bool
    time_limit: float
    diagnose: bool
    seed: int
    name: str = ""
    backend_name: str = ""
    extra: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)  # the variant options set by the caller

    def run(self, case: Case, dtype: str) -> CaseResult:
        return run_case(self, case, dtype)[0]

    def to_kernel(self, host: np.ndarray, dtype: str):
        if isinstance(self.backend, tuple):
            return self.backend[0](host, dtype)
        be = self.backend
        if self.device is not None and self.device != be.device:
            be = B.Backend(be.name, be.xp, self.device)
        return B.from_numpy(host, be, None if host.dtype == np.bool_ else dtype)

    def to_host(self, x) -> np.ndarray:
        if isinstance(self.backend, tuple):
            return np.asarray(self.backend[1](x))
        return B.to_numpy(x)



def run_case(ctx: Session, case: Case, dtype: str) -> list[CaseResult]:
    """Run one case in one dtype; never raises for a kernel's fault.

    Every call into the kernel goes through :func:`conformance.calling.call_kernel`:
    an exception (``SystemExit`` included) is an ``error`` row, a call stopped at
    ``ctx.time_limit`` a ``fail`` row "timed out". ``KeyboardInterrupt`` propagates.
    """
    base = {"case": case.id, "dtype": dtype}
    try:
        applicable(ctx, case)
        prep = prepare(case, ctx.variant, dtype, ctx.seed, tolerance=ctx.tolerance,
                       **ctx.semantics)
    except NotApplicable as exc:
        return [CaseResult.na(reason=str(exc), **base)]

    def convert(a, dt=None):
        return ctx.to_kernel(a, dtype if dt is None else dt)

    try:
        kw = kernel_kwargs(ctx, prep, convert)
    except NotApplicable as exc:
        return [CaseResult.na(reason=str(exc), **base)]
    asked = requested_keywords(ctx, prep)
    kw.update(asked)
    buffers = {}
    if "noncontiguous" in case.needs:
        # views of buffers built afresh for this call (conformance.noncontiguous); the buffers
        # are snapshotted too, so that a write anywhere in them (through another view's
        # region, or a gap) is caught as well as one into a view
        inputs, bufs = kernel_views(ctx, *host_views(case, prep.arrays, ctx.layout), dtype)
        buffers = {f"{n} buffer": x for n, x in bufs.items()}
    else:
        inputs = {n: convert(to_layout(prep.arrays[n], ctx.layout)) for n in BASE_KEYS}
    shapes = {n: tuple(np.shape(to_layout(prep.arrays[n], ctx.layout))) for n in BASE_KEYS}
    snaps = {n: snapshot(ctx, x) for n, x in {**inputs, **buffers}.items()}
    snaps.update({n: snapshot(ctx, x) for n, x in kw.items() if hasattr(x, "shape")})
    want = to_layout(np.empty(prep.golden.shape, dtype=np.int8), ctx.layout).shape

    def forward(kw=kw, declared=None):
        # the read-back is part of the call: it makes an asynchronous library finish
        ret = ctx.kernel.fn(inputs["q"], inputs["k"], inputs["v"], **kw)
        out, extras, problems = split_outputs(
            ret, ctx.variant, expected_outputs(ctx) if declared is None else declared, prep,
            ctx.layout)
        problem = problems.pop("out", "") or check_container(ctx, out, inputs["q"], want)
        if not problem:
            name = aliased_input(out, {**inputs, **kw, **buffers})
            problem = name and (f"the output is the kernel's input {name!r} or a view of it "
                                "(it shares its memory): return a new array")
        if problem:
            return problem, None
        side = {}
        for name, x in extras.items():
            # the output's checks of library and device; any real floating dtype will do
            why = check_container(ctx, x, x if isinstance(ctx.backend, tuple) else inputs["q"],
                                  tuple(x.shape), name=name) if hasattr(x, "shape") else \
                f"{name} is a {type(x).__name__}, not an array"
            if why.startswith(f"{name} dtype"):
                why = ""
            side[name] = why or np.asarray(ctx.to_host(x))
        return "", np.asarray(ctx.to_host(out)), (extras, problems, side)

    grads = bool(ctx.extra.get("grads"))

    def unjudged(why):
        # asked for gradients, none judged: a row that says so (never silently absent)
        return [CaseResult.na(reason=f"gradients not judged: {why}", output="grads", **base)] \
            if grads else []

    call = call_kernel(forward, time_limit=ctx.time_limit)
    if not call.ok:
        return [CaseResult.error(call.fault, verdict="fail" if call.timed_out else "error",
                                 time_s=call.elapsed, shapes=shapes, **base)] + unjudged(
            "the forward call did not return")
    problem, host, *more = call.value
    extras, problems, side = more[0] if more else ({}, {}, {})
    changed = ""
    if not problem:
        name = changed_input(ctx, {**inputs, **kw, **buffers}, snaps)
        changed = name and f"the kernel modified its input {name!r} in place"
    if problem or changed:
        rows = [CaseResult.error(problem or changed, verdict="fail", time_s=call.elapsed,
                                 shapes=shapes, **base)]
        if changed or not grads:
            return rows + unjudged("the forward modified its inputs")
        # an output of the wrong dtype, shape or library: its gradients are still the
        # kernel's to judge (an audit's JAX kernel returning float32 for bfloat16 inputs
        # lost every gradient row)
        return rows + grad_results(ctx, prep, inputs, kw, shapes, dtype)
    try:
        got = from_layout(np.asarray(host, dtype=np.float64), ctx.layout)
    except (TypeError, ValueError) as exc:  # the right dtype name, but not numbers
        return [CaseResult.error(f"output is not numeric: {type(exc).__name__}: {exc}",
                                 verdict="fail", time_s=call.elapsed, shapes=shapes, **base)]
    res = prep.check(got)
    res.time_s = call.elapsed
    res.shapes = shapes
    if ctx.deterministic and res.verdict == "pass":
        again = call_kernel(forward, time_limit=ctx.time_limit)
        if not again.ok:
            res.verdict = "fail" if again.timed_out else "error"
            res.diagnosis = f"second call (deterministic=True): {again.fault}"
        elif again.value[0] or not same(again.value[1], host):
            res.verdict, res.diagnosis = "fail", "not deterministic: a second call differs"
    if asked and res.verdict == "pass":
        res, got = _unasked(ctx, forward, prep, kw, asked, inputs, buffers, snaps, host, res, got)
    if call.elapsed > ctx.time_limit:
        # the call returned, late: stuck in C code the watchdog could not interrupt
        res.verdict = "fail"
        res.diagnosis = (f"over the time limit of {ctx.time_limit:g} s (the call returned late); "
                         + res.diagnosis).rstrip("; ")
    if res.verdict == "fail" and is_long(case):
        # the signatures rerun the reference one-shot: O(N^2) memory at long N
        res.diagnosis = (res.diagnosis + "; " if res.diagnosis else "") + (
            "not diagnosed on a long case: rerun the kernel on the standard suite")
    elif res.verdict == "fail" and ctx.diagnose and not res.diagnosis.startswith("over the time"):
        try:
            with np.errstate(all="ignore"):
                words = diagnose(prep, got, res, rerun=lambda c: _rerun(ctx, c, dtype))
        except Exception as exc:  # a bug of the diagnoser: say so on the row, never hide it
            words = f"(the diagnosis itself failed: {type(exc).__name__}: {exc})"
        if words:
            res.diagnosis = (res.diagnosis + "; " if res.diagnosis else "") + words
    rows = [res] + extra_results(ctx, prep, extras, problems, side, {**base, "shapes": shapes})
    for r in rows[1:]:
        r.time_s = call.elapsed
    if grads:
        return rows + grad_results(ctx, prep, inputs, kw, shapes, dtype, returned=tuple(extras))
    return rows


def _unasked(ctx, forward, prep, kw, asked, inputs, buffers, snaps, host, res, got):
    """The output again, without the keywords that ask for extra outputs
    (``output_final_state=False``): ``(row, output judged)``.

    The first call asked for every extra the kernel returns, as fla's tests do; a kernel
    then takes another path when a model does not ask (no state stored, another
    launch), and a wrong output there passed every case (an independent audit's GLA and
    Gated DeltaNet, output x 1.01 only without the final state: 0 of 56 rows failed).
    The same output, bit for bit, is the first call's verdict; another is judged alone.
    """
    off = {n: False for n in asked}
    words = ", ".join(f"{n}=False" for n in off)
    # only the output is judged: whatever else comes back is not looked at
    unasked = {e.name: False for e in extras_of(ctx.variant)}
    call = call_kernel(lambda: forward({**kw, **off}, unasked), time_limit=ctx.time_limit)
    problem = call.fault if not call.ok else call.value[0]
    if not problem:
        name = changed_input(ctx, {**inputs, **kw, **buffers}, snaps)
        problem = name and f"the kernel modified its input {name!r} in place"
    if problem:
        res.verdict = "fail" if call.ok or call.timed_out else "error"
        res.diagnosis = f"called with {words}: {problem}"
        return res, got
    if same(call.value[1], host):
        return res, got
    other = from_layout(np.asarray(call.value[1], dtype=np.float64), ctx.layout)
    again = prep.check(other)
    if again.verdict == "pass":
        return res, got
    on = ", ".join(f"{n}={v!r}" for n, v in asked.items())
    again.diagnosis = (f"called with {words} (with {on} the output passed): "
                       + again.diagnosis).rstrip(": ")
    again.time_s, again.shapes = res.time_s, res.shapes
    return again, other


def _rerun(ctx, case, dtype):
    """Run the kernel on another case without diagnosing (for growth checks)."""
    sub = Session(**{**ctx.__dict__, "diagnose": False, "deterministic": False})
    return run_case(sub, case, dtype)[0]


def _kernel_name(fn):
    mod = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}:{name}" if mod else name


def session(kernel, variant="softmax", /, *, backend, device=None, layout="bhnd", seed=0,
            supports=None, tolerance=None, deterministic=False, time_limit=60.0, diagnose=True,
            grads=False, backward=None, options=None, **semantics) -> Session:
    """A prepared kernel: ``session(...).run(case, dtype) -> CaseResult`` (one case at a time).

    Takes the keywords of :func:`verify` that concern the kernel (not ``dtypes``,
    ``suite``, ``cases``, ``progress``, ``search_examples``) and checks them all here,
    before any case runs: an unknown variant, option, feature or convention raises.
    """
    sem = parse_semantics(semantics)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    v = with_options(variant_of(variant), options)
    if isinstance(backend, str):
        be, bname = B.load(backend), backend
    elif isinstance(backend, tuple) and len(backend) == 2 and all(map(callable, backend)):
        be, bname = backend, "custom"
    else:
        raise TypeError("backend must be a backend name or a (to_kernel, to_host) pair of "
                        f"functions, got {backend!r}")
    spec = KernelSpec.of(kernel, supports)
    if "causal" in spec.always and sem["causal"] == "both":
        raise ValueError("a kernel that is causal by construction (supports causal='always') "
                         "takes no alignment string: declare causal='top-left' or "
                         "'bottom-right', not 'both'")
    if backward is not None and not callable(backward):
        raise TypeError(f"backward must be a callable (q, k, v, do, **kw) -> (dq, dk, dv), got {backward!r}")
    return Session(spec, v, be, device, layout, sem, tolerance, deterministic,
                   check_time_limit(time_limit), diagnose, seed, name=_kernel_name(kernel),
                   backend_name=bname,
                   extra={"grads": bool(grads) or backward is not None, "backward": backward},
                   options=dict(options or {}))


def verify(kernel, variant="softmax", /, *, backend, device=None, dtypes=("float32",),
           layout="bhnd", suite="standard", seed=0, supports=None, tolerance=None,
           deterministic=False, time_limit=60.0, diagnose=True, progress=None,
           search_examples=100, cases=None, grads=False, backward=None, options=None,
           **semantics) -> Report:
    """Check ``kernel`` against the ``attn_ref`` reference of ``variant``.

    Parameters
    ----------
    kernel : callable
        ``kernel(q, k, v, **kw)`` (see the module docstring for ``kw``).
    variant : str
        A registered :mod:`attn_ref.registry` name (``"softmax"``, ``"linformer"``...).
        For an approximate variant the oracle is that approximation fed the same
        parameters, not exact softmax.
    backend : str or (to_kernel, to_host)
        ``"numpy"``, ``"torch"``, ``"jax"``, ``"cupy"``, ``"array_api_strict"``, or a pair
        of functions ``to_kernel(host_float64_array, dtype_name)`` and
        ``to_host(kernel_array) -> numpy array``.
    device : optional
        Device to place inputs on (default: the backend's).
    dtypes : sequence of str
        Any of ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``.
    layout : {"bhnd", "bnhd", "nd"}
        ``bhnd``: PyTorch SDPA; ``bnhd``: FlashAttention, JAX; ``nd``: one head.
        Masks and biases are always ``(B, H, Nq, Nk)`` (``(Nq, Nk)`` for ``nd``).
    suite : {"quick", "standard", "exhaustive", "long"}
        ``"long"``: ``N`` up to 16384, goldens on Dask (:mod:`conformance.long`; the
        ``dask`` extra), a progress bar while each computes.
    seed : int
        Every input is drawn deterministically from ``seed`` and the case id.
    supports : dict, optional
        Feature overrides: ``{"broadcast": True, "mask": "attn_mask", "bias": False}``;
        ``{"causal": "always"}`` for a kernel that is causal by construction (it gets
        only causal cases and no ``causal`` argument); the subset a kernel takes:
        ``{"cross": False}`` (``Nq == Nk`` only), ``{"head_dims": (64, 128)}``,
        ``{"max_seq_len": 4096}``, ``{"cases": predicate}``
        (:data:`conformance.calling.DECLARATIONS`). Cases outside are ``n/a``, counted
        by reason under the report table.
    tolerance : Tolerance or dict, optional
        Overrides :data:`conformance.tolerance.DEFAULTS` (per dtype or per output).
    deterministic : bool
        Call the kernel twice on each passing case; results must be bitwise equal.
    time_limit : float or None
        Seconds per kernel call (the forward, its read-back to the host, the second
        call of ``deterministic``, the gradients). A call still running at the limit
        is stopped (:class:`conformance.calling.Watchdog`) and fails as "timed out";
        a call stuck inside C code that cannot be interrupted is stopped when it
        returns (the row says so). ``None``: no limit.
    diagnose : bool
        Explain failures (:mod:`conformance.diagnose`).
    progress : bool, optional
        Show ``case i of n`` (default: on a terminal, not under CI).
    search_examples : int
        Hypothesis examples for the ``exhaustive`` suite's search.
    cases : list of Case, optional
        Run these instead of the suite's catalogue.
    grads : bool
        Also check the gradients ``dq``, ``dk``, ``dv`` (and ``dbias``) of the kernel
        against :data:`attn_ref.grad.VJPS`, one report row each, each with its own
        tolerance from the same model (:mod:`conformance.grads`). The kernel is
        differentiated by ``torch.autograd`` or ``jax.vjp``, or by ``backward``.
    backward : callable, optional
        ``backward(q, k, v, do, **kw) -> (dq, dk, dv)`` (or with ``dbias``, or a dict):
        the kernel's explicit backward, for kernels without autodiff (raw CUDA/Triton,
        NumPy). Implies ``grads=True``.
    options : dict, optional
        Options of the variant's function that define what the kernel computes, e.g.
        ``{"feature_map": "identity", "normalize": True}`` for ``"linear"``
        (:func:`conformance.judging.option_names` lists them per variant). The golden,
        the baselines and the diagnoses follow; an option the kernel's signature takes
        is passed to it too. An unknown option or a value the reference refuses raises
        ``ValueError`` before any case runs.
    **semantics
        ``fully_masked="zeros"|"mean"|"excluded"``, ``causal="top-left"|"bottom-right"|"both"``.

    Returns
    -------
    Report

    Raises
    ------
    Interrupted
        A ``KeyboardInterrupt`` (Ctrl-C, or one raised by the kernel) stops the run:
        ``Interrupted`` is a ``KeyboardInterrupt`` whose ``report`` holds the cases
        finished so far (``report.interrupted`` says where; it never passes).
        Every other fault of the kernel - any exception, ``SystemExit`` from
        ``sys.exit()``, a timeout, a wrong output - is a verdict in the report.

    Examples
    --------
    >>> import numpy as np
    >>> from conformance import verify
    >>> def kernel(q, k, v, *, scale=None):
    ...     s = q @ np.swapaxes(k, -1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    ...     p = np.exp(s - s.max(-1, keepdims=True))
    ...     return (p / p.sum(-1, keepdims=True)) @ v
    >>> verify(kernel, "softmax", backend="numpy", suite="quick").passed
    True
    """
    for dt in dtypes:
        if dt not in MANTISSA_BITS:
            raise ValueError(f"dtypes must be among {tuple(MANTISSA_BITS)}, got {dt!r}")
    ctx = session(kernel, variant, backend=backend, device=device, layout=layout, seed=seed,
                  supports=supports, tolerance=tolerance, deterministic=deterministic,
                  time_limit=time_limit, diagnose=diagnose, grads=grads, backward=backward,
                  options=options, **semantics)
    if not isinstance(ctx.backend, tuple):
        for dt in dtypes:  # a backend without the dtype (NumPy has no bfloat16) raises now
            ctx.to_kernel(np.zeros(1), dt)
    v, spec, sem, bname = ctx.variant, ctx.kernel, ctx.semantics, ctx.backend_name
    todo = list(cases) if cases is not None else [
        c for c in _cases(None, suite, grads=bool(grads) or backward is not None)
        if c.belongs_to(v)]
    report = Report(kernel=ctx.name, variant=v.name, backend=bname, layout=layout,
                    dtypes=tuple(dtypes), suite=suite, seed=seed, semantics=sem,
                    features=sorted(spec.features), signature_known=spec.signature_known,
                    options=dict(ctx.options))
    prog = Progress(progress)
    # a long case's golden shows Dask's progress bar where the case counter shows
    settings = dask_settings(progress=prog.enabled)
    settings.__enter__()
    n = len(todo) * len(dtypes)
    i = 0
    where = ""
    try:
        for dt in dtypes:
            for case in todo:
                i += 1
                where = f"{dt} {case.id}"
                prog.update(i, n, where)
                report.results.extend(run_case(ctx, case, dt))
            if suite == "exhaustive" and cases is None:
                where = f"{dt} search"
                prog.update(i, n, f"{dt} searching")
                found = search(ctx, dt, search_examples)
                if found is not None:
                    report.results.append(found)
    except KeyboardInterrupt as exc:
        report.interrupted = (f"interrupted ({type(exc).__name__}) at {where}, after "
                              f"{len(report.results)} results")
        raise Interrupted(report) from exc
    finally:
        prog.done()
        settings.__exit__(None, None, None)
    return report


class Interrupted(KeyboardInterrupt):
    """``verify()`` was stopped by a ``KeyboardInterrupt``; ``.report`` is the partial report.

    A subclass of ``KeyboardInterrupt``, so a script that does not catch it stops as
    Ctrl-C always stops it; one that does gets what ran::

        try:
            report = verify(kernel, backend="torch")
        except Interrupted as exc:
            report = exc.report        # report.passed is False
    """

    def __init__(self, report):
        super().__init__(report.interrupted)
        self.report = report


def search(ctx, dtype, examples):
    """Hypothesis search for a failing case, shrunk to the smallest that still fails."""
    try:
        from hypothesis import HealthCheck, Phase, find, settings
        from hypothesis.errors import NoSuchExample
    except ImportError as exc:
        raise RuntimeError("the exhaustive suite needs hypothesis (pip install hypothesis)") from exc
    from .catalogue import case_strategy

    def fails(case):
        r = run_case(Session(**{**ctx.__dict__, "diagnose": False}), case, dtype)[0]
        return r.verdict in ("fail", "error")

    try:
        case = find(case_strategy(), fails,
                    settings=settings(max_examples=examples, database=None, deadline=None,
                                      derandomize=True, phases=(Phase.generate, Phase.shrink),
                                      suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return None
    res = run_case(ctx, case, dtype)[0]
    res.diagnosis = ("smallest failing case found by search; " + res.diagnosis).rstrip("; ")
    return res
