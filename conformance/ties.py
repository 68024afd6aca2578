"""Discrete choices a dtype cannot resolve: the admissible functions at a near tie.

Two variants select tokens by scores. Improved clustered attention
(``clustered_topk``) selects each centroid's ``topk`` keys by its logits; balanced
routing (``routing``) gives each centroid its ``w`` nearest queries and its ``w``
nearest keys. Where the last selected and a next score are closer than the kernel
dtype's rounding of computing them, a correct kernel may select either token, and then
computes another function of the same inputs: its output differs from the golden by a
whole token's share, not by rounding (attn_ref's own reference failed such heads at
1.4-77x in float16 and bfloat16 under torch, and routing's up to 298x under
``jax.jit``, ``docs/conformance.md``, "Near ties"; where a baseline flipped, the case
was "ill-conditioned" and not judged at all, 27 of routing's 68 bfloat16 cases). Leaving
those heads out would not pay: by the margins below about half the heads of the
bfloat16 standard suite have such a tie, and most flips move the output by less than
the bound.

So each near tie is judged against every admissible choice: :func:`alternatives` lists,
per tie, the reference keywords (``topk_keys``; ``query_routes`` and ``key_routes``)
that give the function of each other selection; the callers compute each one's golden
(and gradients) in the golden's dtype, and :func:`nearest` builds, for a kernel's
result, the golden of the admissible selection nearest to it, best tie first. A kernel that
computes another function (a key short, no correction) is no nearer to any admissible
one than to the golden, and still fails; one that selected otherwise at a tie is judged
against the function it computed.

The margins. A logit ``l_j = scale c . k_j`` of a centroid ``c`` rounds, in a kernel of
unit roundoff ``u``, by at most ``u (scale |c| . |k_j| + |l_j| + 1)``: the centroid stored
in the dtype (each coordinate within ``u |c_i|``), the logit stored in it (``u |l_j|``) and
the softmax probability the selection sorts stored in it (relative ``u``, that is ``u`` in
the logit). Routing's score ``s = mu . x / |x|`` takes ``2 u (|mu| . |x / |x|| + |s|)``
(:func:`_routing_rows`). Tokens ``a`` selected and ``b`` not are a near tie when
``s_a - s_b <= e_a + e_b``.

The k-means assignments of ``clustered`` and ``clustered_topk`` are choices too: a query
about as near two centroids as the dtype resolves may go to either, and the clustering
goes on from there. Each such assignment is a tie whose options are the clusterings with
that one query assigned otherwise (:func:`_kmeans_ties`, the reference keyword
``assignments``); two flips in one clustering are not enumerated, and a failure that
they may explain says so in its diagnosis (:func:`kmeans_margins`). Plain routing's
nearest centroids are enumerated likewise, a token at a time (:func:`_plain_routing_ties`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attn_ref.reduced import kmeans

from .tolerance import MANTISSA_BITS

#: unit roundoff of each kernel dtype, half an ulp of 1: ``2^-(mantissa bits + 1)``
UNIT_ROUNDOFF = {dt: 2.0 ** -(bits + 1) for dt, bits in MANTISSA_BITS.items()}
#: the other selections tried per centroid (nearest ties first) and per case: every
#: pair of tokens within the margin at once would be ``w (N - w)`` functions where the
#: tokens are equal (``constant-keys``), whose reference selection by index is kept.
#: Raised from 4 and 96 for routing: of its bfloat16 standard suite (seed 0, the 60
#: cases judged) 81% of the output rows were kept with those (the rest moved by far
#: selections), 89% with these, 91% with 16 and 512 at 1.4 times the time
PER_CENTROID = 8
PER_CASE = 256
#: exported vectors compare the values no admissible choice moves by more than this share
#: of the smaller of the value bounds (``tol_max``, ``tol_rms``): a kernel that chose
#: otherwise is that much nearer its bound there. With it, of the bfloat16 standard suite
#: of ``clustered`` (seed 0) 43 % of the output values are compared, 14 % with none
#: (clustered_topk 34 % and 9 %; float16 53 % and 52 %, 49 % and 48 %): a k-means flip
#: moves later centroids, many of its head's values a little
SETTLED_SHARE = 0.01

__all__ = ["UNIT_ROUNDOFF", "KMEANS_VARIANTS", "SETTLED_SHARE", "Ties", "alternatives",
           "kmeans_margins", "moved", "nearest", "settled"]


def _settings(prep):
    o = {**prep.params, **prep.options}
    return o.get("num_clusters"), o.get("iterations", 10), o.get("topk"), o.get("seed", 0)


@dataclass
class Ties:
    """The near ties of a case's discrete choices (:func:`alternatives`).

    Attributes
    ----------
    chosen : dict of str to ndarray
        The reference's selections, by the reference keyword that fixes each:
        ``topk_keys (..., C, topk)`` (clustered_topk: each centroid's ``topk`` largest
        logits, ties to the lower key index, :func:`attn_ref.reduced.topk_parts`), or
        ``query_routes (..., C, wq)`` and ``key_routes (..., C, wk)`` (routing: each
        centroid's nearest tokens, ties to the lower index,
        :func:`attn_ref.routing.balanced_routes`); ``assignments (..., iterations + 1,
        Nq)`` (k-means, :func:`_kmeans_ties`) or ``query_clusters (..., Nq)`` and
        ``key_clusters (..., Nk)`` (plain routing, :func:`_plain_routing_ties`), all
        ``-1``: every choice the nearest, an option overriding some.
    ties : list of (tuple, list of tuple)
        Per near tie, nearest first: ``(keyword, index of the centroid's row in
        chosen[keyword])`` (k-means: the head's index and the last step; plain
        routing: the token's index) and its options, each the rows an other admissible choice
        replaces, ``((keyword, index), row)`` pairs: that row with one swap, or with
        routing also the row of a tie that shares its query (a joint option: a query's
        output averages its clusters, so two ties moving one query do not add).
    """

    chosen: dict
    ties: list
    #: rows whose admissible selections are more than were enumerated (an exact tie of
    #: many tokens: ``constant-keys``), each with a far one: its selected tokens within
    #: the margin replaced by unselected ones (:meth:`far_keywords`, :func:`moved`)
    far: dict = field(default_factory=dict)
    #: routing: ``(..., Nq)`` booleans, the queries within the margin of a centroid whose
    #: keys are such a tie; or None. A kernel may take such a query into that cluster,
    #: where its output reads keys no enumerated selection pins down, and the far
    #: selection, which moves the cluster's members only, does not show it
    #: (:meth:`loose_rows`)
    loose: Any = None
    #: choices :func:`nearest` recomputes a step where they need not add at all
    #: (reformer's buckets, :data:`HASH_EXACT`); 0: the differences choose
    exact: int = 0

    @functools.cached_property
    def conflicts(self) -> list:
        """Per tie, the ties whose options cannot be taken with its own (:func:`nearest`):
        a k-means tie's option is a whole other clustering of its head, which sets that
        head's top-k selections too, so it goes with no other tie of that head."""
        heads = [pos[:-1] for (_, pos), _ in self.ties]
        out = [set() for _ in self.ties]
        for t, ((kw, _), _) in enumerate(self.ties):
            if kw != "assignments":
                continue
            for u, head in enumerate(heads):
                if u != t and (head == heads[t] or len(head) != len(heads[t])):
                    out[t].add(u)
                    out[u].add(t)
        return [frozenset(c) for c in out]

    def loose_rows(self, shape) -> np.ndarray:
        """Booleans of ``shape`` ``(..., Nq, e)``: the query rows (output, ``dq``) left
        out for :attr:`loose`; all False without it."""
        if self.loose is None:
            return np.zeros(shape, bool)
        rows, target = self.loose, tuple(shape[:-1])
        while rows.ndim > len(target):  # a gradient summed over broadcast dimensions
            rows = rows.any(axis=0)
        for ax, (a, b) in enumerate(zip(rows.shape, target)):
            if b == 1 and a != 1:
                rows = rows.any(axis=ax, keepdims=True)
        return np.broadcast_to(rows[..., None], shape)

    def _selection(self, rows) -> dict:
        """The reference keywords of ``chosen`` with some rows replaced (``rows``:
        ``((keyword, centroid), selection)`` pairs)."""
        alt = {name: sel.copy() for name, sel in self.chosen.items()}
        for (name, pos), row in rows:
            alt[name][pos] = row
        return alt

    def far_keywords(self) -> dict:
        """The reference keywords of the far selection of every such row at once."""
        return self._selection(self.far.items())

    def keywords(self, picks) -> dict:
        """The reference keywords of the selection with ``picks``, ``[(tie, option)]``, made."""
        return self._selection(pair for t, o in picks for pair in self.ties[t][1][o])

    def combined(self, run):
        """``together(picks)``: ``run``'s results (``{name: array}``) for the choices
        ``picks`` (``((tie, option), ...)``) taken together, each picks run once: the
        goldens :func:`nearest` recomputes where choices do not add."""
        cache = {}

        def together(picks):
            if picks not in cache:
                cache[picks] = run(self.keywords(list(picks)))
            return cache[picks]
        return together

    def deltas(self, run, golden: dict, rows: bool = False) -> list:
        """``[[{name: delta} per option] per tie]``: what each other admissible choice
        changes in the results ``golden`` (``{name: array}``), ``run(keywords)`` giving
        the results of a selection.

        The choices of different heads are made in one run where every result keeps
        the heads apart (its batch shape is the selection's; a gradient of an input
        broadcast over heads sums them): at most as many runs per keyword as one head
        has options. With ``rows`` (every result an output, ``(..., Nq, e)``), plain
        routing's choices of different queries are made in one run too: a query's
        centroid enters its own output row only.
        """
        rounds = []
        for name, sel in self.chosen.items():
            # a row per centroid (..., C, w), per Lloyd step (..., T, N) or per hashing
            # round (..., R, N); plain routing's keywords a value per token (..., N)
            batch = tuple(sel.shape[:-1] if name in TOKEN_KEYWORDS else sel.shape[:-2])
            own_row = rows and name == "query_clusters"
            picks = [(t, o, pos if own_row else pos[:len(batch)]) for t, ((kw, pos), opts)
                     in enumerate(self.ties) if kw == name for o in range(len(opts))]
            if all(tuple(np.shape(g)[:-2]) == batch for g in golden.values()):
                by_region = {}
                for t, o, region in picks:
                    by_region.setdefault(region, []).append((t, o, region))
                for r in range(max(map(len, by_region.values()), default=0)):
                    rounds.append([q[r] for q in by_region.values() if r < len(q)])
            else:
                rounds += [[p] for p in picks]
        out = [[None] * len(opts) for _, opts in self.ties]
        for group in rounds:
            res = run(self.keywords([(t, o) for t, o, _ in group]))
            for t, o, region in group:
                d = {}
                for n, g in golden.items():
                    diff = np.asarray(res[n], dtype=np.float64) - g
                    if len(group) > 1:
                        only = np.zeros_like(diff)
                        only[region] = diff[region]
                        diff = only
                    d[n] = diff
                out[t][o] = d
        return out


def alternatives(prep) -> Ties | None:
    """The near ties of ``prep``'s case in its dtype and every other admissible choice at
    each (:class:`Ties`); None for a variant or case without such choices, or no tie.

    clustered_topk: ``O(iterations Nq C d + C Nk d)`` (the float64 k-means and the
    centroids' logits); routing: ``O(C N d)`` (the scores); then a loop over the
    centroids on the host.
    """
    u = UNIT_ROUNDOFF[prep.dtype]
    if prep.variant.name in KMEANS_VARIANTS:
        rows = _topk_rows(prep, u)
    elif prep.variant.name == "routing":
        rows = _routing_rows(prep, u)
    elif prep.variant.name == "reformer":
        rows = {}
    else:
        return None
    chosen, found, far, near = {}, [], {}, {}
    for name, (scores, err, w) in rows.items():
        # the reference's selection: the w largest scores, ties to the lower index
        order = np.argsort(-scores, axis=-1, kind="stable")
        chosen[name] = np.ascontiguousarray(order[..., :w])
        for pos in np.ndindex(*order.shape[:-1]):
            pairs = near[name, pos] = _near_pairs(scores[pos], err[pos], order[pos], w)
            if len(pairs) > PER_CENTROID:
                far[name, pos] = _far(chosen[name][pos], pairs)
            found += [(r, (name, pos), a, b) for r, a, b in sorted(pairs)[:PER_CENTROID]]
    found.sort(key=lambda t: t[0])
    for _, at, _, _ in found[PER_CASE:]:
        far.setdefault(at, _far(chosen[at[0]][at[1]],
                                [(0.0, a, b) for r, p, a, b in found if p == at]))
    ties, swaps = {}, []
    for _, at, a, b in found[:PER_CASE]:
        row = chosen[at[0]][at[1]].copy()
        row[row == a] = b
        ties.setdefault(at, []).append(((at, row),))
        swaps.append((at, {a, b}, row))
    loose = None
    if prep.variant.name == "routing":
        _join_shared_queries(ties, swaps)
        loose = _loose_queries(chosen, near, far, prep.arrays["q"].shape[-2])
    if prep.variant.name in KMEANS_VARIANTS:
        _kmeans_ties(prep, u, chosen, ties)
    if prep.variant.name == "routing":
        _plain_routing_ties(prep, u, chosen, ties)
    if prep.variant.name == "reformer":
        _hash_ties(prep, u, chosen, ties)
    exact = HASH_EXACT if prep.variant.name == "reformer" else 0
    return Ties(chosen, list(ties.items()), far, loose, exact) if ties else None


def _loose_queries(chosen, near, far, nq):
    """Routing's :attr:`Ties.loose`: the queries within the margin of a centroid whose
    key selection is far, or None. The keys' batch may be broadcast over the queries'
    (one key head for several query heads)."""
    if "query_routes" not in chosen:
        return None
    qbatch = tuple(chosen["query_routes"].shape[:-2])
    kbatch = tuple(chosen["key_routes"].shape[:-2])
    c = chosen["query_routes"].shape[-2]
    kfar = np.zeros(kbatch + (c,), bool)
    for name, pos in far:
        if name == "key_routes":
            kfar[pos] = True
    full = np.broadcast_shapes(qbatch, kbatch)
    loose = np.zeros(qbatch + (nq,), bool)
    for *head, cen in zip(*np.nonzero(np.broadcast_to(kfar, full + (c,)))):
        # the query head of this (broadcast) head: index 0 along a dimension of size 1
        qhead = tuple(int(i) if m > 1 else 0 for i, m in zip(head[len(full) - len(qbatch):], qbatch))
        for _, a, b in near.get(("query_routes", qhead + (int(cen),)), []):
            loose[qhead + (a,)] = loose[qhead + (b,)] = True
    return loose if loose.any() else None


def _join_shared_queries(ties, swaps):
    """Add to ``ties`` (``{at: [option]}``) the joint options of routing's query swaps at
    two centroids of one head that move the same query: its output is the mean over
    its clusters, so neither swap alone comes near what both do (a query dropped by two
    centroids loses both), and :func:`nearest`, which takes a tie's option only where
    it lowers the error, would take neither. Each joint option goes with the first
    tie's options (at most one option per tie is taken, and a joint option taken
    leaves the second tie's own no better). Up to :data:`PER_CASE` joint options."""
    joint = 0
    for i, (at, toks, row) in enumerate(swaps):
        for at2, toks2, row2 in swaps[i + 1:]:
            if joint >= PER_CASE:
                return
            if at[0] == at2[0] == "query_routes" and at[1][:-1] == at2[1][:-1] and \
                    at[1] != at2[1] and toks & toks2:
                ties[at].append(((at, row), (at2, row2)))
                joint += 1


def _near_pairs(row, e, order, w):
    """``[(closeness, selected, unselected)]`` of one row of scores: the pairs of a
    selected token ``a`` and an unselected ``b`` with ``row[a] - row[b] <= e[a] + e[b]``
    (closeness: that gap over the margin). The selected tokens are tried from the
    weakest up, the others from the strongest down, while the pair is within the margin.
    """
    pairs = []
    if w >= len(order):
        return pairs
    for a in order[:w][::-1]:
        if row[a] - row[order[w]] > e[a] + e[order[w]]:
            break
        for b in order[w:]:
            gap = row[a] - row[b]
            if gap > e[a] + e[b]:
                break
            pairs.append((gap / (e[a] + e[b]), int(a), int(b)))
    return pairs


def _topk_rows(prep, u) -> dict:
    """clustered_topk's ``{"topk_keys": (logits, their margins, topk)}``, or ``{}``."""
    c, iterations, topk, seed = _settings(prep)
    q = np.asarray(prep.arrays["q"], dtype=np.float64)
    k = np.asarray(prep.arrays["k"], dtype=np.float64)
    if topk is None or c is None or topk >= k.shape[-2]:
        return {}
    centroids, _, _ = kmeans(q, c, iterations=iterations, seed=seed, xp=np)
    kt = np.swapaxes(k, -1, -2)
    logits = prep.scale * (centroids @ kt)
    err = u * (abs(prep.scale) * (np.abs(centroids) @ np.abs(kt)) + np.abs(logits) + 1.0)
    return {"topk_keys": (logits, err, topk)}


#: the reference keywords of plain routing that fix one token's centroid each, ``(..., N)``
TOKEN_KEYWORDS = ("query_clusters", "key_clusters")
#: plain routing's options per case: each takes a run of the reference (and of its VJP)
#: over the whole case. attn_ref's reference on torch, bfloat16 standard suite, seeds
#: 0-1: 27 and 32 cases ill-conditioned with none enumerated (2.7 and 0.9 s), 4-5 with
#: 16 options (3.0-4.6 s), 1-2 with 64 (8.9-10.8 s) and with 256 (37.5 s)
TOKEN_PER_CASE = 64


def _plain_routing_ties(prep, u, chosen, ties):
    """Add to ``ties`` (``{at: [option]}``, :func:`alternatives`) plain routing's near
    ties: a token ``x`` whose nearest centroid ``a`` and another ``b`` are about as near
    as the dtype resolves, by the distance the reference compares, ``d_j = |mu_j|^2 - 2 s_j``
    with ``s_j = mu_j . x / |x|``: ``d_b - d_a <= e_a + e_b``, ``e_j = u (8 |mu_j| .
    |x / |x|| + 4 |s_j| + 2 |mu_j|^2 + |d_j|)``: ``x / |x|`` within about ``3 u`` a
    coordinate (square, sum, root, quotient) and the dot product's sum ``u |mu_j| . |x / |x||``
    more, ``s_j`` and ``|mu_j|^2`` stored in the dtype, each doubled in ``d_j``, and
    ``d_j`` stored. attn_ref's reference on torch and under ``jax.jit`` erred at most
    0.79 of ``e_j`` in bfloat16 and 0.45 in float16 (standard suite, seed 0; at most 1.15
    of a first margin with ``4 |mu_j| . |x / |x||`` and ``|mu_j|^2``). A tie per token,
    an option per such ``b``: ``chosen["query_clusters"]`` (``key_clusters``) ``(..., N)``,
    all ``-1`` (the nearest, :func:`attn_ref.routing.routing_attention`), with that token
    set to ``b``. Up to :data:`TOKEN_PER_CASE` options, nearest first. Choices at different
    tokens need not add (a key moved into the cluster of a moved query): :func:`nearest`
    recomputes the golden of those taken together."""
    o = {**prep.params, **prep.options}
    if o.get("balanced", True):
        return
    mu = np.asarray(prep.params["centroids"], dtype=np.float64)
    mut = np.swapaxes(mu, -1, -2)
    sq = np.sum(mu * mu, axis=-1)[..., None, :]
    found, shapes = [], {}
    for name, x in (("query_clusters", prep.arrays["q"]), ("key_clusters", prep.arrays["k"])):
        x = np.asarray(x, dtype=np.float64)
        norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
        xh = x / np.where(norm > 0, norm, 1.0)
        s = xh @ mut
        d = sq - 2 * s
        e = u * (8 * (np.abs(xh) @ np.abs(mut)) + 4 * np.abs(s) + 2 * sq + np.abs(d))
        shapes[name] = d.shape[:-1]
        found += [(close, name, head + (i,), b) for close, head, i, b in _near_assignments(d, e)]
    found.sort(key=lambda f: f[0])
    for _, name, pos, b in found[:TOKEN_PER_CASE]:
        if name not in chosen:
            chosen[name] = np.full(shapes[name], -1, dtype=np.int64)
        ties.setdefault((name, pos), []).append((((name, pos), np.int64(b)),))


def _near_assignments(d, e):
    """``[(closeness, batch index, token, centroid b)]`` of distances ``d (..., N, C)``
    with roundings ``e``: the tokens whose nearest centroid ``a`` and another ``b`` have
    ``d_b - d_a <= e_a + e_b`` (closeness: that gap over the margin; k-means'
    assignments and plain routing's nearest centroids)."""
    a = np.argmin(d, axis=-1)[..., None]
    gap = d - np.take_along_axis(d, a, -1)
    margin = e + np.take_along_axis(e, a, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        close = np.where(margin > 0, gap / margin, 0.0)
    return [(float(close[(*h, i, b)]), tuple(map(int, h)), int(i), int(b))
            for *h, i, b in np.argwhere((gap <= margin) & (np.arange(d.shape[-1]) != a))]


#: reformer's hashed tokens with another admissible bucket tried per head (nearest first,
#: up to :data:`PER_CASE` in all): each takes a run of the reference per head. Of the
#: bfloat16 standard suite (seed 0) a head has up to 277 tokens within the margin
#: (1000 tokens, 2 rounds); an independent audit's unit-key kernel flipped tokens ranked
#: at most 25th of their head's
HASH_PER_HEAD = 32
#: reformer's choices recomputed per step of :func:`nearest`: adding the single flips'
#: differences (routing's way) left that kernel failing bfloat16
#: ``long:b1h1-q1000k1000-d64`` at 34x and ``near-ties`` at 12.8x; recomputing the 64
#: best passes them, at about 3x the time of a reformer standard-suite run (41 s against
#: 12.5 s)
HASH_EXACT = 64


def _hash_ties(prep, u, chosen, ties):
    """Add to ``ties`` (``{at: [option]}``, :func:`alternatives`) reformer's near ties:
    a key whose two largest hash logits ``[x R, -x R]`` are about as near as the dtype
    resolves, so that a kernel may hash it into either bucket
    (:func:`attn_ref.hashing.lsh_buckets`).

    The hash is scale-invariant, so a kernel may hash ``k`` or ``k / |k|``; in units of
    the unit key ``x = k / |k|`` the logit ``l_b = x . r_b`` of rotation column ``r_b``
    rounds by about ``u`` per coordinate of ``x`` and ``u |l_b|`` stored: the margin is
    routing's (:func:`_routing_rows`), ``e_b = 2 u (|x| . |r_b| + |l_b|)``, and buckets
    ``a`` (the largest) and ``b`` are a near tie when ``l_a - l_b <= e_a + e_b``. A
    zero key (every logit exactly 0) hashes to bucket 0 in any dtype: no tie.

    A tie per (head, round, token), an option per such ``b``: ``chosen["buckets"]``
    ``(..., R, N)``, all ``-1`` (hashed, :func:`attn_ref.hashing.reformer_attention`),
    with that token set to ``b``, and with it every token of its head whose key is the
    same (identical keys round alike: ``constant-keys``). Up to :data:`HASH_PER_HEAD`
    per head, nearest first, and :data:`PER_CASE` in all. A bucket moves a token in its
    round's sort, so choices at different tokens need not add: :func:`nearest`
    recomputes the golden of those taken together.
    """
    k = np.asarray(prep.arrays["k"], dtype=np.float64)
    rot = np.asarray(prep.params["rotations"], dtype=np.float64)
    norm = np.sqrt(np.sum(k * k, axis=-1, keepdims=True))
    x = k / np.where(norm > 0, norm, 1.0)
    half = np.einsum("...nd,dhb->...hnb", x, rot)
    size = np.einsum("...nd,dhb->...hnb", np.abs(x), np.abs(rot))
    logits = np.concatenate([half, -half], axis=-1)  # (..., R, N, 2B)
    err = 2.0 * u * (np.concatenate([size, size], axis=-1) + np.abs(logits))
    zero = norm[..., 0] == 0  # (..., N)
    found = [f for f in _near_assignments(-logits, err) if not zero[f[1][:-1] + (f[2],)]]
    found.sort(key=lambda f: f[0])
    per_head, picks = {}, []
    for _, at, i, b in found:
        head = at[:-1]
        if per_head.get(head, 0) < HASH_PER_HEAD and len(picks) < PER_CASE:
            per_head[head] = per_head.get(head, 0) + 1
            picks.append((at, i, b))
    if not picks:
        return
    chosen["buckets"] = np.full(logits.shape[:-1], -1, dtype=np.int64)
    done = set()
    for at, i, b in picks:
        head, r = at[:-1], at[-1]
        same = np.flatnonzero(np.all(k[head] == k[head + (i,)], axis=-1))
        if (head, r, int(same[0]), b) in done:
            continue
        done.add((head, r, int(same[0]), b))
        option = tuple((("buckets", head + (r, int(j))), np.int64(b)) for j in same)
        ties.setdefault(("buckets", head + (r, int(same[0]))), []).append(option)


#: variants whose queries are clustered by :func:`attn_ref.reduced.kmeans`
KMEANS_VARIANTS = ("clustered", "clustered_topk")


def _kmeans_steps(prep, u):
    """Per Lloyd assignment of the golden's k-means (:func:`attn_ref.reduced.kmeans`, in
    float64, the final one last): ``(d, e)``, each query's squared distance to each
    centroid less ``|x|^2``, ``d_j = |c_j|^2 - 2 x . c_j``, and its rounding in a kernel
    of unit roundoff ``u``, ``e_j = u (2 |x| . |c_j| + 2 |c_j|^2 + |d_j|)`` (the centroid
    stored in the dtype, each coordinate within ``u |c_i|``, and the distance stored in
    it); both ``(..., Nq, C)``. ``O(iterations^2 Nq C d)``."""
    c, iterations, _, seed = _settings(prep)
    x = np.asarray(prep.arrays["q"], dtype=np.float64)
    for it in range(iterations + 1):
        # the centroids the reference assigns against in iteration ``it`` (attn_ref's own
        # k-means stopped there: its trajectory, not a replay of it)
        cent = np.swapaxes(kmeans(x, c, iterations=it, seed=seed, xp=np)[0], -1, -2)
        sq = np.sum(cent * cent, axis=-2)[..., None, :]
        d = sq - 2 * (x @ cent)
        yield d, u * (2 * (np.abs(x) @ np.abs(cent)) + 2 * sq + np.abs(d))


def _kmeans_ties(prep, u, chosen, ties):
    """Add to ``ties`` (``{at: [option]}``, :func:`alternatives`) one tie per head whose
    k-means has assignments within the margin (:func:`_kmeans_steps`: the nearest ``a``
    and a centroid ``b`` with ``d_b - d_a <= e_a + e_b``), and ``chosen["assignments"]``,
    all ``-1`` (every assignment to the nearest, :func:`attn_ref.reduced.kmeans`).

    Each option assigns one such query to ``b`` at that step and lets Lloyd's iterations
    go on from there: the clustering a kernel computes that rounds that one distance the
    other way. Up to :data:`PER_CENTROID` per head, the nearest ties first, and
    :data:`PER_CASE` in all; two flips in one clustering are not enumerated. With
    clustered_topk's ``topk_keys`` chosen, an option also sets the top-k keys of the
    centroids it moves (the top-k of its own centroids, in float64).
    """
    c, iterations, topk, seed = _settings(prep)
    if c is None or c < 2:
        return
    found = [(close, head, t, i, b) for t, (d, e) in enumerate(_kmeans_steps(prep, u))
             for close, head, i, b in _near_assignments(d, e)]
    found.sort(key=lambda f: f[0])
    per_head = {}
    for f in found:
        if len(per_head.setdefault(f[1], [])) < PER_CENTROID:
            per_head[f[1]].append(f)
    picks = sorted((f for fs in per_head.values() for f in fs), key=lambda f: f[0])[:PER_CASE]
    if not picks:
        return
    x = np.asarray(prep.arrays["q"], dtype=np.float64)
    n = x.shape[-2]
    chosen["assignments"] = np.full(x.shape[:-2] + (iterations + 1, n), -1, dtype=np.int64)
    if "topk_keys" in chosen:
        kt = np.swapaxes(np.asarray(prep.arrays["k"], dtype=np.float64), -1, -2)
        centroids = kmeans(x, c, iterations=iterations, seed=seed, xp=np)[0]
    for _, head, t, i, b in picks:
        forced = np.full((iterations + 1, n), -1, dtype=np.int64)
        forced[t, i] = b
        option = [(("assignments", head + (t,)), forced[t])]
        if "topk_keys" in chosen:
            moved_c = centroids.copy()
            moved_c[head] = kmeans(x[head], c, iterations=iterations, seed=seed,
                                   assignments=forced, xp=np)[0]
            top = np.argsort(-(prep.scale * (moved_c @ kt)), axis=-1, kind="stable")[..., :topk]
            for p in np.argwhere(np.any(top != chosen["topk_keys"], axis=-1)):
                option.append((("topk_keys", tuple(map(int, p))), top[tuple(p)]))
        ties.setdefault(("assignments", head + (iterations,)), []).append(tuple(option))


def kmeans_margins(prep) -> np.ndarray | None:
    """Per batch entry and head, the tightest k-means assignment of the golden's
    clustering, as its margin over the dtype's rounding: ``(B, H)`` ratios (at most 1: a
    near tie), or None for a case without k-means (``num_clusters`` unset or below 2).

    Lloyd's iterations of :func:`attn_ref.reduced.kmeans` on the queries, in float64:
    at every assignment (the last included) each query's squared distances to the
    centroids, ``d_j = |c_j|^2 - 2 x . c_j``, round in a kernel of unit roundoff ``u`` by
    at most ``e_j = u (2 |x| . |c_j| + 2 |c_j|^2 + |d_j|)`` (the centroid stored in the
    dtype, each coordinate within ``u |c_i|``, and the distance stored in it); the
    nearest ``a`` and the next ``b`` are a near tie when ``d_b - d_a <= e_a + e_b``. A
    kernel that assigns such a query otherwise clusters otherwise from that iteration
    on and computes another function: the oracle enumerates one such flip per
    clustering (:func:`alternatives`), not two or more, and names a failure they may
    explain in its diagnosis (:mod:`conformance.diagnose`). In bfloat16 most heads of
    the standard suite have a near tie (the bound is a worst case; 75 of 96
    clustered_topk heads, seed 0), so they are no reason to leave a head out.
    """
    c = _settings(prep)[0]
    if prep.variant.name not in KMEANS_VARIANTS or c is None or c < 2:
        return None
    ratio = np.full(np.shape(prep.arrays["q"])[:-2], np.inf)
    for d, e in _kmeans_steps(prep, UNIT_ROUNDOFF[prep.dtype]):
        order = np.argsort(d, axis=-1, kind="stable")[..., :2]
        (da, db), (ea, eb) = (np.moveaxis(np.take_along_axis(y, order, -1), -1, 0) for y in (d, e))
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(db > da, (db - da) / (ea + eb), 0.0)
        ratio = np.minimum(ratio, np.min(r, axis=-1))
    return ratio


def _routing_rows(prep, u) -> dict:
    """routing's ``{"query_routes" | "key_routes": (scores, their margins, w)}`` (balanced
    routing; ``{}`` for plain routing, whose nearest centroids are
    :func:`_plain_routing_ties`').

    The score of token ``x`` for centroid ``mu`` is ``s = mu . x / |x|``. A kernel of unit
    roundoff ``u`` rounds ``x / |x|`` by about ``u`` per coordinate and the stored score by
    ``u |s|``: attn_ref's reference under torch and under ``jax.jit``, in bfloat16 and
    float16 (``d`` = 8 to 64, 257 tokens, 4 centroids), erred at most ``1.13 u (|mu| .
    |x / |x|| + |s|)``. The margin is twice that sum, ``2 u (|mu| . |x / |x|| + |s|)``: a
    kernel that ranks by the distance ``|x / |x| - mu|`` instead (the same order in exact
    arithmetic) rounds ``2 - 2 s`` by about ``u (1 - s)``, within it.
    """
    o = {**prep.params, **prep.options}
    if not o.get("balanced", True):
        return {}
    mu = np.asarray(prep.params["centroids"], dtype=np.float64)
    size = o.get("cluster_size")
    out = {}
    for name, x in (("query_routes", prep.arrays["q"]), ("key_routes", prep.arrays["k"])):
        x = np.asarray(x, dtype=np.float64)
        n = x.shape[-2]
        w = min(-(-n // mu.shape[-2]) if size is None else size, n)
        norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
        xt = np.swapaxes(x / np.where(norm > 0, norm, 1.0), -1, -2)
        scores = mu @ xt
        err = 2.0 * u * (np.abs(mu) @ np.abs(xt) + np.abs(scores))
        out[name] = (scores, err, w)
    return out


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


def nearest(got, golden, deltas, keep=None, rerun=None, conflicts=None, exact=0):
    """The golden of the admissible choice nearest to ``got``: ``golden`` plus, at each
    tie, the one of its ``deltas`` (each the difference an other choice makes, or
    nothing) that leaves the least squared error on the compared values, the ties
    taken best first. ``deltas``: ``[[delta, ...] per tie]``.

    Choices at different ties add where each centroid's selection enters only its own
    members' output rows (clustered_topk; the gradients as sums over centroids). Where
    they need not (routing: a query swapped into a cluster whose keys are swapped too
    reads the other keys), ``rerun(picks)`` gives the golden of the choices taken at
    once, ``picks`` ``[(tie, option)]``: the differences only choose them. A tie
    taken excludes its ``conflicts`` (:attr:`Ties.conflicts`: a k-means tie's option
    is a whole other clustering of its head).

    With ``exact`` (and ``rerun``) the choices need not add at all (reformer's buckets:
    a token moved to another bucket shifts the chunks of every token sorted between, and
    two such moves over the same tokens shift them by two, not by the sum of two shifts):
    the ``exact`` best changes by their differences are recomputed with the choices
    taken, and the best of them taken while it lowers the error (:func:`_nearest_exact`).
    """
    if not deltas:
        return golden
    got = np.asarray(got, dtype=np.float64)
    mask = np.ones(np.shape(golden), bool) if keep is None else np.broadcast_to(keep, np.shape(golden))
    ok = mask & np.isfinite(got)
    cur = np.array(golden, dtype=np.float64)

    def err(x):
        return float(np.sum(np.where(ok, (got - x) ** 2, 0.0)))

    # best first: the option that lowers the error most, of a tie not yet chosen at, until
    # none does (tie by tie in order, a joint option that matched half of a kernel's
    # choice was taken before the tie of its other half: routing, cross:b2h1-q129k63-d32)
    picks, now = [], err(cur)
    if exact and rerun is not None:
        return _nearest_exact(err, cur, now, deltas, rerun, exact)
    while True:
        taken = {t for t, _ in picks}
        if conflicts is not None:
            taken = taken.union(*(conflicts[t] for t, _ in picks))
        best, best_err = None, now
        for t, options in enumerate(deltas):
            if t in taken:
                continue
            for o, d in enumerate(options):
                e = err(cur + d)
                if e < best_err:
                    best, best_err = (t, o), e
        if best is None:
            break
        cur, now = cur + deltas[best[0]][best[1]], best_err
        picks.append(best)
    picks.sort()
    if rerun is not None and len(picks) > 1:
        return np.asarray(rerun(tuple(picks)), dtype=np.float64)
    return cur


def _nearest_exact(err, cur, now, deltas, rerun, exact):
    """:func:`nearest` for choices that need not add: the differences rank every change
    of one tie's choice (an option taken, another option at a tie taken: a token about
    as near three buckets, whose wrong option alone lowered the error more); the
    ``exact`` best are recomputed with the choices taken (``rerun``), and the one that
    lowers the error most is taken, until none does."""
    picks = {}
    while True:
        ranked = []
        for t, options in enumerate(deltas):
            old = picks.get(t)
            for o, d in enumerate(options):
                if o != old:
                    ranked.append((err(cur + d - (0 if old is None else options[old])), t, o))
        ranked.sort(key=lambda r: r[0])
        best, best_err, best_cur = None, now, None
        for _, t, o in ranked[:exact]:
            alt = np.asarray(rerun(tuple(sorted({**picks, t: o}.items()))), dtype=np.float64)
            e = err(alt)
            if e < best_err:
                best, best_err, best_cur = (t, o), e, alt
        if best is None:
            return cur
        picks[best[0]] = best[1]
        cur, now = best_cur, best_err


def settled(shape, deltas, below=0.0) -> np.ndarray:
    """Booleans of ``shape``: the values no admissible choice at a near tie changes by
    more than ``below``.

    Exported vectors (:mod:`conformance.vectors`) hold one golden and compare the rest
    only: a consumer cannot choose the admissible function nearest to its kernel. They
    pass ``below`` = :data:`SETTLED_SHARE` of the smaller bound: a k-means flip moves
    every centroid after it, most values of its head by much less than the bound."""
    out = np.ones(shape, bool)
    for options in deltas:
        for d in options:
            out &= np.abs(np.broadcast_to(d, shape)) <= below
    return out
