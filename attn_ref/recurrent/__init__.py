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

Range: the output is ``scale q_t S_t``, linear in ``scale`` (no normaliser divides it
out), so it is finite while ``|scale| dk max|q| max|S_t| < finfo.max``; past that its
exact value overflows and the output is ``+-inf`` (never NaN: ``scale`` multiplies the
finished product, not a copy of ``q`` that meets a zero).
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


# ----------------------------------------------------------------------- registration

#: Offset of the seed the gates are drawn from, so that they are not the stream of a
#: ``q`` drawn from the same seed and shape.
GATE_SEED_OFFSET = 1_000_003


def _log_sigmoid(xp, x):
    # log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)): no overflow for large |x|.
    return xp.minimum(x, xp.zeros_like(x)) - xp.log1p(xp.exp(-xp.abs(x)))


def _draw(shape, seed, dtype, device, xp):
    from ..random import standard_normal

    return standard_normal(shape, seed=seed + GATE_SEED_OFFSET, dtype=dtype, device=device, xp=xp)


def retention_params(seed, nq, nk, d, dv, *, dtype, device, xp, batch=()):
    """RetNet's decays ``gamma_h = 1 - 2^(-5 - h)`` for the ``H = batch[-1]`` heads
    (fla's ``naive_retention``); a float ``1 - 2^-5`` without a batch shape."""
    if not batch:
        return {"gamma": 1.0 - 2.0 ** -5}
    heads = batch[-1]
    gamma = xp.asarray([1.0 - 2.0 ** (-5.0 - h) for h in range(heads)], dtype=dtype,
                       device=device)
    return {"gamma": gamma}


def gla_params(seed, nq, nk, d, dv, *, dtype, device, xp, batch=()):
    """``g = logsigmoid(randn) (*batch, T, dk)``, the gates of fla's GLA tests."""
    return {"g": _log_sigmoid(xp, _draw(tuple(batch) + (nq, d), seed, dtype, device, xp))}


def ssd_params(seed, nq, nk, d, dv, *, dtype, device, xp, batch=()):
    """``g = logsigmoid(randn) (*batch, T)``, as fla's simple-GLA tests."""
    return {"g": _log_sigmoid(xp, _draw(tuple(batch) + (nq,), seed, dtype, device, xp))}


def delta_params(seed, nq, nk, d, dv, *, dtype, device, xp, batch=()):
    """``beta = sigmoid(randn) (*batch, T)`` in ``(0, 1)``, as fla's delta-rule tests."""
    x = _draw(tuple(batch) + (nq,), seed + 1, dtype, device, xp)
    return {"beta": xp.exp(_log_sigmoid(xp, x))}


def gated_delta_params(seed, nq, nk, d, dv, *, dtype, device, xp, batch=()):
    """``g = logsigmoid(randn)`` and ``beta = sigmoid(randn)``, both ``(*batch, T)``."""
    out = ssd_params(seed, nq, nk, d, dv, dtype=dtype, device=device, xp=xp, batch=batch)
    out.update(delta_params(seed, nq, nk, d, dv, dtype=dtype, device=device, xp=xp, batch=batch))
    return out


def _register():
    from ..registry import Variant, register

    common = dict(family="recurrent", exact=False, causal=True, causal_only=True,
                  self_attention=True)
    # Chunks of 16 so that the generic tests' short sequences cross chunk boundaries.
    register(Variant(
        name="retention", fn=retention, params=retention_params, weights=retention_weights,
        vjp="attn_ref.grad.recurrent:retention", options={"chunk_size": 16},
        time="O(N C d + N d^2)", memory="O(N d + C^2 + d^2)",
        summary="RetNet retention, decay gamma_h = 1 - 2^(-5-h) per head; chunked",
        **common))
    register(Variant(
        name="gla", fn=gated_linear_attention, params=gla_params,
        weights=gated_linear_attention_weights,
        vjp="attn_ref.grad.recurrent:gated_linear_attention", options={"chunk_size": 16},
        time="O(N C d + N d^2)", memory="O(N d + C^2 + d^2)",
        summary="gated linear attention, per-key-dim log-sigmoid gates; chunked",
        **common))
    register(Variant(
        name="ssd", fn=ssd, params=ssd_params, weights=ssd_weights,
        vjp="attn_ref.grad.recurrent:ssd", options={"chunk_size": 16},
        time="O(N C d + N d^2)", memory="O(N d + C^2 + d^2)",
        summary="Mamba-2 SSD, one log-sigmoid decay per head and step; chunked",
        **common))
    # DeltaNet layers normalise q and k; unnormalised keys of norm ~sqrt(d) make
    # I - beta k^T k expand and the state grow geometrically.
    register(Variant(
        name="deltanet", fn=delta_rule, params=delta_params, weights=delta_rule_weights,
        vjp="attn_ref.grad.recurrent:delta_rule",
        options={"chunk_size": 16, "qk_l2norm": True},
        time="O(N C^2 + N C d + N d^2)", memory="O(N d + C^2 + d^2)",
        summary="DeltaNet delta rule, beta = sigmoid, l2-normalised q, k; chunked WY form",
        **common))
    register(Variant(
        name="gated_deltanet", fn=gated_delta_rule, params=gated_delta_params,
        weights=gated_delta_rule_weights, vjp="attn_ref.grad.recurrent:gated_delta_rule",
        options={"chunk_size": 16, "qk_l2norm": True},
        time="O(N C^2 + N C d + N d^2)", memory="O(N d + C^2 + d^2)",
        summary="Gated DeltaNet: delta rule after a log-sigmoid decay; chunked WY form",
        **common))


_register()
