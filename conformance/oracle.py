"""``verify``: run a kernel over the cases of a suite and judge each output.

The flow for one case and one dtype (:class:`Prepared` holds steps 1-3 so that the
pytest plugin, ``export-vectors`` and people's own tests can reuse them):

1. host inputs from the case (:meth:`conformance.catalogue.Case.inputs`) and the variant's
   extra parameters (projections, features), rounded to the kernel dtype;
2. golden output (float64, longdouble for float64 kernels) and the baseline of a plain
   implementation in the kernel dtype (:mod:`conformance.tolerance`);
3. the semantics the kernel declared: rows with no key to attend to (``fully_masked``:
   ``"zeros"``, ``"mean"`` of V, or ``"excluded"`` from comparison) and the alignment
   of its ``causal=True`` (``causal``: ``"top-left"``, ``"bottom-right"``, or ``"both"``
   for a kernel that takes ``"top-left"``/``"bottom-right"`` strings as attn_ref does);
4. the kernel call in its library, dtype and layout; checks of library, dtype, device,
   shape, unchanged inputs, optional determinism, the time limit; then the values
   against the tolerance; on failure, :mod:`conformance.diagnose`.

Kernel calling convention
-------------------------
``kernel(q, k, v, **kw)`` with ``q``, ``k``, ``v`` in the chosen layout and ``kw``
holding only what the case needs and the signature declares: ``mask``/``attn_mask``,
``bias``/``attn_bias``, ``causal``/``is_causal``, ``scale``/``softmax_scale`` (see
:data:`conformance.catalogue.FEATURES`), plus the variant's parameters (always passed by
the reference's names) and options (passed when the signature has them). A kernel may
return a tuple; its first element is the output. ``verify(supports={...})`` overrides
detection: ``{"mask": "my_mask_arg", "bias": False, "broadcast": True}``.

Extension points
----------------
* ``SEMANTICS`` lists the declarable conventions and their defaults; a new one is a
  dict entry plus its use in :meth:`Prepared.golden_for`.
* ``OUTPUTS``: the forward output is ``"out"``; gradient checks register more outputs
  computed by :meth:`Prepared` hooks (``verify(grads=True)``), each judged by the same
  :func:`conformance.tolerance.measure` and reported on its own row.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import backends as B
from .catalogue import FEATURES, Case, NotApplicable, allowed_matrix
from .catalogue import cases as _cases
from .report import CaseResult, Report
from .tolerance import (
    DEFAULTS,
    MANTISSA_BITS,
    Metrics,
    Tolerance,
    bf16_array,
    measure,
    round_to,
)

__all__ = ["verify", "session", "prepare", "Prepared", "KernelSpec", "SEMANTICS", "LAYOUTS",
           "reference_features"]

SEMANTICS = {
    "fully_masked": ("zeros", ("zeros", "mean", "excluded")),
    "causal": ("top-left", ("top-left", "bottom-right", "both")),
}
LAYOUTS = ("bhnd", "bnhd", "nd")
_BASE_KEYS = ("q", "k", "v")
# a case whose baseline error exceeds this fraction of max|golden| is not applicable
ILL_CONDITIONED = 0.25


def _semantics(given: dict) -> dict:
    out = {}
    for key, (default, allowed) in SEMANTICS.items():
        val = given.get(key, default)
        if val not in allowed:
            raise ValueError(f"semantics {key}= must be one of {allowed}, got {val!r}")
        out[key] = val
    unknown = set(given) - set(SEMANTICS)
    if unknown:
        raise TypeError(f"unknown keyword(s) {sorted(unknown)}; semantics are {sorted(SEMANTICS)}")
    return out


# ----------------------------------------------------------------------- capabilities


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@dataclass
class KernelSpec:
    """What a kernel declares through its signature (and ``supports=`` overrides).

    ``names`` maps a feature name to the kernel parameter that carries it.
    """

    fn: Any
    names: dict
    accepts: frozenset  # every keyword the signature accepts
    var_kw: bool
    signature_known: bool

    @classmethod
    def of(cls, fn, supports: dict | None = None) -> KernelSpec:
        sig = _signature(fn)
        accepts, var_kw = set(), False
        if sig is not None:
            for p in sig.parameters.values():
                if p.kind is p.VAR_KEYWORD:
                    var_kw = True
                elif p.kind is not p.POSITIONAL_ONLY:
                    accepts.add(p.name)
        names = {}
        for feat in FEATURES.values():
            for alias in feat.params:
                if alias in accepts:
                    names[feat.name] = alias
                    break
        for feat in FEATURES.values():
            if feat.assumed and feat.name not in names:
                names[feat.name] = feat.params[0] if feat.params else None
        for feat_name, val in (supports or {}).items():
            if feat_name not in FEATURES:
                raise ValueError(f"supports= names unknown feature {feat_name!r}; known: "
                                 f"{sorted(FEATURES)}")
            if val is False:
                names.pop(feat_name, None)
            elif val is True:
                f = FEATURES[feat_name]
                names[feat_name] = names.get(feat_name) or (f.params[0] if f.params else None)
            elif isinstance(val, str):
                names[feat_name] = val
                accepts.add(val)
            else:
                raise TypeError(f"supports[{feat_name!r}] must be True, False or a parameter "
                                f"name, got {val!r}")
        return cls(fn, names, frozenset(accepts), var_kw, sig is not None)

    @property
    def features(self) -> frozenset:
        return frozenset(self.names)


def reference_features(variant) -> frozenset:
    """Features the reference function of ``variant`` can compute."""
    spec = KernelSpec.of(variant.fn)
    feats = set(spec.features)
    if not variant.causal:
        feats.discard("causal")
    feats.add("broadcast")  # every attn_ref function broadcasts leading dims
    return frozenset(feats)


# -------------------------------------------------------------------------- prepared


_GOLDEN_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def _np_compat():
    import array_api_compat.numpy as npx

    return npx


def _as(x, dtype):
    """Host float64 data as the NumPy array type that computes in ``dtype``."""
    if not isinstance(x, np.ndarray) or x.dtype == np.bool_:
        return x
    if dtype == "bfloat16":
        return bf16_array(x)
    if dtype == "longdouble":
        return x.astype(np.longdouble)
    return x.astype(np.dtype(dtype))


@dataclass
class Prepared:
    """One case, one dtype: rounded inputs, golden output and tolerance bounds.

    Attributes
    ----------
    case : Case
    dtype : str
    arrays : dict
        Host inputs rounded to ``dtype``, held as float64 (masks as bool), canonical
        ``(B, H, N, d)`` layout.
    kwargs : dict
        Plain reference options of the case (``causal``, ``scale``).
    params : dict
        The variant's extra arguments (arrays rounded like the inputs).
    options : dict
        The variant's fixed options (block sizes, ...).
    golden : float64 array (B, H, Nq, dv)
    keep : bool array or None
        Elements compared (False on excluded rows).
    baseline : Metrics
        Error of the plain implementation in ``dtype``.
    tol_max, tol_rms : float
    golden_dtype : str
        ``"longdouble"`` or ``"float64"``.
    """

    case: Case
    variant: Any
    dtype: str
    seed: int
    semantics: dict
    arrays: dict
    kwargs: dict
    params: dict
    options: dict
    golden: np.ndarray
    keep: np.ndarray | None
    dead_rows: np.ndarray | None
    baseline: Any
    baseline_note: str
    tol_max: float
    tol_rms: float
    tolerance: Tolerance
    golden_dtype: str

    # -- the reference in any NumPy dtype, used for golden, baseline and diagnosis
    def reference(self, dtype="float64", *, arrays=None, kwargs=None, fn=None):
        arrays = self.arrays if arrays is None else arrays
        kwargs = self.kwargs if kwargs is None else kwargs
        fn = self.variant.fn if fn is None else fn
        a = {n: _as(x, dtype) for n, x in arrays.items()}
        p = {n: _as(x, dtype) for n, x in self.params.items()}
        out = fn(a["q"], a["k"], a["v"], **{n: x for n, x in a.items() if n not in _BASE_KEYS},
                 **kwargs, **p, **self.options, xp=_np_compat())
        return np.asarray(out, dtype=np.float64) if dtype != "longdouble" else np.asarray(out)

    def apply_semantics(self, out: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
        """Set the rows with no key to attend to as the declared convention says."""
        if self.dead_rows is None or not self.dead_rows.any():
            return out
        dead = np.broadcast_to(self.dead_rows[..., None], out.shape)
        conv = self.semantics["fully_masked"]
        if conv == "mean":
            v = self.arrays["v"] if v is None else v
            fill = np.broadcast_to(np.mean(np.asarray(v, dtype=out.dtype), axis=-2,
                                           keepdims=True), out.shape)
        else:  # zeros, and an arbitrary but finite value for excluded rows
            fill = np.zeros_like(out)
        return np.where(dead, fill, out)

    def check(self, out_host: np.ndarray, *, output: str = "out") -> CaseResult:
        """Judge a kernel output (host, canonical layout) against the golden."""
        m = measure(out_host, self.golden, self.keep)
        return judge(self, m, output=output)


def judge(prep: Prepared, m, *, output="out", **extra) -> CaseResult:
    ratio = max(m.max_err / prep.tol_max if prep.tol_max > 0 else math.inf,
                m.rms_err / prep.tol_rms if prep.tol_rms > 0 else math.inf)
    if m.golden_nonfinite:
        verdict, why = "error", f"oracle: golden output has {m.golden_nonfinite} non-finite values"
    elif m.nonfinite:
        verdict, why, ratio = "fail", f"{m.nonfinite} NaN/Inf values where the golden is finite", math.inf
    elif m.max_err <= prep.tol_max and m.rms_err <= prep.tol_rms:
        verdict, why = "pass", ""
    else:
        verdict, why = "fail", ""
    return CaseResult(
        case=prep.case.id, dtype=prep.dtype, output=output, shapes=extra.pop("shapes", {}),
        max_err=m.max_err, rms_err=m.rms_err, tol_max=prep.tol_max, tol_rms=prep.tol_rms,
        ratio=ratio, worst=m.worst[:3], verdict=verdict, diagnosis=why,
        baseline_max=prep.baseline.max_err if prep.baseline else float("nan"),
        baseline_rms=prep.baseline.rms_err if prep.baseline else float("nan"),
        **extra,
    )


def _variant(variant):
    if isinstance(variant, str):
        from attn_ref.registry import get

        return get(variant)
    return variant


def prepare(case: Case, variant="softmax", dtype="float32", seed=0, *, tolerance=None,
            **semantics) -> Prepared:
    """Inputs, golden and tolerance of one case for one dtype (see :class:`Prepared`).

    Raises :class:`conformance.catalogue.NotApplicable` when the reference cannot take
    the case.
    """
    v = _variant(variant)
    sem = _semantics(semantics)
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype must be one of {tuple(MANTISSA_BITS)}, got {dtype!r}")
    tol = _tolerance(tolerance, dtype, "out")
    key = (v.name, id(v.fn), case, dtype, seed, tuple(sorted(sem.items())), tol)
    if key in _GOLDEN_CACHE:
        _GOLDEN_CACHE.move_to_end(key)
        return _GOLDEN_CACHE[key]
    prep = _prepare(case, v, dtype, seed, sem, tol)
    _GOLDEN_CACHE[key] = prep
    while len(_GOLDEN_CACHE) > _CACHE_SIZE:
        _GOLDEN_CACHE.popitem(last=False)
    return prep


def _tolerance(tolerance, dtype, output):
    if tolerance is None:
        return DEFAULTS[dtype]
    if isinstance(tolerance, Tolerance):
        return tolerance
    if isinstance(tolerance, dict):
        t = tolerance.get(output, tolerance.get(dtype, DEFAULTS[dtype]))
        if not isinstance(t, Tolerance):
            raise TypeError(f"tolerance values must be Tolerance objects, got {t!r}")
        return t
    raise TypeError(f"tolerance must be a Tolerance or a dict of them, got {tolerance!r}")


def _prepare(case, v, dtype, seed, sem, tol) -> Prepared:
    if v.self_attention and case.nq != case.nk:
        raise NotApplicable(f"variant {v.name} is self-attention only (Nq == Nk)")
    missing = case.needs - reference_features(v)
    if missing:
        raise NotApplicable(f"the {v.name} reference does not take {sorted(missing)}")
    arrays, kwargs = case.inputs(seed, dtype)
    arrays = {n: round_to(a, dtype) for n, a in arrays.items()}
    params = {}
    if v.params is not None:
        raw = v.params(seed, case.nq, case.nk, case.d, case.dv, dtype=np.float64,
                       device="cpu", xp=_np_compat())
        params = {n: round_to(np.asarray(x), dtype) if hasattr(x, "shape") else x
                  for n, x in raw.items()}
    options = dict(v.options)
    allowed = allowed_matrix(case, arrays, kwargs)
    dead = None
    if allowed is not None:
        b, h = case.batch
        dead = ~np.broadcast_to(allowed, (b, h, case.nq, case.nk)).any(-1)
    keep = None
    if dead is not None and sem["fully_masked"] == "excluded" and dead.any():
        keep = np.broadcast_to(~dead[..., None], (b, h, case.nq, case.dv))
    prep = Prepared(case, v, dtype, seed, sem, arrays, kwargs, params, options,
                    golden=None, keep=keep, dead_rows=dead, baseline=None, baseline_note="",
                    tol_max=0.0, tol_rms=0.0, tolerance=tol, golden_dtype="float64")
    try:
        gdt = "longdouble" if dtype == "float64" else "float64"
        try:
            gold = prep.reference(gdt)
        except Exception:
            if gdt != "longdouble":
                raise
            gdt, gold = "float64", prep.reference("float64")
    except NotApplicable:
        raise
    except Exception as exc:
        raise NotApplicable(f"the {v.name} reference cannot take this case: "
                            f"{type(exc).__name__}: {exc}") from exc
    prep.golden_dtype = gdt
    prep.golden = prep.apply_semantics(np.asarray(gold, dtype=np.float64))
    bdt = "float64" if dtype == "float64" else dtype
    try:
        bm = None
        for alt in _baselines(prep, bdt):
            with np.errstate(all="ignore"):
                m = measure(prep.apply_semantics(alt()), prep.golden, keep)
            if m.nonfinite:
                raise FloatingPointError(f"{m.nonfinite} non-finite values")
            if bm is None or (m.max_err, m.rms_err) > (bm.max_err, bm.rms_err):
                bm = m if bm is None else Metrics(**{**bm.__dict__, "max_err": max(
                    bm.max_err, m.max_err), "rms_err": max(bm.rms_err, m.rms_err)})
        prep.baseline = bm
        base_max, base_rms = bm.max_err, bm.rms_err
    except Exception as exc:
        # a plain implementation overflows or fails: the tolerance falls back to ulps
        prep.baseline_note = f"baseline in {dtype} unavailable ({exc}); tolerance from ulps"
        base_max = base_rms = 16 * _ulp(prep, dtype)
    mag = float(np.max(np.abs(prep.golden))) if prep.golden.size else 0.0
    if base_max > ILL_CONDITIONED * mag and mag > 0:
        # the plain implementation disagrees with the golden at the size of the output
        # itself (discrete choices of an approximate variant flip, or the dtype cannot
        # resolve the logits): no tolerance derived from it would mean anything
        raise NotApplicable(f"ill-conditioned in {dtype}: a plain {dtype} implementation is off "
                            f"by {base_max:.2g} on outputs of size {mag:.2g}")
    prep.tol_max, prep.tol_rms = tol.bounds(base_max, base_rms, mag, dtype)
    return prep


def _baselines(prep, dtype):
    """Plain implementations in ``dtype``; the baseline error is the largest of theirs.

    One rounding sample is a noisy estimate where the problem is ill-conditioned (large
    logits amplify the rounding of ``Q K^T``), so besides the reference as written the
    scale times ``log2(e)`` is also folded into ``q`` before the product (base-2 kernels
    such as FlashAttention's do this), and exact
    variants also run the blockwise online-softmax form.
    """
    yield lambda: prep.reference(dtype)
    if "scale" in reference_features(prep.variant) and prep.case.d > 0:
        # q * scale * log2(e) in the dtype, logits * ln(2): the rounding of a kernel that
        # works in base 2 (exp2) with the scale folded into q, as FlashAttention does
        scale = prep.kwargs.get("scale") or 1.0 / math.sqrt(prep.case.d)
        arrays = {**prep.arrays,
                  "q": round_to(prep.arrays["q"] * (scale * math.log2(math.e)), prep.dtype)}
        kwargs = {**prep.kwargs, "scale": math.log(2.0)}
        yield lambda: prep.reference(dtype, arrays=arrays, kwargs=kwargs)
    if prep.variant.exact:
        # the blockwise (FlashAttention) form rounds differently again
        from attn_ref.softmax import online_softmax_attention

        def online(q, k, v, /, **kw):
            kw = {n: x for n, x in kw.items() if n not in prep.options}
            return online_softmax_attention(q, k, v, block_q=64, block_k=32, **kw)

        yield lambda: prep.reference(dtype, fn=online)


def _ulp(prep, dtype):
    from .tolerance import ulp

    mag = float(np.max(np.abs(prep.golden))) if prep.golden.size else 0.0
    return ulp(mag, dtype)


# ---------------------------------------------------------------------------- layouts


def to_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """Canonical ``(B, H, N, d)`` -> ``layout``."""
    if layout == "bhnd":
        return x
    if layout == "bnhd":
        return np.swapaxes(x, 1, 2)
    if layout == "nd":
        return x[0, 0]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def from_layout(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "bhnd":
        return x
    if layout == "bnhd":
        return np.swapaxes(x, 1, 2)
    return x[None, None]


def _pair_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """A ``(B|1, H|1, Nq, Nk)`` mask or bias as the kernel takes it (head-major always)."""
    return x[0, 0] if layout == "nd" else x


# ------------------------------------------------------------------------------ runner


class _Progress:
    """``case i of n`` on a terminal once a run passes ~2 s; silent when piped or in CI."""

    def __init__(self, enabled=None, stream=None):
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = self.stream.isatty() and not os.environ.get("CI")
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.shown = False

    def update(self, i, n, label):
        if self.enabled and time.perf_counter() - self.t0 > 2.0:
            self.stream.write(f"\r\x1b[K[{i}/{n}] {label}"[:200])
            self.stream.flush()
            self.shown = True

    def done(self):
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


@dataclass
class _Ctx:
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


def _kernel_kwargs(ctx: _Ctx, prep: Prepared, convert):
    case = prep.case
    kw = {}
    for feat_name in sorted(case.needs):
        feat = FEATURES[feat_name]
        if feat_name not in ctx.kernel.features:
            raise NotApplicable(f"kernel does not declare {feat_name!r} "
                                f"(parameter {' / '.join(feat.params) or 'supports='})")
        pname = ctx.kernel.names[feat_name]
        if feat.declared_only or pname is None:
            continue
        ref_name = feat.params[0]
        if ref_name in prep.arrays:
            val = convert(_pair_layout(prep.arrays[ref_name], ctx.layout))
        elif ref_name in prep.kwargs:
            val = prep.kwargs[ref_name]
        else:
            continue
        if feat.to_kernel is not None:
            val = feat.to_kernel(val, case, ctx.semantics)
        kw[pname] = val
    for name, val in prep.params.items():
        kw[name] = convert(val) if isinstance(val, np.ndarray) else val
    for name, val in prep.options.items():
        if name in ctx.kernel.accepts:
            kw[name] = val
    return kw


def _applicable(ctx: _Ctx, case: Case):
    if ctx.layout == "nd" and (case.batch != (1, 1) or case.kv_batch is not None):
        raise NotApplicable("layout 'nd' takes one head; case has batch/head dimensions")
    missing = {f for f in case.needs if f not in ctx.kernel.features}
    if missing:
        raise NotApplicable(f"kernel does not declare {sorted(missing)}")


def _snapshot(ctx, x):
    return np.array(ctx.to_host(x), copy=True)


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def _lib_name(x):
    mod = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(mod, mod)


def _check_container(ctx: _Ctx, out, inputs: dict, prep: Prepared, want_shape):
    """Library, dtype, device, shape: returns an error string or ''."""
    if isinstance(ctx.backend, tuple):
        if tuple(np.shape(ctx.to_host(out))) != tuple(want_shape):
            return f"output shape {tuple(np.shape(ctx.to_host(out)))}, expected {tuple(want_shape)}"
        return ""
    import array_api_compat

    q = inputs["q"]
    if not array_api_compat.is_array_api_obj(out):
        return f"output is a {type(out).__name__}, expected a {ctx.backend.name} array"
    if _lib_name(out) != _lib_name(q):
        return f"output is a {_lib_name(out)} array, expected {_lib_name(q)} like the inputs"
    if str(out.dtype) != str(q.dtype):
        return f"output dtype {out.dtype}, expected {q.dtype} (the inputs' dtype)"
    dev_out, dev_in = str(array_api_compat.device(out)), str(array_api_compat.device(q))
    if dev_out != dev_in:
        return f"output on device {dev_out}, expected {dev_in} (the inputs' device)"
    if tuple(out.shape) != tuple(want_shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(want_shape)} ({ctx.layout})"
    return ""


def run_case(ctx: _Ctx, case: Case, dtype: str) -> list[CaseResult]:
    """Run one case in one dtype; never raises for a kernel's fault."""
    base = {"case": case.id, "dtype": dtype}
    try:
        _applicable(ctx, case)
        prep = prepare(case, ctx.variant, dtype, ctx.seed, tolerance=ctx.tolerance,
                       **ctx.semantics)
    except NotApplicable as exc:
        return [CaseResult.na(reason=str(exc), **base)]

    def convert(a):
        return ctx.to_kernel(a, dtype)

    try:
        kw = _kernel_kwargs(ctx, prep, convert)
    except NotApplicable as exc:
        return [CaseResult.na(reason=str(exc), **base)]
    inputs = {n: convert(to_layout(prep.arrays[n], ctx.layout)) for n in _BASE_KEYS}
    shapes = {n: tuple(np.shape(to_layout(prep.arrays[n], ctx.layout))) for n in _BASE_KEYS}
    snaps = {n: _snapshot(ctx, x) for n, x in inputs.items()}
    snaps.update({n: _snapshot(ctx, x) for n, x in kw.items() if hasattr(x, "shape")})
    t0 = time.perf_counter()
    try:
        with np.errstate(all="ignore"):
            out = ctx.kernel.fn(inputs["q"], inputs["k"], inputs["v"], **kw)
            if isinstance(out, tuple):
                out = out[0]
            host = ctx.to_host(out)  # forces asynchronous libraries to finish
    except Exception as exc:
        return [CaseResult.error(f"kernel raised {type(exc).__name__}: {exc}",
                                 time_s=time.perf_counter() - t0, shapes=shapes, **base)]
    elapsed = time.perf_counter() - t0
    want = to_layout(np.empty(prep.golden.shape, dtype=np.int8), ctx.layout).shape
    problem = _check_container(ctx, out, inputs, prep, want)
    if not problem:
        for n, x in list(inputs.items()) + [(n, x) for n, x in kw.items() if n in snaps]:
            if not _same(_snapshot(ctx, x), snaps[n]):
                problem = f"the kernel modified its input {n!r} in place"
                break
    if problem:
        return [CaseResult.error(problem, verdict="fail", time_s=elapsed, shapes=shapes, **base)]
    got = from_layout(np.asarray(host, dtype=np.float64), ctx.layout)
    res = prep.check(got)
    res.time_s = elapsed
    res.shapes = shapes
    if ctx.deterministic and res.verdict == "pass":
        again = ctx.to_host(_first(ctx.kernel.fn(inputs["q"], inputs["k"], inputs["v"], **kw)))
        if not _same(np.asarray(again), np.asarray(host)):
            res.verdict, res.diagnosis = "fail", "not deterministic: a second call differs"
    if elapsed > ctx.time_limit:
        res.verdict = "fail"
        res.diagnosis = (f"took {elapsed:.1f} s, over the time limit of {ctx.time_limit:g} s; "
                         + res.diagnosis).rstrip("; ")
    if res.verdict == "fail" and ctx.diagnose and not res.diagnosis.startswith("took"):
        from .diagnose import diagnose

        with contextlib.suppress(Exception), np.errstate(all="ignore"):
            words = diagnose(prep, got, res, rerun=lambda c: _rerun(ctx, c, dtype))
            if words:
                res.diagnosis = (res.diagnosis + "; " if res.diagnosis else "") + words
    if ctx.extra.get("grads"):
        from .grads import grad_results

        return [res] + grad_results(ctx, prep, inputs, kw, shapes, dtype)
    return [res]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _rerun(ctx, case, dtype):
    """Run the kernel on another case without diagnosing (for growth checks)."""
    sub = _Ctx(**{**ctx.__dict__, "diagnose": False, "deterministic": False})
    return run_case(sub, case, dtype)[0]


def _kernel_name(fn):
    mod = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}:{name}" if mod else name


def session(kernel, variant="softmax", /, *, backend, device=None, layout="bhnd", seed=0,
            supports=None, tolerance=None, deterministic=False, time_limit=60.0, diagnose=True,
            grads=False, backward=None, **semantics) -> _Ctx:
    """A prepared kernel: ``session(...).run(case, dtype) -> CaseResult`` (one case at a time)."""
    sem = _semantics(semantics)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    v = _variant(variant)
    if isinstance(backend, str):
        be, bname = B.load(backend), backend
    elif isinstance(backend, tuple) and len(backend) == 2 and all(map(callable, backend)):
        be, bname = backend, "custom"
    else:
        raise TypeError("backend must be a backend name or a (to_kernel, to_host) pair of "
                        f"functions, got {backend!r}")
    spec = KernelSpec.of(kernel, supports)
    if backward is not None and not callable(backward):
        raise TypeError(f"backward must be a callable (q, k, v, do, **kw) -> (dq, dk, dv), got {backward!r}")
    return _Ctx(spec, v, be, device, layout, sem, tolerance, deterministic, time_limit,
                diagnose, seed, name=_kernel_name(kernel), backend_name=bname,
                extra={"grads": bool(grads) or backward is not None, "backward": backward})


def verify(kernel, variant="softmax", /, *, backend, device=None, dtypes=("float32",),
           layout="bhnd", suite="standard", seed=0, supports=None, tolerance=None,
           deterministic=False, time_limit=60.0, diagnose=True, progress=None,
           search_examples=100, cases=None, grads=False, backward=None, **semantics) -> Report:
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
    suite : {"quick", "standard", "exhaustive"}
    seed : int
        Every input is drawn deterministically from ``seed`` and the case id.
    supports : dict, optional
        Feature overrides: ``{"broadcast": True, "mask": "attn_mask", "bias": False}``.
    tolerance : Tolerance or dict, optional
        Overrides :data:`conformance.tolerance.DEFAULTS` (per dtype or per output).
    deterministic : bool
        Call the kernel twice on each passing case; results must be bitwise equal.
    time_limit : float
        Seconds per call; a slower call fails (measured after it returns).
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
    **semantics
        ``fully_masked="zeros"|"mean"|"excluded"``, ``causal="top-left"|"bottom-right"|"both"``.

    Returns
    -------
    Report

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
                  **semantics)
    v, spec, sem, bname = ctx.variant, ctx.kernel, ctx.semantics, ctx.backend_name
    todo = list(cases) if cases is not None else _cases(None, suite)
    report = Report(kernel=ctx.name, variant=v.name, backend=bname, layout=layout,
                    dtypes=tuple(dtypes), suite=suite, seed=seed, semantics=sem,
                    features=sorted(spec.features), signature_known=spec.signature_known)
    prog = _Progress(progress)
    n = len(todo) * len(dtypes)
    i = 0
    try:
        for dt in dtypes:
            for case in todo:
                i += 1
                prog.update(i, n, f"{dt} {case.id}")
                report.results.extend(run_case(ctx, case, dt))
            if suite == "exhaustive" and cases is None:
                prog.update(i, n, f"{dt} searching")
                found = _search(ctx, dt, search_examples)
                if found is not None:
                    report.results.append(found)
    finally:
        prog.done()
    return report


def _search(ctx, dtype, examples):
    """Hypothesis search for a failing case, shrunk to the smallest that still fails."""
    try:
        from hypothesis import HealthCheck, Phase, find, settings
        from hypothesis.errors import NoSuchExample
    except ImportError as exc:
        raise RuntimeError("the exhaustive suite needs hypothesis (pip install hypothesis)") from exc
    from .catalogue import case_strategy

    def fails(case):
        r = run_case(_Ctx(**{**ctx.__dict__, "diagnose": False}), case, dtype)[0]
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
