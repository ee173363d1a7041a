"""Per-layer CPU and GPU branch times of HybridGen's decode steps, for the feedback scheduler.

- CPU branch of layer l: seconds of its host task (scan + top-k + gather + staging) plus the
  exact-logit recompute, measured on the host with ``time.perf_counter`` (:meth:`add_cpu`).
- GPU branch of layer l: the GPU attention inside ``decode(l)`` (:meth:`add_gpu`) plus the
  rest of the layer, from the end of ``decode(l)`` (:meth:`layer_done`) to the next layer's
  ``on_layer_input`` or the step's end (:meth:`close_layer`).

On CUDA the marks are timing events, read back once per step (:meth:`resolve`, at
``end_step``) so no layer waits on the GPU mid-step; elsewhere they are ``perf_counter``
readings. :meth:`take` hands the step's per-layer seconds to the scheduler and starts afresh.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import torch


class BranchTimer:
    """CPU and GPU branch seconds per layer over one decode step.

    num_layers: layers timed; cuda: mark GPU intervals with CUDA events (else perf_counter).
    """

    def __init__(self, num_layers: int, cuda: bool):
        self.num_layers = num_layers
        self.cuda = cuda
        self.cpu_s: List[float] = [0.0] * num_layers
        self.gpu_s: List[float] = [0.0] * num_layers
        self._layer_end: Optional[Tuple[int, Any]] = None
        self._marks: List[Tuple[int, Any, Any]] = []  # (layer, start, end): resolved at the step's end

    def clock(self) -> Any:
        """A mark now: a recorded CUDA timing event, or ``time.perf_counter()``."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (waits for ``b`` on CUDA)."""
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def add_cpu(self, layer: int, seconds: float) -> None:
        """Add host seconds to ``layer``'s CPU branch."""
        self.cpu_s[layer] += seconds

    def add_gpu(self, layer: int, start: Any, end: Any) -> None:
        """Add the interval between two marks to ``layer``'s GPU branch (read at :meth:`resolve`)."""
        self._marks.append((layer, start, end))

    def layer_done(self, layer: int, end: Any) -> None:
        """``layer``'s decode ended at mark ``end``; the rest of the layer runs until :meth:`close_layer`."""
        self._layer_end = (layer, end)

    def close_layer(self) -> None:
        """The GPU time from the end of the previous layer's decode to now (the rest of that layer)."""
        if self._layer_end is not None:
            prev, mark = self._layer_end
            self._marks.append((prev, mark, self.clock()))
            self._layer_end = None

    def resolve(self) -> None:
        """Read the step's GPU marks back into per-layer seconds."""
        for layer, a, b in self._marks:
            self.gpu_s[layer] += self.elapsed(a, b)
        self._marks = []

    def take(self) -> Tuple[List[float], List[float]]:
        """(cpu seconds, gpu seconds) per layer since the last take; both restart at zero."""
        out = (self.cpu_s, self.gpu_s)
        self.cpu_s, self.gpu_s = [0.0] * self.num_layers, [0.0] * self.num_layers
        return out
