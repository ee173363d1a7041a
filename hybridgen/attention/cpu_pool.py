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

This pool is the process's only CPU thread pool of ours: the CPU key scan's numba kernels
split their work over the same threads (:meth:`CPUAttentionPool.run_split`). Those kernels
are compiled ``nogil`` and run serially per slice, never under numba's parallel threading
layer, whose OpenMP clashes with torch's (keep ``NUMBA_THREADING_LAYER=workqueue``;
docs/design.md, thread-runtime pitfalls).
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import torch

from hybridgen import runtime
from hybridgen.errors import ConfigError


#: the smallest split (elements the kernel touches) worth a second thread: handing a slice to a
#: pool thread and joining it cost ~60 us on the 2-core development VM (1.6 us inline), about
#: what the CPU branch's kernels spend on 100-250K elements
SPLIT_MIN_WORK = 1 << 18


class _Chunk:
    """One slice [lo, hi) of a split: run once, by whichever thread claims it first."""

    def __init__(self, fn: Callable, args: Tuple, lo: int, hi: int):
        self.fn, self.args, self.lo, self.hi = fn, args, lo, hi
        self._claim = threading.Lock()

    def run(self) -> None:
        if self._claim.acquire(blocking=False):
            self.fn(*self.args, self.lo, self.hi)


class CPUAttentionPool:
    """The process's CPU threads for host-side attention work: ONE executor for two uses.

    - :meth:`submit`: a host task (e.g. a layer's host partial, HybridGen's scan + top-k +
      gather), at most ``workers`` of them at once, started in submission order.
    - :meth:`run_split`: a kernel split into slices run in parallel (the nogil numba scan and
      top-k of :mod:`hybridgen.attention.cpu_scan`), ``split_threads`` slices at most.

    workers: concurrent host tasks (default 1: one host partial per layer; each task itself
    uses torch's intra-op threads, ``torch_threads`` of them when given; setting it affects
    only the pool's threads, not the caller's).
    split_threads: slices of a split, its caller's thread included (default: follow
    :func:`hybridgen.runtime.scan_threads` at every split, i.e. ``HYBRIDGEN_SCAN_THREADS``,
    else torch's count). The executor holds ``workers + split_threads - 1`` threads (the
    count at construction), created on first use and reused: nothing creates a thread per
    call; slices beyond them wait for a free thread or run on the caller's.
    """

    def __init__(self, workers: int = 1, torch_threads: Optional[int] = None,
                 split_threads: Optional[int] = None):
        if int(workers) < 1:
            raise ConfigError(f"the CPU attention pool needs >= 1 worker, got {workers}")
        if torch_threads is not None and int(torch_threads) < 1:
            raise ConfigError(f"torch_threads must be >= 1 (or unset), got {torch_threads}")
        if split_threads is not None and int(split_threads) < 1:
            raise ConfigError(f"split_threads must be >= 1 (or unset), got {split_threads}")
        self.workers = int(workers)
        self.torch_threads = torch_threads
        self._split_threads = int(split_threads) if split_threads is not None else None
        self._executor = ThreadPoolExecutor(max_workers=self.workers + self.split_threads - 1,
                                            thread_name_prefix="hg-cpu-attn", initializer=self._init_thread)
        self._lock = threading.Condition()
        self._queued: Deque[Tuple[Future, Callable, Tuple, dict]] = deque()
        self._running = 0  # host tasks on the executor now (<= workers)

    @property
    def split_threads(self) -> int:
        """Slices per split now (the configured count, else :func:`hybridgen.runtime.scan_threads`)."""
        return self._split_threads if self._split_threads is not None else runtime.scan_threads()

    def _init_thread(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    # ------------------------------------------------------------------ host tasks
    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) on a worker; returns a Future (its exception re-raises on result())."""
        fut: Future = Future()
        with self._lock:
            self._queued.append((fut, fn, args, kwargs))
            self._dispatch()
        return fut

    def _dispatch(self) -> None:
        """Start queued host tasks while fewer than ``workers`` run (holding ``_lock``)."""
        while self._running < self.workers and self._queued:
            self._running += 1
            self._executor.submit(self._run_task, self._queued.popleft())

    def _run_task(self, task: Tuple[Future, Callable, Tuple, dict]) -> None:
        fut, fn, args, kwargs = task
        try:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller through the Future
                    fut.set_exception(exc)
        finally:
            with self._lock:
                self._running -= 1
                self._dispatch()
                self._lock.notify_all()

    # ------------------------------------------------------------------ split kernels
    def threads_for(self, work: Optional[int]) -> int:
        """Threads a split of ``work`` elements runs on (before capping at its slice count): one
        below SPLIT_MIN_WORK, else ``split_threads``."""
        return self.split_threads if work is None or work >= SPLIT_MIN_WORK else 1

    def run_split(self, fn: Callable, total: int, *args: Any, work: Optional[int] = None,
                  grain: Optional[int] = None) -> None:
        """Run fn(*args, lo, hi) over [0, total) in slices on up to ``split_threads`` threads, in parallel.

        ``fn`` must release the GIL (a nogil numba kernel, a ctypes call) and write disjoint
        outputs per slice. The caller runs slices too, and every thread takes the next slice no
        thread has claimed until none is left, so a split issued from inside a host task never
        waits on a busy pool (a pool thread that has not started by then is cancelled), and a
        thread that starts late or is slowed (a core shared with another process) leaves its
        slices to the others. When a slice raises, no thread starts another, and the first
        error is raised once every started slice has finished. grain: items per slice (default: one
        slice per thread); slices of a few items balance uneven threads at the cost of one
        call per slice. work: about how many elements the call touches; below SPLIT_MIN_WORK
        it runs on the caller's thread alone, where the hand-off would cost more than the
        second thread saves.
        """
        n = min(self.threads_for(work), total)
        if n <= 1:
            fn(*args, 0, total)
            return
        step = max(1, int(grain)) if grain is not None else None
        bounds = list(range(0, total, step)) + [total] if step else [total * i // n for i in range(n + 1)]
        chunks: List[_Chunk] = [_Chunk(fn, args, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]

        errors: List[BaseException] = []

        def drain() -> None:
            for c in chunks:
                if errors:  # a slice failed: nobody starts another
                    return
                try:
                    c.run()
                except BaseException as exc:  # noqa: BLE001 - re-raised on the caller below
                    errors.append(exc)
                    return

        futs = [self._executor.submit(drain) for _ in range(min(n, len(chunks)) - 1)]
        try:
            drain()
        finally:  # every slice has finished before this returns or raises (they write the caller's memory)
            for f in futs:
                if not f.cancel():  # one that never started (a busy pool) is not waited for
                    f.result()
        if errors:
            raise errors[0]

    def run_each(self, tasks: Sequence[Callable[[], Any]]) -> List[Any]:
        """Run every task (no arguments) on the caller and up to ``split_threads - 1`` pool threads,
        each thread taking the next unclaimed task until none is left; their results in order.

        A pipeline over independent pieces of work (e.g. the CPU branch per batch row): while one
        thread is in a memory-bound stage of one piece, another runs a compute-bound stage of the
        next. The tasks must not use this pool's splits (run their kernels inline). The first
        exception is raised after every started task has finished.
        """
        claims = [threading.Lock() for _ in tasks]  # a task runs once, on whichever thread claims it
        results: List[Any] = [None] * len(tasks)
        errors: List[BaseException] = []

        def worker() -> None:
            for i, task in enumerate(tasks):
                if errors or not claims[i].acquire(blocking=False):
                    continue
                try:
                    results[i] = task()
                except BaseException as exc:  # noqa: BLE001 - re-raised on the caller below
                    errors.append(exc)

        futs = [self._executor.submit(worker) for _ in range(min(self.split_threads, len(tasks)) - 1)]
        worker()
        for f in futs:
            f.result()
        if errors:
            raise errors[0]
        return results

    def shutdown(self) -> None:
        """Finish every submitted task, then stop the threads."""
        with self._lock:
            while self._running or self._queued:
                self._lock.wait()
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


_inline: Optional[CPUAttentionPool] = None


def inline_pool() -> CPUAttentionPool:
    """A pool whose splits all run on the calling thread (for work already spread over threads,
    e.g. the pieces of :meth:`CPUAttentionPool.run_each`)."""
    global _inline
    if _inline is None:
        _inline = CPUAttentionPool(workers=1, split_threads=1)
    return _inline
