"""Linear attention: aggregate the keys first, then let each query read the summary.

When the similarity of a query and a key factorises through a feature map,
``sim(q, k) = scale * phi(q) . phi(k)``, the attention output

``o_i = sum_j sim(q_i, k_j) v_j / sum_j sim(q_i, k_j)``

can be computed in either order:

* quadratic, "interact then sum": ``A = phi(Q) phi(K)^T`` (``Nq x Nk``), then ``A V``;
* linear, "sum then interact": ``S = phi(K)^T V`` (``d' x dv``) and ``z = sum_j phi(k_j)``
  once, then ``o_i = phi(q_i)^T S / phi(q_i)^T z``.

They are the same function (Katharopoulos et al. 2020, "Transformers are RNNs"); the
second costs ``O(N d' dv)`` instead of ``O(N^2 d')``. With ``causal`` masking the
linear order becomes a prefix sum of states; this module computes it chunk by chunk
(inter-chunk ``phi(Q_c) S_{c-1}`` plus a masked intra-chunk ``(phi(Q_c) phi(K_c)^T * M) V_c``,
``S`` carried by a cumulative sum over chunks), and :func:`linear_attention_step` is the
recurrent form used for decoding. ``docs/linear.md`` derives the reordering.

Conventions shared by the family
--------------------------------
* ``feature_map``: ``"elu+1"`` (``elu(x) + 1``, Katharopoulos et al.), ``"relu"``,
  ``"identity"``, or a callable ``phi(x) -> (..., N, d')`` written in the array API
  (it is applied to ``q`` and ``k`` separately and must give both the same ``d'``).
* ``scale``: multiplies the similarity; default 1 (the kernel of Katharopoulos et al.).
  It cancels in the normalised output; ``scale=d**-0.5`` is the convention of
  flash-linear-attention's unnormalised kernels.
* ``causal``: as in :mod:`attn_ref.softmax` - ``False``, ``True``/``"top-left"``
  (query ``i`` sees keys ``j <= i``) or ``"bottom-right"`` (``j <= i + Nk - Nq``).
* The denominator ``den_i = scale * phi(q_i) . sum_j phi(k_j)`` (over the keys query
  ``i`` sees) is used as it is when ``|den_i| >= eps`` and replaced by ``+eps`` or
  ``-eps`` (keeping its sign; ``+eps`` for zero) when ``|den_i| < eps``. So the output
  is never NaN or inf for finite inputs whose sums are representable, i.e.
  ``|scale| * Nk * max|phi(q)| * max|phi(k)| * d' * max(1, max|v|)`` below the dtype's
  largest value (for ``"elu+1"`` in float32 with ``d = 64``, ``N = 4096``:
  ``|q|, |k| <= 1e14``; in float64 ``1e150``). Past that range the sums overflow
  (``|q|, |k| >= 1e19`` in float32 gives inf / inf = NaN); the reference does not rescale
  them. :func:`linear_attention` computes float16 input in float32 (the range above is
  then float32's) and returns float16. Inside it, a query with no visible key or with all-zero
  features (possible with ``"relu"``) returns zeros, as a fully masked row does in
  :mod:`attn_ref.softmax`. With a non-negative feature map (``"elu+1"``, ``"relu"``)
  ``den_i >= 0`` and every output row with ``den_i >= eps`` is a convex combination of
  the visible values. The ``"identity"`` map (and any signed callable) gives a
  denominator that can be negative or cross zero; the rule above still applies -
  finite, but unbounded as ``den_i`` approaches ``eps`` - so use ``normalize=False``
  with signed maps unless that is what you want. Unlike Katharopoulos et al., who
  divide by ``den + eps``, a denominator at least ``eps`` is used unchanged, so the
  normalised weights sum to exactly 1 (to rounding).

Where each part lives
---------------------
* :mod:`attn_ref.linear.reference`: the defining forms, read them first - the quadratic
  order (``quadratic_order``), the attention matrix it implies
  (:func:`linear_attention_weights`) and the recurrence that decodes one token at a time
  (:func:`linear_attention_state`, :func:`linear_attention_step`).
* :mod:`attn_ref.linear.engine`: the fast forms - :func:`linear_attention`, the linear
  order block by block and the chunked causal form (``chunked_values``), the heads pool
  (``POOL_MIN_ROWS``, ``GEMM_ROWS``), and the engine shared with Performer
  (:func:`linear_from_features`, :func:`linear_from_row_maps`).
* :mod:`attn_ref.linear.options`: the feature maps and the option checks and defaults.
"""

from __future__ import annotations

from . import engine, options, reference
from .engine import *  # noqa: F403 - the fast forms and linear_attention
from .engine import linear_attention
from .options import *  # noqa: F403 - feature maps, option checks and defaults
from .reference import *  # noqa: F403 - the defining forms
from .reference import linear_attention_weights

__all__ = [*reference.__all__, *engine.__all__, *options.__all__]


def _register():
    from ..registry import Variant, register

    register(Variant(
        name="linear", fn=linear_attention, family="linear", exact=False, causal=True,
        vjp="attn_ref.grad.linear:linear_attention",
        time="O(N d^2)", memory="O(N d + B C + (B/C) d^2)", weights=linear_attention_weights,
        options={"feature_map": "elu+1", "order": "linear", "chunk_size": 8, "block_size": 16},
        summary="linear attention phi(Q)(phi(K)^T V), elu+1 features; causal chunked",
    ))


_register()
