"""The sparse attention patterns, drawn from the masks attn_ref.sparse builds."""

import matplotlib.pyplot as plt
import numpy as np

from attn_ref import sparse

xp = np
N = 32
panels = [
    ("sliding window, w=3", sparse.local_mask(N, window=3, xp=xp)),
    ("causal, dilated (w=3, dil.=2)", sparse.local_mask(N, window=3, one_sided=True, dilation=2, xp=xp)),
    ("strided (Sparse Transf.), l=6", sparse.strided_mask(N, stride=6, xp=xp)),
    ("fixed (Sparse Transf.), l=8, c=2", sparse.fixed_mask(N, stride=8, summary=2, xp=xp)),
    ("Longformer: window + global", sparse.longformer_mask(N, window=2, global_tokens=[0, 17], xp=xp)),
    ("BigBird: window+global+random", sparse.bigbird_mask(N, block_size=4, window=1, global_blocks=1,
                                                          random_blocks=1, seed=0, xp=xp)),
]
fig, axes = plt.subplots(1, len(panels), figsize=(13, 2.6))
for ax, (title, m) in zip(axes, panels):
    m = np.asarray(m)
    ax.imshow(m, cmap="Greys", interpolation="nearest")
    ax.set_title(f"{title}\n{int(m.sum())} of {N * N} pairs", fontsize=7.5)
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].set_ylabel("query i")
axes[0].set_xlabel("key j")
fig.tight_layout()
