"""The committed asv history: each key benchmark's time at N = 4096 across commits.

Read at build time from ``asv_results/`` (one machine folder) by
:mod:`asv_benches.history`; the peers, whose code does not change with the commits,
are drawn dashed: their spread is the run's own noise.
"""

from pathlib import Path

import matplotlib.pyplot as plt

from asv_benches import history

# The plot directive runs this file with its own folder as the working directory.
hist = history.load_history(str(Path.cwd().parent.parent / "asv_results"))
fig, ax = plt.subplots(figsize=(11, 5.5))
history.plot(hist, ax, n=4096)
ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
ax.set_title(f"NumPy float32, 8 heads, d = 64, N = 4096; machine {hist.machine}")
fig.tight_layout()
