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
# emulated on the CPU: the bars then show CPU cost, not GPU speed (the caption says so).

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hybridgen_harness import plotdata

df = plotdata.runs("speedup")

# %%
if df is not None:
    df = df.sort_values("latency.decode_ms_per_token")
    ms = df.set_index("method.name")["latency.decode_ms_per_token"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:red" if m == "hybridgen" else "tab:blue" for m in ms.index]
    axes[0].barh(ms.index, ms.values, color=colors)
    axes[0].set_xlabel("decode ms / token (lower is better)")
    axes[0].invert_yaxis()
    if "hybridgen" in ms.index:
        sp = (ms / ms["hybridgen"]).drop("hybridgen").sort_values()
        axes[1].barh(sp.index, sp.values, color="tab:green")
        axes[1].axvline(1.0, color="k", lw=0.8)
        axes[1].set_xlabel("speedup of hybridgen (baseline time / hybridgen time)")
        axes[1].invert_yaxis()
    else:
        axes[1].text(0.5, 0.5, "no hybridgen run", ha="center", va="center")
    r = df.iloc[0]
    title = (f"{r['model.name']}, batch {int(r['workload.batch'])}, prompt {int(r['workload.prompt_len'])}, "
             f"gen {int(r['workload.gen_len'])}")
    note = plotdata.emulated_note(df)
    fig.suptitle(title + (f"\n({note})" if note else ""))
    fig.tight_layout()
    plotdata.save(fig, "speedup")

# %% [markdown]
# ## Projected at the paper's template (`+exp=speedup_projected`)
# The performance model (hybridgen/perf/) on datasheet hardware profiles: OPT-13B, prompt
# 1920, 128 new tokens, batch 20. PROJECTED, not measured; hatched bars: the method's KV does not
# fit in that GPU's memory (it could not run as modelled).

# %%
proj = plotdata.runs("speedup_projected")
if proj is not None:
    profiles = sorted(proj["projected.profile"].unique())
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 4), sharey=True, squeeze=False)
    from matplotlib.ticker import NullFormatter

    first = proj[proj["projected.profile"] == profiles[0]].set_index("method.name")["projected.step_s"]
    order = list(first.sort_values().index)  # one method order for every panel (shared y axis)
    for ax, prof in zip(axes[0], profiles):
        g = proj[proj["projected.profile"] == prof].set_index("method.name")
        ms = 1e3 * g["projected.step_s"]
        bars = ax.barh(order, ms[order], color=["tab:red" if m == "hybridgen" else "tab:blue" for m in order])
        for b, m in zip(bars, order):
            if not bool(g.loc[m, "projected.fits_gpu"]):
                b.set_hatch("//")
                b.set_alpha(0.5)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("projected ms / decode step")
        ax.set_title(prof, fontsize=10)
    axes[0][0].invert_yaxis()
    r = proj.iloc[0]
    fig.suptitle(f"PROJECTED: {r['model.name']}, batch {int(r['workload.batch'])}, prompt {int(r['workload.prompt_len'])}, "
                 f"gen {int(r['workload.gen_len'])} (hatched: does not fit in GPU memory)")
    fig.tight_layout()
    plotdata.save(fig, "speedup_projected")
