"""``hybridgen-lm-eval --model_args method=full`` against ``lm_eval --model hf``: same task, items, weights.

    python benchmarks/bench_lm_eval_speed.py [--task hg_bigbench_social_iqa] [--limit 20] [--rounds 3]
                                             [--json FILE] [--force]

Both run in this process through ``lm_eval.simple_evaluate`` (so neither pays an import the other
does not), on the same prepared SmolLM2 checkpoint in float32 on the CPU, with the same batch size,
alternating round by round; the times are the medians of the rounds, the spread slowest..fastest.
Prints the ratio (hybridgen / hf: issue 24 asks for <= 1.5) and both accuracies, which must agree
for ``full`` (it is the dense model). A benchmark, not a test: nothing here is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybridgen import runtime  # noqa: E402
from hybridgen.validation.cli import exit_on_existing_output, parse_checked  # noqa: E402


def evaluate(model: str, model_args: str, task: str, limit: int, batch: int) -> tuple:
    """(seconds, the task's metrics) of one lm-eval run."""
    import lm_eval
    from lm_eval.models import huggingface  # noqa: F401  (registers the model 'hf')
    from lm_eval.tasks import TaskManager

    from hybridgen.eval import lm_eval_model  # noqa: F401  (registers the model 'hybridgen')
    from hybridgen.eval.tasks_data import tasks_dir

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit,
                                  batch_size=batch, device="cpu", log_samples=False,
                                  task_manager=TaskManager(include_path=str(tasks_dir())))
    seconds = time.perf_counter() - t0
    metrics = {k: v for k, v in out["results"][task].items() if isinstance(v, (int, float))}
    return seconds, metrics


def main(argv=None) -> int:
    runtime.apply_or_exit()
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="hg_bigbench_social_iqa")
    ap.add_argument("--limit", type=int, default=20, help="items of the task")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    ap.add_argument("--batch", type=int, default=16, help="requests scored together (both models)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    args = parse_checked(ap, argv)
    exit_on_existing_output(args)
    from hybridgen.model.smollm2 import ensure_smollm2

    ckpt = ensure_smollm2()
    runs = {
        "hf": ("hf", f"pretrained={ckpt},dtype=float32"),
        "hybridgen": ("hybridgen", "model=smollm2-135m,method=full,dtype=float32,progress=false"),
    }
    times = {k: [] for k in runs}
    metrics = {}
    for r in range(args.rounds):
        for name, (model, margs) in runs.items():
            s, metrics[name] = evaluate(model, margs, args.task, args.limit, args.batch)
            times[name].append(s)
            print(f"round {r + 1}/{args.rounds} {name:9s} {s:7.1f} s  {metrics[name]}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["hybridgen"] / med["hf"]
    print(f"\n{args.task}, {args.limit} items, batch {args.batch}, {args.rounds} rounds (median, slowest..fastest):")
    for k, v in times.items():
        print(f"  {k:9s} {med[k]:7.1f} s  ({max(v):.1f}..{min(v):.1f})")
    print(f"  ratio hybridgen / hf: {ratio:.2f} (issue 24: <= 1.5)")
    if args.json is not None:
        args.json.write_text(json.dumps({"task": args.task, "limit": args.limit, "batch": args.batch,
                                         "seconds": times, "median_s": med, "ratio": ratio,
                                         "metrics": metrics}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
