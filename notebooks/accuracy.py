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
import matplotlib.pyplot as plt
import pandas as pd

from hybridgen_harness import plotdata

acc = plotdata.runs("accuracy")

# %%
def score_cols(df):
    """(task, column) of the headline metric per task: acc_norm for multiple choice, exact_match
    for the needle, word perplexity for rolling perplexity."""
    out = []
    for c in sorted(df.columns):
        if c.startswith("accuracy.") and c.count(".") == 2:
            _, task, metric = c.split(".")
            if metric in ("acc_norm", "exact_match", "word_perplexity"):
                out.append((task, c))
    return out


def default_budget(name):
    """The budget a method has at its dataclass defaults (None: no budget parameter)."""
    from hybridgen.methods import build_method

    return build_method(name).config().get("budget")


def method_label(row):
    """The method's name, plus what sets its row apart from the method at its defaults: a fixed
    top-k ratio (hybridgen-b20) or a budget other than the method's default (shadowkv-b20)."""
    name = row["method.name"]
    extra = []
    ratio = row.get("method.params.topk_ratio")
    if isinstance(ratio, float) and ratio == ratio:
        extra.append(f"topk {ratio:g}")
    budget = row.get("method.params.budget")
    if isinstance(budget, str) and budget != default_budget(name):
        extra.append(f"budget {budget}")
    return name + (f" ({', '.join(extra)})" if extra else "")


if acc is not None:
    from hybridgen.eval import paired

    # per-item scores of every run: paired comparison against `full` on the same items
    item_runs = {}
    for d in plotdata.run_dirs("accuracy"):
        m = plotdata.load_json(d / "metrics.json")
        row = {"method.name": m["method"]["name"], "method.params.topk_ratio": m["method"]["params"].get("topk_ratio"),
               "method.params.budget": m["method"]["params"].get("budget")}
        if (d / "samples.jsonl").exists():
            item_runs[method_label(row)] = paired.item_scores(d / "samples.jsonl")
    comparisons = paired.compare(item_runs, "full", margin=0.02)
    order = ["full"] + sorted(k for k in item_runs if k != "full")
    paired_md = paired.markdown(comparisons, "full", margin=0.02, order=order)
    # what has no per-item 0/1 score: perplexity and fidelity of the decode-scored tokens
    table = pd.DataFrame({"method": [method_label(r) for _, r in acc.iterrows()]})
    for task, c in score_cols(acc):
        if "ppl" in task:
            table[task] = acc[c].values
    table["top1 vs full"] = acc.get("fidelity.top1_agreement")
    table["KL vs full"] = acc.get("fidelity.mean_kl")
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
