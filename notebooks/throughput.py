# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Throughput vs context length and batch size
# Decode tokens/s per method over the prompt-length sweep (`+exp=prompt_sweep`) and the batch
# sweep (`+exp=batch_sweep`).

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from matplotlib.ticker import NullFormatter

from hybridgen_harness import plotdata
from hybridgen_harness.figures import marks, speed

prompt = plotdata.runs("prompt_sweep")
batch = plotdata.runs("batch_sweep")

# %%
def lines(ax, df, x, xlabel):
    for m, g in df.groupby("method.name"):
        g = g.sort_values(x)
        y = g["throughput.decode_tokens_per_s"].to_numpy(dtype=float)
        # whiskers: the range of tokens/s over each run's repeats (batch tokens per decode ms)
        per = [[1e3 * int(r["workload.batch"]) / t for t in speed.repeat_ms_per_token(r)] for _, r in g.iterrows()]
        lo = [min(p) if len(p) >= 2 else v for p, v in zip(per, y)]
        hi = [max(p) if len(p) >= 2 else v for p, v in zip(per, y)]
        ax.errorbar(g[x], y, yerr=[[max(v - a, 0) for v, a in zip(y, lo)], [max(b - v, 0) for v, b in zip(y, hi)]],
                    marker="o", capsize=2, elinewidth=0.7, label=m, lw=2.5 if m == "hybridgen" else 1.2)
    n_reps = min(len(speed.repeat_ms_per_token(r)) for _, r in df.iterrows())
    ax.set_ylabel("decode tokens / s")
    ax.set_xlabel(xlabel + (f"\n(whiskers: range over {n_reps} repeats)" if n_reps >= 2
                            else "\n(one run per point: no spread)"))
    ax.set_xscale("log", base=2)
    ticks = sorted(df[x].unique())
    ax.set_xticks(ticks, [f"{int(t)}" for t in ticks])  # '1024', not '2^10'
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo - 0.15 * (hi - lo), hi)  # room for the badge under the lines
    marks.badge(ax, marks.run_provenance(df), loc="lower left")


if prompt is not None or batch is not None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if prompt is not None:
        lines(axes[0], prompt, "workload.prompt_len", "prompt length (tokens)")
        axes[0].set_title(f"{prompt['model.name'].iloc[0]}, batch {int(prompt['workload.batch'].iloc[0])}")
    else:
        axes[0].text(0.5, 0.5, "no prompt_sweep runs", ha="center")
    if batch is not None:
        lines(axes[1], batch, "workload.batch", "batch size")
        axes[1].set_title(f"{batch['model.name'].iloc[0]}, prompt {int(batch['workload.prompt_len'].iloc[0])}")
    else:
        axes[1].text(0.5, 0.5, "no batch_sweep runs", ha="center")
    note = plotdata.emulated_note(prompt if prompt is not None else batch)
    fig.suptitle("Decode throughput" + (f" ({note})" if note else ""))
    handles, labels = next((ax.get_legend_handles_labels() for ax in axes if ax.get_legend_handles_labels()[0]))
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    plotdata.save(fig, "throughput")
