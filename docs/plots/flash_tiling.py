"""FlashAttention's tiles, and its HBM accesses against standard attention's."""

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

N, Br, Bc = 32, 8, 8
j_outer, i_inner = 1, 2          # the key/value block in SRAM, and the query block being visited

fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.9), gridspec_kw={"width_ratios": [1, 1.3]})
ax = axes[0]
for i in range(0, N, Br):
    for j in range(0, N, Bc):
        future = j > i + Br - 1                                  # wholly above the diagonal
        colour = "white"
        if j // Bc == j_outer:
            colour = "#c6dbef"
        if (i // Br, j // Bc) == (i_inner, j_outer):
            colour = "#2171b5"
        ax.add_patch(Rectangle((j, i), Bc, Br, facecolor=colour, edgecolor="0.3",
                               hatch="///" if future else None, lw=0.8))
ax.set_xlim(0, N)
ax.set_ylim(N, 0)
ax.set_aspect("equal")
ax.set_xticks(range(0, N + 1, Bc))
ax.set_yticks(range(0, N + 1, Br))
ax.set_xlabel("key j  (outer loop: blocks K_j, V_j of B_c rows)")
ax.set_ylabel("query i  (inner loop: blocks Q_i, O_i of B_r rows)")
ax.set_title("one outer step: K_j, V_j stay in SRAM,\nevery Q_i passes through; hatched: skipped when causal",
             fontsize=8.5)

ax = axes[1]
d = 64
n = 2.0 ** np.arange(9, 17)
ax.loglog(n, 4 * n * d + 4 * n**2, "k-", lw=2, label="standard: $4Nd + 4N^2$")
for M in (2**14, 2**16, 2**17):
    bc = math.ceil(M / (4 * d))
    flash = 2 * n * d + np.ceil(n / bc) * n * (3 * d + 4)
    ax.loglog(n, flash, "--", label=f"FlashAttention, M = {M} elements")
ax.set_xscale("log", base=2)
ax.set_xlabel("sequence length N")
ax.set_ylabel("HBM element accesses, forward, one head")
ax.set_title("$\\Theta(Nd + N^2)$ against $\\Theta(N^2 d^2 / M)$, d = 64", fontsize=9)
ax.legend(fontsize=7.5)
ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
