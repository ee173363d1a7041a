"""RULER's needle tasks that run offline, as documents for ``experiments/long_context.py``.

lm-eval's RULER niah tasks build their haystacks at run time; three need no network:
``niah_single_1`` (a repeated-sentence haystack, one 7-digit number), ``niah_multikey_2`` (a
haystack of other needles, numbers) and ``niah_multikey_3`` (the same with UUIDs); the others
download Paul Graham essays. A document here is one of the task's samples as lm-eval would send
it to the model: its prompt is the task instance's context (the input and its ``gen_prefix``),
its length the task's ``max_seq_lengths`` entry (``max_length``; RULER's own token count of the
sample, its input tokens plus the 128 it sets aside for the answer, often below the length for
UUIDs, is kept as ``ruler_tokens``), its answers the task's ``outputs``. A generation, up to
EOS as lm-eval's ``generate_until`` stops it, is scored as lm-eval scores it
(``string_match_all`` after ``postprocess_pred``: the share of the answers it contains; 0 or 1
here, one answer each), over at most :data:`NEW_TOKENS` tokens: RULER generates up to 128, and
the answer follows the prefix, so a method that gives it later than that scores 0 here (the
same cap for every method, so the paired differences compare like with like).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from hybridgen.errors import ConfigError

OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
#: new tokens per task: a 7-digit number is up to 8 tokens, a UUID 34-38 (Gemma's and SmolLM2's tokenizers)
NEW_TOKENS = {"niah_single_1": 24, "niah_multikey_2": 24, "niah_multikey_3": 64}


def build_docs(tasks: Sequence[str], lengths: Sequence[int], samples: int, tokenizer: str,
               seed: int = 0) -> List[Dict[str, Any]]:
    """The first ``samples`` samples of each RULER task at each length, as documents
    ({id, prompt, answer (list), length, variant (the task), sample, depth None, ruler_tokens});
    ``tokenizer``: the model's tokenizer (a local path or hub id), which RULER counts lengths in.

    RULER draws its samples from Python's global ``random``: it is seeded with ``seed`` before
    each task is built (as lm-eval's ``simple_evaluate`` seeds it with its ``random_seed`` before
    building its tasks, so a ONE-task lm-eval run with that seed and these lengths, sorted, sees these
    samples (a run of several tasks draws them all from one stream, so its later tasks' samples
    differ); a task's samples here do not depend on the other tasks listed, but do on the
    lengths: RULER draws every length's samples in turn), and restored afterwards."""
    import random

    unknown = [t for t in tasks if t not in OFFLINE_TASKS]
    if unknown:
        raise ConfigError(f"RULER tasks {', '.join(unknown)} do not run offline here; choose among "
                          f"{', '.join(OFFLINE_TASKS)}")
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(metadata={"tokenizer": tokenizer, "max_seq_lengths": sorted(set(lengths))})
    docs: List[Dict[str, Any]] = []
    state = random.getstate()
    try:
        built = []
        for name in tasks:
            random.seed(seed)
            task = get_task_dict([name], manager)[name]
            task.build_all_requests(rank=0, world_size=1)
            built.append((name, task))
    finally:
        random.setstate(state)
    for name, task in built:
        taken: Dict[int, int] = {}
        for inst in task.instances:
            length = int(inst.doc["max_length"])
            i = taken.get(length, 0)
            if length not in lengths or i >= samples:
                continue
            taken[length] = i + 1
            docs.append({"id": f"ruler-{name}-{length}-{i}", "prompt": inst.args[0], "answer": list(inst.doc["outputs"]),
                         "length": length, "variant": name, "sample": i, "depth": None,
                         "ruler_tokens": int(inst.doc["length"])})
    order = {length: n for n, length in enumerate(lengths)}
    return sorted(docs, key=lambda d: (order[d["length"]], d["sample"], tasks.index(d["variant"])))


def score(generation: str, answers: Sequence[str]) -> float:
    """lm-eval's RULER score of one generation: the share of ``answers`` it contains (case-insensitive)."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    return float(string_match_all(postprocess_pred([generation]), [list(answers)]))
