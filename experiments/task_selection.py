"""``python experiments/task_selection.py --results-dir DIR [--exp accuracy]``: which accuracy tasks can tell methods apart.

For every multiple-choice task in the finished runs of ``+exp=<exp>`` under ``DIR`` (their
``samples.jsonl``): chance (the mean of 1 / number of choices over the items), the reference
method's score (``full``'s acc_norm) with its exact 95% binomial interval
(``scipy.stats.binomtest``), whether that interval lies above chance (a task where ``full`` sits
at chance cannot rank methods), and how many items a paired comparison needs for a true
difference of ``--delta`` (0.02) to come out significant at 95% with 80% power
(:func:`hybridgen.eval.paired.items_to_decide`, from the per-item differences of every other method
run on that task: the median and the largest over methods). Writes ``task_selection.md`` next to
the runs and prints it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hybridgen.errors import ConfigError, cli_errors  # noqa: E402
from hybridgen.eval import paired  # noqa: E402

Item = Tuple[str, int]


def load_runs(root: Path) -> Tuple[Dict[str, Dict[Item, float]], Dict[Item, int]]:
    """({method label: {item: score}}, {item: number of choices}) of the runs under ``root``
    (label: the method's name, with its parameters when two runs share a name)."""
    runs: Dict[str, Dict[Item, float]] = {}
    choices: Dict[Item, int] = {}
    for samples in sorted(root.glob("*/samples.jsonl")):
        metrics = json.loads((samples.parent / "metrics.json").read_text())
        method = metrics["method"]
        label = method["name"]
        if label in runs:
            label += " " + json.dumps(method.get("params") or {}, sort_keys=True)
        runs[label] = paired.item_scores(samples)
        choices.update(paired.item_choices(samples))
    return runs, choices


def selection(runs: Dict[str, Dict[Item, float]], choices: Dict[Item, int], reference: str = "full",
              delta: float = 0.02) -> List[Dict[str, object]]:
    """One row per multiple-choice task (see the module docstring)."""
    from scipy import stats

    if reference not in runs:
        raise ConfigError(f"no {reference!r} run among {', '.join(runs) or 'no runs'}; run it first")
    ref = runs[reference]
    out = []
    for task in sorted({t for t, _ in choices}):
        items = sorted(k for k in ref if k[0] == task and k in choices)
        if not items:
            continue
        k = int(round(sum(ref[i] for i in items)))
        ci = stats.binomtest(k, len(items)).proportion_ci(confidence_level=paired.LEVEL, method="exact")
        chance = statistics.fmean(1.0 / choices[i] for i in items)
        diffs = [[scores[i] - ref[i] for i in items if i in scores] for label, scores in runs.items()
                 if label != reference and any(i in scores for i in items)]
        needs = [n for d in diffs for n in [paired.items_to_decide(d, delta)] if n is not None]
        out.append({"task": task, "items": len(items), "chance": chance, "score": k / len(items),
                    "low": ci.low, "high": ci.high, "above_chance": ci.low > chance,
                    "compared": len(diffs), "methods": len(needs), "needed_median": int(statistics.median(needs)) if needs else None,
                    "needed_max": max(needs) if needs else None})
    return out


def markdown(rows: List[Dict[str, object]], reference: str, delta: float) -> str:
    lines = [f"| task | items | chance | `{reference}` acc_norm [95% CI] | above chance | items to decide a {delta:g} "
             "difference (median / largest over methods) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["needed_median"] is not None:
            need = f"{r['needed_median']:,} / {r['needed_max']:,} ({r['methods']} methods that differ on some item)"
        elif r["compared"]:
            need = f"undetermined: the {r['compared']} other methods agree with `{reference}` on every item"
        else:
            need = "no other method run"
        lines.append(f"| {r['task']} | {r['items']} | {r['chance']:.3f} | {r['score']:.3f} [{r['low']:.3f}, "
                     f"{r['high']:.3f}] | {'yes' if r['above_chance'] else '**no**'} | {need} |")
    return "\n".join(lines) + "\n"


@cli_errors
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--results-dir", default="outputs")
    p.add_argument("--exp", default="accuracy")
    p.add_argument("--reference", default="full")
    p.add_argument("--delta", type=float, default=0.02)
    args = p.parse_args(argv)
    if not 0 < args.delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {args.delta}")
    root = Path(args.results_dir) / args.exp
    runs, choices = load_runs(root)
    if not runs:
        raise ConfigError(f"no finished runs with samples.jsonl under {root}; run: python experiments/run.py "
                          f"+exp={args.exp} results_dir={args.results_dir}")
    md = markdown(selection(runs, choices, args.reference, args.delta), args.reference, args.delta)
    (root / "task_selection.md").write_text(
        f"# Tasks that can tell methods apart\n\nMade by `python experiments/task_selection.py --results-dir "
        f"{args.results_dir} --exp {args.exp}` from {len(runs)} runs ({', '.join(sorted(runs))}).\n\n" + md)
    print(md)


if __name__ == "__main__":
    main()
