"""The exponent of ``N`` in an analytic cost string such as ``"O(N (l + N/l) d)"``.

The registry (:mod:`attn_ref.registry`) states each variant's cost as text; the benchmark
suite (:mod:`asv_benches._common`) caps ``N`` by it and the scaling report
(:mod:`asv_benches.scaling`) holds fitted exponents against it. Both read it here.
"""

from __future__ import annotations

import math
import re
from dataclasses import astuple, dataclass

__all__ = ["cost_exponent", "Work", "WORK", "variant_work", "linear_causal_work"]

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([A-Za-z_][A-Za-z_0-9]*)|(.))")
_N_SYMBOLS = {"N", "Nq", "Nk", "N_q", "N_k", "n"}


class _CostParser:
    """Exponent of ``N`` in a cost such as ``"O(N (l + N/l) d)"``.

    Grammar: sums (``+``) take the largest exponent, products (juxtaposition, ``*``)
    add, quotients subtract, ``^`` multiplies; ``N``, ``Nq``, ``Nk`` count 1, other
    symbols (``d``, ``m``, ``w``...) are constants, ``log(...)`` counts 0 and
    ``sqrt(x)`` half of ``x``.
    """

    def __init__(self, text):
        self.toks = []
        for num, name, other in _TOKEN.findall(text):
            if num:
                self.toks.append(("num", float(num)))
            elif name:
                self.toks.append(("name", name))
            elif other.strip():
                self.toks.append(("op", other))
        self.i = 0
        self.mentions_n = False

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise ValueError(f"unexpected {tok[1]!r}")
        self.i += 1
        return tok

    def expr(self):
        e = self.term()
        while self.peek() == ("op", "+"):
            self.take()
            e = max(e, self.term())
        return e

    def term(self):
        e = self.power()
        while True:
            kind, val = self.peek()
            if (kind, val) == ("op", "*"):
                self.take()
                e += self.power()
            elif (kind, val) == ("op", "/"):
                self.take()
                e -= self.power()
            elif kind in ("num", "name") or (kind, val) == ("op", "("):
                e += self.power()
            else:
                return e

    def power(self):
        base, number = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            _, exp_number = self.atom()
            if exp_number is None:
                raise ValueError("exponent must be a number")
            return base * exp_number
        return base

    def atom(self):
        kind, val = self.take()
        if kind == "num":
            return 0.0, val
        if kind == "name":
            if val in ("log", "sqrt") and (self.peek()[0] in ("num", "name")
                                           or self.peek() == ("op", "(")):
                inner, _ = self.atom()
                return (0.0 if val == "log" else inner / 2), None
            if val in _N_SYMBOLS:
                self.mentions_n = True
                return 1.0, None
            return 0.0, None
        if val == "(":
            e = self.expr()
            self.take("op", ")")
            return e, None
        raise ValueError(f"unexpected {val!r}")


def cost_exponent(cost: str) -> float | None:
    """The exponent of ``N`` in an analytic cost string, or None if it names no ``N``.

    >>> cost_exponent("O(N^2 d)"), cost_exponent("O(N (l + N/l) d)"), cost_exponent("O(N m d + m^3)")
    (2.0, 2.0, 1.0)
    >>> cost_exponent("O(N log N)"), cost_exponent("O(N sqrt(N) d)")
    (1.0, 1.5)
    >>> cost_exponent("O(nnz B^2 d)") is None
    True
    """
    text = cost.strip()
    m = re.fullmatch(r"O\s*\((.*)\)", text)
    if m:
        text = m.group(1)
    p = _CostParser(text.replace("²", "^2"))
    try:
        e = p.expr()
        if p.i != len(p.toks):
            raise ValueError("trailing text")
    except ValueError:
        return None
    return e if p.mentions_n else None


# --------------------------------------------------------------------------- fitting


# --------------------------------------------------------------------------- roofline
#
# What each variant must do at least, under its benchmark configuration
# (``BENCH_CONFIGS`` in ``asv_benches/_common.py``), counted per head and summed over
# the heads. The counts are the method's, not the implementation's: a tiled
# implementation that computes a score twice, or writes a tile to memory and reads it
# back, is slower than its roofline by exactly that. A variant that attends over
# ``S`` query-key pairs does ``4 S d`` GEMM FLOPs (``Q K^T`` and ``P V``), ``S``
# exponentials and ``3 S`` other elementwise operations (scale and subtract the
# running maximum, add to the row sum, divide); reading ``q, k, v`` and writing the
# output moves ``4 N d`` floats, whatever the variant.


@dataclass(frozen=True)
class Work:
    """Least work of one call: GEMM FLOPs, transcendental evaluations (``exp``, ``log``),
    other elementwise operations, and bytes that must cross the memory bus."""

    gemm_flops: float
    transcendentals: float
    elementwise: float
    bytes: float

    def __add__(self, other):
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, c):
        return Work(*(a * c for a in astuple(self)))

    def seconds(self, rates: dict) -> float:
        """Roofline time at ``rates`` (``gemm_flops``, ``exp``, ``elementwise`` per
        second in cache, ``bandwidth`` bytes per second): the compute terms add up, the
        memory traffic overlaps them.

        Every rate must be the whole machine's (``tools/targets.py rates``: the better
        of one caller on the library's threads and one caller per CPU at once): the
        terms then add as if all cores did each kind of work in turn, the least time
        any split of the work over the cores can take. With one core's ``exp`` rate
        beside an all-core GEMM rate (as measured before 2026-12-02), an implementation
        that runs its exponentials on every core (a heads pool) could come in under
        its roofline."""
        compute = (self.gemm_flops / rates["gemm_flops"] + self.transcendentals / rates["exp"]
                   + self.elementwise / rates["elementwise"])
        return max(compute, self.bytes / rates["bandwidth"])


_F32 = 4


def _attend(pairs: float, d: int) -> Work:
    """Softmax attention over ``pairs`` query-key pairs of dimension ``d``."""
    return Work(4 * pairs * d, pairs, 3 * pairs, 0.0)


def _io(n: int, d: int, arrays: int = 4) -> Work:
    """Reading ``q, k, v`` and writing the output, ``(n, d)`` float32 each."""
    return Work(0.0, 0.0, 0.0, arrays * n * d * _F32)


def _clusters(n, d, c, iterations):
    # Lloyd's algorithm on the queries: distances to C centroids (a GEMM), the argmin,
    # the centroid means; then the C centroids attend to every key.
    lloyd = Work(2 * n * c * d, 0.0, n * c + n * d, 0.0) * iterations
    return lloyd + _attend(c * n, d)


def _work_softmax(n, d, c):
    return _attend(n * n, d) + _io(n, d)


def _work_compressed(n, d, c):
    m = -(-n // c["stride"])  # compressed keys and values
    conv = Work(2 * 2 * m * c["kernel_size"] * d * d, 0.0, 0.0, 0.0)
    return conv + _attend(n * m, d) + _io(n, d)


def _work_linear(n, d, c):
    """Non-causal linear attention with elu+1 features (``dv = d``), per head.

    * exponentials: ``elu(x) + 1`` is ``x + 1`` for ``x > 0`` and ``exp(x)`` else; the
      sign of ``x`` is not known before it is read, so every element of ``q`` and ``k``
      takes one ``exp``: ``2 n d``.
    * elementwise: per element of ``q`` and ``k`` the ``x + 1`` and the choice between
      it and ``exp(x)`` (``4 n d``); the division of the numerator by the
      denominator (``n d``).
    * GEMM: the state ``phi(K)^T [V, 1] = [S, z]`` and the readout ``phi(Q) [S, z]``:
      the normaliser ``z = sum_j phi(k_j)`` and the denominators ``phi(q_i) . z`` ride
      along as one more column of ``V`` (``2 n d (d + 1)`` each), cheaper than
      computing them apart at the elementwise rate.
    * memory: ``q``, ``k``, ``v`` read once and the output written once (``_io``); at
      ``N = 65536``, 8 heads, ``d = 64`` that is 4 x 134 MB. Nothing else need leave
      the cache: the features of a block of rows are made, used and dropped there
      (``attn_ref.linear``, ``block_size``), so a full-size pass over ``phi(Q)`` or
      ``phi(K)`` is the implementation's cost, not the method's.
    """
    return Work(4 * n * d * (d + 1), 2 * n * d, 4 * n * d + n * d, 0.0) + _io(n, d)


def linear_causal_work(n: int, d: int = 64, *, chunk_size: int = 64, heads: int = 8) -> Work:
    """Causal linear attention (elu+1, ``dv = d``) in the chunked form at chunk size ``C``,
    all heads: the non-causal count (:func:`_work_linear`: the chunk states ``phi(K_c)^T
    [V_c, 1]`` are the fold's products and the read of the state entering each chunk is
    the readout's) plus, per chunk,

    * GEMM: the causal half of ``phi(Q_c) phi(K_c)^T``, diagonal included (``(C + 1) / 2``
      keys per query on average, ``2 d`` flops each: ``n (C + 1) d``) and of its product
      with ``[V_c, 1]`` (``n (C + 1) (d + 1)``);
    * elementwise: the mask's products on that half (``n C / 2``) and the running sum of
      the chunk states (``d (d + 1)`` additions per chunk, ``n d (d + 1) / C``).

    At ``C = d`` the in-chunk products are half as many flops again as the non-causal
    GEMMs, so causal's roofline is about 1.3x non-causal's at ``N = 65536``, 8 heads,
    ``d = 64``; an implementation that forms the whole ``C x C`` products (as
    ``attn_ref.linear`` does) does twice the non-causal GEMM flops.
    """
    C = min(chunk_size, n)
    intra = Work(n * (C + 1) * (2 * d + 1), 0.0, n * C / 2 + n * d * (d + 1) / C, 0.0)
    return (_work_linear(n, d, {}) + intra) * heads


def _decayed(n, d, c, per_dim, constant=False):
    """The chunk form of a decayed linear attention at chunk size ``C`` (``d = dk = dv``).

    Per chunk, with ``b`` the running sum of the log decays from the chunk's start and
    ``B`` its total (see ``docs/recurrent.md``, Cost):

    * GEMM: the causal half of ``Q K^T`` and of ``A V`` (``C/2`` keys per query on
      average, ``2 d`` flops each: ``n C d`` apiece), the read of the entering state
      ``(q exp(b)) S`` and the state's update ``(k exp(B - b))^T V`` (``2 n d^2`` each).
    * exponentials: a scalar decay (SSD) multiplies ``Q K^T`` by the causal half of
      ``exp(b_i - b_j)``; taken pairwise that is ``n C / 2`` exponentials, but the block
      of rows ``i >= m > j`` of a halved chunk factors through the reference point
      ``r = b_{m-1}``, ``exp(b_i - r) exp(r - b_j)``, both exponents ``<= 0``: halving
      down to single steps, each of the ``log2 C`` levels takes one exponential per
      step, ``n log2 C`` (the product that forms each entry is elementwise work, below).
      A per-key-dimension decay (GLA) does not factor out of the dot product, but it
      factors through a reference point ``r`` per chunk and dimension:
      ``exp(b_i - b_j) = exp(b_i - r) exp(r - b_j)``, so
      ``A = (q * e) (k / e)^T`` with ``e = exp(b - r)``, one exponential per gate
      element, ``n d``; ``q exp(b) = (q e) exp(r)`` and ``k exp(B - b) = (k / e)
      exp(B - r)`` for the state's read and update then take ``d`` exponentials per
      chunk each (``exp(r)``, ``exp(B - r)``, and ``exp(B)`` for the hand-over:
      ``3 n d / C``). Each gate element enters the output through an exponential, so
      ``n d`` is the least. This needs ``|b - r|`` within the float range (``r``
      midway, half the chunk's decay: at most ``log(max) / 2`` for each factor, 44.4
      in float32), which fla's gates (``logsigmoid(randn)``, about ``-0.8`` a step)
      meet at ``C = 64`` (the benchmark's draw at ``T = 16384``: a chunk's decay is
      at most 73 of the 88.7 allowed, 51 on average); stronger gates need the halving of
      ``decayed_scores``, ``n d log2 C`` (``attn_ref`` checks and chooses). Until the
      factored form was implemented the count took the halving, and ``2 n d`` for
      ``exp(b)`` and ``exp(B - b)``: at ``d = C = 64`` that is 8 exponentials per gate
      element against 1.05 now, and ``2 n d log2 C`` subtractions and products against
      ``3 n d``: the roofline at ``T = 16384``, ``H = 8`` fell from 82.1 to 44.4 ms
      (at the rates of one quiet ``tools/targets.py recurrent`` run: GEMM 99.1 GFLOP/s,
      ``exp`` 2.10 and multiply 7.60 Gelem/s).
      Otherwise ``exp(b)`` and ``exp(B - b)`` for ``q`` and ``k``, ``n`` each.
      ``constant`` (retention: the same decay every step): every chunk has the same
      ``b``, so the decay matrix and the two scalings are computed once per head,
      ``C^2 / 2 + 2 C`` exponentials and no gates read.
    * elementwise: the decay's product with the scores (``n C / 2``; forming the
      factored entries takes as many again, left out: scaling the operands of a
      block's GEMM instead costs ``C d`` per level, and a lower bound need not choose)
      or, per-dimension, ``b - r`` and the two factors ``q e``, ``k / e`` (``3 n d``),
      the scaling of ``q`` and ``k`` (``2 n d``) and the running sum (``n e``); the
      gates read once. The hand-over ``S <- diag(exp(B)) S + dS`` is free with a scalar decay
      (a GEMM's ``C <- alpha A B + beta C`` with ``beta = exp(B)``) and ``d^2`` products
      per chunk with GLA's per-dimension one (``n d^2 / C``).

    Left out, as work an implementation can avoid: the scale (folded into ``exp(b)``
    and the decay), passes over whole arrays (tiles stay in cache), and the upper
    halves of the ``C x C`` products (``attn_ref`` computes them whole, ``2 n C d``
    more flops).
    """
    C = min(c["chunk_size"], n)
    gemm = Work(2 * n * C * d + 4 * n * d * d, 0.0, 0.0, 0.0)
    if per_dim:
        # the factored form: exp(b - r) per gate element; exp(r), exp(B - r), exp(B)
        # per chunk and dimension give the scalings of q and k and the hand-over
        e, scores = d, Work(0.0, n * d + 3 * n * d / C, 3 * n * d + n * d * d / C, 0.0)
    elif constant:
        e, scores = 1, Work(0.0, C * C / 2, n * C / 2, 0.0)
    else:
        e, scores = 1, Work(0.0, n * math.log2(C), n * C / 2, 0.0)
    if constant:
        gates = Work(0.0, 2 * C, 2 * n * d + C, 0.0)
    elif per_dim:  # the scalings' exponentials are counted with the factored scores
        gates = Work(0.0, 0.0, 2 * n * d + n * e, n * e * _F32)
    else:
        gates = Work(0.0, 2 * n * e, 2 * n * d + n * e, n * e * _F32)
    return gemm + scores + gates + _io(n, d)


def _delta(n, d, c, gated):
    """The chunked WY/UT form of the (gated) delta rule at chunk size ``C``.

    The decayed form's work (with a scalar decay, or none) plus, per chunk: ``K K^T``'s
    strict causal half (``n C d``); the values written, ``U = M^{-1} diag(beta) (V -
    exp(b) K S)`` for the unit lower-triangular ``M = I + tril(diag(beta) (K K^T * D),
    -1)`` and the state ``S`` entering the chunk: ``exp(b) K S`` (``2 n d^2``) and a
    triangular solve with the ``C x d`` right-hand side (``C^2 / 2`` multiply-adds per
    column: ``n C d``). The WY/UT form that fla's kernels and this package use
    computes ``W = M^{-1} diag(beta) exp(b) K`` and ``M^{-1} diag(beta) V`` for every
    chunk at once and ``U - W S`` in the sequence: ``2 n C d`` for the solve on the
    ``C x 2d`` right-hand side, ``n C d`` more than the count, which takes the least
    (the implementation forms ``M^{-1}`` by doubling and multiplies dense ``C x C``
    blocks: ``n (2 C^2 / 3 + 4 C d)`` flops, 2.3 times the count's ``n C d`` at
    ``C = d = 64``). Elementwise: ``beta`` times ``K K^T * D`` (``n C / 2``), ``exp(b)
    K`` and ``beta`` times the right-hand side (``2 n d``); with ``qk_l2norm`` the
    normalisation of ``q`` and ``k`` (square, sum, divide: ``6 n d``, and ``2 n``
    square roots); ``beta`` read once.
    """
    C = min(c["chunk_size"], n)
    base = _decayed(n, d, c, False) if gated else (
        Work(2 * n * C * d + 4 * n * d * d, 0.0, 0.0, 0.0) + _io(n, d))
    ut = Work(n * C * d + n * C * d + 2 * n * d * d, 0.0, n * C / 2 + 2 * n * d, n * _F32)
    norm = Work(0.0, 0.0, 6 * n * d + 2 * n, 0.0) if c.get("qk_l2norm") else Work(0.0, 0.0, 0.0, 0.0)
    return base + ut + norm


def _work_linformer(n, d, c):
    r = c["rank"]
    project = Work(2 * 2 * r * n * d, 0.0, 0.0, 2 * r * n * _F32)  # E K, F V; E and F read
    return project + _attend(n * r, d) + _io(n, d)


def _work_performer(n, d, c):
    m = c["features"]
    # phi(x) = exp(w x - |x|^2 / 2) / sqrt(m) for q and k; K'^T V, Q' (K'^T V), normaliser.
    features = Work(2 * 2 * n * d * m, 2 * n * m, 2 * (n * m + n * d), 0.0)
    return features + Work(4 * n * m * d, 0.0, 2 * n * m + n * d, 0.0) + _io(n, d)


def _work_pooled(n, d, c):
    m = c["num_segments"]
    return Work(0.0, 0.0, 2 * n * d, 0.0) + _attend(n * m, d) + _io(n, d)


def _work_query_reduced(n, d, c):
    m = c["num_segments"]
    return Work(0.0, 0.0, n * d, 0.0) + _attend(m * n, d) + _io(n, d)


def _work_nystrom(n, d, c):
    m = c["num_landmarks"]
    pinv = Work(6 * 4 * 2 * m**3, 0.0, 6 * 2 * m * m, 0.0)  # Newton-Schulz, 4 products a step
    # F = softmax(Q K~^T) (N x m), A = softmax(Q~ K~^T) (m x m), B = softmax(Q~ K^T) (m x N);
    # B V, A+ (B V), F (A+ B V).
    kernels = Work(2 * (n * m + m * m + m * n) * d, n * m + m * m + m * n,
                   3 * (n * m + m * m + m * n) + 2 * n * d, 0.0)
    products = Work(2 * m * n * d + 2 * m * m * d + 2 * n * m * d, 0.0, 0.0, 0.0)
    return pinv + kernels + products + _io(n, d)


def _work_clustered(n, d, c):
    return _clusters(n, d, c["num_clusters"], 10) + _io(n, d)


def _work_clustered_topk(n, d, c):
    # the clustered attention, then each query again on its cluster's top-k keys
    return _work_clustered(n, d, c) + _attend(n * c["topk"], d) + Work(0.0, 0.0, c["num_clusters"] * n, 0.0)


def _work_block_sparse(n, d, c):
    b = c["block_size"]
    return _attend(n * min(n, c["blocks_per_row"] * b), d) + _io(n, d)


def _work_local(n, d, c):
    return _attend(n * min(n, 2 * c["window"] + 1), d) + _io(n, d)


def _work_longformer(n, d, c):
    g = len(c["global_tokens"])
    # each query: its window and the global tokens; each global token: every key
    return _attend(n * min(n, 2 * c["window"] + 1 + g) + g * n, d) + _io(n, d)


def _work_bigbird(n, d, c):
    b = c["block_size"]
    keys = (2 * c["window"] + 1 + c["global_blocks"] + c["random_blocks"]) * b
    return _attend(n * min(n, keys) + c["global_blocks"] * b * n, d) + _io(n, d)


def _work_strided(n, d, c):
    # causal: the last l positions and every l-th before them, N / (2 l) on average
    s = c["stride"]
    return _attend(n * (min(n, s) + n / (2 * s)), d) + _io(n, d)


def _work_fixed(n, d, c):
    # causal: the query's own block (l / 2 on average) and c summary positions of
    # each earlier block (N / (2 l) of them on average)
    s = c["stride"]
    return _attend(n * (s / 2 + c["summary"] * n / (2 * s)), d) + _io(n, d)


def _work_routing(n, d, c):
    # unit rows of q and k and their scores against C centroids (a GEMM), two argsorts
    # per centroid and side (counted as log2 N passes over C N entries), then C dense
    # w x w blocks (w = N / C) and the gather/average passes
    k = c["num_clusters"]
    w = -(-n // k)
    log_n = max(1.0, math.log2(n))
    route = Work(2 * 2 * n * k * d, 0.0, 2 * 3 * n * d + 2 * 2 * k * n * log_n, 0.0)
    gather = Work(0.0, 0.0, 3 * k * w * d + 2 * k * n * d, 0.0)
    return route + _attend(k * w * w, d) + gather + _io(n, d)


def _work_synthesizer_dense(n, d, c):
    # relu(X W1 + b1) W2 + b2 (d x d, then d x N), then softmax(B) V: no Q K^T
    mlp = Work(2 * n * d * d + 2 * n * d * n, 0.0, 2 * n * d + n * n, 0.0)
    return mlp + Work(2 * n * n * d, n * n, 3 * n * n, 0.0) + _io(n, d)


def _work_synthesizer_random(n, d, c):
    # softmax(R) V; R (N x N, float32) read once
    return Work(2 * n * n * d, n * n, 3 * n * n, n * n * _F32) + _io(n, d)


def _work_synthesizer_random_mix(n, d, c):
    # the dot-product logits too, and the mix
    return _work_synthesizer_random(n, d, c) + Work(2 * n * n * d, 0.0, 2 * n * n, 0.0)


def _work_reformer(n, d, c):
    h, ch = c["n_hashes"], c["chunk_size"]
    b = c["n_buckets"] // 2  # rotations per round
    # hash (x R, the argmax), sort (log N compare-and-moves per position), then each
    # round's queries attend to 2 chunks; the duplicate count compares H chunk indices
    # per pair; the rounds are combined with one exp per round and position.
    hashing = Work(2 * n * d * h * b, 0.0, 2 * h * n * b + h * n * max(1, n.bit_length()), 0.0)
    count = Work(0.0, 0.0, 2 * h * (h * n * 2 * ch), 0.0)
    combine = Work(0.0, h * n, 2 * h * n * d, 0.0)
    return hashing + _attend(h * n * 2 * ch, d) + count + combine + _io(n, d)


def _work_sinkhorn(n, d, c):
    b, it = c["block_size"], c["n_iters"]
    nb = n // b
    # Sinkhorn: each iteration normalises rows and columns (an exp and a log-sum-exp
    # pass each); the sorted blocks P K and P V; each query attends to 2 b keys.
    sinkhorn = Work(0.0, 2 * it * nb * nb + nb * nb, 6 * it * nb * nb, 0.0)
    sort = Work(2 * 2 * nb * nb * b * d, 0.0, 0.0, 0.0)
    return sinkhorn + sort + _attend(n * 2 * b, d) + _io(n, d)


#: ``{variant: work(n, d, config values) -> Work}`` per head; a registered variant
#: without one fails ``tests/test_benchmarks.py``.
WORK = {
    "softmax": _work_softmax,
    "online_softmax": _work_softmax,
    "compressed": _work_compressed,
    "linear": _work_linear,
    "retention": lambda n, d, c: _decayed(n, d, c, False, constant=True),
    "gla": lambda n, d, c: _decayed(n, d, c, True),
    "ssd": lambda n, d, c: _decayed(n, d, c, False),
    "deltanet": lambda n, d, c: _delta(n, d, c, False),
    "gated_deltanet": lambda n, d, c: _delta(n, d, c, True),
    "linformer": _work_linformer,
    "performer": _work_performer,
    "pooled": _work_pooled,
    "query_reduced": _work_query_reduced,
    "nystrom": _work_nystrom,
    "clustered": _work_clustered,
    "clustered_topk": _work_clustered_topk,
    "block_sparse": _work_block_sparse,
    "local": _work_local,
    "longformer": _work_longformer,
    "bigbird": _work_bigbird,
    "strided": _work_strided,
    "fixed": _work_fixed,
    "routing": _work_routing,
    "synthesizer_dense": _work_synthesizer_dense,
    "synthesizer_random": _work_synthesizer_random,
    "synthesizer_random_mix": _work_synthesizer_random_mix,
    "reformer": _work_reformer,
    "sinkhorn": _work_sinkhorn,
}


def variant_work(name: str, n: int, values: dict, *, d: int = 64, heads: int = 8) -> Work | None:
    """Least work of variant ``name`` at length ``n`` under configuration ``values``
    (``BenchConfig.describe(n)``), all heads; None for a variant without a count."""
    f = WORK.get(name)
    return None if f is None else f(n, d, values) * heads
