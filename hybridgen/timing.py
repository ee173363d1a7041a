"""Wall-clock medians for benchmarks and the profiler (one warm-up call first)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional


def median_time(fn: Callable[[], Any], reps: int, sync: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of fn() over ``reps`` calls after one warm-up (sync() after each when given,
    e.g. ``torch.cuda.synchronize`` so asynchronous GPU work is inside the timing)."""
    return median_interleaved({"fn": fn}, reps, sync)["fn"]


def median_interleaved(fns: Dict[str, Callable[[], Any]], reps: int,
                       sync: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Median seconds per function, calling them round-robin so machine noise hits all alike."""
    for fn in fns.values():
        fn()
        if sync:
            sync()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}
