"""What each method of the reduction page forms, and the N x N matrix that implies.

Top row: the small matrix each method actually computes (its shape is its memory
cost). Bottom row: the implied N x N attention matrix (its ``*_weights`` function),
next to softmax's. All computed by attn_ref on one random input.
"""

import matplotlib.pyplot as plt
import numpy as np

from attn_ref import attention_weights
from attn_ref.compressed import compressed_weights
from attn_ref.lowrank import linformer_projection, linformer_weights
from attn_ref.random import standard_normal
from attn_ref.reduced import (
    clustered_weights,
    kmeans,
    nystrom_weights,
    pooled_weights,
    segment_means,
)

xp = np
N, d, r = 24, 8, 4
q = standard_normal((N, d), seed=1, xp=xp) * 1.5
k = standard_normal((N, d), seed=2, xp=xp) * 1.5
tau = 1 / np.sqrt(d)


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


E = np.abs(linformer_projection(r, N, seed=0, xp=xp))      # non-negative, so the rows read as weights
avg = np.stack([np.eye(d) / 3] * 3)
kbar = segment_means(k, r)
panels = [
    ("softmax", softmax(q @ k.T * tau), attention_weights(q, k), "N x N"),
    ("Linformer", softmax(q @ (E @ k).T * tau), linformer_weights(q, k, e_proj=E), "N x r"),
    ("compressed, c = s = 3", softmax(q @ (segment_means(k, N // 3)).T * tau),
     compressed_weights(q, k, k_weight=avg, stride=3), "N x N/s"),
    ("pooled keys", softmax(q @ kbar.T * tau), pooled_weights(q, k, num_segments=r), "N x r"),
    ("Nystrom", softmax(q @ kbar.T * tau), nystrom_weights(q, k, num_landmarks=r), "N x r, r x r, r x N"),
    ("clustered, C = 4", softmax(kmeans(q, r, xp=xp)[0] @ k.T * tau),
     clustered_weights(q, k, num_clusters=r), "C x N"),
]
fig, axes = plt.subplots(2, len(panels), figsize=(13, 4.6))
exact = attention_weights(q, k)
for col, (name, small, implied, shape) in enumerate(panels):
    axes[0, col].imshow(small, cmap="viridis", aspect="auto" if small.shape[1] < 8 else "equal")
    axes[0, col].set_title(f"{name}\nforms {shape}: {small.shape[0]}x{small.shape[1]}", fontsize=8)
    err = np.linalg.norm(implied - exact) / np.linalg.norm(exact)
    axes[1, col].imshow(implied, cmap="viridis")
    axes[1, col].set_title(f"implied N x N\nrel. error {err:.2f}", fontsize=8)
    for ax in axes[:, col]:
        ax.set_xticks([])
        ax.set_yticks([])
axes[0, 0].set_ylabel("what is computed")
axes[1, 0].set_ylabel("implied weights")
fig.tight_layout()
