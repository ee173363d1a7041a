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
import matplotlib.pyplot as plt

from hybridgen_harness import plotdata

df = plotdata.runs("speedup")

# %%
if df is not None:
    df = df.sort_values("method.name")
    tiers = ["gpu", "dram", "cxl"]
    mib = {t: df.get(f"memory.kv_peak_bytes_by_tier.{t}", 0).fillna(0) / 2**20 for t in tiers}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    bottom = None
    for t, c in zip(tiers, ["tab:red", "tab:blue", "tab:purple"]):
        axes[0].bar(df["method.name"], mib[t], bottom=bottom, label=t, color=c)
        bottom = mib[t] if bottom is None else bottom + mib[t]
    axes[0].set_ylabel("peak KV MiB per tier")
    axes[0].legend()
    axes[0].tick_params(axis="x", rotation=45)
    axes[1].bar(df["method.name"], df["memory.host_peak_rss_bytes"] / 2**30, color="tab:gray")
    axes[1].set_ylabel("peak host RSS (GiB)")
    axes[1].set_title("process RSS high-water during the run (measured)", fontsize=10)
    axes[0].set_title("KV bytes held per tier (store ledger)", fontsize=10)
    axes[1].tick_params(axis="x", rotation=45)
    r = df.iloc[0]
    note = plotdata.emulated_note(df)
    fig.suptitle(f"{r['model.name']}, prompt {int(r['workload.prompt_len'])}, gen {int(r['workload.gen_len'])}"
                 + (f"\n({note})" if note else ""))
    fig.tight_layout()
    plotdata.save(fig, "memory_per_tier")
