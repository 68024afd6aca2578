"""The data flow of the softmax attention backward, as derived on the page.

Forward steps left to right, their VJPs below; the shapes say what each step stores
or recomputes. Shaded boxes are N x N: one-shot backward stores P, the blockwise
(FlashAttention) backward recomputes it tile by tile from Q, K and the saved L.
"""

import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(11, 3.6))
ax.set_xlim(0, 11)
ax.set_ylim(0, 4)
ax.axis("off")

boxes = {
    "Q, K": (0.8, 3.2, "Q, K\nN x d"),
    "S": (3.0, 3.2, "S = tau Q K^T + B\nN x N"),
    "P": (5.4, 3.2, "P = softmax(S)\nN x N"),
    "O": (7.8, 3.2, "O = P V\nN x d_v"),
    "L": (3.4, 2.15, "L = logsumexp(S)\nN (saved)"),
    "dO": (9.9, 1.0, "dO\nN x d_v"),
    "dV": (7.8, 0.2, "dV = P^T dO"),
    "dP": (7.8, 1.2, "dP = dO V^T\nN x N"),
    "D": (9.9, 2.1, "D = rowsum(dO * O)\nN"),
    "dS": (5.4, 1.0, "dS = P * (dP - D)\nN x N"),
    "dQK": (2.6, 1.0, "dQ = tau dS K\ndK = tau dS^T Q"),
}
big = {"S", "P", "dP", "dS"}
for name, (x, y, text) in boxes.items():
    ax.text(x, y, text, ha="center", va="center", fontsize=8,
            bbox={"boxstyle": "round", "fc": "#fdd0a2" if name in big else "#deebf7", "ec": "0.4"})
arrows = [("Q, K", "S"), ("S", "P"), ("P", "O"), ("S", "L"), ("O", "D"), ("dO", "D"),
          ("dO", "dP"), ("dO", "dV"), ("P", "dV"), ("dP", "dS"), ("D", "dS"), ("P", "dS"),
          ("dS", "dQK"), ("L", "dS")]
for a, b in arrows:
    (x0, y0, _), (x1, y1, _) = boxes[a], boxes[b]
    ax.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "->", "color": "0.45",
                                                       "shrinkA": 30, "shrinkB": 30})
ax.text(0.1, 0.1, "orange: N x N. The blockwise backward never holds them whole: per tile,\n"
        "P = exp(S - L) is recomputed from Q, K and the saved L, and D needs only O and dO.",
        fontsize=8, color="0.3")
fig.tight_layout()
