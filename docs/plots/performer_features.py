"""Performer's data flow, and its estimate of P converging as the features grow."""

import matplotlib.pyplot as plt
import numpy as np

from attn_ref import attention_weights
from attn_ref.performer import favor_features, performer_attention_weights, random_features
from attn_ref.random import standard_normal

xp = np
N, d, dv = 32, 8, 4
q = standard_normal((N, d), seed=30, xp=xp) * 0.5
k = standard_normal((N, d), seed=31, xp=xp) * 0.5
v = standard_normal((N, dv), seed=32, xp=xp)
exact = attention_weights(q, k)

fig, axes = plt.subplots(1, 6, figsize=(13.5, 2.9), gridspec_kw={"width_ratios": [1.4, 0.5, 1, 1, 1, 1]})
m = 16
w = random_features(d, m, seed=0, xp=xp)
fq = favor_features(q / d**0.25, w)
fk = favor_features(k / d**0.25, w)
axes[0].imshow(fq, cmap="viridis", aspect="auto")
axes[0].set_title(f"$\\phi(Q)$: N x m = {N}x{m}", fontsize=8)
axes[1].imshow(fk.T @ v, cmap="viridis", aspect="auto")
axes[1].set_title(f"$\\phi(K)^T V$:\nm x $d_v$ = {m}x{dv}", fontsize=8)
axes[2].imshow(exact, cmap="viridis")
axes[2].set_title("softmax P (never formed)", fontsize=8)
for ax, m in zip(axes[3:], (16, 256, 4096)):
    est = performer_attention_weights(q, k, projection=random_features(d, m, seed=0, xp=xp))
    ax.imshow(est, cmap="viridis", vmin=exact.min(), vmax=exact.max())
    ax.set_title(f"implied by m = {m}\nmax |error| {np.max(np.abs(est - exact)):.3f}", fontsize=8)
for ax in axes:
    ax.set_xticks([])
    ax.set_yticks([])
fig.tight_layout()
