"""Accuracy with its uncertainty: standard errors and paired comparisons against a reference method.

Every method is scored on the same items (lm-eval's ``samples.jsonl`` of each run), so the
difference to the reference is measured item by item: d_i = score_i(method) - score_i(ref).
The 95% interval of the mean difference is a paired bootstrap over items
(``scipy.stats.bootstrap(..., paired=True)``, percentile method, ``n_boot`` resamples, seeded),
which is far tighter than two separate error bars because most items are answered identically
(with no discordant item at all the bootstrap has nothing to resample, and the interval is the
"rule of three" bound +-3/n on the rate of discordant items).

Two separate readings of that interval, in standard wording:

* **significant**: the interval excludes zero (the method differs from the reference);
* **equivalent within ±margin**: *yes* when the whole interval lies inside [-margin, +margin],
  *no* when it lies entirely beyond it, *undecided* otherwise (more items would decide it).

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
LEVEL = 0.95
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


def item_choices(samples: Path) -> Dict[Item, int]:
    """{(task, doc_id): number of answer choices} of one run's ``samples.jsonl`` (multiple-choice
    items only); chance on a task is the mean of 1 / choices over its items."""
    out: Dict[Item, int] = {}
    with open(samples) as fh:
        for line in fh:
            row = json.loads(line) if line.strip() else {}
            n = len((row.get("doc") or {}).get("choices") or [])
            if n:
                out[(row["task"], int(row["doc_id"]))] = n
    return out


@dataclass(frozen=True)
class Comparison:
    """One (method, task) against the reference on the items both were scored on.

    score / stderr: the method's mean and its binomial standard error sqrt(p(1-p)/n);
    delta: mean paired difference to the reference; lo, hi: its 95% bootstrap interval;
    significant: the interval excludes 0; equivalent: 'yes' | 'no' | 'undecided' for
    |delta| <= margin (see the module docstring); n: items.
    """

    method: str
    task: str
    n: int
    score: float
    stderr: float
    delta: float
    lo: float
    hi: float
    significant: bool
    equivalent: str


def paired_interval(method: Sequence[float], reference: Sequence[float], n_boot: int = 10000, seed: int = 0,
                    level: float = LEVEL) -> Tuple[float, float]:
    """Paired percentile-bootstrap interval of mean(method - reference), items resampled together.

    method, reference: (n,) per-item scores on the same items, in the same order.
    """
    from scipy import stats

    m = np.asarray(method, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if m.shape != r.shape:
        raise ValueError(f"paired scores need the same items: method has {m.shape}, reference {r.shape}")
    d = m - r
    if d.size == 0:
        return float("nan"), float("nan")
    if np.all(d == 0):
        # no discordant item: the bootstrap would say [0, 0]; the 95% upper bound on the rate of
        # discordant items is about 3/n ("rule of three"), and |mean difference| <= that rate
        bound = min(1.0, 3.0 / d.size)
        return -bound, bound
    if np.all(d == d[0]):
        return float(d[0]), float(d[0])
    res = stats.bootstrap((m, r), lambda a, b, axis: np.mean(a - b, axis=axis), paired=True, vectorized=True,
                          n_resamples=n_boot, confidence_level=level, method="percentile",
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def significant(lo: float, hi: float) -> bool:
    """The interval [lo, hi] excludes zero."""
    return math.isfinite(lo) and math.isfinite(hi) and (hi < 0 or lo > 0)


def equivalent(lo: float, hi: float, margin: float) -> str:
    """'yes' (inside ±margin), 'no' (entirely beyond it) or 'undecided' for the interval [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undecided"
    if -margin <= lo and hi <= margin:
        return "yes"
    if hi < -margin or lo > margin:
        return "no"
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
            lo, hi = paired_interval(m, r, n_boot=n_boot, seed=seed)
            out.append(Comparison(label, task, len(items), p, math.sqrt(max(p * (1 - p), 0.0) / len(items)),
                                  float((m - r).mean()), lo, hi, significant(lo, hi), equivalent(lo, hi, margin)))
    return out


def delta_cell(r: Comparison) -> str:
    """'Δ [lo, hi]', with 'significant' appended when the interval excludes zero."""
    return f"{r.delta:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}]" + (" significant" if r.significant else "")


def markdown(rows: Iterable[Comparison], reference: str, margin: float = 0.02,
             order: Optional[Sequence[str]] = None) -> str:
    """A table: per method and task, 'score ± se (n)', 'Δ [lo, hi]' (+ 'significant') against
    ``reference``, and the separate 'equivalent within ±margin' verdict."""
    import pandas as pd

    rows = list(rows)
    tasks = sorted({r.task for r in rows})
    methods = list(dict.fromkeys(order or [])) + [m for m in dict.fromkeys(r.method for r in rows)
                                                 if m not in (order or [])]
    by = {(r.method, r.task): r for r in rows}
    table: Dict[str, List[str]] = {"method": methods}
    for t in tasks:
        table[f"{t} (n)"] = ["" if (r := by.get((m, t))) is None else f"{r.score:.3f} ± {r.stderr:.3f} ({r.n})"
                             for m in methods]
    for t in tasks:
        table[f"Δ{t} vs {reference} [{LEVEL:.0%} CI]"] = [
            "" if (r := by.get((m, t))) is None or m == reference else delta_cell(r) for m in methods]
    for t in tasks:
        table[f"{t}: equivalent within ±{margin:g}"] = [
            "" if (r := by.get((m, t))) is None or m == reference else r.equivalent for m in methods]
    md = pd.DataFrame(table).to_markdown(index=False, tablefmt="github", disable_numparse=True)
    return md + (f"\n\n± is one binomial standard error; Δ is the mean paired difference to `{reference}` over the "
                 f"same items with its {LEVEL:.0%} paired-bootstrap interval (scipy.stats.bootstrap, paired, "
                 f"percentile); **significant** = the interval excludes zero. **equivalent within ±{margin:g}** "
                 f"(a separate test): *yes* = the whole interval is inside ±{margin:g}, *no* = entirely beyond it, "
                 f"*undecided* = more items are needed to tell.")


def items_to_decide(differences: Sequence[float], delta: float = 0.02, level: float = LEVEL,
                    power: float = 0.8) -> Optional[int]:
    """Items a paired comparison needs for a true mean difference of ``delta`` to come out significant
    (two-sided, ``level``) with probability ``power``: n = (z_{(1+level)/2} + z_power)^2 var(d) / delta^2
    (normal approximation), var(d) estimated from observed per-item differences d (method - reference,
    shape (n,)). None when every observed difference is zero (no variance to scale from)."""
    from scipy import stats

    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2 or not np.any(d != d[0]):
        return None
    z = stats.norm.ppf((1 + level) / 2) + stats.norm.ppf(power)
    return int(math.ceil(z * z * float(d.var(ddof=1)) / (delta * delta)))
