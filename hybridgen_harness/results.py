"""Results store: one directory per run, written atomically, never overwritten silently.

Layout::

    <results_dir>/<exp>/<run-name>/config.yaml    resolved configuration
                                   metrics.json   everything measured (see experiments/runner.py)
                                   trace.json     scheduler trace (when the method has one)
                                   DONE           marker written last, inside the temp dir
    <results_dir>/<exp>/summary.csv (+ .parquet)  one row per finished run (``aggregate``)

``results_dir`` defaults to ``outputs/`` (ad-hoc runs stay out of the committed tree); the
committed ``results/`` is written only by explicit ``make`` targets (``make quickstart``,
``make results EXP=...``).

A run is written into ``<exp>/.tmp-<name>-<host>-<pid>/`` and renamed into place only when
complete, so a killed run leaves no finished-looking directory and a re-run of the sweep
completes exactly the missing runs. Stale temp dirs of dead processes on this host are
removed on the next run.

One run at a time: every run holds an exclusive lock (``flock`` on ``<exp>/.lock-<name>``,
released by the kernel when the process dies) from its skip check to its rename, so a second
identical run started meanwhile waits, then finds the run finished and skips it. Replacing a
finished run needs ``force`` and is announced; nothing is ever replaced without it.

A run directory with a ``DONE`` marker whose ``metrics.json`` is missing, not a JSON object or
without the ``run.name`` a finished run writes (``{}``)
is *damaged*: it counts as unfinished (a re-run redoes it and says so), and aggregation names
the file it skipped.

The run name encodes the configuration: ``<model>[-<weights>]__<method>[-<key params>]__b<batch>
-p<prompt>-g<gen>-<source>__<device>-<dtype>-L<layers>__s<seed>__<hash>`` where ``<device>`` is
the realized hardware (the CUDA device name, or ``cpu-emulated``) and the 8-hex hash covers
every field that identifies the run (so two configs never share a directory even when the
readable part is equal).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from hybridgen.errors import ConfigError
from hybridgen.naming import method_part, slug
from hybridgen.validation.paths import check_writable, pid_alive  # noqa: F401  (check_writable: re-exported for the harness)

DONE = "DONE"
#: a finished run's metrics.json holds ``run: {name: ..., ...}`` (experiments/runner.py writes it);
#: without it (``{}``, a half-written object) the run is damaged: re-run, never tabled as '?'
FINISHED_RUN_KEYS = ("name",)
METRICS = "metrics.json"
CONFIG = "config.yaml"


# ----------------------------------------------------------------------------- naming
def config_hash(identity: Mapping[str, Any]) -> str:
    """8 hex digits of a SHA-1 over the canonical JSON of ``identity``."""
    blob = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:8]


def run_name(model: str, weights: str, method: str, key_params: Mapping[str, Any], batch: int,
             prompt_len: int, gen_len: int, source: str, seed: int,
             identity: Mapping[str, Any], extra: str = "", hardware: str = "") -> str:
    """The directory name of one run (see module docstring).

    key_params: the method parameters worth reading in the name (e.g. those that differ from
    the method's defaults, and budgets). identity: everything that identifies the run.
    hardware: the realized hardware part, e.g. ``cpu-emulated-fp32-L30`` (empty: left out).
    """
    model_part = slug(Path(model).name if os.sep in model else model, 40)
    if weights != "real":
        model_part += f"-{weights}"
    work = f"b{batch}-p{prompt_len}-g{gen_len}-{slug(source, 12)}"
    parts = [model_part, method_part(method, key_params), work]
    if extra:
        parts.append(slug(extra, 40))
    if hardware:
        parts.append(slug(hardware, 60))
    parts += [f"s{seed}", config_hash(identity)]
    return "__".join(parts)


def hardware_part(device: str, dtype: str, num_layers: int) -> str:
    """Readable realized-hardware fragment of a run name: ``<device>-<dtype>-L<layers>``."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(dtype), str(dtype))
    return f"{slug(device, 40)}-{short}-L{int(num_layers)}"


# ----------------------------------------------------------------------------- checks
def _metrics_problem(run_dir: Path) -> Optional[str]:
    """None when ``run_dir/metrics.json`` is a readable JSON object, else what is wrong with it."""
    path = run_dir / METRICS
    if not path.is_file():
        return f"{path} is missing"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{path} is not valid JSON ({first})"
    if not isinstance(data, dict):
        return f"{path} holds a {type(data).__name__}, not a JSON object"
    run = data.get("run")
    if not isinstance(run, dict) or not all(isinstance(run.get(k), str) and run.get(k) for k in FINISHED_RUN_KEYS):
        return (f"{path} lacks what a finished run writes (a 'run' object with "
                f"{', '.join(repr(k) for k in FINISHED_RUN_KEYS)})")
    return None


# ----------------------------------------------------------------------------- store
def _host() -> str:
    """This host's name as one dash-free token (temp dir names split on '-')."""
    return slug(socket.gethostname(), 30).replace("-", "_")


def _lock_name(name: str) -> str:
    """``.lock-<name>``, shortened with a hash when the name is long (file names stop at 255 bytes)."""
    if len(name) <= 200:
        return f".lock-{name}"
    return f".lock-{name[:180]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"


#: lock files this process holds -> nesting depth (``locked`` is re-entrant within a process)
_HELD: Dict[str, int] = {}


def _stderr_log(msg: str) -> None:
    """Waits, replacements and left-out runs: warnings through logging (stderr; hidden by quiet)."""
    logging.getLogger(__name__).warning(msg)


class ResultsStore:
    """The results of one experiment: ``<root>/<exp>/``."""

    def __init__(self, root: os.PathLike | str, exp: str):
        self.root = Path(root).expanduser()  # as check_writable: '~/x' is the home's x, never a './~' folder
        self.exp = exp
        self.exp_dir = self.root / slug(exp, 60)

    def run_dir(self, name: str) -> Path:
        return self.exp_dir / name

    def state(self, name: str) -> Tuple[str, str]:
        """('done' | 'missing' | 'damaged' | 'foreign', why) of run ``name``.

        damaged: DONE present but metrics.json missing or unreadable (counts as unfinished);
        foreign: a directory without DONE (never left by this store: not ours to replace).
        """
        d = self.run_dir(name)
        if not d.exists():
            return "missing", ""
        if not (d / DONE).is_file():
            return "foreign", f"{d} exists but holds no finished run"
        problem = _metrics_problem(d)
        return ("damaged", problem) if problem else ("done", "")

    def is_done(self, name: str) -> bool:
        return self.state(name)[0] == "done"

    def _run_dirs(self) -> List[Path]:
        if not self.exp_dir.is_dir():
            return []
        return sorted(d for d in self.exp_dir.iterdir()
                      if d.is_dir() and not d.name.startswith(".") and (d / DONE).is_file())

    def finished_runs(self) -> List[Path]:
        """Directories of every finished run of this experiment (damaged ones left out), sorted by name."""
        return [d for d in self._run_dirs() if _metrics_problem(d) is None]

    def damaged_runs(self) -> List[Tuple[Path, str]]:
        """(directory, what is wrong) of every run with a DONE marker but no readable metrics.json."""
        out = []
        for d in self._run_dirs():
            problem = _metrics_problem(d)
            if problem:
                out.append((d, problem))
        return out

    def clean_stale(self) -> List[Path]:
        """Remove temp dirs left by killed runs of dead processes on this host; return them."""
        removed = []
        if not self.exp_dir.is_dir():
            return removed
        host = _host()
        for d in self.exp_dir.glob(".tmp-*"):
            m = re.fullmatch(r"\.tmp-.*-(?P<host>[^-]+)-(?P<pid>\d+)", d.name)
            if m and m.group("host") == host and not pid_alive(int(m.group("pid"))):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed

    @contextlib.contextmanager
    def locked(self, name: str, log: Callable[[str], None] = _stderr_log) -> Iterator[None]:
        """Hold the exclusive lock of run ``name`` (waits, saying so once, while another process holds it).

        Re-entrant within one process. The lock file is removed on release; a waiter that
        got the lock on a file already removed retries on the new one (inode check), so two
        processes never both believe they hold it. Directories this call created are removed
        again when they are left empty (a failed run writes nothing).
        """
        import fcntl

        path = self.exp_dir / _lock_name(name)
        key = str(path.absolute())
        if key in _HELD:
            _HELD[key] += 1
            try:
                yield
            finally:
                _HELD[key] -= 1
            return
        made = [p for p in (self.root, self.exp_dir) if not p.exists()]
        self.exp_dir.mkdir(parents=True, exist_ok=True)
        announced = False
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if not announced:
                    log(f"waiting: another process is running {self.run_dir(name)}")
                    announced = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed this file on release: lock the current one
        _HELD[key] = 1
        try:
            yield
        finally:
            del _HELD[key]
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)  # closing releases the flock
            for p in reversed(made):
                with contextlib.suppress(OSError):
                    p.rmdir()  # only when empty

    @contextlib.contextmanager
    def writing(self, name: str, force: bool = False, log: Callable[[str], None] = print) -> Iterator[Path]:
        """Yield a fresh temp dir for run ``name``; on normal exit mark it DONE and move it into place.

        Holds the run's lock throughout (see :meth:`locked`). An exception (or a kill) leaves
        nothing at the final path. A finished run at the final path is replaced only with
        ``force`` (announced through ``log``); a damaged one (DONE but no readable metrics) is
        redone and announced; an unfinished directory there (not ours: we never leave one) is
        an error naming the fix.
        """
        final = self.run_dir(name)
        with self.locked(name, log=log):
            state, why = self.state(name)
            if state == "foreign":
                raise ConfigError(f"{why}; remove it and re-run")
            if state == "done" and not force:
                raise ConfigError(f"{final} is already finished; pass force=true to replace it")
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
                    if state == "done":
                        log(f"replaced finished run {final} (force=true)")
                    else:
                        log(f"re-ran damaged run {final} ({why})")
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
    problem = _metrics_problem(d)
    if problem:
        raise ConfigError(f"{problem}; delete {d} and re-run the experiment to redo it")
    data = json.loads((d / METRICS).read_text())
    data.setdefault("run", {})["dir"] = d.name
    return data
