"""One case in one dtype: rounded inputs, golden output, tolerance bounds, the verdict.

:func:`prepare` turns a :class:`conformance.catalogue.Case` into a :class:`Prepared`:

1. host inputs from the case (:meth:`conformance.catalogue.Case.inputs`) and the variant's
   extra parameters (projections, features), rounded to the kernel dtype;
2. golden output (float64, longdouble for float64 kernels) and the baseline of plain
   implementations in the kernel dtype (:func:`baselines`, :mod:`conformance.tolerance`);
3. the semantics the kernel declared (:data:`SEMANTICS`): rows with no key to attend to
   (``fully_masked``: ``"zeros"``, ``"mean"`` of V, or ``"excluded"`` from comparison)
   and the alignment of its ``causal=True`` (``causal``: ``"top-left"``,
   ``"bottom-right"``, or ``"both"`` for a kernel that takes ``"top-left"`` /
   ``"bottom-right"`` strings as attn_ref does).

:func:`judge` turns the measured error of an output into a
:class:`conformance.report.CaseResult`. The pytest plugin, ``export-vectors`` and
people's own tests reuse both.

Variant options
---------------
A variant's reference function may take keyword options that change the function it
computes (linear attention's ``feature_map`` and ``normalize``, Performer's ``kernel``,
a sparse pattern's ``window``...). :func:`with_options` returns the variant with some
of them set, after checking that its function takes them and accepts the values;
:func:`option_names` lists what may be set. The golden, the baselines, the diagnoses,
the gradient goldens and exported vectors all compute from ``Prepared.options``, so
they follow.

Extension point: ``SEMANTICS`` lists the declarable conventions and their defaults; a
new one is a dict entry plus its use in :meth:`Prepared.apply_semantics`.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import array_api_compat.numpy
import numpy as np

from .calling import reference_features
from .catalogue import case_gates
from .extras import BLOCK_SIZES, FLA_CHUNK, MAMBA2_CHUNK, RECURRENT, fp32_state_form
from .features import FEATURES, NotApplicable, allowed_matrix, default_scale
from .long import is_long, long_reference
from .report import CaseResult
from .ties import alternatives, moved, nearest
from .tolerance import (
    DEFAULTS,
    LOGITS_IN_DTYPE,
    LOGITS_IN_FLOAT32,
    LOW_PRECISION,
    MANTISSA_BITS,
    ROW_SLACK,
    LowPrecisionArray,
    Tolerance,
    as_dtype,
    compared_count,
    elementwise_ulp_rms,
    gemm_in_dtype,
    largest_errors,
    lp_array,
    measure,
    param_dtype,
    plain_array,
    ratios,
    round_to,
    row_errors,
    stochastic_array,
    ulp,
)

__all__ = ["SEMANTICS", "BASE_KEYS", "ILL_CONDITIONED", "Prepared", "prepare", "judge", "verdict_of",
           "worst_of", "row_words",
           "Form", "FORMS", "register_forms", "forms", "baselines", "precision",
           "FLA_CHUNK", "LSE_VARIANTS", "SPARSE_PATTERNS", "lse_form",
           "lse_softmax_attention", "softmax_pattern",
           "parse_semantics", "resolve_tolerance", "as_dtype", "variant_of",
           "option_names", "with_options", "freeze"]

SEMANTICS = {
    "fully_masked": ("zeros", ("zeros", "mean", "excluded")),
    "causal": ("top-left", ("top-left", "bottom-right", "both")),
}
# the three arrays every case has; the others (mask, bias, ...) are keyword inputs
BASE_KEYS = ("q", "k", "v")
# a case whose baseline error exceeds this fraction of max|golden| is not applicable
ILL_CONDITIONED = 0.25


def parse_semantics(given: dict) -> dict:
    """The declared conventions with defaults filled in; unknown keys or values raise."""
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

# -------------------------------------------------------------------------- prepared


_GOLDEN_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 256



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
        The variant's options: registered defaults (block sizes, ...) and those set with
        ``options=`` (:func:`with_options`); passed to the reference and, when its
        signature takes them, to the kernel.
    golden : float64 array (B, H, Nq, dv)
    keep : bool array or None
        Elements compared (False on excluded rows).
    baseline : Metrics
        Error of the plain implementation in ``dtype``.
    tol_max, tol_rms : float
    tol_rows : float array (B, H, Nq) or None
        The largest error each output row may have (:meth:`Tolerance.row_bounds`); None
        where the baseline is unavailable.
    golden_dtype : str
        ``"longdouble"`` or ``"float64"``.
    plain : Metrics or None
        Error of the plain implementation alone (the first of :func:`forms`): in
        float16/bfloat16 an fp32-accumulating one. ``precision`` in the report is the
        kernel's error over this one's.
    tie_set : conformance.ties.Ties or None
        The near ties of a discrete choice the dtype cannot resolve (clustered_topk's
        top-k selections, routing's, the k-means assignments of clustered and
        clustered_topk, reformer's hash buckets) and every other admissible choice at each.
    ties : list
        Per near tie, what each other admissible choice changes in the golden: the
        kernel's output is judged against the nearest admissible golden
        (:meth:`nearest_golden`).
    """

    case: Any  # conformance.catalogue.Case
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
    #: error of the plain (first) form alone: the precision column's denominator
    plain: Any = None
    #: each output row's own bound, (B, H, Nq) (Tolerance.row_bounds), or None
    tol_rows: Any = None
    #: goldens of extra outputs computed with the output (``"lse"`` of a long case)
    golden_extras: dict = field(default_factory=dict)
    #: near ties of a discrete choice (conformance.ties.Ties, or None), and the
    #: difference each other admissible choice makes to the golden, per tie
    tie_set: Any = None
    ties: list = field(default_factory=list)
    #: the goldens of choices taken together at several ties, by their picks
    #: (:meth:`conformance.ties.Ties.combined`), or None
    tie_golden: Any = None

    @property
    def tie_conflicts(self) -> list | None:
        """Per near tie, the ties it excludes (:attr:`conformance.ties.Ties.conflicts`)."""
        return None if self.tie_set is None else self.tie_set.conflicts

    @property
    def tie_exact(self) -> int:
        """How many choices :func:`conformance.ties.nearest` recomputes a step
        (:attr:`conformance.ties.Ties.exact`; 0: the differences add)."""
        return 0 if self.tie_set is None else self.tie_set.exact

    # -- the reference in any NumPy dtype, used for golden, baseline and diagnosis
    def reference(self, dtype="float64", *, arrays=None, kwargs=None, fn=None, options=None, xp=None,
                  host=None):
        arrays = self.arrays if arrays is None else arrays
        kwargs = self.kwargs if kwargs is None else kwargs
        options = self.options if options is None else options
        fn = self.variant.fn if fn is None else fn
        host = host or (lambda x: x)
        a = {n: host(as_dtype(x, dtype)) for n, x in arrays.items()}
        p = {n: host(as_dtype(x, param_dtype(n, dtype))) for n, x in self.params.items()}
        out = fn(a["q"], a["k"], a["v"], **{n: x for n, x in a.items() if n not in BASE_KEYS},
                 **kwargs, **p, **options, xp=LOGITS_IN_FLOAT32 if xp is None else xp)
        return np.asarray(out, dtype=np.float64) if dtype != "longdouble" else np.asarray(out)

    @property
    def scale(self) -> float:
        """The case's explicit logit scale, or the softmax default ``1/sqrt(d)``."""
        s = self.kwargs.get("scale")
        return default_scale(self.case.d) if s is None else float(s)

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

    def nearest_golden(self, out_host: np.ndarray) -> np.ndarray:
        """The golden of the admissible choice nearest to ``out_host`` at each near tie
        (:func:`conformance.ties.nearest`); the golden itself where there is none."""
        together = None if self.tie_golden is None else (lambda p: self.tie_golden(p)["out"])
        return nearest(out_host, self.golden, self.ties, self.keep, together, self.tie_conflicts,
                       self.tie_exact)

    def check(self, out_host: np.ndarray, *, output: str = "out") -> CaseResult:
        """Judge a kernel output (host, canonical layout) against the golden (of the
        admissible choice nearest to it, where a discrete choice is a near tie)."""
        m = measure(out_host, self.nearest_golden(out_host), self.keep, self.tol_rows)
        return judge(self, m, output=output)


def verdict_of(m, tol_max, tol_rms, what="output"):
    """``(verdict, diagnosis, ratio)`` of measured errors ``m`` against the bounds.

    A non-finite golden is an oracle error, never a pass; a kernel value that is NaN/Inf
    where the golden is finite fails whatever the bounds. ``ratio`` is
    ``max(max_err / tol_max, rms_err / tol_rms, row_ratio)`` (infinite for non-finite values;
    0 for an error of exactly 0 against a bound of 0); ``m.row_ratio``, the worst row's error
    over that row's bound, fails a kernel within the case's bounds.
    ``what`` names the output in the message (``"output"``, ``"dq"``...).
    """
    # a zero bound (a golden of exact zeros: every query of a causal compressed or pooled
    # case before its first whole block) met exactly is a ratio of 0, not inf (ratios)
    ratio = max(float(ratios(m.max_err, tol_max)), float(ratios(m.rms_err, tol_rms)), m.row_ratio)
    if m.golden_nonfinite:
        return "error", f"oracle: golden {what} has {m.golden_nonfinite} non-finite values", ratio
    if m.nonfinite:
        return "fail", f"{m.nonfinite} NaN/Inf values where the golden is finite", math.inf
    if m.max_err <= tol_max and m.rms_err <= tol_rms:
        if m.row_ratio <= 1.0:
            return "pass", "", ratio
        return "fail", row_words(m, what), ratio
    return "fail", "", ratio


def row_words(m, what="output") -> str:
    """Why a kernel within the case's bounds fails one row's (:attr:`Prepared.tol_rows`)."""
    at = tuple(m.row_worst)
    where = (f"batch {at[0]}, head {at[1]}, row {at[2]}" if len(at) == 3 else
             ", ".join(map(str, at)))
    whole = "the case's" if what == "output" else f"{what}'s"
    return (f"{what} row ({where}) errs {m.row_err:.3g}, above its own "
            f"bound {m.row_tol:.3g} ({whole} bound is set by larger rows)")


def worst_of(m, tol_max, tol_rms) -> tuple:
    """Where measured errors ``m`` are worst: the largest error's index, or the row's
    (``m.row_worst``) when only a row's own bound fails (:func:`verdict_of`)."""
    on_row = (not m.nonfinite and m.max_err <= tol_max and m.rms_err <= tol_rms
              and m.row_ratio > 1.0)
    return tuple((m.row_worst if on_row else m.worst)[:3])


def judge(prep: Prepared, m, *, output="out", **extra) -> CaseResult:
    verdict, why, ratio = verdict_of(m, prep.tol_max, prep.tol_rms)
    return CaseResult(
        case=prep.case.id, dtype=prep.dtype, output=output, shapes=extra.pop("shapes", {}),
        max_err=m.max_err, rms_err=m.rms_err, tol_max=prep.tol_max, tol_rms=prep.tol_rms,
        ratio=ratio, worst=worst_of(m, prep.tol_max, prep.tol_rms), verdict=verdict, diagnosis=why,
        baseline_max=prep.baseline.max_err if prep.baseline else float("nan"),
        baseline_rms=prep.baseline.rms_err if prep.baseline else float("nan"),
        precision=precision(m, prep.plain),
        **extra,
    )


def precision(m, plain) -> float:
    """The kernel's max error over the plain implementation's (nan when both are 0).

    About 1 for a kernel that rounds like a plain fp32-accumulating implementation in
    its dtype; several times that for one that accumulates ``P V`` and the row sum in
    float16 16 keys at a time at ``N = 4096`` (measured: 4.7).
    """
    if plain is None or m.nonfinite:
        return math.inf if m.nonfinite else math.nan
    if plain.max_err > 0:
        return m.max_err / plain.max_err
    return math.nan if m.max_err == 0 else math.inf


def variant_of(variant):
    """A registered variant from its name (a :class:`attn_ref.registry.Variant` passes through)."""
    if isinstance(variant, str):
        from attn_ref.registry import get

        return get(variant)
    return variant


# reference keywords that every function of the catalogue takes but no option sets
_NOT_OPTIONS = ("xp",)
# the plain input of the trial call that checks option values (self-attention, 8 x 4)
_TRIAL_N, _TRIAL_D = 8, 4


def _reference_keywords(fn) -> list:
    """Keyword parameters of a reference function, in signature order."""
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [n for n, p in inspect.signature(fn).parameters.items()
            if p.kind in kinds and n not in BASE_KEYS and n not in _NOT_OPTIONS]


def _trial_params(v) -> dict:
    """The variant's extra arguments for the trial input (arrays and plain values)."""
    if v.params is None:
        return {}
    return v.params(0, _TRIAL_N, _TRIAL_N, _TRIAL_D, _TRIAL_D, dtype=np.float64, device="cpu",
                    xp=LOGITS_IN_FLOAT32)


def _distinct_value_taps(raw, seed, options):
    """Memory-compressed attention's value kernel with a different scalar per tap.

    The registered parameters compress the values with the averaging kernel
    ``W_v[t] = I / c``, which is what a kernel that mean-pools the values (or ignores
    ``v_weight``) computes: it passed every case. ``W_v[t] = a_t I`` with
    ``a_t = (1 + u_t) / c``, ``u_t`` uniform in ``[-1/2, 1/2]`` from the seed, keeps a
    scalar per tap (so ``compressed_weights``, the implied matrix, is defined) and is
    another function than the mean.
    """
    vw = raw.get("v_weight")
    if vw is None or vw.ndim != 3:
        return raw
    c, dv = vw.shape[0], vw.shape[-1]
    taps = (1.0 + np.random.default_rng(seed).uniform(-0.5, 0.5, c)) / c
    return {**raw, "v_weight": taps[:, None, None] * np.eye(dv)}


def _unequal_centroids(raw, seed, options):
    """Plain routing's centroids scaled to lengths ``2^u``, ``u`` uniform in ``[-1, 1]``
    from the seed, one per centroid.

    Plain routing (``balanced=False``) sends a token ``x`` to the centroid nearest
    ``x / |x|``, ``argmin_c |mu_c|^2 - 2 mu_c . x / |x|``. On the registered unit
    centroids that is also the largest ``mu_c . x`` and the centroid nearest ``x``
    itself, so kernels assigning by either passed every case. Balanced routing ranks
    each centroid's tokens by ``mu_c . x / |x|``, which no length changes: its
    centroids stay as registered.
    """
    mu = raw.get("centroids")
    if options.get("balanced", True) or mu is None:
        return raw
    lengths = 2.0 ** np.random.default_rng(seed).uniform(-1.0, 1.0, mu.shape[-2])
    return {**raw, "centroids": np.asarray(mu) * lengths[:, None]}


#: Changes the oracle makes to a variant's registered parameters, so that its cases can
#: tell apart the mistakes a kernel makes: ``{variant: fn(params, seed, options) ->
#: params}``, ``options`` the variant's with the case's.
PARAM_CHANGES = {"compressed": _distinct_value_taps, "routing": _unequal_centroids}


def unit_rows(x):
    """``x`` with each row scaled to unit l2 norm (zero rows stay zero), float64: the
    ``q`` and ``k`` of the delta rule's cases under ``qk_l2norm=False``.

    The option says the kernel takes ``q`` and ``k`` normalised already (a model calls
    fla's ``l2norm`` before the kernel; fla's tests pass ``F.normalize(x, dim=-1)``).
    The cases' N(0, 1) rows have norm about ``sqrt(d)``: ``I - beta k^T k`` then
    expands, and the state grows geometrically (an independent audit's correct kernels,
    and the reference's own token loop, overflowed float32 on the long and slow-decay
    cases: the golden had 18,928 non-finite values).
    """
    x = np.asarray(x, dtype=np.float64)
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    return x / np.maximum(norm, np.finfo(np.float64).tiny)


def causal_by_default(v) -> bool:
    """Whether ``v``'s reference is causal when no ``causal=`` is given (``strided``,
    ``fixed``): then a case that is not causal passes ``causal=False`` to the reference
    and to a kernel with a ``causal`` parameter."""
    try:
        p = inspect.signature(v.fn).parameters.get("causal")
    except (TypeError, ValueError):
        return False
    return p is not None and p.default is not inspect.Parameter.empty and bool(p.default)


def _case_keywords(v) -> set:
    """Reference keywords that the cases set (mask, causal, scale, ...), unless the
    variant registers one of them as its own option (``local``'s integer ``window``)."""
    return {f.params[0] for f in FEATURES.values() if f.params} - set(v.options)


#: keywords that fix a discrete choice of the reference (clustered_topk's
#: ``topk_keys``, routing's ``query_routes`` and ``key_routes`` or, plain,
#: ``query_clusters`` and ``key_clusters``, the k-means ``assignments`` of clustered and
#: clustered_topk, reformer's hash ``buckets``): the oracle's handle
#: on a near tie's other admissible choice (:mod:`conformance.ties`), per case and head,
#: never an option of what a kernel computes
TIE_KEYWORDS = frozenset({"topk_keys", "query_routes", "key_routes", "assignments",
                          "query_clusters", "key_clusters", "buckets"})


def option_names(variant) -> tuple:
    """The options of ``variant`` that ``verify(..., options=...)`` may set.

    Every keyword parameter of the reference function except those each case sets (the
    kernel features: ``mask``, ``causal``, ``scale``, ...), the arrays the variant
    draws from the seed (projections, random features) and ``xp``. Plain values the
    variant derives from the case (``num_segments``, ``num_landmarks``...) may be set:
    the option then replaces the derived value on every case.

    Examples
    --------
    >>> from conformance.judging import option_names
    >>> option_names("linear")
    ('feature_map', 'order', 'chunk_size', 'block_size', 'normalize', 'eps')
    """
    v = variant_of(variant)
    arrays = {n for n, x in _trial_params(v).items() if hasattr(x, "shape")}
    skip = _case_keywords(v) | arrays | TIE_KEYWORDS
    return tuple(n for n in _reference_keywords(v.fn) if n not in skip)


def with_options(variant, options=None):
    """``variant`` with some of its options set: the function the kernel computes.

    Parameters
    ----------
    variant : str or attn_ref.registry.Variant
    options : dict, optional
        ``{name: value}`` for names among :func:`option_names`; they replace the
        registered defaults (``Variant.options``). A value may be anything the reference
        function accepts (``feature_map="identity"`` or an array-API callable).

    Returns
    -------
    attn_ref.registry.Variant
        The same variant (same name and function) with ``options`` merged into its
        ``options``; ``variant`` itself when ``options`` is empty.

    Raises
    ------
    TypeError
        ``options`` is not a dict with string keys.
    ValueError
        A name the reference function does not take, one a case sets, or a value the
        function refuses on a plain 8 x 4 input (its message is kept); a fixed block
        ``layout`` is tried on the input it is for (rows x ``block_size`` queries,
        columns x ``block_size`` keys), as only the cases of that length can take it.
    """
    v = variant_of(variant)
    if not options:
        return v
    if not isinstance(options, dict) or not all(isinstance(n, str) for n in options):
        raise TypeError(f"options must be a dict of option name -> value, got {options!r}")
    fn_name = f"{getattr(v.fn, '__module__', '')}.{getattr(v.fn, '__name__', repr(v.fn))}"
    allowed = option_names(v)
    for name in options:
        if name in _case_keywords(v):
            raise ValueError(f"option {name!r} of variant {v.name!r} is set by each case (the "
                             f"{name!r} feature), not by options=; settable options: "
                             f"{', '.join(allowed) or 'none'}")
        if name not in allowed:
            raise ValueError(f"variant {v.name!r} ({fn_name}) takes no option {name!r}; its "
                             f"options: {', '.join(allowed) or 'none'}")
    merged = replace(v, options={**v.options, **options})
    rng = np.random.default_rng(0)
    params, opts = _split_params(_trial_params(v), merged.options)
    nq, nk = _trial_lengths(options.get("layout"), opts.get("block_size", params.get("block_size")))
    q, k, val = (rng.standard_normal((1, 1, n, _TRIAL_D)) for n in (nq, nk, nk))
    try:
        with np.errstate(all="ignore"):
            v.fn(q, k, val, **params, **opts, xp=LOGITS_IN_FLOAT32)
    except Exception as exc:
        shown = ", ".join(f"{n}={x!r}" for n, x in options.items())
        raise ValueError(f"variant {v.name!r} ({fn_name}) refuses options {shown}: "
                         f"{type(exc).__name__}: {exc}") from exc
    return merged


def _trial_lengths(layout, block_size):
    """``(Nq, Nk)`` of the trial input: 8 and 8, or those a fixed block layout is for (a
    layout of HuggingFace's Reformer ``LocalSelfAttention`` chunks, say, is one length's)."""
    if layout is None or not isinstance(block_size, int):
        return _TRIAL_N, _TRIAL_N
    try:
        shape = np.shape(np.asarray(layout, dtype=bool))
    except (TypeError, ValueError):
        return _TRIAL_N, _TRIAL_N
    if len(shape) != 2 or not all(shape):
        return _TRIAL_N, _TRIAL_N
    return shape[0] * block_size, shape[1] * block_size


def _split_params(params, options):
    """Options that name a plain derived parameter replace it there (it is then passed
    wherever the parameters go); the rest stay options."""
    params = dict(params)
    rest = {}
    for n, x in options.items():
        if n in params and not hasattr(params[n], "shape"):
            params[n] = x
        else:
            rest[n] = x
    return params, rest


def freeze(x):
    """A hashable, deterministic stand-in for an option value (cache keys, reports).

    Lists, tuples and dicts become tuples; a callable stays itself (hashed by identity)
    but prints as ``module.qualname``; anything else unhashable becomes its ``repr``.
    """
    if isinstance(x, dict):
        return tuple(sorted((str(n), freeze(y)) for n, y in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(freeze(y) for y in x)
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


def prepare(case, variant="softmax", dtype="float32", seed=0, *, tolerance=None, options=None,
            **semantics) -> Prepared:
    """Inputs, golden and tolerance of one case for one dtype (see :class:`Prepared`).

    ``options`` sets variant options (:func:`with_options`); a variant returned by
    :func:`with_options` carries its own.

    Raises :class:`conformance.catalogue.NotApplicable` when the reference cannot take
    the case.
    """
    v = with_options(variant_of(variant), options)
    sem = parse_semantics(semantics)
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype must be one of {tuple(MANTISSA_BITS)}, got {dtype!r}")
    tol = resolve_tolerance(tolerance, dtype, "out")
    # the variant's forms too: their errors are the tolerance, and a register_forms after a
    # verify took no effect on the cases cached before it
    key = (v.name, id(v.fn), freeze(v.options), case, dtype, seed, tuple(sorted(sem.items())), tol,
           FORMS.get(v.name))
    if key in _GOLDEN_CACHE:
        _GOLDEN_CACHE.move_to_end(key)
        return _GOLDEN_CACHE[key]
    prep = _prepare(case, v, dtype, seed, sem, tol)
    _GOLDEN_CACHE[key] = prep
    while len(_GOLDEN_CACHE) > _CACHE_SIZE:
        _GOLDEN_CACHE.popitem(last=False)
    return prep


def resolve_tolerance(tolerance, dtype, output):
    """The :class:`Tolerance` of one output: the default, a single override, or a per-output/dtype dict."""
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
    family = getattr(case, "family", None)
    if family is not None and family != v.family:
        raise NotApplicable(f"a case of the {family} family; variant {v.name} is of the "
                            f"{v.family} family")
    if not case.belongs_to(v):
        raise NotApplicable(f"a case of variant {case.variant}, not {v.name}")
    if v.self_attention and case.nq != case.nk:
        raise NotApplicable(f"variant {v.name} is self-attention only (Nq == Nk)")
    if v.causal_only and case.causal is None:
        raise NotApplicable(f"variant {v.name} is causal by construction; the case is not causal")
    missing = case.needs - reference_features(v)
    if missing:
        raise NotApplicable(f"the {v.name} reference does not take {sorted(missing)}")
    arrays, kwargs = case.inputs(seed, dtype)
    if not kwargs.get("causal") and causal_by_default(v):
        # strided and fixed default to the Sparse Transformer's autoregressive pattern: a
        # case that is not causal must say so, or its golden is the causal one (a kernel
        # computing the non-causal pattern, as told, failed every such case)
        kwargs = {**kwargs, "causal": False}
    arrays = {n: round_to(a, dtype) for n, a in arrays.items()}
    params, case_options = {}, dict(case.options)
    if v.params is not None:
        # a case's option that the parameters are drawn from (block_sparse's block_size:
        # its layout has one entry per block) goes to the params function
        # (keyword-only: the positional seed and sizes are the oracle's; a case's seed
        # option replaces the drawn parameter below, as any option naming one does)
        keyword = {n for n, p in inspect.signature(v.params).parameters.items()
                   if p.kind is p.KEYWORD_ONLY}
        derived = {n: case_options.pop(n) for n in list(case_options) if n in keyword}
        raw = v.params(seed, case.nq, case.nk, case.d, case.dv, dtype=np.float64,
                       device="cpu", xp=LOGITS_IN_FLOAT32, **v.batch_keyword(case.batch), **derived)
        raw = PARAM_CHANGES.get(v.name, lambda raw, seed, options: raw)(
            raw, seed, {**v.options, **dict(case.options)})
        if case.param("gate_normalizer") is not None and "g" in raw:
            # the slow-decay cases: long memory (conformance.catalogue, GATE_NORMALIZER)
            raw = {**raw, "g": np.asarray(raw["g"]) / case.param("gate_normalizer")}
        if case.param("gates") is not None:
            # the strong-gate cases (conformance.catalogue.case_gates)
            if "g" not in raw:
                raise NotApplicable(f"a case of log gates; variant {v.name} takes none")
            raw = {**raw, "g": case_gates(case, raw["g"], seed)}
        params = {n: round_to(np.asarray(x), param_dtype(n, dtype)) if hasattr(x, "shape") else x
                  for n, x in raw.items()}
    params, options = _split_params(params, {**v.options, **case_options})
    if options.get("qk_l2norm") is False:
        arrays = {**arrays, **{n: round_to(unit_rows(arrays[n]), dtype) for n in ("q", "k")}}
    allowed = allowed_matrix(case, arrays, kwargs)
    dead = None
    if allowed is not None:
        b, h = case.batch
        dead = ~np.broadcast_to(allowed, (b, h, case.nq, case.nk)).any(-1)
    keep = None
    if dead is not None and sem["fully_masked"] == "excluded" and dead.any():
        keep = np.broadcast_to(~dead[..., None], (b, h, case.nq, case.dv))
        if not keep.any():
            # nothing left to compare: a verdict of no values would read as a pass
            raise NotApplicable("every query row is fully masked and fully_masked='excluded': "
                                "no value is judged")
    prep = Prepared(case, v, dtype, seed, sem, arrays, kwargs, params, options,
                    golden=None, keep=keep, dead_rows=dead, baseline=None, baseline_note="",
                    tol_max=0.0, tol_rms=0.0, tolerance=tol, golden_dtype="float64")
    try:
        gdt = "longdouble" if dtype == "float64" else "float64"
        if is_long(case):
            # past one tile's memory: golden and lse on Dask, in float64 (conformance.long)
            gdt = "float64"
            gold, prep.golden_extras["lse"] = long_reference(prep)
        else:
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
    if not is_long(case):
        # a discrete choice within the dtype's rounding: the golden of each other
        # admissible one (conformance.ties), before the baselines, which choose too
        prep.tie_set = alternatives(prep)
        if prep.tie_set is not None:
            def run(o):
                return {"out": prep.apply_semantics(np.asarray(
                    prep.reference(gdt, options={**prep.options, **o}), dtype=np.float64))}

            deltas = prep.tie_set.deltas(run, {"out": prep.golden}, rows=True)
            prep.ties = [[d["out"] for d in opts] for opts in deltas]
            prep.tie_golden = prep.tie_set.combined(run)
            if prep.tie_set.far:
                # ties of more keys than were enumerated: the rows their selection moves
                # are left out, as dead rows are
                still = ~(moved(run(prep.tie_set.far_keywords())["out"], prep.golden,
                                size=float(np.max(np.abs(prep.arrays["v"]), initial=0.0)))
                          | prep.tie_set.loose_rows(prep.golden.shape))
                keep = still if keep is None else keep & still
                prep.keep = keep
                if not keep.any():
                    raise NotApplicable(f"every output row is left out: its centroid's top-k "
                                        f"selection is a tie of more keys than {dtype} resolves")
                if not np.any(prep.golden[np.broadcast_to(keep, prep.golden.shape)]) and \
                        np.any(prep.golden):
                    # what is left is the zeros of queries no centroid takes: a pass on
                    # those alone would read as a verdict on the routing
                    raise NotApplicable(f"every output row left judged is zero: the others are "
                                        f"left out, their selection a tie of more tokens than "
                                        f"{dtype} resolves")
    bdt = "float64" if dtype == "float64" else dtype
    base_rows = None
    try:
        bm = None
        for alt in baselines(prep, bdt):
            with np.errstate(all="ignore"):
                out = alt()
                if out is None:  # a form that does not apply after all (Form.run)
                    continue
                out = prep.apply_semantics(out)
                near = prep.nearest_golden(out)
                m = measure(out, near, keep)
                rows = row_errors(out, near, keep)
            base_rows = rows if base_rows is None else np.maximum(base_rows, rows)
            if m.nonfinite:
                raise FloatingPointError(f"{m.nonfinite} non-finite values")
            if prep.plain is None:
                prep.plain = m
            bm = m if bm is None else largest_errors((bm, m))
        prep.baseline = bm
        base_max, base_rms = bm.max_err, bm.rms_err
    except ArithmeticError as exc:
        # a plain implementation overflows (float16 feature maps): the tolerance falls
        # back to ulps. Only then: a baseline that fails for another reason is a bug of
        # the oracle, and falling back would hide it behind a loose bound (float16 masks
        # once fell back this way, 10x the baseline's error).
        prep.baseline_note = f"baseline in {dtype} unavailable ({exc}); tolerance from ulps"
        base_max = base_rms = 16 * _ulp(prep, dtype)
        base_rows = None
    mag = float(np.max(np.abs(prep.golden))) if prep.golden.size else 0.0
    if base_max > ILL_CONDITIONED * mag and mag > 0:
        # the plain implementation disagrees with the golden at the size of the output
        # itself (discrete choices of an approximate variant flip, or the dtype cannot
        # resolve the logits): no tolerance derived from it would mean anything
        raise NotApplicable(f"ill-conditioned in {dtype}: a plain {dtype} implementation is off "
                            f"by {base_max:.2g} on outputs of size {mag:.2g}")
    floor_mag = mag
    if dtype in ("float32", "float64") and prep.arrays["v"].size:
        # Each output is a weighted sum of rows of V: its rounding is in units of the
        # terms (|v|), not of the sum, which a long causal row makes small. The max floor
        # sits at the ulp of max|v| (torch's float64 sums over 4096 keys err ~5 ulps of
        # the output where NumPy's pairwise sums err ~1: a false fail at ulp(max|out|)).
        floor_mag = max(mag, float(np.max(np.abs(prep.arrays["v"]))))
    prep.tol_max, prep.tol_rms = tol.bounds(base_max, base_rms, floor_mag, dtype,
                                            elementwise_ulp_rms(prep.golden, dtype, keep),
                                            compared_count(prep.golden, keep))
    if base_rows is not None and prep.golden.ndim >= 2:
        # each row by the maximum's rule too, at its own size (float32/float64: the
        # floor at the case's, max|v| at least, as a row's rounding is in units of its terms)
        prep.tol_rows = tol.row_bounds(base_rows, prep.golden, prep.tol_max, floor_mag, dtype,
                                       keep=keep, slack=ROW_SLACK if dtype in LOW_PRECISION else 1.0)
    return prep


#: How many draws of stochastic rounding join the baselines of a variant whose rounding
#: is amplified in a direction that depends on its pattern (Nystrom's pseudo-inverse):
#: its forward's forms (:class:`Form` ``draw``) and its VJP's (:mod:`conformance.grads`).
ROUNDING_DRAWS = 4


def rounding_draw(prep, draw: int):
    """``host(x)``: a float16/bfloat16 input (a :class:`LowPrecisionArray`) viewed as a
    :func:`~conformance.tolerance.stochastic_array` whose every result rounds at random,
    seeded by the case, the seed and ``draw``; anything else as it is.

    Where rounding is amplified by much and in a direction its pattern decides, a correct
    kernel's error is one draw from a wide distribution: the round-to-nearest baselines
    are other single draws, and a few draws of stochastic rounding show its spread."""
    cls = stochastic_array(prep.dtype, (zlib.crc32(f"{prep.case.id}/rounding".encode()), prep.seed, draw))

    def host(x):
        return x.view(cls) if isinstance(x, LowPrecisionArray) else x

    return host


@dataclass(frozen=True)
class Form:
    """One way of computing a variant's function; forms differ only in rounding.

    A baseline is the error of a plain implementation in the kernel dtype. One rounding
    sample is a noisy estimate where the problem is ill-conditioned (large logits
    amplify the rounding of ``Q K^T``), so the baseline is the largest error over the
    variant's forms (:data:`FORMS`). Each form must compute *exactly* the variant's
    function - in exact arithmetic its output equals the reference's - or its "rounding
    error" would be the distance between two functions (``tests/
    test_conformance_tolerance.py`` checks every form in float64).

    Attributes
    ----------
    name : str
    options : tuple of (key, value)
        Overrides of the variant's options that leave the function unchanged (block
        sizes, the order of summation).
    fold_scale : bool
        Fold ``scale * log2(e)`` into ``q`` (rounded to the dtype) and use logits scale
        ``ln 2``: the rounding of a kernel that works in base 2 (``exp2``) as
        FlashAttention does. The same function only where the logits are
        ``scale * q . k`` and ``q`` enters nowhere else but linearly.
    split_scale : bool
        Multiply ``q`` and ``k`` by ``sqrt(scale)`` each (both rounded to the dtype) and
        use logits scale 1: the rounding of a kernel that scales both by ``d**-0.25``, as
        the Nystromformer paper and HuggingFace's ``NystromformerSelfAttention`` do. The
        same function only where ``q`` and ``k`` enter linearly and the logits are
        ``scale * q . k``.
    scale_q : bool
        Multiply ``q`` by the scale (rounded to the dtype) and use logits scale 1: the
        rounding of a kernel that scales its queries first (lucidrains'
        ``q = q * self.scale``). The same function under the conditions of
        ``split_scale``.
    fn : callable, optional
        Another function with the reference's signature (the online-softmax form).
    blockwise : bool
        Carries a running accumulator across key blocks in the array dtype. In float16
        and bfloat16 such a form accumulates in low precision, which the oracle must
        fail, so it is no baseline there.
    """

    name: str
    options: tuple = ()
    fold_scale: bool = False
    split_scale: bool = False
    scale_q: bool = False
    fn: Any = None
    blockwise: bool = False
    applies: Any = None  # applies(prep) -> bool; None: every case
    # q, k, v moved by one unit in the last place of the kernel dtype (random signs,
    # seeded): the sensitivity of the function itself to rounding at that size, which
    # every implementation faces and a single rounding sample can miss on rows whose
    # normaliser nearly cancels (sign-indefinite feature maps)
    perturb: bool = False
    # float16/bfloat16: every operation in the dtype, the clips included
    # (:data:`conformance.tolerance.LOGITS_IN_DTYPE`). On the plain namespace a clip
    # (attn_ref clips logits and exponents to the dtype's range) drops the rounding
    # wrapper, and everything after it - softmax weights, FAVOR+ features, Nystrom's
    # pseudo-inverse - runs in float32: far more accurate than the variant run in the
    # dtype on torch or JAX (attn_ref's own Performer on torch float16 erred 1.17 on
    # outputs of 2.3, d = 80, against 0.0054 for that form).
    in_dtype: bool = False
    # with in_dtype, every result rounded stochastically instead of to nearest: draw
    # ``draw`` of a rounding pattern (:func:`rounding_draw`)
    draw: int | None = None

    @property
    def moves_scale(self) -> bool:
        """The form moves the logit scale into ``q`` (and ``k``): the same function only for
        a variant that takes a scale (:func:`forms` leaves it out elsewhere)."""
        return self.fold_scale or self.split_scale or self.scale_q

    def run(self, prep, dtype):
        """This form on ``prep``'s rounded inputs, computed in ``dtype`` (None: an emulated
        ``in_dtype`` form that overflowed where the dtype would have clipped)."""
        arrays, kwargs = prep.arrays, prep.kwargs
        if self.perturb:
            rng = prep.case.rng(prep.seed)
            step = 2.0 ** -MANTISSA_BITS[prep.dtype]
            arrays = {**arrays, **{n: round_to(arrays[n] * (1 + step * rng.choice((-1.0, 1.0),
                                                                               arrays[n].shape)),
                                               prep.dtype) for n in BASE_KEYS}}
        if self.fold_scale:
            arrays = {**arrays, "q": round_to(arrays["q"] * (prep.scale * math.log2(math.e)),
                                              prep.dtype)}
            kwargs = {**kwargs, "scale": math.log(2.0)}
        if self.scale_q:
            arrays = {**arrays, "q": round_to(arrays["q"] * prep.scale, prep.dtype)}
            kwargs = {**kwargs, "scale": 1.0}
        if self.split_scale:
            root = math.sqrt(prep.scale)
            arrays = {**arrays, **{n: round_to(arrays[n] * root, prep.dtype) for n in ("q", "k")}}
            kwargs = {**kwargs, "scale": 1.0}
        emulated = self.in_dtype and dtype in LOW_PRECISION
        out = prep.reference(dtype, arrays=arrays, kwargs=kwargs, fn=self.fn,
                             options={**prep.options, **dict(self.options)},
                             xp=LOGITS_IN_DTYPE if emulated else None,
                             host=rounding_draw(prep, self.draw) if emulated and self.draw is not None
                             else None)
        if emulated and not np.all(np.isfinite(out)):
            # The emulated arrays are float32 underneath, so attn_ref's clips to
            # finfo(dtype).max clip at float32's: an overflow here is the emulation's, which
            # the dtype itself would have clipped (torch float16 FAVOR+ on large logits
            # stays finite). No baseline; the other forms make it.
            return None
        return out


def _online(q, k, v, /, **kw):
    from attn_ref.softmax import online_softmax_attention

    kw = {n: x for n, x in kw.items() if n not in BLOCK_SIZES}
    return online_softmax_attention(q, k, v, block_q=64, block_k=32, **kw)


def _sequential_softmax(q, k, v, /, *, gqa=False, xp=None, **kw):
    """Softmax attention with ``P V`` summed key by key: the weights ``P`` as the
    reference makes them (``attention_weights``, every option), then ``o += P[:, j] v_j``
    for ``j = 0, 1, ...`` in the array dtype.

    The same function. A plain kernel that gives each query row one thread sums its
    keys in sequence, whose rounding grows like ``sqrt(Nk)`` ulps of the terms, where a
    BLAS product and the online form's blocks sum pairwise or in short runs: an
    independent audit's C kernel in float32 (running sums of ``p_j`` and ``p_j v_j``
    key by key, normalised per weight or once at the end) read 0.96-1.12 on the RMS
    bound of ``long:b1h1-q64k4096-d32`` and its causal twin (9 of 12 runs failed,
    seeds 0-2) while the same kernel in blocks of 64 keys passed at about 0.23; with
    this form, 0.40-0.43.
    """
    from attn_ref import attention_weights

    p = attention_weights(q, k, gqa=gqa, xp=xp, **{n: x for n, x in kw.items() if n not in BLOCK_SIZES})
    if gqa and v.shape[-3] != p.shape[-3]:
        # query head h reads key/value head h // (Hq / Hkv), as the reference maps them
        v = xp.repeat(v, p.shape[-3] // v.shape[-3], axis=-3)
    o = xp.zeros(tuple(p.shape[:-1]) + (v.shape[-1],), dtype=p.dtype)
    for j in range(p.shape[-1]):
        o = o + p[..., j:j + 1] * v[..., j:j + 1, :]
    return o


#: the largest ``Nq Nk dv`` the key-by-key softmax form runs on (``Nk`` array operations
#: over ``Nq dv`` elements each; 64 M multiply-adds take about 0.2 s on NumPy)
SEQUENTIAL_MAX_WORK = 1 << 26


def _sequential_applies(prep):
    """float32/float64 cases small enough for :func:`_sequential_softmax`'s loop."""
    c = prep.case
    return _FULL(prep) and c.nq * c.nk * c.dv * math.prod(c.batch) <= SEQUENTIAL_MAX_WORK


def _recurrent_linear(q, k, v, /, *, causal=False, feature_map="elu+1", scale=None,
                      normalize=True, eps=None, xp=None, **_orders):
    """Causal linear attention token by token from the empty state (``S += phi(k) v^T``):
    the rounding of a recurrent kernel (flash-linear-attention's naive recurrent form),
    whose running sums are sequential where the other orders' are blocked."""
    from attn_ref.linear import DEFAULT_EPS, linear_attention_state, linear_attention_step

    opts = {"feature_map": feature_map, "scale": scale, "normalize": normalize,
            "eps": DEFAULT_EPS if eps is None else eps, "xp": xp}
    state = linear_attention_state(k[..., :0, :], v[..., :0, :], feature_map=feature_map, xp=xp)
    outs = []
    for t in range(q.shape[-2]):
        o, state = linear_attention_step(state, q[..., t, :], k[..., t, :], v[..., t, :], **opts)
        outs.append(o)
    return xp.stack(outs, axis=-2)


def _sequential_linear(q, k, v, /, *, causal=False, feature_map="elu+1", scale=None,
                       normalize=True, eps=None, xp=None, **_orders):
    """Linear attention in the quadratic order, ``A V`` and ``rowsum A`` summed key by key.

    The same function as every other order. Its sums over the keys are sequential, whose
    rounding grows like ``sqrt(Nk)`` times the terms' ulp, where NumPy's BLAS and the
    chunked orders sum in blocks (pairwise); a plain kernel may sum either way, and one
    with torch's float64 ``(A V) / rowsum A`` over 4096 keys errs by 3.2 to 4x the
    blocked orders' RMS error (measured on ``long:b1h1-q64k4096-d32``): a false fail
    against those orders alone. Summing ``phi(K)^T V`` key by key instead (the recurrent
    form) does not reach it: the ``d'`` features' errors average out in ``phi(q)^T S``.
    """
    from attn_ref._common import causal_alignment
    from attn_ref.linear import DEFAULT_EPS, causal_visible, feature_map_features, readout

    fq = feature_map_features(q, feature_map=feature_map, name="q", xp=xp)
    fk = feature_map_features(k, feature_map=feature_map, name="k", xp=xp)
    if scale is not None and scale != 1.0:
        fq = fq * scale
    a = fq @ xp.matrix_transpose(fk)
    alignment = causal_alignment(causal)
    if alignment is not None:
        vis = causal_visible(xp, q.shape[-2], k.shape[-2], alignment, "cpu")
        a = xp.where(vis, a, xp.zeros((), dtype=a.dtype))  # where: inf * 0 would be NaN
    num = xp.zeros(a.shape[:-1] + (v.shape[-1],), dtype=a.dtype)
    den = xp.zeros(a.shape[:-1] + (1,), dtype=a.dtype)
    for j in range(k.shape[-2]):
        num = num + a[..., j:j + 1] * v[..., j:j + 1, :]
        den = den + a[..., j:j + 1]
    return readout(xp, num, den, normalize, DEFAULT_EPS if eps is None else eps)


def _elu_as_written(x):
    """``elu(x) + 1`` as torch and fla write it, ``expm1(x) + 1`` for ``x < 0``: the sum
    cancels, so a feature ``e^x`` far below 1 keeps only an absolute error of ``u / 2``,
    where attn_ref's ``max(x, 0) + exp(min(x, 0))`` keeps a relative one. On rows whose
    features are all that small (large negative inputs) the output is a ratio of them:
    a plain torch kernel erred 31x attn_ref's own orders on ``large-logits`` (float64)."""
    import array_api_compat

    xp = array_api_compat.array_namespace(x)
    zero = xp.zeros((), dtype=x.dtype)
    return xp.where(x > 0, x, xp.expm1(xp.minimum(x, zero))) + 1.0


def _elu_plus_one(prep):
    """The default feature map, float32/float64 (calibrated there only)."""
    return (prep.options.get("feature_map", "elu+1") == "elu+1"
            and prep.dtype in ("float32", "float64"))



def _dense_form(name):
    """The variant ``name`` as its defining form: its dense weights matrix (the
    registry's ``weights``; for a sparse pattern the masked softmax over all ``N`` keys,
    one matrix product for the logits) times ``v``. Reformer's and Sinkhorn's union-mask
    softmax; and the sparse patterns', whose efficient forms' logits are products over
    gathered blocks, which NumPy sums more exactly than a BLAS product of the whole
    matrix: on large logits (|S| ~ 1e4) in float32 those logits erred 1e-3 where the dense
    product's err 3e-3, and eager masked attention, SDPA with the pattern as its mask and
    attn_ref's own bigbird under torch failed their outputs at 1.15-1.73x (bigbird,
    strided, local, block_sparse; seeds 10 and 15) while the efficient forms were the
    only baselines."""
    def dense(q, k, v, /, **kw):
        from attn_ref.registry import get

        return get(name).weights(q, k, **kw) @ v

    dense.__name__ = f"{name}_dense"
    return dense


def _performer_paper_rounding(q, k, v, /, *, projection, scale=None, feature_eps=0.0, xp=None, **_):
    """Non-causal FAVOR+ with positive features rounded as google-research's code and
    performer-pytorch round them: ``u = (sqrt(scale) x) W^T`` but the diagonal
    ``|x|^2 / 2`` taken from the unscaled ``x`` and multiplied by the scale afterwards,
    the stabiliser the largest ``u`` of each query row and of all keys, the features
    ``(exp(u - diag - c) + feature_eps) / sqrt(m)``, and the output as the numerator
    times ``1 / denominator``. Without a floor (``feature_eps=0``) the stabiliser is the
    largest exponent ``u - diag`` instead, as attn_ref's.

    The same function (``scale |x|^2 / 2`` either way; the stabilisers cancel, and with
    ``feature_eps`` they are the ones the floor is defined against). In bfloat16 the
    diagonal from the unscaled ``x`` disagrees with the rounded ``sqrt(scale) x`` of the
    product by a rounding, which the exponent then carries: performer-pytorch so failed
    three of 74 rows at 1.05-1.08 against attn_ref's in-dtype form alone (an audit took
    its steps one at a time: this diagonal 1.08 -> 0.74 and 1.06 -> 0.68, the reciprocal
    1.05 -> 0.67).
    """
    root = math.sqrt(default_scale(q.shape[-1]) if scale is None else scale)
    m = projection.shape[0]

    def features(x, over_rows):
        u = (x * root) @ xp.matrix_transpose(projection)
        diag = xp.sum(x * x, axis=-1, keepdims=True) / 2 * (root * root)
        # without a floor, the largest exponent (attn_ref's stabiliser: the largest u alone
        # lets every feature of a large-logits row underflow to 0 / 0)
        c = xp.max(u if feature_eps else u - diag, axis=-1, keepdims=True)
        if over_rows and x.shape[-2] > 0:
            c = xp.max(c, axis=-2, keepdims=True)
        return (xp.exp(u - diag - c) + feature_eps) / math.sqrt(m)

    fq, fk = features(q, False), features(k, True)
    num = fq @ (xp.matrix_transpose(fk) @ v)
    den = fq @ xp.matrix_transpose(xp.sum(fk, axis=-2, keepdims=True))
    return num * (1.0 / den)


def _performer_paper_applies(prep):
    """float16/bfloat16, non-causal, positive stabilised features, a key to attend to."""
    o = prep.options
    return (_HALF(prep) and not prep.kwargs.get("causal") and o.get("kernel", "positive") == "positive"
            and o.get("stabilize", True) and o.get("order", "linear") == "linear"
            and prep.case.nk > 0 and prep.case.nq > 0)


def _nystrom_torch_kernels(q, k, v, /, **kw):
    """:func:`_nystrom_fused_kernels` with its logits as a plain torch kernel makes them in
    float16/bfloat16: ``Q K^T`` by a half-precision matmul (float32 accumulation, rounded
    to the dtype), times the scale (rounded again), then ``softmax`` (float32 inside,
    rounded once)."""
    return _nystrom_fused_kernels(q, k, v, logits_in_dtype=True, **kw)


def _nystrom_fused_kernels(q, k, v, /, *, num_landmarks, pinv_iterations=6, pinv_init="matrix",
                           segments="balanced", causal=False, scale=None, xp=None, logits_in_dtype=False):
    """Nystromformer with each of its three softmax kernels computed at full precision
    and rounded once to the dtype (a fused softmax: torch's and JAX's in float16 and
    bfloat16 exponentiate and sum in float32), the landmarks, the pseudo-inverse's
    iterations and the products in the dtype.

    The same function. The iterations amplify the kernels' rounding by up to the
    condition number of ``softmax(Ql Kl^T)``, so the output's error depends on the
    rounding pattern, not only its size: rounded once, the kernels are closer to exact
    but err differently, and attn_ref's Nystrom on torch float16 erred 1.8x the RMS of
    the forms whose kernels round every step (0.0034 against 0.0018, 1000 tokens) - this
    form reproduces it (0.0034).

    ``logits_in_dtype``: the logits as a plain torch kernel makes them, ``Q K^T`` rounded
    to the dtype and then its product with the scale (a half-precision matmul, then the
    scale), before the fused softmax (:func:`_nystrom_torch_kernels`).
    """
    from attn_ref.reduced import iterative_pinv, landmark_means
    from attn_ref.softmax import attention_weights

    # the dtype the emulated inputs round to (None: plain float32/float64 arrays)
    dtype = _emulated_dtype(q)

    def exact(x):
        return np.asarray(plain_array(x), dtype=np.float64) if dtype else x

    def rounded(x):
        return lp_array(x, dtype) if dtype else x

    scale = default_scale(q.shape[-1]) if scale is None else scale
    npx = LOGITS_IN_FLOAT32
    ql = landmark_means(q, num_landmarks, segments, xp=xp)
    kl = landmark_means(k, num_landmarks, segments, xp=xp)
    if logits_in_dtype:
        def weights(a, b):
            logits = exact(rounded(exact(rounded(exact(a) @ np.swapaxes(exact(b), -1, -2))) * scale))
            e = np.exp(logits - np.max(logits, axis=-1, keepdims=True))
            return rounded(e / np.sum(e, axis=-1, keepdims=True))
    else:
        def weights(a, b):
            return rounded(attention_weights(exact(a), exact(b), scale=scale, xp=npx))
    k1, k2, k3 = (weights(a, b) for a, b in ((q, kl), (ql, kl), (ql, k)))
    if pinv_iterations is None:
        z = rounded(npx.linalg.pinv(exact(k2)))
    else:
        z = iterative_pinv(k2, iterations=pinv_iterations, pinv_init=pinv_init, xp=xp)
    return k1 @ (z @ (k3 @ v))


def _linformer_key_by_key(q, k, v, /, *, e_proj, f_proj=None, scale=None, xp=None, **kw):
    """Linformer with ``E K`` and ``F V`` summed key by key in the array dtype.

    A plain kernel may project with a sequential sum over the ``Nk`` keys (a loop, or a
    BLAS that sums that way: torch's float64 ``E @ K`` on CPU errs about 4x NumPy's
    blocked sum at ``Nk = 4096``), whose rounding grows like ``sqrt(Nk)`` ulps of the
    terms; the projected keys then enter every logit. The same function as the reference.
    """
    from attn_ref import softmax_attention

    f_proj = e_proj if f_proj is None else f_proj
    return softmax_attention(q, keywise_projection(e_proj, k), keywise_projection(f_proj, v),
                             scale=scale, xp=xp, **kw)


def _emulated_dtype(x):
    """The dtype an emulated input rounds to (:class:`LowPrecisionArray`), or None for a plain
    float32/float64 array."""
    return type(x).dtype_name if isinstance(x, LowPrecisionArray) else None


def _linformer_fused(q, k, v, /, *, e_proj, f_proj=None, scale=None, xp=None, **kw):
    """Linformer as a half-precision kernel that projects and then calls a fused
    attention (SDPA, FlashAttention) computes it: ``E K`` and ``F V`` stored in the
    dtype, the logits, softmax and accumulators in float32, every matrix product's
    operands in the dtype (:func:`~conformance.tolerance.gemm_in_dtype`), the output
    rounded once.

    The same function. Where the logits are large the rounding of the projected keys
    (``ulp(|E K|)`` in every logit, times ``|q|``) and that of a half-precision logits
    product (the plain form's) move the output by different, unrelated amounts: on
    ``large-logits:b1h2-q64k64-d64`` in float16 (logits up to 2700, ``|E K|`` 172) the
    plain form erred 0.025 and attn_ref's Linformer on torch (this rounding) 0.30, 5.9
    times the bound the plain form set.
    """
    from attn_ref import linformer_attention

    dtype = _emulated_dtype(q)
    if dtype is None:
        return linformer_attention(q, k, v, e_proj=e_proj, f_proj=f_proj, scale=scale, xp=xp, **kw)

    def fused(x):
        return None if x is None else gemm_in_dtype(plain_array(x), dtype)

    out = linformer_attention(fused(q), fused(k), fused(v), e_proj=fused(e_proj), f_proj=fused(f_proj),
                              scale=scale, xp=array_api_compat.numpy, **kw)
    return lp_array(np.asarray(out, dtype=np.float32), dtype)


def keywise_projection(p, x):
    """``p @ x`` for ``p (..., r, N)``, ``x (..., N, d)`` summed over the ``N`` keys one at
    a time in the arrays' dtype (each partial sum rounded): Linformer's ``E K`` as a
    sequential loop projects it (:func:`_linformer_key_by_key`)."""
    acc = np.zeros(np.broadcast_shapes(p.shape[:-2], x.shape[:-2]) + (p.shape[-2], x.shape[-1]),
                   dtype=x.dtype)
    for j in range(x.shape[-2]):
        acc = acc + p[..., :, j:j + 1] * x[..., j:j + 1, :]
    return acc


def _compressed_tap_by_tap(q, k, v, /, *, k_weight, v_weight=None, stride=3, causal=False,
                           scale=None, block_q=None, xp=None):
    """Memory-compressed attention with its convolutions summed tap by tap in the array
    dtype: ``conv(X) = X[0::s] @ W[0] + X[1::s] @ W[1] + ...`` over the ``c`` taps.

    The same function as the reference, which multiplies the stacked ``(M, c d)``
    windows by ``W`` in one matmul (one blocked sum over ``c d`` terms). A plain kernel
    may add the taps' products instead (a loop over the kernel, as a ``conv1d`` lowered
    tap by tap does); the compressed keys then round differently, and the large-logits
    cases amplify that into the output: an independent audit's such NumPy kernel in
    float32 failed ``large-logits:b1h2-q64k64-d64-large_logits`` at seed 3 (ratio 1.05)
    against the reference's summation order alone. ``block_q`` is ignored (one block).
    """
    from attn_ref import softmax_attention
    from attn_ref.compressed import compressed_causal_mask, prepare_compressed

    v_weight = k_weight if v_weight is None else v_weight
    xp, _, alignment, scale = prepare_compressed(q, k, v, k_weight, v_weight, stride, causal,
                                                 scale, xp)

    mask = compressed_causal_mask(xp, alignment, q, k, k_weight, stride)
    return softmax_attention(q, conv_tap_by_tap(k, k_weight, stride),
                             conv_tap_by_tap(v, v_weight, stride), mask=mask, scale=scale, xp=xp)


def conv_tap_by_tap(x, w, stride):
    """The strided convolution of memory-compressed attention, ``x (..., N, d)`` by ``w
    (..., c, d, d')``, as ``x[0::s] @ w[0] + x[1::s] @ w[1] + ...`` in the arrays' dtype
    (each partial sum rounded; :func:`_compressed_tap_by_tap`), the rows past the end
    zero as the reference pads its last window: ``(..., M, d')``."""
    from attn_ref.compressed import num_blocks

    c, n = w.shape[-3], x.shape[-2]
    m = num_blocks(n, c, stride)
    x = np.concatenate([x, np.zeros(x.shape[:-2] + (max((m - 1) * stride + c - n, 0),
                                                    x.shape[-1]), dtype=x.dtype)], axis=-2)
    acc = np.zeros(np.broadcast_shapes(x.shape[:-2], w.shape[:-3]) + (m, w.shape[-1]),
                   dtype=x.dtype)
    for t in range(c):
        acc = acc + x[..., t::stride, :][..., :m, :] @ w[..., t, :, :]
    return acc


def lse_softmax_attention(q, k, v, /, *, xp=None, block_q=None, block_k=None, return_lse=False,
                          **options):
    """Softmax attention (every option of :func:`attn_ref.softmax_attention`) with the
    weights ``P = exp(S - logsumexp(S))`` in the arrays' dtype, ``logsumexp`` itself
    max-shifted: trax's and HuggingFace's Reformer, ``log_softmax(S).exp()``,
    FlashAttention's backward. With ``return_lse``, ``(out, lse)``, ``lse (..., Nq)``
    (``+inf`` on a row with no allowed key).

    The same function as the reference, and no baseline form: on rows whose
    log-sum-exp is large its ``S - lse`` loses ``u |lse|`` where the max-shifted
    softmax loses nothing (docs/conformance.md, "The softmax as exp(s - logsumexp)").
    :mod:`conformance.diagnose` names it when a kernel's output matches it. The blocks
    of ``online_softmax`` are ignored (one block). ``O(Nq Nk (d + dv))`` time,
    ``O(Nq Nk)`` memory.
    """
    from attn_ref._common import partial_lse
    from attn_ref.softmax.options import prepare_problem
    from attn_ref.softmax.tiles import dropout_scale, keep_tile, row_max, tile_logits

    pb = prepare_problem(q, k, v, xp=xp, **options)
    xp, spec = pb.xp, pb.spec
    if spec.nq == 0 or spec.nk == 0:
        out = pb.ungroup(pb.zeros(pb.v.shape[-1]))
        return (out, xp.full(out.shape[:-1], math.inf, dtype=out.dtype)) if return_lse else out
    s, _ = tile_logits(xp, pb.q, xp.matrix_transpose(pb.k), spec, 0, 0)
    # logsumexp max-shifted, +inf on a row with no allowed key (exp(-inf - lse) is 0 there)
    m = row_max(xp, s)
    lse = partial_lse(xp, m, xp.sum(xp.exp(s - m), axis=-1, keepdims=True))
    # S - lse rounds at |lse|: u |lse| absolute, a relative error of every weight of the
    # row, where S - max is exact near the maximum
    p = keep_tile(xp, xp.exp(s - lse), spec, 0, 0)
    if p.dtype != pb.q.dtype:
        p = xp.astype(p, pb.q.dtype)
    drop = dropout_scale(spec)
    out = pb.ungroup((p * drop if drop != 1.0 else p) @ pb.v)
    return (out, pb.ungroup(lse)[..., 0]) if return_lse else out


#: The sparse patterns: a softmax over the keys a fixed pattern allows (with causal),
#: read off the variant's own attention matrix by :func:`softmax_pattern`.
SPARSE_PATTERNS = ("block_sparse", "local", "longformer", "bigbird", "strided", "fixed")

#: The variants whose output is a softmax over a row of logits ``scale q . k`` (plus the
#: softmax options), masked by the variant's pattern: :func:`lse_form` computes them.
LSE_VARIANTS = ("softmax", "online_softmax") + SPARSE_PATTERNS


def lse_form(name):
    """The variant ``name`` (one of :data:`LSE_VARIANTS`) with its softmax computed as
    ``exp(S - logsumexp(S))``, a function with the reference's signature.

    ``softmax`` and ``online_softmax``: :func:`lse_softmax_attention`. A sparse variant:
    its pattern (with causal) is where its own attention matrix is nonzero on ``q = 0``
    (every allowed logit 0, a uniform row over the allowed keys, so no allowed weight
    underflows), and the logits ``scale q . k`` there go through
    :func:`lse_softmax_attention`. The same function as the variant,
    ``O(Nq Nk (d + dv))`` time.
    """
    if name in ("softmax", "online_softmax"):
        return lse_softmax_attention
    if name not in LSE_VARIANTS:
        raise ValueError(f"lse_form takes a variant of {LSE_VARIANTS}, got {name!r}")

    def form(q, k, v, /, *, scale=None, xp=None, return_lse=False, **options):
        allowed = softmax_pattern(name, q, k, scale=scale, xp=xp, **options)
        return lse_softmax_attention(q, k, v, mask=allowed, scale=scale, xp=xp, return_lse=return_lse)

    form.__name__ = f"{name}_lse_softmax"
    return form


def softmax_pattern(name, q, k, /, *, xp, **options):
    """The ``(..., Nq, Nk)`` boolean pattern of the sparse variant ``name`` (one of
    :data:`LSE_VARIANTS` besides softmax): where its own attention matrix is nonzero on
    ``q = 0``, every allowed logit 0 and the row uniform over the allowed keys, so no
    allowed weight underflows. ``options`` are the variant's (``causal``, ``scale``, its
    pattern's parameters). ``O(Nq Nk d)`` time."""
    from attn_ref.registry import get

    return get(name).weights(xp.zeros_like(q), k, xp=xp, **options) > 0


def _causal_square(prep):
    return bool(prep.kwargs.get("causal")) and prep.case.nq == prep.case.nk and prep.case.nq > 0


AS_REGISTERED = Form("as registered")
# in float16/bfloat16 the fp32-accumulating forms already dominate; moving inputs by
# one of their ulps (2^-10, 2^-7) would declare most sign-indefinite cases n/a
PERTURBED = Form("inputs moved by one ulp", perturb=True,
                 applies=lambda prep: prep.dtype in ("float32", "float64"))
FOLD = Form("scale folded into q, base 2", fold_scale=True)
ONLINE = Form("online softmax, 64 x 32 blocks", fn=_online, blockwise=True)
SPLIT = Form("sqrt(scale) on q and on k", split_scale=True)
# a block larger than any case: one block, no running accumulator
_ONE = 1 << 30

#: The forms of each registered variant; the first is the plain implementation (in
#: float16/bfloat16 the first that is not blockwise), whose error is the precision
#: column's reference. A variant without an entry has one form: the reference as
#: registered. Extension point: :func:`register_forms`.
FORMS: dict[str, tuple[Form, ...]] = {}


def register_forms(variant: str, *forms: Form) -> None:
    """Declare the forms (:class:`Form`) of a variant; the first is the plain one."""
    if not forms or not all(isinstance(f, Form) for f in forms):
        raise TypeError(f"register_forms({variant!r}, ...) takes one or more Form objects, "
                        f"got {forms!r}")
    FORMS[variant] = tuple(forms)


# a plain kernel may sum its keys one by one (one thread per query row)
KEY_BY_KEY = Form("P V summed key by key", fn=_sequential_softmax, blockwise=True,
                  applies=_sequential_applies)
register_forms("softmax", AS_REGISTERED, FOLD, ONLINE, KEY_BY_KEY)
register_forms("online_softmax", Form("one block", (("block_q", _ONE), ("block_k", _ONE))),
               Form("as registered", blockwise=True),
               FOLD, ONLINE, KEY_BY_KEY)
# linear attention: the feature map comes before the scale, so no fold; the two
# summation orders (Katharopoulos et al.) and other chunkings are the same function
register_forms("linear", Form("quadratic order", (("order", "quadratic"),)),
               Form("as registered", blockwise=True),
               Form("linear order, one block, chunks of 64",
                    (("order", "linear"), ("chunk_size", 64), ("block_size", _ONE))),
               Form("recurrent, token by token", fn=_recurrent_linear, blockwise=True,
                    applies=_causal_square),
               Form("quadratic order, keys summed one by one", fn=_sequential_linear,
                    blockwise=True),
               Form("quadratic order, elu(x) + 1 as written", (("order", "quadratic"),
                                                               ("feature_map", _elu_as_written)),
                    applies=_elu_plus_one),
               PERTURBED)
# the recurrent family (attn_ref.recurrent): its three forms are one function; a chunked
# kernel rounds like the chunk form at its own chunk size, a recurrent one like the loop.
# In float16/bfloat16 these forms would run on LowPrecisionArray, which rounds the state
# at every step (attn_ref keeps it in float32 by the input dtype, which those arrays
# hide): a baseline off by 8.2 where a float32-state kernel is off by 0.031 (8 retention
# heads, T = 1000, float16), loose enough to pass a kernel whose state is bfloat16. There
# the baseline is the two fp32-accumulating implementations real kernels are instead.
def _fla_ssd_chunks(q, k, v, /, *, g, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, xp=None, chunk=FLA_CHUNK, **kw):
    """SSD as fla's chunk kernels compute it, in the arrays' dtype: per chunk of
    ``chunk`` steps (:data:`FLA_CHUNK`; Mamba-2's kernels take :data:`MAMBA2_CHUNK`) the
    running sums ``b`` of the log decays from the chunk's start (``chunk_local_cumsum``, a
    parallel scan), the in-chunk decays
    ``exp(b_i - b_j)`` from their differences, ``O = (Q K^T * D) V + (Q * exp(b)) S``
    and ``S <- exp(B) S + (K * exp(B - b))^T V``. The same function as the reference,
    which takes each exponent relative to a nearer reference point
    (:func:`attn_ref.recurrent.common.scalar_decay_in_place`): with strong gates the
    running sums reach some hundreds within a chunk and each difference loses
    ``ulp(|b|)``, an error no other form makes. An audit's fla-style torch kernel failed
    ``strong-gates:b1h3-q65k65-d16-causal-tl-gatesstrong`` in float32 at seed 1 (ratio
    1.30) against the other forms alone. ``O(T C (dk + dv) + T dk dv)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = np.broadcast_to(g, q.shape[:-1])
    if cu_seqlens is not None:
        # packed sequences (batch 1): each its own chunks from its own start and state
        cu = [int(x) for x in np.asarray(cu_seqlens)]
        runs = [_fla_ssd_chunks(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], g=g[..., a:b],
                                scale=scale, output_final_state=True, chunk=chunk,
                                initial_state=None if initial_state is None else initial_state[i:i + 1])
                for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
        out = np.concatenate([o for o, _ in runs], axis=-2)
        return (out, np.concatenate([st for _, st in runs], axis=0)) if output_final_state else out
    mt = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    s = np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]), dtype=q.dtype) \
        if initial_state is None else initial_state
    outs = []
    for c0 in range(0, q.shape[-2], chunk):
        qc, kc, vc = (x[..., c0:c0 + chunk, :] for x in (q, k, v))
        # the running sums by a parallel (Hillis-Steele) scan, as Triton's tl.cumsum and
        # torch's CPU cumsum associate them: a sequential sum's errors cancel between
        # neighbours, a scan's do not, and with strong gates only neighbours matter
        b, n, shift = g[..., c0:c0 + chunk], min(chunk, q.shape[-2] - c0), 1
        while shift < n:
            b = np.concatenate([b[..., :shift], b[..., shift:] + b[..., :-shift]], axis=-1)
            shift *= 2
        lower = np.arange(n)[:, None] >= np.arange(n)[None, :]
        diff = np.where(lower, b[..., :, None] - b[..., None, :], -np.inf)
        outs.append((qc @ mt(kc) * np.exp(diff)) @ vc * scale
                    + (qc * np.exp(b)[..., None]) @ s * scale)
        s = np.exp(b[..., -1:])[..., None] * s + mt(kc * np.exp(b[..., -1:] - b)[..., None]) @ vc
    out = np.concatenate(outs, axis=-2) if outs else np.zeros_like(v)
    return (out, s) if output_final_state else out


def _mamba2_ssd_chunks(q, k, v, /, **kw):
    """:func:`_fla_ssd_chunks` in Mamba-2's chunks of :data:`MAMBA2_CHUNK`: ``mamba_ssm``'s
    kernels round SSD so, each in-chunk exponent a difference of running sums over up to
    256 steps. A torch kernel written so failed ``long:b1h1-q1000k1000-d64-causal-tl`` at
    1.6-2.5 (float32, seeds 0-2) against fla's chunks of 64 alone; with it, the ssd bounds of the
    standard cases longer than 64 steps rose (45 of 112, seeds 0-1, float32 and float64;
    the long case 4-6.7x, a strong-gate case 10.5x in float64) and every planted mistake
    still fails (docs/conformance.md, "SSD's Mamba-2 form")."""
    return _fla_ssd_chunks(q, k, v, chunk=MAMBA2_CHUNK, **kw)


_FULL = lambda prep: prep.dtype in ("float32", "float64")  # noqa: E731
_HALF = lambda prep: prep.dtype in LOW_PRECISION  # noqa: E731
for _name in RECURRENT:
    register_forms(_name,
                   Form("float32 state", fn=fp32_state_form(_name), applies=_HALF),
                   Form(f"float32 state stored in the dtype every {FLA_CHUNK} steps",
                        fn=fp32_state_form(_name, FLA_CHUNK), applies=_HALF),
                   *((Form("q, k normalised in float32, stored in the dtype",
                           fn=fp32_state_form(_name, normalized_in_dtype=True),
                           applies=_HALF),) if _name in ("deltanet", "gated_deltanet") else ()),
                   Form("as registered", applies=_FULL),
                   Form("recurrent, token by token", (("form", "recurrent"),), applies=_FULL),
                   Form("parallel, masked T x T", (("form", "parallel"),), applies=_FULL),
                   Form("chunks of 64", (("chunk_size", 64),), applies=_FULL),
                   *((Form("fla's chunks: decays from differences of chunk running sums",
                           fn=_fla_ssd_chunks, applies=_FULL),
                      Form(f"Mamba-2's chunks of {MAMBA2_CHUNK}: decays from differences of chunk "
                           f"running sums", fn=_mamba2_ssd_chunks, applies=_FULL))
                     if _name == "ssd" else ()),
                   PERTURBED)
# FAVOR+: exp(w . sqrt(scale) q - scale |q|^2 / 2) is not linear in q: no fold either
register_forms("performer", AS_REGISTERED, Form("quadratic order", (("order", "quadratic"),)),
               Form("chunks of 3", (("chunk_size", 3),)), PERTURBED,
               Form("every operation in the dtype", in_dtype=True, applies=_HALF),
               Form("the FAVOR+ paper code's rounding, every operation in the dtype",
                    fn=_performer_paper_rounding, in_dtype=True, applies=_performer_paper_applies))
for _name in ("pooled", "query_reduced", "clustered"):
    register_forms(_name, AS_REGISTERED, FOLD)
# Improved clustered attention: the k-means on the queries and each centroid's top-k keys
# in the dtype, as a half-precision kernel computes them. Without this form attn_ref's
# own reference under torch failed 4 float16 output rows at 73-883x and 5 bfloat16 at
# 6.4-15 (seeds 0-3), where its half-precision clusters or top-k keys differ from those
# of the float32-accumulating form; with it, none and 2 (2.4 and 12.6), and on the
# held-out seeds 4-7 two cases in each dtype (1.4-77x): heads whose top-k set is a near
# tie, which neither form happened to flip. Those are judged against every admissible
# selection now (conformance.ties; prepare): seeds 0-7 pass in both dtypes.
register_forms("clustered_topk", AS_REGISTERED, FOLD,
               Form("every operation in the dtype", in_dtype=True, applies=_HALF))
# memory-compressed attention: the convolution as the reference's one windows @ W matmul
# or tap by tap (every dtype; see _compressed_tap_by_tap: in float16 an independent
# torch kernel summing its taps so failed dq of two cases at 1.03-1.09 against the
# one-matmul form alone)
register_forms("compressed", AS_REGISTERED, FOLD, Form("query blocks of 7", (("block_q", 7),)),
               Form("convolution summed tap by tap", fn=_compressed_tap_by_tap))
# Nystromformer: the paper and HuggingFace scale q and k by d**-0.25 each; both enter the
# landmark means and the three logit matrices linearly, so that is the same function. On
# large logits in float32 HuggingFace's kernel erred 2.4x the fold's tolerance without it
# In float16/bfloat16 the pseudo-inverse's iterations amplify the landmark kernel's
# rounding by up to its condition number, so which rounding pattern a kernel happens to
# make decides its error as much as the pattern's size. A plain torch kernel rounds its
# logits (a half-precision matmul, then the scale) before the fused softmax; without a
# form that does the same (_nystrom_torch_kernels) an independent such kernel (the
# iterations in the dtype) failed one output row in each of seeds 0-2 at 1.18-1.5x
# (bfloat16 basic:b2h3-q17k17-d16, float16 length:b1h2-q3k3-d32 and
# near-ties:b1h2-q64k64-d32). The in-dtype form on inputs moved by one ulp also passed
# them, at about twice the tolerance: not kept. The scale on q as lucidrains'
# nystrom-attention applies it: under torch.autocast in float16 its output failed
# large-logits:b1h2-q16k16-d8-large_logits at 1.37 (seed 2; 1.10 with the draws below
# alone) and passes with it. In float16, four draws of stochastic rounding
# (rounding_draw): the pseudo-inverse amplifies the rounding in a direction its pattern
# decides, and lucidrains' under autocast failed length:b1h2-q64k64-d32 at 1.02 (seed 0)
# against the round-to-nearest forms alone. Not in bfloat16, where they would halve the
# detection (3 % off failing 16 of 41 rows instead of 32) and leave the one failure of a
# correct kernel there as it is (docs/conformance.md, "Rounding draws").
register_forms("nystrom", AS_REGISTERED, FOLD, SPLIT, PERTURBED, Form("scale on q", scale_q=True),
               Form("every operation in the dtype", in_dtype=True, applies=_HALF),
               Form("softmax kernels rounded once", fn=_nystrom_fused_kernels, applies=_HALF),
               Form("logits in the dtype, softmax kernels rounded once", fn=_nystrom_torch_kernels,
                    applies=_HALF),
               *(Form(f"every operation in the dtype, rounded at random (draw {i})", in_dtype=True,
                      draw=i, applies=lambda prep: prep.dtype == "float16") for i in range(ROUNDING_DRAWS)))
# Linformer: the projections E K and F V sum over all Nk keys, blocked (NumPy's BLAS) or
# one by one (a loop, torch's float64 matmul on CPU); in float16/bfloat16 the plain
# fp32-accumulating form already dominates
register_forms("linformer", AS_REGISTERED, FOLD,
               Form("projections summed key by key", fn=_linformer_key_by_key, applies=_FULL),
               Form("projections stored in the dtype, fused attention", fn=_linformer_fused,
                    applies=_HALF))
# Reformer: sort-chunk-attend-unsort, and the dense masked softmax it equals
register_forms("reformer", AS_REGISTERED, FOLD, Form("dense masked softmax", fn=_dense_form("reformer")),
               Form("every operation in the dtype", in_dtype=True, applies=_HALF))
register_forms("sinkhorn", AS_REGISTERED, FOLD, Form("dense masked softmax", fn=_dense_form("sinkhorn")))
# the sparse patterns: local and longformer in other blocks too; each its defining form,
# the dense masked softmax (_dense_form), in float32 and float64, where a dense product's
# logits round differently enough
for _name in SPARSE_PATTERNS:
    _blocks = (Form("blocks of 5", (("block_size", 5),)),) if _name in ("local", "longformer") else ()
    register_forms(_name, AS_REGISTERED, FOLD, *_blocks,
                   Form("dense masked softmax", fn=_dense_form(_name), applies=_FULL))
# routing: q enters the routing only through q / |q|, which the fold's positive factor
# leaves alone, so the fold is the same function
register_forms("routing", AS_REGISTERED, FOLD)
# Synthesizer: q enters the dense logits through an MLP (no fold); the mixture's
# logits are the same whatever order the two terms are added in
for _name in ("synthesizer_dense", "synthesizer_random", "synthesizer_random_mix"):
    register_forms(_name, AS_REGISTERED, PERTURBED)


def forms(prep, dtype) -> list[Form]:
    """The forms whose error in ``dtype`` makes ``prep``'s baseline (plain one first)."""
    fs = FORMS.get(prep.variant.name, (AS_REGISTERED,))
    if dtype in LOW_PRECISION:
        fs = tuple(f for f in fs if not f.blockwise) or fs[:1]
    if "scale" not in reference_features(prep.variant) or prep.case.d == 0:
        fs = tuple(f for f in fs if not f.moves_scale)
    return [f for f in fs if f.applies is None or f.applies(prep)]


def baselines(prep, dtype):
    """Plain implementations in ``dtype`` (:func:`forms`); the baseline error is the largest."""
    if is_long(prep.case):
        # The one form that fits: the Dask split-KV algorithm in the kernel's dtype. The
        # golden of a long case is float64 whatever the kernel's dtype, so for a float64
        # kernel this form run as the golden runs would be the golden itself (error 0, a
        # tolerance at the floor that a correct kernel summing in another order fails:
        # SDPA float64 at N = 8192 was off by 9.6x it). Half the chunk sums in another
        # order: its distance from the golden holds the golden's own rounding, as a
        # kernel's does.
        yield lambda: long_reference(prep, dtype, reorder=dtype == "float64")[0]
        return
    for f in forms(prep, dtype):
        yield lambda f=f: f.run(prep, dtype)


def _ulp(prep, dtype):
    mag = float(np.max(np.abs(prep.golden))) if prep.golden.size else 0.0
    return ulp(mag, dtype)
