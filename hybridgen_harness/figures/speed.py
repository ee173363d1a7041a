"""Decode latency figures: emulated per-method latency and speedup, projected latency per GPU profile."""
from __future__ import annotations

import json
from typing import List, Optional

from hybridgen_harness.figures import marks

HYBRIDGEN_COLOR = "tab:red"
OTHER_COLOR = "tab:blue"


def repeat_ms_per_token(row) -> List[float]:
    """Decode ms per generated token of each repeat of one run (``latency.repeats``; [] when absent)."""
    reps = row.get("latency.repeats")
    if isinstance(reps, str):
        reps = json.loads(reps)
    if not isinstance(reps, list):
        return []
    steps = max(int(row["workload.gen_len"]) - 1, 1)
    return [1e3 * r["decode_s"] / steps for r in reps if isinstance(r, dict) and "decode_s" in r]


def speedup(df, note: Optional[str] = None):
    """Emulated decode ms/token per method (whiskers: the range over the run's repeats) and HybridGen's
    speedup over each. df: the ``speedup`` experiment's runs (one row per method)."""
    import matplotlib.pyplot as plt
    import numpy as np

    df = df.sort_values("latency.decode_ms_per_token")
    names = list(df["method.name"])
    ms = df["latency.decode_ms_per_token"].to_numpy(dtype=float)
    reps = [repeat_ms_per_token(r) for _, r in df.iterrows()]
    n_reps = min((len(r) for r in reps), default=0)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = [HYBRIDGEN_COLOR if m == "hybridgen" else OTHER_COLOR for m in names]
    axes[0].barh(names, ms, color=colors)
    if n_reps >= 2:
        lo = np.array([min(r) for r in reps])
        hi = np.array([max(r) for r in reps])
        axes[0].errorbar(ms, names, xerr=[np.clip(ms - lo, 0, None), np.clip(hi - ms, 0, None)], fmt="none",
                         ecolor="k", capsize=2, lw=0.8, label=f"range over {n_reps} repeats")
        axes[0].legend(fontsize=8, loc="center right")
    axes[0].set_xlabel("decode ms / token (lower is better)")
    axes[0].invert_yaxis()
    marks.badge(axes[0], marks.run_provenance(df), note or "", loc="upper right")
    if "hybridgen" in names:
        base = dict(zip(names, ms))
        sp = {m: base[m] / base["hybridgen"] for m in names if m != "hybridgen"}
        order = sorted(sp, key=sp.get)
        axes[1].barh(order, [sp[m] for m in order], color="tab:green")
        axes[1].axvline(1.0, color="k", lw=0.8)
        axes[1].set_xlabel("HybridGen speedup (baseline time / HybridGen time)")
        axes[1].invert_yaxis()
        axes[1].set_xlim(0, 1.45 * max(max(sp.values()), 1.0))
        marks.badge(axes[1], marks.run_provenance(df), loc="upper right")
    else:
        axes[1].text(0.5, 0.5, "no hybridgen run", ha="center", va="center")
    r = df.iloc[0]
    fig.suptitle(marks.wrap(f"Decode latency on this CPU: {r['model.name']}, batch {int(r['workload.batch'])}, "
                            f"prompt {int(r['workload.prompt_len'])}, {int(r['workload.gen_len'])} new tokens "
                            "(gpu tier emulated on the CPU: CPU cost, not GPU speed)", 100))
    fig.tight_layout()
    return fig


def speedup_projected(proj):
    """PROJECTED ms per decode step per method, one panel per hardware profile, log axis with plain
    ticks; a method whose KV does not fit in that GPU's memory is a hatched, unfilled bar (legend entry)."""
    import matplotlib.pyplot as plt

    profiles = sorted(proj["projected.profile"].unique())
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.4 * len(profiles), 4.6), sharey=True, squeeze=False)
    first = proj[proj["projected.profile"] == profiles[0]].set_index("method.name")["projected.step_s"]
    order = list(first.sort_values().index)  # one method order for every panel (shared y axis)
    misfit = False
    for ax, prof in zip(axes[0], profiles):
        g = proj[proj["projected.profile"] == prof].set_index("method.name")
        ms = 1e3 * g["projected.step_s"]
        for m in order:
            fits = bool(g.loc[m, "projected.fits_gpu"])
            color = HYBRIDGEN_COLOR if m == "hybridgen" else OTHER_COLOR
            if fits:
                ax.barh(m, ms[m], color=color)
            else:
                ax.barh(m, ms[m], facecolor="none", edgecolor=color, hatch=marks.DOES_NOT_FIT_HATCH)
                misfit = True
        ax.set_xscale("log")
        marks.plain_log_ticks(ax.xaxis)
        ax.set_xlabel("projected ms / decode step")
        ax.set_title(prof, fontsize=10)
        marks.badge(ax, "projected")
    axes[0][0].invert_yaxis()
    if misfit:
        fig.legend(handles=[marks.does_not_fit_handle()], loc="lower center", ncol=1, fontsize=8, frameon=False)
    r = proj.iloc[0]
    fig.suptitle(f"PROJECTED decode step: {r['model.name']}, batch {int(r['workload.batch'])}, "
                 f"prompt {int(r['workload.prompt_len'])}, {int(r['workload.gen_len'])} new tokens")
    fig.tight_layout(rect=(0, 0.06 if misfit else 0, 1, 1))
    return fig
