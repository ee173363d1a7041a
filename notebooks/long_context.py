# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Long-context needle retrieval, every length together (Gemma-3-270m)
# The needle runs of `results/long_context/` are one folder per run (4K and 8K together, 16K, 32K:
# each run's README has its own table and figures). This draws them on one axis: accuracy per
# method against context length at each KV budget, with 95% binomial intervals, and accuracy
# against the GPU memory each method's layers held. Each folder's table is computed from its own
# documents (paired with `full` on the same documents); a folder whose run is not finished
# contributes the documents it has (its NOTES.md says how many).

# %%
import matplotlib

matplotlib.use("Agg")

import pandas as pd

from hybridgen_harness import long_context as lc
from hybridgen_harness import plotdata

FOLDERS = ["gemma3-270m", "gemma3-270m-16k", "gemma3-270m-32k"]  # the needle runs (not ruler, not ablations)
tables = []
for name in FOLDERS:
    folder = plotdata.results_dir() / "long_context" / name
    if (folder / "samples.jsonl").exists():
        tables.append(lc.table(lc.load(folder)))
    else:
        print(f"{folder} has no samples.jsonl: python experiments/long_context.py --out {folder} "
              "(the command in the folder's README; figure drawn without it)")

# %%
if tables:
    t = pd.concat(tables, ignore_index=True).sort_values(["length"], kind="stable")
    print(t.groupby("length")["n"].max().to_string())
    for path in lc.figures(t, plotdata.figures_dir(), "gemma3-270m, every needle run", prefix="long_context_"):
        print("wrote", path)
