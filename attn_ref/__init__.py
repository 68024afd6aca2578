"""attn-ref: every major self-attention variant, written once in the Python array API.

Each family lives in its own module; the most used functions are re-exported here.
:mod:`attn_ref.registry` lists every variant with its cost and capabilities.
"""

from .softmax import (
    BOTTOM_RIGHT,
    TOP_LEFT,
    attention_weights,
    online_softmax_attention,
    softmax_attention,
)

__version__ = "0.1.0"

__all__ = [
    "BOTTOM_RIGHT",
    "TOP_LEFT",
    "attention_weights",
    "online_softmax_attention",
    "softmax_attention",
]
