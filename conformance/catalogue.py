"""Conformance cases: data, drawn deterministically from a seed.

A :class:`Case` is a frozen description - shapes, input distribution, mask kind,
causal alignment, bias, scale - and :meth:`Case.inputs` turns it into host float64
arrays in the canonical ``(B, H, N, d)`` layout. Catalogues are plain lists per suite:

``quick``
    A dozen small cases (seconds).
``standard``
    The default: lengths 1, primes and tails around block sizes (63, 65, 127, 129,
    1000), head dims 1..256 including 80 and 96, ``Nq != Nk``, batch/head
    broadcasting, large logits, near-ties, one-hot rows, constant keys, padding and
    random masks, fully masked rows, causal in both alignments, additive bias, long
    sequences; batch 3 x 5 heads for every feature set, ``Nk = 4096`` with and
    without a causal mask, ``Nq != Nk`` both ways at lengths >= 1000; ``q, k, v`` as
    strided views of packed, transposed and sliced buffers (:mod:`conformance.noncontiguous`).
``exhaustive``
    ``standard`` plus longer sequences; :func:`conformance.verify` then runs a
    hypothesis search (:func:`case_strategy`) that shrinks a failure to the smallest
    case that still fails.

Extension points
----------------
* **Features** (:mod:`conformance.features`): a kernel capability that a case may
  need; adding one is a :func:`conformance.features.register_feature` call plus the
  cases that use it.
* **Cases**: append :class:`Case` objects to :data:`CATALOGUE` under a suite name;
  feature-specific settings go in ``Case.params`` (a tuple of ``(key, value)`` pairs,
  read with :meth:`Case.param`), e.g. ``(("kv_heads", 2), ("window", (16, 0)))``;
  variant options a case sets go in ``Case.options``, with ``Case.variant`` naming
  the variant they are for.
* **Outputs**: a case yields one or more named outputs (``"out"``; the gradient
  checks add ``"dq"``, ``"dk"``, ``"dv"``); each gets its own tolerance and report row.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .calling import reference_features
from .features import FEATURES

__all__ = [
    "Case",
    "CATALOGUE",
    "SUITES",
    "cases",
    "case_gates",
    "case_strategy",
    "takes_gates",
    "with_tag",
]

SUITES = ("quick", "standard", "exhaustive")
# offset_values: query size (logits ~ N(0, 0.01): weights within a few % of uniform), the
# values' common offset and spread
_OFFSET_Q, _OFFSET_V, _OFFSET_SPREAD = 0.1, 4.0, 0.5
# small_qk: the size of q and k (norms ~3e-3 at d = 16..64, where an l2 normalisation's
# eps of 1e-6 moves the result by a few per cent)
_SMALL_QK = 1e-3
#: slow-decay cases: the recurrent family's log gates ``g`` divided by this, as fla's GLA
#: layer divides ``logsigmoid`` by its ``gate_logit_normalizer`` (16 by default); 64 gives
#: -0.013 a step on average, the long-memory heads of Mamba-2 (``dt A`` with ``dt`` drawn
#: in [1e-3, 0.1]) and Gated DeltaNet
GATE_NORMALIZER = 64
#: the long-memory gradient case's divisor of the log gates (:func:`_recurrent`)
LONG_MEMORY_GATES = 1024
#: strong-gate cases (param ``gates``, :func:`case_gates`): the range of a strong log gate
#: (``e^-20 ~ 2e-9`` to ``e^-5 ~ 7e-3``). fla's ``logsigmoid(randn)`` draw stays above
#: about -4.5, so a kernel clipping the log gates at -5, or flushing ``exp(g) < 1e-4`` to 0,
#: computed the same function on every other case
STRONG_GATES = (-20.0, -5.0)
#: strong-gate cases: the log gates that erase the no-decay heads' state (decays of 6e-6
#: to 9e-4, on both sides of a flush below 1e-4, all below a clip at -5)
ERASING_GATES = (-12.0, -7.0)
#: the long-chunk case's log gates: uniform in this range, one step in ten exactly 0; a
#: chunk of 64 sums to about -1e3, past ``ln`` of float64's smallest number (-744), so a
#: decay formed as ``exp(G_i) / exp(G_j)`` from running sums is ``0 / 0`` there
LONG_CHUNK_GATES = (-20.0, -11.0)
#: rising: the per-key rise of the logits, spread geometrically over the query rows from
#: the first to the second (logit units per key)
_RISING_RATES = (1e-9, 1e-4)
#: fading_keys: the keys' size at the first key (falling linearly to 0 at the last)
_FADING_KEYS = 7.0
DISTRIBUTIONS = ("normal", "large_logits", "near_ties", "one_hot", "constant_keys", "offset_values",
                 "small_qk", "rising", "fading_keys")
MASKS = (None, "padding", "random", "fully_masked_rows")
ALIGNMENTS = (None, "top-left", "bottom-right")


@dataclass(frozen=True)
class Case:
    """One conformance case (shapes and kinds; the numbers come from :meth:`inputs`).

    Attributes
    ----------
    batch : (B, H)
        Leading shape of ``q`` (and of ``k``, ``v`` unless ``kv_batch`` is given).
    nq, nk, d, dv : int
        Query length, key length, head dim of q/k, head dim of v.
    dist : str
        Input distribution: ``"normal"``, ``"large_logits"`` (logits of magnitude
        ~1e4, ~1e3 in float16: overflow without max-subtraction), ``"near_ties"``,
        ``"one_hot"`` (peaked rows), ``"constant_keys"`` (uniform rows),
        ``"offset_values"`` (near-uniform rows over values with a common offset: where a
        low-precision accumulator of ``P V`` or of the row sum shows), ``"small_qk"``
        (``q`` and ``k`` of norm ~1e-3 sqrt(d), one key and one query exactly zero: where
        the eps of an l2 normalisation shows, and ``x / |x|`` without one is NaN),
        ``"rising"`` (each row's logits rise along the keys by a fixed step, from
        ``1e-9`` to ``1e-4`` per key over the rows, and the values by a ramp: where a
        tiled kernel's running maximum creeps up block after block), ``"fading_keys"``
        (keys scaled from 7 at the first to 0 at the last: FAVOR+'s key exponents
        ``w . k - |k|^2 / 2`` rise from about -100 to 0 along the sequence, so that a
        causal kernel stabilising its keys by a maximum over all of them, the future's
        included, underflows the earlier ones).
    mask : None, "padding", "random" or "fully_masked_rows"
    causal : None, "top-left" or "bottom-right"
    bias : bool
        An additive logits bias, shape ``(1, H, Nq, Nk)``.
    scale : float or None
        An explicit logit scale (None: the kernel's default ``1/sqrt(d)``).
    kv_batch : (B', H') or None
        Leading shape of ``k`` and ``v`` when it broadcasts against ``q``'s.
    params : tuple of (key, value)
        Feature-specific settings (see the module docstring).
    features : tuple of str
        Extra feature names this case needs beyond those implied by the fields.
    tag : str
        What the case is about, first part of its id.
    family : str or None
        The :mod:`attn_ref.registry` family the case is for (``"recurrent"``: chunk
        boundaries, packed sequences, initial states); None: every variant. Not part of
        the id: a case of a family is run only for that family's variants, so other
        variants' suites (and their cost) are unchanged.
    variant : str, tuple of str, or None
        The registered variant (or variants) the case is for; None: every variant (of
        ``family``). Like ``family``, not part of the id.
    options : tuple of (key, value)
        Variant options the case sets (a sparse pattern's window, block size, global
        tokens...), over the registered ones and those of ``options=``: a kernel that
        hard-codes the registered values computes the same function on every other case.
        Passed to the kernel as every option is, by name; a kernel whose signature lacks
        one is ``n/a`` on the case (it computes the function of its one value).
    grads_only : bool
        A case for the gradient rows: in a suite only when gradients are judged
        (``cases(..., grads=True)``, ``verify(grads=True)``), where its forward rows are
        judged with them; the forward's cases cover its forward at no extra cost.
    forward_only : bool
        A case for the forward alone: its gradient rows are ``n/a`` (``rising``: the
        fused gradient bounds do not model its saved output's error, see
        :mod:`conformance.grads`).
    """

    tag: str
    batch: tuple = (1, 1)
    nq: int = 16
    nk: int = 16
    d: int = 16
    dv: int = 16
    dist: str = "normal"
    mask: str | None = None
    causal: str | None = None
    bias: bool = False
    scale: float | None = None
    kv_batch: tuple | None = None
    params: tuple = ()
    features: tuple = ()
    family: str | None = None
    variant: str | None = None
    options: tuple = ()
    grads_only: bool = False
    forward_only: bool = False

    def __post_init__(self):
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {self.dist!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.causal not in ALIGNMENTS:
            raise ValueError(f"causal must be one of {ALIGNMENTS}, got {self.causal!r}")

    @property
    def id(self) -> str:
        b, h = self.batch
        parts = [self.tag, f"b{b}h{h}", f"q{self.nq}k{self.nk}", f"d{self.d}"
                 + (f"v{self.dv}" if self.dv != self.d else "")]
        if self.kv_batch is not None:
            parts.append("kv{}x{}".format(*self.kv_batch))
        if self.dist != "normal":
            parts.append(self.dist)
        if self.causal:
            parts.append("causal-" + {"top-left": "tl", "bottom-right": "br"}[self.causal])
        if self.mask:
            parts.append("mask-" + self.mask)
        if self.bias:
            parts.append("bias")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        parts += [f"{k}{_fmt(v)}" for k, v in self.params + self.options]
        return "/".join(parts[:1]) + ":" + "-".join(parts[1:])

    def belongs_to(self, variant) -> bool:
        """Whether the case is one of ``variant``'s: its family's (:attr:`family`) and
        its own (:attr:`variant`), or every variant's. ``variant`` a registered
        :class:`attn_ref.registry.Variant`."""
        mine = (self.variant,) if isinstance(self.variant, str) else self.variant
        return self.family in (None, variant.family) and (mine is None or variant.name in mine)

    def param(self, key, default=None):
        return dict(self.params).get(key, default)

    @property
    def needs(self) -> frozenset:
        """Feature names a kernel must support to take this case."""
        out = set(self.features)
        if self.mask:
            out.add("mask")
        if self.bias:
            out.add("bias")
        if self.causal:
            out.add("causal")
        if self.scale is not None:
            out.add("scale")
        if self.kv_batch is not None:
            out.add("broadcast")
        if self.dv != self.d:
            out.add("value_dim")
        return frozenset(out)

    @property
    def size(self) -> int:
        """Rough work measure (multiply-adds), used to order and to time cases."""
        b, h = self.batch
        return b * h * self.nq * self.nk * (self.d + self.dv)

    def rng(self, seed: int) -> np.random.Generator:
        # Stable across runs and Python versions: crc32 of the id, not hash().
        return np.random.default_rng([int(seed), zlib.crc32(self.id.encode())])

    def inputs(self, seed: int = 0, dtype: str = "float32") -> tuple[dict, dict]:
        """Host inputs of this case: ``(arrays, kwargs)``.

        ``arrays`` holds float64 (or bool) NumPy arrays in the canonical layout:
        ``q (B, H, Nq, d)``, ``k``/``v`` ``(B', H', Nk, d|dv)``, and ``mask``/``bias``
        ``(B|1, H|1, Nq, Nk)`` when the case has them. ``kwargs`` holds plain values
        (``causal``, ``scale``). ``dtype`` only tunes the large-logit magnitude so that
        float16 does not overflow in ``Q K^T`` itself; rounding happens later.
        """
        rng = self.rng(seed)
        b, h = self.batch
        kb, kh = self.kv_batch or self.batch
        q = rng.standard_normal((b, h, self.nq, self.d))
        k = rng.standard_normal((kb, kh, self.nk, self.d))
        v = rng.standard_normal((kb, kh, self.nk, self.dv))
        d = self.d
        if self.dist == "large_logits":
            # Logits ~ target with the default scale; float16 keeps |Q K^T| < 65504.
            target = 1e3 if dtype == "float16" else 1e4
            s = math.sqrt(target / 3.0)
            q, k = q * s, k * s
            if dtype == "float16":
                # unscaled q.k must stay below float16's max with room to spare
                lim = 3e4 / (3.0 * math.sqrt(d) * 1.0)
                f = min(1.0, math.sqrt(lim / (s * s)))
                q, k = q * f, k * f
        elif self.dist == "near_ties":
            # pairs of keys that differ by 1e-3: logits tie to ~3 digits
            base = rng.standard_normal((kb, kh, (self.nk + 1) // 2, d)) * 2.0
            k = np.repeat(base, 2, axis=-2)[..., : self.nk, :]
            k = k + 1e-3 * rng.standard_normal(k.shape)
            q = q * 2.0
        elif self.dist == "one_hot":
            # each query is a multiple of one key: its own logit is ~30, the others
            # ~30/sqrt(d) * N(0, 1), so the row is (nearly) one-hot
            idx = rng.integers(0, self.nk, size=self.nq)
            kk = np.broadcast_to(k, (b, h) + k.shape[2:])[..., idx, :]
            norm = np.linalg.norm(kk, axis=-1, keepdims=True) + 1e-12
            q = kk / norm * 30.0 * math.sqrt(d) + 0.01 * rng.standard_normal(kk.shape)
        elif self.dist == "constant_keys":
            k = np.broadcast_to(k[..., :1, :], k.shape).copy()
        elif self.dist == "offset_values":
            # Near-uniform rows over values with a common offset: the running sum P V
            # grows to ~Nk times each output, so an accumulator kept in a low-precision
            # dtype rounds at the sum's ulp, not the output's, once per key block.
            q = q * _OFFSET_Q
            v = _OFFSET_V + v * _OFFSET_SPREAD
        elif self.dist == "small_qk":
            # fla's l2norm is x / sqrt(|x|^2 + 1e-6): on rows of norm ~1e-3 sqrt(d) a kernel
            # with another eps (or none: 0 / 0 on the zero rows) computes another function,
            # where on N(0, 1) rows the difference is below float32's resolution
            q, k = q * _SMALL_QK, k * _SMALL_QK
            k[..., 0, :] = 0.0
            q[..., min(1, self.nq - 1), :] = 0.0
        elif self.dist == "rising":
            # Logits scale (q_i . base) + rate_i j: every row's maximum rises a little at
            # each key block, by less than any threshold on some rows (the rates spread
            # geometrically over the rows). An online softmax that skips the rescale of
            # its running sums when the maximum moved by less than a threshold (a "fast
            # path", still taking the new maximum) then weighs the early blocks wrongly,
            # which the values' ramp along the keys turns into an error of the output;
            # on random logits the maximum settles within a few blocks and such a kernel
            # passed every case. Key dimension 0 carries the position.
            base = rng.standard_normal((kb, kh, 1, d))
            k = np.repeat(base, self.nk, axis=-2)
            k[..., 0] += np.arange(self.nk) / self.nk
            lo, hi = _RISING_RATES
            rates = np.geomspace(lo, hi, self.nq) if self.nq > 1 else np.array([hi])
            q[..., 0] = rates * self.nk * math.sqrt(d)  # the default scale 1/sqrt(d)
            v = v + np.linspace(-1.0, 1.0, self.nk)[:, None]
        elif self.dist == "fading_keys":
            k = k * np.linspace(_FADING_KEYS, 0.0, self.nk)[:, None]
        for dst, src in self.param("copy_rows", ()):
            # repeated tokens (padding, a repeated prompt): query row dst is row src exactly
            q[..., dst, :] = q[..., src, :]
        arrays = {"q": q, "k": k, "v": v}
        kwargs: dict[str, Any] = {}
        if self.mask is not None:
            arrays["mask"] = _mask(self, rng)
        if self.bias:
            # (1, H, Nq, Nk) unless the case asks for one bias per batch entry
            # (param "bias_batch" = B): a kernel must read the bias's batch index too
            arrays["bias"] = rng.standard_normal((self.param("bias_batch", 1), h, self.nq, self.nk))
        if self.causal is not None:
            kwargs["causal"] = self.causal
        if self.scale is not None:
            kwargs["scale"] = float(self.scale)
        for name in sorted(self.needs):
            feat = FEATURES.get(name)
            if feat is not None and feat.build is not None:
                feat.build(self, rng, arrays, kwargs)
        return arrays, kwargs


def case_gates(case: Case, g, seed: int = 0) -> np.ndarray:
    """The log gates of ``case`` made from the variant's own draw ``g`` (``(B, H, T)`` or
    ``(B, H, T, d_k)``, float64): unchanged unless the case has a ``gates`` param.

    ``"strong"`` mixes three kinds of head, by head index modulo 3 (so a kernel must get
    each right on its own head): (0) no decay (``g = 0`` exactly) with a gate uniform in
    :data:`ERASING_GATES` on one step in ten, where the state grows over many steps and is
    then all but erased, so a clipped or flushed gate leaks a large state into the next
    ones; (1) a strong gate (uniform in :data:`STRONG_GATES`) on every step; (2) the
    variant's draw with a quarter of its steps 0 and a quarter strong. ``"long-chunk"``:
    uniform in :data:`LONG_CHUNK_GATES`, one step in ten 0. The choices come from a stream
    of their own (the seed, the case id), so the draws of ``q``, ``k``, ``v`` do not
    depend on them.
    """
    kind = case.param("gates")
    g = np.array(g, dtype=np.float64)
    if kind is None:
        return g
    rng = np.random.default_rng([int(seed), zlib.crc32(case.id.encode()), 1])
    u = rng.random(g.shape)
    if kind == "long-chunk":
        return np.where(u < 0.1, 0.0, rng.uniform(*LONG_CHUNK_GATES, g.shape))
    if kind != "strong":
        raise ValueError(f"gates must be 'strong' or 'long-chunk', got {kind!r}")
    strong = rng.uniform(*STRONG_GATES, g.shape)
    head = np.arange(g.shape[1]).reshape((1, -1) + (1,) * (g.ndim - 2)) % 3
    # heads 0, 3, ...: no decay, now and then (nearly) erased by decays of 6e-6 to 9e-4
    out = np.where(u < 0.1, rng.uniform(*ERASING_GATES, g.shape), 0.0)
    out = np.where(head == 1, strong, out)
    mixed = np.where(u < 0.25, 0.0, np.where(u < 0.5, strong, g))
    return np.where(head == 2, mixed, out)


def _fmt(v):
    if isinstance(v, (tuple, list)):
        return "x".join(_fmt(x) for x in v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _mask(case, rng):
    b, h = case.batch
    nq, nk = case.nq, case.nk
    if case.mask == "padding":
        # key padding per batch entry, broadcast over heads and queries
        m = np.ones((b, 1, 1, nk), dtype=bool)
        for i in range(b):
            keep = max(1, nk - int(rng.integers(0, max(1, nk // 2) + 1)))
            m[i, 0, 0, keep:] = False
        return m
    m = rng.random((b, h, nq, nk)) < 0.7
    if case.mask == "fully_masked_rows":
        rows = rng.random((b, h, nq)) < 0.25
        rows[0, 0, min(1, nq - 1)] = True  # at least one
        m = np.where(rows[..., None], False, m)
    else:
        # a random mask keeps every row attendable so it tests the mask, not the
        # fully-masked-row convention
        m[..., 0] = m[..., 0] | ~m.any(-1)
    return m


# ---------------------------------------------------------------------------- catalogue


def _quick():
    C = Case
    return [
        C("basic", (2, 3), 17, 17, 16, 16),
        C("cross", (1, 2), 9, 23, 8, 12),
        C("cross", (1, 2), 23, 9, 8, 4),
        C("length1", (1, 1), 1, 1, 4, 4),
        C("length1", (1, 2), 1, 7, 8, 8),
        C("causal", (1, 2), 13, 21, 8, 8, causal="top-left"),
        C("causal", (1, 2), 13, 21, 8, 8, causal="bottom-right"),
        C("causal", (2, 1), 16, 16, 8, 8, causal="top-left"),
        C("mask", (2, 2), 16, 16, 8, 8, mask="random"),
        C("mask", (2, 2), 12, 19, 8, 8, mask="padding"),
        C("bias", (1, 2), 16, 16, 8, 8, bias=True),
        C("scale", (1, 1), 16, 16, 8, 8, scale=0.3),
        C("large-logits", (1, 2), 16, 16, 8, 8, dist="large_logits"),
        C("fully-masked", (1, 2), 16, 16, 8, 8, mask="fully_masked_rows"),
    ]


def _standard():
    C = Case
    out = []
    # lengths: 1, primes, tails around the usual block sizes
    for n in (2, 3, 7, 31, 61, 63, 64, 65, 127, 129):
        out.append(C("length", (1, 2), n, n, 32, 32))
    out += [C("length", (1, 1), 257, 257, 16, 16), C("length", (1, 1), 1, 65, 16, 16)]
    # head dims 1..256 including 80 and 96
    for d in (1, 2, 80, 96, 128, 256):
        out.append(C("headdim", (1, 2), 33, 33, d, d))
    out.append(C("headdim", (1, 1), 33, 40, 64, 96))
    # cross-attention both ways and causal in both alignments
    for nq, nk in ((63, 129), (129, 63), (65, 65), (1, 100)):
        out.append(C("cross", (2, 1), nq, nk, 32, 32))
        out.append(C("causal", (2, 1), nq, nk, 32, 32, causal="top-left"))
        out.append(C("causal", (2, 1), nq, nk, 32, 32, causal="bottom-right"))
    # batch and head broadcasting of k and v
    out += [C("broadcast", (2, 3), 17, 19, 16, 16, kv_batch=(1, 3)),
            C("broadcast", (2, 3), 17, 19, 16, 16, kv_batch=(2, 1))]
    # input distributions that break kernels
    out += [
        C("large-logits", (1, 2), 64, 64, 64, 64, dist="large_logits"),
        C("large-logits", (1, 2), 65, 63, 64, 64, dist="large_logits", causal="top-left"),
        # large logits over 1000 keys, several key blocks and split-KV partials: a merge
        # whose weights exp(lse_r - lse_0) are taken from the first partial instead of
        # the largest overflows to NaN here and nowhere else (exact softmax only: the
        # approximate variants' features and projections of such logits say nothing new)
        C("large-logits", (1, 2), 16, 1000, 32, 32, dist="large_logits", family="softmax"),
        C("near-ties", (1, 2), 64, 64, 32, 32, dist="near_ties"),
        C("one-hot", (1, 2), 65, 65, 64, 64, dist="one_hot"),
        C("constant-keys", (1, 2), 65, 65, 32, 32, dist="constant_keys"),
    ]
    # masks, fully masked rows, bias, scale and their combinations
    out += [
        C("mask", (2, 2), 64, 64, 32, 32, mask="random"),
        C("mask", (2, 2), 63, 127, 32, 32, mask="padding"),
        C("fully-masked", (2, 2), 33, 47, 32, 32, mask="fully_masked_rows"),
        C("fully-masked", (1, 1), 40, 20, 16, 16, causal="bottom-right"),
        C("bias", (2, 2), 65, 65, 32, 32, bias=True),
        C("combo", (2, 2), 65, 129, 32, 32, mask="random", bias=True, causal="top-left"),
        C("combo", (1, 2), 129, 65, 32, 32, mask="padding", bias=True, causal="bottom-right"),
        C("scale", (1, 2), 65, 65, 32, 32, scale=0.05),
        C("scale", (1, 2), 65, 65, 32, 32, scale=1.0, causal="top-left"),
    ]
    # long sequences, where low-precision accumulation shows
    out += [
        C("long", (1, 1), 1000, 1000, 64, 64),
        C("long", (1, 1), 1000, 1000, 64, 64, causal="top-left"),
        C("long", (1, 1), 1000, 1000, 64, 64, dist="offset_values"),
    ]
    return out + _ranges()


def _ranges():
    """Batch, head and length ranges (issue 14): the indices and lengths kernels get wrong.

    A kernel that declares any one feature (or none) meets a batch of 3 and 5 heads -
    batch index 2 and head index 4, past the grids and strides of two batch entries and
    four heads - in a case that needs only that feature. Keys reach 4096 (past fixed
    key buffers of 1024 and 2048), with and without a causal mask, and ``Nq != Nk``
    both ways with both lengths >= 1000. Few and small: the standard suite runs for
    every variant, in several tests.
    """
    C = Case
    bh = (3, 5)
    out = [
        C("range", bh, 37, 37, 16, 16),
        C("range", bh, 37, 37, 16, 16, mask="random"),
        # a key-padding mask (B, 1, 1, Nk), the shape HuggingFace's attention_mask takes:
        # every other padding case had two batch entries at most, and a kernel whose
        # broadcast-mask path reads entry min(b, 1) passed them all
        C("range", bh, 37, 37, 16, 16, mask="padding"),
        # a bias of its own per batch entry (B, H, Nq, Nk): a kernel that reads batch 0's
        # bias for every entry (a zero batch stride) passes every (1, H) bias
        C("range", bh, 37, 37, 16, 16, bias=True, params=(("bias_batch", bh[0]),)),
        C("range", bh, 37, 37, 16, 16, scale=0.5),
        C("range", bh, 37, 37, 16, 16, causal="top-left"),
        # Nq != Nk, or bottom-right would be the same mask as top-left
        C("range", bh, 29, 37, 16, 16, causal="bottom-right"),
        C("range", bh, 37, 37, 16, 24),
        C("range", bh, 37, 37, 16, 16, kv_batch=(1, 5)),
    ]
    # Nk = 4096 against 64 queries (a prefill chunk) reaches every key from some query
    # (bottom-right: query i sees keys 0..i + 4032) at 1/64 of the cost of 4096 x 4096;
    # a float64 golden is computed in longdouble, without BLAS, and performer's causal
    # prefix in longdouble costs 6x more at d = 64 than at 32 (and a longdouble golden
    # of 1000 x 1300 twice as much at d = 32 as at 16). Nk = 1300 keeps a
    # 1024-key buffer apart from a dropped last partial block (1280 for blocks of
    # 16..256), so the two mistakes are told apart.
    out += [
        C("long", (1, 1), 64, 4096, 32, 32),
        C("long", (1, 1), 64, 4096, 32, 32, causal="bottom-right"),
        C("long", (1, 1), 1000, 1300, 16, 16),
        C("long", (1, 1), 1100, 1000, 16, 16),
    ]
    return out


def _exhaustive():
    C = Case
    return [
        C("long", (1, 1), 4096, 4096, 64, 64),
        C("long", (1, 1), 2048, 2048, 128, 128, causal="bottom-right"),
        C("long", (1, 1), 1000, 4000, 64, 64, causal="bottom-right", mask="padding"),
        C("headdim", (1, 1), 513, 513, 256, 256),
    ]


CATALOGUE: dict[str, list[Case]] = {"quick": _quick(), "standard": [], "exhaustive": []}
CATALOGUE["standard"] = CATALOGUE["quick"] + _standard()
CATALOGUE["exhaustive"] = CATALOGUE["standard"] + _exhaustive()



def _modern_standard():
    C = Case
    gqa, win = ("gqa",), ("window",)
    out = [
        # grouped-query and multi-query heads
        C("gqa", (2, 8), 65, 65, 64, 64, params=(("kv_heads", 2),), features=gqa),
        C("gqa", (1, 8), 33, 129, 64, 64, causal="bottom-right", params=(("kv_heads", 1),),
          features=gqa),
        C("gqa", (2, 6), 63, 63, 32, 32, mask="random", params=(("kv_heads", 3),), features=gqa),
        # sliding windows, alone, with causal, with Nq != Nk
        C("window", (1, 2), 129, 129, 32, 32, params=(("window", (16, 0)),), features=win),
        C("window", (1, 2), 129, 129, 32, 32, params=(("window", (8, 8)),), features=win),
        C("window", (1, 2), 65, 129, 32, 32, params=(("window", (0, 5)),), features=win),
        C("window", (1, 2), 129, 65, 32, 32, params=(("window", (32, -1)),), features=win),
        C("window", (1, 2), 127, 127, 32, 32, causal="bottom-right", params=(("window", (31, -1)),),
          features=win),
        # the left side unbounded (-1): FlashAttention's causal sliding window is (-1, 0);
        # with every left side >= 0, a kernel reading -1 as the bound j >= i + 1 passed
        # every case (an independent audit's)
        C("window", (1, 2), 129, 129, 32, 32, params=(("window", (-1, 0)),), features=win),
        C("window", (1, 2), 65, 129, 32, 32, params=(("window", (-1, 8)),), features=win),
        # soft-capping (Gemma 2 uses 50 for attention logits)
        C("softcap", (1, 2), 65, 65, 64, 64, params=(("softcap", 5.0),), features=("softcap",)),
        C("softcap", (1, 2), 64, 64, 64, 64, dist="large_logits", params=(("softcap", 50.0),),
          features=("softcap",)),
        # the cap comes before the bias and ALiBi: without them in the same case, a kernel
        # that caps the biased logits computes the same function
        C("softcap", (2, 2), 65, 65, 32, 32, bias=True, params=(("softcap", 5.0),),
          features=("softcap",)),
        C("softcap", (1, 4), 65, 65, 32, 32, causal="bottom-right", params=(("softcap", 5.0),),
          features=("softcap", "alibi")),
        # ALiBi
        C("alibi", (1, 4), 65, 129, 32, 32, features=("alibi",)),
        C("alibi", (2, 4), 65, 65, 32, 32, causal="bottom-right", features=("alibi",)),
        # dropout with the caller's keep-mask
        C("dropout", (2, 2), 64, 64, 32, 32, params=(("dropout_p", 0.1),),
          features=("dropout_mask", "dropout_p")),
        C("dropout", (1, 2), 65, 129, 32, 32, causal="bottom-right", params=(("dropout_p", 0.5),),
          features=("dropout_mask", "dropout_p")),
        # varlen in its padded form: per-sequence lengths, self-attention per sequence
        C("varlen", (3, 2), 64, 64, 32, 32, params=(("seqlens_q", (64, 17, 1)),
                                                    ("seqlens_k", (64, 17, 1))),
          features=("seqlens_q", "seqlens_k")),
        C("varlen", (3, 2), 64, 64, 32, 32, causal="bottom-right",
          params=(("seqlens_q", (5, 64, 33)), ("seqlens_k", (5, 64, 33))),
          features=("seqlens_q", "seqlens_k")),
        # a sequence with fewer keys than queries (17 < 40: its first 23 rows see no key
        # bottom-right) and one with no key at all (9 queries on 0 keys: zeros): with
        # 0 < Lk and Lq <= Lk in every other per-sequence case, a kernel that clamps a
        # sequence's offset Lk - Lq at 0, and one that guards its key count with
        # max(Lk, 1), passed them all
        C("varlen", (3, 2), 64, 64, 32, 32, causal="bottom-right",
          params=(("seqlens_q", (40, 64, 9)), ("seqlens_k", (17, 64, 0))),
          features=("seqlens_q", "seqlens_k")),
        # everything a Gemma/Mistral-style kernel combines
        C("combo", (2, 4), 65, 65, 64, 64, causal="bottom-right",
          params=(("kv_heads", 2), ("softcap", 30.0), ("window", (16, -1))),
          features=("gqa", "softcap", "window")),
        # GQA with what belongs to the query head: the bias, ALiBi's slope and the dropout
        # keep-mask are per query head. With no case combining them, kernels reading each
        # at the KV head's index passed every case (an independent audit: 0 of 716 rows
        # failed in float32, float16 and bfloat16)
        C("gqa-bias", (2, 8), 33, 33, 32, 32, bias=True, params=(("kv_heads", 2),), features=gqa),
        C("gqa-alibi", (2, 8), 33, 33, 32, 32, params=(("kv_heads", 2),), features=("gqa", "alibi")),
        C("gqa-dropout", (2, 8), 33, 33, 32, 32, params=(("kv_heads", 2), ("dropout_p", 0.2)),
          features=("gqa", "dropout_mask", "dropout_p")),
        # a running maximum that creeps up over 16 to 256 key blocks (dist "rising"): the
        # online softmax's rescale must not be skipped for small moves
        C("rising", (1, 2), 64, 4096, 32, 32, dist="rising", family="softmax", forward_only=True),
        # gradients only: 16384 queries on 64 keys, so that dK and dV sum over 64 to 256
        # query blocks; a backward declared fp32-accumulating that accumulates them in the
        # dtype across the blocks passed every case (its error grows with the blocks: 0.9
        # of the fused bound at the suite's 1000 queries), and fails this one (2.6 with
        # blocks of 64, 1.9 with 128; a correct FA-2-style backward 0.33)
        C("long-queries", (1, 2), 16384, 64, 32, 32, family="softmax", grads_only=True),
        # causal FAVOR+ whose later keys' feature exponents are ~100 above the earlier
        # ones' (dist "fading_keys"): a key stabiliser taken over every key, the future's
        # included (performer-pytorch's, exact in exact arithmetic), underflows the
        # features of the keys each earlier query sees; an independent audit's such kernel
        # passed every case (0 of 123 in float32 and float16)
        C("fading-keys", (1, 2), 64, 64, 64, 64, dist="fading_keys", causal="top-left",
          family="performer"),
    ]
    # batch 3 x 5 heads for each of these features alone, as _ranges gives the others:
    # without them ALiBi had at most 4 heads and batch 2, and a kernel reading the slope
    # of head h % 4 passed every case
    bh = (3, 5)
    out += [C("alibi", bh, 29, 37, 16, 16, features=("alibi",)),
            C("window", bh, 29, 37, 16, 16, params=(("window", (8, 8)),), features=win),
            C("softcap", bh, 37, 37, 16, 16, params=(("softcap", 5.0),), features=("softcap",)),
            C("dropout", bh, 37, 37, 16, 16, params=(("dropout_p", 0.2),),
              features=("dropout_mask", "dropout_p")),
            C("seqlens", bh, 4, 37, 16, 16, params=(("seqlens_k", (37, 20, 9)),),
              features=("seqlens_k",)),
            C("gqa", (3, 10), 37, 37, 16, 16, params=(("kv_heads", 5),), features=gqa)]
    # a window and ALiBi measured from each sequence's own end (query i at key position
    # i + Lk - Lq of its sequence): without lengths in the same case, a kernel that takes
    # the batch's Nk - Nq there computes the same function (the window bounded on both
    # sides, so that either side off by one shows). Not causal:
    # under a causal mask ALiBi's -slope (i + Lk - Lq - j) differs from any other offset's
    # by a constant per row, which the softmax cancels.
    out += [C("seqlens", (2, 4), 4, 200, 32, 32, params=(("seqlens_k", (200, 77)),
                                                          ("window", (16, 1))),
              features=("seqlens_k", "window")),
            C("seqlens", (2, 4), 4, 200, 32, 32, params=(("seqlens_k", (200, 77)),),
              features=("seqlens_k", "alibi"))]
    # KV-cache decoding: Nq = 1..16 new queries against caches of different lengths
    for nq in (1, 2, 5, 16):
        out.append(C("decode", (2, 8), nq, 1000, 64, 64, causal="bottom-right",
                     params=(("kv_heads", 2), ("seqlens_k", (1000, 200 + nq))),
                     features=("gqa", "seqlens_k")))
    # Sliding-window decoding (Mistral, Gemma 2/3, Qwen 2 with a cache): a window bounded
    # on the left under a causal mask with Nq < Nk, where the window's left edge is
    # measured from each query's position i + Lk - Lq; alone (batch 3 x 5 heads), and
    # as HF's sliding layers run it (GQA, left-padded caches of 300 and 180 keys, which
    # a sliding cache of 63 keys truncates)
    out += [C("window-decode", bh, 5, 300, 32, 32, causal="bottom-right", params=(("window", (63, -1)),),
              features=win),
            C("window-decode", (2, 4), 5, 300, 32, 32, causal="bottom-right",
              params=(("kv_heads", 2), ("seqlens_k", (300, 180)), ("window", (63, -1))),
              features=("gqa", "seqlens_k", "window"))]
    # Llama 4's chunked attention (attention_chunk_size): chunks on absolute positions,
    # lengths that no chunk size divides. A prefill (bottom-right, Nq = Nk = 129 = 8 x
    # 16 + 1); queries at positions 64..128 of 129 keys without causal, where chunks
    # counted from the first query differ from absolute ones; a decode step of 5
    # queries at positions 198..202 of a 203-key cache (batch 3 x 5 heads), where a
    # chunk counted from the queries' own index, or from the last key, holds other keys;
    # and Llama 4's decode: GQA and left-padded caches of 1000 and 205 keys (chunks of
    # 192 counted from each sequence's first token, as HF's left_padding correction).
    chunk = ("chunk",)
    out += [C("chunk", (1, 2), 129, 129, 32, 32, causal="bottom-right", params=(("chunk", 16),),
              features=chunk),
            C("chunk", (1, 2), 65, 129, 32, 32, params=(("chunk", 24),), features=chunk),
            C("chunk", bh, 5, 203, 16, 16, causal="bottom-right", params=(("chunk", 64),), features=chunk),
            C("chunk-decode", (2, 8), 5, 1000, 64, 64, causal="bottom-right",
              params=(("kv_heads", 2), ("seqlens_k", (1000, 205)), ("chunk", 192)),
              features=("gqa", "seqlens_k", "chunk"))]
    return out


def _modern_long():
    C = Case
    out = []
    for nq in (1, 16):
        for nk in (16384, 65536):
            out.append(C("decode", (1, 4), nq, nk, 64, 64, causal="bottom-right",
                         params=(("kv_heads", 1), ("seqlens_k", (nk - 7,))),
                         features=("gqa", "seqlens_k")))
    out.append(C("window", (1, 1), 4096, 4096, 64, 64, causal="bottom-right",
                 params=(("window", (255, -1)),), features=("window",)))
    # Llama 4 Scout's chunks of 8192 decoding 16 queries at positions 8181..8196: the
    # step straddles the first chunk boundary, 11 queries see keys 0..i, 5 see 8192..i
    # (16 x 8197 is no long case: its golden is the one-shot's; the long suite has the
    # 8197-position prefill).
    out.append(C("chunk", (1, 4), 16, 8197, 64, 64, causal="bottom-right", params=(("chunk", 8192),),
                 features=("chunk",)))
    return out


CATALOGUE["standard"] += _modern_standard()
CATALOGUE["exhaustive"] += _modern_standard() + _modern_long()


def _noncontiguous():
    """Non-contiguous inputs (:mod:`conformance.noncontiguous`): one case per kind of view.

    Every other case hands the kernel C-contiguous arrays, so a kernel that reads its
    inputs through a data pointer as if they were contiguous passed them all. Small
    (2 x 3 heads, 37 tokens: past one head and one batch entry, a length no block size
    divides), on by default: ``q, k, v`` of one packed QKV buffer; ``k, v`` of a packed
    KV buffer under queries stored in the other layout (cross attention, Nq != Nk);
    storage in the other of bhnd/bnhd with ``K^T`` stored (a head-dim stride != 1); and
    Megatron's ``[q | k | v]`` per-head slices, causal, so that the causal-only variants
    meet one too. The gradient rows get ``do`` in the other layout.
    """
    C = Case
    bh, feat = (2, 3), ("noncontiguous",)
    return [C("noncontiguous", bh, 37, 37, 16, 16, params=(("views_", "qkv"),), features=feat),
            C("noncontiguous", bh, 29, 41, 16, 16, params=(("views_", "kv"),), features=feat),
            C("noncontiguous", bh, 37, 37, 16, 16, params=(("views_", "layout"),), features=feat),
            C("noncontiguous", bh, 37, 37, 16, 16, causal="top-left", params=(("views_", "headdim"),),
              features=feat)]


CATALOGUE["standard"] += _noncontiguous()
CATALOGUE["exhaustive"] += _noncontiguous()


def _sparse_options():
    """The sparse patterns at option values other than their registered ones.

    Every other case runs a sparse variant at its registered options (local's window 3,
    BigBird's blocks of 4, ...), so a kernel that hard-codes those, or ignores the option
    it is passed, computes the same function there: an independent audit's `fixed` kernel
    ignoring ``summary`` passed every case at the registered ``summary=1`` and fails 38 at 2.
    One case without causal and one with for each variant, the options passed by name
    (:attr:`Case.options`); Longformer's second global token sits mid-sequence, in every
    earlier query's future. And two long ones on ``offset_values`` inputs, with hundreds
    of keys a row (at most 7 to 24 at the registered options): where P V and the row sum
    kept in float16 show, as on the softmax family's long case.
    """
    C = Case
    per_variant = (
        ("local", 65, 65, (("window", 5),)),
        ("longformer", 65, 65, (("window", 5), ("global_tokens", (0, 32)))),
        ("bigbird", 129, 129, (("block_size", 8), ("window", 2), ("global_blocks", 2),
                               ("random_blocks", 2))),
        ("strided", 65, 65, (("stride", 6),)),
        ("fixed", 65, 65, (("stride", 8), ("summary", 2))),
        ("block_sparse", 65, 129, (("block_size", 16),)),
    )
    out = []
    for variant, nq, nk, opts in per_variant:
        out += [C("options", (1, 2), nq, nk, 32, 32, variant=variant, options=opts),
                C("options", (1, 2), nk, nk, 32, 32, causal="top-left", variant=variant,
                  options=opts)]
    out += [C("options", (1, 1), 1000, 1000, 64, 64, dist="offset_values", variant="local",
              options=(("window", 300),)),
            C("options", (1, 1), 1000, 1000, 64, 64, dist="offset_values", variant="bigbird",
              options=(("block_size", 48),))]
    return out


CATALOGUE["standard"] += _sparse_options()
CATALOGUE["exhaustive"] += _sparse_options()

#: the k-means cases' clusters and seed (:func:`_kmeans_cases`)
_KMEANS_CLUSTERS, _KMEANS_SEED = 4, 0


def _kmeans_cases():
    """``clustered`` and ``clustered_topk`` where their k-means' details show.

    * An empty cluster: two of the initial centroid rows (``kmeans_initial_rows`` at the
      case's fixed ``num_clusters`` and ``seed``) are the same query repeated, as padding
      or repeated tokens make them; the first Lloyd step gives every member to the lower
      index, and the other centroid must keep its position (:func:`attn_ref.reduced.kmeans`)
      to take the repeated rows back at the next step. On random queries no cluster ever
      empties (an independent audit counted 0 in 180 calls), so kernels dividing 0 / 0
      (NaN) or resetting an empty centroid to the origin passed every case.
    * One and two Lloyd iterations (``iterations``): at the registered ten, k-means has
      converged on most cases, so a kernel running one step more or fewer, or skipping
      the final assignment, changed the output on 5 or 6 standard cases only and passed
      the quick suite.
    """
    from attn_ref.reduced import kmeans_initial_rows

    n = 16
    first, second = kmeans_initial_rows(n, _KMEANS_CLUSTERS, _KMEANS_SEED)[:2]
    fixed = (("num_clusters", _KMEANS_CLUSTERS), ("seed", _KMEANS_SEED))
    both = ("clustered", "clustered_topk")
    return [Case("empty-cluster", (1, 2), n, n, 16, 16, variant=both, options=fixed,
                 params=(("copy_rows", ((second, first),)),))] + [
        Case("iterations", (1, 2), 33, 33, 16, 16, variant=both, options=(("iterations", it),))
        for it in (1, 2)]


CATALOGUE["quick"] += _kmeans_cases()
CATALOGUE["standard"] += _kmeans_cases()
CATALOGUE["exhaustive"] += _kmeans_cases()


def _recurrent():
    """Cases of the recurrent family (issue 18): where chunked kernels go wrong.

    Lengths that are not a multiple of the chunk sizes kernels use (16, 32, 64), among
    them 1 and 15, shorter than any chunk (4096 steps, states summed over thousands of
    decayed terms and cumulative log-gates of size ~3000, in ``exhaustive``); ``d_v != d_k`` (the state is
    ``d_k x d_v``: a transposed one has the wrong shape); an initial state, at lengths
    short enough that it still shows through the decay; packed sequences (``cu_seqlens``,
    B = 1 as fla takes them) of different lengths, some shorter than a chunk, one of a
    single token, with and without initial states. Causal (the family is causal by
    construction); one case of 3 batch entries and 5 heads.
    """
    C = Case
    tl, fam = "top-left", "recurrent"
    init, cu = ("initial_state",), ("cu_seqlens",)
    out = [C("chunks", (2, 2), n, n, 32, 32, causal=tl, family=fam)
           for n in (1, 15, 33, 63, 65, 100)]
    out.append(C("chunks", (1, 2), 37, 37, 16, 24, causal=tl, family=fam))
    # q and k of norm ~3e-3, a zero key and a zero query: the delta rules' l2
    # normalisation's eps (fla's 1e-6) is a few per cent of |k|^2 here
    out.append(C("small-qk", (1, 2), 33, 33, 32, 32, dist="small_qk", causal=tl, family=fam))
    out += [C("initial-state", (2, 2), n, n, 32, 32, causal=tl, family=fam, features=init)
            for n in (1, 15, 100)]
    out += [
        C("initial-state", (3, 5), 37, 37, 16, 16, causal=tl, family=fam, features=init),
        C("initial-state", (1, 2), 33, 33, 16, 24, causal=tl, family=fam, features=init),
        # packed sequences: 7, 33, 1 and 59 steps; 64, 1, 64 and 71
        C("varlen-packed", (1, 2), 100, 100, 32, 32, causal=tl, family=fam,
          params=(("cu_seqlens", (0, 7, 40, 41, 100)),), features=cu),
        C("varlen-packed", (1, 3), 200, 200, 16, 16, causal=tl, family=fam,
          params=(("cu_seqlens", (0, 64, 65, 129, 200)),), features=cu),
        C("varlen-packed", (1, 2), 100, 100, 32, 32, causal=tl, family=fam,
          params=(("cu_seqlens", (0, 15, 16, 81, 100)),), features=cu + init),
    ]
    # Long memory: the gates g divided by GATE_NORMALIZER (conformance.judging.prepare).
    # logsigmoid(randn) forgets in a few steps (mean -0.8 a step, 64 steps decay by
    # e^-50), so a kernel whose state reaches only one chunk back - or that decays the
    # far past wrongly - matched every other case; a Mamba-2 or Gated DeltaNet head with
    # dt ~ 1e-2 keeps its state for hundreds of steps. At -0.013 a step a chunk of 64
    # decays by 0.45: three chunks of 64 and an initial state still show through.
    out += [C("slow-decay", (1, 2), 200, 200, 32, 32, causal=tl, family=fam,
              params=(("gate_normalizer", GATE_NORMALIZER),)),
            C("slow-decay", (1, 2), 150, 150, 16, 16, causal=tl, family=fam, features=init,
              params=(("gate_normalizer", GATE_NORMALIZER),))]
    # Long memory for the gradients: a backward that holds its state (and the state's
    # cotangent) in bfloat16 passed the slow-decay cases (ratio 0.44-0.49): the
    # gradients' bound in bfloat16 is about 8 ulps of the gradient's largest value (8
    # times one rounding, plus 4 ulps), and a state rounded at every step errs by about
    # sqrt(steps it remembers) half-ulps, and more where a step's decay (|g| ~ 8e-4 at
    # gates / 1024) is below bfloat16's resolution and rounding drops it. At T = 1000 it
    # fails dk, dv and dg by 6 to 12 times; a float32-state backward stays at 0.06.
    out.append(C("long-memory", (1, 2), 1000, 1000, 32, 32, causal=tl, family=fam,
                 params=(("gate_normalizer", LONG_MEMORY_GATES),), grads_only=True))
    # Strong gates (case_gates; the variants with log gates only): log gates down to -20 and
    # exactly 0, mixed per head. A kernel clipping the log gates at -5, or flushing
    # exp(g) < 1e-4 to zero, computes the same function as the reference on fla's draws
    # (which stay above about -4.5); here it leaks a state the gate erases. The long chunk:
    # running sums of about -1e3 over a chunk of 64, where exp(G_i) / exp(G_j) is 0 / 0
    # (float32 from -104, float64 from -745) and exp(G_i - G_j) is right.
    out += [C("strong-gates", (1, 3), 100, 100, 16, 16, causal=tl, family=fam,
              params=(("gates", "strong"),)),
            C("strong-gates", (1, 3), 65, 65, 16, 16, causal=tl, family=fam, features=init,
              params=(("gates", "strong"),)),
            C("strong-gates", (1, 2), 100, 100, 16, 16, causal=tl, family=fam,
              params=(("gates", "long-chunk"),))]
    return out


def _linear():
    """Cases of linear attention (``Case.family == "linear"``): small denominators.

    With the default scale the normaliser ``den_i = scale phi(q_i) . sum_j phi(k_j)`` is
    ~N d, so an ``eps`` added to it (Katharopoulos et al.'s ``den + eps``, where the
    reference uses ``den`` itself whenever ``|den| >= eps``) moves the output by ~1e-9, below
    float32's resolution. A scale of 1e-5 brings ``den`` to ~1e-3 with ``elu+1`` features
    (still far above the default eps 1e-6, so the reference's floor is not what is tested):
    there ``den + 1e-6`` is off by ~1e-4 relative. Not causal: flash-linear-attention's
    causal kernels divide by ``den + 1e-10`` - the same difference, a convention of theirs
    that a causal case at this scale shows (ratio 2.1 with ``identity`` features, whose
    signed denominators come near 0) and that ``attn_ref.linear`` has no option for.
    """
    return [Case("small-denominator", (1, 2), 33, 33, 16, 16, scale=1e-5, family="linear")]


CATALOGUE["standard"] += _linear()
CATALOGUE["exhaustive"] += _linear()


# 4096 steps: exhaustive only. In the standard suite it took the built-in job
# (`verify --variant gla`, every backend) past 30 minutes, a call stopped at the 60 s
# limit, on a loaded 2-core machine; the standard suite reaches T = 1000 for the family.
CATALOGUE["standard"] += _recurrent()
CATALOGUE["exhaustive"] += _recurrent() + [
    Case("chunks", (1, 2), 4096, 4096, 16, 16, causal="top-left", family="recurrent")]


def _long():
    # Nq * Nk past conformance.long.LONG_THRESHOLD: goldens on Dask (conformance.long)
    C = Case
    return [
        C("long", (1, 2), 8192, 8192, 64, 64),
        C("long", (1, 2), 8192, 8192, 64, 64, causal="top-left"),
        C("long", (1, 1), 4096, 16384, 64, 64, causal="bottom-right"),
        # Llama 4's chunked attention past one chunk of 8192 (Scout's size): a prefill of
        # 8197 positions, the last five seeing keys 8192.. only (the Dask golden takes chunk)
        C("long", (1, 2), 8197, 8197, 64, 64, causal="bottom-right", params=(("chunk", 8192),),
          features=("chunk",)),
    ]


CATALOGUE["long"] = _long()


def cases(variant: str | None = None, suite: str = "standard", *, grads: bool = False) -> list[Case]:
    """The cases of ``suite`` (``"quick"``, ``"standard"``, ``"exhaustive"``, ``"long"``).

    ``variant`` (a registered name) drops cases the reference of that variant cannot
    take because its signature lacks the feature or it is self-attention only, the
    non-causal cases of a variant that is causal by construction, and the cases of
    another family (:attr:`Case.family`) or variant (:attr:`Case.variant`); cases
    the kernel cannot take are decided later, in :func:`conformance.verify`. The cases
    for the gradient rows (:attr:`Case.grads_only`) only with ``grads=True``.

    Examples
    --------
    >>> from conformance import cases
    >>> cs = cases("softmax", "quick")
    >>> arrays, kwargs = cs[0].inputs(seed=0)
    >>> arrays["q"].shape
    (2, 3, 17, 16)
    """
    if suite not in CATALOGUE:
        raise ValueError(f"suite must be one of {tuple(CATALOGUE)}, got {suite!r}")
    out = [c for c in CATALOGUE[suite] if grads or not c.grads_only]
    if variant is not None:
        from attn_ref.registry import get

        v = get(variant)
        feats = reference_features(v)
        out = [c for c in out if c.needs <= feats and not (v.self_attention and c.nq != c.nk)
               and not (v.causal_only and c.causal is None)
               and c.belongs_to(v)
               and (c.param("gates") is None or takes_gates(v))]
    return out


def takes_gates(variant) -> bool:
    """Whether the reference of ``variant`` takes log gates ``g`` (GLA, SSD, Gated DeltaNet):
    the cases with a ``gates`` param (:func:`case_gates`) are for those only."""
    import inspect

    return "g" in inspect.signature(variant.fn).parameters


# the search draws the distributions every variant's cases use; those of one family's
# cases are left out (small_qk: the recurrent family's; rising: the softmax family's,
# 4096 keys to creep over; fading_keys: causal Performer's), which also keeps the search's
# draws what they were
_SEARCHED = tuple(d for d in DISTRIBUTIONS if d not in ("small_qk", "rising", "fading_keys"))


def case_strategy(max_n: int = 300, head_dims=(1, 2, 3, 8, 16, 64, 80, 96, 128)):
    """A hypothesis strategy over small-to-medium :class:`Case` objects.

    Batch sizes 1..4 and 1..8 heads, so batch indices >= 2 and head indices >= 4 are
    drawn. Shrinking goes towards short sequences, small head dims, one batch entry
    and head, and no mask/bias/causal, so a failure found by search is reported at
    its simplest.
    """
    from hypothesis import strategies as st

    return st.builds(
        lambda nq, nk, d, dv, b, h, dist, mask, causal, bias: Case(
            "search", (b, h), nq, nk, d, dv, dist=dist, mask=mask, causal=causal, bias=bias),
        st.integers(1, max_n), st.integers(1, max_n), st.sampled_from(head_dims),
        st.sampled_from(head_dims), st.integers(1, 4), st.integers(1, 8),
        st.sampled_from(_SEARCHED), st.sampled_from(MASKS), st.sampled_from(ALIGNMENTS),
        st.booleans(),
    )


def with_tag(case: Case, tag: str) -> Case:
    return replace(case, tag=tag)

