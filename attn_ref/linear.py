"""Linear attention: aggregate the keys first, then let each query read the summary.

When the similarity of a query and a key factorises through a feature map,
``sim(q, k) = scale * phi(q) . phi(k)``, the attention output

``o_i = sum_j sim(q_i, k_j) v_j / sum_j sim(q_i, k_j)``

can be computed in either order:

* quadratic, "interact then sum": ``A = phi(Q) phi(K)^T`` (``Nq x Nk``), then ``A V``;
* linear, "sum then interact": ``S = phi(K)^T V`` (``d' x dv``) and ``z = sum_j phi(k_j)``
  once, then ``o_i = phi(q_i)^T S / phi(q_i)^T z``.

They are the same function (Katharopoulos et al. 2020, "Transformers are RNNs"); the
second costs ``O(N d' dv)`` instead of ``O(N^2 d')``. With ``causal`` masking the
linear order becomes a prefix sum of states; this module computes it chunk by chunk
(inter-chunk ``phi(Q_c) S_{c-1}`` plus a masked intra-chunk ``(phi(Q_c) phi(K_c)^T * M) V_c``,
``S`` carried by a cumulative sum over chunks), and :func:`linear_attention_step` is the
recurrent form used for decoding. ``docs/linear.md`` derives the reordering.

Conventions shared by the family
--------------------------------
* ``feature_map``: ``"elu+1"`` (``elu(x) + 1``, Katharopoulos et al.), ``"relu"``,
  ``"identity"``, or a callable ``phi(x) -> (..., N, d')`` written in the array API
  (it is applied to ``q`` and ``k`` separately and must give both the same ``d'``).
* ``scale``: multiplies the similarity; default 1 (the kernel of Katharopoulos et al.).
  It cancels in the normalised output; ``scale=d**-0.5`` is the convention of
  flash-linear-attention's unnormalised kernels.
* ``causal``: as in :mod:`attn_ref.softmax` - ``False``, ``True``/``"top-left"``
  (query ``i`` sees keys ``j <= i``) or ``"bottom-right"`` (``j <= i + Nk - Nq``).
* The denominator ``den_i = scale * phi(q_i) . sum_j phi(k_j)`` (over the keys query
  ``i`` sees) is used as it is when ``|den_i| >= eps`` and replaced by ``+eps`` or
  ``-eps`` (keeping its sign; ``+eps`` for zero) when ``|den_i| < eps``. So the output
  is never NaN or inf for finite inputs whose sums are representable, i.e.
  ``|scale| * Nk * max|phi(q)| * max|phi(k)| * d' * max(1, max|v|)`` below the dtype's
  largest value (for ``"elu+1"`` in float32 with ``d = 64``, ``N = 4096``:
  ``|q|, |k| <= 1e14``; in float64 ``1e150``). Past that range the sums overflow
  (``|q|, |k| >= 1e19`` in float32 gives inf / inf = NaN); the reference does not rescale
  them. :func:`linear_attention` computes float16 input in float32 (the range above is
  then float32's) and returns float16. Inside it, a query with no visible key or with all-zero
  features (possible with ``"relu"``) returns zeros, as a fully masked row does in
  :mod:`attn_ref.softmax`. With a non-negative feature map (``"elu+1"``, ``"relu"``)
  ``den_i >= 0`` and every output row with ``den_i >= eps`` is a convex combination of
  the visible values. The ``"identity"`` map (and any signed callable) gives a
  denominator that can be negative or cross zero; the rule above still applies -
  finite, but unbounded as ``den_i`` approaches ``eps`` - so use ``normalize=False``
  with signed maps unless that is what you want. Unlike Katharopoulos et al., who
  divide by ``den + eps``, a denominator at least ``eps`` is used unchanged, so the
  normalised weights sum to exactly 1 (to rounding).
* ``normalize=False`` returns the unnormalised ``scale * phi(Q) phi(K)^T V`` (masked).
"""

from __future__ import annotations

import math

import array_api_compat

from ._checks import (
    broadcast_batch,
    check_array,
    check_flag,
    check_positive_int,
    check_qkv,
    check_real,
    default_scale,
    is_floating,
    namespace,
)
from ._common import (
    TOP_LEFT,
    add_into,
    batch_rows,
    causal_alignment,
    causal_offset,
    ceil_div,
    is_lazy,
    mul_into,
    numpy_backed,
    owned_writeable,
    parallel_map,
    pool_helps,
    row_groups,
)
from .softmax.tiles import logit_dtype, transposed_copy

__all__ = [
    "FEATURE_MAPS",
    "feature_map_features",
    "linear_attention",
    "linear_attention_weights",
    "linear_attention_state",
    "linear_attention_step",
    "linear_from_features",
    "linear_from_row_maps",
    "weights_from_features",
    "check_feature_map",
    "check_eps",
    "safe_denominator",
    "kv_state",
    "state_readout",
    "causal_plan",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_EPS",
    # Named steps that attn_ref.grad differentiates.
    "features_qk",
    "check_order",
    "check_scale",
    "readout",
    "causal_visible",
    "quadratic_order",
    "pad_rows",
    "align_square",
    "with_ones",
    "split_num_den",
    "chunked_values",
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
# From this many rows (all heads, queries plus keys) a call on NumPy arrays with several
# heads splits them among the CPUs, contiguous groups on :func:`attn_ref._common.parallel_map`'s
# pool (the block loop's GEMM chunks, GEMM_ROWS, are one-thread products, so without the
# pool the second core idles; BLAS is not held to one thread here, see ``_engine``).
# 8 heads, d = 64: on the quiet 2-core machine the pool took 197 against 246 ms at
# N = 65536 non-causal, before BLAS was held to one thread in it (the lead's measurement,
# ``docs/comparison.md``); under load 8-10 it lost wall time at N = 16384-65536 (N = 65536:
# 969 against 816 ms at the same CPU time in one run, 1484 against 741 ms at twice the
# CPU time in another; why is not settled) and gained at N = 4096 (44.7 against 58.3 ms,
# ``tools/targets.py linear --pool-ns 1024,4096,16384``), lost at 1024 (9.9 against 4.3
# ms: starting the pool costs about 1 ms); those ran with BLAS held to one thread. As
# now (BLAS as it is), load 3.8-3.9: 0-20% slower than no pool at N = 1024-65536
# (65536: 342 against 287 ms). Kept on for the quiet re-take, the condition of the
# lead's gain; set it to 1 << 62 to switch the pool off.
POOL_MIN_ROWS = 1 << 16
# Rows per GEMM of the non-causal block loop: a block's fold and read are taken as
# products of GEMM_ROWS-row chunks (a batch of small GEMMs), not one product over the
# block. Each chunk's GEMM (GEMM_ROWS x d' x (dv + 1) = 532K multiply-adds at 128 x 64 x 65)
# stays below 1M, where OpenBLAS (NumPy's BLAS here, SkylakeX kernels) runs its small-matrix
# kernel: one thread, no packing. One GEMM over a 512-row block (2.1M) takes its threaded
# path instead, whose two threads synchronise per call: at N = 65536, 8 heads, d = 64 that
# was slower than one thread even on the quiet machine (the fold GEMM 127 ms against 62 ms
# for the read) and 4-10x slower than one thread on a loaded one (``docs/comparison.md``,
# "The fold GEMM was OpenBLAS's threading"). The causal chunks (64 x 64 x 65) were always
# below the limit. Wider features (Performer's d' = 256) take fewer rows per chunk, for the
# same GEMM size (:func:`_gemm_rows`).
GEMM_ROWS = 128


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


def _elu_plus_one(xp, x):
    # elu(x) + 1 = max(x, 0) + exp(min(x, 0)): exp never sees a positive argument,
    # so it cannot overflow (and its derivative stays finite for the VJP).
    zero = _zero_like(xp, x)
    # into exp's own array: one fresh array fewer per call, the same sums (addition commutes)
    return add_into(xp.exp(xp.minimum(x, zero)), xp.maximum(x, zero))


def _relu(xp, x):
    return xp.maximum(x, _zero_like(xp, x))


_NAMED = {"elu+1": _elu_plus_one, "relu": _relu, "identity": lambda xp, x: x}


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


def _feature_pair(xp, q, k, feature_map, scale):
    """``phi_q(rows)``, ``phi_k(rows)`` for row blocks of ``q`` and ``k``.

    ``phi_q`` carries the similarity scale. Both check the callable's output (shape,
    dtype) on every block, and that queries and keys get the same ``d'``.
    """
    feature_map = check_feature_map(feature_map)
    seen = {}

    def phi(name, x):
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


# ---------------------------------------------------------------- the engine


def safe_denominator(xp, den, eps):
    """``den`` where ``|den| >= eps``, else ``eps`` with the sign of ``den`` (``+eps`` at 0)."""
    e = xp.full((), eps, dtype=den.dtype, device=array_api_compat.device(den))
    small = xp.abs(den) < e
    return xp.where(small, xp.where(den < 0, -e, e), den)


def readout(xp, num, den, normalize, eps):
    """The output from numerator ``(..., Nq, dv)`` and denominator ``(..., Nq, 1)``."""
    return num / safe_denominator(xp, den, eps) if normalize else num


def causal_visible(xp, nq, nk, alignment, device):
    """Boolean ``(Nq, Nk)``: True where query ``i`` may see key ``j``."""
    off = causal_offset(alignment, nq, nk)
    return xp.arange(nk, device=device)[None, :] <= xp.arange(nq, device=device)[:, None] + off


def _similarities(xp, fq, fk, alignment):
    """``A = phi(Q) phi(K)^T``, zero where the causal ``alignment`` (None: none) hides a key."""
    return _hide(xp, fq @ xp.matrix_transpose(fk), alignment)


def _hide(xp, a, alignment):
    """``a (..., Nq, Nk)`` with zeros where the causal ``alignment`` (None: none) hides a key.

    ``where``, not a product with the mask: a non-finite value at a hidden position must
    not reach the output (``inf * 0`` is NaN)."""
    if alignment is None:
        return a
    vis = causal_visible(xp, a.shape[-2], a.shape[-1], alignment, array_api_compat.device(a))
    return xp.where(vis, a, xp.zeros((), dtype=a.dtype, device=array_api_compat.device(a)))


def _hide_in_chunks(xp, a, fq, fk):
    """:func:`_hide` (top-left) of the in-chunk products ``a = phi(Q_c) phi(K_c)^T`` of a
    block whose features are ``fq`` and ``fk``, as a product with the 0/1 mask where
    that is exact.

    Every entry of ``a``, the hidden ones included, is at most ``d' max|phi(q)|
    max|phi(k)|`` in magnitude; when that bound is finite and below half the dtype's
    largest value no entry is ``inf`` or NaN, so ``a * M`` is ``a`` where ``M`` is 1 and
    zero where it is 0: the same values as the select (a hidden negative entry gives
    ``-0``, which adds nothing to the next product's sums). NumPy's ``where`` runs at a
    fifth of a product's rate: on a causal block of 512 rows, 8 heads, ``d' = C = 64``,
    one thread, 323 us for the select against 60 us for the product and 76 us for the
    four reductions of the bound (one value read back). Otherwise (a feature map that
    overflows, non-finite inputs, lazy arrays whose values cannot be read) the select.
    """
    if not is_lazy(a):
        # one value read back: maximum and the products propagate NaN, inf stays inf
        bound = float(xp.maximum(xp.max(fq), -xp.min(fq)) * xp.maximum(xp.max(fk), -xp.min(fk)))
        if bound * fq.shape[-1] <= xp.finfo(a.dtype).max / 2:
            vis = causal_visible(xp, a.shape[-2], a.shape[-1], TOP_LEFT, array_api_compat.device(a))
            return mul_into(a, xp.astype(vis, a.dtype))
    return _hide(xp, a, TOP_LEFT)


def quadratic_order(xp, fq, fk, v, alignment):
    """Interact then sum: ``A = phi(Q) phi(K)^T`` (masked), ``(A V, rowsum A)``."""
    a = _similarities(xp, fq, fk, alignment)
    return a @ v, xp.sum(a, axis=-1, keepdims=True)


def kv_state(xp, fk, v):
    """The context summary of a set of keys: ``(S, z) = (phi(K)^T V, sum_j phi(k_j))``."""
    return xp.matrix_transpose(fk) @ v, xp.sum(fk, axis=-2)


def state_readout(xp, fq, s, z):
    """Numerator ``phi(Q) S`` and denominator ``phi(Q) z`` of a summary ``(S, z)``."""
    return fq @ s, fq @ z[..., :, None]


def pad_rows(xp, x, before, after, fill=0.0):
    """``x`` with ``before``/``after`` rows of ``fill`` (zeros by default) added on axis -2."""
    if before == 0 and after == 0:
        return x
    dev = array_api_compat.device(x)
    parts = []
    if before:
        parts.append(xp.full(tuple(x.shape[:-2]) + (before, x.shape[-1]), fill, dtype=x.dtype, device=dev))
    parts.append(x)
    if after:
        parts.append(xp.full(tuple(x.shape[:-2]) + (after, x.shape[-1]), fill, dtype=x.dtype, device=dev))
    return xp.concat(parts, axis=-2)


def causal_plan(nq, nk, alignment):
    """How :func:`align_square` pads: ``(P, P', keep, tail)`` (see there)."""
    off = causal_offset(alignment, nq, nk)
    p_q, p_k = max(off, 0), max(-off, 0)
    keep = max(min(nk, nq + p_q - p_k), 0)
    return p_q, p_k, keep, nq + p_q - p_k - keep


def align_square(xp, fq, fk, v, alignment):
    """Rewrite a causal problem with any ``Nq, Nk`` as a square top-left one of length ``L``.

    Query ``i`` moves to position ``i + P`` and key ``j`` to ``j + P'`` with
    ``P - P' = offset``, so ``j <= i + offset`` becomes the usual ``j' <= i'``. Padded
    rows carry zero features, which contribute nothing to any sum; keys no query can
    see are dropped. Returns ``(fq, fk, v, P)``; the outputs are rows ``P:P+Nq``.
    """
    p_q, p_k, keep, tail = causal_plan(fq.shape[-2], fk.shape[-2], alignment)
    fq = pad_rows(xp, fq, p_q, 0)
    fk, v = fk[..., :keep, :], v[..., :keep, :]
    return fq, pad_rows(xp, fk, p_k, tail), pad_rows(xp, v, p_k, tail), p_q


def with_ones(xp, v):
    """``[V, 1]``: a column of ones after the values, whose output is the denominator.

    ``phi(Q) phi(K)^T [V, 1] = [num, den]``, so one matrix product per term gives
    both, and the state ``phi(K)^T [V, 1] = [S, z]`` carries ``z`` as its last column.
    """
    ones = xp.ones(tuple(v.shape[:-1]) + (1,), dtype=v.dtype, device=array_api_compat.device(v))
    return xp.concat([v, ones], axis=-1)


def split_num_den(xp, out):
    """``(num, den)`` from an output ``[num, den]`` of values extended by :func:`with_ones`."""
    return out[..., :-1], out[..., -1:]


def chunked_values(xp, fq, fk, v, chunk_size, state=None):
    """Top-left causal ``phi(Q) phi(K)^T V`` (masked) of square inputs, chunk by chunk.

    Per chunk ``c``: ``phi(Q_c) S_{c-1} + (phi(Q_c) phi(K_c)^T * M) V_c`` with the
    lower-triangular mask ``M`` and the exclusive prefix sum ``S_{c-1}`` of the chunk
    states ``phi(K_c)^T V_c``, taken over all chunks at once (:func:`_exclusive_prefix`)
    starting from ``state`` (the summary ``(..., d', dv)`` of earlier keys; zero if
    None). A ragged tail is padded with zero features. Returns the output
    ``(..., N, dv)`` and the summary of ``state`` and all these keys. Extra memory
    ``O(N C + (N / C) d' dv)``.
    """
    n = fq.shape[-2]
    c = min(chunk_size, n)
    n_chunks = ceil_div(n, c)
    pad = n_chunks * c - n
    fq, fk, v = (pad_rows(xp, x, 0, pad) for x in (fq, fk, v))
    qc, kc, vc = (xp.reshape(x, tuple(x.shape[:-2]) + (n_chunks, c, x.shape[-1])) for x in (fq, fk, v))
    # phi(K_c)^T once in row-major order serves both products that need it: NumPy's
    # stacked matmul is several times slower on a transposed view (N = 65536, 8 heads,
    # C = 64, one thread: phi(Q_c) phi(K_c)^T 109 ms on the view, 49 ms + 21 ms for
    # the copy).
    kt = transposed_copy(xp, kc)
    s = kt @ vc  # (..., n_chunks, d', dv)
    prefix = _exclusive_prefix(xp, s, state)
    out = add_into(qc @ prefix[..., :-1, :, :], _hide_in_chunks(xp, qc @ kt, fq, fk) @ vc)
    out = xp.reshape(out, tuple(out.shape[:-3]) + (n_chunks * c, out.shape[-1]))
    return out[..., :n, :], prefix[..., -1, :, :]


def _exclusive_prefix(xp, s, state):
    """``P_c = state + sum_{c' < c} s_c'``, ``c = 0 .. n``: shape ``(..., n + 1, d', dv)``.

    Taken as one product with the ``(n + 1) x n`` strictly lower-triangular matrix of
    ones rather than ``cumulative_sum`` over the chunk axis: the same sums, but a
    matrix product over ``d' dv`` columns at once, where NumPy's cumulative sum walks
    the short chunk axis element by element (5x slower here). The future still
    cannot reach the past: its chunks meet exact zeros, which leave every earlier
    sum bit-for-bit unchanged (as long as they are finite, as in the masked
    intra-chunk product).
    """
    n, d1, d2 = s.shape[-3], s.shape[-2], s.shape[-1]
    rows = xp.arange(n + 1, device=array_api_compat.device(s))
    lower = xp.astype(rows[:, None] > rows[None, :n], s.dtype)
    flat = xp.reshape(s, tuple(s.shape[:-3]) + (n, d1 * d2))
    prefix = xp.reshape(lower @ flat, tuple(s.shape[:-3]) + (n + 1, d1, d2))
    return prefix if state is None else add_into(prefix, state[..., None, :, :])


def _feature_rows(xp, phi, x, lo, hi, n):
    """``phi`` of rows ``lo:hi`` of ``x`` (``n`` rows); rows outside ``[0, n)`` get zero features.

    Zero features are what padding must carry: they add nothing to ``S`` or ``z``.
    Returns None when no row of the range is real.
    """
    a, b = max(lo, 0), min(hi, n)
    if a >= b:
        return None
    return pad_rows(xp, phi(x[..., a:b, :]), a - lo, hi - b)


def _value_rows(xp, v, lo, hi, n):
    a, b = max(lo, 0), min(hi, n)
    return pad_rows(xp, v[..., a:b, :], a - lo, hi - b)


def _fold(xp, state, fk, v1):
    """``state + phi(K)^T [V, 1]``: the summary with one more block of keys folded in
    (in place when the library allows: ``state`` is always this code's own array)."""
    ds = xp.matrix_transpose(fk) @ v1
    return ds if state is None else add_into(state, ds)


def _row_chunks(xp, x, rows):
    """``x (..., B, n)`` as ``(..., B / rows, rows, n)`` (``rows`` divides ``B``)."""
    return xp.reshape(x, tuple(x.shape[:-2]) + (x.shape[-2] // rows, rows, x.shape[-1]))


def _gemm_rows(n, d_prime, dv1):
    """Rows per chunk of a block of ``n`` rows with ``d'`` features and ``dv + 1`` value
    columns: :data:`GEMM_ROWS` at ``d' = 64``, ``dv = 64``, halved until a chunk's GEMM is no
    larger than that one; None (one GEMM over the block) when they do not divide ``n`` into
    at least two chunks."""
    rows = GEMM_ROWS
    while rows > 1 and rows * d_prime * dv1 > GEMM_ROWS * 64 * 65:
        rows //= 2
    return rows if n > rows and n % rows == 0 else None


def _fold_transposed(xp, state_t, fk, v1):
    """``state_t + [V, 1]^T phi(K)``: the transposed summary ``[S, z]^T``, ``(..., dv + 1,
    d')``, with one more block of keys folded in, chunk by chunk (:func:`_gemm_rows`).

    The chunks' summaries are summed over the chunk axis: the same products as one
    GEMM over the block, added in another order. Transposed, because OpenBLAS runs
    ``[V, 1]^T phi(K)`` (a ``(dv + 1) x B`` left operand) faster than ``phi(K)^T [V, 1]``
    when a product does take its threaded path (a ragged last block)."""
    rows = _gemm_rows(fk.shape[-2], fk.shape[-1], v1.shape[-1])
    if rows is not None:
        ds = xp.sum(xp.matrix_transpose(_row_chunks(xp, v1, rows)) @ _row_chunks(xp, fk, rows), axis=-3)
    else:
        ds = xp.matrix_transpose(v1) @ fk
    return ds if state_t is None else add_into(state_t, ds)


def _read_summary(xp, fq, state):
    """``phi(Q) [S, z]`` of a block, ``(..., B, dv + 1)``, chunk by chunk (:func:`_gemm_rows`):
    each output row is the same dot products as in one GEMM over the block."""
    n = fq.shape[-2]
    rows = _gemm_rows(n, fq.shape[-1], state.shape[-1])
    if rows is None:
        return fq @ state
    out = _row_chunks(xp, fq, rows) @ state[..., None, :, :]
    return xp.reshape(out, tuple(out.shape[:-3]) + (n, out.shape[-1]))


def _read(xp, out, normalize, eps):
    """``(num, den)`` of a ``[num, den]`` block for :meth:`_Rows.put`: ``den`` is the
    safe denominator (:func:`readout`), None when ``normalize`` is off."""
    num, den = split_num_den(xp, out)
    return num, (safe_denominator(xp, den, eps) if normalize else None)


class _OnesColumn:
    """:func:`with_ones` of successive row blocks of ``v``, at most ``rows`` rows each.

    Where the library allows writes, every block is copied into one ``[V, 1]`` buffer
    made once (its ones column written once), instead of a fresh concatenation per
    block; else (JAX, lazy or autograd-recording arrays) :func:`with_ones` each time.
    The block returned is only valid until the next ``put``.
    """

    def __init__(self, xp, v, rows):
        self.xp, self.buf = xp, None
        if is_lazy(v) or (array_api_compat.is_torch_array(v) and v.requires_grad):
            return  # a copy into the buffer would be traced or recorded
        shape = tuple(v.shape[:-2]) + (rows, v.shape[-1] + 1)
        buf = xp.ones(shape, dtype=v.dtype, device=array_api_compat.device(v))
        self.buf = buf if owned_writeable(buf) else None

    def put(self, block):
        if self.buf is None:
            return with_ones(self.xp, block)
        n = block.shape[-2]
        self.buf[..., :n, :-1] = block
        return self.buf[..., :n, :]


class _Rows:
    """An output of ``n`` rows (axis -2), filled block by block in order.

    Where the library lets us write into an array we made (NumPy, PyTorch, CuPy,
    array-api-strict) each block goes straight into one preallocated output (``out``,
    when the caller made it: a heads group's rows of the pooled call's output); else
    (JAX, a lazy array) the blocks are kept and concatenated at the end. Writing in
    place saves a full pass: with ``concat`` every block is written to memory once as
    a block and again into the result (at N = 65536, 8 heads, ``d = 64``, 134 MB each
    way), and the result's fresh pages are touched a second time.
    """

    def __init__(self, xp, n, out=None):
        self.xp, self.n, self.parts, self.out = xp, n, [], out

    def put(self, lo, block, den=None):
        """Rows ``lo:lo + B`` of the output: ``block (..., B, dv)``, divided by ``den
        (..., B, 1)`` when given."""
        if (self.out is None and not self.parts and block.shape[-2] < self.n
                and array_api_compat.is_writeable_array(block) and not is_lazy(block)):
            shape = tuple(block.shape[:-2]) + (self.n, block.shape[-1])
            self.out = self.xp.empty(shape, dtype=block.dtype, device=array_api_compat.device(block))
        if self.out is None:
            self.parts.append(block if den is None else block / den)
            return
        hi = lo + block.shape[-2]
        if den is not None and not owned_writeable(block):
            block = block / den  # autograd records the division
            den = None
        self.out[..., lo:hi, :] = block
        if den is not None:
            # Divided where it lies: on the output's contiguous rows the division is about
            # a third faster than on the strided numerator columns of [num, den] (NumPy,
            # (8, 512, 64) float32 blocks, the same quotients).
            rows = self.out[..., lo:hi, :]
            rows /= den

    def result(self):
        if self.out is not None:
            return self.out
        return self.xp.concat(self.parts, axis=-2) if len(self.parts) > 1 else self.parts[0]


def _stream(xp, q, k, v, phi_q, phi_k, batch, alignment, chunk_size, block_size, normalize, eps,
            out=None):
    """The linear order, ``block_size`` rows at a time: ``batch + (Nq, dv)``, written into
    ``out`` when given (an array of that shape the caller made; :class:`_Rows`).

    Non-causal: every key block is folded into the summary ``phi(K)^T [V, 1] =
    [S, z]``, then every query block reads it. Causal: the problem is aligned to a
    square top-left one of length ``L`` (:func:`causal_plan`) and walked block by
    block; inside a block the chunked form runs vectorised over its chunks, its
    prefix sum starting from the summary of all earlier blocks. The feature maps see
    one block at a time, so ``phi(Q)``, ``phi(K)`` and the chunk states never exist
    for the whole sequence: extra memory ``O(B (C + d') + (B / C) d' dv)`` besides
    the output.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    outs = _Rows(xp, nq, out)
    if alignment is None:
        state_t = None
        ones = _OnesColumn(xp, v, min(block_size, nk))
        for lo in range(0, nk, block_size):
            hi = min(lo + block_size, nk)  # out-of-bounds slice stops are not in the standard
            fk = phi_k(k[..., lo:hi, :])
            state_t = _fold_transposed(xp, state_t, fk, ones.put(v[..., lo:hi, :]))
        # [S, z] row-major again (d' (dv + 1) floats per head), the read's right operand.
        state = transposed_copy(xp, state_t)
        for lo in range(0, nq, block_size):
            hi = min(lo + block_size, nq)
            # Named, so that a block's arrays are freed only once the next block's exist.
            fq = phi_q(q[..., lo:hi, :])
            out = _read_summary(xp, fq, state)
            outs.put(lo, *_read(xp, out, normalize, eps))
        return outs.result()
    p_q, p_k, keep, tail = causal_plan(nq, nk, alignment)
    length = nq + p_q
    c = min(chunk_size, length)
    block = ceil_div(block_size, c) * c  # whole chunks per block
    state = None
    ones = _OnesColumn(xp, v, min(block, length))
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        fk = _feature_rows(xp, phi_k, k, lo - p_k, hi - p_k, keep)
        v1 = ones.put(_value_rows(xp, v, lo - p_k, hi - p_k, keep)) if fk is not None else None
        fq = _feature_rows(xp, phi_q, q, lo - p_q, hi - p_q, nq)
        if fq is None:  # keys before the first query: only the summary grows
            if fk is not None:
                state = _fold(xp, state, fk, v1)
            continue
        if fk is not None:
            out, state = chunked_values(xp, fq, fk, v1, c, state)
        elif state is not None:
            out = fq @ state
        else:  # no key visible yet; zeros of the batch every other block has
            out = xp.zeros(batch + (hi - lo, v.shape[-1] + 1), dtype=v.dtype,
                           device=array_api_compat.device(v))
        outs.put(max(lo - p_q, 0), *_read(xp, out[..., max(p_q - lo, 0):, :], normalize, eps))
    return outs.result()


def _engine(xp, q, k, v, phi_q, phi_k, *, causal, order, chunk_size, block_size, normalize, eps,
            threads=True):
    """Shared by :func:`linear_attention` and :func:`linear_from_features`; options checked
    here. ``threads=False`` keeps a large call on one thread (a user's feature map is
    not promised to be thread-safe)."""
    alignment = causal_alignment(causal)
    check_order(order)
    check_positive_int("chunk_size", chunk_size)
    check_positive_int("block_size", block_size)
    normalize = check_flag("normalize", normalize)
    eps = check_eps(eps)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    batch = broadcast_batch([("q", tuple(q.shape[:-2])), ("k", tuple(k.shape[:-2])),
                             ("v", tuple(v.shape[:-2]))])
    if nq == 0 or nk == 0:
        return xp.zeros(batch + (nq, dv), dtype=v.dtype, device=array_api_compat.device(v))
    if order == "quadratic":
        num, den = quadratic_order(xp, phi_q(q), phi_k(k), v, alignment)
        return readout(xp, num, den, normalize, eps)
    rows = batch_rows((q, k, v))
    pooled = threads and rows > 1 and rows * (nq + nk) >= POOL_MIN_ROWS and pool_helps(q, k, v)
    if not pooled:
        return _stream(xp, q, k, v, phi_q, phi_k, batch, alignment, chunk_size, block_size, normalize, eps)
    # The heads are independent problems: a few contiguous groups of them, one per CPU,
    # each the same computation as the batched call on its rows.
    flat = [xp.reshape(x, (rows,) + tuple(x.shape[-2:])) for x in (q, k, v)]
    # One output for all groups, each writing its own rows: the groups' outputs joined by
    # concat cost a pass over the whole output and its fresh pages (N = 65536, 8 heads,
    # d = 64: 128 MiB written twice).
    out = None
    if not (array_api_compat.is_torch_array(v) and v.requires_grad):
        out = xp.empty((rows, nq, dv), dtype=v.dtype, device=array_api_compat.device(v))
        out = out if owned_writeable(out) else None

    def run(group):
        a, b = group
        qi, ki, vi = (x[a:b, ...] for x in flat)
        return _stream(xp, qi, ki, vi, phi_q, phi_k, (b - a,), alignment, chunk_size, block_size,
                       normalize, eps, None if out is None else out[a:b, ...])

    # BLAS keeps its threads: the block loop's GEMMs are all small-matrix ones (one
    # thread each, GEMM_ROWS), and holding OpenBLAS to one thread made the pooled call
    # slower (N = 65536, 8 heads, non-causal, two interleaved runs under load 6-7,
    # medians of 5: 909 and 748 ms wall, 470 and 584 ms CPU, against 673 and 513 ms
    # wall, 330 and 332 ms CPU without the limit; no pool 640 and 592 ms). Not
    # understood: the same small GEMMs alone on two threads cost the same either way.
    outs = parallel_map(run, row_groups(rows), pooled=True, one_blas_thread=False)
    if out is None:
        out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)
    return xp.reshape(out, batch + (nq, dv))


def linear_from_features(fq, fk, v, /, *, causal=False, order="linear", chunk_size=DEFAULT_CHUNK_SIZE,
                         block_size=DEFAULT_BLOCK_SIZE, normalize=True, eps=DEFAULT_EPS, xp=None):
    """Linear attention from precomputed features ``phi(Q)``, ``phi(K)``.

    The engine behind :func:`linear_attention` and :func:`attn_ref.performer_attention`.
    ``fq (..., Nq, d')`` should already carry the similarity scale. Options as in
    :func:`linear_attention`. Returns ``(..., Nq, dv)``.
    """
    xp = namespace(("fq", fq), ("fk", fk), ("v", v), xp=xp)
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(f"fq (..., Nq, d') and fk (..., Nk, d') must have the same d', got "
                         f"{tuple(fq.shape)} and {tuple(fk.shape)}")
    return _engine(xp, fq, fk, v, lambda x: x, lambda x: x, causal=causal, order=order,
                   chunk_size=chunk_size, block_size=block_size, normalize=normalize, eps=eps)


def linear_from_row_maps(q, k, v, phi_q, phi_k, /, *, causal=False, order="linear",
                         chunk_size=DEFAULT_CHUNK_SIZE, block_size=DEFAULT_BLOCK_SIZE, normalize=True,
                         eps=DEFAULT_EPS, xp=None):
    """Linear attention with features made block by block: ``phi_q(q)``, ``phi_k(k)``.

    The same function as ``linear_from_features(phi_q(q), phi_k(k), v, ...)``, but the
    maps are applied to ``block_size`` rows at a time inside the engine, so the
    features never exist for the whole sequence (for Performer's ``m = 256`` features,
    four times the size of ``q``). ``phi_q``, ``phi_k``: row-wise maps
    ``(..., B, d) -> (..., B, d')`` written in the array API, the scale already in
    ``phi_q``. Options as in :func:`linear_attention`. Returns ``(..., Nq, dv)``.

    The call stays on the calling thread (no heads pool): a map may hold arrays shaped
    like the whole batch (Performer's key stabiliser, one per head), which a group of
    heads could not broadcast against.
    """
    xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
    return _engine(xp, q, k, v, phi_q, phi_k, causal=causal, order=order, chunk_size=chunk_size,
                   block_size=block_size, normalize=normalize, eps=eps, threads=False)


def weights_from_features(fq, fk, /, *, causal=False, normalize=True, eps=DEFAULT_EPS, xp=None):
    """The ``(..., Nq, Nk)`` attention matrix implied by features ``phi(Q)``, ``phi(K)``."""
    xp = namespace(("fq", fq), ("fk", fk), xp=xp)
    alignment = causal_alignment(causal)
    normalize = check_flag("normalize", normalize)
    eps = check_eps(eps)
    a = _similarities(xp, fq, fk, alignment)
    if not normalize:
        return a
    return a / safe_denominator(xp, xp.sum(a, axis=-1, keepdims=True), eps)


# ---------------------------------------------------------------- public functions


def linear_attention(q, k, v, /, *, feature_map="elu+1", causal=False, order="linear",
                     chunk_size=DEFAULT_CHUNK_SIZE, block_size=DEFAULT_BLOCK_SIZE, scale=None,
                     normalize=True, eps=DEFAULT_EPS, xp=None):
    """Linear (kernelised) attention ``phi(Q) (phi(K)^T V) / phi(Q) sum_j phi(k_j)``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
        Leading (batch, head) dimensions broadcast.
    feature_map : {"elu+1", "relu", "identity"} or callable
        ``phi``; see the module docstring.
    causal : {False, True, "top-left", "bottom-right"}
        Query ``i`` sees keys ``j <= i`` (top-left) or ``j <= i + Nk - Nq``.
    order : {"linear", "quadratic"}
        ``"linear"`` (default) sums the keys into ``S = phi(K)^T V`` first; with
        ``causal`` it runs the chunked form. ``"quadratic"`` forms
        ``phi(Q) phi(K)^T`` (masked) and multiplies by ``V``. Same function.
    chunk_size : int
        Chunk length ``C`` of the causal linear order. ``N`` need not be a multiple
        of it; ``chunk_size=1`` is the naive prefix sum over positions.
    block_size : int
        Rows of ``q``, ``k``, ``v`` the linear order takes at a time (rounded up to
        whole chunks when causal): the feature maps and chunk states exist for one
        block, never for the whole sequence. Any value gives the same function (to
        rounding); the default keeps a block of 8 heads in cache.
    scale : float, optional
        Multiplies the similarity ``phi(q) . phi(k)``; default 1.
    normalize : bool
        Divide by the denominator (default). ``False`` returns the unnormalised
        ``scale * phi(Q) phi(K)^T V`` (masked).
    eps : float
        Denominators with ``|den| < eps`` are replaced by ``+-eps`` (module docstring).
    xp : namespace, optional

    Returns
    -------
    array, shape (..., Nq, dv)
        Queries with no visible key (``Nk == 0``, causal bottom-right with
        ``Nq > Nk``) give zeros; ``Nq == 0`` gives ``(..., 0, dv)``.

    Notes
    -----
    Linear order: ``O(N d' dv)`` time, ``O(B d' + d' dv)`` extra memory per head
    besides the output (non-causal); causal chunked ``O(N (C + d') dv)`` time and
    ``O(B C + (B / C) d' dv)`` extra memory, ``B`` the block size. Quadratic order: ``O(Nq Nk (d' + dv))``
    time, ``O(Nq Nk)`` memory. Katharopoulos et al., "Transformers are RNNs" (ICML 2020).

    On NumPy arrays a linear-order call with several heads and at least ``POOL_MIN_ROWS``
    rows (queries plus keys, all heads) runs groups of heads on a thread pool, one per
    CPU (its GEMMs are small enough for OpenBLAS's one-thread kernel, so BLAS is left
    as it is); the result is the unpooled call's, bit for bit. A callable
    ``feature_map`` keeps the call on the calling thread.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linear_attention
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (8, 5))
    >>> a = linear_attention(x, x, x, causal=True, chunk_size=3)
    >>> b = linear_attention(x, x, x, causal=True, order="quadratic")
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    xp, _ = check_qkv(q, k, v, xp=xp)
    scale = check_scale(scale)
    work = logit_dtype(xp, q.dtype)
    if work != q.dtype:
        # float16 sums overflow at 65504 already for moderate inputs: the features and
        # sums run in float32, and the output goes back to q's dtype.
        out = linear_attention(*(xp.astype(x, work) for x in (q, k, v)), feature_map=feature_map,
                               causal=causal, order=order, chunk_size=chunk_size,
                               block_size=block_size, scale=scale, normalize=normalize, eps=eps, xp=xp)
        return xp.astype(out, q.dtype)
    phi_q, phi_k = _feature_pair(xp, q, k, feature_map, scale)
    return _engine(xp, q, k, v, phi_q, phi_k, causal=causal, order=order, chunk_size=chunk_size,
                   block_size=block_size, normalize=normalize, eps=eps,
                   threads=isinstance(feature_map, str))


def linear_attention_weights(q, k, /, *, feature_map="elu+1", causal=False, scale=None, normalize=True,
                             eps=DEFAULT_EPS, order="linear", chunk_size=DEFAULT_CHUNK_SIZE,
                             block_size=DEFAULT_BLOCK_SIZE, xp=None):
    """The attention matrix linear attention implies: ``A_ij = sim(q_i, k_j) / den_i``.

    Parameters
    ----------
    q, k, feature_map, causal, scale, normalize, eps, xp
        As in :func:`linear_attention`.
    order, chunk_size, block_size
        Checked and otherwise ignored: every order implies the same matrix. Accepted
        so that one set of options serves :func:`linear_attention` and this function.

    Returns
    -------
    array, shape (..., Nq, Nk)
        ``linear_attention(q, k, v, ...) == weights @ v``. Normalised rows sum to 1
        when ``|den_i| >= eps``; rows with no visible key are zero. Entries are
        non-negative for non-negative feature maps.

    Notes
    -----
    ``O(Nq Nk d')`` time and ``O(Nq Nk)`` memory: for diagnostics, not for long inputs.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linear_attention_weights
    >>> x = xp.reshape(xp.cos(xp.arange(12.0)), (4, 3))
    >>> w = linear_attention_weights(x, x, causal=True)
    >>> float(xp.sum(w[2, :])), float(w[0, 1])
    (1.0, 0.0)
    """
    xp, _ = check_qkv(q, k, k, xp=xp)
    scale = check_scale(scale)
    check_order(order)
    check_positive_int("chunk_size", chunk_size)
    check_positive_int("block_size", block_size)
    fq, fk = features_qk(xp, q, k, feature_map)
    if scale != 1.0:
        fq = fq * scale
    return weights_from_features(fq, fk, causal=causal, normalize=normalize, eps=eps, xp=xp)


def linear_attention_state(k, v, /, *, feature_map="elu+1", xp=None):
    """The recurrent state ``(S, z) = (phi(K)^T V, sum_j phi(k_j))`` of a key/value prefix.

    Parameters
    ----------
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
        ``Nk == 0`` gives the empty (all-zero) state that decoding starts from:
        ``linear_attention_state(k[..., :0, :], v[..., :0, :])``.
    feature_map, xp
        As in :func:`linear_attention`.

    Returns
    -------
    s : array, shape (..., d', dv)
    z : array, shape (..., d')

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linear_attention_state
    >>> k = xp.ones((3, 4)); v = xp.ones((3, 2))
    >>> s, z = linear_attention_state(k[:0, :], v[:0, :])
    >>> s.shape, z.shape, float(xp.sum(s))
    ((4, 2), (4,), 0.0)
    """
    xp, _ = check_qkv(k, k, v, xp=xp)
    fk = feature_map_features(k, feature_map=feature_map, name="k", xp=xp)
    return kv_state(xp, fk, v)


def linear_attention_step(state, q, k, v, /, *, feature_map="elu+1", scale=None, normalize=True,
                          eps=DEFAULT_EPS, xp=None):
    """One step of causal linear attention as a recurrence ("transformers are RNNs").

    ``S' = S + phi(k) v^T``, ``z' = z + phi(k)``, ``o = phi(q)^T S' / phi(q)^T z'``:
    the new token sees itself and every token summarised in ``state``.

    Parameters
    ----------
    state : tuple ``(S, z)``
        ``S (..., d', dv)``, ``z (..., d')``, from :func:`linear_attention_state` or a
        previous step.
    q : array, shape (..., d)
    k : array, shape (..., d)
    v : array, shape (..., dv)
        One token (no sequence axis).
    feature_map, scale, normalize, eps, xp
        As in :func:`linear_attention`.

    Returns
    -------
    out : array, shape (..., dv)
    new_state : tuple ``(S', z')``

    Notes
    -----
    ``O(d' dv)`` time and memory per step. Running it over ``q, k, v`` from the empty
    state reproduces ``linear_attention(q, k, v, causal=True)`` to rounding.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linear_attention, linear_attention_state, linear_attention_step
    >>> x = xp.reshape(xp.sin(xp.arange(15.0)), (5, 3))
    >>> state = linear_attention_state(x[:0, :], x[:0, :])
    >>> outs = []
    >>> for t in range(5):
    ...     o, state = linear_attention_step(state, x[t, :], x[t, :], x[t, :])
    ...     outs.append(o)
    >>> ref = linear_attention(x, x, x, causal=True)
    >>> bool(xp.max(xp.abs(xp.stack(outs) - ref)) < 1e-14)
    True
    """
    if not (isinstance(state, (tuple, list)) and len(state) == 2):
        raise TypeError(f"state must be a pair (S, z), got {type(state).__name__}")
    s, z = state
    xp = namespace(("S", s), ("z", z), ("q", q), ("k", k), ("v", v), xp=xp)
    for name, x, want in (("q", q, "(..., d)"), ("k", k, "(..., d)"), ("v", v, "(..., dv)"),
                          ("S", s, "(..., d', dv)"), ("z", z, "(..., d')")):
        if x.ndim < (2 if name == "S" else 1):
            raise ValueError(f"{name} must have shape {want}, got shape {tuple(x.shape)}")
        if not is_floating(xp, x.dtype):
            raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    xp, _ = check_qkv(q[..., None, :], k[..., None, :], v[..., None, :], xp=xp)
    if s.dtype != q.dtype or z.dtype != q.dtype:
        raise TypeError(f"state must have the dtype of q ({q.dtype}), got S {s.dtype}, z {z.dtype}")
    scale = check_scale(scale)
    normalize = check_flag("normalize", normalize)
    eps = check_eps(eps)
    fq, fk = features_qk(xp, q[..., None, :], k[..., None, :], feature_map)
    m, dv = fk.shape[-1], v.shape[-1]
    if s.shape[-2:] != (m, dv) or z.shape[-1] != m:
        raise ValueError(
            f"state does not fit this token: need S (..., d', dv) = (..., {m}, {dv}) and "
            f"z (..., {m}), got S {tuple(s.shape)} and z {tuple(z.shape)}"
        )
    ds, dz = kv_state(xp, fk, v[..., None, :])
    s, z = s + ds, z + dz
    if scale != 1.0:
        fq = fq * scale
    num, den = state_readout(xp, fq, s, z)
    return readout(xp, num, den, normalize, eps)[..., 0, :], (s, z)


def _register():
    from .registry import Variant, register

    register(Variant(
        name="linear", fn=linear_attention, family="linear", exact=False, causal=True,
        vjp="attn_ref.grad.linear:linear_attention",
        time="O(N d^2)", memory="O(N d + B C + (B/C) d^2)", weights=linear_attention_weights,
        options={"feature_map": "elu+1", "order": "linear", "chunk_size": 8, "block_size": 16},
        summary="linear attention phi(Q)(phi(K)^T V), elu+1 features; causal chunked",
    ))


_register()
