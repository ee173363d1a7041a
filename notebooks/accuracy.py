# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Accuracy table and accuracy vs KV budget
# `+exp=accuracy`: every method (20% KV budget where one applies) vs `full` on BIG-bench
# substitutes, needle retrieval and perplexity, with fidelity to `full` (top-1 agreement and KL
# of every decode-scored token against the dense pass). Writes results/accuracy/table.md.
# `+exp=budget_sweep`: accuracy of the compressing methods as their budget shrinks.

# %%
import matplotlib

matplotlib.use("Agg")
import pandas as pd

from hybridgen_harness import plotdata

acc = plotdata.runs("accuracy")

# %%
if acc is not None:
    from hybridgen.eval import paired
    from hybridgen_harness import accuracy_summary
    from hybridgen_harness.result_tables import splice

    # per-item scores of every run: paired comparison against `full` on the same items
    runs = accuracy_summary.load(plotdata.run_dirs("accuracy"))
    item_runs = {r.label: r.scores for r in runs}
    comparisons = paired.compare(item_runs, "full", margin=0.02)
    order = ["full"] + sorted(k for k in item_runs if k != "full")
    paired_md = paired.markdown(comparisons, "full", margin=0.02, order=order)
    # what has no per-item 0/1 score: perplexity and fidelity of the decode-scored tokens
    table = pd.DataFrame([{"method": r.label, **r.perplexity, "top1 vs full": r.top1, "KL vs full": r.kl}
                          for r in runs])
    table = table.sort_values("method", key=lambda m: m.map(lambda x: (x != "full", x))).reset_index(drop=True)
    print(paired_md)
    print(table.to_string())
    md = plotdata.results_dir() / "accuracy" / "table.md"
    limit = acc["lm_eval.limit"].iloc[0] if "lm_eval.limit" in acc else None
    header = (f"Accuracy of every method vs `full` ({acc['model.name'].iloc[0]}, lm-eval {limit} items per task "
              "where the task has that many; multiple choice: acc_norm; needle: exact match; continuations scored "
              "by teacher-forced decode steps through each method).\n\n"
              "Command: `make results EXP=accuracy` (= `python experiments/run.py +exp=accuracy results_dir=results`; "
              "`ARGS=\"force=true\"` replaces finished runs), then `make figures`.\n\n")
    try:
        extra = table.to_markdown(index=False, floatfmt=".4f")
    except ImportError:  # tabulate missing
        extra = "```\n" + table.to_string(index=False) + "\n```"
    md.write_text(header + paired_md + "\n\nPerplexity (word perplexity, lower is better) and fidelity of every "
                  "decode-scored token to the dense pass:\n\n" + extra + "\n")
    print(f"wrote {md}")
    readme = plotdata.repo_root() / "README.md"
    if plotdata.results_dir().resolve() == (plotdata.repo_root() / "results").resolve() and readme.exists():
        readme.write_text(splice(readme.read_text(), accuracy_summary.readme_block(runs),
                                 accuracy_summary.README_BEGIN, accuracy_summary.README_END))
        print(f"wrote the accuracy summary into {readme}")

# %% [markdown]
# ## Fidelity vs KV budget and vs GPU memory (`+exp=budget_sweep`)
# One 1K-token prompt, 32 teacher-forced tokens per point: next-token fidelity to `full`, not task
# accuracy (the titles say so). HybridGen's points: `gpu_budget` = `topk_ratio` = 0.025, 0.05, 0.1,
# 0.25, at their attended share g + t(1 - g). The memory plot's x is the peak KV each method holds on
# the gpu tier (the store ledger); `full`'s mark is the paper_speedup experiment's emulated `full` run
# of the same workload.

# %%
from hybridgen_harness.figures import accuracy as accuracy_figures

budget = plotdata.runs("budget_sweep")
if budget is not None:
    plotdata.save(accuracy_figures.accuracy_vs_budget(budget), "accuracy_vs_budget")
    r0 = budget.iloc[0]
    full_bytes = None
    ref = plotdata.runs("paper_speedup")
    if ref is not None:
        same = ref[(ref["method.name"] == "full") & (ref["model.name"] == r0["model.name"])
                   & (ref["workload.prompt_len"] == r0["workload.prompt_len"])
                   & (ref["workload.gen_len"] == r0["workload.gen_len"])]
        if len(same):
            full_bytes = float(same["memory.kv_peak_bytes_by_tier.gpu"].iloc[0])
    plotdata.save(accuracy_figures.accuracy_vs_memory(budget, full_bytes), "accuracy_vs_memory")
