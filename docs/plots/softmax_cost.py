"""The N x N logits of one head under each mask, and the bytes they take."""

import matplotlib.pyplot as plt
import numpy as np

from attn_ref import attention_weights
from attn_ref.random import standard_normal

xp = np
nq, nk, d = 6, 10, 4
q = standard_normal((nq, d), seed=0, xp=xp)
k = standard_normal((nk, d), seed=1, xp=xp)
seg = np.repeat([0, 1, 2], [3, 4, 3])
panels = [
    ("no mask", attention_weights(q, k)),
    ("causal, top-left", attention_weights(q, k, causal="top-left")),
    ("causal, bottom-right", attention_weights(q, k, causal="bottom-right")),
    ("varlen (3, 4, 3), causal", attention_weights(k, k, mask=seg[:, None] == seg[None, :], causal=True)),
]
fig, axes = plt.subplots(1, len(panels) + 1, figsize=(13, 2.9),
                         gridspec_kw={"width_ratios": [1] * len(panels) + [1.6]})
for ax, (title, p) in zip(axes, panels):
    ax.imshow(np.where(p > 0, p, np.nan), cmap="viridis")
    ax.set_title(f"{title}\n{p.shape[0]} x {p.shape[1]}", fontsize=8)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].set_ylabel("query i", fontsize=8)
ax = axes[-1]
n = 2.0 ** np.arange(10, 18)
for heads, batch in ((1, 1), (8, 1), (8, 8)):
    ax.loglog(n, 4 * n**2 * heads * batch, label=f"S: {heads} head(s), batch {batch}")
ax.loglog(n, 4 * n * 64 * 4, "k--", label="Q, K, V, O: one head, d = 64")
ax.set_xscale("log", base=2)
ax.axhline(80 * 2**30, color="0.5", lw=0.8)
ax.annotate("80 GiB", (n[0], 80 * 2**30), fontsize=7, color="0.4", xytext=(0, 3), textcoords="offset points")
ax.set_xlabel("N")
ax.set_ylabel("bytes, float32")
ax.set_title("the N x N term dominates memory", fontsize=8)
ax.legend(fontsize=6.5)
fig.tight_layout()
