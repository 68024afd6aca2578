"""attn-ref: every major self-attention variant, written once in the Python array API.

Each family lives in its own module; the most used functions are re-exported here.
:mod:`attn_ref.registry` lists every variant with its cost and capabilities.
"""

from .compressed import compressed_attention, compressed_weights
from .diagnostics import (
    best_rank_k_error,
    compare_variants,
    effective_rank,
    normalized_cumulative_spectrum,
    singular_values,
)
from .linear import (
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    linear_attention_weights,
)
from .lowrank import linformer_attention, linformer_projection, linformer_weights
from .performer import (
    favor_features,
    performer_attention,
    performer_attention_weights,
    random_features,
)
from .reduced import (
    clustered_attention,
    clustered_weights,
    iterative_pinv,
    nystrom_attention,
    nystrom_weights,
    pooled_attention,
    pooled_weights,
    query_reduced_attention,
    query_reduced_weights,
)
from .softmax import (
    BOTTOM_RIGHT,
    TOP_LEFT,
    attention_weights,
    merge_attention,
    online_softmax_attention,
    partial_attention,
    softmax_attention,
    varlen_attention,
)
from .sparse import (
    bigbird_attention,
    block_sparse_attention,
    fixed_attention,
    local_attention,
    local_mask,
    longformer_attention,
    strided_attention,
)

__version__ = "0.1.0"

__all__ = [
    "BOTTOM_RIGHT",
    "TOP_LEFT",
    "attention_weights",
    "online_softmax_attention",
    "softmax_attention",
    "varlen_attention",
    "partial_attention",
    "merge_attention",
    "linformer_attention",
    "linformer_weights",
    "linformer_projection",
    "compressed_attention",
    "compressed_weights",
    "pooled_attention",
    "pooled_weights",
    "query_reduced_attention",
    "query_reduced_weights",
    "iterative_pinv",
    "nystrom_attention",
    "nystrom_weights",
    "clustered_attention",
    "clustered_weights",
    "block_sparse_attention",
    "local_attention",
    "local_mask",
    "longformer_attention",
    "bigbird_attention",
    "strided_attention",
    "fixed_attention",
    "linear_attention",
    "linear_attention_state",
    "linear_attention_step",
    "linear_attention_weights",
    "random_features",
    "favor_features",
    "performer_attention",
    "performer_attention_weights",
    "singular_values",
    "normalized_cumulative_spectrum",
    "effective_rank",
    "best_rank_k_error",
    "compare_variants",
]
