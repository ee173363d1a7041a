# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # HybridGen's CPU branch against the host's read bandwidth
# From `results/cpu_scan/sketch_default_quick.json` (`python benchmarks/bench_cpu_scan.py --quick
# --json ...`): one Llama-3.1-8B layer, batch 8, 32K host tokens, cold data. Left: GB/s of bf16
# key bytes of the plain read, the exact scan and the whole branch (HybridGen's default, over the
# int4 key sketch; the same without it, bf16-dot scanning the keys), per thread count, with the
# issues' targets as fractions of read. Right: the key sketches'
# tokens/s against the bf16 limit (the tokens/s a bf16 scan would reach at 100% of read).

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hybridgen_harness import plotdata

path = plotdata.results_dir() / "cpu_scan" / "sketch_default_quick.json"
data = plotdata.load_json(path) if path.exists() else None
if data is None:
    print(f"no {path}; run: python benchmarks/bench_cpu_scan.py --quick --json {path}  (figure skipped)")

# %%
if data is not None:
    runs = data["by_threads"]
    threads = sorted(runs, key=int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    bars = [("read", "read"), ("scan native bf16", "exact scan"), ("default branch, no sketch", "branch, no sketch"),
            ("default branch", "default branch (int4 sketch)")]
    width = 0.8 / len(bars)
    for i, (row, label) in enumerate(bars):
        xs = [t + (i - len(bars) / 2 + 0.5) * width for t in range(len(threads))]
        left.bar(xs, [runs[n]["rows"][row]["gbps"] for n in threads], width, label=label,
                 yerr=[[runs[n]["rows"][row]["gbps"] - runs[n]["rows"][row]["gbps_min"] for n in threads],
                       [runs[n]["rows"][row]["gbps_max"] - runs[n]["rows"][row]["gbps"] for n in threads]],
                 capsize=3)
    for t, n in enumerate(threads):
        read = runs[n]["read_gbps"]
        for frac, style in ((0.8, ":"), (0.6, "--")):
            left.hlines(frac * read, t - 0.45, t + 0.45, colors="grey", linestyles=style, linewidth=1)
    left.set_xticks(range(len(threads)), [f"{n} thread{'s' if n != '1' else ''}" for n in threads])
    left.set_ylabel("GB/s of bf16 key bytes (median, min-max)")
    left.set_title("scan and branch vs read (dotted 0.8x, dashed 0.6x read)")
    left.set_ylim(0, 1.3 * max(runs[n]["rows"]["read"]["gbps_max"] for n in threads))
    left.legend(fontsize=8, loc="upper center", ncol=2)
    kinds = [("sketch int8", "int8 (VNNI)"), ("sketch int4", "int4 (VNNI)"), ("sketch int4 avx2", "int4 (AVX2)")]
    kinds = [(r, lab) for r, lab in kinds if r in runs[threads[0]]["rows"]]
    width = 0.8 / max(1, len(kinds))
    for i, (row, label) in enumerate(kinds):
        xs = [t + (i - len(kinds) / 2 + 0.5) * width for t in range(len(threads))]
        right.bar(xs, [runs[n]["rows"][row]["tokens_per_s"] / runs[n]["bf16_limit_tokens_per_s"] for n in threads],
                  width, label=label)
    right.axhline(1.0, color="black", linewidth=1)
    right.axhline(1.5, color="grey", linestyle=":", linewidth=1)
    right.set_xticks(range(len(threads)), [f"{n} thread{'s' if n != '1' else ''}" for n in threads])
    right.set_ylabel("x the bf16 read limit (tokens/s)")
    right.set_title("key sketch scan (dotted: the 1.5x target)")
    right.legend(fontsize=8)
    from hybridgen_harness.figures import marks

    for ax in (left, right):
        marks.badge(ax, "measured", "this CPU", loc="upper right")
    fig.suptitle(f"CPU branch, {data['machine'].get('cpu', '?')}: measured {data.get('date', '')}")
    fig.tight_layout()
    plotdata.save(fig, "cpu_scan")
