"""Sparse attention patterns: who may attend whom, and attention that computes only that.

Two forms of every pattern, tested against each other:

* the **defining form**: a boolean ``(N, N)`` mask builder (``local_mask``,
  ``strided_mask``, ``fixed_mask``, ``global_mask``, ``longformer_mask``,
  ``bigbird_mask``, ``layout_mask``) handed to
  :func:`attn_ref.softmax.softmax_attention` as ``mask=`` ("dense masked softmax"), and
  the matching ``*_weights`` function giving the implied attention matrix;
* the **efficient form** (``block_sparse_attention``, ``local_attention``,
  ``longformer_attention``, ``bigbird_attention``, ``strided_attention``,
  ``fixed_attention``), which gathers only the key blocks a query block may see and
  never builds an ``(N, N)`` array. It equals the dense masked softmax up to rounding.
  Each is a plan of softmax partials over disjoint key sets, merged exactly; the
  VJPs in :mod:`attn_ref.grad.sparse` differentiate the same plans, just as sparsely.

Conventions
-----------
* Masks are ``(Nq, Nk)`` boolean arrays in the caller's namespace and device;
  True = may attend. Query ``i`` and key ``j`` are sequence positions.
* ``window`` is the reach **per side**, counted in attended keys: two-sided, query
  ``i`` sees ``j`` with ``|i - j| <= window * dilation`` and ``(i - j) % dilation == 0``;
  one-sided (causal) only ``0 <= i - j``. Window 0 is the diagonal; a window of
  ``N - 1`` or more is full attention. The dilated form is Longformer's (Beltagy et
  al. 2020): ``window`` keys per side at gaps of ``dilation``.
* A block layout is a host-side boolean ``(ceil(Nq/B), ceil(Nk/B))`` table (nested
  sequences of bools, or a concrete boolean array); entry ``(a, b)`` True means query
  block ``a`` may attend key block ``b``. It is a structural parameter, so a jitted
  caller keeps it static (a tuple of tuples is hashable). The last block may be
  ragged: positions past ``Nq``/``Nk`` are padding that never receives weight.
* Rows with no key to attend to return zeros, as in :mod:`attn_ref.softmax`.
* The efficient forms, like the defining form :func:`attn_ref.softmax_attention`, apply
  ``scale`` to the products ``q . k``, never to ``q``, and clamp a logit past the
  dtype's range to ``+-finfo.max`` (:func:`attn_ref._common.scaled_logits`): finite input
  gives finite output for every finite ``scale`` (``scale=1e308`` gives the rows' hardmax).
* float16 and bfloat16 inputs are computed in float32 and the output is rounded once to
  their dtype (as the defining form's logits and statistics are); the VJPs
  (:mod:`attn_ref.grad`) compute in the input's dtype.
* A block layout, like ``cu_seqlens``, is read on the host: it may come from any
  library (or be nested sequences), unlike the array arguments, which must share
  ``q``'s library.

Where each part lives
---------------------
* :mod:`attn_ref.sparse.masks`: each pattern as a predicate on ``(i, j)`` and the mask
  and layout builders made from it - the defining forms.
* :mod:`attn_ref.sparse.attention`: the efficient forms and the ``*_weights`` functions.
* :mod:`attn_ref.sparse.plans`: how the efficient forms and their VJPs compute - a plan
  of parts (gathered key blocks, residue classes, summary columns), each a softmax
  partial, merged exactly.
"""

from __future__ import annotations

from .._common import ceil_div
from . import attention, masks, plans  # noqa: F401 - the modules, as attn_ref.sparse.<module>
from .attention import *  # noqa: F403 - the efficient forms and the *_weights functions
from .attention import (
    bigbird_attention,
    bigbird_weights,
    block_sparse_attention,
    block_sparse_weights,
    fixed_attention,
    fixed_weights,
    local_attention,
    local_weights,
    longformer_attention,
    longformer_weights,
    strided_attention,
    strided_weights,
)
from .masks import *  # noqa: F403 - each pattern's mask and layout builders
from .masks import random_block_layout

__all__ = [*masks.__all__, *attention.__all__]


def _block_sparse_params(seed, nq, nk, d, dv, *, dtype, device, xp, block_size=4):
    B = block_size
    return {"block_size": B, "layout": random_block_layout(ceil_div(nq, B), ceil_div(nk, B), seed=seed)}


def _bigbird_params(seed, nq, nk, d, dv, *, dtype, device, xp):
    return {"seed": seed}


def _register():
    from ..registry import Variant, register

    register(Variant(
        name="block_sparse", fn=block_sparse_attention, family="sparse", exact=False, causal=True,
        vjp="attn_ref.grad.sparse:block_sparse_attention",
        time="O(nnz B^2 d)", memory="O(nnz B^2)", params=_block_sparse_params,
        weights=block_sparse_weights,
        summary="softmax over the active blocks of a block layout (gather, then softmax)",
    ))
    register(Variant(
        name="local", fn=local_attention, family="sparse", exact=False, causal=True,
        vjp="attn_ref.grad.sparse:local_attention",
        time="O(N w d)", memory="O(N w)", weights=local_weights, self_attention=True,
        options={"window": 3}, summary="sliding window of w keys per side (one-sided if causal)",
    ))
    register(Variant(
        name="longformer", fn=longformer_attention, family="sparse", exact=False, causal=True,
        vjp="attn_ref.grad.sparse:longformer_attention",
        time="O(N (w + g B) d)", memory="O(N (w + g B))", weights=longformer_weights,
        self_attention=True, options={"window": 2, "global_tokens": (0,)},
        summary="sliding window plus symmetric global tokens (Beltagy et al. 2020)",
    ))
    register(Variant(
        name="bigbird", fn=bigbird_attention, family="sparse", exact=False, causal=True,
        vjp="attn_ref.grad.sparse:bigbird_attention",
        time="O(N B (2w + 1 + g + r) d)", memory="O(N B (2w + 1 + g + r))",
        params=_bigbird_params, weights=bigbird_weights, self_attention=True,
        options={"block_size": 4, "window": 1, "global_blocks": 1, "random_blocks": 1},
        summary="sliding, global and seeded random blocks (Zaheer et al. 2020)",
    ))
    register(Variant(
        name="strided", fn=strided_attention, family="sparse", exact=False, causal=True,
        vjp="attn_ref.grad.sparse:strided_attention",
        time="O(N (l + N/l) d)", memory="O(N (l + N/l))", weights=strided_weights,
        self_attention=True, options={"stride": 4},
        summary="Sparse Transformer strided pattern, both parts in one head",
    ))
    register(Variant(
        name="fixed", fn=fixed_attention, family="sparse", exact=False, causal=True,
        vjp="attn_ref.grad.sparse:fixed_attention",
        time="O(N (l + c N/l) d)", memory="O(N (l + c N/l))", weights=fixed_weights,
        self_attention=True, options={"stride": 4, "summary": 1},
        summary="Sparse Transformer fixed pattern, both parts in one head",
    ))


_register()
