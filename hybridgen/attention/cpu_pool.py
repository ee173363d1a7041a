"""CPU attention pool: runs the host half of attention concurrently with the GPU half.

Torch CPU kernels release the GIL, so a small thread pool gives real overlap between the
host-side computation and the caller's GPU work without copying KV into another process.

Threads or processes? ``benchmarks/bench_cpu_pool.py`` measures both on decode shapes
(Hq=9, Hkv=3, D=64 as SmolLM2, fp32, 4K-32K host tokens, batch 1 and 4): the host partial
runs in a worker thread of this pool, or in a worker process that holds the host KV in shared
memory (torch.multiprocessing, spawn; q in / out+lse back through shared tensors, a pipe
signals), while the caller waits (as on a GPU), spins in pure Python holding the GIL, or
runs torch compute. Measured on a 2-core machine (no GPU) shared with other jobs (load
average ~1.5-2; median of 7 steps, modes interleaved; ms per step = host partial + other
work lasting as long as the host partial alone):

  ======================  ==========  ===========  ============  ==================
  case                    sequential  thread (2t)  process (1t)  process (2t)
  ======================  ==========  ===========  ============  ==================
  B1, 32K, caller waits   16.3        8.4          9.7           12.2
  B4, 32K, caller waits   68.3        34.2         44.2          82.1
  B4, 16K, caller waits   46.4        20.2         28.2          79.8
  B1, 32K, caller Python  17.5        16.6         9.3           12.9
  B4, 32K, caller Python  73.3        62.5         57.0          99.1
  B4, 32K, caller torch   71.2        61.3         67.6          108.3
  ======================  ==========  ===========  ============  ==================

Threads win where this pool is used (the caller launches the GPU half and blocks on its
result: "caller waits", 6 of 6 shapes; also 5 of 6 with torch work on the caller). A
process only wins while the caller holds the GIL in pure Python for the whole host
partial (4 of 6 shapes), and costs a pipe round trip per call, KV that must live in shared
memory (re-shared at every growth) and, with 2 torch threads per process on 2 cores,
OpenMP oversubscription that makes it up to 70 ms slower. A second run at load average
5-7 ranked them the same (threads fastest in 5 of 6 "caller waits" shapes, a 1-thread
process in 4 of 6 "caller Python" shapes). So the pool uses threads. Rerun the script on
the target host; on many-core hosts the balance may differ.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from hybridgen.errors import ConfigError


class CPUAttentionPool:
    """A pool of worker threads for host-side attention work.

    workers: concurrent host tasks (default 1: one host partial per layer; each task itself
    uses torch's intra-op threads, ``torch_threads`` of them when given; setting it affects
    only the pool's threads, not the caller's).
    """

    def __init__(self, workers: int = 1, torch_threads: Optional[int] = None):
        if int(workers) < 1:
            raise ConfigError(f"the CPU attention pool needs >= 1 worker, got {workers}")
        if torch_threads is not None and int(torch_threads) < 1:
            raise ConfigError(f"torch_threads must be >= 1 (or unset), got {torch_threads}")
        self.workers = int(workers)
        self.torch_threads = torch_threads
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hg-cpu-attn",
                                            initializer=self._init_thread)

    def _init_thread(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) on a worker; returns a Future (its exception re-raises on result())."""
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


_default: Optional[CPUAttentionPool] = None


def default_pool() -> CPUAttentionPool:
    """A process-wide pool created on first use (``HYBRIDGEN_CPU_WORKERS`` workers, default 1)."""
    global _default
    if _default is None:
        text = os.environ.get("HYBRIDGEN_CPU_WORKERS", "1")
        try:
            workers = int(text)
        except ValueError:
            raise ConfigError(f"HYBRIDGEN_CPU_WORKERS must be a positive integer, got {text!r}") from None
        _default = CPUAttentionPool(workers=workers)
    return _default
