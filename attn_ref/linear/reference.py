"""Linear attention's defining forms: the quadratic order and the recurrence.

The quadratic order, "interact then sum": ``A = phi(Q) phi(K)^T`` (masked when causal),
then ``A V`` and the row sums of ``A`` (:func:`quadratic_order`); the attention matrix
it implies (:func:`linear_attention_weights`); and the recurrent form that decodes one
token at a time from the summary ``(S, z) = (phi(K)^T V, sum_j phi(k_j))``
(:func:`linear_attention_state`, :func:`linear_attention_step`). The normalisation
rule (:func:`safe_denominator`) is shared by every form. Read this module first; the
fast forms are in :mod:`attn_ref.linear.engine`.
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_flag, check_positive_int, check_qkv, is_floating, namespace
from .._common import causal_alignment, causal_offset
from .options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_EPS,
    check_eps,
    check_order,
    check_scale,
    feature_map_features,
    features_qk,
)

__all__ = [
    "safe_denominator",
    "readout",
    "causal_visible",
    "zero_keyless_rows",
    "similarities",
    "hide",
    "quadratic_order",
    "kv_state",
    "state_readout",
    "weights_from_features",
    "linear_attention_weights",
    "linear_attention_state",
    "linear_attention_step",
]


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


def zero_keyless_rows(xp, x, alignment, nk):
    """``x (..., Nq, dv)`` with exact zeros, selected, on the queries that the causal
    ``alignment`` (None: none) leaves without a key among ``nk``.

    Their output is ``0 / eps = 0`` already; selected, it does not depend on that
    division, whose ``1 / eps`` times ``V`` overflows at Performer's ``eps`` (the
    dtype's smallest normal number) before the causal mask's zero meets it. Applied to
    the output (torch and JAX autograd) and to its cotangent (the VJP), it keeps their
    gradients finite: attn_ref's causal Performer had NaN ``dq`` and ``dk`` under torch
    autograd, and its VJP a non-finite ``dq`` in float64, on every bottom-right case with
    more queries than keys. ``O(Nq dv)``."""
    nq = x.shape[-2]
    off = 0 if alignment is None else causal_offset(alignment, nq, nk)
    if off >= 0:
        return x
    dev = array_api_compat.device(x)
    keyless = (xp.arange(nq, device=dev) + off < 0)[:, None]
    return xp.where(keyless, xp.zeros((), dtype=x.dtype, device=dev), x)


def similarities(xp, fq, fk, alignment):
    """``A = phi(Q) phi(K)^T``, zero where the causal ``alignment`` (None: none) hides a key."""
    return hide(xp, fq @ xp.matrix_transpose(fk), alignment)


def hide(xp, a, alignment):
    """``a (..., Nq, Nk)`` with zeros where the causal ``alignment`` (None: none) hides a key.

    ``where``, not a product with the mask: a non-finite value at a hidden position must
    not reach the output (``inf * 0`` is NaN)."""
    if alignment is None:
        return a
    vis = causal_visible(xp, a.shape[-2], a.shape[-1], alignment, array_api_compat.device(a))
    return xp.where(vis, a, xp.zeros((), dtype=a.dtype, device=array_api_compat.device(a)))



def quadratic_order(xp, fq, fk, v, alignment):
    """Interact then sum: ``A = phi(Q) phi(K)^T`` (masked), ``(A V, rowsum A)``."""
    a = similarities(xp, fq, fk, alignment)
    return a @ v, xp.sum(a, axis=-1, keepdims=True)


def kv_state(xp, fk, v):
    """The context summary of a set of keys: ``(S, z) = (phi(K)^T V, sum_j phi(k_j))``."""
    return xp.matrix_transpose(fk) @ v, xp.sum(fk, axis=-2)


def state_readout(xp, fq, s, z):
    """Numerator ``phi(Q) S`` and denominator ``phi(Q) z`` of a summary ``(S, z)``."""
    return fq @ s, fq @ z[..., :, None]



def weights_from_features(fq, fk, /, *, causal=False, normalize=True, eps=DEFAULT_EPS, xp=None):
    """The ``(..., Nq, Nk)`` attention matrix implied by features ``phi(Q)``, ``phi(K)``."""
    xp = namespace(("fq", fq), ("fk", fk), xp=xp)
    alignment = causal_alignment(causal)
    normalize = check_flag("normalize", normalize)
    eps = check_eps(eps)
    a = similarities(xp, fq, fk, alignment)
    if not normalize:
        return a
    return a / safe_denominator(xp, xp.sum(a, axis=-1, keepdims=True), eps)



# ---------------------------------------------------------------- public functions


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

