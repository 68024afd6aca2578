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
``mask``, ``causal``, ``window`` or the lengths forbid -> softmax -> dropout -> ``@ V``.

Shared tile helpers (``TileSpec``, ``tile_logits``, ``tile_coverage``, ``keep_tile``)
compute one ``[q0, q1) x [k0, k1)`` tile of that pipeline; the one-shot form is the
single tile ``[0, Nq) x [0, Nk)``. A blockwise backward can call them per tile, and
``online_forward`` is the one tiled forward loop: it returns the output and the row
log-sum-exp that the blockwise backward of :mod:`attn_ref.grad.softmax` recomputes
``P`` from.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import array_api_compat

from .._checks import (
    broadcast_batch,
    check_array,
    check_bias,
    check_flag,
    check_mask,
    check_positive_int,
    check_qkv,
    check_real,
    default_scale,
    is_integer,
    namespace,
)
from .._common import (
    BOTTOM_RIGHT,
    TOP_LEFT,
    and_masks,
    causal_alignment,
    finish_partial,
    finite_max,
    online_step,
    partial_lse,
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
    # Named steps that attn_ref.grad differentiates.
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

def _tile(x, q0, q1, k0, k1):
    """Slice a ``(..., Nq|1, Nk|1)`` broadcastable array to one tile."""
    if x is None:
        return None
    rows = slice(q0, q1) if x.shape[-2] != 1 else slice(None)
    cols = slice(k0, k1) if x.shape[-1] != 1 else slice(None)
    return x[..., rows, cols]


# ---------------------------------------------------------------- option checks


def check_window(window):
    """Normalise ``window`` to ``None`` or ``(left, right)``, ``None`` = unbounded side."""
    if window is None:
        return None
    want = "None or a pair (left, right) of integers >= -1 (-1 or None = unbounded)"
    if isinstance(window, (str, bytes)) or not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be {want}, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool):
            raise TypeError(f"window must be {want}; its {side} extent is {w!r}")
        try:
            w = operator.index(w)
        except TypeError:
            raise TypeError(f"window must be {want}; its {side} extent is {w!r}") from None
        if w < -1:
            raise ValueError(f"window must be {want}; its {side} extent is {w}")
        out.append(None if w == -1 else w)
    return None if out == [None, None] else tuple(out)


def check_softcap(softcap):
    """``None`` (off) or a finite positive float."""
    if softcap is None:
        return None
    if not 0.0 < check_real("softcap", softcap, want="None or a finite positive real number"):
        raise ValueError(
            f"softcap must be None (off) or a finite positive real number c for c tanh(s / c), "
            f"got {softcap!r}"
        )
    return float(softcap)


def check_dropout(xp, dropout_p, dropout_mask, batch, nq, nk, *, like):
    """``(p, keep)``: ``p`` in ``[0, 1)``; ``keep`` a bool mask of ``like``'s library,
    required when ``p > 0``."""
    if not 0.0 <= check_real("dropout_p", dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    keep = check_mask(xp, dropout_mask, batch, nq, nk, name="dropout_mask", like=like)
    if dropout_p > 0 and keep is None:
        raise ValueError(
            f"dropout_p={dropout_p} needs dropout_mask, a bool keep-mask broadcastable to "
            f"(..., Nq, Nk) = {tuple(batch) + (nq, nk)}: the reference cannot draw a kernel's "
            "random numbers"
        )
    return float(dropout_p), keep


def _fits_batch(name, shape, batch):
    """Does an array of ``shape`` broadcast to ``batch`` without adding dimensions?"""
    if len(shape) > len(batch):
        return False
    try:
        return broadcast_batch([("batch", tuple(batch)), (name, shape)]) == tuple(batch)
    except ValueError:
        return False


def check_alibi_slopes(xp, slopes, batch, dtype, *, like):
    """Slopes ``(H,)`` or ``(B, H)`` of ``like``'s library as a ``(..., H, 1, 1)`` array of
    ``dtype``, or None."""
    if slopes is None:
        return None
    check_array("alibi_slopes", slopes, like=like)
    shape = tuple(slopes.shape)
    if slopes.ndim < 1 or not _fits_batch("alibi_slopes", shape, batch):
        raise ValueError(
            f"alibi_slopes must have shape (H,) or (B, H), broadcastable to the (batch, head) "
            f"dimensions {tuple(batch)} of q's (..., H, Nq, d) without adding any, got shape {shape}"
        )
    slopes = slopes if slopes.dtype == dtype else xp.astype(slopes, dtype)
    return xp.reshape(slopes, shape + (1, 1))


def check_seqlens(xp, name, lens, batch, n, device=None, *, like):
    """Per-sequence lengths ``(B,)`` as an integer ``(B, 1, 1, 1)`` array of ``like``'s
    library, or None.

    A list or tuple of Python ints is taken as a 1-D array (static under ``jax.jit``).
    """
    if lens is None:
        return None
    if isinstance(lens, (list, tuple)) and all(is_integer(x) for x in lens):
        lens = xp.asarray([operator.index(x) for x in lens], dtype=xp.int64, device=device)
    if not array_api_compat.is_array_api_obj(lens):
        raise TypeError(
            f"{name} must be an integer array or a sequence of ints, got {type(lens).__name__}"
        )
    check_array(name, lens, like=like, kind="integral")
    shape = tuple(lens.shape)
    if lens.ndim < 1 or not _fits_batch(name, shape + (1,), batch):
        raise ValueError(
            f"{name} must have shape (B,) for inputs (B, H, N, d) (it broadcasts against the "
            f"axes before the head axis -3 of the (batch, head) dimensions {tuple(batch)}), "
            f"got shape {shape}"
        )
    return xp.reshape(lens, shape + (1, 1, 1))


def _check_gqa(q, k, v):
    """``(Hkv, g)`` for grouped-query attention, or raise naming the shapes."""
    for name, x, want in (("q", q, "(..., Hq, Nq, d)"), ("k", k, "(..., Hkv, Nk, d)"),
                          ("v", v, "(..., Hkv, Nk, dv)")):
        if x.ndim < 3:
            raise ValueError(
                f"with gqa=True, {name} must have shape {want} with the head axis at -3, "
                f"got shape {tuple(x.shape)}"
            )
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv:
        raise ValueError(
            f"with gqa=True, k and v must have the same number of heads Hkv on axis -3, "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if hk == 0 or hq % hk:
        raise ValueError(
            f"with gqa=True, the query heads Hq must be a multiple of the key/value heads Hkv "
            f"(axis -3): q {tuple(q.shape)} has Hq={hq}, k {tuple(k.shape)} has Hkv={hk}"
        )
    return hk, hq // hk


def group_heads(xp, x, hkv, g):
    """View a per-query-head array ``(..., Hq|1, A, B)`` as ``(..., Hkv|1, g|1, A, B)``.

    Arrays without a head axis (rank < 3) broadcast as they are. Keys and values, with
    ``Hkv`` heads, get a unit group axis instead (``xp.expand_dims(k, axis=-3)``), so
    query head ``h = r g + i`` meets key/value head ``r = h // g`` by broadcasting.
    """
    if x is None or x.ndim < 3:
        return x
    if x.shape[-3] == 1:
        return xp.expand_dims(x, axis=-3)
    return xp.reshape(x, tuple(x.shape[:-3]) + (hkv, g) + tuple(x.shape[-2:]))


# ---------------------------------------------------------------- shared tile helpers


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """Everything besides ``q``, ``k``, ``v`` that decides one logits tile.

    Array fields are "pairwise": they broadcast against ``(..., Nq, Nk)`` with the head
    axis at ``-3`` (grouped already when ``gqa=True``). ``len_q``/``len_k`` are None
    when the lengths are the static ``nq``/``nk``.
    """

    nq: int
    nk: int
    scale: float = 1.0
    mask: Any = None
    bias: Any = None
    alignment: str | None = None
    window: tuple | None = None
    softcap: float | None = None
    alibi: Any = None
    len_q: Any = None
    len_k: Any = None
    keep: Any = None
    dropout_p: float = 0.0

    @property
    def offset(self):
        """Bottom-right offset ``Lk - Lq``: an int, or an int array per sequence."""
        lk = self.nk if self.len_k is None else self.len_k
        lq = self.nq if self.len_q is None else self.len_q
        return lk - lq

    @property
    def static(self):
        return self.len_q is None and self.len_k is None

    def band(self):
        """``(lows, highs)``: key ``j`` is visible to query ``i`` iff ``j >= i + lo`` for
        every ``lo`` and ``j <= i + hi`` for every ``hi`` (ints or per-sequence arrays)."""
        lows, highs = [], []
        if self.alignment == TOP_LEFT:
            highs.append(0)
        elif self.alignment == BOTTOM_RIGHT:
            highs.append(self.offset)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                lows.append(self.offset - left)
            if right is not None:
                highs.append(self.offset + right)
        return lows, highs


def _band_coverage(lo, hi, q0, q1, k0, k1):
    """Coverage of the band ``i + lo <= j <= i + hi`` (None = open side) on the tile
    ``[q0, q1) x [k0, k1)``: ``"none"``, ``"all"`` or ``"partial"``, exactly."""
    # Rows i that have some visible key: k0 - hi <= i <= k1 - 1 - lo.
    first = q0 if hi is None else max(q0, k0 - hi)
    last = q1 - 1 if lo is None else min(q1 - 1, k1 - 1 - lo)
    if first > last or (lo is not None and hi is not None and lo > hi):
        return "none"
    if (hi is None or k1 - 1 <= q0 + hi) and (lo is None or k0 >= q1 - 1 + lo):
        return "all"
    return "partial"


def tile_coverage(spec, q0, q1, k0, k1):
    """``"none"`` when causal/window hide the tile ``[q0, q1) x [k0, k1)`` entirely (skip
    it), ``"all"`` when nothing in it is hidden, else ``"partial"``.

    Only statically known bounds count; per-sequence lengths make a bound ``"partial"``.
    """
    lows, highs = spec.band()
    static_lows = [b for b in lows if isinstance(b, int)]
    static_highs = [b for b in highs if isinstance(b, int)]
    cov = _band_coverage(max(static_lows, default=None), min(static_highs, default=None),
                         q0, q1, k0, k1)
    if cov == "none":
        return "none"
    dynamic = len(static_lows) < len(lows) or len(static_highs) < len(highs)
    if cov == "all" and spec.mask is None and spec.static and not dynamic:
        return "all"
    return "partial"


def _positions(xp, q0, q1, k0, k1, device):
    """Query rows ``(q1 - q0, 1)`` and key columns ``(1, k1 - k0)`` as integer arrays."""
    return xp.arange(q0, q1, device=device)[:, None], xp.arange(k0, k1, device=device)[None, :]


def _tile_visible(xp, spec, q0, q1, k0, k1, device):
    """Bool tile: which logits the mask, causal, window and lengths allow (None = all)."""
    allowed = _tile(spec.mask, q0, q1, k0, k1)
    lows, highs = spec.band()
    need = [(b, lo) for b, lo in [(b, True) for b in lows] + [(b, False) for b in highs]
            if not isinstance(b, int)
            or _band_coverage(b if lo else None, None if lo else b, q0, q1, k0, k1) != "all"]
    if not need and spec.static:
        return allowed
    qi, kj = _positions(xp, q0, q1, k0, k1, device)
    for bound, is_low in need:
        allowed = and_masks(xp, allowed, kj >= qi + bound if is_low else kj <= qi + bound)
    if spec.len_q is not None:
        allowed = and_masks(xp, allowed, qi < spec.len_q)
    if spec.len_k is not None:
        allowed = and_masks(xp, allowed, kj < spec.len_k)
    return allowed


def _alibi_tile(xp, spec, q0, q1, k0, k1, dtype, device):
    """ALiBi bias of one tile: ``-slope |i + off - j|`` (FlashAttention's convention)."""
    qi, kj = _positions(xp, q0, q1, k0, k1, device)
    dist = xp.astype(xp.abs(qi + spec.offset - kj), dtype)
    return -spec.alibi * dist


def tile_logits(xp, q, kt, spec, q0, k0):
    """Logits of the tile whose first query is ``q0`` and first key ``k0``, ``-inf`` where
    attention is not allowed.

    ``q (..., tq, d)`` and ``kt (..., d, tk)`` (keys already transposed) are the tile's
    rows; ``spec.scale`` multiplies ``q kt`` (pass ``1.0`` when ``q`` is pre-scaled).
    Applies, in order: scale (clamped to ``+-finfo.max``), soft-cap, bias, ALiBi (the sum
    clamped to at most ``finfo.max``), then the visibility mask. The logits are in
    :func:`logit_dtype` (float32 for float16 input).
    Returns ``(logits, allowed)``; ``allowed`` is None when every entry is allowed.
    """
    q1, k1 = q0 + q.shape[-2], k0 + kt.shape[-1]
    device = array_api_compat.device(q)
    work = logit_dtype(xp, q.dtype)
    if work != q.dtype:
        q, kt = xp.astype(q, work), xp.astype(kt, work)
    # The scale multiplies the product, not q: scale * q may overflow where scale * (q k)
    # does not, and an infinite q gives inf - inf = NaN inside the product.
    s = q @ kt
    # A logit past the dtype's range (a huge scale) becomes +-finfo.max instead of
    # +-inf, so that s - rowmax is never inf - inf (finfo.max stays the library's
    # scalar: float() of np.longdouble's is inf).
    big = xp.finfo(s.dtype).max
    if spec.scale != 1.0:
        s = xp.clip(s * spec.scale, min=-big, max=big)
    if spec.softcap is not None:
        s = spec.softcap * xp.tanh(s / spec.softcap)
    if spec.bias is not None:
        s = s + _tile(spec.bias, q0, q1, k0, k1)
    if spec.alibi is not None:
        s = s + _alibi_tile(xp, spec, q0, q1, k0, k1, s.dtype, device)
    if spec.softcap is not None or spec.bias is not None or spec.alibi is not None:
        # Only the top is clamped again: a -inf bias is a deliberate mask.
        s = xp.clip(s, max=big)
    allowed = _tile_visible(xp, spec, q0, q1, k0, k1, device)
    if allowed is not None:
        s = xp.where(allowed, s, -xp.inf)
    return s, allowed


def logit_dtype(xp, dtype):
    """The dtype logits and softmax statistics are computed in: ``dtype``, or float32 for
    a narrower one (float16 logits overflow above 65504; the probabilities, in [0, 1],
    go back to ``dtype`` before they multiply ``V``)."""
    return xp.float32 if xp.finfo(dtype).bits < 32 else dtype


def keep_tile(xp, p, spec, q0, k0):
    """``p`` times the dropout keep-mask of its tile (the ``1/(1-p)`` factor is left to
    the caller, who applies it once to the output)."""
    if spec.keep is None:
        return p
    keep = _tile(spec.keep, q0, q0 + p.shape[-2], k0, k0 + p.shape[-1])
    return p * xp.astype(keep, p.dtype)


def dropout_scale(spec):
    """The factor ``1 / (1 - dropout_p)`` that dropout applies to the output (1 without dropout)."""
    return 1.0 if spec.keep is None else 1.0 / (1.0 - spec.dropout_p)


def transposed_copy(xp, k):
    """``k^T`` as a fresh row-major array, ``(..., d, Nk)``.

    NumPy's stacked matmul calls BLAS only for operands whose matrices are row-major;
    on a transposed view it falls back to a loop several times slower. Flattening and
    reshaping forces one cheap ``O(Nk d)`` copy into row-major order on NumPy and
    CuPy, and is free (or a no-op) on the other libraries.
    """
    kt = xp.matrix_transpose(k)
    return xp.reshape(xp.reshape(kt, (-1,)), kt.shape)


def row_max(xp, s):
    """Row maximum with rows of only ``-inf`` mapped to 0, so ``exp(s - m)`` is 0 there."""
    return finite_max(xp, xp.max(s, axis=-1, keepdims=True))


# ---------------------------------------------------------------- problem set-up


@dataclasses.dataclass(frozen=True)
class Problem:
    """Checked inputs of one call: ``q``, ``k``, ``v`` (grouped views when ``gqa=True``),
    the tile spec, the output batch shape and the batch shape of the computation."""

    xp: Any
    q: Any
    k: Any
    v: Any
    spec: TileSpec
    batch: tuple
    batch_g: tuple
    grouped: bool

    def zeros(self, n):
        return self.xp.zeros(self.batch_g + (self.spec.nq, n), dtype=self.q.dtype,
                             device=array_api_compat.device(self.q))

    def ungroup(self, x):
        """``(..., Hkv, g, Nq, n)`` back to ``(..., Hq, Nq, n)``."""
        if not self.grouped:
            return x
        return self.xp.reshape(x, self.batch + tuple(x.shape[-2:]))


def prepare_problem(q, k, v, *, mask=None, bias=None, causal=False, scale=None, window=None, softcap=None,
                    alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None,
                    gqa=False, xp=None):
    """Check the inputs of the softmax functions (same options) and group GQA heads: a :class:`Problem`."""
    gqa = check_flag("gqa", gqa)
    if gqa:
        xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
        hkv, g = _check_gqa(q, k, v)
        qg, kg, vg = group_heads(xp, q, hkv, g), xp.expand_dims(k, axis=-3), xp.expand_dims(v, axis=-3)
        xp, batch_g = check_qkv(qg, kg, vg, xp=xp)
        batch = batch_g[:-2] + (hkv * g,)
    else:
        try:
            xp, batch = check_qkv(q, k, v, xp=xp)
        except ValueError as exc:
            heads = [x.shape[-3] for x in (q, k, v) if x.ndim >= 3]
            if "do not broadcast" in str(exc) and len(heads) == 3 and heads[0] % max(heads[1], 1) == 0:
                raise ValueError(f"{exc}; for grouped-query attention (Hq a multiple of Hkv on "
                                 "axis -3) pass gqa=True") from None
            raise
        qg, kg, vg, batch_g = q, k, v, batch
    nq, nk = q.shape[-2], k.shape[-2]
    mask = check_mask(xp, mask, batch, nq, nk, like=q)
    bias = check_bias(xp, bias, batch, nq, nk, q.dtype, like=q)
    alignment = causal_alignment(causal)
    scale = default_scale(q.shape[-1], scale)
    window = check_window(window)
    softcap = check_softcap(softcap)
    alibi = check_alibi_slopes(xp, alibi_slopes, batch, q.dtype, like=q)
    dropout_p, keep = check_dropout(xp, dropout_p, dropout_mask, batch, nq, nk, like=q)
    device = array_api_compat.device(q)
    len_q = check_seqlens(xp, "seqlens_q", seqlens_q, batch, nq, device, like=q)
    len_k = check_seqlens(xp, "seqlens_k", seqlens_k, batch, nk, device, like=q)
    if gqa:
        mask, bias, alibi, keep, len_q, len_k = (
            group_heads(xp, x, hkv, g) for x in (mask, bias, alibi, keep, len_q, len_k)
        )
    spec = TileSpec(nq=nq, nk=nk, scale=scale, mask=mask, bias=bias, alignment=alignment,
                    window=window, softcap=softcap, alibi=alibi, len_q=len_q, len_k=len_k,
                    keep=keep, dropout_p=dropout_p)
    return Problem(xp, qg, kg, vg, spec, tuple(batch), tuple(batch_g), gqa)


def _weights(pb):
    xp, spec = pb.xp, pb.spec
    if spec.nq == 0 or spec.nk == 0:
        return pb.zeros(spec.nk)
    s, _ = tile_logits(xp, pb.q, xp.matrix_transpose(pb.k), spec, 0, 0)
    p = xp.exp(s - row_max(xp, s))
    denom = xp.sum(p, axis=-1, keepdims=True)
    # Rows with no allowed key have p == 0 everywhere; dividing by 1 keeps them zero.
    p = p / xp.where(denom > 0, denom, xp.ones_like(denom))
    if p.dtype != pb.q.dtype:
        p = xp.astype(p, pb.q.dtype)
    p = keep_tile(xp, p, spec, 0, 0)
    drop = dropout_scale(spec)
    return p * drop if drop != 1.0 else p


def _oneshot(pb):
    if pb.spec.nq == 0 or pb.spec.nk == 0:
        return pb.zeros(pb.v.shape[-1])
    return _weights(pb) @ pb.v


def online_forward(pb, block_q, block_k):
    """The online-softmax recurrence over key blocks: ``(out, lse)`` in the grouped shapes
    ``batch_g + (Nq, dv)`` and ``batch_g + (Nq,)``.

    ``lse`` is the log-sum-exp of each row's masked logits (before dropout), ``+inf`` for
    a row with no key to attend to, so that the backward's ``exp(S - lse)`` is 0 there.
    The forward discards it (a few ``O(Nq)`` operations). ``out`` has q's dtype; ``lse``
    and the running statistics are in :func:`logit_dtype` (float32 for float16).
    """
    xp, spec = pb.xp, pb.spec
    nq, nk, dv = spec.nq, spec.nk, pb.v.shape[-1]
    device = array_api_compat.device(pb.q)
    dtype = logit_dtype(xp, pb.q.dtype)
    if nq == 0 or nk == 0:
        return pb.zeros(dv), xp.full(pb.batch_g + (nq,), xp.inf, dtype=dtype, device=device)
    # The scale is not folded into q: scale * q can overflow where scale * (q k) does not.
    kt = transposed_copy(xp, pb.k)
    v = pb.v
    outputs, lses = [], []
    for q0 in range(0, nq, block_q):
        q1 = min(q0 + block_q, nq)
        qb = pb.q[..., q0:q1, :]
        shape = pb.batch_g + (q1 - q0, 1)
        m = xp.full(shape, -xp.inf, dtype=dtype, device=device)
        l = xp.zeros(shape, dtype=dtype, device=device)
        acc = xp.zeros(pb.batch_g + (q1 - q0, dv), dtype=dtype, device=device)
        for k0 in range(0, nk, block_k):
            k1 = min(k0 + block_k, nk)
            if tile_coverage(spec, q0, q1, k0, k1) == "none":
                continue
            s, _ = tile_logits(xp, qb, kt[..., k0:k1], spec, q0, k0)
            # The normaliser counts dropped weights too (dropout acts after the softmax).
            m, l, p, alpha = online_step(xp, m, l, s)
            pv = keep_tile(xp, p, spec, q0, k0)
            acc = acc * alpha + (pv if pv.dtype == v.dtype else xp.astype(pv, v.dtype)) @ v[..., k0:k1, :]
        outputs.append(xp.astype(finish_partial(xp, l, acc), pb.q.dtype))
        lses.append(partial_lse(xp, m, l)[..., 0])
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=-1)
    drop = dropout_scale(spec)
    return (out * drop if drop != 1.0 else out), lse


# ---------------------------------------------------------------- public functions

_OPTIONS_DOC = """
    mask : bool array broadcastable to (..., Nq, Nk), optional
        True where the query may attend the key.
    bias : float array broadcastable to (..., Nq, Nk), optional
        Added to the scaled (and soft-capped) logits.
    causal : {False, True, "top-left", "bottom-right"}
        See the module docstring; True means "top-left".
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    window : (left, right), optional
        Sliding window, FlashAttention's ``window_size``: query ``i`` sees keys
        ``i + off - left <= j <= i + off + right`` with ``off = Lk - Lq``; ``-1`` or
        ``None`` = unbounded side. ANDed with ``causal``.
    softcap : float > 0, optional
        Soft-cap ``c tanh(s / c)`` of the scaled logits, before ``bias`` and ALiBi.
    alibi_slopes : float array (H,) or (B, H), optional
        Adds ``-slope_h |i + off - j|`` to the logits of query head ``h``.
    dropout_p : float in [0, 1)
        Dropout rate; kept weights are scaled by ``1 / (1 - dropout_p)``.
    dropout_mask : bool array broadcastable to (..., Nq, Nk), optional
        The keep-mask (True = kept); required when ``dropout_p > 0``.
    seqlens_q, seqlens_k : int array (B,) or sequence of ints, optional
        Per-sequence lengths of a padded batch ``(B, H, N, d)``: keys ``j >= Lk`` are
        hidden, query rows ``i >= Lq`` give zeros, offsets are per sequence.
    gqa : bool
        Grouped-query attention: ``k``, ``v`` have ``Hkv`` heads on axis -3, ``q`` has
        ``Hq = g Hkv``; query head ``h`` uses key/value head ``h // g``."""


def _doc(f):
    f.__doc__ = f.__doc__.replace("    {options}", _OPTIONS_DOC.strip("\n"))
    return f


@_doc
def attention_weights(q, k, /, *, mask=None, bias=None, causal=False, scale=None, window=None,
                      softcap=None, alibi_slopes=None, dropout_p=0.0, dropout_mask=None,
                      seqlens_q=None, seqlens_k=None, gqa=False, xp=None):
    """Softmax attention probabilities ``P = softmax(scale Q K^T + bias)``, masked.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    {options}

    Returns
    -------
    array, shape (..., Nq, Nk)
        Each row sums to 1, except rows with no allowed key, which are all zero. With
        dropout, the weights actually applied to ``V``: ``P * keep / (1 - dropout_p)``.

    Notes
    -----
    ``O(Nq Nk d)`` time, ``O(Nq Nk)`` memory.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import attention_weights
    >>> q = xp.asarray([[1.0, 0.0], [0.0, 1.0]])
    >>> p = attention_weights(q, q, causal=True)
    >>> p[0, 1] == 0.0, float(xp.sum(p[1, :]))
    (Array(True, dtype=array_api_strict.bool), 1.0)
    >>> attention_weights(xp.zeros((3, 1)), xp.zeros((3, 1)), window=(1, 0))
    Array([[1. , 0. , 0. ],
           [0.5, 0.5, 0. ],
           [0. , 0.5, 0.5]], dtype=array_api_strict.float64)
    """
    pb = prepare_problem(q, k, k, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    return pb.ungroup(_weights(pb))


@_doc
def softmax_attention(q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None,
                      softcap=None, alibi_slopes=None, dropout_p=0.0, dropout_mask=None,
                      seqlens_q=None, seqlens_k=None, gqa=False, xp=None):
    """Exact softmax attention, one-shot: ``softmax(scale Q K^T + bias) V``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
        Leading (batch, head) dimensions of ``q``, ``k``, ``v`` broadcast (with
        ``gqa=True``, the head axis -3 of ``k``, ``v`` may divide that of ``q``).
    {options}
    xp : namespace, optional
        Array namespace; inferred from the inputs by default.

    Returns
    -------
    array, shape (..., Nq, dv)
        Rows with no key to attend to are zero.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time, ``O(Nq Nk)`` extra memory: the whole logits matrix is
    materialised. Use :func:`online_softmax_attention` for long sequences. The order
    of operations and each option's convention are in the module docstring.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> q = k = xp.asarray([[0.0, 0.0], [0.0, 0.0]])
    >>> v = xp.asarray([[1.0], [3.0]])
    >>> softmax_attention(q, k, v)[:, 0]    # equal logits: the mean of v
    Array([2., 2.], dtype=array_api_strict.float64)

    KV-cache decoding with grouped-query heads: two new queries per sequence against
    caches holding 3 and 5 tokens (the rest of the cache is padding).

    >>> q = xp.zeros((2, 4, 2, 8))                # (B, Hq, Nq, d)
    >>> k = xp.zeros((2, 2, 6, 8))                # (B, Hkv, Ncache, d)
    >>> v = xp.reshape(xp.arange(2 * 2 * 6 * 1.0), (2, 2, 6, 1))
    >>> o = softmax_attention(q, k, v, causal="bottom-right", gqa=True,
    ...                       seqlens_k=xp.asarray([3, 5]))
    >>> o[0, 0, :, 0], o[1, 3, :, 0]   # query i sees cache keys j <= i + Lk - Nq
    (Array([0.5, 1. ], dtype=array_api_strict.float64), Array([19.5, 20. ], dtype=array_api_strict.float64))
    """
    pb = prepare_problem(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    return pb.ungroup(_oneshot(pb))


def online_softmax_attention(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None,
    gqa=False, block_q=512, block_k=1024, xp=None,
):
    """Exact softmax attention by the online-softmax recurrence over key blocks.

    For each query block, key/value blocks are visited in order while carrying the
    running row maximum ``m``, normaliser ``l`` and unnormalised output ``acc``::

        m' = max(m, rowmax(S_j));  a = exp(m - m')
        l' = a l + rowsum(exp(S_j - m'));  acc' = a acc + (exp(S_j - m') * keep_j) V_j

    and the output is ``acc / l`` (times ``1 / (1 - dropout_p)`` with dropout). This is
    the algorithm of Rabe & Staats (2021) and FlashAttention (Dao et al. 2022); it is
    exact, not an approximation.

    Parameters
    ----------
    q, k, v, mask, bias, causal, scale, window, softcap, alibi_slopes, dropout_p, \
dropout_mask, seqlens_q, seqlens_k, gqa, xp
        As in :func:`softmax_attention`.
    block_q, block_k : int
        Tile sizes. Sequence lengths need not be multiples of them. Tiles that the
        causal mask or the window hide entirely are skipped (bounds that depend on
        ``seqlens_q``/``seqlens_k`` are only known at run time and skip nothing). With
        ``gqa=True`` the ``g`` query heads of a group share each key/value tile.

    Returns
    -------
    array, shape (..., Nq, dv)
        Equal to :func:`softmax_attention` up to rounding.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time; ``O(block_q block_k)`` extra memory per batch entry
    plus ``O(Nq dv)`` for the output, never ``O(Nq Nk)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import online_softmax_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(30.0)), (5, 6))
    >>> a = online_softmax_attention(x, x, x, causal=True, block_q=2, block_k=3)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x, causal=True))) < 1e-14)
    True
    >>> a = online_softmax_attention(x, x, x, window=(2, 1), softcap=5.0, block_q=2, block_k=2)
    >>> b = softmax_attention(x, x, x, window=(2, 1), softcap=5.0)
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    pb = prepare_problem(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    out, _ = online_forward(pb, block_q, block_k)
    return pb.ungroup(out)


# ---------------------------------------------------------------- packed variable length


def cu_offsets(name, cu, total, tensor):
    """``cu_seqlens`` as Python ints: 1-D, starting at 0, non-decreasing, ending at ``total``."""
    if array_api_compat.is_array_api_obj(cu):
        cxp = array_api_compat.array_namespace(cu)
        if cu.ndim != 1:
            raise ValueError(f"{name} must be 1-D, shape (B + 1,), got shape {tuple(cu.shape)}")
        if not cxp.isdtype(cu.dtype, "integral"):
            raise TypeError(f"{name} must have an integer dtype, got {cu.dtype}")
        # The offsets plan the tiles, so they are read on the host (FlashAttention
        # likewise takes max_seqlen as a host integer). Under jax.jit pass a tuple.
        vals = [int(cu[i]) for i in range(cu.shape[0])]
    elif isinstance(cu, (list, tuple)) and all(is_integer(c) for c in cu):
        vals = [operator.index(c) for c in cu]
    else:
        raise TypeError(
            f"{name} must be a 1-D integer array or a sequence of ints [0, n1, n1 + n2, ...], "
            f"got {type(cu).__name__}"
        )
    if not vals or vals[0] != 0:
        raise ValueError(
            f"{name} must be cumulative offsets [0, n1, n1 + n2, ..., total] starting at 0, "
            f"got {vals}"
        )
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing (cumulative sequence lengths), but "
                f"{name}[{i - 1}]={vals[i - 1]} > {name}[{i}]={vals[i]}"
            )
    if vals[-1] != total:
        raise ValueError(
            f"{name} must end at the number of packed tokens, {tensor}.shape[0] = {total}, "
            f"got {name}[-1]={vals[-1]}"
        )
    return vals


def unpack_index(offsets, width):
    """Gather indices ``(B * width,)`` taking packed rows to a padded ``(B, width)`` grid;
    padding slots repeat a valid row (their results are masked or dropped)."""
    idx = []
    for start, stop in zip(offsets[:-1], offsets[1:]):
        n = stop - start
        idx.extend(start + min(i, n - 1) if n else 0 for i in range(width))
    return idx


def packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, extra=()):
    """Check the packed ``(total, H, d)`` layout; return the offsets and sequence lengths.

    ``extra`` holds further ``(name, array, expected shape)`` triples (the backward's
    ``do``). Returns ``(cu_q, cu_k, lengths_q, lengths_k)`` as host lists.
    """
    for name, x, want in (("q", q, "(total_q, Hq, d)"), ("k", k, "(total_k, Hkv, d)"),
                          ("v", v, "(total_k, Hkv, dv)"), *extra):
        if x.ndim != 3:
            raise ValueError(f"{name} must have the packed shape {want}, got shape {tuple(x.shape)}")
    cq = cu_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    ck = cu_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
            f"got {len(cq) - 1} and {len(ck) - 1}"
        )
    lq = [b - a for a, b in zip(cq[:-1], cq[1:])]
    lk = [b - a for a, b in zip(ck[:-1], ck[1:])]
    return cq, ck, lq, lk


def varlen_attention(q, k, v, /, *, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                     window=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                     dropout_mask=None, online=False, block_q=512, block_k=1024, xp=None):
    """Softmax attention over a packed batch of variable-length sequences.

    FlashAttention's ``flash_attn_varlen_func`` layout: the tokens of ``B`` sequences
    are concatenated along axis 0 and ``cu_seqlens`` holds the cumulative offsets
    ``[0, n_1, n_1 + n_2, ..., total]``; sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]``. No token attends across a sequence boundary:
    the result equals running each sequence alone through :func:`softmax_attention`
    (with ``gqa=True``), and positions for ``causal``, ``window`` and ALiBi are local to
    each sequence (``off = Lk_b - Lq_b``).

    Parameters
    ----------
    q : array, shape (total_q, Hq, d)
    k : array, shape (total_k, Hkv, d)
    v : array, shape (total_k, Hkv, dv)
        ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention, as in
        FlashAttention: query head ``h`` uses key/value head ``h // (Hq / Hkv)``).
    cu_seqlens_q, cu_seqlens_k : 1-D integer array or sequence of ints, (B + 1,)
        Cumulative offsets, starting at 0, non-decreasing, ending at ``total_q`` /
        ``total_k``. They are read on the host (pass a tuple under ``jax.jit``).
    causal, scale, window, softcap, dropout_p
        As in :func:`softmax_attention`, per sequence.
    alibi_slopes : float array (Hq,) or (B, Hq), optional
    dropout_mask : bool array, optional
        Keep-mask in the padded layout ``(B, Hq, max_seqlen_q, max_seqlen_k)`` of
        FlashAttention's returned ``S_dmask`` (sliced to the longest sequences).
    online : bool
        Use :func:`online_softmax_attention` with ``block_q``, ``block_k`` instead of the
        one-shot form.

    Returns
    -------
    array, shape (total_q, Hq, dv)
        Query rows of a sequence with no keys are zero.

    Notes
    -----
    Sequences are gathered into a padded ``(B, H, max_seqlen, d)`` batch and run with
    ``seqlens_q``/``seqlens_k``; the extra memory is that padded copy (``O(B max_seqlen
    d)``) plus what the chosen form needs.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention, varlen_attention
    >>> x = xp.reshape(xp.sin(xp.arange(5 * 2 * 3.0)), (5, 2, 3))   # lengths 2 and 3
    >>> o = varlen_attention(x, x, x, cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 2, 5])
    >>> alone = softmax_attention(*(xp.permute_dims(x[2:, ...], (1, 0, 2)),) * 3)
    >>> bool(xp.max(xp.abs(o[2:, ...] - xp.permute_dims(alone, (1, 0, 2)))) < 1e-15)
    True
    """
    xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
    online = check_flag("online", online)
    cq, ck, lq, lk = packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k)
    device = array_api_compat.device(q)
    nb = len(cq) - 1
    wq, wk = max(lq, default=0), max(lk, default=0)

    def unpack(x, offsets, width):
        if x.shape[0] == 0:
            return xp.zeros((nb, x.shape[1], width, x.shape[2]), dtype=x.dtype, device=device)
        idx = xp.asarray(unpack_index(offsets, width), dtype=xp.int64, device=device)
        x = xp.reshape(xp.take(x, idx, axis=0), (nb, width) + tuple(x.shape[1:]))
        return xp.permute_dims(x, (0, 2, 1, 3))

    qp, kp, vp = unpack(q, cq, wq), unpack(k, ck, wk), unpack(v, ck, wk)
    lens_q = xp.asarray(lq, dtype=xp.int64, device=device)
    lens_k = xp.asarray(lk, dtype=xp.int64, device=device)
    kw = dict(causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
              dropout_p=dropout_p, dropout_mask=dropout_mask, seqlens_q=lens_q, seqlens_k=lens_k,
              gqa=True, xp=xp)
    pb = prepare_problem(qp, kp, vp, **kw)
    if online:
        check_positive_int("block_q", block_q)
        check_positive_int("block_k", block_k)
        out = pb.ungroup(online_forward(pb, block_q, block_k)[0])
    else:
        out = pb.ungroup(_oneshot(pb))
    hq, dv = q.shape[1], v.shape[2]
    if q.shape[0] == 0:
        return xp.zeros((0, hq, dv), dtype=q.dtype, device=device)
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (nb * wq, hq, dv))
    rows = [b * wq + i for b in range(nb) for i in range(lq[b])]
    return xp.take(out, xp.asarray(rows, dtype=xp.int64, device=device), axis=0)


def _register():
    from ..registry import Variant, register

    register(Variant(
        name="softmax", fn=softmax_attention, family="softmax", exact=True, causal=True,
        time="O(N^2 d)", memory="O(N^2)", weights=attention_weights,
        summary="one-shot softmax(QK^T/sqrt(d))V",
    ))
    register(Variant(
        name="online_softmax", fn=online_softmax_attention, family="softmax", exact=True,
        causal=True, time="O(N^2 d)", memory="O(N)", weights=attention_weights,
        options={"block_q": 16, "block_k": 24},
        summary="online-softmax (FlashAttention) recurrence over key blocks",
    ))


_register()
