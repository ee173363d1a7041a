"""CPU attention pool: runs the host half of attention concurrently with the GPU half.

Torch CPU kernels release the GIL, so a small thread pool gives real overlap between the
host-side computation and the caller's GPU work without copying KV into another process.
(`benchmarks/bench_foundation.py` measures threads against a process pool over shared
memory; see docs/ for the result.)
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch


class CPUAttentionPool:
    """A pool of worker threads for host-side attention work.

    workers: concurrent host tasks (default 1: one host partial per layer; each task itself
    uses torch's intra-op threads, ``torch_threads`` of them when given).
    """

    def __init__(self, workers: int = 1, torch_threads: Optional[int] = None):
        self.workers = workers
        self.torch_threads = torch_threads
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hg-cpu-attn",
                                            initializer=self._init_thread)

    def _init_thread(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) on a worker; returns a Future."""
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


_default: Optional[CPUAttentionPool] = None


def default_pool() -> CPUAttentionPool:
    """A process-wide pool created on first use."""
    global _default
    if _default is None:
        _default = CPUAttentionPool(workers=int(os.environ.get("HYBRIDGEN_CPU_WORKERS", "1")))
    return _default
