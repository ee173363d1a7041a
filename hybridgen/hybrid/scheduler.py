"""Feedback-driven scheduler: keep HybridGen's CPU branch hidden under its GPU branch.

Pure logic: it is fed measured branch times and answers with knob settings, so it runs
(and is tested) without any hardware. Per decode step the method calls
``record(layer, cpu_s, gpu_s)`` for every layer, then ``end_step()``; every ``interval``
steps the scheduler compares the mean CPU branch time (scan + top-k + gather + copy) with
the mean GPU branch time (GPU attention + the rest of the layer) and moves its knobs:

1. **top-k ratio** (the rule as it is read from the original): start 0.05; if host <= GPU
   then ratio x1.2 else x0.8, clamped to [0.01, 0.5].
2. **host scan window** (optional, ``adapt_window``): the CPU scans only the newest
   ``window`` host tokens. It shrinks x0.5 (min 32) only when the host is too slow with the
   ratio already at its floor, and grows x2 back to "whole host" (None) whenever the host
   is hidden: it is lossy, so it is the first thing given back.
3. **GPU/host split point** (optional, ``adapt_split``): the GPU's recent window grows by
   ``split_step`` tokens when the host is too slow with ratio (and window) at their floors,
   and shrinks by ``split_step`` back toward the configured window when the host is hidden
   with the ratio at its cap; bounded by [min_gpu_window, max_gpu_window].
4. **streamed fraction** (optional, ``adapt_stream``: HybridGen's three-way split): the share
   f of a layer's host tokens (its oldest) copied over PCIe instead of scanned. From the
   measured CPU seconds per scanned token c and copy seconds per streamed token p, the split
   that makes the CPU branch and the copy equally long is f* = c / (c + p) (CPU time
   (1 - f) n c = copy time f n p); f moves ``stream_damping`` of the way to f* and stays in
   [min_stream, max_stream]. A unit with no streamed token yet (no copy rate) keeps f.

Choices where the paper is silent: ``per_layer=False`` (default) keeps one set of knobs for
all layers and compares the times summed over layers (the unit is named 'all' in the
trace); ``per_layer=True`` keeps knobs per layer. ``slack`` scales the GPU time in the
comparison (host <= slack * GPU counts as hidden). Every decision is appended to
``trace`` as a dict: step, layer, cpu_s, gpu_s, knob, old, new.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from hybridgen.errors import ConfigError

Unit = Union[int, str]


@dataclass
class SchedulerConfig:
    """Constants of the feedback rule (defaults: the original rule as it is read)."""

    start_ratio: float = 0.05
    grow: float = 1.2
    shrink: float = 0.8
    min_ratio: float = 0.01
    max_ratio: float = 0.5
    interval: int = 4
    per_layer: bool = False
    slack: float = 1.0
    adapt_ratio: bool = True
    adapt_window: bool = False
    window_shrink: float = 0.5
    window_grow: float = 2.0
    min_window: int = 32
    adapt_split: bool = False
    split_step: int = 64
    adapt_stream: bool = False
    start_stream: float = 0.1
    min_stream: float = 0.0
    max_stream: float = 0.9
    stream_damping: float = 0.5

    def __post_init__(self):
        if not (0 < self.min_ratio <= self.max_ratio <= 1):
            raise ConfigError(f"scheduler needs 0 < min_ratio <= max_ratio <= 1, got {self.min_ratio}, {self.max_ratio}")
        if not (self.min_ratio <= self.start_ratio <= self.max_ratio):
            raise ConfigError(f"scheduler start_ratio {self.start_ratio} must lie in [{self.min_ratio}, {self.max_ratio}]")
        if self.interval < 1 or self.min_window < 1 or self.split_step < 0:
            raise ConfigError("scheduler interval and min_window must be >= 1 and split_step >= 0")
        if not (self.grow >= 1 and 0 < self.shrink <= 1 and 0 < self.window_shrink < 1 and self.window_grow > 1):
            raise ConfigError("scheduler factors need grow >= 1, 0 < shrink <= 1, 0 < window_shrink < 1, window_grow > 1")
        if not (0 <= self.min_stream <= self.start_stream <= self.max_stream < 1 and 0 < self.stream_damping <= 1):
            raise ConfigError("scheduler stream fractions need 0 <= min_stream <= start_stream <= max_stream < 1 "
                              f"and 0 < stream_damping <= 1, got {self.min_stream}, {self.start_stream}, "
                              f"{self.max_stream}, {self.stream_damping}")


@dataclass
class _Knobs:
    ratio: float
    window: Optional[int]  # host scan window (None = every host token)
    gpu_window: int        # the GPU's recent-window size (the split point)
    stream: float = 0.0    # three-way: fraction of the host tokens streamed over PCIe


class FeedbackScheduler:
    """Adjusts top-k ratio, host scan window and GPU/host split from measured branch times.

    num_layers: layers fed to :meth:`record`. gpu_window: the configured GPU recent window
    (tokens); min/max_gpu_window bound the split moves (default: the configured window and
    twice it). host_tokens: host tokens per layer, used when the scan window first shrinks
    (it may be updated through :meth:`set_host_tokens`).
    """

    def __init__(self, config: Optional[SchedulerConfig] = None, num_layers: int = 1, gpu_window: int = 0,
                 min_gpu_window: Optional[int] = None, max_gpu_window: Optional[int] = None,
                 host_tokens: int = 0):
        self.config = config or SchedulerConfig()
        self.num_layers = num_layers
        self.min_gpu_window = gpu_window if min_gpu_window is None else min_gpu_window
        self.max_gpu_window = max(self.min_gpu_window, 2 * gpu_window if max_gpu_window is None else max_gpu_window)
        units: List[Unit] = list(range(num_layers)) if self.config.per_layer else ["all"]
        self.knobs: Dict[Unit, _Knobs] = {u: _Knobs(self.config.start_ratio, None, gpu_window, self.config.start_stream)
                                          for u in units}
        self.host_tokens = host_tokens
        self.step = 0
        self.trace: List[dict] = []
        self._cpu: Dict[Unit, float] = {u: 0.0 for u in units}
        self._gpu: Dict[Unit, float] = {u: 0.0 for u in units}
        self._flow: Dict[Unit, List[float]] = {u: [0.0, 0.0, 0.0, 0.0] for u in units}  # cpu s, scanned, copy s, streamed
        self._steps_in_window = 0

    # ----------------------------------------------------------------- queries
    def _unit(self, layer: int) -> Unit:
        return layer if self.config.per_layer else "all"

    def ratio(self, layer: int) -> float:
        return self.knobs[self._unit(layer)].ratio

    def scan_window(self, layer: int) -> Optional[int]:
        """Newest host tokens the CPU scans (None = all of them)."""
        return self.knobs[self._unit(layer)].window

    def gpu_window(self, layer: int) -> int:
        return self.knobs[self._unit(layer)].gpu_window

    def stream_fraction(self, layer: int) -> float:
        """Share of the host tokens (the oldest) the three-way split streams to the GPU."""
        return self.knobs[self._unit(layer)].stream

    def set_host_tokens(self, n: int) -> None:
        self.host_tokens = n

    # ----------------------------------------------------------------- feedback
    def record(self, layer: int, cpu_s: float, gpu_s: float) -> None:
        """One layer's measured branch times at the current step (seconds)."""
        u = self._unit(layer)
        self._cpu[u] += cpu_s
        self._gpu[u] += gpu_s

    def record_stream(self, layer: int, cpu_s: float, scanned: int, copy_s: float, streamed: int) -> None:
        """One layer's three-way flows at the current step: CPU branch seconds over ``scanned``
        host tokens, copy seconds over ``streamed`` tokens (for ``adapt_stream``)."""
        f = self._flow[self._unit(layer)]
        f[0] += cpu_s
        f[1] += scanned
        f[2] += copy_s
        f[3] += streamed

    def end_step(self) -> List[dict]:
        """Close a decode step; every ``interval`` steps decide and return the decisions made."""
        self.step += 1
        self._steps_in_window += 1
        if self._steps_in_window < self.config.interval:
            return []
        n = self._steps_in_window
        made: List[dict] = []
        for u, knobs in self.knobs.items():
            cpu, gpu = self._cpu[u] / n, self._gpu[u] / n
            if cpu == 0.0 and gpu == 0.0:
                continue  # nothing measured for this unit (e.g. no host tokens yet)
            made.extend(self._decide(u, knobs, cpu, gpu))
            self._cpu[u] = self._gpu[u] = 0.0
        if self.config.adapt_stream:
            for u, knobs in self.knobs.items():
                made.extend(self._balance_stream(u, knobs, *self._flow[u]))
                self._flow[u] = [0.0, 0.0, 0.0, 0.0]
        self._steps_in_window = 0
        self.trace.extend(made)
        return made

    def _balance_stream(self, u: Unit, kn: _Knobs, cpu_s: float, scanned: float, copy_s: float,
                        streamed: float) -> List[dict]:
        """Move the streamed fraction toward f* = c / (c + p) (module docstring, rule 4)."""
        c = self.config
        if scanned <= 0 or streamed <= 0 or cpu_s <= 0 or copy_s <= 0:
            return []  # no rate measured on one side yet
        per_scan, per_copy = cpu_s / scanned, copy_s / streamed
        target = per_scan / (per_scan + per_copy)
        old = kn.stream
        kn.stream = min(c.max_stream, max(c.min_stream, old + c.stream_damping * (target - old)))
        if kn.stream == old:
            return []
        return [{"step": self.step, "layer": u, "cpu_s": cpu_s, "gpu_s": copy_s, "knob": "stream_ratio",
                 "old": old, "new": kn.stream, "target": target}]

    def _decide(self, u: Unit, kn: _Knobs, cpu: float, gpu: float) -> List[dict]:
        c = self.config
        hidden = cpu <= c.slack * gpu
        out: List[dict] = []

        def note(knob, old, new):
            if old != new:
                out.append({"step": self.step, "layer": u, "cpu_s": cpu, "gpu_s": gpu,
                            "knob": knob, "old": old, "new": new})

        ratio_at_floor = kn.ratio <= c.min_ratio
        ratio_at_cap = kn.ratio >= c.max_ratio
        if c.adapt_ratio:
            old = kn.ratio
            kn.ratio = min(c.max_ratio, old * c.grow) if hidden else max(c.min_ratio, old * c.shrink)
            note("topk_ratio", old, kn.ratio)
        if hidden:
            if c.adapt_window and kn.window is not None:
                old = kn.window
                grown = int(old * c.window_grow)
                kn.window = None if self.host_tokens and grown >= self.host_tokens else grown
                note("scan_window", old, kn.window)
            elif c.adapt_split and (ratio_at_cap or not c.adapt_ratio) and kn.gpu_window > self.min_gpu_window:
                old = kn.gpu_window
                kn.gpu_window = max(self.min_gpu_window, old - c.split_step)
                note("gpu_window", old, kn.gpu_window)
        elif ratio_at_floor or not c.adapt_ratio:
            window_done = True
            if c.adapt_window:
                old = kn.window
                base = old if old is not None else max(self.host_tokens, c.min_window)
                new = max(c.min_window, int(base * c.window_shrink))
                if old is None or new < old:
                    kn.window = new
                    note("scan_window", old, new)
                    window_done = False
            if window_done and c.adapt_split and kn.gpu_window < self.max_gpu_window:
                old = kn.gpu_window
                kn.gpu_window = min(self.max_gpu_window, old + c.split_step)
                note("gpu_window", old, kn.gpu_window)
        return out
