"""Each method's known error bound next to the error measured here, computed at build time.

Used by the ``error-bound-table`` directive of ``attn_docs.py`` (the table on
``docs/bounds.md``) and by ``tests/test_docs.py`` (every bound that is claimed to hold
must hold on the measured inputs). Plain NumPy and attn-ref only, no Sphinx, so the test
suite can import it.

Each row is a :class:`Bound`: the method, the statement and its source, the bound's
value on the inputs used here, the measured value, and whether the measured value
satisfies the statement (``None`` where there is no bound to satisfy, or where the
statement is an existence or asymptotic claim that one measurement cannot confirm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Bound:
    method: str
    statement: str
    source: str
    bound: str
    measured: str
    holds: bool | None


def _inputs(n, d, seed, scale=1.0):
    from attn_ref.random import standard_normal

    q = standard_normal((n, d), seed=seed, xp=np) * scale
    k = standard_normal((n, d), seed=seed + 1, xp=np) * scale
    v = standard_normal((n, d), seed=seed + 2, xp=np)
    return q, k, v


def linformer_rows():
    """Theorem 1 (per value column) with the proof's construction; Theorem 2 (existence)."""
    from attn_ref import attention_weights, softmax_attention
    from attn_ref.lowrank import linformer_attention, linformer_projection

    n, eps = 512, 0.5
    q, k, v = _inputs(n, 16, 40)
    v = v[:, :8]
    p = attention_weights(q, k)
    kk = math.ceil(5 * math.log(n) / (eps**2 - eps**3))
    per_col, additive = [], []
    for s in range(5):
        r = linformer_projection(kk, n, seed=s, xp=np)
        err = p @ r.T @ (r @ v) - p @ v
        per_col.append(np.max(np.linalg.norm(err, axis=0) / np.linalg.norm(p @ v, axis=0)))
        scale = np.linalg.norm(p, axis=1)[:, None] * np.linalg.norm(v, axis=0)[None, :]
        additive.append(np.max(np.abs(err) / scale))
    rows = [
        Bound("Linformer, Thm 1", "|P~w - Pw| < eps |Pw| per value column w, rank(P~) = "
              "Theta(log N), w.p. 1 - o(1)", "Wang et al. 2020",
              f"eps = {eps} at k = {kk} (the proof's k, N = {n})",
              f"{max(per_col):.2f} (largest over 5 draws x 8 columns)", max(per_col) < eps),
        Bound("Linformer, Thm 1 (what its JL proof gives)",
              "|(P~w - Pw)_i| <= eps |p_i| |w| for every row i, column w",
              "JL + polarisation, lowrank.md", f"eps = {eps} at k = {kk}",
              f"{max(additive):.2f} (largest ratio)", max(additive) <= eps),
    ]
    # Theorem 2 is an existence statement; measured: the registered (untrained, Gaussian)
    # projections, as the relative quantity the theorem bounds.
    n2 = 64
    q, k, v = _inputs(n2, 16, 0)
    out = linformer_attention(q, k, v, e_proj=linformer_projection(8, n2, seed=0, xp=np),
                              f_proj=linformer_projection(8, n2, seed=1, xp=np))
    exact = softmax_attention(q, k, v)
    p = attention_weights(q, k)
    ratio = np.max(np.linalg.norm(out - exact, axis=1)
                   / (np.linalg.norm(p, axis=1) * np.linalg.norm(v, ord=2)))
    rows.append(Bound("Linformer, Thm 2", "some E, F with k = min(Theta(9 d log d / eps^2), "
                      "5 Theta(log N / eps^2)) give |softmax(wE^T)FV - softmax(w)V| <= "
                      "eps |softmax(w)| |V|, w.p. 1 - o(1)", "Wang et al. 2020",
                      "existence only (no constant)",
                      f"eps reached by Gaussian E, F, k = 8, N = {n2}: {ratio:.2f}", None))
    return rows


def performer_rows():
    """Variance of one positive-feature estimate; orthogonal vs i.i.d. features (m <= d)."""
    from attn_ref.performer import favor_features, random_features
    from attn_ref.random import standard_normal

    d, m = 4, 64
    x = standard_normal((1, d), seed=3, xp=np) * 0.4
    y = standard_normal((1, d), seed=4, xp=np) * 0.4
    sm = math.exp(float(np.sum(x * y)))
    est = []
    for s in range(4000):
        w = random_features(d, m, kind="iid", seed=s, xp=np)
        est.append(float(np.sum(favor_features(x, w) * favor_features(y, w))))
    var_formula = sm**2 * (math.exp(float(np.sum((x + y) ** 2))) - 1) / m
    var_measured = float(np.var(est))
    rows = [Bound("Performer (positive features)",
                  "Var = SM(x,y)^2 (exp|x+y|^2 - 1) / m, unbiased", "Choromanski et al. 2020, "
                  "performer.md (exact by quadrature)", f"{var_formula:.2e} (m = {m})",
                  f"{var_measured:.2e} (4000 draws)",
                  abs(var_measured / var_formula - 1) < 0.1)]
    d = 16
    xq = standard_normal((8, d), seed=3, xp=np) * 0.3 / d**0.25
    yk = standard_normal((8, d), seed=4, xp=np) * 0.3 / d**0.25
    exact = np.exp(xq @ yk.T)

    def mse(kind):
        err = 0.0
        for s in range(200):
            w = random_features(d, d, kind=kind, seed=s, xp=np)
            err += float(np.mean((favor_features(xq, w) @ favor_features(yk, w).T - exact) ** 2))
        return err / 200

    ort, iid = mse("orthogonal"), mse("iid")
    rows.append(Bound("Performer, orthogonal features", "MSE(orthogonal) < MSE(i.i.d.) at the "
                      "same m, for m <= d", "Choromanski et al. 2020", f"i.i.d.: {iid:.2e} (m = d = 16)",
                      f"orthogonal: {ort:.2e}", ort < iid))
    return rows


def clustered_rows():
    """|softmax(q_i K^T/sqrt d) - softmax(c K^T/sqrt d)| <= |K|_2 |q_i - c| / (2 sqrt d)."""
    from attn_ref import attention_weights
    from attn_ref.reduced import kmeans

    n, d = 64, 16
    q, k, _ = _inputs(n, d, 0)
    centroids, assignment, _ = kmeans(q, 8, seed=0, xp=np)
    c = centroids[assignment]
    lhs = np.linalg.norm(attention_weights(q, k) - attention_weights(c, k), axis=1)
    rhs = np.linalg.norm(k, ord=2) / math.sqrt(d) / 2 * np.linalg.norm(q - c, axis=1)
    ratio = float(np.max(lhs / np.where(rhs > 0, rhs, np.inf)))
    return [Bound("clustered (C = 8 of 64)", "|p_i - p_c|_2 <= |K|_2 |q_i - q_c| / (2 sqrt d) "
                  "(Prop. 1 with softmax's Lipschitz constant 1/2)", "Vyas et al. 2020, reduction.md",
                  "ratio <= 1", f"largest ratio {ratio:.2f}", ratio <= 1)]


def sparse_rows():
    """|p_i - p~_i|_1 = 2 mu_i, an identity."""
    from attn_ref import attention_weights, sparse

    q, k, _ = _inputs(64, 16, 0)
    p = attention_weights(q, k)
    pw = sparse.local_weights(q, k, window=3)
    mu = np.sum(np.where(sparse.local_mask(64, window=3, xp=np), 0.0, p), axis=1)
    gap = float(np.max(np.abs(np.sum(np.abs(p - pw), axis=1) - 2 * mu)))
    return [Bound("sparse patterns (window 3, N = 64)", "|p_i - p~_i|_1 = 2 mu_i, mu_i the mass "
                  "outside the pattern (identity)", "sparse.md", f"2 x mean mu = {2 * mu.mean():.3f}",
                  f"mean l1 = {np.mean(np.sum(np.abs(p - pw), axis=1)):.3f}, "
                  f"largest |l1 - 2 mu| = {gap:.0e}", gap < 1e-12)]


def lowrank_rows():
    """Nystrom: no bound known for its softmax form; Eckart-Young: the floor for any rank k."""
    from attn_ref import attention_weights
    from attn_ref.diagnostics import best_rank_k_error
    from attn_ref.reduced import nystrom_weights

    q, k, _ = _inputs(64, 16, 0)
    p = attention_weights(q, k)
    ny = nystrom_weights(q, k, num_landmarks=8)
    rel = float(np.linalg.norm(p - ny) / np.linalg.norm(p))
    floor = float(best_rank_k_error(p, 8, relative=True))
    return [
        Bound("Nystromformer (8 landmarks, N = 64)", "no bound known (the paper states none): "
              "the three factors are softmaxes with different normalisers, P is neither "
              "symmetric nor PSD, so the classical Nystrom bounds do not apply",
              "Xiong et al. 2021", "none",
              f"relative Frobenius error {rel:.3f}", None),
        Bound("any rank-8 matrix (Eckart-Young)", "|P - X|_F >= (sum_{i>k} sigma_i^2)^{1/2}",
              "Eckart-Young 1936, Mirsky 1960", f"{floor:.3f} (relative, k = 8)",
              f"Nystrom: {rel:.3f}", rel >= floor),
    ]


def rows():
    out = linformer_rows() + performer_rows() + clustered_rows() + sparse_rows() + lowrank_rows()
    # NumPy comparisons give numpy.bool_; the verdicts are plain bools (or None).
    return [replace(b, holds=None if b.holds is None else bool(b.holds)) for b in out]
