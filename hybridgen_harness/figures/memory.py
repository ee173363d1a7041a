"""Memory figure: peak KV bytes per tier (store ledger) and peak host RSS per method."""
from __future__ import annotations

from typing import Optional

from hybridgen_harness.figures import marks

TIER_COLORS = {"gpu": "tab:red", "dram": "tab:blue", "cxl": "tab:purple"}


def memory_per_tier(df, note: Optional[str] = None):
    """Stacked peak KV MiB per tier per method, with headroom above the tallest bar (no bar is
    clipped) and each bar's total written on it; next to it the process's peak host RSS.
    df: runs with ``memory.kv_peak_bytes_by_tier.<tier>`` and ``memory.host_peak_rss_bytes``."""
    import matplotlib.pyplot as plt
    import numpy as np

    df = df.sort_values("method.name")
    names = list(df["method.name"])
    mib = {t: df.get(f"memory.kv_peak_bytes_by_tier.{t}", 0).fillna(0).to_numpy(dtype=float) / 2**20
           for t in TIER_COLORS}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    bottom = np.zeros(len(names))
    for t, c in TIER_COLORS.items():
        axes[0].bar(names, mib[t], bottom=bottom, label=t, color=c)
        bottom = bottom + mib[t]
    for x, total in enumerate(bottom):
        axes[0].annotate(f"{total:.0f}", (x, total), ha="center", va="bottom", fontsize=7, xytext=(0, 1),
                         textcoords="offset points")
    axes[0].set_ylim(0, 1.45 * float(bottom.max() or 1))  # room for the totals, legend and badge
    axes[0].set_ylabel("peak KV MiB per tier")
    axes[0].legend(title="tier", loc="upper right", fontsize=8)
    axes[0].tick_params(axis="x", rotation=45)
    axes[0].set_title("KV bytes held per tier (store ledger, peak)", fontsize=10)
    marks.badge(axes[0], marks.run_provenance(df), note or "")
    rss = df["memory.host_peak_rss_bytes"].to_numpy(dtype=float) / 2**30
    axes[1].bar(names, rss, color="tab:gray")
    axes[1].set_ylim(0, 1.3 * float(rss.max() or 1))
    axes[1].set_ylabel("peak host RSS (GiB)")
    axes[1].set_title("process RSS high-water during the run (measured on this CPU)", fontsize=10)
    axes[1].tick_params(axis="x", rotation=45)
    marks.badge(axes[1], "measured", "this CPU's process")
    r = df.iloc[0]
    fig.suptitle(f"Memory per tier: {r['model.name']}, prompt {int(r['workload.prompt_len'])}, "
                 f"{int(r['workload.gen_len'])} new tokens")
    fig.tight_layout()
    return fig
