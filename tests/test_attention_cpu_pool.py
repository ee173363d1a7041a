"""The CPU attention pool: correct results, real concurrency, errors, configuration."""
import threading

import pytest
import torch

from hybridgen.attention import dense_attention_reference, merge_partials, partial_attention
from hybridgen.attention import cpu_pool
from hybridgen.attention.cpu_pool import CPUAttentionPool, default_pool
from hybridgen.errors import ConfigError
from tests._attention_cases import random_case, rel_err


@pytest.mark.parametrize("seed", range(4))
def test_pool_partial_merged_with_caller_partial_is_exact(seed):
    c = random_case(seed, T=40, mask_kind="none")
    pool = CPUAttentionPool(workers=2)
    fut = pool.submit(partial_attention, c.q, c.k[:, :, :25], c.v[:, :, :25], c.scale)
    mine = partial_attention(c.q, c.k[:, :, 25:], c.v[:, :, 25:], c.scale)
    out, _ = merge_partials([mine, fut.result()])
    pool.shutdown()
    assert rel_err(out, dense_attention_reference(c.q, c.k, c.v, c.scale)) < 1e-5


def test_pool_runs_on_another_thread_concurrently():
    pool = CPUAttentionPool(workers=1)
    started, release = threading.Event(), threading.Event()

    def task():
        started.set()
        assert release.wait(5)  # blocks until the caller, still running, releases it
        return threading.current_thread().name

    fut = pool.submit(task)
    assert started.wait(5)  # the task started while the caller keeps going
    assert not fut.done()
    release.set()
    assert fut.result(5).startswith("hg-cpu-attn")
    pool.shutdown()


def test_pool_errors_reraise_and_config_checks():
    pool = CPUAttentionPool()
    fut = pool.submit(partial_attention, torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5), 1.0)
    with pytest.raises(RuntimeError):
        fut.result()
    pool.shutdown()
    with pytest.raises(ConfigError):
        CPUAttentionPool(workers=0)
    with pytest.raises(ConfigError):
        CPUAttentionPool(torch_threads=0)


def test_torch_threads_only_affect_the_pool():
    before = torch.get_num_threads()
    pool = CPUAttentionPool(torch_threads=1)
    assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before
    pool.shutdown()


def test_default_pool_singleton_and_env(monkeypatch):
    monkeypatch.setattr(cpu_pool, "_default", None)
    monkeypatch.setenv("HYBRIDGEN_CPU_WORKERS", "2")
    p = default_pool()
    assert p is default_pool() and p.workers == 2
    monkeypatch.setattr(cpu_pool, "_default", None)
    monkeypatch.setenv("HYBRIDGEN_CPU_WORKERS", "many")
    with pytest.raises(ConfigError):
        default_pool()
    monkeypatch.setattr(cpu_pool, "_default", None)
    p.shutdown()


def test_run_split_covers_every_slice_once_and_keeps_small_work_on_the_caller():
    """Slices [lo, hi) tile [0, total) exactly; below SPLIT_MIN_WORK the caller runs it alone."""
    pool = CPUAttentionPool(workers=1, split_threads=2)
    seen, threads = [], set()

    def fn(tag, lo, hi):
        seen.append((tag, lo, hi))
        threads.add(threading.get_ident())

    pool.run_split(fn, 10, "big", work=cpu_pool.SPLIT_MIN_WORK)
    assert sorted(s[1:] for s in seen if s[0] == "big") == [(0, 5), (5, 10)]
    threads.clear()
    pool.run_split(fn, 10, "small", work=cpu_pool.SPLIT_MIN_WORK - 1)
    assert [s[1:] for s in seen if s[0] == "small"] == [(0, 10)] and threads == {threading.get_ident()}
    pool.run_split(fn, 10, "unknown")  # no work given: split as before
    assert sorted(s[1:] for s in seen if s[0] == "unknown") == [(0, 5), (5, 10)]
    pool.shutdown()


@pytest.mark.parametrize("total,grain,threads", [(10, 1, 2), (10, 3, 2), (64, 8, 3), (5, 7, 4), (1, 1, 3)])
def test_run_split_in_grains_covers_every_item_once(total, grain, threads):
    pool = CPUAttentionPool(workers=1, split_threads=threads)
    hits = torch.zeros(total, dtype=torch.int64)
    lock = threading.Lock()

    def fn(lo, hi):
        assert hi - lo <= grain
        with lock:
            hits[lo:hi] += 1

    pool.run_split(fn, total, grain=grain)
    assert hits.tolist() == [1] * total
    pool.shutdown()


def test_a_stalled_thread_leaves_its_slices_to_the_others():
    """Slice 0 holds its thread until every other slice is done: the other thread must take all
    of them (a static half-and-half split would leave slices 1-3 behind slice 0 and time out)."""
    pool = CPUAttentionPool(workers=1, split_threads=2)
    others_done = threading.Event()
    done, owner = [], {}
    lock = threading.Lock()

    def fn(lo, hi):
        owner[lo] = threading.get_ident()
        if lo == 0:
            assert others_done.wait(timeout=5), "the other slices waited on the stalled thread"
            return
        with lock:
            done.append(lo)
            if len(done) == 7:
                others_done.set()

    pool.run_split(fn, 8, grain=1)
    assert sorted(done) == list(range(1, 8))
    assert len({owner[i] for i in range(1, 8)}) == 1 and owner[1] != owner[0]
    pool.shutdown()


@pytest.mark.parametrize("failing", [0, 5])  # the caller's first slice, or one a pool thread may take
def test_a_failing_slice_stops_the_split_and_every_started_slice_ends_before_it_raises(failing):
    pool = CPUAttentionPool(workers=1, split_threads=2)
    running, ran = [0], []
    lock = threading.Lock()

    def fn(lo, hi):
        with lock:
            running[0] += 1
        try:
            threading.Event().wait(0.02)
            if lo == failing:
                raise ValueError(f"slice {lo}")
            ran.append(lo)
        finally:
            with lock:
                running[0] -= 1

    with pytest.raises(ValueError, match=f"slice {failing}"):
        pool.run_split(fn, 40, grain=1)
    assert running[0] == 0  # nothing still writing when the error reaches the caller
    assert len(ran) < 39  # the others stopped taking slices
    pool.shutdown()


def test_a_split_from_a_busy_pool_runs_on_the_caller_without_waiting():
    """Both pool threads are busy: the caller runs every slice itself and returns at once."""
    pool = CPUAttentionPool(workers=1, split_threads=2)
    release = threading.Event()
    busy = [pool.submit(release.wait, 5), pool._executor.submit(release.wait, 5)]
    seen = []
    pool.run_split(lambda lo, hi: seen.append((lo, hi)), 4, grain=1)
    assert sorted(seen) == [(0, 1), (1, 2), (2, 3), (3, 4)] and not release.is_set()
    release.set()
    for f in busy:
        f.result()
    pool.shutdown()
