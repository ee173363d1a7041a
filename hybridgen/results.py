"""Results store: one directory per run, written atomically, never overwritten silently.

Layout::

    results/<exp>/<run-name>/config.yaml    resolved configuration
                             metrics.json   everything measured (see experiments/runner.py)
                             trace.json     scheduler trace (when the method has one)
                             DONE           marker written last, inside the temp dir
    results/<exp>/summary.csv (+ .parquet)  one row per finished run (``aggregate``)

A run is written into ``results/<exp>/.tmp-<name>-<host>-<pid>/`` and renamed into place
only when complete, so a killed run leaves no finished-looking directory and a re-run of the
sweep completes exactly the missing runs. Replacing a finished run needs ``force`` and is
announced. Stale temp dirs of dead processes on this host are removed on the next run.

The run name encodes the configuration: ``<model>__<method>[-<key params>]__b<batch>-p<prompt>
-g<gen>-<source>__s<seed>__<hash>`` where the 8-hex hash covers every field that identifies
the run (so two configs never share a directory even when the readable part is equal).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

from hybridgen.errors import ConfigError

DONE = "DONE"
METRICS = "metrics.json"
CONFIG = "config.yaml"
_SAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


# ----------------------------------------------------------------------------- naming
def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return "+".join(_fmt_value(v) for v in value)
    return str(value)


def slug(text: str, max_len: int = 80) -> str:
    """Filesystem-safe fragment: runs of unsafe characters become '_'; '/' never survives."""
    out = _SAFE.sub("_", str(text)).strip("_") or "x"
    return out[:max_len]


def config_hash(identity: Mapping[str, Any]) -> str:
    """8 hex digits of a SHA-1 over the canonical JSON of ``identity``."""
    blob = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:8]


def run_name(model: str, weights: str, method: str, key_params: Mapping[str, Any], batch: int,
             prompt_len: int, gen_len: int, source: str, seed: int,
             identity: Mapping[str, Any], extra: str = "") -> str:
    """The directory name of one run (see module docstring).

    key_params: the method parameters worth reading in the name (e.g. those that differ from
    the method's defaults, and budgets). identity: everything that identifies the run.
    """
    model_part = slug(Path(model).name if os.sep in model else model, 40)
    if weights != "real":
        model_part += f"-{weights}"
    meth = slug(method, 30)
    if key_params:
        meth += "-" + "-".join(f"{slug(k, 20)}={slug(_fmt_value(v), 20)}" for k, v in sorted(key_params.items()))
    work = f"b{batch}-p{prompt_len}-g{gen_len}-{slug(source, 12)}"
    parts = [model_part, slug(meth, 120), work]
    if extra:
        parts.append(slug(extra, 40))
    parts += [f"s{seed}", config_hash(identity)]
    return "__".join(parts)


# ----------------------------------------------------------------------------- store
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host() -> str:
    """This host's name as one dash-free token (temp dir names split on '-')."""
    return slug(socket.gethostname(), 30).replace("-", "_")


class ResultsStore:
    """The results of one experiment: ``<root>/<exp>/``."""

    def __init__(self, root: os.PathLike | str, exp: str):
        self.root = Path(root)
        self.exp = exp
        self.exp_dir = self.root / slug(exp, 60)

    def run_dir(self, name: str) -> Path:
        return self.exp_dir / name

    def is_done(self, name: str) -> bool:
        d = self.run_dir(name)
        return (d / DONE).is_file() and (d / METRICS).is_file()

    def finished_runs(self) -> List[Path]:
        """Directories of every finished run of this experiment, sorted by name."""
        if not self.exp_dir.is_dir():
            return []
        return sorted(d for d in self.exp_dir.iterdir()
                      if d.is_dir() and not d.name.startswith(".") and (d / DONE).is_file()
                      and (d / METRICS).is_file())

    def clean_stale(self) -> List[Path]:
        """Remove temp dirs left by killed runs of dead processes on this host; return them."""
        removed = []
        if not self.exp_dir.is_dir():
            return removed
        host = _host()
        for d in self.exp_dir.glob(".tmp-*"):
            m = re.fullmatch(r"\.tmp-.*-(?P<host>[^-]+)-(?P<pid>\d+)", d.name)
            if m and m.group("host") == host and not _pid_alive(int(m.group("pid"))):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed

    @contextlib.contextmanager
    def writing(self, name: str, force: bool = False, log=print) -> Iterator[Path]:
        """Yield a fresh temp dir for run ``name``; on normal exit mark it DONE and move it into place.

        An exception (or a kill) leaves nothing at the final path. A finished run at the final
        path is replaced only with ``force`` (announced through ``log``); an unfinished directory
        there (not ours: we never leave one) is an error naming the fix.
        """
        final = self.run_dir(name)
        if final.exists() and not self.is_done(name):
            raise ConfigError(f"{final} exists but holds no finished run; remove it and re-run")
        if final.exists() and not force:
            raise ConfigError(f"{final} is already finished; pass force=true to replace it")
        self.exp_dir.mkdir(parents=True, exist_ok=True)
        host = _host()
        tmp = self.exp_dir / f".tmp-{name[:60]}-{host}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            yield tmp
            (tmp / DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
            if final.exists():
                old = self.exp_dir / f".replaced-{name[:60]}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
                log(f"replaced finished run {final} (force=true)")
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# ----------------------------------------------------------------------------- json helpers
def to_jsonable(obj: Any) -> Any:
    """Plain JSON values from tensors, numpy scalars, dataclasses, paths, dtypes, NaN (-> None)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, (int, str, bool)) or obj is None:
        return obj
    if np is not None and isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if np is not None and isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # torch tensor
        return to_jsonable(obj.tolist())
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses
        return to_jsonable(dataclasses.asdict(obj))
    return str(obj)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(to_jsonable(data), indent=2, sort_keys=False) + "\n")


def load_run(run_dir: os.PathLike | str) -> Dict[str, Any]:
    """metrics.json of a finished run, with its directory name under 'run.dir'."""
    d = Path(run_dir)
    data = json.loads((d / METRICS).read_text())
    data.setdefault("run", {})["dir"] = d.name
    return data


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


def aggregate(root: os.PathLike | str, exp: str) -> Dict[str, Path]:
    """Write ``<root>/<exp>/summary.csv`` (and ``summary.parquet`` when pyarrow is present).

    Returns the paths written. No finished run -> a one-line ConfigError naming the fix.
    """
    import pandas as pd

    rows = collect(root, exp)
    store = ResultsStore(root, exp)
    if not rows:
        raise ConfigError(f"no finished runs under {store.exp_dir}; run `python experiments/run.py +exp={exp}` first")
    df = pd.DataFrame(rows)
    front = [c for c in ("run.name", "model.name", "method.name", "workload.batch", "workload.prompt_len",
                         "workload.gen_len", "seed") if c in df.columns]
    df = df[front + [c for c in df.columns if c not in front]]
    out = {"csv": store.exp_dir / "summary.csv"}
    tmp = out["csv"].with_suffix(".csv.tmp")
    df.to_csv(tmp, index=False)
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
    """A plain-text table (right-aligned columns); None shows as '-', floats with 4 significant digits."""
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
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
