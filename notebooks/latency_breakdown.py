# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Latency breakdown of HybridGen's decode step
# Per decode step (summed over layers): the CPU branch (host key scan + top-k + gather +
# staging), the GPU branch (GPU-side attention and the rest of the layer), and the bytes moved
# host->GPU (logits + selected V rows), from the `speedup`, `prompt_sweep` and `scheduler_trace`
# runs. Transfer time is bytes / the host link bandwidth of a hardware profile: projected,
# labelled as such (on this machine nothing crosses a PCIe link).

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from matplotlib.ticker import FuncFormatter

from hybridgen_harness import plotdata
from hybridgen_harness.figures import marks

PCIE_GBPS = {"PCIe Gen5 x16 (55 GB/s pinned, measured on H200)": 55e9}
frames = [d for d in (plotdata.runs(e) for e in ("speedup", "prompt_sweep", "scheduler_trace")) if d is not None]
df = pd.concat(frames, ignore_index=True) if frames else None

# %%
if df is not None and "method_stats.cpu_branch_s" in df.columns:
    h = df[(df["method.name"] == "hybridgen") & df["method_stats.cpu_branch_s"].notna()].copy()
    h = h.drop_duplicates("run.name").sort_values("workload.prompt_len")
    steps = (h["workload.gen_len"] - 1).clip(lower=1)
    bw = list(PCIE_GBPS.values())[0]
    h["cpu ms"] = 1e3 * h["method_stats.cpu_branch_s"] / steps
    h["gpu ms"] = 1e3 * h["method_stats.gpu_branch_s"] / steps
    h["transfer ms (projected)"] = 1e3 * h["transfer.bytes_h2d"] / steps / bw
    h["label"] = h["run.exp"] + "\np=" + h["workload.prompt_len"].astype(int).astype(str)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(h)), 4))
    x = range(len(h))
    w = 0.27
    bars = [ax.bar([i - w for i in x], h["cpu ms"], w, label="CPU branch (scan + top-k + gather + staging)"),
            ax.bar(list(x), h["gpu ms"], w, label="GPU branch (attention + rest of layer)"),
            ax.bar([i + w for i in x], h["transfer ms (projected)"], w, hatch="//", edgecolor="white",
                   label="H2D transfer (PROJECTED from the bytes moved at 55 GB/s; hatched)")]
    for b in bars:
        ax.bar_label(b, fmt="%.2f", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(h["label"], fontsize=8)
    ax.set_ylabel("ms per decode step (all layers)")
    note = plotdata.emulated_note(h)
    ax.set_title("hybridgen: CPU vs GPU branch per step" + (f"\n({note})" if note else ""))
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, 1.45 * float(max(h["cpu ms"].max(), h["gpu ms"].max())))
    marks.badge(ax, marks.run_provenance(h), "branches timed here; transfer bars projected", loc="upper right")
    fig.tight_layout()
    plotdata.save(fig, "latency_breakdown")
else:
    print("no hybridgen runs with branch timers (method_stats.cpu_branch_s); run +exp=speedup")

# %% [markdown]
# ## Projected breakdown at the paper's template (`+exp=speedup_projected`)
# Per decode step, summed over layers: CPU-branch, GPU-branch and host->GPU transfer time of each
# method on each profile, from the performance model (PROJECTED; branches of one layer overlap, so
# they do not add up to the step time).

# %%
proj = plotdata.runs("speedup_projected")
if proj is not None:
    profiles = sorted(proj["projected.profile"].unique())
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.5 * len(profiles), 4), sharey=True, squeeze=False)
    for ax, prof in zip(axes[0], profiles):
        g = proj[proj["projected.profile"] == prof].sort_values("method.name")
        x = range(len(g))
        w = 0.27
        for off, col, lab in ((-w, "projected.cpu_branch_s", "CPU branch"), (0, "projected.gpu_branch_s", "GPU branch"),
                              (w, "projected.transfer_s", "H2D transfer")):
            ax.bar([i + off for i in x], 1e3 * g[col], w, label=lab)
        ax.set_xticks(list(x))
        ax.set_xticklabels(g["method.name"], rotation=60, fontsize=8)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # '100', not '10^2'
        ax.set_title(prof, fontsize=10)
        marks.badge(ax, "projected", loc="upper right")
    axes[0][0].set_ylabel("projected ms per decode step")
    axes[0][0].legend(fontsize=8)
    r = proj.iloc[0]
    fig.suptitle(f"PROJECTED breakdown: {r['model.name']}, batch {int(r['workload.batch'])}, "
                 f"prompt {int(r['workload.prompt_len'])}")
    fig.tight_layout()
    plotdata.save(fig, "latency_breakdown_projected")
