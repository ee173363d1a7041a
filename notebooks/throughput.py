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

from hybridgen.eval import plotdata
from hybridgen.eval.figures import marks

prompt = plotdata.runs("prompt_sweep")
batch = plotdata.runs("batch_sweep")

# %%
def lines(ax, df, x, xlabel):
    for m, g in df.groupby("method.name"):
        g = g.sort_values(x)
        ax.plot(g[x], g["throughput.decode_tokens_per_s"], marker="o", label=m,
                lw=2.5 if m == "hybridgen" else 1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("decode tokens / s")
    ax.set_xscale("log", base=2)
    ticks = sorted(df[x].unique())
    ax.set_xticks(ticks, [f"{int(t)}" for t in ticks])  # '1024', not '2^10'
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
    if note:
        fig.suptitle(f"({note})")
    fig.tight_layout()
    plotdata.save(fig, "throughput")
