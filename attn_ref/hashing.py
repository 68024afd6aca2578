"""Reformer LSH attention: angular hashing, sorted chunks, several rounds.

Kitaev, Kaiser and Levskaya, *Reformer: The Efficient Transformer* (ICLR 2020). Large
softmax weights come from keys close in angle to the query, and a random rotation
``R`` puts close vectors into the same bucket with high probability:
``h(x) = argmax([x R; -x R])`` gives ``n_buckets`` buckets from ``n_buckets / 2``
random directions. Each of ``n_hashes`` rounds draws its own ``R``, sorts the positions
by ``(bucket, position)``, cuts the sorted sequence into chunks of ``chunk_size`` and
lets every chunk attend to itself and to the chunk before it (the first chunk's
"chunk before" is the last one of the same round: the look-back wraps around, as in
trax and reformer-pytorch). The rounds' outputs are combined with the weights of their
log-sum-exps, and a pair found in several rounds (or twice in one round's window) is
counted once: its logit is lowered by ``log`` of the number of times it was found.
``docs/hashing.md`` derives why this is one softmax.

Conventions of this reference
-----------------------------
* **Keys are given, and they carry the hash.** The registry calls ``fn(q, k, v)``;
  the bucket of position ``j`` in round ``r`` is ``h_r(k_j)``. The paper's shared-QK
  attention ties keys to queries, ``k_j = q_j / |q_j|``; pass ``k=shared_keys(q)``
  (:func:`shared_keys`) for it: the angular hash is scale-invariant, so
  ``h(k_j) = h(q_j)`` and queries and keys land in the same buckets, which is what
  makes one sort serve both.
* **Self-attention only** (``Nq == Nk``): query ``i`` and key ``i`` are one token.
* **A token does not attend to itself unless it has no other key**: the logit of the
  pair ``(i, i)`` is *replaced* by ``self_logit`` (default ``-5e4``, reformer-pytorch's
  ``TOKEN_SELF_ATTN_VALUE``; trax uses ``-1e5``); ``exp(-5e4 - m)`` is 0 in every
  floating dtype, so the token is excluded whenever another key is visible and is
  its own only key otherwise. ``self_logit=None`` keeps the ordinary logit.
* **The function.** With the duplicate correction the rounds combine into a single
  softmax over the union ``U_i`` of the keys query ``i`` meets in any round
  (:func:`lsh_attention_mask`), with the self logit replaced:
  ``out_i = sum_{j in U_i} exp(s_ij) v_j / sum_{j in U_i} exp(s_ij)``. That dense
  masked softmax is the defining form (:func:`reformer_weights`); the sort-chunk-attend
  form (:func:`reformer_attention`) is tested to agree.

Two conventions of widely used code are options (``docs/hashing.md``):

* ``look_back="sequence"``: the rounds are sorted as one sequence of ``H`` rounds and
  the look-back runs over it, so the first chunk of round ``r`` looks back at the last
  chunk of round ``r - 1`` (round 0's at the last round's). trax, HuggingFace
  ``transformers``' ``LSHSelfAttention`` and reformer-pytorch do this; the default
  ``"round"`` wraps within the round.
* ``dedup=False``: a pair found ``c`` times (in several rounds, or twice in one window)
  enters the softmax ``c`` times, its logit raised by ``log c`` instead of counted
  once: the rounds combined by their log-sum-exps without the duplicate correction.
  HuggingFace's ``LSHSelfAttention`` and reformer-pytorch's default
  (``allow_duplicate_attention=True``) do this.
"""

from __future__ import annotations

import math

import array_api_compat

from ._checks import (
    check_array,
    check_index_array,
    check_positive_int,
    check_qkv,
    check_real,
    default_scale,
    namespace,
)
from ._common import causal_alignment, ceil_div, finite_max, scaled_logits
from .random import standard_normal

__all__ = [
    "DEFAULT_SELF_LOGIT",
    "lsh_rotations",
    "shared_keys",
    "lsh_buckets",
    "lsh_chunks",
    "lsh_attention_mask",
    "lsh_pair_counts",
    "reformer_rounds",
    "combine_rounds",
    "reformer_attention",
    "reformer_weights",
    # Named steps that attn_ref.grad differentiates.
    "prepare_reformer",
]

#: reformer-pytorch's TOKEN_SELF_ATTN_VALUE: the logit that replaces ``q_i . k_i``.
DEFAULT_SELF_LOGIT = -5e4


def lsh_rotations(d, n_hashes, n_buckets, /, *, seed, dtype=None, device=None, xp):
    """The ``(d, n_hashes, n_buckets / 2)`` random rotations of angular LSH, from ``seed``.

    i.i.d. standard normal entries (the paper's random rotation; a Gaussian matrix is
    what trax and reformer-pytorch draw, laid out as reformer-pytorch's
    ``random_rotations`` with one rotation per round).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.hashing import lsh_rotations
    >>> lsh_rotations(4, 2, 8, seed=0, xp=xp).shape
    (4, 2, 4)
    """
    check_positive_int("d", d)
    check_positive_int("n_hashes", n_hashes)
    check_positive_int("n_buckets", n_buckets)
    if n_buckets % 2:
        raise ValueError(f"n_buckets must be even (h(x) = argmax([xR; -xR]) makes pairs), got {n_buckets}")
    return standard_normal((d, n_hashes, n_buckets // 2), seed=seed, dtype=dtype, device=device, xp=xp)


def shared_keys(q, /, *, xp=None):
    """The paper's shared-QK keys ``k_j = q_j / |q_j|`` (a zero row stays zero).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.hashing import shared_keys
    >>> shared_keys(xp.asarray([[3.0, 4.0]]))
    Array([[0.6, 0.8]], dtype=array_api_strict.float64)
    """
    xp = namespace(("q", q), xp=xp)
    norm = xp.sqrt(xp.sum(q * q, axis=-1, keepdims=True))
    return q / xp.where(norm > 0, norm, xp.ones_like(norm))


def _check_rotations(rotations, d, like):
    check_array("rotations", rotations, like=like, like_name="k", dtype=like.dtype)
    if rotations.ndim != 3 or rotations.shape[0] != d or rotations.shape[1] < 1 or rotations.shape[2] < 1:
        raise ValueError(
            f"rotations must have shape (d, n_hashes, n_buckets / 2) = ({d}, H, B) with H, B >= 1 "
            f"to match the head dimension d={d} of k, got shape {tuple(rotations.shape)}")
    return rotations


def lsh_buckets(x, rotations, /, *, xp=None):
    """Angular LSH buckets ``h_r(x_j) = argmax([x_j R_r; -x_j R_r])`` of every round.

    Parameters
    ----------
    x : array, shape (..., N, d)
    rotations : array, shape (d, n_hashes, n_buckets / 2)

    Returns
    -------
    int array, shape (..., n_hashes, N)
        Values in ``[0, n_buckets)``; a tie goes to the lowest bucket. ``O(N d H B)`` time.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.hashing import lsh_buckets
    >>> r = xp.asarray([[[1.0]], [[0.0]]])          # d = 2, one round, two buckets
    >>> lsh_buckets(xp.asarray([[2.0, 1.0], [-1.0, 3.0]]), r)
    Array([[0, 1]], dtype=array_api_strict.int64)
    """
    xp = namespace(("x", x), ("rotations", rotations), xp=xp)
    _check_rotations(rotations, x.shape[-1], x)
    d, h, b = rotations.shape
    u = x @ xp.reshape(rotations, (d, h * b))
    u = xp.reshape(u, tuple(u.shape[:-1]) + (h, b))
    return xp.matrix_transpose(xp.argmax(xp.concat([u, -u], axis=-1), axis=-1))


def _given_buckets(k, rotations, buckets, xp):
    """:func:`lsh_buckets` of ``k``, with the buckets ``buckets (..., n_hashes, N)`` gives
    where they are ``>= 0`` (None: every bucket hashed)."""
    hashed = lsh_buckets(k, rotations, xp=xp)
    if buckets is None:
        return hashed
    return xp.where(buckets >= 0, xp.astype(buckets, hashed.dtype), hashed)


def lsh_chunks(buckets, chunk_size, /, *, xp=None):
    """Sort each round by ``(bucket, position)`` and cut it into chunks of ``chunk_size``.

    Parameters
    ----------
    buckets : int array, shape (..., H, N)
    chunk_size : int

    Returns
    -------
    order : int array, shape (..., H, N)
        ``order[..., r, t]`` is the position at sorted place ``t`` of round ``r``.
    chunk : int array, shape (..., H, N)
        ``chunk[..., r, j]`` is the chunk of position ``j`` in round ``r``
        (``rank // chunk_size``); ``ceil(N / chunk_size)`` chunks, the last one short
        when ``chunk_size`` does not divide ``N``.
    """
    xp = array_api_compat.array_namespace(buckets) if xp is None else xp
    n = buckets.shape[-1]
    pos = xp.arange(n, dtype=buckets.dtype, device=array_api_compat.device(buckets))
    # one integer key per position: distinct, so any sort gives (bucket, position) order
    order = xp.argsort(buckets * n + pos, axis=-1)
    rank = xp.argsort(order, axis=-1)
    return order, rank // chunk_size


def lsh_pair_counts(chunk, chunk_size, /, *, look_back="round", xp=None):
    """How many times query ``i`` meets key ``j``: ``(..., N, N)`` integers.

    The sum over rounds of ``[j in i's chunk] + [j in the chunk before it]``; with
    ``look_back="round"`` the chunk before chunk 0 is the round's last chunk, with
    ``"sequence"`` it is the last chunk of the round before (the rounds sorted as one
    sequence, the last round before round 0). ``chunk`` is the second output of
    :func:`lsh_chunks`. ``O(H N^2)`` time.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.hashing import lsh_pair_counts
    >>> chunk = xp.asarray([[0, 0, 1, 1, 2, 2], [2, 0, 1, 0, 1, 2]])  # 2 rounds, 3 chunks of 2
    >>> lsh_pair_counts(chunk, 2)[0, :]  # round 0: {0, 1} + {4, 5}; round 1: {0, 5} + {2, 4}
    Array([2, 1, 1, 0, 2, 2], dtype=array_api_strict.int64)
    >>> lsh_pair_counts(chunk, 2, look_back="sequence")[0, :]  # round 0 looks back at {0, 5}
    Array([3, 1, 1, 0, 1, 2], dtype=array_api_strict.int64)
    """
    xp = array_api_compat.array_namespace(chunk) if xp is None else xp
    _check_look_back(look_back)
    n = chunk.shape[-1]
    n_chunks = max(ceil_div(n, chunk_size), 1)
    ci, cj = chunk[..., :, :, None], chunk[..., :, None, :]
    back = cj == (ci - 1) % n_chunks
    if look_back == "sequence":
        # chunk 0 of round r looks back at the last chunk of round r - 1
        cj_before = xp.roll(chunk, 1, axis=-2)[..., :, None, :]
        back = xp.where(ci > 0, back, cj_before == n_chunks - 1)
    found = xp.astype(cj == ci, xp.int64) + xp.astype(back, xp.int64)
    return xp.sum(found, axis=-3)


def _check_look_back(look_back):
    if look_back not in ("round", "sequence"):
        raise ValueError(f"look_back must be 'round' or 'sequence', got {look_back!r}")


def lsh_attention_mask(chunk, chunk_size, /, *, causal=False, look_back="round", xp=None):
    """The ``(..., N, N)`` union mask: key ``j`` is in query ``i``'s chunk or the one
    before it (cyclically) in at least one round, and ``j <= i`` when causal.

    ``chunk`` is the second output of :func:`lsh_chunks`; ``look_back`` as in
    :func:`lsh_pair_counts`. ``O(H N^2)`` time.
    """
    xp = array_api_compat.array_namespace(chunk) if xp is None else xp
    return _union_mask(xp, lsh_pair_counts(chunk, chunk_size, look_back=look_back, xp=xp), causal)


def _union_mask(xp, count, causal):
    """The pairs met at least once (``count (..., N, N)`` of :func:`lsh_pair_counts`),
    with ``j <= i`` when causal (the square problem: both alignments agree)."""
    found = count > 0
    if causal_alignment(causal) is not None:
        n, dev = count.shape[-1], array_api_compat.device(count)
        found = found & (xp.arange(n, device=dev)[None, :] <= xp.arange(n, device=dev)[:, None])
    return found


def prepare_reformer(q, k, v, rotations, chunk_size, causal, self_logit, scale, xp, look_back="round",
                     dedup=True, buckets=None):
    """Check the inputs of :func:`reformer_attention`: ``(xp, batch, alignment, scale)``."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    xp = namespace(("q", q), ("rotations", rotations), xp=xp)
    _check_rotations(rotations, k.shape[-1], k)
    if buckets is not None:
        check_index_array("reformer_attention", "buckets", buckets, (rotations.shape[1], k.shape[-2]),
                          "n_hashes, N", ", one bucket (or -1) per round and token")
    check_positive_int("chunk_size", chunk_size)
    _check_look_back(look_back)
    if not isinstance(dedup, bool):
        raise TypeError(f"dedup must be a bool, got {type(dedup).__name__}")
    if self_logit is not None:
        check_real("self_logit", self_logit)
    alignment = causal_alignment(causal)
    return xp, batch, alignment, default_scale(q.shape[-1], scale)


def _const(xp, value, like):
    return xp.asarray(value, dtype=like.dtype, device=array_api_compat.device(like))


def _gather(xp, x, idx):
    """Rows of ``x (..., N, e)`` at ``idx (..., H, M)``: ``(..., H, M, e)``."""
    e = x.shape[-1]
    shape = tuple(idx.shape) + (e,)
    x = xp.broadcast_to(x[..., None, :, :], tuple(idx.shape[:-1]) + tuple(x.shape[-2:]))
    return xp.take_along_axis(x, xp.broadcast_to(idx[..., None], shape), axis=-2)


def _look_back(xp, x, axis, look_back="round"):
    """Each chunk next to the chunk before it (cyclically), along the chunk ``axis``;
    with ``look_back="sequence"`` over the rounds (``axis - 1``) and chunks as one
    sequence, so that chunk 0 of round ``r`` gets the last chunk of round ``r - 1``."""
    if look_back == "round":
        return xp.concat([x, xp.roll(x, 1, axis=axis)], axis=axis + 1)
    axis = axis % x.ndim
    shape = tuple(x.shape)
    flat = xp.reshape(x, shape[:axis - 1] + (shape[axis - 1] * shape[axis],) + shape[axis + 1:])
    before = xp.reshape(xp.roll(flat, 1, axis=axis - 1), shape)
    return xp.concat([x, before], axis=axis + 1)


def reformer_rounds(q, k, v, /, *, rotations, chunk_size, causal=False, self_logit=DEFAULT_SELF_LOGIT,
                    scale=None, look_back="round", dedup=True, buckets=None, xp=None):
    """Each round's output and log-sum-exp, before the rounds are combined.

    Sort, chunk, attend to the chunk and the one before, unsort: the efficient form of
    one round, with each pair's logit lowered by ``log`` of the number of times the
    pair is found over all rounds (the duplicate correction; none with ``dedup=False``).
    ``look_back`` and ``buckets`` as in :func:`reformer_attention`.

    Returns
    -------
    out : array, shape (..., H, N, dv)
        Round ``r``'s softmax output over its window.
    lse : array, shape (..., H, N)
        Round ``r``'s log-sum-exp of the corrected logits.

    Notes
    -----
    ``O(H N c (d + dv + H))`` time for chunks of ``c`` (the ``H`` in the bracket is
    the duplicate count), ``O(H N c)`` extra memory.
    """
    xp, batch, alignment, scale = prepare_reformer(q, k, v, rotations, chunk_size, causal, self_logit,
                                                   scale, xp, look_back, dedup, buckets)
    n, dv = q.shape[-2], v.shape[-1]
    q, k, v = (xp.broadcast_to(x, batch + tuple(x.shape[-2:])) for x in (q, k, v))
    c = chunk_size
    n_chunks = ceil_div(n, c)
    pad = n_chunks * c - n
    order, chunk = lsh_chunks(_given_buckets(k, rotations, buckets, xp), c, xp=xp)
    dev = array_api_compat.device(q)
    if pad:
        # padded places hold position 0 and are masked as keys; their query rows are dropped
        order = xp.concat([order, xp.zeros(tuple(order.shape[:-1]) + (pad,), dtype=order.dtype,
                                           device=dev)], axis=-1)
    valid = xp.arange(n_chunks * c, device=dev) < n  # (M,)
    lead = tuple(order.shape[:-1])

    def chunked(x):
        return xp.reshape(x, lead + (n_chunks, c) + tuple(x.shape[len(lead) + 1:]))

    qs, ks, vs = (chunked(_gather(xp, x, order)) for x in (q, k, v))  # (..., H, C, c, e)
    pos_q = chunked(order)  # (..., H, C, c)
    pos_k = _look_back(xp, pos_q, -2, look_back)  # (..., H, C, 2c)
    ks, vs = _look_back(xp, ks, -3, look_back), _look_back(xp, vs, -3, look_back)
    # every round is padded alike: the chunk before is padded as the same round's would be
    valid_k = _look_back(xp, xp.reshape(valid, (n_chunks, c)), -2)  # (C, 2c)

    s = scaled_logits(xp, qs @ xp.matrix_transpose(ks), scale)  # (..., H, C, c, 2c)
    is_self = pos_q[..., :, None] == pos_k[..., None, :]
    if self_logit is not None:
        s = xp.where(is_self, _const(xp, self_logit, s), s)
    # The duplicate count: in how many (round, window slot) places query i meets key j.
    chunk_all = xp.matrix_transpose(chunk)  # (..., N, H): each position's chunk per round
    cq = chunked(_gather(xp, chunk_all, order))  # (..., H, C, c, H')
    ck = _look_back(xp, cq, -3, look_back)  # (..., H, C, 2c, H')
    count = xp.zeros_like(s)
    n_rounds = cq.shape[-1]
    for t in range(n_rounds if dedup else 0):  # a loop over rounds t keeps the memory at O(H N c)
        a, b = cq[..., :, None, t], ck[..., None, :, t]
        back = b == (a - 1) % n_chunks
        if look_back == "sequence":
            back = xp.where(a > 0, back, ck[..., None, :, (t - 1) % n_rounds] == n_chunks - 1)
        count = count + xp.astype(b == a, s.dtype) + xp.astype(back, s.dtype)
    # padded places are no key, and no query either (their duplicate counts are not theirs)
    valid_q = xp.reshape(valid, (n_chunks, c))
    allowed = xp.broadcast_to(valid_k[:, None, :] & valid_q[:, :, None], s.shape)
    if alignment is not None:
        allowed = allowed & (pos_k[..., None, :] <= pos_q[..., :, None])
    if dedup:
        s = s - xp.log(xp.where(allowed, count, xp.ones_like(count)))
    s = xp.where(allowed, s, _const(xp, -math.inf, s))
    m = xp.max(s, axis=-1, keepdims=True)
    p = xp.exp(s - finite_max(xp, m))
    den = xp.sum(p, axis=-1, keepdims=True)
    o = (p @ vs) / xp.where(den > 0, den, xp.ones_like(den))
    # padded query rows (no valid key) get -inf; they are dropped below
    lse = xp.where(den > 0, m + xp.log(xp.where(den > 0, den, xp.ones_like(den))),
                   _const(xp, -math.inf, den))[..., 0]
    # unsort: sorted place rank[j] of round r holds position j
    rank = xp.argsort(order[..., :n], axis=-1)
    o = xp.take_along_axis(xp.reshape(o, lead + (n_chunks * c, dv)),
                           xp.broadcast_to(rank[..., None], lead + (n, dv)), axis=-2)
    lse = xp.take_along_axis(xp.reshape(lse, lead + (n_chunks * c,)), rank, axis=-1)
    return o, lse


def combine_rounds(out, lse, /, *, xp=None):
    """``sum_r softmax_r(lse) out_r``: the rounds weighted by ``exp(lse_r - logsumexp_r lse_r)``.

    ``out (..., H, N, dv)`` and ``lse (..., H, N)`` from :func:`reformer_rounds`;
    returns ``(..., N, dv)``.
    """
    xp = array_api_compat.array_namespace(out, lse) if xp is None else xp
    top = xp.max(lse, axis=-2, keepdims=True)
    w = xp.exp(lse - top)
    w = w / xp.sum(w, axis=-2, keepdims=True)
    return xp.sum(out * w[..., None], axis=-3)


def reformer_attention(q, k, v, /, *, rotations, chunk_size, causal=False, self_logit=DEFAULT_SELF_LOGIT,
                       scale=None, look_back="round", dedup=True, buckets=None, xp=None):
    """Reformer LSH attention: hash, sort, attend in chunks with one chunk of look-back.

    Parameters
    ----------
    q : array, shape (..., N, d)
    k : array, shape (..., N, d)
        The keys, which also carry the hash (module docstring); ``shared_keys(q)`` for
        the paper's shared-QK attention.
    v : array, shape (..., N, dv)
    rotations : array, shape (d, n_hashes, n_buckets / 2)
        From :func:`lsh_rotations`; ``n_hashes`` rounds of ``n_buckets`` buckets.
    chunk_size : int
        Sorted positions per chunk; a chunk attends to itself and to the chunk before
        it (the first to the last, cyclically). Any ``N``: the last chunk may be short.
    causal : {False, True, "top-left", "bottom-right"}
        Key ``j`` is visible to query ``i`` only when ``j <= i`` (``Nq = Nk``, so both
        alignments agree).
    self_logit : float or None
        The logit that replaces ``q_i . k_i`` (default ``-5e4``: the token attends to
        itself only when it has no other key); ``None`` keeps the ordinary logit.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    look_back : {"round", "sequence"}
        The chunk before a round's first chunk: the round's last (default), or the last
        chunk of the round before, the rounds sorted as one sequence (trax, HuggingFace's
        ``LSHSelfAttention``, reformer-pytorch).
    dedup : bool
        Count a pair found several times once (default), or as often as it is found
        (``False``: HuggingFace's ``LSHSelfAttention``, reformer-pytorch's
        ``allow_duplicate_attention=True``).
    buckets : int array, shape (..., n_hashes, N), optional
        Fixes the bucket of token ``j`` in round ``r`` where ``buckets[..., r, j] >= 0``;
        ``-1`` hashes it (:func:`lsh_buckets`). A bucket is a discrete choice: where two
        hash logits are within a dtype's rounding, a kernel may hash a token either way,
        and ``conformance`` judges it against each such function
        (``docs/conformance.md``, "Reformer's near ties").

    Returns
    -------
    array, shape (..., N, dv)
        ``reformer_weights(q, k, ...) @ v``. One chunk (``chunk_size >= N``) is softmax
        over every other key; ``n_hashes`` equal rounds are one round.

    Notes
    -----
    ``O(H N c (d + dv + H) + H N (d B + log N))`` time for ``H`` rounds, chunks of
    ``c`` and ``B = n_buckets / 2``; ``O(H N c)`` extra memory. Kitaev et al., *Reformer:
    The Efficient Transformer*, ICLR 2020.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.hashing import lsh_rotations, reformer_attention, shared_keys
    >>> x = xp.reshape(xp.sin(xp.arange(48.0)), (12, 4))
    >>> r = lsh_rotations(4, 2, 4, seed=0, xp=xp)
    >>> reformer_attention(x, shared_keys(x), x, rotations=r, chunk_size=3).shape
    (12, 4)
    """
    xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
    out, lse = reformer_rounds(q, k, v, rotations=rotations, chunk_size=chunk_size, causal=causal,
                               self_logit=self_logit, scale=scale, look_back=look_back, dedup=dedup,
                               buckets=buckets, xp=xp)
    return combine_rounds(out, lse, xp=xp)


def reformer_weights(q, k, /, *, rotations, chunk_size, causal=False, self_logit=DEFAULT_SELF_LOGIT,
                     scale=None, look_back="round", dedup=True, buckets=None, xp=None):
    """The defining form: the ``(..., N, N)`` masked softmax the buckets imply.

    ``softmax`` of ``scale q_i . k_j`` (``self_logit`` on the diagonal) over the union
    mask :func:`lsh_attention_mask`, plus ``log c_ij`` with ``dedup=False`` (``c_ij``
    from :func:`lsh_pair_counts`: the pair entered ``c_ij`` times);
    ``reformer_attention(q, k, v, ...) == weights @ v``.
    Arguments as in :func:`reformer_attention`. ``O(N^2 (d + H))`` time, ``O(N^2)`` memory.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.hashing import lsh_rotations, reformer_weights
    >>> x = xp.reshape(xp.cos(xp.arange(20.0)), (5, 4))
    >>> p = reformer_weights(x, x, rotations=lsh_rotations(4, 1, 2, seed=0, xp=xp), chunk_size=8)
    >>> bool(xp.all(xp.linalg.diagonal(p) == 0.0))  # one chunk: every other key, never itself
    True
    """
    xp, batch, alignment, scale = prepare_reformer(q, k, k, rotations, chunk_size, causal, self_logit,
                                                   scale, xp, look_back, dedup, buckets)
    _, chunk = lsh_chunks(_given_buckets(k, rotations, buckets, xp), chunk_size, xp=xp)
    count = lsh_pair_counts(chunk, chunk_size, look_back=look_back, xp=xp)
    allowed = _union_mask(xp, count, alignment or False)
    s = scaled_logits(xp, q @ xp.matrix_transpose(k), scale)
    if self_logit is not None:
        n = q.shape[-2]
        eye = xp.eye(n, dtype=xp.bool, device=array_api_compat.device(q))
        s = xp.where(eye, _const(xp, self_logit, s), s)
    if not dedup:
        # a pair found c times enters the softmax c times (the self logit too)
        s = s + xp.log(xp.astype(xp.where(allowed, count, xp.ones_like(count)), s.dtype))
    s = xp.where(allowed, s, _const(xp, -math.inf, s))
    m = xp.max(s, axis=-1, keepdims=True)
    p = xp.exp(s - finite_max(xp, m))
    den = xp.sum(p, axis=-1, keepdims=True)
    return p / xp.where(den > 0, den, xp.ones_like(den))


def _params(seed, nq, nk, d, dv, *, dtype, device, xp):
    # Paper-like proportions at small N: chunks of 4 and about two chunks per bucket pair.
    n_buckets = 2 * max(1, min(4, nk // 8))
    # standard_normal, not lsh_rotations: the oracle's cases include d = 0
    return {"rotations": standard_normal((d, 2, n_buckets // 2), seed=seed, dtype=dtype, device=device,
                                         xp=xp)}


def _register():
    from .registry import Variant, register

    register(Variant(
        name="reformer", fn=reformer_attention, family="hashing", exact=False, causal=True,
        vjp="attn_ref.grad.hashing:reformer_attention",
        time="O(N c d)", memory="O(N c)", params=_params, weights=reformer_weights,
        self_attention=True, options={"chunk_size": 4},
        summary="Reformer LSH: 2 rounds of angular hashing, chunks of 4 with one look-back",
    ))


_register()
