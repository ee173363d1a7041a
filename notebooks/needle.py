# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Needle in a haystack: depth x length
# Exact-match retrieval of a 7-digit number hidden at several depths of Paul Graham essay
# haystacks of several lengths (task `hg_needle` in `+exp=accuracy`), one heatmap per method.

# %%

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from hybridgen_harness import plotdata

cells = {}
for d in plotdata.run_dirs("accuracy"):
    m = plotdata.load_json(d / "metrics.json")
    if m.get("needle"):
        cells[m["method"]["name"]] = m["needle"]
if not cells:
    print("no needle results; run: python experiments/run.py +exp=accuracy (needs `make data`)  (figure skipped)")

# %%
if cells:
    names = sorted(cells, key=lambda n: (n != "full", n))
    ncol = min(3, len(names))
    nrow = (len(names) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False, layout="constrained")
    for i, (ax, name) in enumerate(zip(axes.flat, names)):
        c = cells[name]
        lengths = sorted({x["length"] for x in c})
        depths = sorted({x["depth"] for x in c})
        grid = np.full((len(depths), len(lengths)), np.nan)
        for x in c:
            grid[depths.index(x["depth"]), lengths.index(x["length"])] = x["score"]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for x in c:
            ax.text(lengths.index(x["length"]), depths.index(x["depth"]), f"{x['score']:.2f}\nn={x['n']}",
                    ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{l // 1024}K" if l % 1024 == 0 else str(l) for l in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        if i >= len(names) - ncol:  # the lowest panel of each column
            ax.set_xlabel("context length")
        if i % ncol == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{name}: {np.nanmean(grid):.2f}", fontsize=10)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="exact match")
    plotdata.save(fig, "needle_heatmap")
