"""Accuracy next to speed in the paper's regime: each in-regime cell's methods, at the configuration
their placement gives them there, joined to the fidelity to ``full`` measured on a real model.

The regime table (results/paper_regime/table.csv) is PROJECTED on models that do not run here
(Llama-3.1-8B, Qwen2.5-14B, OPT at 8K-1M tokens). Accuracy is measured on the longest context a real
model reaches on this machine (SmolLM2-135M at 8K, ``benchmarks/bench_baselines.py``: 128 decode
steps teacher-forced with ``full``'s tokens; top-1 agreement and mean KL(full || method)), for each
configuration the regime's cells use, at the knob values their speed was priced at (the table's
``priced`` / ``hybridgen_priced``, :meth:`hybridgen.methods.KVMethod.priced_knobs`: HybridGen's
scheduler-owned top-k and streamed fraction where its model's scheduler settles). A cell's
configuration is matched to a measured one by its ``output_config`` (:meth:`hybridgen.methods.KVMethod.output_config`: the parameters its tokens
depend on, placement parameters left out and tested to change nothing), so H2O offloaded and H2O
resident share one measurement; HybridGen's ``gpu_budget`` (a share of the context in the regime
cell), streamed fraction and top-k ratio are matched to the largest measured values at or below the
cell's (:data:`BELOW_PARAMS`): the measurement is of a configuration with no more exact attention
than the cell's (the conservative side).

Rows in: ``table.csv``'s dicts (placement, gpu, regime, baseline, run_preset, context, params,
hybridgen_params, speedup). Measured rows: the bench's CSV (method label, params, top1_agreement,
mean_kl, context, model).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hybridgen.errors import ConfigError
from hybridgen_harness import regime as rg

# matched at or below the cell's value (gpu_budget as a share of the context); every other parameter exactly
BELOW_PARAMS = ("gpu_budget", "stream_ratio", "topk_ratio")


@dataclass(frozen=True)
class Fidelity:
    """One measured configuration: registry ``method``, its ``output_config``, top-1 agreement and mean
    KL (nats) vs ``full`` over ``positions`` decode positions, on ``model`` at ``context`` tokens."""

    label: str
    method: str
    output_config: Tuple[Tuple[str, str], ...]
    top1: float
    mean_kl: float
    model: str
    context: int
    scheduled: bool = False  # a knob moved with the measuring machine's timings: matches no cell

    def below_values(self) -> Dict[str, float]:
        """The numeric :data:`BELOW_PARAMS` (gpu_budget as a share of the context)."""
        return _below_values(dict(self.output_config), self.context)


def registry_of(label: str) -> str:
    """The registered method a preset or bench label names: the label itself, or the longest
    registered name it starts with ('flexgen-int4' -> 'flexgen', 'h2o-offload' -> 'h2o',
    'hybridgen:gpu_budget=0.07' -> 'hybridgen')."""
    from hybridgen.methods import available_methods

    head = label.split(":", 1)[0]
    names = available_methods()
    if head in names:
        return head
    prefixes = [n for n in names if head.startswith(n + "-")]
    if not prefixes:
        raise ConfigError(f"{label!r} names no registered method ({', '.join(names)})")
    return max(prefixes, key=len)


def output_key(method: str, params: Mapping[str, Any]) -> Tuple[Tuple[str, str], ...]:
    """The output configuration of ``method`` built with ``params``, as a sorted hashable tuple."""
    from hybridgen.methods import build_method

    return tuple(sorted((k, str(v)) for k, v in build_method(method, **dict(params)).output_config().items()))


def _scheduled(method: str, params: Mapping[str, Any]) -> bool:
    from hybridgen.methods import build_method

    return bool(build_method(method, **dict(params)).scheduled_params())


def _share(value: str, context: int) -> float:
    """A budget string ('0.07' of the context, or '9222t' tokens) as a share of ``context``."""
    value = str(value)
    return int(value[:-1]) / context if value.endswith("t") else float(value)


def load_fidelity(path: Path) -> List[Fidelity]:
    """The measured rows of one bench_baselines CSV (comment lines skipped)."""
    with open(path) as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    out = []
    for r in rows:
        method = r.get("registry") or registry_of(r["method"])
        params = json.loads(r["params"])
        out.append(Fidelity(r["method"], method, output_key(method, params), float(r["top1_agreement"]),
                            float(r["mean_kl"]), r["model"], int(r["context"]), _scheduled(method, params)))
    return out


def _below_values(cfg: Mapping[str, str], context: int) -> Dict[str, float]:
    out = {}
    for k in BELOW_PARAMS:
        try:
            out[k] = _share(cfg[k], context) if k == "gpu_budget" else float(cfg[k])
        except (KeyError, TypeError, ValueError):
            continue  # absent, or None (e.g. no stream without three-way): compared exactly
    return out


def match(method: str, params: Mapping[str, Any], context: int, measured: Sequence[Fidelity],
          priced: Optional[Mapping[str, Any]] = None) -> Optional[Fidelity]:
    """The measured configuration of ``method`` with ``params`` in a cell of ``context`` tokens (module doc):
    the cell's PRICED configuration (``params`` with its scheduler-owned knobs at the values ``priced``
    names) against each measurement's output configuration: the same one, else the largest measured
    numeric :data:`BELOW_PARAMS` all at or below the cell's, every other parameter equal. A measurement
    whose knobs moved with its machine's timings (``Fidelity.scheduled``) matches no cell."""
    key = dict(output_key(method, {**params, **dict(priced or {})}))
    pool = [m for m in measured if m.method == method and not m.scheduled]
    same = [m for m in pool if dict(m.output_config) == key]
    if same:
        return same[0]
    want = _below_values(key, context)
    rest = {k: v for k, v in key.items() if k not in want}
    below = [m for m in pool if set(m.below_values()) == set(want)
             and all(m.below_values()[k] <= want[k] + 1e-9 for k in want)
             and {k: v for k, v in m.output_config if k not in want} == rest]
    return max(below, key=lambda m: tuple(m.below_values()[k] for k in BELOW_PARAMS if k in want)) if below else None


@dataclass(frozen=True)
class AccuracyRow:
    """One (placement, gpu, baseline) group of in-regime cells: the verdict's speedup next to both sides'
    fidelity (None: a cell's configuration not measured)."""

    placement: str
    gpu: str
    baseline: str
    speedup: Optional[float]
    cells: int
    baseline_fid: List[Optional[Fidelity]]
    hybridgen_fid: List[Optional[Fidelity]]


def accuracy_rows(rows: Sequence[Mapping[str, Any]], measured: Sequence[Fidelity], placements: Sequence[str],
                  gpus: Sequence[str], baselines: Sequence[str]) -> List[AccuracyRow]:
    """Per (placement, gpu, baseline): the verdict's geometric-mean speedup and, for every in-regime cell
    where both fit, the measured fidelity of the baseline's and HybridGen's configuration there."""
    out = []
    for v in rg.verdicts(rows, placements, gpus, baselines):
        used = rg.in_regime_cells(rows, v.placement, v.gpu, v.baseline)[1]
        base, hg = [], []
        for r in used:
            ctx = int(r["context"])
            base.append(match(registry_of(r["run_preset"]), json.loads(r["params"]), ctx, measured,
                              json.loads(r.get("priced") or "{}")))
            hg.append(match("hybridgen", json.loads(r["hybridgen_params"]), ctx, measured,
                            json.loads(r.get("hybridgen_priced") or "{}")))
        out.append(AccuracyRow(v.placement, v.gpu, v.baseline, v.speedup, len(used), base, hg))
    return out


def _fid_text(fids: Sequence[Optional[Fidelity]]) -> str:
    """'0.992 / 0.0014' (top-1 / mean KL), a range over cells measured at different configurations,
    or 'not measured (n cells)'."""
    got = [f for f in fids if f is not None]
    missing = len(fids) - len(got)
    if not got:
        return "not measured" if fids else "-"
    t1, kl = [f.top1 for f in got], [f.mean_kl for f in got]
    span = lambda xs, fmt: fmt.format(min(xs)) + ("" if min(xs) == max(xs) else "-" + fmt.format(max(xs)))  # noqa: E731
    text = f"{span(t1, '{:.3f}')} / {span(kl, '{:.2g}')}"
    return text + (f" ({missing} cells not measured)" if missing else "")


def accuracy_markdown(acc: Sequence[AccuracyRow], labels: Mapping[str, str], gpu_titles: Mapping[str, str],
                      source: str) -> str:
    """Two tables: per baseline, its measured fidelity next to HybridGen's projected speedup over it on
    each (placement, GPU); per (placement, GPU), HybridGen's measured fidelity in those cells."""
    models = sorted({f"{f.model} at {f.context} tokens" for a in acc for f in a.baseline_fid + a.hybridgen_fid if f})
    placements = list(dict.fromkeys(a.placement for a in acc))
    gpus = list(dict.fromkeys(a.gpu for a in acc))
    by = {(a.placement, a.gpu, a.baseline): a for a in acc}
    titles = [gpu_titles.get(g, g) for g in gpus]
    lines = [f"In-regime cells only. Speed: the verdict's PROJECTED geometric-mean speedup of HybridGen (default) "
             f"over the baseline (n cells). Accuracy: MEASURED fidelity to `full` (top-1 agreement / mean KL in nats, "
             f"127 teacher-forced decode positions) of the configuration each side runs with in those cells, on "
             f"{', '.join(models) or 'no measured model'} ({source}); a range where the cells' configurations "
             f"differ.", "",
             "| baseline | baseline top-1 / KL | " + " | ".join(f"speedup, {p}: {t}" for p in placements for t in titles)
             + " |", "|---|---|" + "---|" * (len(placements) * len(gpus))]
    for base in dict.fromkeys(a.baseline for a in acc):
        fids = [f for a in acc if a.baseline == base for f in a.baseline_fid]
        cells = [by.get((p, g, base)) for p in placements for g in gpus]
        lines.append(f"| {labels.get(base, base)} | {_fid_text(fids)} | " + " | ".join(
            "-" if c is None or c.speedup is None else f"{c.speedup:.2f}x (n={c.cells})" for c in cells) + " |")
    lines += ["", "| HybridGen (default), top-1 / KL | " + " | ".join(titles) + " |", "|---|" + "---|" * len(gpus)]
    for p in placements:
        lines.append(f"| placement {p} | " + " | ".join(
            _fid_text([f for a in acc if (a.placement, a.gpu) == (p, g) for f in a.hybridgen_fid]) for g in gpus) + " |")
    return "\n".join(lines) + "\n"


def find_measured(directory: Path) -> List[Fidelity]:
    """Every measured row of the bench CSVs in ``directory`` (empty when there is none)."""
    if not directory.is_dir():
        return []
    return [f for path in sorted(directory.rglob("*.csv")) for f in load_fidelity(path) if not math.isnan(f.top1)]
