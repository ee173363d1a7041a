# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Speedup over the baselines
# Decode latency per token of every method on the same model and workload (`+exp=speedup`),
# and the speedup of `hybridgen` over each. On a machine without CUDA the gpu tier is
# emulated on the CPU: the bars then show CPU cost, not GPU speed (each panel's badge says so);
# whiskers: the range over the run's repeats.

# %%
import matplotlib

matplotlib.use("Agg")

from hybridgen_harness import plotdata

df = plotdata.runs("speedup")

# %%
from hybridgen_harness.figures import speed

if df is not None:
    plotdata.save(speed.speedup(df, plotdata.emulated_note(df)), "speedup")

# %% [markdown]
# ## Projected at the paper's template (`+exp=speedup_projected`)
# The performance model (hybridgen/perf/) on datasheet hardware profiles: OPT-13B, prompt
# 1920, 128 new tokens, batch 20. PROJECTED, not measured; hatched, unfilled bars: the method's KV
# does not fit in that GPU's memory (it could not run as modelled; legend entry).

# %%
proj = plotdata.runs("speedup_projected")
if proj is not None:
    plotdata.save(speed.speedup_projected(proj), "speedup_projected")
