"""Linear attention's feature maps and option checks, shared by every form.

The feature map ``phi`` (a named one, :data:`FEATURE_MAPS`, or a callable written in the
array API), applied row-wise to ``q`` and ``k`` with its output checked (shape, dtype,
one ``d'`` for both), and the checks and defaults of the family's options: ``eps``,
``order``, ``scale``, the chunk and block sizes. Conventions: :mod:`attn_ref.linear`.
"""

from __future__ import annotations

import math

import array_api_compat

from .._checks import check_array, check_flag, check_positive_int, check_real, default_scale, namespace
from .._common import add_into, causal_alignment, numpy_backed

__all__ = [
    "FEATURE_MAPS",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_EPS",
    "check_feature_map",
    "feature_map_features",
    "features_qk",
    "feature_pair",
    "check_eps",
    "check_order",
    "check_scale",
    "check_engine_options",
]

FEATURE_MAPS = ("elu+1", "relu", "identity")
_ORDERS = ("linear", "quadratic")
DEFAULT_CHUNK_SIZE = 64
DEFAULT_EPS = 1e-6
# Rows per block of the linear order: 1 MiB per (8, B, 64) float32 block, so the
# feature maps and the chunk states of a block stay in cache. Chosen by measurement
# (N = 65536, 8 heads, d = 64, C = 64, BLAS on one thread, CPU-time minima of 5
# interleaved calls, two runs on a loaded 2-core machine, load 10-13, so noisy):
# causal 556 ms at B = 512 against 619 (1024) and 667 (2048); non-causal 297 ms against
# 328 and 427. Not re-checked with both BLAS threads on a quiet machine.
DEFAULT_BLOCK_SIZE = 512


# ---------------------------------------------------------------- feature maps


def _zero_like(xp, x):
    """A zero to compare ``x`` with: ``x``'s shape on NumPy, else one 0-d zero.

    NumPy (2.4) takes a loop without SIMD for ``minimum`` and ``maximum`` when one
    operand is a broadcast scalar: on an ``(8, 128, 64)`` float32 block, 39 us against
    5 us with a full-size operand, as slow as ``exp`` (37 us); making the zeros costs
    6 us. Linear attention at N = 65536, 8 heads, d = 64, non-causal: 0.32 against
    0.39 s of CPU (medians of 8 interleaved calls, the same bits). PyTorch is the other
    way round (1.44 against 1.01 ms for the feature map of an ``(8, 512, 64)`` block),
    so only NumPy's arrays (and array-api-strict's) take the full-size zeros.
    """
    if numpy_backed(x):
        return xp.zeros_like(x)
    return xp.zeros((), dtype=x.dtype, device=array_api_compat.device(x))


def _elu_plus_one(xp, x, zero=None):
    # elu(x) + 1 = max(x, 0) + exp(min(x, 0)): exp never sees a positive argument,
    # so it cannot overflow (and its derivative stays finite for the VJP). ``zero``: a
    # zero to compare with (:func:`_zero_like`'s, or a block's reused one: feature_pair).
    zero = _zero_like(xp, x) if zero is None else zero
    # into exp's own array: one fresh array fewer per call, the same sums (addition commutes)
    return add_into(xp.exp(xp.minimum(x, zero)), xp.maximum(x, zero))


def _relu(xp, x, zero=None):
    return xp.maximum(x, _zero_like(xp, x) if zero is None else zero)


_NAMED = {"elu+1": _elu_plus_one, "relu": _relu, "identity": lambda xp, x, zero=None: x}


def check_feature_map(feature_map):
    """Validate ``feature_map``: one of :data:`FEATURE_MAPS` or a callable."""
    if callable(feature_map):
        return feature_map
    if isinstance(feature_map, str) and feature_map in _NAMED:
        return feature_map
    raise ValueError(
        f"feature_map must be one of {', '.join(map(repr, FEATURE_MAPS))} or a callable "
        f"phi(x) -> (..., N, d'), got {feature_map!r}"
    )


def feature_map_features(x, /, *, feature_map="elu+1", name="x", xp=None):
    """Apply a feature map to the rows of ``x``: ``phi(x)``, shape ``(..., N, d')``.

    Parameters
    ----------
    x : array, shape (..., N, d)
    feature_map : {"elu+1", "relu", "identity"} or callable
        A callable must return an array of the same library, floating dtype
        ``x.dtype`` and shape ``x.shape[:-1] + (d',)``. It must be row-wise (row ``i`` of
        the result depends only on row ``i`` of ``x``): the variants apply it to blocks of
        rows, so a map that mixes rows (a softmax over the sequence, a normalisation by
        a whole-sequence statistic) would change with ``block_size``. Each call checks
        this once, cheaply, by comparing the map of the first row alone with the first
        row of the whole result (``ValueError`` if they differ by more than
        ``sqrt(eps)`` relative). The callable receives a copy of the caller's rows, so
        writing into its argument cannot corrupt ``q`` or ``k``.
    name : str
        The argument name used in error messages (``"q"``, ``"k"``).

    Returns
    -------
    array, shape (..., N, d')
    """
    xp = namespace((name, x), xp=xp)
    feature_map = check_feature_map(feature_map)
    if isinstance(feature_map, str):
        return _NAMED[feature_map](xp, x)
    what = f"feature_map applied to {name} {tuple(x.shape)}"
    f = _call_feature_map(xp, feature_map, x, name, what)
    if x.shape[-2] > 1:
        _check_row_wise(xp, feature_map, x, f, name, what)
    return f


def _call_feature_map(xp, feature_map, x, name, what):
    """``feature_map`` applied to a copy of ``x`` (so it cannot write into the caller's
    array), its result checked like an array argument (library, dtype, shape)."""
    f = feature_map(xp.asarray(x, copy=True))
    if not array_api_compat.is_array_api_obj(f):
        raise TypeError(f"{what} must return an array, got {type(f).__name__}")
    check_array(what, f, like=x, like_name=name, dtype=x.dtype)
    if f.ndim != x.ndim or tuple(f.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{what} must return shape (..., N, d') = {tuple(x.shape[:-1]) + ('d_prime',)}, "
            f"got shape {tuple(f.shape)}"
        )
    return f


def _check_row_wise(xp, feature_map, x, f, name, what):
    """The map of the first row alone must equal the first row of ``f = phi(x)``.

    One extra call on a single row. A row-wise map agrees up to rounding (a matmul of
    one row may round differently from a matmul of many), so the test allows
    ``sqrt(eps)`` relative to the row's largest entry; a map that mixes rows (a softmax
    or normalisation over the sequence) differs by far more.
    """
    first = f[..., :1, :]
    try:
        alone = _call_feature_map(xp, feature_map, x[..., :1, :], name, what)
    except ValueError as exc:  # the map's shape depends on the number of rows
        alone, gap = None, str(exc)
    if alone is not None and alone.shape[-1] != first.shape[-1]:
        gap = f"d'={alone.shape[-1]} for one row, d'={first.shape[-1]} for all"
    elif alone is not None:
        try:
            tol = math.sqrt(float(xp.finfo(x.dtype).eps)) * (float(xp.max(xp.abs(first))) + 1.0)
            diff = float(xp.max(xp.abs(alone - first)))
        except TypeError:
            # traced arrays (under jax.jit) have no values to compare: the check needs
            # concrete ones and is made on eager calls only
            return
        # NaN (from NaN input) compares False: such input is not evidence of mixing rows.
        gap = f"by {diff:.3g}" if diff > tol else None
    if gap is not None:
        raise ValueError(
            f"{what} is not row-wise: the map of the first row alone differs from the first "
            f"row of the map of all {x.shape[-2]} rows ({gap}); the variants apply it to "
            "blocks of rows, so a map that mixes rows (e.g. a softmax over the sequence) "
            "would change with block_size"
        )


def features_qk(xp, q, k, feature_map):
    """The feature maps ``(phi(q), phi(k))``, checked to share their feature dimension ``d'``."""
    fq = feature_map_features(q, feature_map=feature_map, name="q", xp=xp)
    fk = feature_map_features(k, feature_map=feature_map, name="k", xp=xp)
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(
            f"feature_map must give q and k the same feature dimension d', got "
            f"{fq.shape[-1]} for q {tuple(q.shape)} and {fk.shape[-1]} for k {tuple(k.shape)}"
        )
    return fq, fk


def feature_pair(xp, q, k, feature_map, scale):
    """``phi_q(rows)``, ``phi_k(rows)`` for row blocks of ``q`` and ``k``.

    ``phi_q`` carries the similarity scale. Both check the callable's output (shape,
    dtype) on every block, and that queries and keys get the same ``d'``. A named map
    on NumPy compares every block of a shape with one zero array made once
    (:func:`_block_zero`), not a fresh one per block.
    """
    feature_map = check_feature_map(feature_map)
    seen, zeros = {}, {}

    def phi(name, x):
        if isinstance(feature_map, str):
            # rows of q or k, checked already: the named map itself, its zero reused
            return _NAMED[feature_map](xp, x, _block_zero(xp, x, zeros))
        f = feature_map_features(x, feature_map=feature_map, name=name, xp=xp)
        d_prime = seen.setdefault("d'", (name, f.shape[-1]))
        if f.shape[-1] != d_prime[1]:
            raise ValueError(
                f"feature_map must give q and k the same feature dimension d', got "
                f"{f.shape[-1]} for {name} {tuple(x.shape)} and {d_prime[1]} for {d_prime[0]}"
            )
        return f

    def phi_q(x):
        f = phi("q", x)
        return f * scale if scale != 1.0 else f

    return phi_q, lambda x: phi("k", x)


def _block_zero(xp, x, zeros):
    """:func:`_zero_like` of ``x``, made once per shape and dtype in ``zeros`` (a dict that
    lives for one call; the maps only read it) where that is a full-size array (NumPy);
    None elsewhere (the maps then take their 0-d zero). The blocks of a call share one
    shape, so the zeros are made once instead of once per block: at N = 65536, 8 heads,
    d = 64 that is 256 fills of 1 MiB, about 11 us each (NumPy, one thread)."""
    if not numpy_backed(x):
        return None
    key = (tuple(x.shape), x.dtype)
    zero = zeros.get(key)
    if zero is None:
        # two pooled groups may both make it: either array is a zero
        zero = zeros[key] = _zero_like(xp, x)
    return zero


# ---------------------------------------------------------------- option checks


def check_eps(eps):
    """A positive finite ``eps`` as ``float``; a non-number is a ``TypeError``, the rest a ``ValueError``."""
    if not check_real("eps", eps, want="a positive finite real number") > 0:
        raise ValueError(f"eps must be a positive finite real number, got {eps!r}")
    return float(eps)


def check_order(order):
    """One of ``"linear"``, ``"quadratic"``, else a ``ValueError``."""
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {', '.join(map(repr, _ORDERS))}, got {order!r}")
    return order


def check_scale(scale):
    """The feature scale: ``1.0`` by default (linear attention does not scale by ``1/sqrt(d)``)."""
    return 1.0 if scale is None else default_scale(1, scale)


def check_engine_options(causal, order, chunk_size, block_size, normalize, eps):
    """The options of the linear-order engine and its VJP, checked once: returns
    ``(alignment, normalize, eps)`` (``alignment`` None when not causal)."""
    alignment = causal_alignment(causal)
    check_order(order)
    check_positive_int("chunk_size", chunk_size)
    check_positive_int("block_size", block_size)
    return alignment, check_flag("normalize", normalize), check_eps(eps)
