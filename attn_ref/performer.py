"""Performer (FAVOR+): softmax attention estimated by random features.

The softmax kernel is an expectation over Gaussian ``w`` (Choromanski et al. 2020,
"Rethinking Attention with Performers")::

    exp(x . y) = E_w[ exp(w.x - |x|^2/2) exp(w.y - |y|^2/2) ]

so ``m`` random rows ``w_1..w_m`` give features ``phi(x) = exp(W x - |x|^2/2) / sqrt(m)``
with ``E[phi(x) . phi(y)] = exp(x . y)``, positive by construction ("positive random
features"). Feeding ``phi(sqrt(scale) q)`` and ``phi(sqrt(scale) k)`` to linear
attention (:mod:`attn_ref.linear`) estimates ``softmax(scale Q K^T) V`` in ``O(N m dv)``.
The older trigonometric features ``exp(|x|^2/2) [sin(W x), cos(W x)] / sqrt(m)`` are
also unbiased but signed, so their denominators can vanish. Orthogonal rows
(:func:`random_features` ``kind="orthogonal"``) lower the variance at equal ``m``.
``docs/performer.md`` derives the estimator.

The stabiliser
--------------
``exp`` of the raw exponents overflows or underflows for large inputs. A constant
subtracted from the exponent cancels in the normalised output when it is common to
everything it multiplies: for a query, any per-query constant (its own maximum over
features, as the reference implementation does); for the keys, a constant shared by
every key a query sees. Non-causal attention uses the maximum over all keys and
features (per batch and head), as FAVOR+ does. Causal attention must not do that - it
would let a future key change a past output (underflow makes the "cancelling"
constant visible). Causally, each key ``j`` is shifted by its own maximum exponent
``c_j`` (for the trigonometric kernel ``c_j = |x_j|^2/2``) and carries the weight
``exp(c_j - R_i)`` towards query ``i``, where ``R_i = max_{j visible to i} c_j`` is a
running maximum over the past only. As in online softmax, the summed states are
rescaled when the running maximum grows: chunk states at their chunk's maximum, an
exclusive prefix over chunks by a log-depth doubling scan with rescaling, and a masked
running maximum inside each chunk. Every factor is at most 1, nothing overflows, and
no key influences an earlier query's output, bit for bit.

The feature floor (``feature_eps``)
-----------------------------------
google-research's FAVOR+ code (``numerical_stabilizer``) and lucidrains'
performer-pytorch (``softmax_kernel``, ``eps=1e-4``) add a constant to each feature after
the stabiliser, ``phi(x) = (exp(W x - |x|^2/2 - c) + feature_eps) / sqrt(m)``, with their
own stabiliser: ``c`` the largest ``w.x`` of each query's features, and of all keys'
features of a batch entry and head. The floor is relative to ``exp(-c)``, so it does not
cancel: features far below that maximum are moved by O(1). That is another function,
which ``feature_eps > 0`` computes (non-causal; that code's causal form takes ``c`` over
every key, future ones included). ``docs/performer.md`` compares the two.
"""

from __future__ import annotations

import math
import sys

import array_api_compat

from . import random as _random
from ._checks import check_array, check_positive_int, check_qkv, default_scale, is_floating, namespace
from ._common import causal_alignment, ceil_div
from .linear import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_SIZE,
    causal_plan,
    causal_visible,
    check_eps,
    check_order,
    linear_from_features,
    linear_from_row_maps,
    pad_rows,
    readout,
    safe_denominator,
    weights_from_features,
    zero_keyless_rows,
)
from .softmax.tiles import logit_dtype

__all__ = [
    "KERNELS",
    "random_features",
    "favor_features",
    "performer_attention",
    "performer_attention_weights",
    "default_num_features",
    "half_sq_norm",
    "feature_exponent",
    "features_from_exponent",
    "row_offset",
    "key_offset",
    # Named steps that attn_ref.grad differentiates.
    "performer_features",
    "prepare_performer",
    "default_eps",
    "floored_features",
]

KERNELS = ("positive", "trigonometric")
#: ``2^-126``, float32's smallest normal number (the default floor's lower bound)
FLOAT32_SMALLEST_NORMAL = 2.0 ** -126
_KINDS = ("orthogonal", "iid")


def default_num_features(d):
    """``m = max(2 d, round(d log d))``, the Performer paper's ``d log d`` rule."""
    check_positive_int("d", d)
    return max(2 * d, int(round(d * math.log(d))))


def random_features(d, m, /, *, kind="orthogonal", seed, dtype=None, device=None, xp):
    """The ``(m, d)`` random projection ``W`` of FAVOR+, drawn from ``seed``.

    Parameters
    ----------
    d : int
        Head dimension of ``q`` and ``k``.
    m : int
        Number of random features.
    kind : {"orthogonal", "iid"}
        ``"iid"``: i.i.d. standard normal rows. ``"orthogonal"``: rows orthogonal in
        blocks of ``d`` with the norms of Gaussian rows (each row alone is still
        ``N(0, I_d)``), which lowers the estimator's variance.
    seed : int
        Non-negative; the same seed gives the same ``W`` on every backend.
    dtype, device, xp
        Where to build ``W``; ``dtype`` defaults to ``xp.float64``.

    Returns
    -------
    array, shape (m, d)

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import random_features
    >>> random_features(4, 10, seed=0, xp=xp).shape
    (10, 4)
    """
    check_positive_int("d", d)
    check_positive_int("m", m)
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, _KINDS))}, got {kind!r}")
    if kind == "iid":
        return _random.standard_normal((m, d), seed=seed, dtype=dtype, device=device, xp=xp)
    return _random.orthogonal_gaussian(m, d, seed=seed, dtype=dtype, device=device, xp=xp)


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    return kernel


def _check_projection(xp, projection, d, like, like_name="q"):
    check_array("projection", projection, like=like, like_name=like_name, dtype=like.dtype)
    if projection.ndim != 2 or projection.shape[1] != d or projection.shape[0] < 1:
        raise ValueError(
            f"projection must have shape (m, d) = (m, {d}) with m >= 1 to match the head "
            f"dimension d={d} of q and k, got shape {tuple(projection.shape)}"
        )
    return projection


# ---------------------------------------------------------------- features, in named steps


def half_sq_norm(xp, x):
    """``|x|^2 / 2`` of each row, shape ``(..., N, 1)``."""
    return xp.sum(x * x, axis=-1, keepdims=True) / 2


def feature_exponent(xp, x, projection, kernel):
    """The log-magnitude of the features: ``W x - |x|^2/2`` (positive) or ``|x|^2/2`` (trig).

    Clamped to ``+-finfo.max``: for ``x = sqrt(scale) q`` with a huge scale, ``|x|^2``
    overflows, and an infinite exponent would meet its stabiliser as ``inf - inf = NaN``.
    Clamped, the stabilised features stay finite (every such row shares one offset).
    """
    e = (x @ xp.matrix_transpose(projection) - half_sq_norm(xp, x) if kernel == "positive"
         else half_sq_norm(xp, x))
    big = xp.finfo(e.dtype).max
    return xp.clip(e, min=-big, max=big)


def features_from_exponent(xp, x, projection, exponent, offset, kernel):
    """``exp(exponent - offset) / sqrt(m)``, times ``[sin Wx, cos Wx]`` for the trig kernel."""
    m = projection.shape[0]
    e = xp.exp(exponent - offset) if offset is not None else xp.exp(exponent)
    if kernel == "positive":
        return e / math.sqrt(m)
    u = x @ xp.matrix_transpose(projection)
    return xp.concat([xp.sin(u) * e, xp.cos(u) * e], axis=-1) / math.sqrt(m)


def row_offset(xp, exponent):
    """Each row's own maximum exponent, shape ``(..., N, 1)``: the per-query stabiliser
    (it cancels in each query's normalisation) and the per-key log-scales ``c_j`` of
    the causal forward."""
    return xp.max(exponent, axis=-1, keepdims=True)


def key_offset(xp, exponent, projection, kernel, causal):
    """Key stabiliser shared by all keys: data max (non-causal), projection bound (causal).

    The causal bound ``max_f |w_f|^2/2 - log(finfo.max)/4`` depends on the projection
    alone (every exponent ``w.x - |x|^2/2`` is at most ``|w|^2/2``), so it cannot leak a
    future key; it serves only inputs without queries or keys. The forward and its VJP
    use the per-key log-scales (:func:`stabilised_causal_features`): below this bound
    by more than the dtype's exponent range, every key's features underflow to zero.
    """
    if not causal:
        m = xp.max(exponent, axis=-1, keepdims=True)
        return xp.max(m, axis=-2, keepdims=True)
    if kernel == "trigonometric":
        return None
    bound = xp.max(half_sq_norm(xp, projection))
    # log(finfo.max) taken in the dtype: float(finfo.max) is inf for a dtype wider than
    # float64 (np.longdouble), and log(inf) would make the offset -inf.
    largest = xp.asarray(xp.finfo(projection.dtype).max, dtype=projection.dtype,
                         device=array_api_compat.device(projection))
    # kept an array (no float()): under jax.jit both are traced values
    return bound - xp.log(largest) / 4


def _very_negative(xp, dtype):
    # A finite stand-in for -inf: exp() of it (or of it minus a real number) is 0, and
    # the difference of two of them is 0, never NaN. Kept as the library's scalar of
    # ``dtype`` (never float()): finfo.max of a dtype wider than float64 (np.longdouble)
    # is inf as a Python float, and inf - inf would bring back the NaN this avoids.
    return -(xp.finfo(dtype).max / 4)


def logscaled_weights(xp, ck, nq, alignment):
    """Causal ``w_ij = exp(c_j - R_i)``, zero where query ``i`` does not see key ``j``:
    ``(..., Nq, Nk)`` from the per-key log-scales ``ck (..., Nk, 1)``, ``R_i`` the largest
    ``c_j`` query ``i`` sees (every ``w_ij <= 1``, the largest 1)."""
    dev = array_api_compat.device(ck)
    vis = causal_visible(xp, nq, ck.shape[-2], alignment, dev)
    e = xp.where(vis, xp.matrix_transpose(ck), _very_negative(xp, ck.dtype))
    w = xp.exp(e - xp.max(e, axis=-1, keepdims=True))
    return xp.where(vis, w, xp.zeros((), dtype=w.dtype, device=dev))


def _logscaled_quadratic(xp, fq, fk, ck, alignment):
    """Causal ``A_ij = (phi(q_i) . phi(k_j)) exp(c_j - R_i)`` (masked), ``R_i`` the visible max."""
    return (fq @ xp.matrix_transpose(fk)) * logscaled_weights(xp, ck, fq.shape[-2], alignment)


def _rescaled_prefix_scan(xp, t, tz, g):
    """Inclusive prefix sums over axis -3 of states ``t`` (and ``tz``) held at log-scales ``g``.

    Entry ``b`` becomes ``sum_{b' <= b} exp(g_b' - G_b) t_b'`` with ``G_b = max_{b' <= b} g_b'``
    (returned too). Hillis-Steele doubling: ``ceil(log2 n)`` steps, each combining an entry
    with the one ``2^s`` before it after rescaling both to their common maximum.
    """
    n = g.shape[-1]
    dev = array_api_compat.device(t)
    neg = _very_negative(xp, g.dtype)
    s = 1
    while s < n:
        g_sh = xp.concat([xp.full(tuple(g.shape[:-1]) + (s,), neg, dtype=g.dtype, device=dev),
                          g[..., :n - s]], axis=-1)
        t_sh = xp.concat([xp.zeros(tuple(t.shape[:-3]) + (s,) + tuple(t.shape[-2:]), dtype=t.dtype,
                                   device=dev), t[..., :n - s, :, :]], axis=-3)
        tz_sh = xp.concat([xp.zeros(tuple(tz.shape[:-2]) + (s, tz.shape[-1]), dtype=tz.dtype, device=dev),
                           tz[..., :n - s, :]], axis=-2)
        g_new = xp.maximum(g, g_sh)
        a, b = xp.exp(g_sh - g_new), xp.exp(g - g_new)
        t = t_sh * a[..., None, None] + t * b[..., None, None]
        tz = tz_sh * a[..., None] + tz * b[..., None]
        g = g_new
        s *= 2
    return t, tz, g


def logscaled_chunked(xp, fq, fk, ck, v, chunk_size):
    """Square top-left causal attention with per-key log-weights ``c_j``, chunk by chunk.

    The chunked form of :mod:`attn_ref.linear` with online-softmax-style rescaling:
    chunk states at the chunk's maximum ``c``, an exclusive rescaled prefix over chunks,
    and per query ``R_i = max(prefix max of earlier chunks, running max inside its chunk)``.
    """
    n = fq.shape[-2]
    c = min(chunk_size, n)
    n_chunks = ceil_div(n, c)
    pad = n_chunks * c - n
    neg = _very_negative(xp, ck.dtype)
    dev = array_api_compat.device(fq)
    fq, fk, v = (pad_rows(xp, x, 0, pad) for x in (fq, fk, v))
    ck = pad_rows(xp, ck, 0, pad, fill=neg)
    qc, kc, vc = (xp.reshape(x, tuple(x.shape[:-2]) + (n_chunks, c, x.shape[-1])) for x in (fq, fk, v))
    cc = xp.reshape(ck, tuple(ck.shape[:-2]) + (n_chunks, c))
    top = xp.max(cc, axis=-1)  # (..., n_chunks)
    kw = kc * xp.exp(cc - top[..., None])[..., None]
    t, tz, g = _rescaled_prefix_scan(xp, xp.matrix_transpose(kw) @ vc, xp.sum(kw, axis=-2), top)
    # Exclusive: chunk b reads the scan up to chunk b - 1.
    t = xp.concat([xp.zeros(tuple(t.shape[:-3]) + (1,) + tuple(t.shape[-2:]), dtype=t.dtype, device=dev),
                   t[..., :-1, :, :]], axis=-3)
    tz = xp.concat([xp.zeros(tuple(tz.shape[:-2]) + (1, tz.shape[-1]), dtype=tz.dtype, device=dev),
                    tz[..., :-1, :]], axis=-2)
    g = xp.concat([xp.full(tuple(g.shape[:-1]) + (1,), neg, dtype=g.dtype, device=dev), g[..., :-1]], axis=-1)
    tril = xp.arange(c, device=dev)[None, :] <= xp.arange(c, device=dev)[:, None]
    e = xp.where(tril, cc[..., None, :], neg)  # (..., n_chunks, C, C): c_j for j <= i
    r = xp.maximum(xp.max(e, axis=-1), g[..., None])  # R_i, (..., n_chunks, C)
    inter = xp.exp(g[..., None] - r)[..., None]
    num = (qc @ t) * inter
    den = (qc @ tz[..., None]) * inter
    a = (qc @ xp.matrix_transpose(kc)) * xp.where(tril, xp.exp(e - r[..., None]), xp.zeros((), dtype=e.dtype,
                                                                                          device=dev))
    num, den = num + a @ vc, den + xp.sum(a, axis=-1, keepdims=True)
    shape = tuple(num.shape[:-3]) + (n_chunks * c,)
    return xp.reshape(num, shape + (num.shape[-1],))[..., :n, :], xp.reshape(den, shape + (1,))[..., :n, :]


def stabilised_causal_features(xp, q, k, projection, kernel, scale):
    """``(fq, fk, ck)``: features stabilised row by row and the keys' log-scales ``c_j``.

    ``phi(k_j) = fk_j exp(c_j)`` exactly, ``c_j`` the largest exponent of key ``j``
    (:func:`row_offset`); each query's own offset cancels in its normalisation. Held
    apart, the log-scales meet only as differences ``c_j - R_i`` (:func:`logscaled_weights`,
    :func:`logscaled_chunked`), so no key's features underflow however far its
    exponents lie below the other keys' (large logits: every ``|x|^2 / 2`` in the
    thousands).
    """
    root = math.sqrt(scale)
    xq, xk = q * root, k * root
    eq = feature_exponent(xp, xq, projection, kernel)
    ek = feature_exponent(xp, xk, projection, kernel)
    ck = row_offset(xp, ek)
    return (features_from_exponent(xp, xq, projection, eq, row_offset(xp, eq), kernel),
            features_from_exponent(xp, xk, projection, ek, ck, kernel), ck)


def logscaled_square(xp, fq, fk, ck, v, alignment):
    """The causal problem as a square top-left one (:func:`attn_ref.linear.align_square`),
    the log-scales too: ``(fq, fk, ck, v, (p_q, p_k, keep))``. Padded keys carry zero
    features and a log-scale of ``-finfo.max / 4`` (nothing, and never a maximum)."""
    p_q, p_k, keep, tail = causal_plan(fq.shape[-2], fk.shape[-2], alignment)
    fq = pad_rows(xp, fq, p_q, 0)
    fk, v, ck = fk[..., :keep, :], v[..., :keep, :], ck[..., :keep, :]
    fk, v = pad_rows(xp, fk, p_k, tail), pad_rows(xp, v, p_k, tail)
    ck = pad_rows(xp, ck, p_k, tail, fill=_very_negative(xp, ck.dtype))
    return fq, fk, ck, v, (p_q, p_k, keep)


def _causal_stabilised(xp, q, k, v, projection, kernel, alignment, scale, order, chunk_size, eps):
    """Causal, stabilised Performer: per-key offsets and past-only running maxima."""
    fq, fk, ck = stabilised_causal_features(xp, q, k, projection, kernel, scale)
    if v is None:  # the weights
        return _logscaled_quadratic(xp, fq, fk, ck, alignment)
    if order == "quadratic":
        a = _logscaled_quadratic(xp, fq, fk, ck, alignment)
        return readout(xp, a @ v, xp.sum(a, axis=-1, keepdims=True), True, eps)
    nq = fq.shape[-2]
    fq, fk, ck, v, (p_q, _, _) = logscaled_square(xp, fq, fk, ck, v, alignment)
    num, den = logscaled_chunked(xp, fq, fk, ck, v, chunk_size)
    return readout(xp, num[..., p_q:p_q + nq, :], den[..., p_q:p_q + nq, :], True, eps)


def favor_features(x, projection, /, *, kernel="positive", offset=None, xp=None):
    """FAVOR random features ``phi(x)`` with ``E[phi(x) . phi(y)] = exp(x . y)``.

    Parameters
    ----------
    x : array, shape (..., N, d)
        Already scaled: pass ``sqrt(scale) q`` to estimate ``exp(scale q . k)``.
    projection : array, shape (m, d)
        From :func:`random_features`.
    kernel : {"positive", "trigonometric"}
        ``exp(W x - |x|^2/2) / sqrt(m)``, shape ``(..., N, m)``, or
        ``exp(|x|^2/2) [sin(W x), cos(W x)] / sqrt(m)``, shape ``(..., N, 2 m)``.
    offset : array broadcastable to (..., N, 1), optional
        Subtracted from the exponent (features multiplied by ``exp(-offset)``); the
        stabiliser. A per-query or all-keys constant cancels in normalised attention.

    Returns
    -------
    array, shape (..., N, m) or (..., N, 2 m)

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import favor_features, random_features
    >>> w = random_features(3, 5, seed=1, xp=xp)
    >>> f = favor_features(xp.zeros((2, 3)), w)  # x = 0: every feature is 1/sqrt(m)
    >>> f.shape, bool(xp.all(f == 1 / 5**0.5))
    ((2, 5), True)
    """
    xp = namespace(("x", x), ("projection", projection), xp=xp)
    _check_kernel(kernel)
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., N, d) (rank >= 2), got shape {tuple(x.shape)}")
    if not is_floating(xp, x.dtype):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    _check_projection(xp, projection, x.shape[-1], x, "x")
    return features_from_exponent(xp, x, projection, feature_exponent(xp, x, projection, kernel),
                                  offset, kernel)


def floored_features(xp, x, projection, feature_eps, over_rows):
    """``(exp(W x - |x|^2/2 - c) + feature_eps) / sqrt(m)``, ``c`` the largest ``w.x`` of
    each row (``over_rows=False``: queries) or of all rows (``True``: keys), as
    google-research's FAVOR+ code and performer-pytorch stabilise (module docstring)."""
    u = x @ xp.matrix_transpose(projection)
    c = xp.max(u, axis=-1, keepdims=True)
    if over_rows and x.shape[-2] > 0:
        c = xp.max(c, axis=-2, keepdims=True)
    return (xp.exp(u - half_sq_norm(xp, x) - c) + feature_eps) / math.sqrt(projection.shape[0])


def performer_features(xp, q, k, projection, kernel, alignment, stabilize, scale, feature_eps=0.0):
    """The stabilised random features ``(phi(q), phi(k))`` of the scaled queries and keys."""
    root = math.sqrt(scale)
    xq, xk = q * root, k * root
    if feature_eps:
        return (floored_features(xp, xq, projection, feature_eps, False),
                floored_features(xp, xk, projection, feature_eps, True))
    eq = feature_exponent(xp, xq, projection, kernel)
    ek = feature_exponent(xp, xk, projection, kernel)
    oq = row_offset(xp, eq) if stabilize else None
    # No keys: nothing to stabilise (and no maximum over an empty axis).
    ok = (key_offset(xp, ek, projection, kernel, alignment is not None)
          if stabilize and k.shape[-2] > 0 else None)
    return (features_from_exponent(xp, xq, projection, eq, oq, kernel),
            features_from_exponent(xp, xk, projection, ek, ok, kernel))


def _check_feature_eps(feature_eps, kernel, alignment, stabilize):
    if isinstance(feature_eps, bool) or not isinstance(feature_eps, (int, float)) or not (
            0.0 <= feature_eps < math.inf):
        raise ValueError(f"feature_eps must be a finite float >= 0, got {feature_eps!r}")
    if not feature_eps:
        return
    if kernel != "positive":
        raise ValueError(f"feature_eps floors the positive features; kernel={kernel!r} takes none")
    if not stabilize:
        raise ValueError("feature_eps is added after the stabiliser (it is relative to it); "
                         "stabilize=False takes none")
    if alignment is not None:
        raise ValueError(
            "feature_eps is defined for non-causal attention only: the causal form of the code "
            "it follows (performer-pytorch) takes its key stabiliser over every key, future "
            "ones included, so a later key changes an earlier output")


def prepare_performer(q, k, v, projection, kernel, causal, scale, eps, xp, feature_eps=0.0,
                      stabilize=True):
    """Check the inputs of :func:`performer_attention`: ``(xp, alignment, scale, eps)``."""
    xp, _ = check_qkv(q, k, v, xp=xp)
    xp = namespace(("q", q), ("projection", projection), xp=xp)
    _check_kernel(kernel)
    _check_projection(xp, projection, q.shape[-1], q)
    alignment = causal_alignment(causal)
    _check_feature_eps(feature_eps, kernel, alignment, stabilize)
    scale = default_scale(q.shape[-1], scale)
    if scale < 0:
        raise ValueError(f"scale must be non-negative for random features, got {scale!r}")
    return xp, alignment, scale, default_eps(xp, q.dtype) if eps is None else check_eps(eps)


def default_eps(xp, dtype):
    """The default denominator floor of ``dtype``: the least positive number it holds that is
    a normal float32 number (float16's smallest subnormal ``2^-24``; float32's and
    bfloat16's smallest normal), float64's smallest normal for float64 and wider dtypes;
    on JAX the dtype's smallest normal.

    It floors only a zero denominator: every positive float16 number is at least
    ``2^-24``. float16's smallest normal, ``6.1e-5``, floored real ones: FAVOR+'s features
    are at most ``1/sqrt(m)`` after the stabiliser, and 20 % of the denominators of a
    33-token, ``d = 80`` case were below it, off by up to 3x (an output error of 1.17 on
    outputs of 2.3). JAX (XLA on CPU) flushes subnormals to zero, float16's too: a
    subnormal floor is 0 there and leaves ``0 / 0`` (NaN on 96 outputs of that case), so
    JAX keeps the smallest normal - its subnormal denominators are flushed anyway. A
    Python float: a dtype's smallest normal below float64's (np.longdouble's 3.4e-4932)
    is 0.0 as a float.
    """
    fi = xp.finfo(dtype)
    if fi.bits > 32:
        return max(float(fi.smallest_normal), sys.float_info.min)
    if array_api_compat.is_jax_namespace(xp):
        return float(fi.smallest_normal)
    return max(float(fi.smallest_normal) * float(fi.eps), FLOAT32_SMALLEST_NORMAL)


def performer_attention(q, k, v, /, *, projection, kernel="positive", causal=False, stabilize=True,
                        scale=None, order="linear", chunk_size=DEFAULT_CHUNK_SIZE, eps=None,
                        feature_eps=0.0, xp=None):
    """Performer (FAVOR+) attention: random-feature estimate of ``softmax(scale Q K^T) V``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    projection : array, shape (m, d)
        Random rows from :func:`random_features` (same dtype and device as ``q``).
    kernel : {"positive", "trigonometric"}
        Positive random features (FAVOR+, default) or sin/cos features.
    causal : {False, True, "top-left", "bottom-right"}
        As in :func:`attn_ref.linear_attention`.
    stabilize : bool
        Shift the feature exponents (module docstring); exact in real arithmetic,
        and never uses a future key when causal.
    scale : float, optional
        Softmax logit scale, default ``1/sqrt(d)``.
    order, chunk_size
        As in :func:`attn_ref.linear_attention`.
    eps : float, optional
        Denominator floor (see :mod:`attn_ref.linear`), default :func:`default_eps` of
        the dtype the denominators are computed in: float32's smallest normal for
        float16, bfloat16 and float32 inputs (the narrower ones are computed in float32),
        float64's for float64 and wider dtypes such as ``np.longdouble``: positive features give
        ``den >= 0`` and ``|num| <= den max|v|``, so only an exactly-zero or underflowed
        denominator is floored. Trigonometric denominators can be near zero or negative; outputs
        there are large (the instability positive features were introduced to fix).
    feature_eps : float
        ``0`` (default): FAVOR+ as the paper defines it. ``> 0``: the floor that
        google-research's FAVOR+ code and performer-pytorch add to every feature after
        their stabiliser, ``(exp(W x - |x|^2/2 - max w.x) + feature_eps) / sqrt(m)``
        (performer-pytorch: ``1e-4``): another function (module docstring). Positive
        kernel, ``stabilize=True`` and non-causal only.

    Returns
    -------
    array, shape (..., Nq, dv)
        Converges to softmax attention as ``m`` grows (``feature_eps=0``).

    Notes
    -----
    ``O(N m (d + dv))`` time; non-causal in the linear order ``O(B m + m dv)`` extra
    memory besides the output, the features made ``B`` rows at a time
    (:data:`attn_ref.linear.DEFAULT_BLOCK_SIZE`); causal as the chunked form of linear
    attention with ``d' = m``.
    Choromanski et al., "Rethinking Attention with Performers" (ICLR 2021).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import performer_attention, random_features, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> w = random_features(4, 4096, seed=0, xp=xp)
    >>> err = xp.max(xp.abs(performer_attention(x, x, x, projection=w) - softmax_attention(x, x, x)))
    >>> bool(err < 0.05)  # the error falls like 1/sqrt(m)
    True
    """
    given_eps = eps
    xp, alignment, scale, eps = prepare_performer(q, k, v, projection, kernel, causal, scale, eps, xp,
                                                  feature_eps, stabilize)
    check_order(order)
    check_positive_int("chunk_size", chunk_size)
    work = logit_dtype(xp, q.dtype)
    if work != q.dtype:
        # The default floor is the computing dtype's (given_eps None): float16's 2^-24
        # floors only a zero float16 denominator, but these are float32, and on large
        # logits real ones lie far below it (the oracle's large-logits d = 8 case: output
        # off by 2.67 on outputs of 2.7 with it, 1.2e-6 without).
        out = performer_attention(*(xp.astype(x, work) for x in (q, k, v)),
                                  projection=xp.astype(projection, work), kernel=kernel, causal=causal,
                                  stabilize=stabilize, scale=scale, order=order, chunk_size=chunk_size,
                                  eps=given_eps, feature_eps=feature_eps, xp=xp)
        return xp.astype(out, q.dtype)
    if alignment is None and order == "linear" and not feature_eps:
        return _blocked(xp, q, k, v, projection, kernel, stabilize, scale, eps)
    if alignment is not None and stabilize and q.shape[-2] > 0 and k.shape[-2] > 0:
        out = _causal_stabilised(xp, q, k, v, projection, kernel, alignment, scale, order, chunk_size, eps)
    else:
        fq, fk = performer_features(xp, q, k, projection, kernel, alignment, stabilize, scale, feature_eps)
        out = linear_from_features(fq, fk, v, causal=alignment or False, order=order, chunk_size=chunk_size,
                                   eps=eps, xp=xp)
    return zero_keyless_rows(xp, out, alignment, k.shape[-2])


def _blocked(xp, q, k, v, projection, kernel, stabilize, scale, eps):
    """Non-causal Performer with the features of one block of rows at a time.

    The same features as :func:`performer_features`: the query stabiliser is each row's
    own, and the key stabiliser, the maximum exponent over all keys, is found by a first
    pass over the keys' blocks (their exponents are recomputed in the second pass, one
    ``W k`` product more, rather than held: at ``m = 256`` they are four times the size
    of ``k``). No array of the features' full size is made, so none of their
    elementwise passes leaves the cache.
    """
    root = math.sqrt(scale)
    nk, block = k.shape[-2], DEFAULT_BLOCK_SIZE
    ok = None
    if stabilize and nk > 0:
        for lo in range(0, nk, block):
            e = feature_exponent(xp, k[..., lo:min(lo + block, nk), :] * root, projection, kernel)
            m = key_offset(xp, e, projection, kernel, False)
            ok = m if ok is None else xp.maximum(ok, m)

    def phi_q(x):
        x = x * root
        e = feature_exponent(xp, x, projection, kernel)
        return features_from_exponent(xp, x, projection, e, row_offset(xp, e) if stabilize else None, kernel)

    def phi_k(x):
        x = x * root
        return features_from_exponent(xp, x, projection, feature_exponent(xp, x, projection, kernel), ok,
                                      kernel)

    return linear_from_row_maps(q, k, v, phi_q, phi_k, block_size=block, eps=eps, xp=xp)


def performer_attention_weights(q, k, /, *, projection, kernel="positive", causal=False, stabilize=True,
                                scale=None, order="linear", chunk_size=DEFAULT_CHUNK_SIZE, eps=None,
                                feature_eps=0.0, xp=None):
    """The ``(..., Nq, Nk)`` attention matrix the Performer estimate implies.

    ``performer_attention(q, k, v, ...) == weights @ v``; rows sum to 1 (rows with no
    visible key are zero) and, for the positive kernel, entries are non-negative.
    Arguments as in :func:`performer_attention`; ``order`` and ``chunk_size`` are checked
    and otherwise ignored (every order implies the same matrix). ``O(Nq Nk m)`` time,
    ``O(Nq Nk)`` memory.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import performer_attention_weights, random_features
    >>> x = xp.reshape(xp.cos(xp.arange(12.0)), (3, 4))
    >>> p = performer_attention_weights(x, x, projection=random_features(4, 8, seed=0, xp=xp))
    >>> bool(xp.all(xp.abs(xp.sum(p, axis=-1) - 1.0) < 1e-12))
    True
    """
    xp, alignment, scale, eps = prepare_performer(q, k, k, projection, kernel, causal, scale, eps, xp,
                                                  feature_eps, stabilize)
    check_order(order)
    check_positive_int("chunk_size", chunk_size)
    if alignment is not None and stabilize and q.shape[-2] > 0 and k.shape[-2] > 0:
        a = _causal_stabilised(xp, q, k, None, projection, kernel, alignment, scale, order, chunk_size, eps)
        return a / safe_denominator(xp, xp.sum(a, axis=-1, keepdims=True), eps)
    fq, fk = performer_features(xp, q, k, projection, kernel, alignment, stabilize, scale, feature_eps)
    return weights_from_features(fq, fk, causal=alignment or False, eps=eps, xp=xp)


def _params(seed, nq, nk, d, dv, *, dtype, device, xp):
    return {"projection": random_features(d, default_num_features(d), kind="orthogonal", seed=seed,
                                          dtype=dtype, device=device, xp=xp)}


def _register():
    from .registry import Variant, register

    register(Variant(
        name="performer", fn=performer_attention, family="performer", exact=False, causal=True,
        vjp="attn_ref.grad.performer:performer_attention",
        time="O(N m d)", memory="O(N m + m d)", params=_params, weights=performer_attention_weights,
        options={"kernel": "positive", "chunk_size": 8},
        summary="Performer FAVOR+: positive orthogonal random features, m = d log d",
    ))


_register()
