"""The tolerance model: what error a kernel in a given dtype may make.

For each case and kernel dtype:

1. The inputs are rounded to the kernel's dtype (:func:`round_to`). Everything below
   sees exactly the values the kernel sees.
2. The **golden** output is the ``attn_ref`` reference run on NumPy in float64 on those
   rounded inputs - in ``np.longdouble`` (80-bit extended on x86) when the kernel
   itself is float64, so that the golden is more precise than the kernel.
3. The **baseline** is the same reference run in the kernel's dtype (NumPy float16 /
   float32 / float64; float16 and bfloat16 as fp32-accumulating :class:`LowPrecisionArray`
   arrays), in each of the variant's forms (:func:`conformance.judging.forms`). Its error
   against the golden is what a plain implementation in that dtype makes.
4. The kernel passes when, over the compared elements,

   ``max_err <= fudge * baseline_max + floor_ulps * ulp(M)`` and
   ``rms_err <= fudge_rms * baseline_rms + floor_rms_ulps * U`` (in float16 and bfloat16
   ``rms_err <= max(fudge_rms * baseline_rms, floor_rms_ulps * U * (1 + 1/sqrt(n)))`` over
   ``n`` compared elements),

   where ``M = max |golden|``, ``ulp(M)`` is the spacing of the dtype at ``M`` and ``U``
   the RMS over elements of each golden element's own ulp.
   The floors keep an exactly representable baseline from giving a zero tolerance.
   A non-finite kernel value where the golden is finite always fails; a non-finite
   golden is never a pass (it is reported as an oracle error).

Defaults (:data:`DEFAULTS`) were calibrated against PyTorch SDPA and
``jax.nn.dot_product_attention`` over 20 seeds of the standard suite (see
``docs/conformance.md``). Gradient checks (``dq``, ``dk``, ``dv``) use the same model
with their own golden and baseline; pass a per-output :class:`Tolerance` through
``verify(..., tolerance={"dq": Tolerance(...)})`` to override one of them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

__all__ = [
    "FLOAT32_PARAMS",
    "param_dtype",
    "Tolerance",
    "DEFAULTS",
    "MANTISSA_BITS",
    "ulp",
    "elementwise_ulp",
    "elementwise_ulp_rms",
    "compared_count",
    "round_to",
    "host_dtype",
    "bf16_round",
    "f16_round",
    "stochastic_round",
    "stochastic_array",
    "LowPrecisionArray",
    "BF16Array",
    "F16Array",
    "LOW_PRECISION",
    "lp_array",
    "LOGITS_IN_DTYPE",
    "ROW_SUMS_IN_FLOAT32",
    "LOGITS_IN_FLOAT32",
    "GemmInDtypeArray",
    "gemm_in_dtype",
    "plain_array",
    "as_dtype",
    "Metrics",
    "measure",
    "largest_errors",
    "ROW_WINDOW",
    "ROW_VALUES",
    "ROW_SLACK",
    "neighbourhood_max",
    "row_errors",
    "row_magnitudes",
    "ratios",
    "ROUNDING_COSINE",
    "rounding_cosine",
    "UNTOLD",
    "rounding_caveat",
    "normalized_in_dtype",
]

MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}
DTYPES = tuple(MANTISSA_BITS)


@dataclass(frozen=True)
class Tolerance:
    """``max_err <= fudge*base_max + floor_ulps*ulp(M)``, same for RMS (see module doc)."""

    fudge: float = 4.0
    floor_ulps: float = 4.0
    fudge_rms: float = 3.0
    # 2, not 1: with one key (O = V) the baseline is exact and a correct kernel's
    # normalisation still rounds every element by up to an ulp (performer, torch float64)
    floor_rms_ulps: float = 2.0
    #: True: the RMS bound is ``max(fudge_rms * base_rms, floor_rms_ulps * U)``, the floor a
    #: minimum instead of an addend (float16/bfloat16, see :data:`DEFAULTS`)
    rms_floor_is_minimum: bool = False

    def bounds(self, base_max: float, base_rms: float, magnitude: float, dtype: str,
               ulp_rms: float | None = None, count: int | None = None):
        """``(tol_max, tol_rms)``. The RMS floor is in units of ``ulp_rms`` (the RMS of
        each golden element's own ulp, :func:`elementwise_ulp_rms`) when given, else of
        ``ulp(magnitude)``: on long rows the outputs are far below their maximum, and a
        floor at the maximum's ulp would hide an error many times the baseline's.

        With :attr:`rms_floor_is_minimum`, the floor grows by ``1/sqrt(count)`` over
        ``count`` compared elements: a correct kernel's RMS error is its final rounding
        (at most half an ulp per element) plus rounding noise of its intermediate values
        (``P`` rounded to the dtype), which averages out over many elements and not over
        a handful (the torch reference in float16 measured 0.56 ulp on 16 elements).
        """
        u = ulp(magnitude, dtype)
        ur = u if ulp_rms is None else ulp_rms
        if self.rms_floor_is_minimum:
            small_sample = 1.0 + 1.0 / math.sqrt(count) if count else 2.0
            rms = max(self.fudge_rms * base_rms, self.floor_rms_ulps * ur * small_sample)
        else:
            rms = self.fudge_rms * base_rms + self.floor_rms_ulps * ur
        return self.fudge * base_max + self.floor_ulps * u, rms

    def row_bounds(self, base_rows: np.ndarray, golden: np.ndarray, bound: float, floor_mag: float,
                   dtype: str, *, keep: np.ndarray | None = None, slack: float = 1.0,
                   extra_floor: float = 0.0) -> np.ndarray:
        """The largest error each row of ``golden`` may have (its last axis reduced: an
        output's or ``dq``'s query rows, ``dk``'s and ``dv``'s key rows), ``golden.shape[:-1]``:
        the maximum's rule applied to the row alone, ``fudge * base + floor_ulps * ulp(floor)
        + extra_floor``, never below ``bound`` (the case's) scaled to the row's size, never
        above ``bound``.

        ``base`` is ``slack`` times the largest baseline error (``base_rows``,
        :func:`row_errors`) of the row and of its neighbours on either side
        (:data:`ROW_WINDOW` of them, more where rows hold fewer than :data:`ROW_VALUES` / 8
        values each, so that the neighbourhood holds at least :data:`ROW_VALUES`).
        ``floor`` is the case's floor magnitude ``floor_mag``, or in float16/bfloat16,
        where that is the golden's own largest value, the row's largest value (over
        ``keep``; ``floor_mag`` for a row of zeros). In float32 and float64 the case's
        floor sits at the size of the terms (``max|v|`` for an output), which a row's
        rounding follows too: Nystrom's ``dv`` rows of 1e-28 on large logits erred twice
        a floor at their own size.

        The case's maximum is set by its largest outputs. A long causal row, an average of
        many values, is far smaller than the first rows, so an error of 15 % on it hid
        below the bound of a bfloat16 case's first rows. Neighbours, because one row's
        baseline error is a sample of a few values that may round luckily (rows of one
        value: a pooled ``dv`` with ``d = 1`` in bfloat16 erred 1.19 times a bound taken
        over 9 of them). The relative term, because a lucky baseline row must tighten
        nothing: a float64 kernel erred 17 ulps on one-hot rows whose baseline erred ~1."""
        size = row_magnitudes(golden, keep)
        largest = float(np.max(np.abs(golden))) if np.size(golden) else 0.0
        own = dtype in LOW_PRECISION and floor_mag <= largest
        floor_rows = np.where(own & (size > 0), size, floor_mag)
        window = max(ROW_WINDOW, math.ceil((ROW_VALUES / max(golden.shape[-1], 1) - 1) / 2))
        rows = (self.fudge * neighbourhood_max(slack * base_rows, window)
                + self.floor_ulps * elementwise_ulp(floor_rows, dtype) + extra_floor)
        relative = bound * (size / largest) if largest > 0 else bound
        return np.minimum(np.maximum(rows, relative), bound)

    def to_dict(self):
        return asdict(self)


DEFAULTS: dict[str, Tolerance] = {dt: Tolerance() for dt in DTYPES}
# float16/bfloat16: the baseline is a plain fp32-accumulating implementation in the
# dtype (:class:`LowPrecisionArray`); SDPA, FlashAttention-style blockwise kernels and
# jax.nn.dot_product_attention make at most about its error. FlashAttention's own rule
# ("at most twice a plain low-precision implementation's error") for the maximum, and
# 1.5x on the RMS, at least 0.6 ulp per element: a correctly rounded result has an RMS
# error of about 0.29 ulp (never more than 0.5), and a kernel that also rounds P to the
# dtype before P V adds about as much again on short rows (sqrt(2) x 0.29 = 0.41; the
# torch reference and jax.nn.dot_product_attention measured 0.57 ulp on 192 bfloat16
# elements). The floor is a minimum, not an addend: added (0.5 ulp), it let a kernel
# that accumulates P V or the row sum in its own dtype 64 keys at a time pass at N = 1000
# (its RMS error 0.74 ulp on the long offset-values case, the bound 1.5 x 0.29 + 0.5 =
# 0.93 ulp); as a minimum the bound is 0.6 ulp (times 1 + 1/sqrt(n) on n elements, see
# Tolerance.bounds) and it fails, while SDPA (math and fused), a FlashAttention-style
# blockwise kernel, the reference on torch and jax.nn.dot_product_attention pass (20
# seeds of the standard suite plus two N = 4096 rows).
for _dt in ("float16", "bfloat16"):
    DEFAULTS[_dt] = Tolerance(fudge=2.0, floor_ulps=2.0, fudge_rms=1.5, floor_rms_ulps=0.6,
                              rms_floor_is_minimum=True)



def ulp(magnitude: float, dtype: str) -> float:
    """Spacing of ``dtype`` numbers at ``magnitude`` (at 1.0 when magnitude is 0)."""
    m = abs(float(magnitude))
    if not math.isfinite(m) or m == 0.0:
        m = 1.0
    return 2.0 ** (math.floor(math.log2(m)) - MANTISSA_BITS[dtype])


def compared_count(golden: np.ndarray, keep: np.ndarray | None = None) -> int:
    """How many elements a verdict compares: the finite golden values that ``keep`` keeps."""
    g = np.asarray(golden)
    fin = np.isfinite(g)
    return int(np.count_nonzero(fin if keep is None else np.broadcast_to(keep, g.shape) & fin))


def elementwise_ulp(x, dtype: str) -> np.ndarray:
    """Each element's own ``dtype`` ulp, the spacing at its magnitude (0 at 0 and where
    not finite): the array form of :func:`ulp`."""
    m = np.abs(np.asarray(x, dtype=np.float64))
    live = np.isfinite(m) & (m > 0)
    return np.where(live, np.exp2(np.floor(np.log2(np.where(live, m, 1.0))) - MANTISSA_BITS[dtype]),
                    0.0)


def elementwise_ulp_rms(golden: np.ndarray, dtype: str, keep: np.ndarray | None = None) -> float:
    """RMS over the compared finite elements of each element's own ``dtype`` ulp (0 at 0)."""
    g = np.abs(np.asarray(golden, dtype=np.float64))
    sel = np.isfinite(g) & (g > 0)
    if keep is not None:
        sel &= np.broadcast_to(keep, g.shape)
    n = compared_count(g, keep)
    if n == 0 or not sel.any():
        return 0.0
    u = elementwise_ulp(g[sel], dtype)
    return float(np.sqrt(np.sum(u * u) / n))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round to the nearest bfloat16 (ties to even), returned as float32.

    Done on the float32 bit pattern so that NumPy alone suffices; inputs are first
    rounded to float32, exactly as a float64 -> float32 -> bfloat16 hand-over does.
    """
    a = np.array(x, dtype=np.float32)  # a C-contiguous copy that keeps 0-d arrays 0-d
    out = _round_off_bits(a, 16)
    np.copyto(out, a, where=np.isnan(a))
    return out


def _round_off_bits(a: np.ndarray, drop: int) -> np.ndarray:
    """The float32 array ``a`` with the low ``drop`` bits of each fraction rounded off
    (to nearest, ties to even): a fresh float32 array, right wherever the result's
    exponent is the narrower format's too (its normal range); NaN and overflow are
    the caller's.

    In place, in 32 bits (out= keeps 0-d arrays arrays): 8x faster than 64-bit
    temporaries on 4096 x 4096 (0.04 against 0.33 s), the low-precision baselines' hot
    spot. Only a NaN's pattern can carry past bit 31; the result equals the 64-bit
    form's on every float32 bit pattern."""
    bits = a.view(np.uint32)
    r = np.asarray(np.right_shift(bits, drop))
    np.bitwise_and(r, 1, out=r)
    np.add(r, (1 << (drop - 1)) - 1, out=r)
    np.add(r, bits, out=r)
    np.bitwise_and(r, (0xFFFFFFFF >> drop) << drop, out=r)
    return r.view(np.float32)


#: Below this many elements NumPy's own cast is quicker than :func:`f16_round`'s passes.
_F16_CAST_BELOW = 256


def f16_round(x: np.ndarray) -> np.ndarray:
    """Round to the nearest float16 (ties to even), returned as float32.

    The same values as ``x.astype(float32).astype(float16).astype(float32)`` on every
    float32 bit pattern (checked exhaustively once; ``tests/test_conformance.py``
    samples it), faster: NumPy's cast takes a scalar path for float16's subnormal
    range (``|x| < 2^-14``), about 70 ns an element, and the low-precision baselines'
    probabilities live there (a float16 softmax over 4096 keys: mostly below
    ``2^-14``). In float32 bits as :func:`bf16_round`: 13 of the 23 fraction bits are
    rounded off, right for float16's normal range; the subnormal range is a grid of
    ``2^-24`` (``rint(x 2^24) 2^-24``, exact scalings); magnitudes from 65520 up become
    infinities and NaN keeps its bits. On 2^20 normal values 1.3 ms against the cast's
    4.4, on values mostly in the subnormal range 12 against 71 ms.
    """
    a = np.array(x, dtype=np.float32)  # a C-contiguous copy that keeps 0-d arrays 0-d
    if a.size < _F16_CAST_BELOW:
        with np.errstate(over="ignore"):  # to infinity is the rounding, not an error
            return a.astype(np.float16).astype(np.float32)
    out = _round_off_bits(a, 13)
    m = np.abs(a)
    # one reduction each decides whether the fix-ups are needed (a NaN makes both run)
    if not np.min(m) >= 2.0 ** -14:
        small = m < 2.0 ** -14
        out[small] = np.rint(a[small] * np.float32(2.0 ** 24)) * np.float32(2.0 ** -24)
    if not np.max(m) < 65520:
        np.copyto(out, np.copysign(np.float32(np.inf), a), where=m >= 65520)
        np.copyto(out, a, where=np.isnan(a))
    return out


def stochastic_round(x, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Round each value to one of its two neighbours in ``dtype`` (``"bfloat16"``,
    ``"float16"``) at random, the upper with probability its closeness (stochastic
    rounding: unbiased, each error below one ulp), returned as float32.

    A draw of a rounding pattern. Where a computation amplifies its rounding by much and
    in a direction that depends on the pattern (Nystrom's pseudo-inverse: ``dZ = -Z dK Z``),
    a correct kernel's error is one draw from a wide distribution, which the
    round-to-nearest baseline, one other draw, does not show; a few draws of this rounding
    do (:class:`StochasticArray`). In float32 bits as :func:`bf16_round`: a random integer
    below ``2^drop`` added to the pattern, then the low ``drop`` bits cleared; float16's
    subnormal range on its grid of ``2^-24``, magnitudes past 65504 to infinity, NaN kept.
    """
    a = np.array(x, dtype=np.float32)
    shape, a = a.shape, a.reshape(-1)  # 1-d: a 0-d sum would be a scalar, not a view
    drop = 16 if dtype == "bfloat16" else 13
    r = a.view(np.uint32) + rng.integers(0, 1 << drop, size=a.shape, dtype=np.uint32)
    np.bitwise_and(r, (0xFFFFFFFF >> drop) << drop, out=r)
    out = r.view(np.float32)
    if dtype == "float16":
        m = np.abs(a)
        small = m < 2.0 ** -14
        if np.any(small):
            u = rng.random(int(np.sum(small)), dtype=np.float32)
            grid = np.floor(m[small] * np.float32(2.0 ** 24) + u)
            out[small] = np.copysign(grid * np.float32(2.0 ** -24), a[small])
        with np.errstate(invalid="ignore"):
            np.copyto(out, np.copysign(np.float32(np.inf), a), where=np.abs(out) > 65504)
    np.copyto(out, a, where=np.isnan(a))
    return out.reshape(shape)


def host_dtype(dtype: str):
    """The NumPy dtype holding values of ``dtype`` on the host (bfloat16 -> float32)."""
    return np.float32 if dtype == "bfloat16" else np.dtype(dtype)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and returned as float64 (booleans pass through)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x
    if dtype == "bfloat16":
        return bf16_round(x).astype(np.float64)
    return x.astype(np.dtype(dtype)).astype(np.float64)


class LowPrecisionArray(np.ndarray):
    """A float32 ndarray whose every operation rounds its result to a narrower dtype.

    NumPy has no bfloat16 arithmetic, array_api_compat refuses ml_dtypes' bfloat16,
    and NumPy's own float16 accumulates some reductions (``cumsum``) in float16, so
    the low-precision baselines run the reference on float32 arrays of a subclass
    (:class:`BF16Array`, :class:`F16Array`): each ufunc (``@``, ``*``, ``exp``,
    ``max``, ``sum``, ...) and array function (``where``, ``concat``, ...) computes in
    float32 and rounds its result to the nearest value of the dtype. That is a plain
    **fp32-accumulating** implementation in the dtype, as SDPA's math path and
    FlashAttention are: inputs and every intermediate stored in the dtype, products and
    reductions accumulated in float32. A kernel that accumulates ``P V`` or the row
    sum in its own dtype a few keys at a time makes a larger error than this.
    """

    #: the name of the dtype the results are rounded to
    dtype_name = ""

    @staticmethod
    def round(x: np.ndarray) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(_plain(x) for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_plain(x) for x in kwargs["out"])
        return _lp_wrap(type(self), getattr(ufunc, method)(*inputs, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return _lp_wrap(type(self), func(*_unwrap(args), **_unwrap(kwargs)))


class BF16Array(LowPrecisionArray):
    """float32 storage, every result rounded to bfloat16 (see :class:`LowPrecisionArray`)."""

    dtype_name = "bfloat16"

    @staticmethod
    def round(x):
        return bf16_round(x)


class F16Array(LowPrecisionArray):
    """float32 storage, every result rounded to float16 (see :class:`LowPrecisionArray`)."""

    dtype_name = "float16"

    @staticmethod
    def round(x):
        return f16_round(x)


LOW_PRECISION = {"bfloat16": BF16Array, "float16": F16Array}


class StochasticArray(LowPrecisionArray):
    """A :class:`LowPrecisionArray` whose every result is rounded stochastically
    (:func:`stochastic_round`) from the class's own generator; :func:`stochastic_array`
    makes one, its dtype and seed fixed."""

    rng: np.random.Generator

    @classmethod
    def round(cls, x):
        return stochastic_round(x, cls.dtype_name, cls.rng)


def stochastic_array(dtype: str, seed) -> type:
    """A fresh :class:`StochasticArray` class for ``dtype`` with its generator seeded
    ``seed``: ``x.view(cls)`` of values already in ``dtype`` computes with every result
    rounded at random, the same draws for the same seed."""
    return type(f"Stochastic{dtype.capitalize()}Array", (StochasticArray,),
                {"dtype_name": dtype, "rng": np.random.default_rng(seed)})


def _plain(x, cls=None):
    """``x`` as a plain ndarray when it is a ``cls`` (default :class:`LowPrecisionArray`)."""
    return x.view(np.ndarray) if isinstance(x, cls or LowPrecisionArray) else x


def _unwrap(obj, cls=None):
    """:func:`_plain` of ``obj`` and of the arrays in its lists, tuples and dicts."""
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, cls) for o in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v, cls) for k, v in obj.items()}
    return _plain(obj, cls)


def _lp_wrap(cls, out):
    if isinstance(out, tuple):
        return tuple(_lp_wrap(cls, o) for o in out)
    if isinstance(out, np.ndarray) and out.dtype.kind == "f":
        # float32 arithmetic first (a float64 operand would otherwise promote)
        return cls.round(out.astype(np.float32, copy=False)).view(cls)
    if isinstance(out, np.floating):
        return np.float32(cls.round(np.asarray(out, dtype=np.float32))[()])
    return out


def lp_array(x: np.ndarray, dtype: str) -> LowPrecisionArray:
    """``x`` rounded to ``dtype`` (``"bfloat16"`` or ``"float16"``) as a :class:`LowPrecisionArray`."""
    cls = LOW_PRECISION[dtype]
    return cls.round(np.asarray(x, dtype=np.float32)).view(cls)


def plain_array(x):
    """``x`` as a plain ndarray when it is a :class:`LowPrecisionArray` (same data; its
    operations no longer round), else ``x`` itself."""
    return _plain(x)


class _EmulatedClip:
    """``array_api_compat.numpy`` whose ``clip`` of a :class:`LowPrecisionArray` is
    defined by the oracle, not by array_api_compat: rounded and of its type (``keep``
    True, :data:`LOGITS_IN_DTYPE`) or a plain float32 ndarray (``keep`` False,
    :data:`LOGITS_IN_FLOAT32`).

    attn_ref clips its softmax logits (and Performer its feature exponents) to the
    dtype's range. Kept in the emulated type, the logits stay in the dtype, every step
    rounded, and so do the weights, which a real half-precision kernel does. As a plain
    array, the emulation's rounding stops there: the softmax weights (FAVOR+'s features)
    come from the rounded logits in float32, and their cast back to ``q``'s dtype is a
    no-op on float32 storage. array_api_compat (1.16) builds ``clip``'s result with
    ``np.empty``, the plain case; a release whose ``clip`` kept the subclass would
    otherwise have changed every baseline that relies on it.
    """

    def __init__(self, keep):
        self.keep = keep

    def __getattr__(self, name):
        import array_api_compat.numpy as npx

        # kept on the instance: the next lookup is a plain attribute (a reference makes
        # thousands; through __getattr__ they cost 6 % of the oracle's prepare)
        value = self.__dict__[name] = getattr(npx, name)
        return value

    def clip(self, x, /, *args, **kwargs):
        import array_api_compat.numpy as npx

        out = npx.clip(x, *args, **kwargs)
        if not isinstance(x, LowPrecisionArray):
            return out
        return _lp_wrap(type(x), out) if self.keep else _plain(out)


#: the NumPy namespace of :class:`_EmulatedClip` that keeps the emulated type: a
#: reference run on ``LowPrecisionArray`` inputs through it computes its softmax logits
#: and weights in the dtype
LOGITS_IN_DTYPE = _EmulatedClip(keep=True)


class _RowSumsInFloat32(_EmulatedClip):
    """:data:`LOGITS_IN_DTYPE` whose sums over the last axis of a
    :class:`LowPrecisionArray`, kept for a broadcast (``sum(x, axis=-1, keepdims=True)``:
    a softmax's denominator, its VJP's ``rowsum(P * dP)``), accumulate in float32 and
    stay float32 (a plain ndarray) until they meet an array of the dtype, whose
    operation rounds its result. torch's softmax and softmax backward on float16 and
    bfloat16 tensors compute so, each in one kernel: the backward reads ``P`` as stored,
    rounded to the dtype, and rounds ``P (dP - rowsum(P dP))`` once (the emulation rounds
    the difference and the product, and gave torch's bits on the row measured). Where a
    row's largest weight rounds to 1 that differs from a rounded row sum: ``dS`` of the
    largest logit is ``-sum_{j != max} P_j dP_j`` instead of about 0, a ``dq`` row many
    times its own size where ``dP`` is nearly constant along the row (Nystrom's ``K1``
    rows). Any other sum rounds as the emulated type's do."""

    def __init__(self):
        super().__init__(keep=True)

    def sum(self, x, /, *, axis=None, dtype=None, keepdims=False):
        import array_api_compat.numpy as npx

        if keepdims and isinstance(x, LowPrecisionArray) and axis in (-1, x.ndim - 1):
            return npx.sum(_plain(x), axis=axis, dtype=dtype, keepdims=True)
        return npx.sum(x, axis=axis, dtype=dtype, keepdims=keepdims)


#: :class:`_RowSumsInFloat32`: every step in the dtype but a softmax's row sums
ROW_SUMS_IN_FLOAT32 = _RowSumsInFloat32()

#: The NumPy namespace the oracle runs references through by default
#: (:meth:`conformance.judging.Prepared.reference`, the reference VJPs of
#: :mod:`conformance.grads`): :class:`_EmulatedClip` with a plain float32 ``clip``. The
#: "as registered" half-precision baselines are that computation; the oracle's
#: calibration (SDPA, FlexAttention, JAX and the Hugging Face models in float16 and
#: bfloat16), its mutants' catch rates and the form with every step in the dtype
#: (:data:`LOGITS_IN_DTYPE`) were measured on it. With a ``clip`` that kept the subclass,
#: softmax's float16 tolerances grew by a median 3 % (up to 5.3x on a soft-capped case),
#: bfloat16's by 6 %; Gemma's eager soft-cap-5 rounding passed, a 3 % wrong Sinkhorn
#: ``dk`` in bfloat16 failed 4 of 8 cases instead of 5, and Performer's float16 baseline
#: overflowed on 8 standard cases (measured 4 December 2026).
LOGITS_IN_FLOAT32 = _EmulatedClip(keep=False)


class _MatmulArray(np.ndarray):
    """An ndarray whose matrix products are its class's own (``_matmul``) and every other
    operation NumPy's, each result wrapped back into the class (``_wrap``): what
    :class:`GemmInDtypeArray` and :class:`SequentialGemmArray` share."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        cls = type(self)
        inputs = tuple(_plain(x, _MatmulArray) for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_plain(x, _MatmulArray) for x in kwargs["out"])
        if ufunc is np.matmul and method == "__call__":
            return cls._wrap(cls._matmul(*inputs, **kwargs))
        return cls._wrap(getattr(ufunc, method)(*inputs, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        plain = _unwrap(args, _MatmulArray), _unwrap(kwargs, _MatmulArray)
        return type(self)._wrap(func(*plain[0], **plain[1]))


class GemmInDtypeArray(_MatmulArray):
    """A float32 ndarray whose matrix products round both operands to a narrower dtype.

    What a fused half-precision kernel on tensor cores computes: every elementwise
    operation and reduction in float32, every matrix product with its operands in the
    dtype and a float32 accumulator. Through the softmax VJP of :mod:`attn_ref.grad` it
    is FlashAttention-2's backward: ``S``, ``P``, ``dP``, ``D`` and ``dS`` in float32,
    ``P`` rounded to the dtype for ``dV = P^T dO`` and ``dS`` for ``dQ = dS K`` and
    ``dK = dS^T Q`` (``flash_bwd_kernel.h`` converts both before its GEMMs); ``Q``, ``K``,
    ``V``, ``dO`` are in the dtype already. Subclasses :class:`BF16GemmArray`,
    :class:`F16GemmArray`; :func:`gemm_in_dtype` makes one.
    """

    #: the :class:`LowPrecisionArray` whose rounding the operands get
    rounding: type = LowPrecisionArray

    @classmethod
    def _matmul(cls, *inputs, **kwargs):
        return np.matmul(*(cls.rounding.round(np.asarray(x, dtype=np.float32)) for x in inputs), **kwargs)

    @classmethod
    def _wrap(cls, out):
        return _gemm_wrap(cls, out)


class BF16GemmArray(GemmInDtypeArray):
    """float32 arithmetic, matrix products on bfloat16 operands (:class:`GemmInDtypeArray`)."""

    rounding = BF16Array


class F16GemmArray(GemmInDtypeArray):
    """float32 arithmetic, matrix products on float16 operands (:class:`GemmInDtypeArray`)."""

    rounding = F16Array


_GEMM_IN_DTYPE = {"bfloat16": BF16GemmArray, "float16": F16GemmArray}


def _gemm_wrap(cls, out):
    if isinstance(out, tuple):
        return tuple(_gemm_wrap(cls, o) for o in out)
    if isinstance(out, np.ndarray) and out.dtype.kind == "f":
        # float32 arithmetic (a float64 operand would otherwise promote)
        return out.astype(np.float32, copy=False).view(cls)
    if isinstance(out, np.floating):
        return np.float32(out)
    return out


def gemm_in_dtype(x, dtype: str):
    """Host data as a :class:`GemmInDtypeArray` of ``dtype`` (``"bfloat16"``, ``"float16"``):
    float values as float32 (rounded to ``dtype`` first: the kernel's inputs), masks and
    lengths as they are, in the same array class (the references refuse a mix)."""
    if not isinstance(x, np.ndarray):
        return x
    cls = _GEMM_IN_DTYPE[dtype]
    if x.dtype.kind in "biu":
        return x.view(cls)
    return cls.rounding.round(np.asarray(x, dtype=np.float32)).view(cls)


class SequentialGemmArray(_MatmulArray):
    """A float64 ndarray whose matrix products add their terms one at a time, in order.

    What a plain loop computes, and a BLAS that does not split the sum: PyTorch's float64
    CPU matmul of ``(64, 16384) @ (16384, 32)`` (``dV = P^T dO`` over 16384 queries) erred
    1.78e-13 against the exact product, this order 1.76e-13, NumPy's OpenBLAS 1.42e-14:
    a bound set by the latter failed torch SDPA's float64 ``dv`` at 1.44. Every other
    operation is NumPy's. :func:`sequential_gemm` makes one.
    """

    @staticmethod
    def _matmul(a, b, **kwargs):
        """``a @ b`` summed term by term over the contracted axis (``O(M N K)``, ``K``
        steps); with keywords (``out=``), or a vector operand, NumPy's."""
        a, b = np.asarray(a), np.asarray(b)
        if kwargs or a.ndim < 2 or b.ndim < 2:
            return np.matmul(a, b, **kwargs)
        acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                       dtype=np.result_type(a, b))
        for i in range(a.shape[-1]):
            acc += a[..., :, i, None] * b[..., i, None, :]
        return acc

    @classmethod
    def _wrap(cls, out):
        if isinstance(out, tuple):
            return tuple(cls._wrap(o) for o in out)
        return out.view(cls) if isinstance(out, np.ndarray) else out


def sequential_gemm(x):
    """Host data as a :class:`SequentialGemmArray` (masks and lengths too: the references
    refuse a mix of array classes); anything else as it is."""
    return x.view(SequentialGemmArray) if isinstance(x, np.ndarray) else x


def bf16_array(x: np.ndarray) -> BF16Array:
    return lp_array(x, "bfloat16")


@dataclass(frozen=True)
class Metrics:
    max_err: float
    rms_err: float
    worst: tuple  # index of the largest error in the canonical layout
    magnitude: float  # max |golden| over compared elements
    nonfinite: int  # kernel values that are NaN/Inf where the golden is finite
    golden_nonfinite: int
    compared: int
    #: the largest row error over its row's bound (measure's ``row_tol``; 0 without one),
    #: and that row's index, error and bound
    row_ratio: float = 0.0
    row_worst: tuple = ()
    row_err: float = 0.0
    row_tol: float = 0.0


#: Query rows on either side of a row whose baseline error its bound also takes
#: (:meth:`Tolerance.row_bounds`), and the least number of values those rows hold
#: together (more rows where rows are short).
ROW_WINDOW, ROW_VALUES = 4, 64
#: How many times over a float16/bfloat16 row's bound takes its baselines' errors
#: (:meth:`Tolerance.row_bounds`' ``slack``): a neighbourhood's largest error is a sample
#: of a few hundred values, and where rounding is amplified (near ties, large logits)
#: the baseline's may be lucky where a correct kernel's is not. Taken once, correct
#: kernels failed rows: HuggingFace's Longformer output on
#: ``near-ties:b1h2-q64k64-d32`` at 1.18 (float16, seed 1) and 1.06 (bfloat16, seed 3),
#: lucidrains' Linformer on ``long:b1h1-q64k4096-d32`` at 1.06 (float16, seed 1), and
#: attn_ref's online softmax under torch autograd a bfloat16 decode case's ``dk`` row
#: at 1.01. Taken twice, last output rows 15 % (bfloat16) or 5 % (float16) off passed
#: 56 of 2741 judged rows of every variant's standard cases, where once passed 49.
ROW_SLACK = 2.0


def row_errors(got, golden, keep=None) -> np.ndarray:
    """The largest ``|got - golden|`` of each row (the last axis reduced) over the compared
    finite values, ``golden.shape[:-1]``; 0 where a row compares none."""
    got = np.asarray(got, dtype=np.float64)
    golden = np.asarray(golden, dtype=np.float64)
    sel = np.isfinite(golden) & np.isfinite(got)
    if keep is not None:
        sel &= np.broadcast_to(keep, golden.shape)
    return np.max(np.where(sel, np.abs(got - np.where(sel, golden, 0.0)), 0.0), axis=-1,
                  initial=0.0)


def row_magnitudes(golden, keep=None) -> np.ndarray:
    """``max |golden|`` of each row over the compared finite values, ``golden.shape[:-1]``."""
    g = np.abs(np.asarray(golden, dtype=np.float64))
    sel = np.isfinite(g)
    if keep is not None:
        sel &= np.broadcast_to(keep, g.shape)
    return np.max(np.where(sel, g, 0.0), axis=-1, initial=0.0)


def neighbourhood_max(rows: np.ndarray, window: int = ROW_WINDOW) -> np.ndarray:
    """The maximum of each entry and its ``window`` neighbours either side along the last
    axis (the query axis of a ``(B, H, Nq)`` array of rows)."""
    rows = np.asarray(rows, dtype=np.float64)
    out = rows.copy()
    n = rows.shape[-1] if rows.ndim else 0
    for s in range(1, min(window, n - 1) + 1):
        np.maximum(out[..., s:], rows[..., :-s], out=out[..., s:])
        np.maximum(out[..., :-s], rows[..., s:], out=out[..., :-s])
    return out


def ratios(err, tol) -> np.ndarray:
    """``err / tol`` elementwise, where a zero bound met exactly (a row of exact zeros) is a
    ratio of 0 and exceeded an infinite one."""
    err, tol = np.asarray(err, dtype=np.float64), np.asarray(tol, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tol > 0, err / np.where(tol > 0, tol, 1.0), np.where(err > 0, np.inf, 0.0))


def largest_errors(ms) -> Metrics:
    """A baseline's :class:`Metrics` over several forms: ``max_err`` and ``rms_err`` each
    the largest over ``ms``, from whichever form makes it, the rest the first form with
    the largest ``max_err``. Kept only where a form's largest error was larger, a form
    with a smaller largest error and a larger RMS error left the RMS bound lower (886 of
    6157 standard output bounds, 2355 of 22301 gradient ones)."""
    ms = list(ms)
    return replace(max(ms, key=lambda m: m.max_err), rms_err=max(m.rms_err for m in ms))


def measure(got: np.ndarray, golden: np.ndarray, keep: np.ndarray | None = None,
            row_tol: np.ndarray | None = None) -> Metrics:
    """Errors of ``got`` against ``golden`` (float64), over elements where ``keep``; with
    ``row_tol`` (each row's bound, ``golden.shape[:-1]``, or with a trailing axis of 1), also
    the worst row's error over its bound (:attr:`Metrics.row_ratio`)."""
    got = np.asarray(got, dtype=np.float64)
    golden = np.asarray(golden, dtype=np.float64)
    keep = np.ones(golden.shape, dtype=bool) if keep is None else np.broadcast_to(keep, golden.shape)
    gfin = np.isfinite(golden)
    golden_bad = int(np.count_nonzero(keep & ~gfin))
    bad = keep & gfin & ~np.isfinite(got)
    sel = keep & gfin & np.isfinite(got)
    err = np.where(sel, np.abs(got - np.where(gfin, golden, 0.0)), 0.0)
    n = int(np.count_nonzero(keep))
    if np.any(bad):
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), golden.shape))
    elif err.size:
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), golden.shape))
    else:
        worst = ()
    mag = float(np.max(np.abs(np.where(sel, golden, 0.0)))) if err.size else 0.0
    rows = {}
    if row_tol is not None and err.size:
        tol = np.asarray(row_tol, dtype=np.float64)
        if tol.ndim == err.ndim:
            tol = tol[..., 0]
        row_err = np.max(err, axis=-1)
        r = ratios(row_err, tol)
        at = np.unravel_index(int(np.argmax(r)), r.shape)
        rows = {"row_ratio": float(r[at]), "row_worst": tuple(int(i) for i in at),
                "row_err": float(row_err[at]), "row_tol": float(tol[at])}
    return Metrics(
        max_err=float(err.max()) if err.size else 0.0,
        rms_err=float(np.sqrt(np.sum(err * err) / max(n, 1))),
        worst=worst,
        magnitude=mag,
        nonfinite=int(np.count_nonzero(bad)),
        golden_nonfinite=golden_bad,
        compared=n,
        **rows,
    )


#: Variant parameters that kernels keep in float32 whatever the activations' dtype:
#: retention's per-head decays ``gamma_h = 1 - 2^(-5-h)``, which RetNet and
#: flash-linear-attention compute in float32 (fla's retention kernels build them in,
#: torchscale makes them with ``dtype=torch.float``). Rounded to bfloat16 they are
#: another function: ``1 - 2^-9`` and beyond are not bfloat16 numbers, and from
#: ``h = 4`` on the rounded decay is 1 (no decay) or ``1 - 2^-8``.
FLOAT32_PARAMS = frozenset({"gamma"})


def param_dtype(name: str, dtype: str) -> str:
    """The dtype a variant parameter ``name`` is rounded to, computed in and passed to the
    kernel in, for a case in ``dtype``: float32 for :data:`FLOAT32_PARAMS` in float16 and
    bfloat16, else ``dtype`` itself."""
    return "float32" if name in FLOAT32_PARAMS and dtype in LOW_PRECISION else dtype


def normalized_in_dtype(x, dtype: str) -> np.ndarray:
    """``q`` or ``k`` as a model calling fla's ``l2norm`` hands it to a float16/bfloat16
    recurrence: ``x / sqrt(|x|^2 + eps)`` (``attn_ref.recurrent.delta.L2NORM_EPS``)
    computed in float32, the result stored in ``dtype``; float64 values of ``x``'s shape.
    The one normalisation of the forward's baseline form, its backward and the final
    state's bound (:mod:`conformance.judging`, :mod:`conformance.grads`,
    :mod:`conformance.extras`)."""
    from attn_ref.recurrent.delta import L2NORM_EPS

    x32 = np.asarray(x, dtype=np.float32)
    return round_to(x32 / np.sqrt(np.sum(x32 * x32, axis=-1, keepdims=True)
                                  + np.float32(L2NORM_EPS)), dtype)


def as_dtype(x, dtype):
    """Host float64 data as the NumPy array type that computes in ``dtype``."""
    if not isinstance(x, np.ndarray):
        return x
    if dtype in LOW_PRECISION:
        if x.dtype.kind in "biu":
            # a mask or sequence lengths: the same library as the float inputs (the
            # references refuse arrays of another library), values untouched
            return x.view(LOW_PRECISION[dtype])
        # float32 arithmetic rounded to the dtype after every operation: fp32 accumulation
        return lp_array(x, dtype)
    if x.dtype.kind in "biu":
        return x
    if dtype == "longdouble":
        return x.astype(np.longdouble)
    return x.astype(np.dtype(dtype))


#: The least cosine between a kernel's error and a plain lower-dtype implementation's
#: for the error to be called that dtype's rounding. Both round the inputs to the dtype
#: the same way, so their errors share a direction: measured 0.45-1.0 on a NumPy float16
#: softmax against the float16 baseline (n >= 128 compared values), against at most 0.35
#: for mistakes of 1 % (beta, a feature map, a projection) of the same size
#: (``python -m conformance.mutants audit``).
ROUNDING_COSINE = 0.5


def rounding_cosine(err: np.ndarray, base_err: np.ndarray) -> tuple[float, float]:
    """``(cosine, least)``: the cosine between a kernel's error ``err`` and a plain
    lower-dtype implementation's ``base_err`` (each: output minus golden, zeros where not
    compared), and the least cosine that makes the kernel's error that dtype's rounding:
    :data:`ROUNDING_COSINE`, or ``3 / sqrt(n)`` over ``n`` compared (non-zero) values -
    three standard deviations of the cosine of unrelated errors - when larger (above 1: too
    few values to tell). ``(nan, inf)`` when either error is zero.

    Rounding to a dtype is noise with the direction of that dtype's input rounding; a
    mistake of a small factor is a systematic change that an error of the same size
    does not share. Only the former is named as the dtype's rounding.
    """
    e, b = (np.where(np.isfinite(x), x, 0.0).ravel() for x in (err, base_err))
    n = int(np.count_nonzero((e != 0) | (b != 0)))
    den = float(np.linalg.norm(e) * np.linalg.norm(b))
    if n == 0 or not den > 0:
        return math.nan, math.inf
    return float(e @ b) / den, max(ROUNDING_COSINE, 3.0 / math.sqrt(n))


#: What a precision diagnosis says when the error's direction does not settle it.
UNTOLD = "which the direction of the error does not tell apart here"


def rounding_caveat(cos: float, least: float) -> str:
    """The clause a diagnosis naming a lower dtype's rounding adds when
    :func:`rounding_cosine` does not confirm it: the same size is what a systematic
    mistake of that relative size makes (a parameter 1 % off is 2.6 bfloat16 epsilons;
    a real float32 computation's error shares only a cosine of 0.06-0.17 with the
    reference's own float32 rounding, measured on fla's naive GLA and DeltaNet), and the
    reader must know it is not settled. Empty when the cosine confirms it."""
    if cos >= least:
        return ""
    why = ("too few values compared" if least > 1 else
           f"cosine {cos:.2f} with that implementation's error")
    return f" - or a systematic mistake of that size, {UNTOLD} ({why})"
