"""Accuracy figures: fidelity vs KV budget, fidelity vs GPU memory, needle retrieval counts.

The budget sweep measures *fidelity* to ``full`` (top-1 next-token agreement and KL over the
teacher-forced positions of one prompt), not task accuracy, and the titles say so with the
sample count. A HybridGen point's x is its attended share of the prompt: ``gpu_budget`` on the
gpu tier plus the top ``topk_ratio`` of the rest, g + t (1 - g).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

from hybridgen_harness.figures import marks

HYBRIDGEN = "hybridgen"
HYBRIDGEN_STYLE = dict(color="tab:red", lw=2.4, marker="*", markersize=10, zorder=5)
# the other methods' colours: the tab10 cycle without HybridGen's red
PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive",
           "tab:cyan"]


def style(method: str, i: int) -> dict:
    """Line style of the i-th method of a figure: HybridGen stands out (thick red stars)."""
    if method == HYBRIDGEN:
        return HYBRIDGEN_STYLE
    return dict(color=PALETTE[i % len(PALETTE)], marker="o", markersize=4, lw=1.2)


def attended_share(row) -> float:
    """The share of the prompt a run's method attends per step: its ``budget``, or HybridGen's
    g + t (1 - g) from ``gpu_budget`` g and ``topk_ratio`` t."""
    if row.get("method.name") == HYBRIDGEN:
        g = float(row["method.params.gpu_budget"])
        t = float(row["method.params.topk_ratio"])
        return g + t * (1 - g)
    return float(row["method.params.budget"])


def wilson(k: int, n: int) -> tuple:
    """95% Wilson interval of a proportion k / n (scipy)."""
    from scipy.stats import binomtest

    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=0.95, method="wilson")
    return float(ci.low), float(ci.high)


def _positions(row) -> int:
    n = row.get("fidelity.positions")
    if isinstance(n, (int, float)) and not math.isnan(n) and n > 0:
        return int(n)
    return int(row["workload.gen_len"]) * int(row.get("workload.batch", 1))


def _method_frames(df):
    df = df.assign(share=[attended_share(r) for _, r in df.iterrows()])
    names = sorted(df["method.name"].unique(), key=lambda m: (m != HYBRIDGEN, m))
    return [(m, df[df["method.name"] == m].sort_values("share")) for m in names]


def accuracy_vs_budget(df):
    """Top-1 agreement (95% Wilson whiskers over the scored positions) and mean KL to ``full`` vs the
    attended KV share, one line per method, HybridGen included and drawn on top.
    df: the ``budget_sweep`` runs (fidelity columns, method params)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    shares = set()
    for i, (m, g) in enumerate(_method_frames(df)):
        n = [_positions(r) for _, r in g.iterrows()]
        top1 = g["fidelity.top1_agreement"].to_numpy(dtype=float)
        ci = [wilson(round(p * k), k) for p, k in zip(top1, n)]
        st = style(m, i)
        axes[0].errorbar(g["share"], top1, yerr=[[p - lo for p, (lo, _) in zip(top1, ci)],
                                                 [hi - p for p, (_, hi) in zip(top1, ci)]],
                         capsize=2, elinewidth=0.7, label=m, **st)
        axes[1].plot(g["share"], g["fidelity.mean_kl"], label=m, **st)
        shares |= set(round(s, 4) for s in g["share"])
    ticks = sorted(shares)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0%}" if v >= 0.1 else f"{v:.1%}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks([t for t in ticks if t in (0.05, 0.1, 0.2, 0.5)] or ticks)
        ax.set_xlabel("KV attended per step (share of the prompt)")
        ax.grid(alpha=0.3)
        marks.badge(ax, marks.run_provenance(df))
    axes[0].set_ylabel("top-1 agreement with full (95% Wilson CI)")
    axes[1].set_ylabel("mean KL(full || method), nats")
    axes[1].set_yscale("log")
    marks.plain_log_ticks(axes[1].yaxis)
    axes[1].legend(fontsize=8, loc="upper right")
    r = df.iloc[0]
    fig.suptitle(marks.wrap(f"Fidelity to full vs KV budget ({r['model.name']}; ONE {int(r['workload.prompt_len'])}-token "
                            f"{r['workload.source']} prompt, {_positions(r)} teacher-forced positions per point: "
                            "next-token fidelity, not task accuracy)", 110))
    fig.tight_layout()
    return fig


def accuracy_vs_memory(df, full_gpu_bytes: Optional[float] = None):
    """Top-1 agreement with ``full`` vs the peak KV bytes a method holds on the gpu tier (store ledger),
    one line per method over its budgets; ``full`` (all KV on the gpu, agreement 1) as a reference mark
    when its bytes are given. df: the ``budget_sweep`` runs."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for i, (m, g) in enumerate(_method_frames(df)):
        mib = g["memory.kv_peak_bytes_by_tier.gpu"].fillna(0).to_numpy(dtype=float) / 2**20
        ax.plot(mib, g["fidelity.top1_agreement"], label=m, **style(m, i))
    if full_gpu_bytes:
        ax.plot([full_gpu_bytes / 2**20], [1.0], marker="D", color="k", ls="none", label="full (all KV on gpu)")
    ax.set_xscale("log")
    marks.plain_log_ticks(ax.xaxis)
    ax.set_xlabel("peak KV on the gpu tier, MiB (log scale)")
    ax.set_ylabel("top-1 agreement with full")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="method")
    marks.badge(ax, marks.run_provenance(df), "bytes: store ledger", loc="lower left")
    r = df.iloc[0]
    ax.set_title(marks.wrap(f"Fidelity vs GPU memory ({r['model.name']}; one {int(r['workload.prompt_len'])}-token "
                            f"prompt, {_positions(r)} positions per point; points: budgets of each method)", 80),
                 fontsize=10)
    fig.tight_layout()
    return fig


def needle_counts(cells: Dict[str, Sequence[dict]], provenance: str):
    """Needles found per method as counts ("2 / 9"), with the cells found per context length beside
    it: each (length, depth) cell is ONE needle, too few samples for a per-cell heatmap.
    cells: {method: [{"length", "depth", "score", "n"}, ...]} (metrics.json ``needle``); provenance:
    a :data:`marks.PROVENANCE` key for the runs."""
    import matplotlib.pyplot as plt

    names = sorted(cells, key=lambda n: (n != "full", n != HYBRIDGEN, n))
    found = {m: sum(round(c["score"] * c["n"]) for c in cells[m]) for m in names}
    total = {m: sum(int(c["n"]) for c in cells[m]) for m in names}
    lengths = sorted({c["length"] for m in names for c in cells[m]})
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.4), gridspec_kw={"width_ratios": [1, 1.4]})
    colors = ["k" if m == "full" else HYBRIDGEN_STYLE["color"] if m == HYBRIDGEN else "tab:blue" for m in names]
    axes[0].barh(names, [found[m] for m in names], color=colors)
    for y, m in enumerate(names):
        axes[0].text(found[m] + 0.05, y, f"{found[m]} / {total[m]}", va="center", fontsize=8)
    axes[0].set_xlim(0, max(total.values()) + 0.5)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("needles found (count of cells)")
    width = 0.8 / len(lengths)
    for j, length in enumerate(lengths):
        per = [sum(round(c["score"] * c["n"]) for c in cells[m] if c["length"] == length) for m in names]
        n_len = max(sum(int(c["n"]) for c in cells[m] if c["length"] == length) for m in names)
        axes[1].barh([y + (j - (len(lengths) - 1) / 2) * width for y in range(len(names))], per, height=width,
                     label=f"{length // 1024}K tokens (of {n_len})" if length % 1024 == 0 else f"{length} (of {n_len})")
    axes[1].set_yticks(range(len(names)), names)
    axes[1].invert_yaxis()
    most = max(max(sum(int(c["n"]) for c in cells[m] if c["length"] == length) for m in names) for length in lengths)
    axes[1].set_xticks(range(most + 1))
    axes[1].set_xlim(0, most + 0.3)
    axes[1].set_xlabel("needles found per context length (count)")
    axes[1].legend(fontsize=8, loc="lower right", title="context length")
    for ax in axes:
        marks.badge(ax, provenance, loc="upper right")
    n_cells = max(total.values())
    fig.suptitle(marks.wrap(f"Needle retrieval: {n_cells} cells per method (lengths x depths), ONE needle per cell; "
                            "counts, not rates (too few samples for a per-cell heatmap)", 110))
    fig.tight_layout()
    return fig

