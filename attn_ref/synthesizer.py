"""Synthesizer attention (Tay et al. 2021): attention weights without query-key products.

The Synthesizer replaces the logits ``scale Q K^T`` by *synthetic* logits ``B`` of
shape ``(Nq, Nk)`` and keeps ``softmax(B) V``:

* **dense**: a two-layer MLP of each token alone, ``B_i = relu(x_i W1 + b1) W2 + b2``
  with ``W1 (d, h)``, ``b1 (h,)``, ``W2 (h, Nk)``, ``b2 (Nk,)`` - one logit per key
  position. The paper feeds the layer input ``X``; here the query rows ``q`` play ``X``
  (a model passes ``X`` itself, or its projection, as ``q``);
* **random**: a matrix ``R (Nq, Nk)`` that depends on no input (fixed or trained; its
  VJP gives ``dR``);
* **factorised random**: ``R = R1 R2^T`` of rank ``k`` (``r=R1, r2=R2``);
* **factorised dense**: two MLPs of sizes ``a`` and ``b`` with ``a b = Nk``, combined by
  :func:`factorized_dense_logits`, then :func:`synthesizer_attention`.

The mixture with dot-product attention mixes *logits*, before the softmax, as the
paper's "Mixture of Synthesizers" ``softmax(a_1 S_1(X) + a_2 S_2(X)) G(X)`` with
``a_1 + a_2 = 1`` does: ``softmax(alpha B + (1 - alpha) scale Q K^T) V``. ``alpha = 1``
(the default) is the synthesizer alone, ``alpha = 0`` softmax attention.
``docs/routing.md`` derives the forms and the VJPs.
"""

from __future__ import annotations

from ._checks import check_array, check_qkv, check_real, default_scale, is_floating, namespace
from .random import standard_normal
from .softmax import attention_weights, softmax_attention

__all__ = [
    "dense_synthesizer_logits",
    "factorized_dense_logits",
    "synthesizer_attention",
    "synthesizer_weights",
    "dense_synthesizer_attention",
    "dense_synthesizer_weights",
    "random_synthesizer_attention",
    "random_synthesizer_weights",
    "synthesizer_params",
    # Named steps that attn_ref.grad differentiates.
    "prepare_synthesizer",
    "check_dense_weights",
    "random_logits",
]


def _rows_namespace(x, xp):
    xp = namespace(("x", x), xp=xp)
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., N, d) (rank >= 2), got shape {tuple(x.shape)}")
    if not is_floating(xp, x.dtype):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    return xp


def check_dense_weights(xp, x, w1, b1, w2, b2, n_out=None, prefix=""):
    """``W1 (d, h)``, ``b1 (h,)``, ``W2 (h, n)``, ``b2 (n,)`` of ``x (..., N, d)``'s library and
    dtype (``n = n_out`` when given); returns ``n``."""
    for name, a in ((f"{prefix}w1", w1), (f"{prefix}b1", b1), (f"{prefix}w2", w2), (f"{prefix}b2", b2)):
        check_array(name, a, like=x, dtype=x.dtype)
    d = x.shape[-1]
    if w1.ndim != 2 or w1.shape[0] != d:
        raise ValueError(f"{prefix}w1 must have shape (d, h) with d={d}, got shape {tuple(w1.shape)}")
    h = w1.shape[1]
    if tuple(b1.shape) != (h,):
        raise ValueError(f"{prefix}b1 must have shape (h,) = ({h},), got shape {tuple(b1.shape)}")
    n = w2.shape[-1] if w2.ndim == 2 else None
    if w2.ndim != 2 or w2.shape[0] != h or (n_out is not None and n != n_out):
        want = f"(h, Nk) = ({h}, {n_out})" if n_out is not None else f"(h, n) with h={h}"
        raise ValueError(f"{prefix}w2 must have shape {want}, got shape {tuple(w2.shape)}")
    if tuple(b2.shape) != (n,):
        raise ValueError(f"{prefix}b2 must have shape (n,) = ({n},), got shape {tuple(b2.shape)}")
    return n


def dense_synthesizer_logits(x, w1, b1, w2, b2, /, *, xp=None):
    """The dense Synthesizer's logits ``B = relu(X W1 + b1) W2 + b2``: ``(..., N, n)``.

    Parameters
    ----------
    x : array, shape (..., N, d)
    w1 : array, shape (d, h)
    b1 : array, shape (h,)
    w2 : array, shape (h, n)
    b2 : array, shape (n,)

    Notes
    -----
    ``O(N d h + N h n)`` time. Each row depends on its own token only.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.synthesizer import dense_synthesizer_logits
    >>> x = xp.asarray([[1.0, -1.0]])
    >>> w1, b1 = xp.eye(2), xp.zeros(2)
    >>> dense_synthesizer_logits(x, w1, b1, xp.ones((2, 3)), xp.zeros(3))   # relu(x) = [1, 0]
    Array([[1., 1., 1.]], dtype=array_api_strict.float64)
    """
    xp = _rows_namespace(x, xp)
    check_dense_weights(xp, x, w1, b1, w2, b2)
    hidden = x @ w1 + b1
    return xp.maximum(hidden, xp.zeros_like(hidden)) @ w2 + b2


def factorized_dense_logits(x, a_weights, b_weights, /, *, xp=None):
    """Factorised dense Synthesizer logits: ``C_i[s b + t] = A_i[s] B_i[t]``, ``(..., N, a b)``.

    ``A = F_A(X)`` and ``B = F_B(X)`` are two dense MLPs (:func:`dense_synthesizer_logits`)
    of output sizes ``a`` and ``b``, with ``a b = Nk``; ``a_weights`` and ``b_weights``
    are their ``(W1, b1, W2, b2)``. The paper tiles ``A`` (each entry repeated ``b``
    times) and ``B`` (repeated ``a`` times) to length ``a b`` and multiplies: position
    ``p = s b + t`` gets ``A_s B_t``, the row-major flattening of the outer product
    ``A B^T``. The paper does not fix the order of the ``a b`` positions; another
    order is a permutation of the keys.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.synthesizer import factorized_dense_logits
    >>> x = xp.ones((1, 2))
    >>> a = (xp.eye(2), xp.zeros(2), xp.asarray([[1.0, 2.0], [0.0, 0.0]]), xp.zeros(2))
    >>> b = (xp.eye(2), xp.zeros(2), xp.asarray([[1.0, 10.0, 100.0], [0.0, 0.0, 0.0]]), xp.zeros(3))
    >>> factorized_dense_logits(x, a, b)
    Array([[  1.,  10., 100.,   2.,  20., 200.]], dtype=array_api_strict.float64)
    """
    xp = _rows_namespace(x, xp)
    fa = dense_synthesizer_logits(x, *a_weights, xp=xp)
    fb = dense_synthesizer_logits(x, *b_weights, xp=xp)
    outer = fa[..., :, None] * fb[..., None, :]
    return xp.reshape(outer, tuple(outer.shape[:-2]) + (fa.shape[-1] * fb.shape[-1],))


def prepare_synthesizer(q, k, v, logits_shape, alpha, causal, scale, xp):
    """Check ``q, k, v``, the logits' shape and ``alpha``: ``(xp, batch, alpha, scale)``.

    ``logits_shape`` is the shape of the synthetic logits, ``(..., Nq, Nk)``.
    """
    xp, batch = check_qkv(q, k, v, xp=xp)
    nq, nk = q.shape[-2], k.shape[-2]
    if len(logits_shape) < 2 or tuple(logits_shape[-2:]) != (nq, nk):
        raise ValueError(f"logits (the synthetic logits B) must have shape (..., Nq, Nk) = "
                         f"(..., {nq}, {nk}), got shape {tuple(logits_shape)}")
    alpha = check_real("alpha", alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (the weight of the synthetic logits), got {alpha!r}")
    return xp, batch, alpha, default_scale(q.shape[-1], scale)


def synthesizer_attention(q, k, v, /, *, logits, alpha=1.0, causal=False, scale=None, xp=None):
    """``softmax(alpha B + (1 - alpha) scale Q K^T) V`` for given synthetic logits ``B``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    logits : array, shape (..., Nq, Nk)
        The synthetic logits ``B`` (broadcast against the batch).
    alpha : float
        Weight of ``B`` in ``[0, 1]``; ``1 - alpha`` weighs the dot-product logits.
    causal : {False, True, "top-left", "bottom-right"}
        Masks key positions after the query, as for softmax attention.
    scale : float, optional
        Scale of the dot-product logits, default ``1/sqrt(d)``; unused when ``alpha = 1``.

    Returns
    -------
    array, shape (..., Nq, dv)

    Notes
    -----
    ``O(Nq Nk dv)`` time (``O(Nq Nk (d + dv))`` mixed), ``O(Nq Nk)`` memory: the
    logits are ``(Nq, Nk)`` by construction. Computed as softmax attention with the
    additive bias ``alpha B`` and logit scale ``(1 - alpha) scale``, the same function.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.synthesizer import synthesizer_attention
    >>> v = xp.asarray([[1.0], [2.0]])
    >>> b = xp.asarray([[0.0, -xp.inf], [0.0, 0.0]])   # row 0 sees key 0 only
    >>> synthesizer_attention(v, v, v, logits=b)
    Array([[1. ],
           [1.5]], dtype=array_api_strict.float64)
    """
    check_array("logits", logits, like=q, dtype=q.dtype)
    xp, _, alpha, scale = prepare_synthesizer(q, k, v, logits.shape, alpha, causal, scale, xp)
    return softmax_attention(q, k, v, bias=alpha * logits, scale=(1.0 - alpha) * scale, causal=causal,
                             xp=xp)


def synthesizer_weights(q, k, /, *, logits, alpha=1.0, causal=False, scale=None, xp=None):
    """The ``(..., Nq, Nk)`` weights ``softmax(alpha B + (1 - alpha) scale Q K^T)`` (masked)."""
    check_array("logits", logits, like=q, dtype=q.dtype)
    xp, _, alpha, scale = prepare_synthesizer(q, k, k, logits.shape, alpha, causal, scale, xp)
    return attention_weights(q, k, bias=alpha * logits, scale=(1.0 - alpha) * scale, causal=causal,
                             xp=xp)


def dense_synthesizer_attention(q, k, v, /, *, w1, b1, w2, b2, alpha=1.0, causal=False, scale=None,
                                xp=None):
    """Dense Synthesizer: ``softmax(alpha B + (1 - alpha) scale Q K^T) V`` with
    ``B = relu(Q W1 + b1) W2 + b2``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
        The token rows ``X`` of the paper (and the dot-product queries when ``alpha < 1``).
    k : array, shape (..., Nk, d)
        Used only by the dot-product part (``alpha < 1``).
    v : array, shape (..., Nk, dv)
    w1, b1, w2, b2 : arrays, shapes (d, h), (h,), (h, Nk), (Nk,)
    alpha, causal, scale
        As in :func:`synthesizer_attention`.

    Returns
    -------
    array, shape (..., Nq, dv)

    Notes
    -----
    ``O(Nq d h + Nq h Nk + Nq Nk dv)`` time, ``O(Nq Nk)`` memory. ``W2`` has one column
    per key position, so the layer is tied to the length ``Nk``. Tay, Bahri, Metzler,
    Juan, Zhao and Zheng, *Synthesizer: Rethinking Self-Attention for Transformer
    Models*, ICML 2021.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.synthesizer import dense_synthesizer_attention, synthesizer_params
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (8, 3))
    >>> p = synthesizer_params(8, 8, 3, kind="dense", seed=0, xp=xp)
    >>> dense_synthesizer_attention(x, x, x, **p).shape
    (8, 3)
    """
    xp = check_qkv(q, k, v, xp=xp)[0]
    check_dense_weights(xp, q, w1, b1, w2, b2, n_out=k.shape[-2])
    b = dense_synthesizer_logits(q, w1, b1, w2, b2, xp=xp)
    return synthesizer_attention(q, k, v, logits=b, alpha=alpha, causal=causal, scale=scale, xp=xp)


def dense_synthesizer_weights(q, k, /, *, w1, b1, w2, b2, alpha=1.0, causal=False, scale=None, xp=None):
    """The implied ``(..., Nq, Nk)`` matrix of :func:`dense_synthesizer_attention`."""
    xp = check_qkv(q, k, k, xp=xp)[0]
    check_dense_weights(xp, q, w1, b1, w2, b2, n_out=k.shape[-2])
    b = dense_synthesizer_logits(q, w1, b1, w2, b2, xp=xp)
    return synthesizer_weights(q, k, logits=b, alpha=alpha, causal=causal, scale=scale, xp=xp)


def random_logits(xp, q, k, r, r2):
    """``R``, or ``R1 R2^T`` when ``r2`` is given, checked against ``q (..., Nq, d)`` and
    ``k (..., Nk, d)``."""
    nq, nk = q.shape[-2], k.shape[-2]
    check_array("r", r, like=q, dtype=q.dtype)
    if r2 is None:
        if r.ndim < 2 or tuple(r.shape[-2:]) != (nq, nk):
            raise ValueError(f"r must have shape (..., Nq, Nk) = (..., {nq}, {nk}), got shape "
                             f"{tuple(r.shape)}")
        return r
    check_array("r2", r2, like=q, dtype=q.dtype)
    if r.ndim < 2 or r.shape[-2] != nq or r2.ndim < 2 or r2.shape[-2] != nk or r.shape[-1] != r2.shape[-1]:
        raise ValueError(f"factorised: r must have shape (..., Nq, k) and r2 (..., Nk, k) with "
                         f"Nq={nq}, Nk={nk} and one rank k, got r {tuple(r.shape)} and r2 "
                         f"{tuple(r2.shape)}")
    return r @ xp.matrix_transpose(r2)


def random_synthesizer_attention(q, k, v, /, *, r, r2=None, alpha=1.0, causal=False, scale=None,
                                 xp=None):
    """Random Synthesizer: ``softmax(alpha R + (1 - alpha) scale Q K^T) V``.

    Parameters
    ----------
    q, k : arrays, shapes (..., Nq, d), (..., Nk, d)
        Used only by the dot-product part (``alpha < 1``).
    v : array, shape (..., Nk, dv)
    r : array, shape (..., Nq, Nk), or (..., Nq, k) with ``r2``
        The random (fixed or trained) logits ``R``; with ``r2``, the factor ``R1``.
    r2 : array, shape (..., Nk, k), optional
        Factorised random Synthesizer: ``R = R1 R2^T`` (the paper takes ``k = 8``).
    alpha, causal, scale
        As in :func:`synthesizer_attention`.

    Returns
    -------
    array, shape (..., Nq, dv)
        With ``alpha = 1`` the output depends on ``v`` (and ``R``) only.

    Notes
    -----
    ``O(Nq Nk dv)`` time (``+ O(Nq Nk k)`` factorised), ``O(Nq Nk)`` memory.
    ``R = scale Q K^T`` recovers softmax attention: the random Synthesizer is softmax
    attention whose logits are free parameters.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.synthesizer import random_synthesizer_attention
    >>> from attn_ref import softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (8, 3))
    >>> r = (x @ x.mT) / 3 ** 0.5
    >>> a = random_synthesizer_attention(x, x, x, r=r)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x))) < 1e-14)
    True
    """
    xp = check_qkv(q, k, v, xp=xp)[0]
    logits = random_logits(xp, q, k, r, r2)
    return synthesizer_attention(q, k, v, logits=logits, alpha=alpha, causal=causal, scale=scale, xp=xp)


def random_synthesizer_weights(q, k, /, *, r, r2=None, alpha=1.0, causal=False, scale=None, xp=None):
    """The implied ``(..., Nq, Nk)`` matrix of :func:`random_synthesizer_attention`."""
    xp = check_qkv(q, k, k, xp=xp)[0]
    logits = random_logits(xp, q, k, r, r2)
    return synthesizer_weights(q, k, logits=logits, alpha=alpha, causal=causal, scale=scale, xp=xp)


def synthesizer_params(nq, nk, d, /, *, kind, hidden=None, rank=None, seed, dtype=None, device=None,
                       xp):
    """Seeded Synthesizer parameters: ``{"w1", "b1", "w2", "b2"}`` (``kind="dense"``) or
    ``{"r"}`` (``"random"``; ``{"r", "r2"}`` with ``rank``).

    Gaussian, scaled so the logits are of order one: ``W1 ~ N(0, 1/d)`` with ``h = d``
    hidden units by default (the paper's ``W1`` is ``d x d``), ``W2 ~ N(0, 1/h)``,
    biases ``N(0, 0.1^2)``; ``R ~ N(0, 1)``, factors ``N(0, 1/k)``.
    """
    if kind == "dense":
        h = d if hidden is None else hidden
        shapes = {"w1": ((d, h), d), "b1": ((h,), 100.0), "w2": ((h, nk), h), "b2": ((nk,), 100.0)}
    elif kind == "random":
        shapes = {"r": ((nq, nk), 1.0)} if rank is None else {"r": ((nq, rank), rank),
                                                              "r2": ((nk, rank), rank)}
    else:
        raise ValueError(f"kind must be 'dense' or 'random', got {kind!r}")
    out = {}
    for i, (name, (shape, var)) in enumerate(shapes.items()):
        out[name] = standard_normal(shape, seed=seed + i, dtype=dtype, device=device, xp=xp) / var ** 0.5
    return out


# ----------------------------------------------------------------------- registration

def _dense(seed, nq, nk, d, dv, *, dtype, device, xp):
    return synthesizer_params(nq, nk, d, kind="dense", seed=seed, dtype=dtype, device=device, xp=xp)


def _random(seed, nq, nk, d, dv, *, dtype, device, xp):
    return synthesizer_params(nq, nk, d, kind="random", seed=seed, dtype=dtype, device=device, xp=xp)


def _register():
    from .registry import Variant, register

    register(Variant(
        name="synthesizer_dense", fn=dense_synthesizer_attention, family="synthesizer", exact=False,
        causal=True, vjp="attn_ref.grad.synthesizer:dense_synthesizer_attention",
        time="O(N^2 h + N^2 d)", memory="O(N^2)", params=_dense, weights=dense_synthesizer_weights,
        summary="dense Synthesizer: logits relu(q W1 + b1) W2 + b2 from each query alone, h = d",
    ))
    register(Variant(
        name="synthesizer_random", fn=random_synthesizer_attention, family="synthesizer", exact=False,
        causal=True, vjp="attn_ref.grad.synthesizer:random_synthesizer_attention",
        time="O(N^2 dv)", memory="O(N^2)", params=_random, weights=random_synthesizer_weights,
        summary="random Synthesizer: a fixed seeded N x N logit matrix R, no query or key",
    ))
    register(Variant(
        name="synthesizer_random_mix", fn=random_synthesizer_attention, family="synthesizer",
        exact=False, causal=True, vjp="attn_ref.grad.synthesizer:random_synthesizer_attention",
        time="O(N^2 (d + dv))", memory="O(N^2)", params=_random, weights=random_synthesizer_weights,
        options={"alpha": 0.25},
        summary="Random + Vanilla Synthesizer: softmax(R / 4 + 3/4 scale q k^T), logits mixed",
    ))


_register()
