"""Tables of finished runs: flatten each run's metrics, one row per run (``summary.csv`` and
``summary.parquet`` next to the runs: :func:`aggregate`), plain-text tables (:func:`format_table`),
and generated blocks spliced between markers of a README (:func:`splice`).

The runs themselves are read through :mod:`hybridgen_harness.results` (the store and its damage rules).
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from hybridgen.errors import ConfigError
from hybridgen_harness.results import ResultsStore, load_run


def _stderr_log(msg: str) -> None:
    """Waits, replacements and left-out runs: warnings through logging (stderr; hidden by quiet)."""
    logging.getLogger(__name__).warning(msg)


# ----------------------------------------------------------------------------- aggregation
def flatten(data: Mapping[str, Any], prefix: str = "", skip: Sequence[str] = ()) -> Dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists become JSON text (except long ones: skipped)."""
    out: Dict[str, Any] = {}
    for key, val in data.items():
        full = f"{prefix}{key}"
        if full in skip:
            continue
        if isinstance(val, Mapping):
            out.update(flatten(val, full + ".", skip))
        elif isinstance(val, list):
            if len(val) <= 64:
                out[full] = json.dumps(val)
        else:
            out[full] = val
    return out


def collect(root: os.PathLike | str, exp: str, skip: Sequence[str] = ("environment.pip",)) -> List[Dict[str, Any]]:
    """One flat row per finished run of ``exp`` (sorted by run name)."""
    store = ResultsStore(root, exp)
    return [flatten(load_run(d), skip=skip) for d in store.finished_runs()]


def aggregate(root: os.PathLike | str, exp: str, log: Callable[[str], None] = _stderr_log) -> Dict[str, Path]:
    """Write ``<root>/<exp>/summary.csv`` (and ``summary.parquet`` when pyarrow is present).

    Returns the paths written. Damaged runs (DONE but no readable metrics.json) are left out,
    each named through ``log``. No finished run -> a one-line ConfigError naming the fix.
    """
    import pandas as pd

    rows = collect(root, exp)
    store = ResultsStore(root, exp)
    damaged = store.damaged_runs()
    for d, why in damaged:
        log(f"warning: left out damaged run {d.name}: {why}; re-run the experiment to redo it")
    if not rows:
        also = f" ({len(damaged)} damaged: {damaged[0][1]})" if damaged else ""
        raise ConfigError(f"no finished runs under {store.exp_dir}{also}; run `python experiments/run.py "
                          f"+exp={exp} results_dir={root}` first")
    df = pd.DataFrame(rows)
    front = [c for c in ("run.name", "model.name", "method.name", "workload.batch", "workload.prompt_len",
                         "workload.gen_len", "seed") if c in df.columns]
    df = df[front + [c for c in df.columns if c not in front]]
    out = {"csv": store.exp_dir / "summary.csv"}
    tmp = out["csv"].with_suffix(".csv.tmp")
    try:
        df.to_csv(tmp, index=False)
    except OSError as err:
        raise ConfigError(f"cannot write {out['csv']} ({err.strerror or err}); make {store.exp_dir} writable") from None
    os.replace(tmp, out["csv"])
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return out
    pq = store.exp_dir / "summary.parquet"
    obj_cols = [c for c in df.columns if df[c].dtype == object]
    df2 = df.copy()
    for c in obj_cols:  # mixed-type object columns do not convert to arrow
        df2[c] = df2[c].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
    df2.to_parquet(pq.with_suffix(".parquet.tmp"), index=False)
    os.replace(pq.with_suffix(".parquet.tmp"), pq)
    out["parquet"] = pq
    return out


# ----------------------------------------------------------------------------- table
def format_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """A plain-text table (tabulate's "simple" format, right-aligned columns); None shows as '-',
    floats with 4 significant digits."""
    from tabulate import tabulate

    if not rows:
        return "(no runs)"
    cols = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    return tabulate(body, headers=cols, tablefmt="simple", disable_numparse=True,
                    colalign=("right",) * len(cols))


def splice(text: str, block: str, begin: str, end: str) -> str:
    """``text`` (a README) with what lies between the markers ``begin`` and ``end`` replaced by ``block``."""
    if begin not in text or end not in text:
        raise ConfigError(f"README has no '{begin}' ... '{end}' markers; add them where the block goes")
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + block + end + rest.split(end, 1)[1]
