"""BIG-bench multiple-choice tasks converted to lm-eval ``multiple_choice`` JSONL.

Each output line: ``{"id", "query", "choices": [str], "gold": int}``; lm-eval scores
``query + choice`` for every choice (``doc_to_text: query``, ``doc_to_choice: choices``,
``target_delimiter: ""`` because choices carry their own leading space).

Offline substitutes for the hub tasks the paper's template uses: ``social_iqa`` (SIQA-like),
``winowhy`` (Winograd / WinoGrande-like), ``step_inference`` (goal_step_wikihow, HellaSwag-like),
``strategyqa`` (yes/no, BoolQ-like), ``cause_and_effect`` (COPA-like; 102 items only),
``physical_intuition`` (PIQA-like; 81 items only).

Choices where BIG-bench is silent about zero-shot log-likelihood formatting:
- prompts follow each task's own prefixes where it has them (winowhy: "The above reasoning
  is"), otherwise "Q: ...\\nA:"; choices get one leading space;
- the gold answer is the unique arg-max of ``target_scores`` (examples with ties are dropped);
- examples are shuffled with a fixed seed (1234) so ``--limit N`` takes a random sample.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

# task key -> path of its task.json inside the bigbench source tree (relative to benchmark_tasks/)
TASKS: Dict[str, List[str]] = {
    "social_iqa": ["social_iqa/task.json"],
    "winowhy": ["winowhy/task.json"],
    "step_inference": ["goal_step_wikihow/step_inference/task.json"],
    "strategyqa": ["strategyqa/task.json"],
    "cause_and_effect": ["cause_and_effect/one_sentence_no_prompt/task.json",
                         "cause_and_effect/two_sentences/task.json"],
    "physical_intuition": ["physical_intuition/task.json"],
}
SHUFFLE_SEED = 1234


def _gold(target_scores: Dict[str, float]) -> Optional[int]:
    scores = list(target_scores.values())
    best = max(scores)
    return scores.index(best) if scores.count(best) == 1 else None


def _qa(ex: dict, meta: dict) -> str:
    return f"Q: {ex['input'].strip()}\nA:"


def _winowhy(ex: dict, meta: dict) -> str:
    return f"{ex['input'].strip()}\nThe above reasoning is"


def _step(ex: dict, meta: dict) -> str:
    return ex["input"].rstrip()


def _cause(ex: dict, meta: dict) -> str:
    if meta.get("name") == "two_sentences":
        return "Two events are given. Which event caused the other?\nAnswer:"
    return "Which sentence makes more sense?\nAnswer:"


FORMATTERS: Dict[str, Callable[[dict, dict], str]] = {
    "social_iqa": _qa, "winowhy": _winowhy, "step_inference": _step, "strategyqa": _qa,
    "cause_and_effect": _cause, "physical_intuition": _qa,
}


def convert_task(key: str, task_jsons: Iterable[dict]) -> List[dict]:
    """Docs of one task from its parsed task.json file(s) (see module docstring)."""
    fmt = FORMATTERS[key]
    docs = []
    for meta in task_jsons:
        for ex in meta.get("examples", []):
            ts = ex.get("target_scores")
            if not ts:
                continue
            gold = _gold(ts)
            if gold is None:
                continue
            docs.append({"query": fmt(ex, meta), "choices": [" " + c.strip() for c in ts], "gold": gold})
    random.Random(SHUFFLE_SEED).shuffle(docs)
    for i, d in enumerate(docs):
        d["id"] = f"{key}-{i}"
    return docs


def write_jsonl(docs: Iterable[dict], path: Path) -> int:
    """Write docs atomically; returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w") as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def convert_tree(benchmark_tasks: Path, out_dir: Path, only: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """Convert every task in TASKS found under ``benchmark_tasks`` into ``out_dir/bigbench_<key>.jsonl``."""
    counts = {}
    for key, rels in TASKS.items():
        if only and key not in only:
            continue
        metas = [json.loads((benchmark_tasks / r).read_text()) for r in rels]
        counts[key] = write_jsonl(convert_task(key, metas), out_dir / f"bigbench_{key}.jsonl")
    return counts
