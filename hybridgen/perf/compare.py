"""Prediction error: projected vs measured times, per key (``compare_to_measured``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Tuple, Union

from hybridgen.perf.predict import StepPrediction


@dataclass(frozen=True)
class ErrorRow:
    """One key's projected and measured seconds."""

    key: str
    predicted_s: float
    measured_s: float

    @property
    def error_pct(self) -> float:
        """(predicted - measured) / measured, in percent (positive: the model is pessimistic)."""
        return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s else float("nan")


@dataclass(frozen=True)
class ErrorTable:
    """Projected vs measured times. missing: keys present on one side only."""

    rows: Tuple[ErrorRow, ...]
    missing: Tuple[str, ...]
    field: str

    @property
    def mean_abs_error_pct(self) -> float:
        errs = [abs(r.error_pct) for r in self.rows if math.isfinite(r.error_pct)]
        return sum(errs) / len(errs) if errs else float("nan")

    def to_markdown(self) -> str:
        lines = [f"| key | projected {self.field} (ms) | measured (ms) | error |", "|---|---:|---:|---:|"]
        for r in self.rows:
            lines.append(f"| {r.key} | {r.predicted_s * 1e3:.3f} | {r.measured_s * 1e3:.3f} | {r.error_pct:+.1f}% |")
        lines.append(f"| mean absolute error | | | {self.mean_abs_error_pct:.1f}% |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"prediction error (projected vs measured, {self.field})\n" + self.to_markdown()


def compare_to_measured(predictions: Mapping[str, Union[StepPrediction, float]], measurements: Mapping[str, float],
                        field: str = "attention_layer_s") -> ErrorTable:
    """Prediction error per key present in both mappings (seconds).

    predictions: key -> StepPrediction (its ``field`` is compared) or a float; measurements:
    key -> measured seconds (None or non-finite values are treated as missing).
    """
    rows, missing = [], []
    for key in sorted(set(predictions) | set(measurements), key=str):
        pred, meas = predictions.get(key), measurements.get(key)
        if isinstance(pred, StepPrediction):
            pred = getattr(pred, field)
        if pred is None or meas is None or not math.isfinite(float(meas)) or not math.isfinite(float(pred)):
            missing.append(str(key))
            continue
        rows.append(ErrorRow(str(key), float(pred), float(meas)))
    return ErrorTable(tuple(rows), tuple(missing), field)
