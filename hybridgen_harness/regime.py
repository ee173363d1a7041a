"""The paper's regime (issue 23): which cells test the claim, and the verdict drawn from them.

A cell of the paper comparison is *in regime* when the KV cache of ``full`` at that point (every
layer, row and token: :attr:`hybridgen.methods.footprint.KVShape.full_bytes`) is larger than the
GPU's KV budget (``memory.gpu_kv=auto``: GPU memory x gpu_kv_fraction - weights); otherwise it is
*out of regime*: the KV fits the GPU and the cell tests nothing the paper claims.

The verdict per GPU and baseline is the geometric mean of HybridGen's speedup (baseline step /
HybridGen step) over the IN-REGIME cells where both fit, with a band from the performance model's
measured error on the costs that priced the two sides (every committed validation run,
results/perfmodel/**/validation.json: a cost's largest |error| over all of them). A validation
error is e = (predicted - measured) / measured, so a step priced with error e measures
predicted / (1 + e), and the speedup measures ``G (1 + e_h) / (1 + e_b)``; with |e_b| <= E_b and
|e_h| <= E_h it lies in ``[G (1 - E_h) / (1 + E_b), G (1 + E_h) / (1 - E_b)]`` (E_b, E_h: the largest
|error| of the baseline's and HybridGen's cost over those cells; the top is unbounded from E_b = 100%;
no band where a cost is not validated). A model that under-prices HybridGen (e_h < 0) over-states
its speedup: the band's low end is set by HybridGen's error.

Rows here are the dicts of ``results/paper_regime/table.csv`` (experiments/paper_regime.py): keys
``placement, gpu, regime, baseline, speedup, baseline_error_pct, hybridgen_error_pct, bound,
hybridgen_bound, status``.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from hybridgen.errors import ConfigError

IN_REGIME = "in regime"
NOT_VALIDATED = "not validated"
OUT_OF_REGIME = "out of regime"
PAPER_BAND = (1.41, 3.2)


def regime_label(full_kv_bytes: float, gpu_kv_budget_bytes: float) -> str:
    """'in regime' when the KV of ``full`` exceeds the GPU's KV budget, else 'out of regime'."""
    if gpu_kv_budget_bytes is None or gpu_kv_budget_bytes <= 0:
        raise ConfigError(f"regime: the GPU KV budget must be a positive byte count, got {gpu_kv_budget_bytes!r}")
    return IN_REGIME if float(full_kv_bytes) > float(gpu_kv_budget_bytes) else OUT_OF_REGIME


def regime_of_run(hardware: Mapping[str, Any], model: Mapping[str, Any], workload: Mapping[str, Any]) -> Dict[str, Any]:
    """{'regime', 'kv_bytes', 'budget_bytes'} of a run's config nodes (no model is loaded: the shapes
    are the shipped config's; the budget is memory.gpu_kv=auto's, hybridgen.methods.placement)."""
    from hybridgen.methods.placement import budget_and_shape

    budget, shape = budget_and_shape("auto", hardware, model, workload)
    return {"regime": regime_label(shape.full_bytes, budget), "kv_bytes": shape.full_bytes, "budget_bytes": budget}


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive numbers (refused when there are none)."""
    vs = [float(v) for v in values]
    if not vs or any(v <= 0 for v in vs):
        raise ConfigError(f"geomean: needs positive values, got {vs!r}")
    return math.exp(sum(math.log(v) for v in vs) / len(vs))


def error_band(g: float, baseline_error_pct: Optional[float], hybridgen_error_pct: Optional[float]
               ) -> Tuple[Optional[float], Optional[float]]:
    """(low, high) of a speedup ``g`` = baseline step / HybridGen step, both predicted, whose steps
    are each priced within the given |error| (%, e = (predicted - measured) / measured): the range
    of ``g (1 + e_h) / (1 + e_b)`` (see the module docstring); (None, None) when either side's cost
    is not validated."""
    if baseline_error_pct is None or hybridgen_error_pct is None:
        return None, None
    eb, eh = abs(baseline_error_pct) / 100.0, abs(hybridgen_error_pct) / 100.0
    # e >= -100% always (a predicted time is >= 0): the low end is never below 0
    return g * max(0.0, 1 - eh) / (1 + eb), (g * (1 + eh) / (1 - eb) if eb < 1 else math.inf)


@dataclass(frozen=True)
class Verdict:
    """HybridGen against one baseline on one GPU in one placement, from its in-regime cells.

    speedup: geometric mean over the cells where both fit (None: no such cell); low / high: its band
    from the model's error (None: a cost not validated); cells: in-regime cells used; refused: in-regime
    cells where a side does not fit (or cannot run), refused_why their statuses counted ('8x does not fit
    GPU (baseline)'); bound / hybridgen_bound: the resource bounding each
    side most often over the cells used ('-' without cells); unvalidated: cells used whose baseline or
    HybridGen cost has no validation row (any: no band); outcome: 'reproduced' (the band at or above
    the paper's 1.41x), 'refuted' (the band below 1.41x), 'inconclusive' (the band straddles 1.41x),
    'not validated' (no band: the point estimate alone decides nothing, whatever its value) or
    'untested' (no cell)."""

    placement: str
    gpu: str
    baseline: str
    speedup: Optional[float]
    low: Optional[float]
    high: Optional[float]
    cells: int
    refused: int
    refused_why: str
    bound: str
    hybridgen_bound: str
    outcome: str
    unvalidated: int = 0


def _num(x: Any) -> Optional[float]:
    if x is None or x == "":
        return None
    v = float(x)
    return None if math.isnan(v) else v


def _most_common(values: Sequence[Any]) -> str:
    vs = [str(v) for v in values if v not in (None, "")]
    return Counter(vs).most_common(1)[0][0] if vs else "-"


def outcome_of(speedup: Optional[float], low: Optional[float], high: Optional[float]) -> str:
    """'reproduced' / 'refuted' / 'inconclusive' / 'not validated' / 'untested' (see :class:`Verdict`)."""
    if speedup is None:
        return "untested"
    if low is None:  # the model's error on a side is unknown: a point estimate is no verdict
        return NOT_VALIDATED
    if low >= PAPER_BAND[0]:
        return "reproduced"
    if high < PAPER_BAND[0]:
        return "refuted"
    return "inconclusive"


def in_regime_cells(rows: Sequence[Mapping[str, Any]], placement: str, gpu: str, baseline: str
                    ) -> Tuple[List[Mapping[str, Any]], List[Mapping[str, Any]]]:
    """(the IN-REGIME rows of ``baseline`` on ``gpu`` in ``placement``, those of them where both sides
    fit: the cells a verdict uses)."""
    cells = [r for r in rows if r["placement"] == placement and r["gpu"] == gpu and r["baseline"] == baseline
             and r["regime"] == IN_REGIME]
    return cells, [r for r in cells if _num(r.get("speedup")) is not None]


def verdict(rows: Sequence[Mapping[str, Any]], placement: str, gpu: str, baseline: str) -> Verdict:
    """The :class:`Verdict` of ``baseline`` on ``gpu`` in ``placement`` from the IN-REGIME rows only."""
    cells, used = in_regime_cells(rows, placement, gpu, baseline)
    why = "; ".join(f"{n}x {s}" for s, n in sorted(Counter(str(r.get("status")) for r in cells
                                                            if _num(r.get("speedup")) is None).items()))
    if not used:
        return Verdict(placement, gpu, baseline, None, None, None, 0, len(cells), why, "-", "-", "untested")
    g = geomean(_num(r["speedup"]) for r in used)
    eb = [_num(r.get("baseline_error_pct")) for r in used]
    eh = [_num(r.get("hybridgen_error_pct")) for r in used]
    lo, hi = error_band(g, None if None in eb else max(map(abs, eb)), None if None in eh else max(map(abs, eh)))
    unvalidated = sum(1 for b, h in zip(eb, eh) if b is None or h is None)
    return Verdict(placement, gpu, baseline, g, lo, hi, len(used), len(cells) - len(used), why,
                   _most_common([r.get("bound") for r in used]), _most_common([r.get("hybridgen_bound") for r in used]),
                   outcome_of(g, lo, hi), unvalidated)


def verdicts(rows: Sequence[Mapping[str, Any]], placements: Sequence[str], gpus: Sequence[str],
             baselines: Sequence[str]) -> List[Verdict]:
    """:func:`verdict` for every (placement, gpu, baseline), in that order."""
    return [verdict(rows, p, g, b) for p in placements for g in gpus for b in baselines]


def band_text(v: Verdict) -> str:
    """'2.13x [1.80-2.52]' / '2.13x (model error not validated in 2 of 12 cells)' / 'no cell where both fit'."""
    if v.speedup is None:
        return "no in-regime cell where both fit"
    if v.low is None:
        return f"{v.speedup:.2f}x (model error not validated in {v.unvalidated} of {v.cells} cells)"
    return f"{v.speedup:.2f}x [{v.low:.2f}-{v.high:.2f}]"
