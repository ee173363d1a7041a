"""The paper's hub tasks (piqa, openbookqa, winogrande, copa, rte, wikitext) on local data files.

With a network, lm-eval loads these tasks from the Hugging Face hub as usual (pass their names
in ``exp.accuracy.tasks``). Without one, a user who has the files can point the same task
definitions (prompts, choices, metrics) at them: :func:`load_local` merges the task's own YAML
with ``dataset_path: json`` and the given ``data_files``. The tests use this on small
generated fixtures.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

HUB_TASKS = ("piqa", "openbookqa", "winogrande", "copa", "rte", "wikitext")


def local_config(task_manager, name: str, data_files: Mapping[str, str]) -> Dict[str, Any]:
    """The task's full config with its dataset replaced by local JSON/JSONL files {split: path}."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from hybridgen.errors import unknown_name

    entry = task_manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise unknown_name("lm-eval task", name, HUB_TASKS)
    cfg = load_yaml(entry.yaml_path)
    cfg.update({"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": dict(data_files)}})
    cfg.pop("custom_dataset", None)
    return cfg


def load_local(task_manager, name: str, data_files: Mapping[str, str]):
    """A ready lm-eval Task for ``name`` over local files."""
    d = task_manager.load([local_config(task_manager, name, data_files)])
    return next(iter(d["tasks"].values()))
