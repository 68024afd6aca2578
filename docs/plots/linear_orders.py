"""Interact then sum vs. sum then interact, computed by attn_ref.linear."""

import matplotlib.pyplot as plt
import numpy as np

from attn_ref.linear import feature_map_features, linear_attention
from attn_ref.random import standard_normal

xp = np
N, d, dv = 48, 8, 6
q = standard_normal((N, d), seed=1, xp=xp)
k = standard_normal((N, d), seed=2, xp=xp)
v = standard_normal((N, dv), seed=3, xp=xp)

fq = feature_map_features(q, feature_map="elu+1")
fk = feature_map_features(k, feature_map="elu+1")
A = fq @ fk.T                       # the N x N interactions of the quadratic order
S = fk.T @ v                        # the d' x dv summary of the linear order
z = fk.sum(axis=0)

quad = linear_attention(q, k, v, order="quadratic")
lin = linear_attention(q, k, v, order="linear")
err = float(np.max(np.abs(quad - lin)))

fig = plt.figure(figsize=(10.5, 3.4))
gs = fig.add_gridspec(1, 3, width_ratios=[1.25, 1.0, 1.35], wspace=0.35)

ax = fig.add_subplot(gs[0])
ax.imshow(A, cmap="viridis")
ax.set_title(f"interact, then sum\n$A=\\phi(Q)\\phi(K)^T$: {N}x{N} pairs")
ax.set_xlabel("key j")
ax.set_ylabel("query i")

ax = fig.add_subplot(gs[1])
ax.imshow(np.concatenate([S, z[:, None]], axis=1), cmap="viridis")
ax.axvline(dv - 0.5, color="w", lw=2)
ax.set_title(f"sum, then interact\n$[S \\mid z]$: {d}x{dv}+{d}, built once")
ax.set_xlabel("value dim | z")
ax.set_ylabel("feature dim")
ax.set_xticks([])

ax = fig.add_subplot(gs[2])
n = np.logspace(4, 17, 60, base=2)
dp = dvv = 64
ax.loglog(n, 2 * n**2 * (dp + dvv), label="interact, then sum  $2N^2(d'+d_v)$")
ax.loglog(n, 4 * n * dp * dvv, label="sum, then interact  $4Nd'd_v$")
ax.axvline(2 * dp * dvv / (dp + dvv), color="0.6", ls=":", lw=1)
ax.set_xlabel("sequence length N")
ax.set_ylabel("flops, one head")
ax.set_title("cost for $d'=d_v=64$")
ax.legend(fontsize=7, loc="upper left")

fig.suptitle(f"same output: max |quadratic - linear| = {err:.1e} (float64)", y=1.04)
