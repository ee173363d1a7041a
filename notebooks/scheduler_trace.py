# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # HybridGen's feedback scheduler over decode steps
# From `+exp=scheduler_trace` (trace.json of each run): the top-k ratio the scheduler sets over
# decode steps (and the host scan window when it adapts it), against the measured mean CPU-branch
# and GPU-branch times per step that drove each decision. Without CUDA both branches run on the
# CPU, so the balance shown is this machine's, not a GPU host's.

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hybridgen_harness import plotdata
from hybridgen_harness.figures import marks

traces = []
for d in plotdata.run_dirs("scheduler_trace"):
    m = plotdata.load_json(d / "metrics.json")
    if (d / "trace.json").exists():
        tr = plotdata.load_json(d / "trace.json")
        label = "adapt_window" if m["method"]["params"].get("adapt_window") else "ratio only"
        traces.append((label, m, tr.get("scheduler", [])))
if not traces:
    print("no scheduler traces; run: python experiments/run.py +exp=scheduler_trace  (figure skipped)")

# %%
if traces:
    fig, axes = plt.subplots(len(traces), 2, figsize=(12, 3.2 * len(traces)), squeeze=False)
    for row, (label, m, dec) in zip(axes, traces):
        steps = int(m["workload"]["gen_len"]) - 1
        ratio = [d for d in dec if d["knob"] == "topk_ratio"]
        xs, ys = [0], [ratio[0]["old"] if ratio else None]
        for d in ratio:
            xs.append(d["step"])
            ys.append(d["new"])
        xs.append(steps)
        ys.append(ys[-1])
        row[0].step(xs, ys, where="post", color="tab:red", label="top-k ratio")
        win = [d for d in dec if d["knob"] == "scan_window"]
        if win:
            ax2 = row[0].twinx()
            ax2.step([d["step"] for d in win], [d["new"] or 0 for d in win], where="post", color="tab:gray",
                     label="scan window (0 = all)")
            ax2.set_ylabel("host scan window (tokens)")
        row[0].set_xlabel("decode step")
        row[0].set_ylabel("top-k ratio")
        row[0].set_title(f"{label}: {len(dec)} decisions")
        seen = {}
        for d in dec:
            seen.setdefault(d["step"], d)
        st = sorted(seen)
        row[1].plot(st, [1e3 * seen[s]["cpu_s"] for s in st], marker="o", label="CPU branch")
        row[1].plot(st, [1e3 * seen[s]["gpu_s"] for s in st], marker="s", label="GPU branch")
        row[1].set_xlabel("decode step")
        row[1].set_ylabel("mean ms per step (all layers)")
        row[1].legend(fontsize=8)
        for ax in row:
            ax.grid(alpha=0.3)
            marks.badge(ax, "emulated" if m["hardware"]["store"]["gpu"]["emulated"] else "measured",
                        loc="lower right")
    emulated = traces[0][1]["hardware"]["store"]["gpu"]["emulated"]
    fig.suptitle("feedback scheduler" + (" (gpu tier emulated on CPU)" if emulated else ""))
    fig.tight_layout()
    plotdata.save(fig, "scheduler_trace")
