"""Low-rank diagnostics of attention matrices.

The low-rank argument behind Linformer, Nystromformer and their relatives is a
statement about the singular values of the attention matrix ``P``: when they decay
fast, a rank-``k`` matrix is close to ``P``. This module measures that:

* :func:`singular_values`, :func:`normalized_cumulative_spectrum` (the curve of
  Wang et al. 2020, Fig. 1), :func:`effective_rank` (Roy & Vetterli 2007) and
  :func:`numerical_rank`;
* :func:`best_rank_k_error`: by the Eckart-Young(-Mirsky) theorem the smallest error
  any rank-``k`` matrix can reach, ``sigma_{k+1}`` in the spectral norm and
  ``sqrt(sum_{i>k} sigma_i^2)`` in the Frobenius norm, attained by
  :func:`best_rank_k_approximation`;
* :func:`approximation_error` of any approximation, and :func:`compare_variants`,
  which sets each registered variant's implied matrix beside the best rank-``k``
  error at the rank that matrix actually has (or at a given budget).

Everything is pure array API over ``xp.linalg`` (``svdvals``, ``svd``), so it runs
on every backend that has the linalg extension, on the device of its input, batched
over leading dimensions. Inputs have shape ``(..., M, N)``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import array_api_compat

from ._checks import check_nonnegative_int, check_qkv, is_floating, is_integer, namespace

__all__ = [
    "singular_values",
    "normalized_cumulative_spectrum",
    "effective_rank",
    "numerical_rank",
    "best_rank_k_approximation",
    "best_rank_k_error",
    "approximation_error",
    "VariantError",
    "compare_variants",
    "format_comparison",
]

_NORMS = ("fro", "spectral")


def _matrix(p, xp, name="p"):
    xp = namespace((name, p), xp=xp)
    if p.ndim < 2:
        raise ValueError(f"{name} must have shape (..., M, N) (rank >= 2), got shape {tuple(p.shape)}")
    if not is_floating(xp, p.dtype):
        raise TypeError(f"{name} must have a real floating dtype, got {p.dtype}")
    if not hasattr(xp, "linalg"):
        raise TypeError(
            f"the array namespace of {name} ({getattr(xp, '__name__', xp)}) has no linalg "
            "extension; the diagnostics need xp.linalg.svdvals"
        )
    return xp


def _check_norm(norm):
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")


def _svdvals(xp, p):
    if min(p.shape[-2], p.shape[-1]) == 0:
        return xp.zeros(tuple(p.shape[:-2]) + (0,), dtype=p.dtype, device=array_api_compat.device(p))
    return xp.linalg.svdvals(p)


def _safe_div(xp, a, b):
    """``a / b`` with ``0 / 0 = 0`` (the zero matrix has no spectrum to normalise)."""
    return xp.where(b > 0, a / xp.where(b > 0, b, xp.ones_like(b)), xp.zeros_like(a))


def singular_values(p, /, *, xp=None):
    """Singular values of ``p``, in descending order.

    Parameters
    ----------
    p : array, shape (..., M, N)
    xp : namespace, optional

    Returns
    -------
    array, shape (..., min(M, N))

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.diagnostics import singular_values
    >>> singular_values(xp.asarray([[3.0, 0.0], [0.0, -4.0]]))
    Array([4., 3.], dtype=array_api_strict.float64)
    """
    xp = _matrix(p, xp)
    return _svdvals(xp, p)


def normalized_cumulative_spectrum(p, /, *, power=1, xp=None):
    """``c_k = sum_{i<=k} sigma_i^power / sum_i sigma_i^power``, for ``k = 1..min(M, N)``.

    ``power=1`` is the "normalized cumulative singular value" curve of Linformer
    (Wang et al. 2020, Fig. 1); ``power=2`` is the captured energy, for which
    ``1 - c_k`` is the squared relative Frobenius error of the best rank-``k``
    approximation.

    Parameters
    ----------
    p : array, shape (..., M, N)
    power : {1, 2}
    xp : namespace, optional

    Returns
    -------
    array, shape (..., min(M, N))
        Non-decreasing, ending at 1; all zeros for the zero matrix.
    """
    xp = _matrix(p, xp)
    if not is_integer(power):
        raise TypeError(f"power must be 1 or 2, got {power!r} ({type(power).__name__})")
    if power not in (1, 2):
        raise ValueError(f"power must be 1 or 2, got {power!r}")
    s = _svdvals(xp, p)
    w = s if power == 1 else s * s
    if w.shape[-1] == 0:
        return w
    c = xp.cumulative_sum(w, axis=-1)
    return _safe_div(xp, c, c[..., -1:])


def effective_rank(p, /, *, xp=None):
    """Effective rank ``exp(H(sigma / ||sigma||_1))`` (Roy & Vetterli 2007).

    ``H`` is the Shannon entropy of the singular values normalised to sum to one
    (``0 log 0 = 0``). It lies between 1 and the rank: ``k`` equal singular values
    give exactly ``k``.

    Parameters
    ----------
    p : array, shape (..., M, N)
    xp : namespace, optional

    Returns
    -------
    array, shape (...)
        0 for the zero (or empty) matrix.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.diagnostics import effective_rank
    >>> round(float(effective_rank(xp.eye(3))), 12)
    3.0
    """
    xp = _matrix(p, xp)
    s = _svdvals(xp, p)
    total = xp.sum(s, axis=-1, keepdims=True)
    pk = _safe_div(xp, s, total)
    pos = pk > 0
    h = -xp.sum(xp.where(pos, pk * xp.log(xp.where(pos, pk, xp.ones_like(pk))), xp.zeros_like(pk)),
                axis=-1)
    return xp.where(total[..., 0] > 0, xp.exp(h), xp.zeros_like(h))


def numerical_rank(p, /, *, rtol=None, xp=None):
    """Number of singular values above ``rtol * sigma_max``.

    ``rtol`` defaults to ``max(M, N) * eps`` of the dtype, as ``numpy.linalg.matrix_rank``.

    Returns
    -------
    int array, shape (...)
    """
    xp = _matrix(p, xp)
    s = _svdvals(xp, p)
    if rtol is None:
        rtol = max(p.shape[-2], p.shape[-1]) * float(xp.finfo(p.dtype).eps)
    if s.shape[-1] == 0:
        return xp.zeros(tuple(s.shape[:-1]), dtype=xp.int64, device=array_api_compat.device(p))
    return xp.sum(xp.astype(s > rtol * s[..., :1], xp.int64), axis=-1)


def best_rank_k_approximation(p, /, k, *, xp=None):
    """The truncated SVD ``U_k diag(sigma_k) V_k^T``: a closest rank-``k`` matrix to ``p``.

    Closest in both the spectral and the Frobenius norm (Eckart-Young-Mirsky); unique
    when ``sigma_k > sigma_{k+1}``.

    Parameters
    ----------
    p : array, shape (..., M, N)
    k : int
        ``>= 0``; ``k >= min(M, N)`` returns ``p`` (up to rounding).
    xp : namespace, optional

    Returns
    -------
    array, shape (..., M, N)
    """
    xp = _matrix(p, xp)
    check_nonnegative_int("k", k)
    if k == 0 or min(p.shape[-2], p.shape[-1]) == 0:
        return xp.zeros_like(p)
    u, s, vh = xp.linalg.svd(p, full_matrices=False)
    k = min(k, s.shape[-1])
    return (u[..., :, :k] * s[..., None, :k]) @ vh[..., :k, :]


def best_rank_k_error(p, /, k, *, norm="fro", relative=False, xp=None):
    """The smallest error ``||p - X||`` over matrices ``X`` of rank at most ``k``.

    By Eckart-Young-Mirsky it is ``sigma_{k+1}`` in the spectral norm and
    ``sqrt(sum_{i>k} sigma_i^2)`` in the Frobenius norm (0 when ``k >= min(M, N)``).

    Parameters
    ----------
    p : array, shape (..., M, N)
    k : int
        Rank budget, ``>= 0``.
    norm : {"fro", "spectral"}
    relative : bool
        Divide by ``||p||`` in the same norm (0 for the zero matrix).
    xp : namespace, optional

    Returns
    -------
    array, shape (...)

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.diagnostics import best_rank_k_error
    >>> p = xp.asarray([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0]])
    >>> float(best_rank_k_error(p, 1, norm="spectral")), round(float(best_rank_k_error(p, 1) ** 2), 12)
    (2.0, 5.0)
    """
    xp = _matrix(p, xp)
    check_nonnegative_int("k", k)
    _check_norm(norm)
    s = _svdvals(xp, p)
    r = s.shape[-1]
    zero = xp.zeros(tuple(s.shape[:-1]), dtype=p.dtype, device=array_api_compat.device(p))
    if norm == "spectral":
        err = s[..., k] if k < r else zero
        full = s[..., 0] if r else zero
    else:
        tail = s[..., k:] if k < r else None
        err = xp.sqrt(xp.sum(tail * tail, axis=-1)) if tail is not None else zero
        full = xp.sqrt(xp.sum(s * s, axis=-1))
    return _safe_div(xp, err, full) if relative else err


def approximation_error(p, p_approx, /, *, norm="fro", relative=False, xp=None):
    """``||p - p_approx||`` in the Frobenius or spectral norm.

    Parameters
    ----------
    p, p_approx : array, shape (..., M, N)
        Same shape, same library.
    norm : {"fro", "spectral"}
    relative : bool
        Divide by ``||p||`` in the same norm (0 when ``p`` is zero).
    xp : namespace, optional

    Returns
    -------
    array, shape (...)
    """
    xp = namespace(("p", p), ("p_approx", p_approx), xp=xp)
    _matrix(p, xp)
    _matrix(p_approx, xp, "p_approx")
    _check_norm(norm)
    if tuple(p.shape) != tuple(p_approx.shape):
        raise ValueError(
            f"p_approx must have the shape of p, {tuple(p.shape)} = (..., M, N), "
            f"got {tuple(p_approx.shape)}"
        )
    if p_approx.dtype != p.dtype:
        raise TypeError(f"p and p_approx must share one dtype, got {p.dtype} and {p_approx.dtype}")
    diff = p - p_approx
    err, full = _norm(xp, diff, norm), _norm(xp, p, norm)
    return _safe_div(xp, err, full) if relative else err


def _norm(xp, a, norm):
    if norm == "fro":
        return xp.sqrt(xp.sum(a * a, axis=(-2, -1)))
    s = _svdvals(xp, a)
    if s.shape[-1] == 0:
        return xp.zeros(tuple(s.shape[:-1]), dtype=a.dtype, device=array_api_compat.device(a))
    return s[..., 0]


@dataclass(frozen=True)
class VariantError:
    """One row of :func:`compare_variants`.

    Attributes
    ----------
    name, family : str
        The registered variant.
    rank : int
        Numerical rank of the variant's implied matrix (largest over the batch).
    budget : int
        The rank ``k`` of the Eckart-Young column: ``rank`` unless a budget was given.
    error, relative_error : float
        ``||P - W||`` and ``||P - W|| / ||P||`` (mean over the batch) for the implied
        matrix ``W`` against exact softmax ``P``.
    best_error, relative_best_error : float
        The best any rank-``budget`` matrix can do (mean over the batch).
    """

    name: str
    family: str
    rank: int
    budget: int
    error: float
    relative_error: float
    best_error: float
    relative_best_error: float


def compare_variants(q, k, /, *, names=None, causal=False, rank=None, norm="fro", seed=0,
                     options=None, xp=None):
    """Each registered variant's implied attention matrix next to the Eckart-Young bound.

    For every variant with a ``weights`` function (see :mod:`attn_ref.registry`), its
    matrix ``W = weights(q, k, **params, **options)`` is compared with exact softmax
    ``P = attention_weights(q, k)``; the row also gives the smallest error any matrix
    of rank ``budget`` can reach, so a low-rank method can be judged against the
    bound it is trying to approach, and a sparse one seen for what it is (usually of
    high rank, close to ``P`` in other ways).

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    names : sequence of str, optional
        Variants to evaluate, default every registered variant that can take these
        inputs (variants without ``weights``, self-attention variants when
        ``Nq != Nk`` and, with ``causal``, variants without causal support are left
        out; naming one of them explicitly raises ``ValueError``).
    causal : bool
        Compare against causal softmax and pass ``causal=True`` to each variant.
    rank : int, optional
        One rank budget for every row; default each variant's own numerical rank.
    norm : {"fro", "spectral"}
    seed : int
        Seed of the variants' extra inputs (projections, random blocks, ...).
    options : dict of str to dict, optional
        Per-variant keyword overrides, e.g. ``{"linformer": {...}, "local": {"window": 8}}``.
    xp : namespace, optional

    Returns
    -------
    list of VariantError
        In registration order.
    """
    from .registry import get, variants
    from .softmax import attention_weights

    xp, _ = check_qkv(q, k, k, xp=xp)
    _matrix(q, xp, "q")
    _check_norm(norm)
    if rank is not None:
        check_nonnegative_int("rank", rank)
    options = dict(options or {})
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    device = array_api_compat.device(q)

    def usable(v):
        if v.weights is None:
            return "it has no weights function"
        if v.self_attention and nq != nk:
            return f"it is self-attention only and Nq={nq} != Nk={nk}"
        if causal and not v.causal:
            return "it does not support causal masking"
        return None

    if names is None:
        chosen = [v for v in variants() if usable(v) is None]
    else:
        chosen = [get(n) for n in names]
        for v in chosen:
            why = usable(v)
            if why is not None:
                raise ValueError(f"names: cannot compare variant {v.name!r}: {why}")
    unknown = sorted(set(options) - {v.name for v in chosen})
    if unknown:
        raise ValueError(f"options names variants that are not compared: {unknown}")

    p = attention_weights(q, k, causal=bool(causal), xp=xp)
    rows = []
    for v in chosen:
        extra = v.extra(seed, nq, nk, d, d, dtype=q.dtype, device=device, xp=xp)
        extra.update(options.get(v.name, {}))
        if causal:
            extra["causal"] = True
        w = v.weights(q, k, **_accepted(v.weights, extra))
        r = int(xp.max(numerical_rank(w, xp=xp))) if w.size else 0
        budget = r if rank is None else rank
        rows.append(VariantError(
            name=v.name, family=v.family, rank=r, budget=budget,
            error=_mean(xp, approximation_error(p, w, norm=norm, xp=xp)),
            relative_error=_mean(xp, approximation_error(p, w, norm=norm, relative=True, xp=xp)),
            best_error=_mean(xp, best_rank_k_error(p, budget, norm=norm, xp=xp)),
            relative_best_error=_mean(xp, best_rank_k_error(p, budget, norm=norm, relative=True, xp=xp)),
        ))
    return rows


def _accepted(fn, kwargs):
    """The keyword arguments ``fn`` takes: options of the efficient form that do not
    change the implied matrix (tile sizes, say) are dropped."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return {key: val for key, val in kwargs.items() if key in names}


def _mean(xp, a):
    return float(xp.mean(a)) if a.size else 0.0


def format_comparison(rows, /):
    """A Markdown table of :func:`compare_variants` rows, for the docs."""
    lines = [
        "| variant | family | rank | budget k | rel. error | best rank-k rel. error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.family} | {r.rank} | {r.budget} | {r.relative_error:.3e} "
            f"| {r.relative_best_error:.3e} |"
        )
    return "\n".join(lines)
