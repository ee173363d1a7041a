"""Feedback scheduler on synthetic timings: right direction, bounds, cadence, trace."""
import pytest

from hybridgen.errors import ConfigError
from hybridgen.hybrid.scheduler import FeedbackScheduler, SchedulerConfig


def _feed(s, steps, cpu, gpu, layers=2):
    made = []
    for _ in range(steps):
        for l in range(layers):
            s.record(l, cpu, gpu)
        made += s.end_step()
    return made


def test_host_slower_shrinks_ratio_to_floor_every_interval():
    s = FeedbackScheduler(num_layers=2, gpu_window=100)
    assert s.ratio(0) == 0.05
    assert _feed(s, 3, cpu=2.0, gpu=1.0) == []  # no decision before 4 steps
    made = _feed(s, 1, cpu=2.0, gpu=1.0)
    assert len(made) == 1 and made[0]["knob"] == "topk_ratio" and made[0]["step"] == 4
    assert made[0]["new"] == pytest.approx(0.05 * 0.8) and made[0]["layer"] == "all"
    ratios = [s.ratio(0)]
    for _ in range(40):
        _feed(s, 4, cpu=2.0, gpu=1.0)
        ratios.append(s.ratio(1))
    assert all(b <= a for a, b in zip(ratios, ratios[1:]))
    assert ratios[-1] == 0.01 and min(ratios) >= 0.01
    assert s.trace[-1]["new"] == 0.01 and all(d["new"] >= 0.01 for d in s.trace)


def test_host_hidden_grows_ratio_to_cap():
    s = FeedbackScheduler(num_layers=3)
    _feed(s, 4, cpu=0.5, gpu=1.0, layers=3)
    assert s.ratio(2) == pytest.approx(0.06)
    _feed(s, 400, cpu=0.5, gpu=1.0, layers=3)
    assert s.ratio(0) == 0.5
    assert all(d["new"] <= 0.5 for d in s.trace)
    n = len(s.trace)
    _feed(s, 8, cpu=0.5, gpu=1.0, layers=3)
    assert len(s.trace) == n  # at the cap nothing changes, nothing is logged


def test_equal_times_count_as_hidden_and_trace_fields():
    s = FeedbackScheduler(num_layers=1)
    d = _feed(s, 4, cpu=1.0, gpu=1.0, layers=1)[0]
    assert d["new"] > d["old"]
    assert set(d) == {"step", "layer", "cpu_s", "gpu_s", "knob", "old", "new"}
    assert d["cpu_s"] == pytest.approx(1.0) and d["gpu_s"] == pytest.approx(1.0)


def test_per_layer_units_move_independently():
    s = FeedbackScheduler(SchedulerConfig(per_layer=True), num_layers=2)
    for _ in range(4):
        s.record(0, 2.0, 1.0)
        s.record(1, 0.5, 1.0)
        s.end_step()
    assert s.ratio(0) < 0.05 < s.ratio(1)
    assert {d["layer"] for d in s.trace} == {0, 1}


def test_window_shrinks_only_at_ratio_floor_and_grows_back():
    s = FeedbackScheduler(SchedulerConfig(adapt_window=True, start_ratio=0.01), num_layers=1, host_tokens=1000)
    _feed(s, 4, cpu=2.0, gpu=1.0, layers=1)
    assert s.scan_window(0) == 500
    windows = []
    for _ in range(10):
        _feed(s, 4, cpu=2.0, gpu=1.0, layers=1)
        windows.append(s.scan_window(0))
    assert windows[-1] == 32 and all(w >= 32 for w in windows)
    assert all(b <= a for a, b in zip(windows, windows[1:]))
    _feed(s, 4, cpu=0.1, gpu=1.0, layers=1)
    assert s.scan_window(0) == 64
    for _ in range(5):
        _feed(s, 4, cpu=0.1, gpu=1.0, layers=1)
    assert s.scan_window(0) is None  # back to the whole host
    s2 = FeedbackScheduler(SchedulerConfig(adapt_window=True), num_layers=1, host_tokens=1000)
    _feed(s2, 4, cpu=2.0, gpu=1.0, layers=1)
    assert s2.scan_window(0) is None  # ratio not at its floor yet: window untouched


def test_split_moves_within_bounds():
    cfg = SchedulerConfig(adapt_split=True, start_ratio=0.01, split_step=50)
    s = FeedbackScheduler(cfg, num_layers=1, gpu_window=100, max_gpu_window=220)
    gw = []
    for _ in range(6):
        _feed(s, 4, cpu=3.0, gpu=1.0, layers=1)
        gw.append(s.gpu_window(0))
    assert gw == [150, 200, 220, 220, 220, 220]
    # hidden host: ratio climbs to its cap first, then the split moves back, never below the start
    for _ in range(100):
        _feed(s, 4, cpu=0.1, gpu=1.0, layers=1)
    assert s.ratio(0) == 0.5 and s.gpu_window(0) == 100
    knobs = [d["knob"] for d in s.trace]
    assert knobs.index("gpu_window") < len(knobs)
    assert all(100 <= d["new"] <= 220 for d in s.trace if d["knob"] == "gpu_window")


def test_nothing_measured_makes_no_decision():
    s = FeedbackScheduler(num_layers=2)
    _feed(s, 8, cpu=0.0, gpu=0.0)
    assert s.trace == [] and s.ratio(0) == 0.05


@pytest.mark.parametrize("bad", [dict(min_ratio=0), dict(start_ratio=0.9), dict(interval=0),
                                 dict(grow=0.5), dict(window_shrink=1.0), dict(max_ratio=1.5)])
def test_bad_config_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        SchedulerConfig(**bad)
