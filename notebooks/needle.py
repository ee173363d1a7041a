# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Needle in a haystack: counts per method and per context length
# Exact-match retrieval of a 7-digit number hidden at several depths of Paul Graham essay
# haystacks of several lengths (task `hg_needle` in `+exp=accuracy`). Each (length, depth) cell
# holds ONE needle, so the figure shows counts ("2 / 9"), not a per-cell heatmap of rates.

# %%

import matplotlib

matplotlib.use("Agg")

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
    from hybridgen_harness.figures.accuracy import needle_counts
    from hybridgen_harness.figures.marks import run_provenance

    plotdata.save(needle_counts(cells, run_provenance(plotdata.runs("accuracy"))), "needle_retrieval")
