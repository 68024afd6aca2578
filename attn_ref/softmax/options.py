"""The options of the softmax family, checked once: the ``window``, ``chunk``, ``softcap``, dropout,
ALiBi and length checks, grouped-query heads, and ``prepare_problem``, which turns one
call's arguments into a :class:`Problem` every form computes from.
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
from .._common import causal_alignment
from .tiles import TileSpec

__all__ = [
    "check_window",
    "check_chunk",
    "check_softcap",
    "check_dropout",
    "check_alibi_slopes",
    "check_seqlens",
    "group_heads",
    "Problem",
    "prepare_problem",
    "OPTIONS_DOC",
    "with_options_doc",
]


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


def check_chunk(chunk):
    """``None`` (off) or the chunk size, a positive integer."""
    if chunk is None:
        return None
    return check_positive_int(
        "chunk", chunk, "None (off) or a positive integer chunk size (Llama 4's attention_chunk_size)")


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
        # made here, so of like's namespace by construction: not checked as a user's array
        # (a NumPy subclass such as the oracle's low-precision arrays is a library of its
        # own to check_array, and xp.asarray of a list gives a plain ndarray)
        lens = xp.asarray([operator.index(x) for x in lens], dtype=xp.int64, device=device)
    elif not array_api_compat.is_array_api_obj(lens):
        raise TypeError(
            f"{name} must be an integer array or a sequence of ints, got {type(lens).__name__}"
        )
    else:
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


def prepare_problem(q, k, v, *, mask=None, bias=None, causal=False, scale=None, window=None, chunk=None,
                    softcap=None, alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None,
                    seqlens_k=None, gqa=False, xp=None):
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
    chunk = check_chunk(chunk)
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
                    window=window, chunk=chunk, softcap=softcap, alibi=alibi, len_q=len_q, len_k=len_k,
                    keep=keep, dropout_p=dropout_p)
    return Problem(xp, qg, kg, vg, spec, tuple(batch), tuple(batch_g), gqa)


# ---------------------------------------------------------------- public functions

OPTIONS_DOC = """
    mask : bool array broadcastable to (..., Nq, Nk), optional
        True where the query may attend the key.
    bias : float array broadcastable to (..., Nq, Nk), optional
        Added to the scaled (and soft-capped) logits.
    causal : {False, True, "top-left", "bottom-right"}
        See :mod:`attn_ref.softmax`; True means "top-left".
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    window : (left, right), optional
        Sliding window, FlashAttention's ``window_size``: query ``i`` sees keys
        ``i + off - left <= j <= i + off + right`` with ``off = Lk - Lq``; ``-1`` or
        ``None`` = unbounded side. ANDed with ``causal``.
    chunk : int >= 1, optional
        Chunked attention, Llama 4's ``attention_chunk_size``: query ``i`` sees key ``j``
        only when ``(i + off) // chunk == j // chunk``, chunks counted on absolute
        positions from key 0 (query ``i`` at ``i + off``, ``off = Lk - Lq``, as the
        window). ANDed with ``causal`` (Llama 4's layers are ``causal="bottom-right"``).
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


def with_options_doc(f):
    """Put :data:`OPTIONS_DOC` (the options' parameter text, written once) in place of
    ``{options}`` in ``f``'s docstring."""
    f.__doc__ = f.__doc__.replace("    {options}", OPTIONS_DOC.strip("\n"))
    return f
