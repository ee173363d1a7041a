"""The paper-regime figure (experiments/paper_regime.py): HybridGen's speedup per baseline, per GPU.

One panel per (placement, GPU), all PROJECTED (badged). Per baseline: every in-regime cell where
both fit as a filled dot, the geometric mean over them as a black bar with the band from the
model's error (hybridgen_harness.regime), "does not fit" cells as red crosses on the panel's floor,
and out-of-regime cells as hollow grey dots in a grey strip to the right of the baseline's in-regime
column (drawn, never counted). The paper's 1.41x-3.2x band is shaded green.

``rows``: the dicts of results/paper_regime/table.csv (experiments.paper_regime.read_table).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Sequence, Tuple

from hybridgen_harness import regime as rg
from hybridgen_harness.figures import marks

BAND_LABEL = f"paper: {rg.PAPER_BAND[0]:g}x-{rg.PAPER_BAND[1]:g}x"
MEAN_LABEL = "geo-mean, in-regime cells (bar: model error band; none: cost not validated)"
IN_LABEL = "in-regime cell"
OUT_LABEL = "out-of-regime cell (not in the verdict)"
NOFIT_LABEL = "does not fit / cannot run (in regime)"
FLOOR = 0.05  # where 'does not fit' crosses sit (y, log scale)
OUT_OFFSET = 0.32


def _panel(ax, rows: Sequence[Mapping[str, Any]], placement: str, gpu: str, baselines: Sequence[str],
           labels: Mapping[str, str]) -> Dict[str, Any]:
    handles: Dict[str, Any] = {}
    handles[BAND_LABEL] = ax.axhspan(*rg.PAPER_BAND, color="tab:green", alpha=0.15)
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    for i, base in enumerate(baselines):
        rs = [r for r in rows if r["placement"] == placement and r["gpu"] == gpu and r["baseline"] == base]
        inside = [r for r in rs if r["regime"] == rg.IN_REGIME]
        outside = [r for r in rs if r["regime"] == rg.OUT_OF_REGIME]
        ok = [r["speedup"] for r in inside if r["speedup"] is not None]
        nofit = [r for r in inside if r["speedup"] is None]
        if ok:
            xs = [i - 0.12 + 0.24 * k / max(1, len(ok) - 1) for k in range(len(ok))]
            handles[IN_LABEL] = ax.scatter(xs, ok, s=10, color="tab:blue", alpha=0.7, zorder=3)
        v = rg.verdict(rows, placement, gpu, base)
        if v.speedup is not None:
            lo, hi = (v.low, v.high) if v.low is not None else (v.speedup, v.speedup)
            handles[MEAN_LABEL] = ax.errorbar([i], [v.speedup], yerr=[[v.speedup - lo], [hi - v.speedup]], fmt="_",
                                              color="black", markersize=16, capsize=3, lw=1.5, zorder=4)
        if nofit:
            handles[NOFIT_LABEL] = ax.scatter([i] * len(nofit), [FLOOR] * len(nofit), marker="x", color="tab:red",
                                              s=30, zorder=3)
            ax.annotate(f"{len(nofit)} do not fit", (i, FLOOR), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=5, color="tab:red")
        if outside:
            ax.axvspan(i + OUT_OFFSET - 0.1, i + OUT_OFFSET + 0.1, color="0.85", zorder=0)
            ys = [r["speedup"] if r["speedup"] is not None else FLOOR for r in outside]
            handles[OUT_LABEL] = ax.scatter([i + OUT_OFFSET] * len(ys), ys, s=14, facecolors="none",
                                            edgecolors="0.4", zorder=3)
    ax.set_yscale("log")
    ax.set_ylim(FLOOR * 0.7, 60)
    ax.set_xticks(range(len(baselines)))
    ax.set_xticklabels([labels.get(b, b) for b in baselines], rotation=35, ha="right", fontsize=6)
    ax.tick_params(axis="y", labelsize=6)
    ax.set_title(f"{gpu.upper()}, placement: {placement}", fontsize=8)
    marks.badge(ax, "projected", loc="upper right")
    return handles


def draw(rows: Sequence[Mapping[str, Any]], placements: Sequence[str], gpus: Sequence[Tuple[str, str]],
         baselines: Sequence[str], labels: Mapping[str, str]):
    """The figure (matplotlib Figure): rows = placements, columns = GPUs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(placements), len(gpus), figsize=(4.2 * len(gpus), 3.6 * len(placements)),
                             squeeze=False, sharey=True)
    handles: Dict[str, Any] = {}
    for pi, placement in enumerate(placements):
        for gi, (gpu, _title) in enumerate(gpus):
            handles.update(_panel(axes[pi][gi], rows, placement, gpu, baselines, labels))
        axes[pi][0].set_ylabel("HybridGen speedup (x, log)", fontsize=7)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("HybridGen (default) vs the baselines in the paper's regime (projected; A100/H100/H200, "
                 "with and without CXL pooled)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    return fig


def figure(rows: Sequence[Mapping[str, Any]], path: Path, **kw: Any) -> Path:
    """Draw and save the figure to ``path`` (PNG); returns the path."""
    import matplotlib.pyplot as plt

    fig = draw(rows, **kw)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)
