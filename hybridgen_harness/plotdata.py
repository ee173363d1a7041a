"""Data access for the figure notebooks (notebooks/*.py): finished runs as DataFrames.

Notebooks call :func:`runs` (one row per finished run of an experiment, every metric flattened
to dotted columns) and :func:`save` (writes a PNG under results/figures/). When an experiment
has no finished runs, :func:`runs` returns None and prints the command that produces them, so a
notebook can skip its figure instead of crashing. :func:`all_runs` loads every experiment's
finished runs into one DataFrame (an ``exp`` column says which experiment each row is from):

    from hybridgen_harness.plotdata import all_runs
    df = all_runs()                       # results/ of the checkout you are in (or $HYBRIDGEN_RESULTS)
    df = all_runs("outputs", exps=["quickstart", "accuracy"])
    df.groupby(["exp", "method.name"]).size()
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

log = logging.getLogger(__name__)


def repo_root() -> Path:
    """The checkout at or above the current directory, else the current directory itself.

    Never the directory this package was installed from: a user outside the repository reads
    their own results, not a checkout's (issue 26).
    """
    here = Path.cwd().resolve()
    for p in (here, *here.parents):
        if (p / "conf" / "config.yaml").exists():
            return p
    return here


def results_dir() -> Path:
    """``$HYBRIDGEN_RESULTS``, else ``results/`` of :func:`repo_root`."""
    return Path(os.environ.get("HYBRIDGEN_RESULTS") or repo_root() / "results")


def figures_dir() -> Path:
    d = results_dir() / "figures"
    d.mkdir(parents=True, exist_ok=True)
    return d


def runs(exp: str, hint: str = ""):
    """DataFrame of the finished runs of ``exp`` (None, with a message, when there are none)."""
    import pandas as pd

    from hybridgen_harness.result_tables import collect

    rows = collect(results_dir(), exp)
    if not rows:
        log.warning("[%s] no finished runs under %s; produce them with: %s  (figure skipped)", exp,
                    results_dir() / exp, hint or f"python experiments/run.py +exp={exp}")
        return None
    return pd.DataFrame(rows)


def experiments(root: Union[None, str, os.PathLike] = None) -> List[str]:
    """Names of the experiments under ``root`` (default :func:`results_dir`) with a finished run."""
    from hybridgen_harness.results import ResultsStore

    base = Path(root) if root is not None else results_dir()
    if not base.is_dir():
        return []
    return [d.name for d in sorted(base.iterdir())
            if d.is_dir() and not d.name.startswith((".", "_")) and ResultsStore(base, d.name).finished_runs()]


def all_runs(root: Union[None, str, os.PathLike] = None, exps: Optional[Sequence[str]] = None):
    """One DataFrame of the finished runs of every experiment (or of ``exps``) under ``root``.

    ``root`` None: :func:`results_dir` (``$HYBRIDGEN_RESULTS``, else ``results/`` of the checkout
    at or above the current directory, else ``./results``). The directory read is logged and
    kept in ``df.attrs["results_dir"]``. Columns: ``exp`` (the experiment), then the union of
    every run's flattened columns (``method.name``, ``metrics.*``, ``workload.*``,
    ``run.name``...; a column a run lacks is NaN). Damaged runs are left out (as in
    :func:`runs`). A directory without one finished run (of ``exps``) is a ConfigError.
    """
    import pandas as pd

    from hybridgen.errors import ConfigError
    from hybridgen_harness.result_tables import collect

    base = (Path(root) if root is not None else results_dir()).expanduser().resolve()
    how = "given" if root is not None else ("$HYBRIDGEN_RESULTS" if os.environ.get("HYBRIDGEN_RESULTS")
                                            else "default: results/ of the checkout or the current directory")
    names = list(exps) if exps is not None else experiments(base)
    frames = []
    for exp in names:
        rows = collect(base, exp)
        if rows:
            frames.append(pd.DataFrame(rows).assign(exp=exp))
        else:
            log.info("[%s] no finished runs under %s", exp, base / exp)
    if not frames:
        which = f" of {', '.join(names)}" if exps is not None else ""
        raise ConfigError(f"all_runs: no finished runs{which} under {base} ({how}); pass the directory your runs "
                          "went to (results_dir=...), e.g. all_runs('outputs') or all_runs('results')")
    df = pd.concat(frames, ignore_index=True, sort=False)
    log.info("all_runs: %d run(s) of %d experiment(s) from %s (%s)", len(df), len(frames), base, how)
    df = df[["exp"] + [c for c in df.columns if c != "exp"]]
    df.attrs["results_dir"] = str(base)
    return df


def run_dirs(exp: str) -> List[Path]:
    from hybridgen_harness.results import ResultsStore

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
    print(f"wrote {path}")  # what the notebook made (its output, like a result)
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
