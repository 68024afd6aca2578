"""Singular value spectra of softmax attention matrices, by attn_ref.diagnostics."""

import matplotlib.pyplot as plt
import numpy as np

from attn_ref import attention_weights
from attn_ref.diagnostics import effective_rank, normalized_cumulative_spectrum, singular_values
from attn_ref.random import standard_normal

xp = np
N, d = 512, 64
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
# The logit scale plays the role of an inverse temperature: random Gaussian q, k at
# scale t (inverse temperature t) give logits of standard deviation about t.
for t in (0.25, 0.5, 1.0, 2.0, 4.0):
    q = standard_normal((N, d), seed=1, xp=xp) * t ** 0.5
    k = standard_normal((N, d), seed=2, xp=xp) * t ** 0.5
    p = attention_weights(q, k)
    s = singular_values(p)
    erank = float(effective_rank(p))
    axes[0].semilogy(np.arange(1, N + 1), s / s[0], label=f"logit std {t:g}: eff. rank {erank:.0f}")
    axes[1].plot(np.arange(1, N + 1), normalized_cumulative_spectrum(p), label=f"logit std {t:g}")
q = standard_normal((N, d), seed=1, xp=xp)
k = standard_normal((N, d), seed=2, xp=xp)
s = singular_values(q @ k.T / np.sqrt(d))
axes[0].semilogy(np.arange(1, N + 1), np.maximum(s / s[0], 1e-17), "k:", label="$QK^T$ itself (rank d = 64)")
axes[0].set_ylim(1e-17, 2)
axes[0].set_xlabel("index i")
axes[0].set_ylabel(r"$\sigma_i / \sigma_1$")
axes[0].set_title(f"spectrum of $P = $softmax$(QK^T/\\sqrt{{d}})$, N={N}, d={d}")
axes[0].legend(fontsize=7)
axes[1].set_xlabel("k")
axes[1].set_ylabel(r"$\sum_{i\leq k}\sigma_i / \sum_i \sigma_i$")
axes[1].set_title("normalised cumulative spectrum")
axes[1].legend(fontsize=7, loc="lower right")
fig.tight_layout()
