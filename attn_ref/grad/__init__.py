"""Exact gradients (vector-Jacobian products) of the attention variants, in pure array API.

The array API standard has no automatic differentiation, so the reference carries its
backward passes in closed form. Each function here mirrors the forward of the same
name in :mod:`attn_ref` - same positional inputs, same keyword options - with one more
positional argument, the cotangent ``do`` of the output, and returns a dict mapping
the name of each differentiable input to its gradient::

    g = attn_ref.grad.softmax_attention(q, k, v, do, mask=mask, bias=bias, causal=True)
    g["q"], g["k"], g["v"], g["bias"]

Gradients have the shape of their input: an input that was broadcast (a bias of
shape ``(1, Nq, Nk)`` against a batch of 4) gets the gradient summed over the
broadcast dimensions. Non-array options (masks, ``causal``, block sizes) are not
differentiated. Each registered variant names its VJP (``attn_ref.registry.get(name).vjp``);
:data:`VJPS` is a read-only view of that catalogue, name -> VJP.

Each VJP is a composition of the small VJPs in :mod:`attn_ref.grad._common` (matrix
product, row softmax, broadcasting, feature maps) applied to the forward's named
steps, and is tested against central finite differences in float64 and against
``torch.autograd`` and ``jax.vjp`` applied to the forward code itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from .. import registry
from .compressed import compressed_attention
from .hashing import reformer_attention
from .linear import feature_map_backward, linear_attention, linear_from_features
from .lowrank import linformer_attention
from .performer import performer_attention
from .reduced import clustered_attention, nystrom_attention, pooled_attention, query_reduced_attention
from .routing import routing_attention
from .softmax import online_softmax_attention, online_softmax_forward, softmax_attention, varlen_attention
from .sorting import sinkhorn_attention
from .sparse import (
    bigbird_attention,
    block_sparse_attention,
    fixed_attention,
    local_attention,
    longformer_attention,
    strided_attention,
)
from .synthesizer import (
    dense_synthesizer_attention,
    random_synthesizer_attention,
    synthesizer_attention,
)

__all__ = [
    "VJPS",
    "bigbird_attention",
    "block_sparse_attention",
    "clustered_attention",
    "compressed_attention",
    "dense_synthesizer_attention",
    "feature_map_backward",
    "fixed_attention",
    "linear_attention",
    "linear_from_features",
    "linformer_attention",
    "local_attention",
    "longformer_attention",
    "nystrom_attention",
    "online_softmax_attention",
    "online_softmax_forward",
    "performer_attention",
    "pooled_attention",
    "query_reduced_attention",
    "random_synthesizer_attention",
    "routing_attention",
    "reformer_attention",
    "sinkhorn_attention",
    "softmax_attention",
    "strided_attention",
    "synthesizer_attention",
    "varlen_attention",
]


class _RegistryVJPs(Mapping):
    """Variant name -> ``registry.get(name).vjp``, for every variant that has one.

    A view, not a copy: the catalogue is the one place a VJP is recorded, so a variant
    registered later (a plugin's) appears here too, and nothing can be assigned here.
    """

    def __getitem__(self, name: str):
        try:
            vjp = registry.get(name).vjp
        except KeyError:
            vjp = None
        if vjp is None:
            raise KeyError(name)
        return vjp

    def __iter__(self) -> Iterator[str]:
        return (v.name for v in registry.variants() if v.vjp is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"VJPS({dict(self)!r})"


#: Variant name (as in :mod:`attn_ref.registry`) -> its VJP
#: ``vjp(q, k, v, do, /, **same options as the forward) -> {input name: gradient}``:
#: a read-only view of the ``vjp`` field of the registry's variants.
VJPS: Mapping = _RegistryVJPs()
