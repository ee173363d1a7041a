"""Accuracy of one (model, method) through lm-eval, for the experiment runner (harness side: takes a Hydra config).

Runs ``lm_eval.simple_evaluate`` with :class:`HybridGenLM` over the configured tasks (local
ones from hybridgen/eval/tasks, or hub tasks for users with a network), and returns:

    accuracy   {task: {metric: value, metric_stderr: value}}   (lm-eval's numbers, 'none' filter
               or the task's named filter stripped from the key)
    fidelity   top-1 agreement / mean KL of every decode-scored token vs the dense pass (= full)
    needle     [{length, depth, score, n}] per cell of hg_needle (for the heatmap)
    lm_eval    versions, task configs' hashes, n-samples per task; samples.jsonl in the run dir
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List

from omegaconf import DictConfig, OmegaConf

from hybridgen.errors import MissingDataError


def _metrics(task_res: Dict[str, Any]) -> Dict[str, Any]:
    """A task's metrics from lm-eval's results ({"metric,filter": value}); a RULER task's score
    per context length ("4096,none") keeps only the lengths run (lm-eval reports -1 for the
    others, which is not a score)."""
    out: Dict[str, Any] = {}
    for key, val in task_res.items():
        if key == "alias" or "," not in key:
            continue
        metric, _filt = key.split(",", 1)
        if metric.isdigit() and val == -1:
            continue
        if isinstance(val, (int, float)) or val is None:
            out[metric] = None if val == "N/A" else val
    return out


def lm_for(engine, cfg: DictConfig):
    """The lm-eval model for this run's method and accuracy settings."""
    from hybridgen.eval.lm_eval_model import HybridGenLM

    a = cfg.exp.accuracy
    params = OmegaConf.to_container(cfg.method.params, resolve=True) or {}
    return HybridGenLM(engine=engine, method=cfg.method.name, score_mode=a.score_mode, max_length=a.max_length,
                       rolling_prefill=a.rolling_prefill, fidelity=bool(a.fidelity), max_gen_toks=a.max_gen_toks,
                       progress=bool(cfg.progress), **params)


def task_metadata(engine, cfg: DictConfig) -> Dict[str, Any]:
    a = cfg.exp.accuracy
    tok_path = getattr(engine.tokenizer, "name_or_path", None)
    meta = {"tokenizer": tok_path, "needle_lengths": list(a.needle_lengths), "needle_depths": list(a.needle_depths),
            "needle_samples": int(a.needle_samples), "needle_seed": int(cfg.seed),
            "max_seq_lengths": list(a.ruler_lengths)}
    if a.ppl_max_docs:
        meta["ppl_max_docs"] = int(a.ppl_max_docs)
    return meta


def evaluate(engine, cfg: DictConfig, out_dir: Path, log: Callable[[str], None] = print) -> Dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hybridgen.eval.tasks_data import needle_cells, tasks_dir

    a = cfg.exp.accuracy
    lm = lm_for(engine, cfg)
    tm = TaskManager(include_path=str(tasks_dir()), metadata=task_metadata(engine, cfg))
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=list(a.tasks), num_fewshot=int(a.num_fewshot),
                                      limit=a.limit, task_manager=tm, log_samples=bool(a.log_samples),
                                      bootstrap_iters=1000, random_seed=int(cfg.seed),
                                      numpy_random_seed=int(cfg.seed), torch_random_seed=int(cfg.seed),
                                      fewshot_random_seed=int(cfg.seed))
    except MissingDataError:
        raise
    except Exception as err:
        from hybridgen.eval.lm_eval_errors import explain

        known = explain(err)  # ours in the cause chain, an unknown task, hub-only data while offline
        if known is not None:
            raise known from None
        raise
    accuracy = {task: _metrics(vals) for task, vals in res["results"].items()}
    samples = res.get("samples") or {}
    needle: List[Dict[str, Any]] = []
    if samples:
        with open(out_dir / "samples.jsonl", "w") as fh:
            for task, items in samples.items():
                for s in items:
                    doc = {k: v for k, v in s.get("doc", {}).items() if k not in ("prompt", "text", "query", "input")}
                    row = {"task": task, "doc_id": s.get("doc_id"), "doc": doc, "target": s.get("target"),
                           "filtered_resps": s.get("filtered_resps"),
                           **{k: s[k] for k in ("acc", "acc_norm", "exact_match") if k in s}}
                    fh.write(json.dumps(row, default=str) + "\n")
        if "hg_needle" in samples:
            needle = needle_cells(samples["hg_needle"])
    return {
        "accuracy": accuracy,
        "fidelity": lm.fidelity_summary if a.fidelity else None,
        "needle": needle,
        "lm_eval": {"version": lm_eval.__version__, "n_samples": res.get("n-samples"),
                    "requests": lm.requests_scored, "tasks": list(a.tasks), "limit": a.limit,
                    "num_fewshot": int(a.num_fewshot), "score_mode": a.score_mode},
        "model": {**OmegaConf.to_container(cfg.model), "spec": engine.spec.to_dict()},
    }
