"""Fewer keys or fewer queries: segment pooling, Nystromformer landmarks, clustered queries.

Each variant here shrinks one side of the ``N x N`` problem to ``m << N``
representatives before the softmax:

* :func:`pooled_attention` - keys and values replaced by the means of ``m`` segments.
* :func:`query_reduced_attention` - ``m`` representative queries (segment means) attend,
  their outputs are copied back to the positions of their segments.
* :func:`nystrom_attention` - Nystromformer (Xiong et al. 2021): landmarks are segment
  means of queries and keys, and the softmax matrix is approximated by the Nystrom
  formula with an iterative pseudo-inverse (:func:`iterative_pinv`).
* :func:`clustered_attention` - Vyas et al. (2020): k-means on the queries, each
  centroid attends every key and its members receive its output; ``topk`` gives the
  improved variant.

Segments
--------
``N`` positions are cut into ``m`` contiguous segments whose sizes differ by at most
one: with ``N = c m + r`` (``0 <= r < m``) the first ``r`` segments have ``c + 1``
positions and the other ``m - r`` have ``c``. When ``m`` divides ``N`` these are the
equal segments of the Nystromformer code; otherwise no padding is needed and every
position belongs to exactly one segment. :func:`segment_means` computes the means by
two reshapes (exact, ``O(N d)``), :func:`segment_expand` copies ``m`` rows back to
``N`` positions.

lucidrains' nystrom-attention cuts differently (``segments="front-padded"`` of
:func:`nystrom_attention`): it pads the sequence at the front with zero tokens to
``m l`` positions, ``l = ceil(N / m)``, and with its key mask leaves them out of the
means, so the first segment holds ``l - (m l - N)`` tokens and the others ``l``
(:func:`front_padded_means`). The two agree when ``m`` divides ``N``.
"""

from __future__ import annotations

import array_api_compat

from ._checks import (
    check_index_array,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    default_scale,
    is_floating,
    namespace,
)
from ._common import causal_alignment, causal_offset
from .random import permutation
from .softmax import attention_weights, softmax_attention

__all__ = [
    "segment_sizes",
    "segment_means",
    "segment_expand",
    "front_padded_sizes",
    "front_padded_means",
    "landmark_means",
    "SEGMENTS",
    "pooled_attention",
    "pooled_weights",
    "query_reduced_attention",
    "query_reduced_weights",
    "iterative_pinv",
    "nystrom_kernels",
    "nystrom_attention",
    "nystrom_weights",
    "kmeans",
    "kmeans_initial_rows",
    "clustered_attention",
    "clustered_weights",
    # Named steps that attn_ref.grad differentiates.
    "prepare_pooled",
    "prepare_query_reduced",
    "prepare_nystrom",
    "check_pinv_init",
    "pinv_norms",
    "PINV_INITS",
    "assign_clusters",
    "prepare_clustered",
    "check_topk_keys",
    "check_assignments",
    "gather_rows",
    "topk_parts",
]


# --------------------------------------------------------------------------- segments

def segment_sizes(n, m):
    """Sizes of the ``m`` segments of ``n`` positions: ``r`` of ``c + 1``, then ``m - r`` of ``c``."""
    c, r = divmod(n, m)
    return [c + 1] * r + [c] * (m - r)


def _split(n, m):
    c, r = divmod(n, m)
    return c, r, r * (c + 1)


def segment_means(x, m, /, *, xp=None):
    """Means of ``x (..., N, d)`` over the ``m`` segments of the module docstring.

    Returns ``(..., m, d)``. ``1 <= m <= N``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.reduced import segment_means
    >>> segment_means(xp.reshape(xp.arange(5.0), (5, 1)), 2)[:, 0]   # [0,1,2] and [3,4]
    Array([1. , 3.5], dtype=array_api_strict.float64)
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    n, d, lead = x.shape[-2], x.shape[-1], tuple(x.shape[:-2])
    c, r, cut = _split(n, m)
    parts = []
    if r:
        parts.append(xp.mean(xp.reshape(x[..., :cut, :], lead + (r, c + 1, d)), axis=-2))
    if m - r:
        parts.append(xp.mean(xp.reshape(x[..., cut:, :], lead + (m - r, c, d)), axis=-2))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-2)


def segment_expand(y, n, /, *, xp=None):
    """Copy row ``j`` of ``y (..., m, e)`` to every position of segment ``j``: ``(..., n, e)``."""
    xp = array_api_compat.array_namespace(y) if xp is None else xp
    m, e, lead = y.shape[-2], y.shape[-1], tuple(y.shape[:-2])
    c, r, cut = _split(n, m)
    parts = []
    if r:
        rows = xp.broadcast_to(y[..., :r, None, :], lead + (r, c + 1, e))
        parts.append(xp.reshape(rows, lead + (cut, e)))
    if m - r:
        rows = xp.broadcast_to(y[..., r:, None, :], lead + (m - r, c, e))
        parts.append(xp.reshape(rows, lead + (n - cut, e)))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-2)


#: The two ways of cutting the sequence into landmark segments (``segments=`` of
#: :func:`nystrom_attention`).
SEGMENTS = ("balanced", "front-padded")


def front_padded_sizes(n, m):
    """Tokens per segment of ``n`` positions zero-padded at the front to ``m ceil(n / m)``,
    padding left out: ``[l - pad] + [l] * (m - 1)``. Raises ``ValueError`` when the
    padding fills the first segment (``pad >= l``: a landmark of no token)."""
    check_positive_int("num_landmarks", m)
    size = -(-n // m)
    pad = m * size - n
    if pad >= size:
        raise ValueError(
            f"segments='front-padded' needs a token in every segment: N = {n} with m = {m} "
            f"pads {pad} positions at the front, at least a whole segment of ceil(N / m) = "
            f"{size}; pass a num_landmarks with (m - 1) ceil(N / m) < N")
    return [size - pad] + [size] * (m - 1)


def front_padded_means(x, m, /, *, xp=None):
    """Means of ``x (..., N, d)`` over the front-padded segments (module docstring).

    lucidrains' nystrom-attention (0.0.14) with a key mask: zero rows in front up to
    ``m ceil(N / m)``, sums over ``ceil(N / m)`` consecutive rows, divided by the number of
    real rows. Returns ``(..., m, d)``; ``O(N d)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.reduced import front_padded_means
    >>> front_padded_means(xp.reshape(xp.arange(5.0), (5, 1)), 2)[:, 0]   # [0,1] and [2,3,4]
    Array([0.5, 3. ], dtype=array_api_strict.float64)
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    n, d, lead = x.shape[-2], x.shape[-1], tuple(x.shape[:-2])
    sizes = front_padded_sizes(n, m)
    size, pad = sizes[-1], sizes[-1] - sizes[0]
    dev = array_api_compat.device(x)
    if pad:
        x = xp.concat([xp.zeros(lead + (pad, d), dtype=x.dtype, device=dev), x], axis=-2)
    sums = xp.sum(xp.reshape(x, lead + (m, size, d)), axis=-2)
    counts = xp.asarray([float(c) for c in sizes], dtype=x.dtype, device=dev)
    return sums / counts[:, None]


def landmark_means(x, m, segments, /, *, xp=None):
    """:func:`segment_means` (``"balanced"``) or :func:`front_padded_means`."""
    return (front_padded_means(x, m, xp=xp) if segments == "front-padded"
            else segment_means(x, m, xp=xp))


def _membership(xp, n, m, dtype, device):
    """``(n, m)`` 0/1 matrix: position ``p`` belongs to segment ``j``."""
    return segment_expand(xp.eye(m, dtype=dtype, device=device), n, xp=xp)


def _check_count(name, value, limit, what):
    check_positive_int(name, value)
    if value > limit:
        raise ValueError(f"{name} must be at most {what}, got {name}={value}")
    return value


def _refuse_causal(fn, causal, why):
    if causal is not False and causal is not None:
        raise ValueError(f"{fn} does not support causal masking: {why}; got causal={causal!r}")


# ----------------------------------------------------------------- pooled keys/values

def _pooled_mask(xp, causal, nq, nk, m, device):
    """Segment ``j`` is visible to query ``i`` only when its last position is in the past."""
    alignment = causal_alignment(causal)
    if alignment is None:
        return None
    off = causal_offset(alignment, nq, nk)
    ends, total = [], 0
    for size in segment_sizes(nk, m):
        total += size
        ends.append(total - 1)
    last = xp.asarray(ends, device=device)
    return last[None, :] <= xp.arange(nq, device=device)[:, None] + off


def prepare_pooled(q, k, v, num_segments, causal, scale, xp):
    """Check the inputs of :func:`pooled_attention`: ``(xp, causal mask or None, scale)``."""
    xp, batch = check_qkv(q, k, v, xp=xp)
    nk = k.shape[-2]
    _check_count("num_segments", num_segments, nk, f"the number of keys Nk={nk}")
    mask = _pooled_mask(xp, causal, q.shape[-2], nk, num_segments, array_api_compat.device(q))
    return xp, mask, default_scale(q.shape[-1], scale)


def pooled_attention(q, k, v, /, *, num_segments, causal=False, scale=None, xp=None):
    """Softmax attention over segment-mean-pooled keys and values.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    num_segments : int
        ``1 <= m <= Nk``; segments as in the module docstring.
    causal : {False, True, "top-left", "bottom-right"}
        A query sees a segment only when the whole segment lies in its past (the rule
        of :mod:`attn_ref.compressed`); queries before the end of the first segment
        return zeros.
    scale : float, optional

    Returns
    -------
    array, shape (..., Nq, dv)
        ``m = Nk`` is softmax attention.

    Notes
    -----
    ``O(Nk (d + dv) + Nq m (d + dv))`` time, ``O(Nq m)`` extra memory. Pooling is the
    averaging-kernel case of memory-compressed attention (Liu et al. 2018) and the
    key/value reduction of Funnel-style and PVT-style models. Good when neighbouring
    keys are redundant (smooth signals, images); bad when single tokens matter
    (copying, retrieval), since a key is only seen through its segment's mean.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.reduced import pooled_attention
    >>> x = xp.reshape(xp.sin(xp.arange(21.0)), (7, 3))
    >>> pooled_attention(x, x, x, num_segments=3).shape
    (7, 3)
    """
    xp, mask, scale = prepare_pooled(q, k, v, num_segments, causal, scale, xp)
    kp = segment_means(k, num_segments, xp=xp)
    vp = segment_means(v, num_segments, xp=xp)
    return softmax_attention(q, kp, vp, mask=mask, scale=scale, xp=xp)


def pooled_weights(q, k, /, *, num_segments, causal=False, scale=None, xp=None):
    """The implied ``(..., Nq, Nk)`` matrix: ``softmax(scale Q Kp^T)`` spread evenly
    over each segment's positions."""
    xp, mask, scale = prepare_pooled(q, k, k, num_segments, causal, scale, xp)
    p = attention_weights(q, segment_means(k, num_segments, xp=xp), mask=mask, scale=scale, xp=xp)
    s = _membership(xp, k.shape[-2], num_segments, q.dtype, array_api_compat.device(q))
    return p @ (xp.matrix_transpose(s) / xp.sum(s, axis=0)[:, None])


# ------------------------------------------------------------------- query reduction

def prepare_query_reduced(q, k, v, num_segments, causal, scale, xp, fn):
    """Check the inputs of :func:`query_reduced_attention`: ``(xp, scale)``."""
    _refuse_causal(fn, causal, "a representative query is the mean of its segment, so it "
                   "carries later queries of the segment to earlier positions")
    xp, batch = check_qkv(q, k, v, xp=xp)
    nq = q.shape[-2]
    _check_count("num_segments", num_segments, nq, f"the number of queries Nq={nq}")
    return xp, default_scale(q.shape[-1], scale)


def query_reduced_attention(q, k, v, /, *, num_segments, expand=True, causal=False, scale=None,
                            xp=None):
    """``m`` representative queries (segment means) attend; outputs mapped back to ``N``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    num_segments : int
        ``1 <= m <= Nq``; segments as in the module docstring.
    expand : bool
        True: every position receives its segment's output, shape ``(..., Nq, dv)``.
        False: the ``(..., m, dv)`` representative outputs themselves.
    causal
        Not supported (a segment mean contains later queries); raises ``ValueError``.
    scale : float, optional

    Returns
    -------
    array, shape (..., Nq, dv) or (..., m, dv)
        ``m = Nq`` is softmax attention.

    Notes
    -----
    ``O(Nq d + m Nk (d + dv) + Nq dv)`` time, ``O(m Nk)`` extra memory. Whether the
    output should keep length ``N`` is case by case: shrinking it is the point of
    Funnel-Transformer-style pooling (a shorter sequence for the next layers), while a
    layer with a residual connection needs ``expand=True``. Since the representative's
    logits are the mean of its members' logits, this is a good idea when queries
    within a segment are alike (smooth inputs, downsampled images) and a bad one when
    neighbouring queries ask different things (token-level tasks, causal decoding).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.reduced import query_reduced_attention
    >>> x = xp.reshape(xp.sin(xp.arange(21.0)), (7, 3))
    >>> query_reduced_attention(x, x, x, num_segments=2, expand=False).shape
    (2, 3)
    """
    xp, scale = prepare_query_reduced(q, k, v, num_segments, causal, scale, xp,
                                      "query_reduced_attention")
    out = softmax_attention(segment_means(q, num_segments, xp=xp), k, v, scale=scale, xp=xp)
    return segment_expand(out, q.shape[-2], xp=xp) if expand else out


def query_reduced_weights(q, k, /, *, num_segments, expand=True, causal=False, scale=None,
                          xp=None):
    """The implied matrix: each query's row is its segment representative's softmax row."""
    xp, scale = prepare_query_reduced(q, k, k, num_segments, causal, scale, xp, "query_reduced_weights")
    p = attention_weights(segment_means(q, num_segments, xp=xp), k, scale=scale, xp=xp)
    return segment_expand(p, q.shape[-2], xp=xp) if expand else p


# ---------------------------------------------------------------------- Nystromformer

#: The two starts of :func:`iterative_pinv` (``pinv_init=``).
PINV_INITS = ("matrix", "global")


def check_pinv_init(pinv_init):
    """``pinv_init`` must be one of :data:`PINV_INITS`."""
    if not isinstance(pinv_init, str):
        raise TypeError(f"pinv_init must be a str, one of {PINV_INITS}, got {pinv_init!r} "
                        f"({type(pinv_init).__name__})")
    if pinv_init not in PINV_INITS:
        raise ValueError(f"pinv_init must be one of {PINV_INITS}, got {pinv_init!r}")


def pinv_norms(xp, a, pinv_init):
    """``(colsum, rowsum, norm1, norminf)`` of :func:`iterative_pinv`'s initial scale.

    ``colsum (..., m)`` and ``rowsum (..., m)`` are the column and row sums of ``|A|``;
    ``norm1``, ``norminf`` their maxima, per matrix ``(...)`` or, with
    ``pinv_init="global"``, over the whole batch (0-D).
    """
    absa = xp.abs(a)
    colsum, rowsum = xp.sum(absa, axis=-2), xp.sum(absa, axis=-1)
    axis = -1 if pinv_init == "matrix" else None
    return colsum, rowsum, xp.max(colsum, axis=axis), xp.max(rowsum, axis=axis)


def iterative_pinv(a, /, *, iterations=6, pinv_init="matrix", xp=None):
    """Moore-Penrose pseudo-inverse of ``a (..., m, m)`` by Razavi et al.'s iteration.

    ``Z_{k+1} = Z_k (13 I - A Z_k (15 I - A Z_k (7 I - A Z_k))) / 4`` from
    ``Z_0 = A^T / (||A||_1 ||A||_inf)``, the initialisation of Razavi et al. (2014)
    that Nystromformer uses (Xiong et al. 2021, Lemma 1). Since
    ``||A||_2^2 <= ||A||_1 ||A||_inf``, the iteration converges to ``pinv(A)`` for every
    ``A``; a zero matrix gives zeros.

    Two conventions differ in where the norms are taken. After a few iterations (6 in
    Nystromformer) the iteration has not converged, so they are different functions:

    * ``pinv_init="matrix"`` (default): per matrix, over the last two axes, as Lemma 1
      states it for one matrix. HuggingFace ``transformers``' ``NystromformerSelfAttention``
      with ``init_option`` other than ``"original"`` (``1 / max_j sum_i A_ij`` per
      matrix) computes the same start for a softmax matrix, whose rows sum to 1
      (``||A||_inf = 1`` up to rounding).
    * ``pinv_init="global"``: one scale for the whole batch of matrices (all leading
      axes), ``1 / (max_b ||A_b||_1 max_b ||A_b||_inf)``. This is lucidrains'
      ``nystrom-attention`` (``moore_penrose_iter_pinv``: exactly this formula) and the
      official Nystromformer code, HuggingFace's default ``init_option="original"``
      (``1 / max`` of all column sums, equal to this for softmax matrices up to
      rounding). The batch entries are then coupled: a matrix much smaller than the
      largest of its batch starts too close to zero and stays far from its inverse
      after a few iterations.

    For a singular ``A``, stop near convergence: once ``A Z`` is a projection, the
    step multiplies any component of ``Z`` on the null space of ``A^T`` by ``13/4``,
    so rounding errors there grow with further iterations. The kernel that
    Nystromformer inverts (a softmax matrix of landmarks) is non-singular in practice.

    Parameters
    ----------
    a : array, shape (..., m, m)
    iterations : int
        Number of iterations (6 in Nystromformer).
    pinv_init : {"matrix", "global"}
        Where the norms of ``Z_0``'s scale are taken: per matrix or over the batch.

    Returns
    -------
    array, shape (..., m, m)

    Notes
    -----
    ``O(iterations m^3)`` time. Razavi et al., *A new iterative method for finding
    approximate inverses of complex matrices*, 2014; Xiong et al. 2021, Lemma 1.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.reduced import iterative_pinv
    >>> a = xp.asarray([[2.0, 1.0], [1.0, 3.0]])
    >>> bool(xp.max(xp.abs(iterative_pinv(a, iterations=20) @ a - xp.eye(2))) < 1e-14)
    True
    >>> b = xp.stack([a, a / 1000])  # one scale for both: the small one lags behind
    >>> z = iterative_pinv(b, iterations=6, pinv_init="global")
    >>> bool(xp.max(xp.abs(z[1, ...] @ b[1, ...] - xp.eye(2))) > 0.5)
    True
    """
    xp = namespace(("a", a), xp=xp)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must have shape (..., m, m) (square), got shape {tuple(a.shape)}")
    if not is_floating(xp, a.dtype):
        raise TypeError(f"a must have a real floating dtype, got {a.dtype}")
    check_nonnegative_int("iterations", iterations)
    check_pinv_init(pinv_init)
    m = a.shape[-1]
    _, _, norm1, norminf = pinv_norms(xp, a, pinv_init)
    denom = norm1 * norminf
    denom = xp.where(denom > 0, denom, xp.ones_like(denom))
    z = xp.matrix_transpose(a) / denom[..., None, None]
    eye = xp.eye(m, dtype=a.dtype, device=array_api_compat.device(a))
    for _ in range(iterations):
        az = a @ z
        z = (z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))) * 0.25
    return z


def prepare_nystrom(q, k, v, num_landmarks, pinv_iterations, causal, scale, xp, fn,
                    pinv_init="matrix", segments="balanced"):
    """Check the inputs of :func:`nystrom_attention`: ``(xp, scale)``."""
    _refuse_causal(fn, causal, "every landmark is a mean over the whole sequence")
    xp, batch = check_qkv(q, k, v, xp=xp)
    nq, nk = q.shape[-2], k.shape[-2]
    _check_count("num_landmarks", num_landmarks, min(nq, nk),
                 f"the sequence lengths min(Nq, Nk) = min({nq}, {nk})")
    if pinv_iterations is not None:
        check_positive_int("pinv_iterations", pinv_iterations)
    check_pinv_init(pinv_init)
    if segments not in SEGMENTS:
        raise ValueError(f"segments must be one of {', '.join(map(repr, SEGMENTS))}, got {segments!r}")
    if segments == "front-padded":
        for n in dict.fromkeys((nq, nk)):
            front_padded_sizes(n, num_landmarks)
    return xp, default_scale(q.shape[-1], scale)


def nystrom_kernels(xp, q, k, m, pinv_iterations, scale, pinv_init="matrix", segments="balanced"):
    """Nystromformer's three kernels and the pseudo-inverse: ``(K1, K2, Z, K3)``.

    ``K1 = softmax(scale Q Kl^T) (..., Nq, m)``, ``K2 = softmax(scale Ql Kl^T) (..., m, m)``,
    ``Z = pinv(K2)`` (iterative from ``pinv_init``'s start unless ``pinv_iterations`` is
    None) and
    ``K3 = softmax(scale Ql K^T) (..., m, Nk)``, with ``Ql``, ``Kl`` the segment means of
    ``q``, ``k`` (:func:`landmark_means`). ``O((Nq + Nk) m d + m^3 pinv_iterations)`` time.
    """
    # The scale multiplies the products, not q (scale * q may overflow where the logits
    # do not); the landmarks are means, so those of the unscaled queries are the same.
    ql = landmark_means(q, m, segments, xp=xp)
    kl = landmark_means(k, m, segments, xp=xp)
    k1 = attention_weights(q, kl, scale=scale, xp=xp)
    k2 = attention_weights(ql, kl, scale=scale, xp=xp)
    k3 = attention_weights(ql, k, scale=scale, xp=xp)
    if pinv_iterations is None:
        z = xp.linalg.pinv(k2)
    else:
        z = iterative_pinv(k2, iterations=pinv_iterations, pinv_init=pinv_init, xp=xp)
    return k1, k2, z, k3


def nystrom_attention(q, k, v, /, *, num_landmarks, pinv_iterations=6, pinv_init="matrix",
                      segments="balanced", causal=False, scale=None, xp=None):
    """Nystromformer attention: ``softmax(Q Kl^T) pinv(softmax(Ql Kl^T)) softmax(Ql K^T) V``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    num_landmarks : int
        ``1 <= m <= min(Nq, Nk)``. Landmarks ``Ql``, ``Kl`` are the means of the
        ``m`` segments of the module docstring (any ``N``, no padding).
    pinv_iterations : int or None
        Iterations of :func:`iterative_pinv` (6 in the paper); ``None`` uses the exact
        ``xp.linalg.pinv`` (needs the ``linalg`` extension).
    pinv_init : {"matrix", "global"}
        The iteration's start ``Z_0 = A^T / (||A||_1 ||A||_inf)`` with the norms per
        landmark matrix (default, Razavi et al.'s start as Lemma 1 states it) or their
        maxima over all batch entries and heads (``"global"``: HuggingFace's
        ``init_option="original"``, lucidrains' ``nystrom-attention``); see
        :func:`iterative_pinv`. Unused with ``pinv_iterations=None``.
    segments : {"balanced", "front-padded"}
        How the sequence is cut into the ``m`` segments: ``m`` segments whose sizes differ
        by at most one (default), or lucidrains' nystrom-attention's, the sequence
        zero-padded at the front to ``m ceil(N / m)`` and the padding left out of the
        means (module docstring; needs ``(m - 1) ceil(N / m) < N``). The same when ``m``
        divides ``N``.
    causal
        Not supported (landmarks average the whole sequence); raises ``ValueError``.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)`` (the paper scales ``Q`` and ``K`` by
        ``d^{-1/4}`` each, the same thing).

    Returns
    -------
    array, shape (..., Nq, dv)
        With ``m = Nq = Nk`` and the exact inverse this is softmax attention:
        ``P pinv(P) P = P``.

    Notes
    -----
    ``O(N m (d + dv) + m^3)`` time, ``O(N m + m^2)`` extra memory: the products are taken
    right to left so no ``N x N`` matrix is formed. Xiong et al., *Nystromformer: A
    Nystrom-Based Algorithm for Approximating Self-Attention*, AAAI 2021. The paper's
    depthwise convolution skip on ``V`` is a separate layer, not part of attention.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import nystrom_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (8, 3))
    >>> a = nystrom_attention(x, x, x, num_landmarks=8, pinv_iterations=None)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x))) < 1e-12)
    True
    """
    xp, scale = prepare_nystrom(q, k, v, num_landmarks, pinv_iterations, causal, scale, xp,
                                "nystrom_attention", pinv_init, segments)
    k1, _, z, k3 = nystrom_kernels(xp, q, k, num_landmarks, pinv_iterations, scale, pinv_init, segments)
    return k1 @ (z @ (k3 @ v))


def nystrom_weights(q, k, /, *, num_landmarks, pinv_iterations=6, pinv_init="matrix",
                    segments="balanced", causal=False, scale=None, xp=None):
    """The implied ``(..., Nq, Nk)`` matrix ``softmax(Q Kl^T) pinv(...) softmax(Ql K^T)``.

    Rows sum to one only approximately, and entries may be negative. The options are
    those of :func:`nystrom_attention`.
    """
    xp, scale = prepare_nystrom(q, k, k, num_landmarks, pinv_iterations, causal, scale, xp,
                                "nystrom_weights", pinv_init, segments)
    k1, _, z, k3 = nystrom_kernels(xp, q, k, num_landmarks, pinv_iterations, scale, pinv_init, segments)
    return (k1 @ z) @ k3


# ----------------------------------------------------------------- clustered attention

def assign_clusters(xp, x, centroids, forced=None):
    """Nearest centroid of every row of ``x``: indices ``(..., N)`` and one-hot ``(..., N, C)``.

    ``|x|^2`` is the same for every centroid and is left out; ties go to the lowest
    centroid index (``argmin`` returns the first minimum). ``forced (..., N)``, optional:
    where it is ``>= 0``, that cluster instead of the nearest (a row of
    :func:`kmeans`'s ``assignments``).
    """
    d2 = xp.sum(centroids * centroids, axis=-1)[..., None, :] - 2 * (
        x @ xp.matrix_transpose(centroids))
    idx = xp.argmin(d2, axis=-1)
    if forced is not None:
        idx = xp.where(forced >= 0, xp.astype(forced, idx.dtype), idx)
    c = centroids.shape[-2]
    onehot = xp.astype(idx[..., None] == xp.arange(c, device=array_api_compat.device(x)), x.dtype)
    return idx, onehot


def kmeans_initial_rows(n, num_clusters, seed=0):
    """The rows of ``x (..., N, d)`` that :func:`kmeans` takes as its initial centroids:
    ``permutation(N, seed)[:C]``, the same rows in every batch entry and head.

    A host-side list of ``C`` distinct ints in ``[0, N)`` (no array library), so that an
    external kernel (or the oracle's exported vectors) can start its k-means from the
    same rows. Cost: O(N) on the host.
    """
    _check_count("num_clusters", num_clusters, n, f"the number of queries Nq={n}")
    return [int(i) for i in permutation(n, seed=seed)[:num_clusters]]


def check_assignments(assignments, iterations, n, fn):
    """Refuse an ``assignments`` of :func:`kmeans` that is not ``(..., iterations + 1, N)``
    integers. Its values (``-1`` or a cluster in ``[0, C)``) are the caller's to keep:
    checking them would read the array on the host."""
    if assignments is not None:
        check_index_array(fn, "assignments", assignments, (iterations + 1, n),
                          "iterations + 1, N", f", one row per Lloyd assignment of the N={n} rows")


def kmeans(x, num_clusters, /, *, iterations=10, seed=0, assignments=None, xp=None):
    """Lloyd's k-means on the rows of ``x (..., N, d)``, deterministic from ``seed``.

    The initial centroids are the rows ``permutation(N, seed)[:C]``
    (:func:`kmeans_initial_rows`, the same rows in every batch entry); then
    ``iterations`` rounds of assign-to-nearest and centroid-as-mean-of-members. A
    centroid that loses all its members keeps its position. Everything is one-hot
    matrices and matmuls: no data-dependent control flow, so it runs under ``jax.jit``.

    ``assignments (..., iterations + 1, N)`` int, optional: row ``t`` overrides the
    ``t``-th assignment (the last row: the final one) wherever it is ``>= 0``; ``-1``
    keeps the nearest centroid. Where a row is nearly as near to two centroids as a
    dtype resolves, a correct kernel may assign it to either and continue from there:
    ``conformance`` fixes such a choice with it (:mod:`conformance.ties`).

    Returns
    -------
    centroids : array, shape (..., C, d)
    assignment : int array, shape (..., N)
    onehot : array, shape (..., N, C)
        ``onehot[..., i, c] = 1`` when row ``i`` belongs to cluster ``c``.
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    n = x.shape[-2]
    first_rows = kmeans_initial_rows(n, num_clusters, seed)
    check_nonnegative_int("iterations", iterations)
    check_assignments(assignments, iterations, n, "kmeans")
    device = array_api_compat.device(x)
    first = xp.asarray(first_rows, device=device)
    centroids = xp.take(x, first, axis=x.ndim - 2)

    def forced(t):
        return None if assignments is None else assignments[..., t, :]

    for t in range(iterations):
        _, onehot = assign_clusters(xp, x, centroids, forced(t))
        counts = xp.sum(onehot, axis=-2)[..., None]
        sums = xp.matrix_transpose(onehot) @ x
        means = sums / xp.where(counts > 0, counts, xp.ones_like(counts))
        centroids = xp.where(counts > 0, means, centroids)
    idx, onehot = assign_clusters(xp, x, centroids, forced(iterations))
    return centroids, idx, onehot


def prepare_clustered(q, k, v, num_clusters, iterations, topk, seed, causal, scale, xp, fn):
    """Check the inputs of :func:`clustered_attention`: ``(xp, batch, scale)``."""
    _refuse_causal(fn, causal, "a centroid averages queries from the whole sequence")
    xp, batch = check_qkv(q, k, v, xp=xp)
    nq, nk = q.shape[-2], k.shape[-2]
    _check_count("num_clusters", num_clusters, nq, f"the number of queries Nq={nq}")
    check_nonnegative_int("iterations", iterations)
    if topk is not None:
        _check_count("topk", topk, nk, f"the number of keys Nk={nk}")
    return xp, batch, default_scale(q.shape[-1], scale)


def check_topk_keys(topk_keys, topk, num_clusters, nk, fn):
    """Refuse a ``topk_keys`` of :func:`clustered_attention` that is not ``(..., C, topk)``
    integers, or one given without ``topk``. Its values (distinct keys in ``[0, Nk)``)
    are the caller's to keep: checking them would read the array on the host."""
    if topk_keys is None:
        return
    if topk is None:
        raise ValueError(f"{fn}: topk_keys fixes the top-k selection, but topk is None")
    check_index_array(fn, "topk_keys", topk_keys, (num_clusters, topk), "C, topk",
                      f" indexing the Nk={nk} keys")


def gather_rows(xp, x, idx, batch):
    """``x (..., Nk, e)`` rows at ``idx (batch..., R, t)``: ``(batch..., R, t, e)``."""
    e = x.shape[-1]
    r, t = idx.shape[-2], idx.shape[-1]
    x = xp.broadcast_to(x, batch + tuple(x.shape[-2:]))
    flat = xp.broadcast_to(xp.reshape(idx, batch + (r * t, 1)), batch + (r * t, e))
    return xp.reshape(xp.take_along_axis(x, flat, axis=-2), batch + (r, t, e))


def topk_parts(xp, q, k, centroids, idx, onehot, topk, scale, batch, order=None):
    """Pieces of improved clustered attention for every query.

    Returns ``(p_top, keys_idx, mass, pc, order)``: each query's exact softmax over its
    cluster's top-k keys ``(..., N, topk)``, those key indices, the centroid's
    probability mass on them ``(..., N, 1)``, the centroids' rows ``(..., C, Nk)`` and
    each centroid's top-k key indices ``(..., C, topk)``: the ``topk`` largest of its
    row (ties to the lower key index), or ``order`` when given (see
    :func:`clustered_attention`'s ``topk_keys``).
    """
    pc = attention_weights(centroids, k, scale=scale, xp=xp)
    pc = xp.broadcast_to(pc, batch + tuple(pc.shape[-2:]))
    if order is None:
        order = xp.argsort(pc, axis=-1, descending=True, stable=True)[..., :topk]
    else:
        order = xp.broadcast_to(order, batch + (centroids.shape[-2], topk))
    mass_c = xp.sum(xp.take_along_axis(pc, order, axis=-1), axis=-1, keepdims=True)
    nq = q.shape[-2]
    idx = xp.broadcast_to(idx, batch + (nq,))
    keys_idx = xp.take_along_axis(order, xp.broadcast_to(idx[..., None], batch + (nq, topk)),
                                  axis=-2)
    k_top = gather_rows(xp, k, keys_idx, batch)  # (..., N, topk, d)
    p_top = attention_weights(q[..., None, :], k_top, scale=scale, xp=xp)[..., 0, :]
    return p_top, keys_idx, onehot @ mass_c, pc, order


def clustered_attention(q, k, v, /, *, num_clusters, iterations=10, topk=None, seed=0, causal=False,
                        scale=None, topk_keys=None, assignments=None, xp=None):
    """Clustered attention (Vyas et al. 2020): queries grouped by k-means share attention.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    num_clusters : int
        ``1 <= C <= Nq``.
    iterations : int
        Lloyd iterations of :func:`kmeans` on the queries (fixed, not until convergence).
    topk : int, optional
        Improved clustered attention: each query takes exact softmax over its
        cluster's ``topk`` highest-scoring keys, scaled by the centroid's probability
        mass on them, and the centroid's probabilities for all other keys.
        ``1 <= topk <= Nk``.
    seed : int
        Chooses the initial centroids; same seed, same clustering, on every backend.
    causal
        Not supported (a centroid averages queries from the whole sequence).
    scale : float, optional
    topk_keys : int array, shape (..., C, topk), optional
        Each centroid's selected keys (distinct indices in ``[0, Nk)``), instead of the
        ``topk`` largest of its softmax row. The selection is a discrete choice: where
        a centroid's ``topk``-th and next logits are closer than a dtype's rounding, a
        correct kernel may select either key, and ``conformance`` judges it against the
        function of each admissible selection (:mod:`conformance.ties`). None (default)
        selects by the row.
    assignments : int array, shape (..., iterations + 1, Nq), optional
        Each query's cluster at every Lloyd assignment where it is ``>= 0``, instead of
        its nearest centroid (:func:`kmeans`): a query about as near two centroids as a
        dtype resolves is a discrete choice too, judged the same way. None (default):
        every assignment to the nearest.

    Returns
    -------
    array, shape (..., Nq, dv)
        ``C = Nq`` is softmax attention (every query is its own centroid; duplicate
        queries share one, which changes nothing). ``topk = Nk`` is softmax attention
        for every ``C``.

    Notes
    -----
    ``O(iterations Nq C d + C Nk (d + dv) + Nq dv)`` time and ``O(Nq C + C Nk)`` memory;
    ``topk`` adds ``O(C Nk log Nk)`` for the sort and ``O(Nq topk (d + dv))``. The paper
    clusters Hamming codes of hashed queries; plain Euclidean k-means on the queries
    is used here. Vyas, Katharopoulos and Fleuret, *Fast Transformers with Clustered
    Attention*, NeurIPS 2020.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import clustered_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (8, 3))
    >>> a = clustered_attention(x, x, x, num_clusters=8)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x))) < 1e-14)
    True
    """
    xp, batch, scale = prepare_clustered(q, k, v, num_clusters, iterations, topk, seed, causal,
                                         scale, xp, "clustered_attention")
    check_topk_keys(topk_keys, topk, num_clusters, k.shape[-2], "clustered_attention")
    check_assignments(assignments, iterations, q.shape[-2], "clustered_attention")
    centroids, idx, onehot = kmeans(q, num_clusters, iterations=iterations, seed=seed,
                                    assignments=assignments, xp=xp)
    if topk is None:
        return onehot @ softmax_attention(centroids, k, v, scale=scale, xp=xp)
    p_top, keys_idx, mass, pc, order = topk_parts(xp, q, k, centroids, idx, onehot, topk, scale,
                                                  batch, topk_keys)
    v_top = gather_rows(xp, v, keys_idx, batch)  # (..., N, topk, dv)
    top_out = (p_top[..., None, :] @ v_top)[..., 0, :]
    # The centroid's output on the keys outside its top-k: everything minus the top-k part.
    pc_top = xp.take_along_axis(pc, order, axis=-1)
    vc_top = gather_rows(xp, v, order, batch)  # (..., C, topk, dv)
    rest_c = pc @ v - (pc_top[..., None, :] @ vc_top)[..., 0, :]
    return mass * top_out + onehot @ rest_c


def clustered_weights(q, k, /, *, num_clusters, iterations=10, topk=None, seed=0, causal=False,
                      scale=None, xp=None):
    """The implied ``(..., Nq, Nk)`` matrix of :func:`clustered_attention`.

    Without ``topk``, each query's row is its centroid's softmax row. With ``topk``,
    the row's top-k entries are replaced by ``mass * p_top``; this builds an
    ``(..., Nq, topk, Nk)`` selection, so it is for diagnostics at moderate sizes.
    """
    xp, batch, scale = prepare_clustered(q, k, k, num_clusters, iterations, topk, seed, causal,
                                         scale, xp, "clustered_weights")
    centroids, idx, onehot = kmeans(q, num_clusters, iterations=iterations, seed=seed, xp=xp)
    if topk is None:
        return onehot @ attention_weights(centroids, k, scale=scale, xp=xp)
    p_top, keys_idx, mass, pc, _ = topk_parts(xp, q, k, centroids, idx, onehot, topk, scale,
                                              batch)
    base = onehot @ pc
    nk = k.shape[-2]
    sel = keys_idx[..., None] == xp.arange(nk, device=array_api_compat.device(q))
    zero = xp.zeros_like(base[..., None, :])
    top = xp.sum(xp.where(sel, (mass * p_top)[..., None], zero), axis=-2)
    return xp.where(xp.any(sel, axis=-2), top, base)


# ----------------------------------------------------------------------- registration

def _register():
    from .registry import Variant, register

    def segments(seed, nq, nk, d, dv, **_):
        return {"num_segments": max(1, min(nk, 4))}

    def query_segments(seed, nq, nk, d, dv, **_):
        return {"num_segments": max(1, min(nq, 4))}

    def landmarks(seed, nq, nk, d, dv, **_):
        return {"num_landmarks": max(1, min(nq, nk, 4))}

    def clusters(seed, nq, nk, d, dv, **_):
        return {"num_clusters": max(1, min(nq, 4)), "seed": seed}

    def clusters_topk(seed, nq, nk, d, dv, **_):
        return {"num_clusters": max(1, min(nq, 4)), "seed": seed, "topk": max(1, min(nk, 4))}

    register(Variant(
        name="pooled", fn=pooled_attention, family="reduced", exact=False, causal=True,
        vjp="attn_ref.grad.reduced:pooled_attention",
        time="O(N m d)", memory="O(N m)", params=segments, weights=pooled_weights,
        summary="softmax over m = 4 segment-mean-pooled keys/values",
    ))
    register(Variant(
        name="query_reduced", fn=query_reduced_attention, family="reduced", exact=False,
        vjp="attn_ref.grad.reduced:query_reduced_attention",
        causal=False, time="O(N m d)", memory="O(N m)", params=query_segments,
        weights=query_reduced_weights, self_attention=False,
        summary="m = 4 segment-mean queries attend; outputs copied back to their segments",
    ))
    register(Variant(
        name="nystrom", fn=nystrom_attention, family="reduced", exact=False, causal=False,
        vjp="attn_ref.grad.reduced:nystrom_attention",
        time="O(N m d + m^3)", memory="O(N m)", params=landmarks, weights=nystrom_weights,
        summary="Nystromformer, m = 4 segment-mean landmarks, 6-step iterative pinv",
    ))
    register(Variant(
        name="clustered", fn=clustered_attention, family="reduced", exact=False, causal=False,
        vjp="attn_ref.grad.reduced:clustered_attention",
        time="O(N C d)", memory="O(N C)", params=clusters, weights=clustered_weights,
        summary="clustered attention, C = 4 k-means query clusters (10 Lloyd steps)",
    ))
    register(Variant(
        name="clustered_topk", fn=clustered_attention, family="reduced", exact=False,
        vjp="attn_ref.grad.reduced:clustered_attention",
        causal=False, time="O(N C d + N k d)", memory="O(N C + N k)", params=clusters_topk,
        weights=clustered_weights,
        summary="improved clustered attention, exact softmax on each cluster's top-4 keys",
    ))


_register()
