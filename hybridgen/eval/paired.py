"""Accuracy with its uncertainty: standard errors and paired comparisons against a reference method.

Every method is scored on the same items (lm-eval's ``samples.jsonl`` of each run), so the
difference to the reference is measured item by item: d_i = score_i(method) - score_i(ref).
The 95% interval of the mean difference is a paired bootstrap over items (percentile method,
``n_boot`` resamples, seeded), which is far tighter than two separate error bars because most
items are answered identically (with no discordant item at all the interval is the "rule of
three" bound +-3/n on the rate of discordant items). A method is *within* ``margin`` of the reference when the
whole interval lies inside [-margin, +margin], *outside* when the whole interval lies beyond
it, and *undecided* otherwise (more items would decide it).

Per-item scores: the task's headline metric (``acc_norm`` for multiple choice, ``exact_match``
for the needle task); tasks without a per-item 0/1 score (rolling perplexity) are skipped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

HEADLINE = ("acc_norm", "exact_match", "acc")
Item = Tuple[str, int]  # (task, doc_id)


def item_scores(samples: Path) -> Dict[Item, float]:
    """{(task, doc_id): headline score} of one run's ``samples.jsonl`` (tasks without one are left out)."""
    out: Dict[Item, float] = {}
    with open(samples) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            metric = next((m for m in HEADLINE if isinstance(row.get(m), (int, float))), None)
            if metric is not None:
                out[(row["task"], int(row["doc_id"]))] = float(row[metric])
    return out


@dataclass(frozen=True)
class Comparison:
    """One (method, task) against the reference on the items both were scored on.

    score / stderr: the method's mean and its binomial standard error sqrt(p(1-p)/n);
    delta: mean paired difference to the reference; lo, hi: its 95% bootstrap interval;
    verdict: 'within' | 'outside' | 'undecided' for |delta| <= margin; n: items.
    """

    method: str
    task: str
    n: int
    score: float
    stderr: float
    delta: float
    lo: float
    hi: float
    verdict: str


def paired_interval(diff: Sequence[float], n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> Tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``diff`` (resampling items with replacement)."""
    d = np.asarray(diff, dtype=np.float64)
    if d.size == 0:
        return float("nan"), float("nan")
    if np.all(d == 0):
        # no discordant item: the bootstrap would say [0, 0]; the 95% upper bound on the rate of
        # discordant items is about 3/n ("rule of three"), and |mean difference| <= that rate
        bound = min(1.0, 3.0 / d.size)
        return -bound, bound
    if np.all(d == d[0]):
        return float(d[0]), float(d[0])
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    tail = (1.0 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def verdict(lo: float, hi: float, margin: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undecided"
    if -margin <= lo and hi <= margin:
        return "within"
    if hi < -margin or lo > margin:
        return "outside"
    return "undecided"


def compare(runs: Mapping[str, Mapping[Item, float]], reference: str, margin: float = 0.02,
            n_boot: int = 10000, seed: int = 0) -> List[Comparison]:
    """Every (method, task) of ``runs`` ({label: item scores}) against ``runs[reference]``."""
    if reference not in runs:
        raise KeyError(f"no run labelled {reference!r} to compare against; have: {', '.join(runs)}")
    ref = runs[reference]
    tasks = sorted({t for scores in runs.values() for t, _ in scores})
    out: List[Comparison] = []
    for label, scores in runs.items():
        for task in tasks:
            items = sorted(k for k in scores if k[0] == task and k in ref)
            if not items:
                continue
            m = np.array([scores[k] for k in items])
            r = np.array([ref[k] for k in items])
            p = float(m.mean())
            lo, hi = paired_interval(m - r, n_boot=n_boot, seed=seed)
            out.append(Comparison(label, task, len(items), p, math.sqrt(max(p * (1 - p), 0.0) / len(items)),
                                  float((m - r).mean()), lo, hi, verdict(lo, hi, margin)))
    return out


def markdown(rows: Iterable[Comparison], reference: str, margin: float = 0.02,
             order: Optional[Sequence[str]] = None) -> str:
    """A table: per method and task, 'score ± se' and 'Δ [lo, hi] verdict' against ``reference``."""
    rows = list(rows)
    tasks = sorted({r.task for r in rows})
    methods = list(dict.fromkeys(order or [])) + [m for m in dict.fromkeys(r.method for r in rows)
                                                 if m not in (order or [])]
    by = {(r.method, r.task): r for r in rows}
    head = ["method"] + [f"{t} (n)" for t in tasks] + [f"Δ{t} vs {reference} [95% CI]" for t in tasks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells = [m]
        for t in tasks:
            r = by.get((m, t))
            cells.append("" if r is None else f"{r.score:.3f} ± {r.stderr:.3f} ({r.n})")
        for t in tasks:
            r = by.get((m, t))
            cells.append("" if r is None or m == reference else
                         f"{r.delta:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}] {r.verdict}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"± is one binomial standard error; Δ is the mean paired difference to `{reference}` over the same "
              f"items with its 95% paired-bootstrap interval; **within** = the whole interval is inside "
              f"±{margin:g}, **outside** = entirely beyond it, **undecided** = more items are needed to tell."]
    return "\n".join(lines)
