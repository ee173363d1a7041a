"""Wall-clock timings for benchmarks and the profiler: the median of >= 3 repeats with its spread.

torch.utils.benchmark does the work: each call is timed by its ``Timer``'s clock (which
synchronizes the accelerator when one is present; ``sync`` adds the caller's own, e.g. a CUDA
stream), and the repeats of one function form a ``torch.utils.benchmark.Measurement``, whose
median and interquartile range (IQR) are what :class:`Timing` reports. One warm-up call precedes
the repeats. ``Timer.timeit`` itself is not called per repeat: it runs two warm-up calls before
every timed one, which would triple the profiler's run time on large buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

MIN_REPS = 3


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function: ``median`` and ``iqr`` (interquartile range) over ``reps`` repeats."""

    median: float
    iqr: float
    reps: int

    @property
    def relative_spread(self) -> float:
        """IQR / median (0 when the median is 0)."""
        return self.iqr / self.median if self.median > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3g} ms (IQR {self.iqr * 1e3:.2g} ms, n={self.reps})"


def _check_reps(reps: int) -> None:
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < MIN_REPS:
        from hybridgen.errors import ConfigError

        raise ConfigError(f"reps={reps!r}: a timing is the median of at least {MIN_REPS} repeats with their "
                          f"spread; pass reps >= {MIN_REPS}")


def measure_interleaved(fns: Dict[str, Callable[[], Any]], reps: int,
                        sync: Optional[Callable[[], None]] = None) -> Dict[str, Timing]:
    """Median and IQR of seconds per call for each function, calling them round-robin so machine
    noise hits all alike (sync() after each call when given, e.g. ``torch.cuda.synchronize``)."""
    import torch
    from torch.utils.benchmark import Measurement, TaskSpec
    from torch.utils.benchmark.utils.timer import timer as clock

    _check_reps(reps)
    for fn in fns.values():  # warm-up
        fn()
        if sync:
            sync()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            if sync:
                sync()
            times[name].append(clock() - t0)
    threads = torch.get_num_threads()
    out: Dict[str, Timing] = {}
    for name, raw in times.items():
        m = Measurement(number_per_run=1, raw_times=raw, task_spec=TaskSpec(stmt=name, setup="", num_threads=threads))
        out[name] = Timing(median=float(m.median), iqr=float(m.iqr), reps=len(m.raw_times))
    return out


def measure(fn: Callable[[], Any], reps: int, sync: Optional[Callable[[], None]] = None) -> Timing:
    """Median and IQR of seconds per fn() call over ``reps`` repeats after one warm-up."""
    return measure_interleaved({"fn": fn}, reps, sync)["fn"]


def median_time(fn: Callable[[], Any], reps: int, sync: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of fn() over ``reps`` (>= 3) calls after one warm-up (:func:`measure` has the spread)."""
    return measure(fn, reps, sync).median


def median_interleaved(fns: Dict[str, Callable[[], Any]], reps: int,
                       sync: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Median seconds per function, called round-robin (:func:`measure_interleaved` has the spread)."""
    return {name: t.median for name, t in measure_interleaved(fns, reps, sync).items()}
