"""Step timers: torch.utils.benchmark underneath, medians of >= 3 repeats with their spread."""
import time

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.timing import Timing, measure, measure_interleaved, median_interleaved, median_time


def test_median_and_spread_of_repeats_and_round_robin_order():
    calls = []
    fns = {"short": lambda: (calls.append("s"), time.sleep(0.002)),
           "long": lambda: (calls.append("l"), time.sleep(0.012))}
    t = measure_interleaved(fns, reps=3)
    assert calls == ["s", "l"] * 4  # one warm-up each, then round-robin repeats
    assert all(isinstance(v, Timing) and v.reps == 3 and v.iqr >= 0 for v in t.values())
    assert 0.002 <= t["short"].median < t["long"].median and t["long"].median >= 0.012
    assert set(median_interleaved(fns, reps=3)) == {"short", "long"}


def test_sync_runs_after_every_call_and_the_thread_count_is_the_callers():
    synced, seen = [], []
    threads = torch.get_num_threads()
    t = measure(lambda: seen.append(torch.get_num_threads()), reps=4, sync=lambda: synced.append(1))
    assert len(synced) == 5 and t.reps == 4  # warm-up + 4 repeats
    assert set(seen) == {threads}  # timed at the caller's thread count (torch's Timer would set 1)
    assert "IQR" in str(t) and "n=4" in str(t)


@pytest.mark.parametrize("reps", [0, 1, 2])
def test_fewer_than_three_repeats_is_refused(reps):
    with pytest.raises(ConfigError, match="reps >= 3"):
        median_time(lambda: None, reps)


def test_the_spread_is_the_interquartile_range_of_the_repeats():
    durations = iter([0.001] + [0.001, 0.02] * 3)  # warm-up, then alternating short and long calls
    t = measure(lambda: time.sleep(next(durations)), reps=6)
    assert t.iqr > 0.01 and t.relative_spread > 0.5  # a plausible "median only" timer would show no spread
