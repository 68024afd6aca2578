"""Gradients of Linformer attention, including the projections.

``out = softmax(scale Q (E K)^T) (F V)`` is softmax attention on projected keys and
values, so its VJP is the softmax VJP (:func:`attn_ref.grad.softmax_attention`) on
``(Q, EK, FV)`` followed by the matrix-product VJPs of the projections:
``dK = E^T dKc``, ``dE = dKc K^T``, ``dV = F^T dVc``, ``dF = dVc V^T`` (summed over the
batch and, for a shared ``(r, Nk)`` projection, over the heads). With key-value
sharing (``f_proj=None``, ``F = E``) both terms land in ``dE``.
"""

from __future__ import annotations

from ..lowrank import prepare_linformer, project
from ._common import matmul_vjp, unbroadcast
from .softmax import softmax_attention

__all__ = ["linformer_attention"]


def linformer_attention(q, k, v, do, /, *, e_proj, f_proj=None, scale=None, mask=None, causal=False,
                        xp=None):
    """VJP of :func:`attn_ref.linformer_attention`.

    Parameters
    ----------
    q, k, v, e_proj, f_proj, scale, mask, causal, xp
        As in :func:`attn_ref.linformer_attention` (``mask`` and ``causal`` are refused
        the same way).
    do : array, shape (..., Nq, dv)
        Cotangent of the output.

    Returns
    -------
    dict
        ``{"q", "k", "v", "e_proj"}`` plus ``"f_proj"`` when it was given; each shaped
        like its input.

    Notes
    -----
    Same cost as the forward, ``O(r Nk (d + dv) + Nq r (d + dv))``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> eye = xp.eye(6, dtype=xp.float64)
    >>> a = grad.linformer_attention(x, x, x, x, e_proj=eye)
    >>> b = grad.softmax_attention(x, x, x, x)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    shared = f_proj is None
    xp, e_proj, f_proj, scale = prepare_linformer(q, k, v, e_proj, f_proj, mask, causal, scale, xp,
                                                  "linformer_attention")
    kc, vc = project(e_proj, k), project(f_proj, v)
    g = softmax_attention(q, kc, vc, do, scale=scale, xp=xp)
    # g["k"], g["v"] are reduced to the shapes of kc, vc: the broadcast of the projection's
    # heads and the inputs' batch, which is what the projection VJPs need.
    de, dk = matmul_vjp(xp, e_proj, k, g["k"])
    df, dv = matmul_vjp(xp, f_proj, v, g["v"])
    out = {"q": g["q"], "k": dk, "v": dv}
    if shared:
        out["e_proj"] = de + df
    else:
        out["e_proj"], out["f_proj"] = de, df
    return {n: unbroadcast(xp, x, s) for n, x, s in
            ((n, x, _shape(n, q, k, v, e_proj, f_proj)) for n, x in out.items())}


def _shape(name, q, k, v, e_proj, f_proj):
    return {"q": q, "k": k, "v": v, "e_proj": e_proj, "f_proj": f_proj}[name].shape
