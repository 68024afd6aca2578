"""Packed variable-length batches: FlashAttention's ``flash_attn_varlen_func`` layout.
"""

from __future__ import annotations

import operator

import array_api_compat

from .._checks import check_flag, check_positive_int, is_integer, namespace
from .online import online_forward
from .options import prepare_problem
from .reference import one_shot

__all__ = [
    "varlen_attention",
    "cu_offsets",
    "unpack_index",
    "packed_layout",
]


# ---------------------------------------------------------------- packed variable length


def cu_offsets(name, cu, total, tensor):
    """``cu_seqlens`` as Python ints: 1-D, starting at 0, non-decreasing, ending at ``total``."""
    if array_api_compat.is_array_api_obj(cu):
        cxp = array_api_compat.array_namespace(cu)
        if cu.ndim != 1:
            raise ValueError(f"{name} must be 1-D, shape (B + 1,), got shape {tuple(cu.shape)}")
        if not cxp.isdtype(cu.dtype, "integral"):
            raise TypeError(f"{name} must have an integer dtype, got {cu.dtype}")
        # The offsets plan the tiles, so they are read on the host (FlashAttention
        # likewise takes max_seqlen as a host integer). Under jax.jit pass a tuple.
        vals = [int(cu[i]) for i in range(cu.shape[0])]
    elif isinstance(cu, (list, tuple)) and all(is_integer(c) for c in cu):
        vals = [operator.index(c) for c in cu]
    else:
        raise TypeError(
            f"{name} must be a 1-D integer array or a sequence of ints [0, n1, n1 + n2, ...], "
            f"got {type(cu).__name__}"
        )
    if not vals or vals[0] != 0:
        raise ValueError(
            f"{name} must be cumulative offsets [0, n1, n1 + n2, ..., total] starting at 0, "
            f"got {vals}"
        )
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing (cumulative sequence lengths), but "
                f"{name}[{i - 1}]={vals[i - 1]} > {name}[{i}]={vals[i]}"
            )
    if vals[-1] != total:
        raise ValueError(
            f"{name} must end at the number of packed tokens, {tensor}.shape[0] = {total}, "
            f"got {name}[-1]={vals[-1]}"
        )
    return vals


def unpack_index(offsets, width):
    """Gather indices ``(B * width,)`` taking packed rows to a padded ``(B, width)`` grid;
    padding slots repeat a valid row (their results are masked or dropped)."""
    idx = []
    for start, stop in zip(offsets[:-1], offsets[1:]):
        n = stop - start
        idx.extend(start + min(i, n - 1) if n else 0 for i in range(width))
    return idx


def packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, extra=()):
    """Check the packed ``(total, H, d)`` layout; return the offsets and sequence lengths.

    ``extra`` holds further ``(name, array, expected shape)`` triples (the backward's
    ``do``). Returns ``(cu_q, cu_k, lengths_q, lengths_k)`` as host lists.
    """
    for name, x, want in (("q", q, "(total_q, Hq, d)"), ("k", k, "(total_k, Hkv, d)"),
                          ("v", v, "(total_k, Hkv, dv)"), *extra):
        if x.ndim != 3:
            raise ValueError(f"{name} must have the packed shape {want}, got shape {tuple(x.shape)}")
    cq = cu_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    ck = cu_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
            f"got {len(cq) - 1} and {len(ck) - 1}"
        )
    lq = [b - a for a, b in zip(cq[:-1], cq[1:])]
    lk = [b - a for a, b in zip(ck[:-1], ck[1:])]
    return cq, ck, lq, lk


def varlen_attention(q, k, v, /, *, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                     window=None, chunk=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                     dropout_mask=None, online=False, block_q=512, block_k=1024, xp=None):
    """Softmax attention over a packed batch of variable-length sequences.

    FlashAttention's ``flash_attn_varlen_func`` layout: the tokens of ``B`` sequences
    are concatenated along axis 0 and ``cu_seqlens`` holds the cumulative offsets
    ``[0, n_1, n_1 + n_2, ..., total]``; sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]``. No token attends across a sequence boundary:
    the result equals running each sequence alone through :func:`softmax_attention`
    (with ``gqa=True``), and positions for ``causal``, ``window``, ``chunk`` and ALiBi
    are local to each sequence (``off = Lk_b - Lq_b``; chunks counted from each
    sequence's first key).

    Parameters
    ----------
    q : array, shape (total_q, Hq, d)
    k : array, shape (total_k, Hkv, d)
    v : array, shape (total_k, Hkv, dv)
        ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention, as in
        FlashAttention: query head ``h`` uses key/value head ``h // (Hq / Hkv)``).
    cu_seqlens_q, cu_seqlens_k : 1-D integer array or sequence of ints, (B + 1,)
        Cumulative offsets, starting at 0, non-decreasing, ending at ``total_q`` /
        ``total_k``. They are read on the host (pass a tuple under ``jax.jit``).
    causal, scale, window, chunk, softcap, dropout_p
        As in :func:`softmax_attention`, per sequence.
    alibi_slopes : float array (Hq,) or (B, Hq), optional
    dropout_mask : bool array, optional
        Keep-mask in the padded layout ``(B, Hq, max_seqlen_q, max_seqlen_k)`` of
        FlashAttention's returned ``S_dmask`` (sliced to the longest sequences).
    online : bool
        Use :func:`online_softmax_attention` with ``block_q``, ``block_k`` instead of the
        one-shot form.

    Returns
    -------
    array, shape (total_q, Hq, dv)
        Query rows of a sequence with no keys are zero.

    Notes
    -----
    Sequences are gathered into a padded ``(B, H, max_seqlen, d)`` batch and run with
    ``seqlens_q``/``seqlens_k``; the extra memory is that padded copy (``O(B max_seqlen
    d)``) plus what the chosen form needs.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention, varlen_attention
    >>> x = xp.reshape(xp.sin(xp.arange(5 * 2 * 3.0)), (5, 2, 3))   # lengths 2 and 3
    >>> o = varlen_attention(x, x, x, cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 2, 5])
    >>> alone = softmax_attention(*(xp.permute_dims(x[2:, ...], (1, 0, 2)),) * 3)
    >>> bool(xp.max(xp.abs(o[2:, ...] - xp.permute_dims(alone, (1, 0, 2)))) < 1e-15)
    True
    """
    xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
    online = check_flag("online", online)
    cq, ck, lq, lk = packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k)
    device = array_api_compat.device(q)
    nb = len(cq) - 1
    wq, wk = max(lq, default=0), max(lk, default=0)

    def unpack(x, offsets, width):
        if x.shape[0] == 0:
            return xp.zeros((nb, x.shape[1], width, x.shape[2]), dtype=x.dtype, device=device)
        idx = xp.asarray(unpack_index(offsets, width), dtype=xp.int64, device=device)
        x = xp.reshape(xp.take(x, idx, axis=0), (nb, width) + tuple(x.shape[1:]))
        return xp.permute_dims(x, (0, 2, 1, 3))

    qp, kp, vp = unpack(q, cq, wq), unpack(k, ck, wk), unpack(v, ck, wk)
    lens_q = xp.asarray(lq, dtype=xp.int64, device=device)
    lens_k = xp.asarray(lk, dtype=xp.int64, device=device)
    kw = dict(causal=causal, scale=scale, window=window, chunk=chunk, softcap=softcap,
              alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_mask=dropout_mask,
              seqlens_q=lens_q, seqlens_k=lens_k, gqa=True, xp=xp)
    pb = prepare_problem(qp, kp, vp, **kw)
    if online:
        check_positive_int("block_q", block_q)
        check_positive_int("block_k", block_k)
        out = pb.ungroup(online_forward(pb, block_q, block_k)[0])
    else:
        out = pb.ungroup(one_shot(pb))
    hq, dv = q.shape[1], v.shape[2]
    if q.shape[0] == 0:
        return xp.zeros((0, hq, dv), dtype=q.dtype, device=device)
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (nb * wq, hq, dv))
    rows = [b * wq + i for b in range(nb) for i in range(lq[b])]
    return xp.take(out, xp.asarray(rows, dtype=xp.int64, device=device), axis=0)
