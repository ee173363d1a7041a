"""Data access for the figure notebooks (notebooks/*.py): finished runs as DataFrames.

Notebooks call :func:`runs` (one row per finished run of an experiment, every metric flattened
to dotted columns) and :func:`save` (writes a PNG under results/figures/). When an experiment
has no finished runs, :func:`runs` returns None and prints the command that produces them, so a
notebook can skip its figure instead of crashing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional


def repo_root() -> Path:
    here = Path.cwd().resolve()
    for p in (here, *here.parents):
        if (p / "conf" / "config.yaml").exists():
            return p
    return Path(__file__).resolve().parents[2]


def results_dir() -> Path:
    return Path(os.environ.get("HYBRIDGEN_RESULTS") or repo_root() / "results")


def figures_dir() -> Path:
    d = results_dir() / "figures"
    d.mkdir(parents=True, exist_ok=True)
    return d


def runs(exp: str, hint: str = ""):
    """DataFrame of the finished runs of ``exp`` (None, with a message, when there are none)."""
    import pandas as pd

    from hybridgen.result_tables import collect

    rows = collect(results_dir(), exp)
    if not rows:
        print(f"[{exp}] no finished runs under {results_dir() / exp}; produce them with: "
              f"{hint or f'python experiments/run.py +exp={exp}'}  (figure skipped)")
        return None
    return pd.DataFrame(rows)


def run_dirs(exp: str) -> List[Path]:
    from hybridgen.results import ResultsStore

    return ResultsStore(results_dir(), exp).finished_runs()


def load_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def label(row: Dict[str, Any]) -> str:
    """'method' or 'method (params)' for legend entries."""
    return str(row.get("method.name"))


def save(fig, name: str) -> Path:
    """Save a figure as results/figures/<name>.png (150 dpi) and return the path."""
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    print(f"wrote {path}")
    return path


def emulated_note(df) -> Optional[str]:
    """A caption line when the gpu/cxl tiers were emulated in these runs."""
    notes = []
    col = "hardware.store.gpu.emulated"
    if col in df.columns and bool(df[col].fillna(False).astype(bool).any()):
        notes.append("gpu tier emulated on CPU")
    col = "hardware.store.cxl.emulated"
    if col in df.columns and bool(df[col].fillna(False).astype(bool).any()):
        notes.append("cxl tier emulated in DRAM")
    return "; ".join(notes) if notes else None
