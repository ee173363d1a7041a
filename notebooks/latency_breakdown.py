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

from hybridgen.eval import plotdata

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
            ax.bar([i + w for i in x], h["transfer ms (projected)"], w, label="H2D transfer (projected, 55 GB/s)")]
    for b in bars:
        ax.bar_label(b, fmt="%.2f", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(h["label"], fontsize=8)
    ax.set_ylabel("ms per decode step (all layers)")
    note = plotdata.emulated_note(h)
    ax.set_title("hybridgen: CPU vs GPU branch per step" + (f"\n({note})" if note else ""))
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, 1.35 * float(max(h["cpu ms"].max(), h["gpu ms"].max())))
    fig.tight_layout()
    plotdata.save(fig, "latency_breakdown")
else:
    print("no hybridgen runs with branch timers (method_stats.cpu_branch_s); run +exp=speedup")
