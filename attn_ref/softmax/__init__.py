"""Exact softmax attention: the defining form, the tiled online form and packed variable-length batches.

The family outgrew one file; every public name is re-exported here, so
``from attn_ref.softmax import X`` and ``attn_ref.softmax.X`` keep working.
"""

from __future__ import annotations

from .tiles import (
    BOTTOM_RIGHT,
    TOP_LEFT,
    Problem,
    TileSpec,
    attention_weights,
    causal_alignment,
    check_alibi_slopes,
    check_dropout,
    check_seqlens,
    check_softcap,
    check_window,
    cu_offsets,
    dropout_scale,
    group_heads,
    keep_tile,
    logit_dtype,
    online_forward,
    online_softmax_attention,
    packed_layout,
    prepare_problem,
    row_max,
    softmax_attention,
    tile_coverage,
    tile_logits,
    transposed_copy,
    unpack_index,
    varlen_attention,
)

__all__ = [
    "TOP_LEFT",
    "BOTTOM_RIGHT",
    "softmax_attention",
    "attention_weights",
    "online_softmax_attention",
    "varlen_attention",
    "causal_alignment",
    "logit_dtype",
    "check_window",
    "check_softcap",
    "check_dropout",
    "check_alibi_slopes",
    "check_seqlens",
    "group_heads",
    "TileSpec",
    "tile_coverage",
    "tile_logits",
    "keep_tile",
    "dropout_scale",
    "transposed_copy",
    "row_max",
    "Problem",
    "prepare_problem",
    "online_forward",
    "cu_offsets",
    "unpack_index",
    "packed_layout",
]
