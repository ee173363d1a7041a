# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Memory per tier
# Peak KV bytes held per tier (gpu / dram / cxl) by each method (`+exp=speedup`), measured by
# the tiered store's ledger, next to the process's peak host RSS (measured, VmHWM).

# %%
import matplotlib

matplotlib.use("Agg")

from hybridgen_harness import plotdata

df = plotdata.runs("speedup")

# %%
if df is not None:
    from hybridgen_harness.figures.memory import memory_per_tier

    plotdata.save(memory_per_tier(df, plotdata.emulated_note(df)), "memory_per_tier")
