"""The tile machinery of softmax attention.

Shared tile helpers (``TileSpec``, ``tile_logits``, ``tile_coverage``, ``keep_tile``)
compute one ``[q0, q1) x [k0, k1)`` tile of the logits pipeline of
:mod:`attn_ref.softmax`; the defining form (:mod:`attn_ref.softmax.reference`) is the
single tile ``[0, Nq) x [0, Nk)``. A blockwise backward can call them per tile, and
``online_forward`` (:mod:`attn_ref.softmax.online`) is the one tiled forward loop: it
returns the output and the row log-sum-exp that the blockwise backward of
:mod:`attn_ref.grad.softmax` recomputes ``P`` from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import array_api_compat

from .._common import BOTTOM_RIGHT, TOP_LEFT, and_masks, finite_max, scaled_logits

__all__ = [
    "logit_dtype",
    "TileSpec",
    "tile_coverage",
    "chunk_coverage",
    "tile_logits",
    "keep_tile",
    "dropout_scale",
    "transposed_copy",
    "row_max",
]


def _tile(x, q0, q1, k0, k1):
    """Slice a ``(..., Nq|1, Nk|1)`` broadcastable array to one tile."""
    if x is None:
        return None
    rows = slice(q0, q1) if x.shape[-2] != 1 else slice(None)
    cols = slice(k0, k1) if x.shape[-1] != 1 else slice(None)
    return x[..., rows, cols]


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
    chunk: int | None = None
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


def chunk_coverage(c, off, q0, q1, k0, k1):
    """Coverage of the chunk pattern ``(i + off) // c == j // c`` on the tile
    ``[q0, q1) x [k0, k1)``: ``"none"``, ``"all"`` or ``"partial"``, exactly."""
    first, last = q0 + off, q1 - 1 + off  # absolute positions of the tile's queries
    if last < 0:
        return "none"  # a query before position 0 is in no key's chunk
    # The rows' chunks are consecutive, so the keys they may see are one interval.
    lo, hi = (max(first, 0) // c) * c, (last // c) * c + c - 1
    if hi < k0 or lo > k1 - 1:
        return "none"
    if first >= 0 and first // c == last // c and lo <= k0 and k1 - 1 <= hi:
        return "all"
    return "partial"


def _chunked_band_coverage(c, off, lo, hi, q0, q1, k0, k1):
    """Coverage of the band ``i + lo <= j <= i + hi`` ANDed with the chunks
    ``(i + off) // c == j // c`` on the tile, exactly: the rows of one chunk see one
    interval of keys, so the tile is the union of a few sub-tiles of the band alone."""
    groups, visible = 0, False
    row = max(q0, -off)  # rows before position 0 are in no key's chunk
    while row < q1:
        start = ((row + off) // c) * c  # the chunk's first key
        end = min(q1, start + c - off)  # rows [row, end) are in this chunk
        a, b = max(k0, start), min(k1, start + c)
        if a < b and _band_coverage(lo, hi, row, end, a, b) != "none":
            visible = True
        groups += 1
        row = end
    if not visible:
        return "none"
    if q0 + off >= 0 and groups == 1 and chunk_coverage(c, off, q0, q1, k0, k1) == "all":
        return _band_coverage(lo, hi, q0, q1, k0, k1)
    return "partial"


def tile_coverage(spec, q0, q1, k0, k1):
    """``"none"`` when causal/window/chunks hide the tile ``[q0, q1) x [k0, k1)`` entirely
    (skip it), ``"all"`` when nothing in it is hidden, else ``"partial"``.

    Only statically known bounds count; per-sequence lengths make a bound ``"partial"``.
    """
    lows, highs = spec.band()
    static_lows = [b for b in lows if isinstance(b, int)]
    static_highs = [b for b in highs if isinstance(b, int)]
    lo, hi = max(static_lows, default=None), min(static_highs, default=None)
    if spec.chunk is not None and spec.static:
        cov = _chunked_band_coverage(spec.chunk, spec.offset, lo, hi, q0, q1, k0, k1)
    else:
        # per-sequence offsets place the chunks at run time: at most "partial"
        cov = _band_coverage(lo, hi, q0, q1, k0, k1)
        cov = "partial" if spec.chunk is not None and cov == "all" else cov
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
    """Bool tile: which logits the mask, causal, window, chunks and lengths allow (None = all)."""
    allowed = _tile(spec.mask, q0, q1, k0, k1)
    lows, highs = spec.band()
    need = [(b, lo) for b, lo in [(b, True) for b in lows] + [(b, False) for b in highs]
            if not isinstance(b, int)
            or _band_coverage(b if lo else None, None if lo else b, q0, q1, k0, k1) != "all"]
    chunked = spec.chunk is not None and not (
        spec.static and chunk_coverage(spec.chunk, spec.offset, q0, q1, k0, k1) == "all")
    if not need and not chunked and spec.static:
        return allowed
    qi, kj = _positions(xp, q0, q1, k0, k1, device)
    for bound, is_low in need:
        allowed = and_masks(xp, allowed, kj >= qi + bound if is_low else kj <= qi + bound)
    if chunked:
        # Llama 4's chunked attention on absolute positions: query i sits at i + Lk - Lq
        allowed = and_masks(xp, allowed, xp.floor_divide(qi + spec.offset, spec.chunk)
                            == xp.floor_divide(kj, spec.chunk))
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
    s = scaled_logits(xp, q @ kt, spec.scale)
    if spec.softcap is not None:
        s = spec.softcap * xp.tanh(s / spec.softcap)
    if spec.bias is not None:
        s = s + _tile(spec.bias, q0, q1, k0, k1)
    if spec.alibi is not None:
        s = s + _alibi_tile(xp, spec, q0, q1, k0, k1, s.dtype, device)
    if spec.softcap is not None or spec.bias is not None or spec.alibi is not None:
        # Only the top is clamped again: a -inf bias is a deliberate mask.
        s = xp.clip(s, max=xp.finfo(s.dtype).max)
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
