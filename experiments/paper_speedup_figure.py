"""``python experiments/paper_speedup_figure.py [--results-dir results]``: redraw speedup.png from table.csv.

The paper comparison's figure: HybridGen's speedup over each baseline, one panel per case
(InfiniGen's template and 32K at batch 1/2/4/8: PROJECTED by the performance model per GPU; this
machine: EMULATED on its CPUs). Every panel carries its provenance badge and the suptitle says
which panels are which, so the projected GPUs and the emulated CPU are never read as one
comparison. Error bars on projected cells: the band both sides' model errors allow (the table's
[low-high], ``paper_speedup.speedup_band``); a cell where a side is not validated has none.
"does not fit": a hatched bar up to 1x (that method's KV cannot be placed in that GPU's memory
budget), with its legend entry. ``experiments/paper_speedup.py`` calls :func:`figure` with the rows
it computes; this script redraws from the committed ``table.csv`` without reading any run.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from experiments.paper_speedup import (CPU_COLUMN, EXP, GPUS, LABELS, _case_order,  # noqa: E402
                                       _case_title, speedup_band)
from hybridgen.errors import ConfigError, cli_errors  # noqa: E402
from hybridgen_harness.figures import marks  # noqa: E402
from hybridgen_harness.regime import PAPER_BAND  # noqa: E402

GPU_COLORS = {"a100": "tab:blue", "h100": "tab:orange", "rtx5090": "tab:green", "h200": "tab:red",
              "cpu-emulated": "#b35806"}
BAND_LABEL = f"paper: {PAPER_BAND[0]:g}x-{PAPER_BAND[1]:g}x"
ERROR_LABEL = "band from both sides' model errors (validated costs)"
TOP_CAP = 10.0  # an unbounded band (the baseline's error >= 100%) is drawn up to 10x its speedup


def _none(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) or v == "" else v


def read_table(path: Path) -> List[Dict[str, Any]]:
    """The rows of a committed ``table.csv`` (empty cells as None, fits as bools)."""
    import pandas as pd

    if not Path(path).is_file():
        raise ConfigError(f"no {path}; make it with: python experiments/paper_speedup.py --results-dir {Path(path).parents[1]}")
    rows = [{k: _none(v) for k, v in r.items()} for r in pd.read_csv(path).to_dict("records")]
    for r in rows:
        for k in ("baseline_fits", "hybridgen_fits"):
            if isinstance(r.get(k), str):
                r[k] = r[k] == "True"
    return rows


def _panel(ax, case: str, rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Draw one case; returns its legend entries {label: handle}."""
    rs = [r for r in rows if r["case"] == case and r["baseline"] != "full"]
    bases = sorted({r["baseline"] for r in rs}, key=lambda b: list(LABELS).index(b) if b in LABELS else 99)
    cols = [CPU_COLUMN] if case == "emulated" else [g for g in GPUS if any(r["gpu"] == g[0] for r in rs)]
    width = 0.8 / max(1, len(cols))
    ax.axhspan(*PAPER_BAND, color="tab:green", alpha=0.12, label=BAND_LABEL)
    ax.axhline(1.0, color="k", lw=0.8)
    values = [r["speedup"] for r in rs if _none(r["speedup"])]
    low = min(values + [1.0]) / 1.6
    misfit = errors = False
    for j, (gid, gname) in enumerate(cols):
        xs, ys, err, nx = [], [], [], []
        for i, b in enumerate(bases):
            r = next((r for r in rs if r["baseline"] == b and r["gpu"] == gid), None)
            if r is None:
                continue
            x = i + (j - (len(cols) - 1) / 2) * width
            if _none(r["speedup"]):
                xs.append(x)
                ys.append(r["speedup"])
                lo, hi = speedup_band({**r, "model_error_pct": _none(r.get("model_error_pct")),
                                       "hybridgen_error_pct": _none(r.get("hybridgen_error_pct"))})
                err.append((r["speedup"] - lo, min(hi, TOP_CAP * r["speedup"]) - r["speedup"]) if lo is not None
                           else (float("nan"), float("nan")))
            elif r.get("baseline_fits") is False or r.get("hybridgen_fits") is False:
                nx.append(x)
        color = GPU_COLORS.get(gid, "0.5")
        ax.bar(xs, ys, width=width, color=color, label=gname)
        if any(not math.isnan(e[0]) for e in err):
            ax.errorbar(xs, ys, yerr=[[e[0] for e in err], [e[1] for e in err]], fmt="none", ecolor="k",
                        elinewidth=0.8, capsize=1.5)
            errors = True
        if nx:
            ax.bar(nx, [1.0 - low] * len(nx), bottom=low, width=width, facecolor="none", edgecolor=color,
                   hatch=marks.DOES_NOT_FIT_HATCH, lw=0.6)
            misfit = True
    ax.set_yscale("log")
    ax.set_ylim(low, max(values + [PAPER_BAND[1]]) * 1.6)
    marks.times_ticks(ax.yaxis)
    ax.set_xticks(range(len(bases)))
    ax.set_xticklabels([LABELS.get(b, b).replace(" (on FlexGen)", "") for b in bases], rotation=40, ha="right",
                       fontsize=8)
    ax.set_ylabel("HybridGen speedup (log scale)")
    ax.set_title(marks.wrap(_case_title(case, rs or rows), 58), fontsize=9)
    if case == "emulated":
        marks.badge(ax, "emulated", "2 CPU cores; not a GPU number")
    else:
        marks.badge(ax, "projected", "A100 / H100 / RTX 5090 / H200 profiles")
    handles, labels = ax.get_legend_handles_labels()
    entries = dict(zip(labels, handles))
    if misfit:
        entries[marks.DOES_NOT_FIT] = marks.does_not_fit_handle()
    if errors:
        from matplotlib.lines import Line2D

        entries[ERROR_LABEL] = Line2D([], [], color="k", lw=0.8, marker="_", markersize=6, label=ERROR_LABEL)
    return entries


def draw(rows: Sequence[Dict[str, Any]]):
    """The figure (one panel per case, projected first, the emulated one last) for ``rows``."""
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows}, key=_case_order)
    n = len(cases)
    ncol = min(3, n)
    nrow = (n + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.4 * ncol, 4.6 * nrow + 0.6), squeeze=False)
    entries: Dict[str, Any] = {}
    for ax, case in zip(axes.flat, cases):
        entries.update(_panel(ax, case, rows))
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    order = [BAND_LABEL] + [g[1] for g in GPUS] + [CPU_COLUMN[1], marks.DOES_NOT_FIT, ERROR_LABEL]
    entries = {k: entries[k] for k in order if k in entries}
    projected = sum(1 for c in cases if c != "emulated")
    title = (f"HybridGen's decode speedup over each baseline: {projected} PROJECTED panels (performance model on "
             "datasheet GPU profiles)" + (", 1 EMULATED panel (this CPU with the gpu tier on the CPU: another machine "
                                          "and model, not comparable with the GPU panels)" if "emulated" in cases else ""))
    fig.suptitle(marks.wrap(title, 150), fontsize=11)
    fig.legend(list(entries.values()), list(entries), loc="upper center", ncol=len(entries), fontsize=8,
               bbox_to_anchor=(0.5, 0.955), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def figure(rows: Sequence[Dict[str, Any]], path: Path) -> Path:
    """Draw :func:`draw` into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@cli_errors
def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default="results")
    args = p.parse_args(argv)
    out = Path(args.results_dir) / EXP
    path = figure(read_table(out / "table.csv"), out / "speedup.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
