"""The efficient sparse forms, which never build an ``(N, N)`` array, and the
``*_weights`` functions that give each pattern's attention matrix by the defining form.
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_qkv
from .._common import causal_alignment
from ..softmax import attention_weights
from .masks import bigbird_mask, fixed_mask, layout_mask, local_mask, longformer_mask, strided_mask
from .plans import (
    attend_plan,
    bigbird_plan,
    block_sparse_plan,
    fixed_plan,
    local_plan,
    longformer_plan,
    strided_plan,
)

__all__ = [
    "block_sparse_attention",
    "local_attention",
    "longformer_attention",
    "bigbird_attention",
    "strided_attention",
    "fixed_attention",
    "block_sparse_weights",
    "local_weights",
    "longformer_weights",
    "bigbird_weights",
    "strided_weights",
    "fixed_weights",
]


# ---------------------------------------------------------------- efficient forms


def block_sparse_attention(q, k, v, /, *, layout, block_size, causal=False, scale=None, xp=None):
    """Softmax attention restricted to the active blocks of a block layout.

    Equal to ``softmax_attention(q, k, v, mask=layout_mask(layout, block_size), ...)``,
    but only active blocks are gathered and multiplied.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    layout : nested sequences of bool or bool array, shape (ceil(Nq/B), ceil(Nk/B))
        Host-side structure (see :mod:`attn_ref.sparse`); static under ``jax.jit``.
    block_size : int
        ``B >= 1``; ``Nq`` and ``Nk`` need not be multiples of it.
    causal : {False, True, "top-left", "bottom-right"}
        Also applied element-wise, as in :func:`attn_ref.softmax.softmax_attention`.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    xp : namespace, optional

    Returns
    -------
    array, shape (..., Nq, dv)

    Notes
    -----
    ``O(nnz(layout) B^2 (d + dv))`` time and ``O(nnz(layout) B^2)`` memory for the
    logits (times the batch), ``nnz`` being the number of active blocks. A full layout
    is ordinary softmax attention; a banded layout of ``c`` blocks per row is
    ``O(N c B d)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> from attn_ref.sparse import block_sparse_attention, layout_mask
    >>> x = xp.reshape(xp.sin(xp.arange(35.0)), (7, 5))
    >>> lay = ((True, False), (True, True))
    >>> a = block_sparse_attention(x, x, x, layout=lay, block_size=4)
    >>> b = softmax_attention(x, x, x, mask=layout_mask(lay, 4, nq=7, nk=7, xp=xp))
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    plan = block_sparse_plan(q, k, v, layout=layout, block_size=block_size, causal=causal,
                             scale=scale, xp=xp)
    return attend_plan(plan, q, k, v)


def local_attention(q, k, v, /, *, window, causal=False, dilation=1, block_size=None, scale=None,
                    xp=None):
    """Sliding-window (local) attention in ``O(N w d)`` time and memory.

    Equal to ``softmax_attention(q, k, v, mask=local_mask(N, window=window,
    one_sided=causal, dilation=dilation))``: query ``i`` attends the ``window``
    positions on each side (only the past with ``causal``), at gaps of ``dilation``.
    Used by Image Transformer, Longformer, Mistral; ``window >= N - 1`` is full
    attention.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
        Self-attention: ``q`` and ``k`` have the same length.
    window : int
        Keys per side, ``>= 0``.
    causal : {False, True, "top-left", "bottom-right"}
        Any causal value gives the one-sided window (the alignments agree for
        ``Nq == Nk``).
    dilation : int
        ``>= 1``.
    block_size : int, optional
        Tile size, default ``window * dilation // 2`` (at least 1, at most ``N``).
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    With the default ``B = r / 2`` (``r = window * dilation``) every query block
    gathers 5 key blocks (3 when causal), about ``2.5 r`` keys per query:
    ``O(N r (d + dv))`` time, ``O(N r)`` logits memory, never an ``(N, N)`` array.
    Dilation keeps the reach ``r`` and so costs ``dilation`` times the keys actually
    attended.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> from attn_ref.sparse import local_attention, local_mask
    >>> x = xp.reshape(xp.cos(xp.arange(40.0)), (10, 4))
    >>> a = local_attention(x, x, x, window=2, causal=True)
    >>> b = softmax_attention(x, x, x, mask=local_mask(10, window=2, one_sided=True, xp=xp))
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    plan = local_plan(q, k, v, window=window, causal=causal, dilation=dilation, block_size=block_size,
                      scale=scale, xp=xp)
    return attend_plan(plan, q, k, v)


def longformer_attention(q, k, v, /, *, window, global_tokens, causal=False, dilation=1,
                         block_size=None, scale=None, xp=None):
    """Longformer attention (Beltagy et al. 2020): a sliding window plus global tokens.

    Equal to dense masked softmax with :func:`longformer_mask` (and the causal mask
    when ``causal``). Global tokens attend every position and every position attends
    them (symmetric); the paper's separate projections for global attention are the
    caller's business (pass different ``q``/``k``).

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    window : int
        Keys per side of the sliding window.
    global_tokens : sequence of int
        Positions in ``[0, N)``.
    causal : {False, True, "top-left", "bottom-right"}
        Intersects the pattern with the causal mask (global tokens then see only
        their past); Longformer itself is bidirectional.
    dilation, block_size, scale, xp
        As in :func:`local_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    Query blocks holding a global token gather every key block; the others gather
    their window and see the global tokens as columns, one product of all queries with
    the ``g`` global keys: ``O(N (w + g B) d)`` time for ``g`` global tokens in blocks of
    ``B``. Gathered into every query block instead, a global key's ``dK`` and ``dV``
    would be summed back over the ``N / B`` blocks, and under torch's autograd in the
    dtype (bfloat16, ``B = 1``: 1000 roundings) it erred 7 %.
    """
    plan = longformer_plan(q, k, v, window=window, global_tokens=global_tokens, causal=causal,
                           dilation=dilation, block_size=block_size, scale=scale, xp=xp)
    return attend_plan(plan, q, k, v)


def bigbird_attention(q, k, v, /, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0,
                      last_global_blocks=0, causal=False, scale=None, xp=None):
    """BigBird attention (Zaheer et al. 2020): sliding, global and random blocks.

    Block-sparse attention with :func:`bigbird_layout`; equal to dense masked softmax
    with :func:`bigbird_mask`.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    block_size : int
        ``B >= 1``; ``N`` need not be a multiple.
    window, global_blocks, random_blocks, seed, last_global_blocks
        As in :func:`bigbird_layout` (counted in blocks); ``last_global_blocks=1`` with
        ``global_blocks=1`` is HuggingFace's and google-research's layout (global blocks
        first and last).
    causal : {False, True, "top-left", "bottom-right"}
        Intersects the pattern with the causal mask.
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    ``O(N B (2 window + 1 + g + random_blocks) d)`` time for the ordinary rows plus
    ``O(g B N d)`` for the global rows, ``g = global_blocks + last_global_blocks``. The
    ordinary rows see the global blocks as columns, one product of all their queries
    with those ``g B`` keys, not a gather into every query block, whose backward would
    sum their ``dK``, ``dV`` over the blocks (as :func:`longformer_attention`'s).
    """
    plan = bigbird_plan(q, k, v, block_size=block_size, window=window, global_blocks=global_blocks,
                        random_blocks=random_blocks, seed=seed, last_global_blocks=last_global_blocks,
                        causal=causal, scale=scale, xp=xp)
    return attend_plan(plan, q, k, v)


def strided_attention(q, k, v, /, *, stride, causal=True, scale=None, xp=None):
    """Strided Sparse Transformer attention (Child et al. 2019), one head over both parts.

    Equal to dense masked softmax with :func:`strided_mask` (``part="both"``). The
    local part is :func:`local_attention` with window ``stride``; the strided part
    attends within each residue class ``{r, r + l, r + 2l, ...}`` (offsets of two or
    more strides; one stride is already local), and the two softmax partials are
    merged exactly.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    stride : int
        ``l >= 1``.
    causal : bool or {"top-left", "bottom-right"}
        The paper's autoregressive pattern (default); False looks both ways.
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    ``O(N (l + N/l) d)`` time and ``O(N l + N^2/l)`` memory: ``O(N sqrt(N) d)`` at
    ``l = sqrt(N)``.
    """
    return attend_plan(strided_plan(q, k, v, stride=stride, causal=causal, scale=scale, xp=xp), q, k, v)


def fixed_attention(q, k, v, /, *, stride, summary=1, causal=True, scale=None, xp=None):
    """Fixed Sparse Transformer attention (Child et al. 2019), one head over both parts.

    Equal to dense masked softmax with :func:`fixed_mask` (``part="both"``): each
    query attends its own block of ``stride`` positions and the last ``summary``
    positions of every other block; the two softmax partials are merged exactly.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    stride : int
        Block length ``l >= 1``.
    summary : int
        ``1 <= c <= l`` summary positions per block.
    causal : bool or {"top-left", "bottom-right"}
        The paper's autoregressive pattern (default).
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    ``O(N (l + c N / l) d)`` time and ``O(N (l + c N / l))`` memory.
    """
    plan = fixed_plan(q, k, v, stride=stride, summary=summary, causal=causal, scale=scale, xp=xp)
    return attend_plan(plan, q, k, v)


# ---------------------------------------------------------------- implied matrices


def _weights(q, k, mask, causal, scale, xp):
    return attention_weights(q, k, mask=mask, causal=causal, scale=scale, xp=xp)


def _ns_device(q, k, xp):
    xp, _ = check_qkv(q, k, k, xp=xp)
    return xp, array_api_compat.device(q)


def block_sparse_weights(q, k, /, *, layout, block_size, causal=False, scale=None, xp=None):
    """The attention matrix implied by :func:`block_sparse_attention`, ``(..., Nq, Nk)``."""
    xp, device = _ns_device(q, k, xp)
    mask = layout_mask(layout, block_size, nq=q.shape[-2], nk=k.shape[-2], xp=xp, device=device)
    return _weights(q, k, mask, causal, scale, xp)


def local_weights(q, k, /, *, window, causal=False, dilation=1, block_size=None, scale=None,
                  xp=None):
    """The attention matrix implied by :func:`local_attention`, ``(..., N, N)``.

    ``block_size`` is accepted (and ignored) so the options of the efficient form
    can be passed unchanged.
    """
    xp, device = _ns_device(q, k, xp)
    one_sided = causal_alignment(causal) is not None
    mask = local_mask(q.shape[-2], window=window, one_sided=one_sided, dilation=dilation, xp=xp,
                      device=device)
    return _weights(q, k, mask, False, scale, xp)


def longformer_weights(q, k, /, *, window, global_tokens, causal=False, dilation=1, block_size=None,
                       scale=None, xp=None):
    """The attention matrix implied by :func:`longformer_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = longformer_mask(q.shape[-2], window=window, global_tokens=global_tokens,
                           dilation=dilation, xp=xp, device=device)
    return _weights(q, k, mask, causal, scale, xp)


def bigbird_weights(q, k, /, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0,
                    last_global_blocks=0, causal=False, scale=None, xp=None):
    """The attention matrix implied by :func:`bigbird_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = bigbird_mask(q.shape[-2], block_size=block_size, window=window,
                        global_blocks=global_blocks, random_blocks=random_blocks, seed=seed, xp=xp,
                        device=device, last_global_blocks=last_global_blocks)
    return _weights(q, k, mask, causal, scale, xp)


def strided_weights(q, k, /, *, stride, causal=True, scale=None, xp=None):
    """The attention matrix implied by :func:`strided_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = strided_mask(q.shape[-2], stride=stride, causal=causal_alignment(causal) is not None,
                        xp=xp, device=device)
    return _weights(q, k, mask, False, scale, xp)


def fixed_weights(q, k, /, *, stride, summary=1, causal=True, scale=None, xp=None):
    """The attention matrix implied by :func:`fixed_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = fixed_mask(q.shape[-2], stride=stride, summary=summary,
                      causal=causal_alignment(causal) is not None, xp=xp, device=device)
    return _weights(q, k, mask, False, scale, xp)
