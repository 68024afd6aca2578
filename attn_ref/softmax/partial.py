"""Split-KV attention: the partial result of a key chunk and the merge of partials.

Long-context kernels (flash-decoding, ring attention, context parallelism) split the
keys into chunks ``K_1, ..., K_c``, compute on each the pair ``(O_i, lse_i)``, the
softmax output over that chunk alone and its row log-sum-exp, and merge them::

    lse = log sum_i exp(lse_i)           O = sum_i exp(lse_i - lse) O_i

which is exactly softmax attention over all the keys. The merge is associative and
commutative (it is ``logaddexp`` with weights), so any split of the keys and any merge
tree give the same answer up to rounding; ``docs/long_context.md`` derives it.

A row that sees no key of a chunk has ``lse = -inf`` (``log 0``) and ``O = 0``: it
weighs nothing in a merge. A row that sees no key at all keeps ``lse = -inf``, ``O = 0``.
(The blockwise backward's saved ``lse`` is ``+inf`` on such rows instead, FlashAttention
2's convention there, so that ``exp(S - lse)`` is 0; a ``+inf`` partial would swallow
every partial it meets, hence ``-inf`` here.)
"""

from __future__ import annotations

import operator

import array_api_compat

from .._checks import check_flag, namespace
from .._common import finish_partial, finite_max, partial_lse, softmax_partial
from .options import check_chunk, prepare_problem
from .tiles import chunk_coverage, logit_dtype, tile_logits, transposed_copy

__all__ = [
    "partial_attention",
    "merge_attention",
]


def _position(name, value):
    """A sequence position: an ``int`` (or anything with ``__index__``), not a bool."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer position, got {value!r} "
                        f"({type(value).__name__})") from None


def partial_attention(q, k, v, /, *, mask=None, bias=None, causal=False, query_offset=0,
                      key_offset=0, scale=None, chunk=None, softcap=None, xp=None):
    """Softmax attention over one chunk of keys: the output and the row log-sum-exp.

    ``S = scale q k^T`` (soft-capped, plus ``bias``, ``-inf`` where hidden),
    ``lse = log sum_j exp(S_j)``, ``O = softmax(S) V``. Partials of disjoint key chunks
    merge with :func:`merge_attention` into softmax attention over their union.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
        A block of queries (all of them, or one chunk).
    k : array, shape (..., n, d)
        One chunk of keys.
    v : array, shape (..., n, dv)
        The values of that chunk.
    mask : bool array broadcastable to (..., Nq, n), optional
        True where the query may attend the key, in the chunk's coordinates.
    bias : float array broadcastable to (..., Nq, n), optional
        Added to the scaled (and soft-capped) logits, in the chunk's coordinates.
    causal : bool
        Query ``query_offset + i`` sees key ``key_offset + j`` iff
        ``key_offset + j <= query_offset + i``: positions in the whole sequence.
        FlashAttention's bottom-right alignment of ``Nq`` queries on ``Nk`` keys is
        ``query_offset = Nk - Nq`` for the first query.
    query_offset, key_offset : int
        Positions of the first query and the first key of the chunk in the whole
        sequence; ``causal`` and ``chunk`` read them (``causal`` only their difference,
        so a negative ``query_offset``, bottom-right with ``Nq > Nk``, is fine).
    scale : float, optional
        Logit scale, default ``1/sqrt(d)`` (of the whole problem: the same for every
        chunk).
    chunk : int >= 1, optional
        Llama 4's chunked attention: query ``query_offset + i`` sees key
        ``key_offset + j`` only when both positions are in the same chunk,
        ``(query_offset + i) // chunk == (key_offset + j) // chunk``; the positions are
        absolute (for the bottom-right alignment of :func:`softmax_attention`'s
        ``chunk``, ``query_offset = Nk - Nq`` for the first query). Not to be confused
        with the split of the keys into the chunks this function is called on.
    softcap : float > 0, optional
        Soft-cap ``c tanh(s / c)`` of the scaled logits, before ``bias``.
    xp : namespace, optional
        Array namespace; inferred from ``q``, ``k``, ``v``.

    Returns
    -------
    out : array, shape (..., Nq, dv)
        ``softmax(S) V`` over the chunk, dtype of ``q``; zero on a row that sees none of
        its keys.
    lse : array, shape (..., Nq)
        ``logsumexp(S)`` per row, in float32 for float16 input and ``q``'s dtype
        otherwise; ``-inf`` on a row that sees none of the chunk's keys.

    Notes
    -----
    ``O(Nq n (d + dv))`` time, ``O(Nq n)`` extra memory (one tile of logits). A chunk
    that ``causal`` hides entirely costs nothing. See ``docs/long_context.md``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import merge_attention, partial_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(54.0)), (9, 6))
    >>> parts = [partial_attention(x, x[j:j + 3, :], x[j:j + 3, :], causal=True, key_offset=j)
    ...          for j in (0, 3, 6)]
    >>> out, lse = merge_attention(parts)
    >>> bool(xp.max(xp.abs(out - softmax_attention(x, x, x, causal=True))) < 1e-14)
    True
    >>> out, lse = partial_attention(x[:2, :], x[4:, :], x[4:, :], causal=True, key_offset=4)
    >>> float(lse[0]), float(xp.max(xp.abs(out)))
    (-inf, 0.0)
    """
    causal = check_flag("causal", causal)
    query_offset, key_offset = _position("query_offset", query_offset), _position("key_offset", key_offset)
    # the chunks are on absolute positions, which the problem's tile coordinates are not:
    # applied below with the offsets, as causal is
    chunk = check_chunk(chunk)
    pb = prepare_problem(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, xp=xp)
    xp, spec = pb.xp, pb.spec
    nq, n, dv = spec.nq, spec.nk, pb.v.shape[-1]
    device = array_api_compat.device(pb.q)
    dtype = logit_dtype(xp, pb.q.dtype)
    # The chunk's first key comes after its last query: nothing to see (a skipped tile).
    chunks = None if chunk is None else chunk_coverage(chunk, 0, query_offset, query_offset + nq,
                                                       key_offset, key_offset + n)
    if nq == 0 or n == 0 or (causal and key_offset > query_offset + nq - 1) or chunks == "none":
        return pb.zeros(dv), xp.full(pb.batch + (nq,), -xp.inf, dtype=dtype, device=device)
    s, _ = tile_logits(xp, pb.q, transposed_copy(xp, pb.k), spec, 0, 0)
    i = xp.arange(query_offset, query_offset + nq, device=device)[:, None]
    j = xp.arange(key_offset, key_offset + n, device=device)[None, :]
    if causal and key_offset + n - 1 > query_offset:
        s = xp.where(j <= i, s, -xp.inf)
    if chunks == "partial":
        s = xp.where(xp.floor_divide(i, chunk) == xp.floor_divide(j, chunk), s, -xp.inf)
    v = pb.v if pb.v.dtype == dtype else xp.astype(pb.v, dtype)
    m, l, acc = softmax_partial(xp, s, v)
    out = finish_partial(xp, l, acc)
    out = out if out.dtype == pb.q.dtype else xp.astype(out, pb.q.dtype)
    return out, partial_lse(xp, m, l, empty=-xp.inf)[..., 0]


def _check_partials(partials, xp):
    """The namespace of a non-empty sequence of ``(out, lse)`` pairs that fit together."""
    if isinstance(partials, tuple) and len(partials) == 2 and not isinstance(partials[0], (tuple, list)):
        raise TypeError("partials must be a sequence of (out, lse) pairs, got one (out, lse) "
                        "pair; pass [(out, lse), ...]")
    try:
        partials = list(partials)
    except TypeError:
        raise TypeError(f"partials must be a sequence of (out, lse) pairs, got "
                        f"{type(partials).__name__}") from None
    if not partials:
        raise ValueError("partials must hold at least one (out, lse) pair, got an empty sequence")
    for i, p in enumerate(partials):
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise TypeError(f"partials[{i}] must be an (out, lse) pair, got {type(p).__name__}"
                            + (f" of length {len(p)}" if isinstance(p, (tuple, list)) else ""))
    named = [(f"partials[{i}][{j}]", p[j]) for i, p in enumerate(partials) for j in (0, 1)]
    xp = namespace(*named, xp=xp)
    out0, lse0 = partials[0]
    for i, (out, lse) in enumerate(partials):
        if not xp.isdtype(out.dtype, "real floating"):
            raise TypeError(f"partials[{i}] out must have a real floating dtype, got {out.dtype}")
        if not xp.isdtype(lse.dtype, "real floating"):
            raise TypeError(f"partials[{i}] lse must have a real floating dtype, got {lse.dtype}")
        if out.ndim < 2 or tuple(lse.shape) != tuple(out.shape[:-1]):
            raise ValueError(f"partials[{i}] must be out (..., Nq, dv) and lse (..., Nq) of the same "
                             f"rows, got out {tuple(out.shape)} and lse {tuple(lse.shape)}")
        if tuple(out.shape) != tuple(out0.shape):
            raise ValueError(f"partials[{i}] out has shape {tuple(out.shape)}, partials[0] out "
                             f"{tuple(out0.shape)}: every partial covers the same queries")
        if out.dtype != out0.dtype or lse.dtype != lse0.dtype:
            raise TypeError(f"partials[{i}] has dtypes out {out.dtype}, lse {lse.dtype}; partials[0] "
                            f"out {out0.dtype}, lse {lse0.dtype}: every partial must share them")
    return xp, partials


def merge_attention(partials, /, *, xp=None):
    """Merge partials ``(O_i, lse_i)`` of disjoint key chunks into ``(O, lse)`` over their union.

    ``lse = log sum_i exp(lse_i)`` and ``O = sum_i exp(lse_i - lse) O_i``, computed
    after subtracting ``M = max_i lse_i`` so no ``exp`` overflows. Associative and
    commutative up to rounding: merging merged partials (any tree) equals merging all
    at once. Rows with ``lse_i = -inf`` weigh nothing; a row where every ``lse_i`` is
    ``-inf`` gives ``lse = -inf`` and ``O = 0``, never NaN.

    Parameters
    ----------
    partials : sequence of (out, lse) pairs
        ``out (..., Nq, dv)`` and ``lse (..., Nq)``, e.g. from :func:`partial_attention`;
        all of one shape and dtypes. At least one.
    xp : namespace, optional
        Array namespace; inferred from the partials.

    Returns
    -------
    out : array, shape (..., Nq, dv)
        The merged output, the partials' ``out`` dtype.
    lse : array, shape (..., Nq)
        The merged log-sum-exp, the partials' ``lse`` dtype.

    Notes
    -----
    ``O(c Nq dv)`` time for ``c`` partials, ``O(Nq dv)`` extra memory. The weights and
    the sum are computed in the wider of the two dtypes (float32 for float16 outputs).
    An ``lse`` of ``+inf`` is not an empty partial (FlashAttention 2 marks empty rows of
    its *final* lse so): it takes over the merge and gives NaN; map it to ``-inf``
    first. See ``docs/long_context.md`` for the identity and its monoid structure.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import merge_attention
    >>> a = (xp.asarray([[1.0], [5.0]]), xp.asarray([0.0, -xp.inf]))
    >>> b = (xp.asarray([[3.0], [7.0]]), xp.asarray([0.0, -xp.inf]))
    >>> out, lse = merge_attention([a, b])
    >>> [float(o) for o in out[:, 0]], float(lse[0]) == float(xp.log(xp.asarray(2.0))), float(lse[1])
    ([2.0, 0.0], True, -inf)
    """
    xp, partials = _check_partials(partials, xp)
    out_dtype = partials[0][0].dtype
    if len(partials) == 1:
        return tuple(partials[0])
    # float16 outputs are summed in lse's float32; float64 outputs never lose digits.
    dtype = xp.result_type(out_dtype, partials[0][1].dtype)
    lses = [lse[..., None] for _, lse in partials]
    m = lses[0]
    for lse in lses[1:]:
        m = xp.maximum(m, lse)
    # Shift by a finite max: a row with every lse_i = -inf gets weights exp(-inf) = 0.
    ms = finite_max(xp, m)
    weights = [xp.exp(lse - ms) for lse in lses]
    l, acc = None, None
    for w, (o, _) in zip(weights, partials):
        w = w if w.dtype == dtype else xp.astype(w, dtype)
        term = w * (o if o.dtype == dtype else xp.astype(o, dtype))
        l, acc = (w, term) if l is None else (l + w, acc + term)
    out = finish_partial(xp, l, acc)
    out = out if out.dtype == out_dtype else xp.astype(out, out_dtype)
    lse = partial_lse(xp, m, l if l.dtype == m.dtype else xp.astype(l, m.dtype), empty=-xp.inf)
    return out, lse[..., 0]
