"""Discrete choices a dtype cannot resolve: the admissible functions at a near tie.

Improved clustered attention (``clustered_topk``) selects each centroid's ``topk`` keys
by its logits. Where the ``topk``-th and a later logit are closer than the kernel dtype's
rounding of computing them, a correct kernel may select either key, and then computes
another function of the same inputs: its output differs from the golden by a whole
key's share, not by rounding (attn_ref's own reference under torch failed such heads at
1.4-77x in float16 and bfloat16, ``docs/conformance.md``, "Near ties"). Leaving those
heads out would not pay: by the margin below about half the heads of the bfloat16
standard suite have such a tie, and most flips move the output by less than the bound.

So each near tie is judged against every admissible choice: :func:`alternatives` lists,
per tie, the reference keywords (``topk_keys``) that give the function of each other
selection; the callers compute each one's golden (and gradients) in the golden's
dtype, and :func:`nearest` builds, for a kernel's result, the golden of the admissible
selection nearest to it, tie by tie. A kernel that computes another function (a key
short, no correction) is no nearer to any admissible one than to the golden, and still
fails; one that selected otherwise at a tie is judged against the function it computed.

The margin. A logit ``l_j = scale c . k_j`` of a centroid ``c`` rounds, in a kernel of
unit roundoff ``u``, by at most ``u (scale |c| . |k_j| + |l_j| + 1)``: the centroid stored
in the dtype (each coordinate within ``u |c_i|``), the logit stored in it (``u |l_j|``) and
the softmax probability the selection sorts stored in it (relative ``u``, that is ``u`` in
the logit). Keys ``a`` selected and ``b`` not are a near tie when
``l_a - l_b <= e_a + e_b``. The k-means assignments are left as they are: the same
k-means without the top-k (``clustered``) passes every row of the same runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attn_ref.reduced import kmeans

from .tolerance import MANTISSA_BITS

#: unit roundoff of each kernel dtype, half an ulp of 1: ``2^-(mantissa bits + 1)``
UNIT_ROUNDOFF = {dt: 2.0 ** -(bits + 1) for dt, bits in MANTISSA_BITS.items()}
#: the other selections tried per centroid (nearest ties first) and per case: every
#: pair of keys within the margin at once would be ``topk (Nk - topk)`` functions where
#: the keys are equal (``constant-keys``), whose reference selection by index is kept
PER_CENTROID = 4
PER_CASE = 96

__all__ = ["UNIT_ROUNDOFF", "Ties", "alternatives", "moved", "nearest", "settled"]


def _settings(prep):
    o = {**prep.params, **prep.options}
    return o.get("num_clusters"), o.get("iterations", 10), o.get("topk"), o.get("seed", 0)


@dataclass
class Ties:
    """The near ties of a case's discrete choices (:func:`alternatives`).

    Attributes
    ----------
    chosen : ndarray, shape (..., C, topk)
        The reference's selection: each centroid's ``topk`` largest logits, ties to the
        lower key index (:func:`attn_ref.reduced.topk_parts`).
    ties : list of (tuple, list of ndarray)
        Per near tie, nearest first: the centroid's index into ``chosen`` and each other
        admissible selection of it.
    """

    chosen: np.ndarray
    ties: list
    #: centroids whose admissible selections are more than were enumerated (an exact tie
    #: of many keys: ``constant-keys``), each with a far one: its selected keys within the
    #: margin replaced by unselected ones (:meth:`far_keywords`, :func:`moved`)
    far: dict = field(default_factory=dict)

    def _selection(self, rows) -> dict:
        """The reference keywords of ``chosen`` with some centroids' rows replaced
        (``rows``: ``(centroid, selection)`` pairs)."""
        alt = self.chosen.copy()
        for pos, row in rows:
            alt[pos] = row
        return {"topk_keys": alt}

    def far_keywords(self) -> dict:
        """The reference keywords of the far selection of every such centroid at once."""
        return self._selection(self.far.items())

    def keywords(self, picks) -> dict:
        """The reference keywords of the selection with ``picks``, ``[(tie, option)]``, made."""
        return self._selection((self.ties[t][0], self.ties[t][1][o]) for t, o in picks)

    def deltas(self, run, golden: dict) -> list:
        """``[[{name: delta} per option] per tie]``: what each other admissible choice
        changes in the results ``golden`` (``{name: array}``), ``run(keywords)`` giving
        the results of a selection.

        The choices of different heads are made in one run where every result keeps
        the heads apart (its batch shape is the selection's; a gradient of an input
        broadcast over heads sums them): at most as many runs as one head has options.
        """
        batch = tuple(self.chosen.shape[:-2])
        apart = all(tuple(np.shape(g)[:-2]) == batch for g in golden.values())
        picks = [(t, o, pos[:-1]) for t, (pos, rows) in enumerate(self.ties) for o in range(len(rows))]
        rounds = []
        if apart:
            by_head = {}
            for t, o, head in picks:
                by_head.setdefault(head, []).append((t, o, head))
            for r in range(max(map(len, by_head.values()), default=0)):
                rounds.append([q[r] for q in by_head.values() if r < len(q)])
        else:
            rounds = [[p] for p in picks]
        out = [[None] * len(rows) for _, rows in self.ties]
        for group in rounds:
            res = run(self.keywords([(t, o) for t, o, _ in group]))
            for t, o, head in group:
                d = {}
                for n, g in golden.items():
                    diff = np.asarray(res[n], dtype=np.float64) - g
                    if len(group) > 1:
                        only = np.zeros_like(diff)
                        only[head] = diff[head]
                        diff = only
                    d[n] = diff
                out[t][o] = d
        return out


def alternatives(prep) -> Ties | None:
    """The near ties of ``prep``'s case in its dtype and every other admissible choice at
    each (:class:`Ties`); None for a variant or case without such choices, or no tie.

    ``O(iterations Nq C d + C Nk d)`` (the float64 k-means and the centroids' logits),
    and a loop over the centroids on the host.
    """
    if prep.variant.name != "clustered_topk":
        return None
    c, iterations, topk, seed = _settings(prep)
    q = np.asarray(prep.arrays["q"], dtype=np.float64)
    k = np.asarray(prep.arrays["k"], dtype=np.float64)
    nk = k.shape[-2]
    if topk is None or c is None or topk >= nk:
        return None
    u = UNIT_ROUNDOFF[prep.dtype]
    centroids, _, _ = kmeans(q, c, iterations=iterations, seed=seed, xp=np)
    kt = np.swapaxes(k, -1, -2)
    logits = prep.scale * (centroids @ kt)
    err = u * (abs(prep.scale) * (np.abs(centroids) @ np.abs(kt)) + np.abs(logits) + 1.0)
    # The reference's selection: the topk largest probabilities, ties to the lower index
    # (attn_ref.reduced.topk_parts); the logits order the same way.
    order = np.argsort(-logits, axis=-1, kind="stable")
    chosen = np.ascontiguousarray(order[..., :topk])
    found = []  # (closeness, centroid, key selected, key not)
    far = {}  # centroids with more admissible swaps than PER_CENTROID: a far selection
    for pos in np.ndindex(*order.shape[:-1]):
        row, e, o = logits[pos], err[pos], order[pos]
        pairs = []
        # the selected keys from the weakest up, the others from the strongest down, while
        # the pair is within the margin
        for a in o[:topk][::-1]:
            if row[a] - row[o[topk]] > e[a] + e[o[topk]]:
                break
            for b in o[topk:]:
                gap = row[a] - row[b]
                if gap > e[a] + e[b]:
                    break
                pairs.append((gap / (e[a] + e[b]), int(a), int(b)))
        if len(pairs) > PER_CENTROID:
            far[pos] = _far(chosen[pos], pairs)
        found += [(r, pos, a, b) for r, a, b in sorted(pairs)[:PER_CENTROID]]
    found.sort(key=lambda t: t[0])
    for _, pos, _, _ in found[PER_CASE:]:
        far.setdefault(pos, _far(chosen[pos], [(0.0, a, b) for r, p, a, b in found if p == pos]))
    ties = {}
    for _, pos, a, b in found[:PER_CASE]:
        row = chosen[pos].copy()
        row[row == a] = b
        ties.setdefault(pos, []).append(row)
    return Ties(chosen, list(ties.items()), far) if ties else None


def _far(row, pairs):
    """``row`` (a centroid's selection) with as many of its keys in ``pairs`` (``(closeness,
    selected, unselected)`` within the margin) replaced by unselected keys of the pairs."""
    ins = sorted({a for _, a, _ in pairs})
    outs = sorted({b for _, _, b in pairs})
    row = row.copy()
    for a, b in zip(ins, outs):
        row[row == a] = b
    return row


def moved(alt, golden, queries=True, size=None) -> np.ndarray:
    """Booleans of ``golden``'s shape ``(B, H, N, e)``: the values a selection that was not
    enumerated may change, judged by the far one's result ``alt``. With ``queries`` (the
    output, ``dq``) the rows the far selection changed; else (``dk``, ``dv``) every row of
    a head where it changed any, since the keys such a selection takes are any of its
    tied ones. "Changed": by more than ``1e-12`` of ``size`` (default: the golden's
    largest value), the size of the terms the values are summed from: two float64
    evaluations of a function the selection does not change - the output over identical
    keys, or ``dq`` there, which is zero but for rounding of the size of its terms -
    differ by rounding alone."""
    golden = np.asarray(golden, dtype=np.float64)
    big = float(np.max(np.abs(golden))) if golden.size else 0.0
    big = big if size is None else max(big, size)
    rows = np.any(np.abs(np.asarray(alt, dtype=np.float64) - golden) > 1e-12 * big, axis=-1,
                  keepdims=True)
    if not queries:
        rows = np.any(rows, axis=-2, keepdims=True)
    return np.broadcast_to(rows, golden.shape)


def nearest(got, golden, deltas, keep=None):
    """The golden of the admissible choice nearest to ``got``: ``golden`` plus, tie by tie,
    the one of its ``deltas`` (each the difference an other choice makes, or nothing)
    that leaves the least squared error on the compared values. Choices at different
    ties add: each centroid's selection enters the output rows of its own members and
    the gradients as a sum over centroids. ``deltas``: ``[[delta, ...] per tie]``.
    """
    if not deltas:
        return golden
    got = np.asarray(got, dtype=np.float64)
    mask = np.ones(np.shape(golden), bool) if keep is None else np.broadcast_to(keep, np.shape(golden))
    ok = mask & np.isfinite(got)
    cur = np.array(golden, dtype=np.float64)

    def err(x):
        return float(np.sum(np.where(ok, (got - x) ** 2, 0.0)))

    for options in deltas:
        best, best_err = None, err(cur)
        for d in options:
            e = err(cur + d)
            if e < best_err:
                best, best_err = d, e
        if best is not None:
            cur = cur + best
    return cur


def settled(shape, deltas) -> np.ndarray:
    """Booleans of ``shape``: the values no admissible choice at a near tie changes.

    Exported vectors (:mod:`conformance.vectors`) hold one golden and compare the rest
    only: a consumer cannot choose the admissible function nearest to its kernel."""
    out = np.ones(shape, bool)
    for options in deltas:
        for d in options:
            out &= np.broadcast_to(d, shape) == 0
    return out
