"""Golden outputs at long ``N`` on Dask: the sequence axis chunked, the keys merged by a tree.

Exact softmax attention is the split-KV algorithm of long-context kernels: one task per
(query chunk, key chunk) computes :func:`~attn_ref.softmax.partial_attention`'s
``(out, lse)`` on NumPy blocks, and a tree of :func:`~attn_ref.softmax.merge_attention`
tasks reduces the key chunks of each query chunk (the merge is associative, so any tree
gives the same result to rounding). Causal key chunks that a query chunk cannot see get
no task at all.

Linear attention (Katharopoulos et al. 2020) runs through array-api-compat's Dask
namespace, the reference's own array-API code building the graph: per key chunk the
summary ``(phi(K_c)^T V_c, phi(K_c)^T 1)``; non-causal, their sum (a tree reduction);
causal, their exclusive prefix sum across chunks (a scan) read out by each query chunk
plus the chunk's own masked quadratic term.

Dask and distributed are imported here only, and only when called (the ``dask`` extra).
A lost worker stops the run with :class:`WorkerLost`: no partial result.
``docs/long_context.md`` has the derivation and the measured rates.
"""

from __future__ import annotations

import math
import sys

import array_api_compat

from ._checks import check_positive_int
from ._common import causal_alignment, causal_offset
from .linear import check_eps, check_scale, chunked_values, feature_map_features, readout
from .softmax.options import check_chunk
from .softmax.partial import merge_attention, partial_attention
from .softmax.tiles import chunk_coverage

__all__ = [
    "dask_softmax_attention",
    "dask_linear_attention",
    "local_cluster",
    "compute",
    "WorkerLost",
]


class WorkerLost(RuntimeError):
    """A Dask worker died while the graph ran: nothing is returned (no partial result)."""


def _dask_array(name, x):
    import dask.array as da

    if not isinstance(x, da.Array):
        raise TypeError(f"{name} must be a dask.array.Array (the sequence axis chunked), got "
                        f"{type(x).__module__}.{type(x).__name__}; wrap it with "
                        f"dask.array.from_array({name}, chunks=...)")
    return x


def _check_chunks(q, k, v, *, same_sequence_chunks=False):
    """``q (..., Nq, d)``, ``k (..., Nk, d)``, ``v (..., Nk, dv)`` chunked along the
    sequence axis only, with matching chunks where blocks meet."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _dask_array(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got shape {x.shape}")
        if len(x.chunks[-1]) != 1:
            raise ValueError(
                f"{name} is chunked along its last (head) dimension, chunks {x.chunks[-1]}: "
                f"only the sequence axis may be chunked; {name}.rechunk({{-1: -1}}) joins them")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"q, k and v must share their leading (batch, head) shape, got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}")
    if not (q.chunks[:-2] == k.chunks[:-2] == v.chunks[:-2]):
        raise ValueError(f"mismatched chunks of q and k along the batch/head axes: q "
                         f"{q.chunks[:-2]}, k {k.chunks[:-2]}, v {v.chunks[:-2]}; rechunk them alike")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dimension d, got q {q.shape}, k {k.shape}")
    if k.chunks[-2] != v.chunks[-2]:
        raise ValueError(f"mismatched chunks of k and v along the sequence axis: k {k.chunks[-2]}, "
                         f"v {v.chunks[-2]}; each key chunk needs its values")
    if same_sequence_chunks and q.chunks[-2] != k.chunks[-2]:
        raise ValueError(f"mismatched chunks of q and k along the sequence axis: q {q.chunks[-2]}, "
                         f"k {k.chunks[-2]}; causal linear attention reads chunk c of the queries "
                         f"against chunk c of the keys, rechunk k and v like q")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(f"q, k and v must share one floating dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")


def _starts(chunks):
    out, s = [], 0
    for c in chunks:
        out.append(s)
        s += c
    return out


def _tree(items, fn, split_every):
    """Reduce ``items`` by ``fn`` on groups of ``split_every`` neighbours, level by level."""
    while len(items) > 1:
        items = [fn(items[i:i + split_every]) if len(items[i:i + split_every]) > 1 else items[i]
                 for i in range(0, len(items), split_every)]
    return items[0]


def _merge(parts):
    return merge_attention(list(parts))


def dask_softmax_attention(q, k, v, /, *, causal=False, scale=None, chunk=None, split_every=2):
    """Exact softmax attention of Dask arrays: ``(out, lse)``, lazy.

    Parameters
    ----------
    q : dask array, shape (..., Nq, d)
    k : dask array, shape (..., Nk, d)
    v : dask array, shape (..., Nk, dv)
        Chunked along the sequence axis (and, alike, along the leading axes); the last
        axis one chunk. Key and value chunks must match.
    causal : {False, True, "top-left", "bottom-right"}
        As in :func:`attn_ref.softmax_attention`.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    chunk : int >= 1, optional
        Llama 4's chunked attention, as in :func:`attn_ref.softmax_attention`: query
        ``i`` sees key ``j`` only when ``(i + Nk - Nq) // chunk == j // chunk`` (ANDed with
        ``causal``). Each (query chunk, key chunk) pair whose positions share no chunk
        gets no task. Not with ``causal="top-left"`` and ``Nq != Nk``, where the causal
        mask and the chunks count positions from different ends (one offset per tile).
    split_every : int
        Partials merged per task of the tree (2: a binary tree of depth ``log2 c``).

    Returns
    -------
    out : dask array, shape (..., Nq, dv), chunked like ``q``
    lse : dask array, shape (..., Nq)
        Row log-sum-exp, ``-inf`` on rows that see no key.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` work in ``c_q c_k`` tasks (about half causal), each
    ``O(b_q b_k)`` memory for chunks of ``b_q`` queries and ``b_k`` keys; the merges add
    ``O(c_k Nq dv)``. Equal to :func:`attn_ref.softmax_attention` to rounding.

    Examples
    --------
    >>> import dask.array as da, numpy as np
    >>> from attn_ref import softmax_attention
    >>> from attn_ref.dask import dask_softmax_attention
    >>> x = np.sin(np.arange(96.0)).reshape(16, 6)
    >>> xd = da.from_array(x, chunks=(4, 6))
    >>> out, lse = dask_softmax_attention(xd, xd, xd, causal=True)
    >>> bool(np.max(np.abs(out.compute(scheduler="sync") - softmax_attention(x, x, x, causal=True))) < 1e-14)
    True
    """
    import dask
    import dask.array as da

    _check_chunks(q, k, v)
    alignment = causal_alignment(causal)
    if not isinstance(split_every, int) or isinstance(split_every, bool) or split_every < 2:
        raise ValueError(f"split_every must be an integer >= 2, got {split_every!r}")
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    off = causal_offset(alignment, nq, nk) if alignment else 0
    chunk = check_chunk(chunk)
    if chunk is not None:
        if alignment and off != nk - nq:
            raise ValueError(f"chunk counts query positions bottom-right (i + Nk - Nq) and "
                             f"causal={causal!r} top-left: with Nq = {nq} != Nk = {nk} the two "
                             f"differ; pass causal='bottom-right' (Llama 4's decode)")
        off = nk - nq
    qs, ks = _starts(q.chunks[-2]), _starts(k.chunks[-2])
    qd, kd, vd = q.to_delayed(), k.to_delayed(), v.to_delayed()
    partial = dask.delayed(partial_attention, pure=True)
    merge = dask.delayed(_merge, pure=True)
    # partial_attention's lse dtype: float32 for float16 input, else the input's
    lse_dtype = q.dtype if q.dtype.itemsize >= 4 else "float32"
    outs = []
    for lead in _lead_indices(qd.shape[:-2]):
        row_out, row_lse = [], []
        for i, q0 in enumerate(qs):
            bq = q.chunks[-2][i]
            parts = [partial(qd[lead + (i, 0)], kd[lead + (j, 0)], vd[lead + (j, 0)],
                             causal=bool(alignment), query_offset=q0 + off, key_offset=k0,
                             scale=scale, chunk=chunk)
                     for j, k0 in enumerate(ks)
                     # a key chunk wholly after the chunk's last query, or in no chunk
                     # of its queries: no task
                     if not (alignment and k0 > q0 + off + bq - 1) and not (
                         chunk is not None and chunk_coverage(
                             chunk, off, q0, q0 + bq, k0, k0 + k.chunks[-2][j]) == "none")]
            shape_o = tuple(c[b] for c, b in zip(q.chunks[:-2], lead)) + (bq, dv)
            if not parts:
                row_out.append(da.zeros(shape_o, dtype=q.dtype))
                row_lse.append(da.full(shape_o[:-1], -math.inf, dtype=lse_dtype))
                continue
            merged = _tree(parts, merge, split_every)
            row_out.append(da.from_delayed(merged[0], shape=shape_o, dtype=q.dtype))
            row_lse.append(da.from_delayed(merged[1], shape=shape_o[:-1], dtype=lse_dtype))
        outs.append((lead, da.concatenate(row_out, axis=-2), da.concatenate(row_lse, axis=-1)))
    return _assemble(outs, q.chunks[:-2])


def _lead_indices(shape):
    if not shape:
        return [()]
    import itertools

    return list(itertools.product(*(range(n) for n in shape)))


def _assemble(pieces, lead_chunks):
    """Join the per-leading-block results back along the leading axes."""
    import dask.array as da

    grid = {lead: (o, lse) for lead, o, lse in pieces}

    def nest(lead, which):
        depth = len(lead)
        if depth == len(lead_chunks):
            return grid[lead][which]
        return da.concatenate([nest(lead + (b,), which) for b in range(len(lead_chunks[depth]))],
                              axis=depth)

    return nest((), 0), nest((), 1)


def dask_linear_attention(q, k, v, /, *, causal=False, feature_map="elu+1", scale=None,
                          eps=1e-6, inner_chunk=64):
    """Linear attention of Dask arrays, through array-api-compat's Dask namespace (lazy).

    ``out_i = phi(q_i) S / phi(q_i) z`` with ``S = sum_j phi(k_j)^T v_j`` and
    ``z = sum_j phi(k_j)`` over the keys ``i`` sees, as :func:`attn_ref.linear_attention`.

    Parameters
    ----------
    q : dask array, shape (..., N, d)
    k : dask array, shape (..., N, d)
    v : dask array, shape (..., N, dv)
        Chunked along the sequence axis only (the last axis one chunk); causal needs
        the same sequence chunks for ``q``, ``k`` and ``v``.
    causal : bool
        Query ``i`` sees keys ``j <= i`` (self-attention, ``Nq == Nk``).
    feature_map : {"elu+1", "relu", "identity"}
        ``phi``, as in :func:`attn_ref.linear_attention`.
    scale : float, optional
        Multiplies the similarity ``phi(q) . phi(k)``; default 1.
    eps : float
        Denominators with ``|den| < eps`` become ``+-eps``.
    inner_chunk : int
        Causal: the chunk length ``C`` of :func:`attn_ref.linear.chunked_values` inside
        each Dask chunk (the masked ``C x C`` products against the running state).

    Returns
    -------
    dask array, shape (..., Nq, dv), chunked like ``q``

    Notes
    -----
    Non-causal: ``O(N d' dv)`` work, the summary ``(S, z)`` a tree reduction over key
    chunks. Causal: ``O(N (C + d') dv)``; the Dask chunks' summaries' exclusive prefix
    sum is a scan (``cumulative_sum``) over ``c`` chunks of ``d' (dv + 1)`` numbers, and
    each chunk starts its chunked causal form from its prefix.

    Examples
    --------
    >>> import dask.array as da, numpy as np
    >>> from attn_ref import linear_attention
    >>> from attn_ref.dask import dask_linear_attention
    >>> x = np.sin(np.arange(96.0)).reshape(16, 6)
    >>> xd = da.from_array(x, chunks=(4, 6))
    >>> out = dask_linear_attention(xd, xd, xd, causal=True).compute(scheduler="sync")
    >>> bool(np.max(np.abs(out - linear_attention(x, x, x, causal=True))) < 1e-14)
    True
    """
    _check_chunks(q, k, v, same_sequence_chunks=bool(causal))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if not isinstance(feature_map, str):
        raise TypeError("feature_map must be one of 'elu+1', 'relu', 'identity' on Dask (a "
                        f"callable is not checked block by block), got {feature_map!r}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal linear attention on Dask is self-attention (Nq == Nk), got q "
                         f"{q.shape}, k {k.shape}")
    scale, eps = check_scale(scale), check_eps(eps)
    inner_chunk = check_positive_int("inner_chunk", inner_chunk)
    xp = array_api_compat.array_namespace(q, k, v)
    fq = feature_map_features(q, feature_map=feature_map, name="q", xp=xp)
    fk = feature_map_features(k, feature_map=feature_map, name="k", xp=xp)
    fq = fq * scale if scale != 1.0 else fq
    ones = xp.ones(tuple(v.shape[:-1]) + (1,), dtype=v.dtype)
    # [V, 1]: one product gives the numerator and (last column) the denominator
    v1 = xp.concat([v, xp.astype(ones, v.dtype)], axis=-1)
    if not causal:
        state = xp.matrix_transpose(fk) @ v1  # contraction over chunked N: a tree sum
        nd = fq @ state
        return readout(xp, nd[..., :-1], nd[..., -1:], True, eps)
    starts, sizes = _starts(q.chunks[-2]), q.chunks[-2]
    blocks = [(a, a + b) for a, b in zip(starts, sizes)]
    states = xp.stack([xp.matrix_transpose(fk[..., a:b, :]) @ v1[..., a:b, :] for a, b in blocks],
                      axis=-3)
    # exclusive prefix: chunk c reads the keys of chunks 0..c-1 (a scan over chunks)
    prefix = xp.cumulative_sum(states, axis=-3, include_initial=True)
    outs = []
    for c, (a, b) in enumerate(blocks):
        # inside the chunk, the reference's chunked causal form from the incoming state
        nd, _ = chunked_values(xp, fq[..., a:b, :], fk[..., a:b, :], v1[..., a:b, :],
                               inner_chunk, state=prefix[..., c, :, :])
        outs.append(readout(xp, nd[..., :-1], nd[..., -1:], True, eps))
    return xp.concat(outs, axis=-2)


def local_cluster(n_workers=2, *, threads_per_worker=1, memory_limit="auto", allowed_failures=0,
                  quiet=False):
    """A ``distributed.LocalCluster`` of worker processes and its ``Client``; prints the
    dashboard link.

    ``allowed_failures=0``: a task whose worker dies is not retried elsewhere, so a lost
    worker stops :func:`compute` with :class:`WorkerLost` instead of a long silent
    recomputation. On a real cluster, ``distributed.Client("tcp://scheduler:8786")``
    takes its place; nothing else changes (``docs/long_context.md``).
    """
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": allowed_failures}):
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                               processes=True, memory_limit=memory_limit, dashboard_address=":0")
    client = Client(cluster)
    if not quiet:
        print(f"Dask dashboard: {client.dashboard_link}")
    return cluster, client


def compute(*arrays, client=None, progress=False):
    """Compute Dask arrays to NumPy, on ``client`` (the default scheduler without one).

    A worker lost mid-run raises :class:`WorkerLost` and returns nothing; ``progress``
    shows Dask's progress bar.
    """
    import dask

    if client is None:
        if progress:
            from dask.diagnostics import ProgressBar

            with ProgressBar(out=sys.stderr):
                return dask.compute(*arrays)
        return dask.compute(*arrays)
    from distributed import progress as show

    futures = client.compute(list(arrays))
    try:
        if progress:
            show(futures)
        return tuple(client.gather(futures))
    except Exception as exc:
        if _lost_worker(exc):
            client.cancel(futures)
            raise WorkerLost(f"a Dask worker died while computing ({type(exc).__name__}: {exc}); "
                             "no result is returned - rerun on a healthy cluster") from exc
        raise


def _lost_worker(exc) -> bool:
    from distributed import KilledWorker
    from distributed.comm import CommClosedError

    return isinstance(exc, (KilledWorker, CommClosedError))
