"""Kernel features: the capabilities a conformance case may need from a kernel.

A :class:`Feature` names the reference keyword it feeds (``mask``, ``bias``, ``causal``,
``scale``, ``gqa``, ``window``, ``chunk``, ...), the kernel parameter names that declare it, and
optional hooks: ``build`` adds or reshapes a case's inputs (GQA: fewer kv heads; varlen:
sequence lengths), ``allowed`` contributes to the ``(..., Nq, Nk)`` visibility matrix
used for fully-masked-row semantics (windows, chunks, varlen boundaries), ``to_kernel``
converts the value for the kernel (causal alignment -> ``True``).

Extension point: :func:`register_feature`. Adding a kernel capability is one call plus
the cases (:mod:`conformance.catalogue`) that use it.

This module is the bottom of the package: it imports no other module of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Feature",
    "FEATURES",
    "NotApplicable",
    "register_feature",
    "allowed_matrix",
    "sequence_lengths",
    "default_scale",
    "window_off_by_one",
]


def default_scale(d: int) -> float:
    """The logit scale of softmax attention when none is given: ``1/sqrt(d)``."""
    return 1.0 / math.sqrt(d) if d > 0 else 1.0

@dataclass(frozen=True)
class Feature:
    """A capability a case may need from a kernel.

    Attributes
    ----------
    name : str
        Feature name, as used in :attr:`Case.needs` and in ``verify(supports=...)``.
    params : tuple of str
        Kernel parameter names that declare the feature; the first one is also the
        keyword of the ``attn_ref`` reference it feeds. Empty for features that cannot
        be seen in a signature (``declared_only``).
    declared_only : bool
        The kernel must opt in with ``verify(..., supports={name: True})``.
    assumed : bool
        Supported unless the kernel opts out with ``supports={name: False}``.
    build : callable, optional
        ``build(case, rng, arrays, kwargs)``: add or change inputs in place.
    allowed : callable, optional
        ``allowed(case, arrays, kwargs) -> bool (B|1, H|1, Nq, Nk)`` or None: which
        query/key pairs this feature leaves visible (for fully-masked-row semantics).
    to_kernel : callable, optional
        ``to_kernel(value, case, semantics) -> value`` converting the reference value
        for the kernel, or raising :class:`NotApplicable`.
    doc : str
        One line for the docs and the report.
    """

    name: str
    params: tuple = ()
    declared_only: bool = False
    assumed: bool = False
    build: Callable | None = None
    allowed: Callable | None = None
    to_kernel: Callable | None = None
    doc: str = ""


class NotApplicable(Exception):
    """A case the kernel (or the reference) cannot take; the message says why."""


def _causal_to_kernel(value, case, semantics):
    conv = semantics.get("causal", "top-left")
    if conv == "both":
        return value
    if value == conv:
        return True
    # The alignments differ wherever a sequence has Lq != Lk: the padded Nq == Nk of a
    # varlen batch says nothing about the sequences inside it (40 queries on 17 keys).
    b = case.batch[0]
    lq = case.param("seqlens_q", (case.nq,) * b)
    lk = case.param("seqlens_k", (case.nk,) * b)
    if tuple(lq) == tuple(lk):
        return True
    what = "Nq != Nk" if case.nq != case.nk else f"sequences of Lq = {tuple(lq)} on Lk = {tuple(lk)}"
    raise NotApplicable(f"kernel's causal=True is {conv}; case needs {value} with {what}")


def _causal_allowed(case, arrays, kwargs):
    align = kwargs.get("causal")
    if not align:
        return None
    i, j = np.arange(case.nq)[:, None], np.arange(case.nk)[None, :]
    if align == "top-left":
        return (j <= i)[None, None]
    # bottom-right from each sequence's own end, as the window and the reference measure
    lq, lk = sequence_lengths(case, kwargs)
    return j <= i + lk - lq


def _mask_allowed(case, arrays, kwargs):
    return arrays.get("mask")


FEATURES: dict[str, Feature] = {}


def register_feature(feature: Feature) -> Feature:
    """Add a feature (see the module docstring); returns it."""
    FEATURES[feature.name] = feature
    return feature


register_feature(Feature("mask", ("mask", "attn_mask"), allowed=_mask_allowed,
                         doc="boolean mask broadcastable to (B, H, Nq, Nk), True = may attend"))
register_feature(Feature("bias", ("bias", "attn_bias"),
                         doc="additive float logits bias broadcastable to (B, H, Nq, Nk)"))
register_feature(Feature("causal", ("causal", "is_causal"), allowed=_causal_allowed,
                         to_kernel=_causal_to_kernel,
                         doc="causal masking; alignment declared by semantics causal="))
register_feature(Feature("scale", ("scale", "softmax_scale", "sm_scale"),
                         doc="explicit logit scale (default 1/sqrt(d) otherwise)"))
register_feature(Feature("value_dim", declared_only=True, assumed=True,
                         doc="v with a head dim dv different from q/k's d (opt out with False)"))
register_feature(Feature("broadcast", declared_only=True,
                         doc="k and v with leading (batch, head) dims that broadcast against q's"))
# on by default: the point of these cases is that a kernel unaware of strides fails them
register_feature(Feature("noncontiguous", declared_only=True, assumed=True,
                         doc="q, k, v (and do) as strided views of packed or transposed buffers "
                             "(conformance.noncontiguous); a kernel that requires contiguous inputs "
                             "opts out with False"))



# ------------------------------------------------------------- features of modern kernels
# Grouped-query heads, sliding windows, soft-capping, ALiBi, dropout keep-masks and
# per-sequence lengths (KV-cache decoding, varlen batches in their padded form). The
# reference keywords are those of attn_ref.softmax; positions follow FlashAttention:
# query i sits at key position i + Lk - Lq of its own sequence.


def sequence_lengths(case, kwargs):
    """Per-batch ``(Lq, Lk)`` int arrays shaped ``(B, 1, 1, 1)``."""
    b = case.batch[0]
    lq = np.asarray(kwargs.get("seqlens_q", (case.nq,) * b)).reshape(b, 1, 1, 1)
    lk = np.asarray(kwargs.get("seqlens_k", (case.nk,) * b)).reshape(b, 1, 1, 1)
    return lq, lk


def _gqa_build(case, rng, arrays, kwargs):
    hkv = case.param("kv_heads")
    arrays["k"], arrays["v"] = arrays["k"][:, :hkv].copy(), arrays["v"][:, :hkv].copy()
    kwargs["gqa"] = True


def _window_build(case, rng, arrays, kwargs):
    kwargs["window"] = tuple(int(w) for w in case.param("window"))


def window_off_by_one(window):
    """``(side, new_window, nonnegative)`` for each bounded side of a sliding ``window =
    (left, right)`` taken one wider and one narrower: ``side`` ``"left"``/``"right"``,
    ``nonnegative`` False where the narrower extent is -1 (a window that also hides the
    query's own position, not one a ``window`` keyword can state). An unbounded side
    (-1) is never off by one. The diagnoses of a kernel's window (forward and backward)
    try each."""
    left, right = window
    for side, dl, dr in (("left", 1, 0), ("left", -1, 0), ("right", 0, 1), ("right", 0, -1)):
        bound = left if side == "left" else right
        if bound >= 0:
            yield side, (left + dl, right + dr), bound + dl + dr >= 0


def _window_allowed(case, arrays, kwargs):
    left, right = kwargs["window"]
    lq, lk = sequence_lengths(case, kwargs)
    i, j = np.arange(case.nq)[:, None], np.arange(case.nk)[None, :]
    ok = np.ones((case.batch[0], 1, case.nq, case.nk), dtype=bool)
    if left >= 0:
        ok &= j >= i + lk - lq - left
    if right >= 0:
        ok &= j <= i + lk - lq + right
    return ok


def _chunk_build(case, rng, arrays, kwargs):
    kwargs["chunk"] = int(case.param("chunk"))


def _chunk_allowed(case, arrays, kwargs):
    # Llama 4's chunked_overlay on absolute positions: query i at i + Lk - Lq, chunks
    # counted from each sequence's key 0
    c = kwargs["chunk"]
    lq, lk = sequence_lengths(case, kwargs)
    i, j = np.arange(case.nq)[:, None], np.arange(case.nk)[None, :]
    return (i + lk - lq) // c == j // c


def _softcap_build(case, rng, arrays, kwargs):
    kwargs["softcap"] = float(case.param("softcap"))


def _alibi_build(case, rng, arrays, kwargs):
    # Slopes 2^-e with e drawn from the seed in 1..8 (the paper's range), in no order over
    # the heads: with the paper's 2^(-8 h / H) in every case, a kernel that ignores
    # alibi_slopes and computes those itself passed them all (an independent audit's).
    # Powers of two, as the paper's are for H a power of two: every dtype holds them and
    # their products with distances up to 256 exactly (a FlexAttention score_mod forms
    # slope * distance in the slopes' dtype), so only where they come from changes.
    h = case.batch[1]
    e = rng.integers(1, 9, h)
    paper = 8.0 * np.arange(1, h + 1) / h
    if np.array_equal(e, paper):
        e = e % 8 + 1  # (H = 8 only, one draw in 8^8) still not the paper's
    arrays["alibi_slopes"] = 2.0 ** -e.astype(np.float64)


def _dropout_build(case, rng, arrays, kwargs):
    p = float(case.param("dropout_p"))
    b, h = case.batch
    arrays["dropout_mask"] = rng.random((b, h, case.nq, case.nk)) >= p
    kwargs["dropout_p"] = p


def _seqlens_build(which):
    def build(case, rng, arrays, kwargs):
        kwargs[f"seqlens_{which}"] = tuple(int(x) for x in case.param(f"seqlens_{which}"))
    return build


def _seqlens_allowed(case, arrays, kwargs):
    lq, lk = sequence_lengths(case, kwargs)
    i, j = np.arange(case.nq)[:, None], np.arange(case.nk)[None, :]
    return (i < lq) & (j < lk)


register_feature(Feature("gqa", ("gqa", "enable_gqa"), build=_gqa_build,
                         to_kernel=lambda value, case, semantics: True,
                         doc="grouped-query/multi-query attention: k, v with Hkv heads, query "
                             "head h uses kv head h // (Hq / Hkv)"))
register_feature(Feature("window", ("window", "window_size"), build=_window_build,
                         allowed=_window_allowed,
                         doc="sliding window (left, right), FlashAttention's window_size, -1 = "
                             "unbounded, bottom-right aligned"))
register_feature(Feature("chunk", ("chunk", "attention_chunk_size"), build=_chunk_build,
                         allowed=_chunk_allowed,
                         doc="chunked attention (Llama 4's attention_chunk_size c): query i sees key "
                             "j iff (i + Lk - Lq) // c == j // c, chunks on absolute positions"))
register_feature(Feature("softcap", ("softcap", "logit_softcap"), build=_softcap_build,
                         doc="logit soft-capping c tanh(s / c) of the scaled logits, before bias"))
register_feature(Feature("alibi", ("alibi_slopes",), build=_alibi_build,
                         doc="ALiBi slopes (H,): bias -slope |i + Lk - Lq - j|"))
register_feature(Feature("dropout_mask", ("dropout_mask",), build=_dropout_build,
                         doc="dropout keep-mask (B, H, Nq, Nk), True = kept"))
register_feature(Feature("dropout_p", ("dropout_p",),
                         doc="dropout rate: kept weights scaled by 1 / (1 - p)"))
register_feature(Feature("seqlens_k", ("seqlens_k", "cache_seqlens"), build=_seqlens_build("k"),
                         allowed=_seqlens_allowed,
                         doc="per-sequence key lengths (B,): KV-cache lengths, key padding"))
register_feature(Feature("seqlens_q", ("seqlens_q",), build=_seqlens_build("q"),
                         allowed=_seqlens_allowed,
                         doc="per-sequence query lengths (B,): padded varlen batches; padding "
                             "rows count as rows with no key"))


def allowed_matrix(case, arrays: dict, kwargs: dict) -> np.ndarray | None:
    """The ``(B|1, H|1, Nq, Nk)`` visibility matrix of a case (None: all visible)."""
    out = None
    for name in sorted(case.needs):
        feat = FEATURES.get(name)
        if feat is None or feat.allowed is None:
            continue
        a = feat.allowed(case, arrays, kwargs)
        if a is not None:
            out = a if out is None else np.logical_and(out, a)
    return out


# ------------------------------------------------- features of recurrent kernels (issue 18)
# The state a recurrent kernel starts from and the packed sequences it runs over, as
# flash-linear-attention's kernels take them: ``initial_state (N, H, d_k, d_v)`` (N the
# batch, or the number of packed sequences) and ``cu_seqlens = (0, t_1, ..., T)`` with
# ``q (1, T, H, d_k)``. Both are passed by name; the state as an array in the kernel's
# dtype, the boundaries as a tuple of Python ints.


def _cu_seqlens_build(case, rng, arrays, kwargs):
    kwargs["cu_seqlens"] = tuple(int(x) for x in case.param("cu_seqlens"))


def _initial_state_build(case, rng, arrays, kwargs):
    # drawn as fla's tests draw h0 (torch.randn(N, H, K, V)); one state per packed
    # sequence when the case packs several
    cu = case.param("cu_seqlens")
    n = len(cu) - 1 if cu is not None else case.batch[0]
    arrays["initial_state"] = rng.standard_normal((n, case.batch[1], case.d, case.dv))


register_feature(Feature("initial_state", ("initial_state",), build=_initial_state_build,
                         doc="the state S_0 (N, H, d_k, d_v) a recurrent kernel starts from, "
                             "one per batch entry or packed sequence"))
register_feature(Feature("cu_seqlens", ("cu_seqlens",), build=_cu_seqlens_build,
                         doc="packed sequences [0, t_1, ..., T] (B = 1), a tuple of ints as "
                             "seqlens_q/seqlens_k are (static under jit; fla's kernels take "
                             "torch.tensor(cu_seqlens)); the state restarts at each boundary"))
