"""Exact softmax attention, in its defining (one-shot) and memory-efficient (online) forms.

``O = softmax(scale * Q K^T + B, masked) V``

The one-shot form materialises the ``(..., Nq, Nk)`` logits; the online form
(Rabe & Staats 2021, Dao et al. 2022) walks over key blocks with a running maximum and
running normaliser and never holds more than one ``block_q x block_k`` tile of logits.
Both compute the same function; see ``docs/online_softmax.md`` for why the recurrence
is exact. :func:`varlen_attention` takes FlashAttention's packed variable-length layout.

Conventions shared by the family
--------------------------------
* ``mask``: boolean, broadcastable to ``(..., Nq, Nk)``, True = may attend.
* ``bias``: additive float logits bias (ALiBi, relative positions), same broadcast.
* ``causal``: ``False``; ``"top-left"`` (query ``i`` sees keys ``j <= i``; PyTorch's
  ``is_causal``, JAX); ``"bottom-right"`` (query ``i`` sees keys
  ``j <= i + Nk - Nq``, so the last query sees every key; FlashAttention, KV-cache
  decoding). ``True`` means ``"top-left"``. The two agree when ``Nq == Nk``.
* A query row with no key it may attend to (fully masked, ``Nk == 0``, or all
  logits ``-inf``) returns zeros, as PyTorch SDPA and FlashAttention do; its
  weights row is all zeros.
* ``Nq == 0`` gives an empty ``(..., 0, dv)`` output.
* Finite input gives finite output whenever the unscaled products ``q.k`` are finite in
  the dtype (``|q| |k| < finfo.max``): the max is subtracted before ``exp``, and a
  scaled logit past the dtype's range (``scale=1e308``) is clamped to ``+-finfo.max``
  instead of becoming ``inf`` (so several overflowing logits of one row share its
  weight equally, where exact arithmetic would favour the largest). float16 (and any
  dtype narrower than float32) computes the logits and the softmax in float32, so
  logits above 65504 do not overflow; the output keeps the input's dtype.

Options of modern kernels (FlashAttention 2, PyTorch SDPA, Gemma 2)
--------------------------------------------------------------------
Below, ``Lq`` and ``Lk`` are a sequence's lengths (``Nq``, ``Nk`` unless
``seqlens_q``/``seqlens_k`` say otherwise) and ``off = Lk - Lq`` is the bottom-right
offset, so query ``i`` sits at key position ``i + off`` (FlashAttention's alignment).

* ``gqa=True``: grouped-query / multi-query attention (Ainslie et al. 2023; PyTorch's
  ``enable_gqa``). Axis ``-3`` is the head axis: ``q (..., Hq, Nq, d)``,
  ``k (..., Hkv, Nk, d)``, ``v (..., Hkv, Nk, dv)`` with ``Hq = g Hkv``; query head
  ``h`` uses key/value head ``h // g`` (PyTorch's ``repeat_interleave``,
  FlashAttention). Axes before ``-3`` broadcast as usual; ``mask``, ``bias``,
  ``dropout_mask`` and ``alibi_slopes`` are given per *query* head (or broadcast).
  Without ``gqa=True`` head axes must broadcast, as any other batch axis; keys and
  values are never copied to ``Hq`` heads (``q`` is viewed as ``(..., Hkv, g, Nq, d)``).
* ``window=(left, right)``: FlashAttention's ``window_size``. Query ``i`` sees key
  ``j`` iff ``i + off - left <= j <= i + off + right``; ``-1`` or ``None`` leaves
  that side unbounded. Always bottom-right aligned, whatever ``causal`` says, and
  ANDed with ``causal`` (FlashAttention's ``causal=True`` is ``right = 0``).
* ``chunk=c``: chunked attention, Llama 4's ``attention_chunk_size``
  (``transformers.masking_utils.chunked_overlay``). Query ``i`` sees key ``j`` iff
  ``(i + off) // c == j // c``: the sequence's positions are cut into chunks of ``c``
  counted from key 0 (absolute positions, so a decoding step's chunk is fixed by the
  cache length, not by the step's first query), ANDed with ``causal``: Llama 4's
  chunked layers are ``causal="bottom-right", chunk=attention_chunk_size``. With
  ``seqlens_k`` the chunks start at each sequence's own first key (HF counts them from
  the first real token of a left-padded row). Tiles in no query's chunk are skipped.
* ``softcap=c``: logit soft-capping ``c tanh(s / c)`` of the *scaled* logits
  ``s = scale q.k``, before ``bias`` and ALiBi are added (Gemma 2; FlashAttention's
  ``softcap`` and its ``attention_ref``). ``None`` turns it off.
* ``alibi_slopes``: float array of shape ``(H,)`` or ``(B, H)`` (per query head),
  adding ``-slope * |i + off - j|`` to the logits after soft-capping: FlashAttention's
  convention (Press et al. 2022 write ``-m (i - j)`` for causal self-attention; the two
  differ by a per-row constant, which softmax ignores).
* ``dropout_p``, ``dropout_mask``: dropout with a keep-mask supplied by the caller
  (the reference cannot share a kernel's RNG): bool, broadcastable to
  ``(..., Nq, Nk)``, True = kept. The normalised weights are ``P * keep / (1 - p)``
  (FlashAttention, PyTorch): the softmax denominator counts dropped entries too.
  ``dropout_p > 0`` needs a mask.
* ``seqlens_q``, ``seqlens_k``: per-sequence lengths of a padded batch (key padding,
  KV-cache lengths): integer arrays (or tuples of ints) of shape ``(B,)`` for inputs
  ``(B, H, N, d)`` (generally: they broadcast against the axes before the head axis
  ``-3``). Keys
  ``j >= Lk`` are hidden; query rows ``i >= Lq`` are padding and give zeros. Values
  outside ``[0, N]`` act as clipped to it. The causal, window and ALiBi offsets use each
  sequence's own ``Lk - Lq``, as FlashAttention's ``cache_seqlens`` does: KV-cache
  decoding is ``causal="bottom-right", seqlens_k=cache_lengths``.

Order of operations for one logit, as in FlashAttention's ``attention_ref``:
``s = scale q.k`` -> soft-cap -> ``+ bias - slope |i + off - j|`` -> ``-inf`` where
``mask``, ``causal``, ``window``, ``chunk`` or the lengths forbid -> softmax -> dropout -> ``@ V``.

Where each part lives
---------------------
* :mod:`attn_ref.softmax.reference`: the defining form, read it first -
  :func:`softmax_attention` and :func:`attention_weights`, the whole logits matrix as
  one tile.
* :mod:`attn_ref.softmax.online`: the online (FlashAttention) form,
  :func:`online_softmax_attention`, and its forward loop ``online_forward``.
* :mod:`attn_ref.softmax.varlen`: packed variable-length batches.
* :mod:`attn_ref.softmax.partial`: split-KV attention, :func:`partial_attention` of
  one key chunk returning ``(out, lse)`` and :func:`merge_attention` of partials.
* :mod:`attn_ref.softmax.options`: the options above, checked once (``prepare_problem``).
* :mod:`attn_ref.softmax.tiles`: one tile of the pipeline, shared by every form and by
  the blockwise backward of :mod:`attn_ref.grad.softmax`.
"""

from __future__ import annotations

from .._common import BOTTOM_RIGHT, TOP_LEFT, causal_alignment
from . import online, options, partial, reference, tiles, varlen
from .online import *  # noqa: F403 - the online (FlashAttention) form
from .online import online_softmax_attention
from .options import *  # noqa: F403 - the option checks and prepare_problem
from .partial import *  # noqa: F403 - split-KV partials and their merge
from .reference import *  # noqa: F403 - the defining form
from .reference import attention_weights, softmax_attention
from .tiles import *  # noqa: F403 - the tile machinery
from .varlen import *  # noqa: F403 - packed variable-length batches

__all__ = [
    "TOP_LEFT",
    "BOTTOM_RIGHT",
    "causal_alignment",
    *reference.__all__,
    *online.__all__,
    *partial.__all__,
    *varlen.__all__,
    *options.__all__,
    *tiles.__all__,
]


def _register():
    from ..registry import Variant, register

    register(Variant(
        name="softmax", fn=softmax_attention, family="softmax", exact=True, causal=True,
        vjp="attn_ref.grad.softmax:softmax_attention",
        time="O(N^2 d)", memory="O(N^2)", weights=attention_weights,
        summary="one-shot softmax(QK^T/sqrt(d))V",
    ))
    register(Variant(
        name="online_softmax", fn=online_softmax_attention, family="softmax", exact=True,
        vjp="attn_ref.grad.softmax:online_softmax_attention",
        causal=True, time="O(N^2 d)", memory="O(N)", weights=attention_weights,
        options={"block_q": 16, "block_k": 24},
        summary="online-softmax (FlashAttention) recurrence over key blocks",
    ))


_register()
