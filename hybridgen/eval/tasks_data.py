"""Loaders behind the local lm-eval task YAMLs in hybridgen/eval/tasks/ (custom_dataset hooks).

Each returns ``{"test": datasets.Dataset}``. Keyword arguments are the task's
``dataset_kwargs`` merged with the run's metadata (lm-eval passes both); unknown ones are ignored.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hybridgen.data.cache import missing, sub

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_NEEDLE_LENGTHS = (2048, 4096, 8192)
DEFAULT_NEEDLE_DEPTHS = (0, 25, 50, 75, 100)


def tasks_dir() -> Path:
    """The include path holding hybridgen's local task YAMLs."""
    return TASKS_DIR


def _read_jsonl(path: Path) -> List[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _dataset(docs: List[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_bigbench(bigbench_task: str = "social_iqa", **_: Any):
    path = sub("jsonl") / f"bigbench_{bigbench_task}.jsonl"
    if not path.exists():
        raise missing("bigbench", path)
    return _dataset(_read_jsonl(path))


def load_ppl(ppl_source: str = "pydoc", ppl_max_docs: Optional[int] = None, **_: Any):
    """Perplexity docs; pydoc is built on the fly when not prepared (it is always present)."""
    path = sub("jsonl") / f"ppl_{ppl_source}.jsonl"
    if path.exists():
        docs = _read_jsonl(path)
    elif ppl_source == "pydoc":
        from hybridgen.data import perplexity, sources

        docs = perplexity.chunk_documents(sources.documents("pydoc"), "pydoc")
    else:
        raise missing("ppl", path)
    if ppl_max_docs:
        docs = docs[: int(ppl_max_docs)]
    return _dataset(docs)


def _as_list(value: Any, default: Sequence) -> List:
    if value is None:
        return list(default)
    if isinstance(value, str):
        return [float(v) if "." in v else int(v) for v in value.replace(";", ",").split(",") if v.strip()]
    if isinstance(value, (int, float)):
        return [value]
    return list(value)


def load_needle(tokenizer: Optional[str] = None, needle_lengths: Any = None, needle_depths: Any = None,
                needle_samples: int = 1, needle_seed: int = 0, **_: Any):
    """Needle docs over the essays; lengths in tokens of ``tokenizer`` (a tokenizer dir or name)."""
    from hybridgen.data import needle, sources

    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    docs = needle.build_docs(sources.corpus("essays"), _as_list(needle_lengths, DEFAULT_NEEDLE_LENGTHS),
                             _as_list(needle_depths, DEFAULT_NEEDLE_DEPTHS), int(needle_samples), tok,
                             int(needle_seed))
    return _dataset(docs)


_TASK_DATA = {"hg_needle": ("essays", lambda: sub("essays")),
              "hg_ppl_pg_text": ("ppl", lambda: sub("jsonl") / "ppl_pg-text.jsonl")}


def local_tasks() -> List[str]:
    """Names of the local tasks and groups (``hg_*``) defined by the YAMLs in :func:`tasks_dir`."""
    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        for line in path.read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("task", "group") and val.strip():
                names.append(val.strip())
    return names


def check_tasks(tasks: Sequence[str]) -> None:
    """Raise ConfigError for an unknown local (``hg_*``) task and MissingDataError (one line
    naming `make data`) if a local task's data is not prepared. Other names go to lm-eval."""
    from hybridgen.errors import unknown_name

    local = local_tasks()
    for t in tasks:
        if t.startswith("hg_") and t not in local:
            raise unknown_name("local task", t, local)
        if t.startswith("hg_bigbench_"):
            path = sub("jsonl") / f"bigbench_{t[len('hg_bigbench_'):]}.jsonl"
            if not path.exists():
                raise missing("bigbench", path)
        elif t in _TASK_DATA:
            what, path = _TASK_DATA[t][0], _TASK_DATA[t][1]()
            if not path.exists():
                raise missing(what, path)


def needle_cells(samples: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Accuracy per (length, depth) from lm-eval logged samples of hg_needle."""
    cells: Dict[tuple, List[float]] = {}
    for s in samples:
        doc = s.get("doc", {})
        key = (int(doc.get("length", 0)), float(doc.get("depth", 0)))
        cells.setdefault(key, []).append(float(s.get("exact_match", 0.0)))
    return [{"length": k[0], "depth": k[1], "score": sum(v) / len(v), "n": len(v)} for k, v in sorted(cells.items())]
