"""Decayed, gated and delta-rule linear attention: the recurrent family.

The seed's reordering ``phi(Q) (phi(K)^T V)`` read as a recurrence over a state
``S_t = phi(K_{<=t})^T V_{<=t}``, then grown: the state decays (:mod:`.decay`:
retention, GLA, Mamba-2's SSD) or is corrected by online regression (:mod:`.delta`:
DeltaNet, Gated DeltaNet). Layout ``q, k (..., T, dk)``, ``v (..., T, dv)``, state
``S (..., dk, dv)`` (flash-linear-attention's ``K x V``), ``o_t = scale q_t S_t``
including the current token. Every function has three forms (``form=``: the
recurrence, the masked ``T x T`` matrix, and the chunked form of fast kernels),
``initial_state``, ``output_final_state`` and packed sequences (``cu_seqlens``). See
:doc:`/recurrent`.
"""

from .decay import (
    gated_linear_attention,
    gated_linear_attention_weights,
    retention,
    retention_weights,
    ssd,
    ssd_weights,
)
from .delta import (
    delta_rule,
    delta_rule_weights,
    gated_delta_rule,
    gated_delta_rule_weights,
    l2_normalize,
)

__all__ = [
    "retention",
    "retention_weights",
    "gated_linear_attention",
    "gated_linear_attention_weights",
    "ssd",
    "ssd_weights",
    "delta_rule",
    "delta_rule_weights",
    "gated_delta_rule",
    "gated_delta_rule_weights",
    "l2_normalize",
]
