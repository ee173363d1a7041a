"""Numbers at the edges: one parser per kind, each refusal one line naming the field (issue 25, item 2)."""
from __future__ import annotations

import math

import pytest

from hybridgen.errors import ConfigError
from hybridgen.kv.tiers import MAX_BYTES, parse_bytes
from hybridgen.methods import build_method
from hybridgen.methods.budget import Budget
from hybridgen.validation import numbers

TINY = ["model.weights=random", "model.num_layers=1", "workload.source=random", "workload.prompt_len=8",
        "workload.gen_len=2"]


@pytest.mark.parametrize("value", ["1e309GiB", "1.5e18", 1e300, 10 ** 400, "99999999999TiB", 2 ** 61])
def test_a_size_past_1_eib_is_refused_not_overflowed(value):
    with pytest.raises(ConfigError, match="^hardware.gpu_capacity: .*at most 1 EiB"):
        numbers.size("hardware.gpu_capacity", value)


def test_size_limits_and_meanings():
    assert parse_bytes(MAX_BYTES) == MAX_BYTES
    assert parse_bytes("1GiB") == 2 ** 30
    assert parse_bytes(float("inf")) is None and parse_bytes("unlimited") is None
    for bad in (float("nan"), float("-inf"), -1, "-1GB", "banana", "１GB"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match=r"^hardware.gpu_capacity: cannot read 'banana' as a size"):
        numbers.size("hardware.gpu_capacity", "banana")
    with pytest.raises(ConfigError, match="memory.gpu_kv=\\[1\\] is not a size"):
        numbers.size("memory.gpu_kv", [1], allow_auto=True)
    assert numbers.size("memory.gpu_kv", "auto", allow_auto=True) == "auto"
    with pytest.raises(ConfigError, match="hardware.dram_capacity"):
        numbers.size("hardware.dram_capacity", "auto")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 0.0, 1.5, "x", True, [0.5], None])
def test_fraction_refuses_non_finite_and_out_of_range(value):
    with pytest.raises(ConfigError, match="^hardware.gpu_kv_fraction "):
        numbers.fraction("hardware.gpu_kv_fraction", value)


def test_fraction_accepts_its_range():
    assert numbers.fraction("f", 1) == 1.0 and numbers.fraction("f", "0.25") == 0.25
    assert numbers.fraction("f", 0.0, lo_open=False) == 0.0


@pytest.mark.parametrize("value", [99999999999999999999, 2 ** 32, -1, 1.5, True, "7"])
def test_seed_is_a_32_bit_integer(value):
    with pytest.raises(ConfigError, match=r"^seed must be an integer in \[0, 4294967295\]"):
        numbers.seed("seed", value)
    assert numbers.seed("seed", 2 ** 32 - 1) == 2 ** 32 - 1


@pytest.mark.parametrize("value", [-3, 0, 2.5, "5", True, 2 ** 40])
def test_limit_is_null_or_a_positive_integer(value):
    with pytest.raises(ConfigError, match="^exp.accuracy.limit must be"):
        numbers.limit("exp.accuracy.limit", value)
    assert numbers.limit("exp.accuracy.limit", None) is None and numbers.limit("x", 3) == 3


def test_count_names_the_upper_bound_when_it_is_the_problem():
    with pytest.raises(ConfigError, match=r"workload.batch must be <= 2147483647, got 99999999999999999999"):
        numbers.count("workload.batch", 99999999999999999999)
    with pytest.raises(ConfigError, match=r"workload.batch must be >= 1, got 0"):
        numbers.count("workload.batch", 0)


@pytest.mark.parametrize("value, text", [
    (float("inf"), "ratio must be in"), (float("-inf"), "ratio must be in"), ({"ratio": "0.5"}, "must be a number"),
    ({"tokens": 5.5}, "whole number"), ({"tokens": True}, "whole number"), ({"ratio": [0.5]}, "must be a number"),
    ({"ratio": float("nan")}, "ratio must be in"), ({"tokens": "12"}, "whole number"), ({"ratio": 0.1, "tokens": 3}, "not both"),
])
def test_budget_edges_are_one_line(value, text):
    with pytest.raises(ConfigError, match=text):
        Budget.parse(value)


def test_budget_mappings_of_the_right_kind_are_accepted():
    assert Budget.parse({"ratio": 0.5}) == Budget(ratio=0.5)
    assert Budget.parse({"tokens": 12}) == Budget(tokens=12)


@pytest.mark.parametrize("params, text", [
    ({"budget": float("inf")}, "'budget'"), ({"budget": {"tokens": 5.5}}, "'budget'"),
    ({"chunk": 10 ** 20}, "63 bits"), ({"chunk": "²"}, "an integer"), ({"recent_fraction": float("inf")}, "recent_fraction"),
])
def test_method_params_at_the_edges(params, text):
    with pytest.raises(ConfigError, match=text):
        build_method("h2o", **params)


@pytest.mark.parametrize("override, field", [
    ("memory.gpu_kv=1e309GiB", "memory.gpu_kv"), ("memory.gpu_kv=inf", "memory.gpu_kv"), ("memory.gpu_kv=20GiB", None),
    ("hardware.gpu_kv_fraction=nan", "hardware.gpu_kv_fraction"), ("hardware.gpu_kv_fraction=0", "hardware.gpu_kv_fraction"),
    ("seed=99999999999999999999", "seed"), ("seed=-1", "seed"),
    ("exp.accuracy.limit=-3", "exp.accuracy.limit"), ("exp.accuracy.limit=0", "exp.accuracy.limit"),
    ("hardware.gpu_capacity=banana", "hardware.gpu_capacity"), ("hardware.cxl_capacity=-5GB", "hardware.cxl_capacity"),
    ("exp.accuracy.needle_depths=[0,101]", "exp.accuracy.needle_depths[1]"),
    ("exp.accuracy.rolling_prefill=1.0", "exp.accuracy.rolling_prefill"),
    ("exp.accuracy.ruler_lengths=[4096,0]", "exp.accuracy.ruler_lengths[1]"),
    ("workload.batch=99999999999999999999", "workload.batch"),
])
def test_the_preflight_names_the_field(override, field, tmp_path):
    from experiments.preflight import resolve_points

    args = [*TINY, f"results_dir={tmp_path}/r", override]
    if field is None:  # a valid value: accepted
        assert len(resolve_points(args)) == 1
        return
    with pytest.raises(ConfigError) as err:
        resolve_points(args)
    msg = str(err.value)
    assert field in msg and "\n" not in msg
    assert not (tmp_path / "r").exists()


def test_method_budget_inf_and_mappings_through_the_preflight(tmp_path):
    from experiments.preflight import resolve_points

    for value in ("inf", "{ratio:'0.5'}", "{tokens:5.5}", "nan", "-inf"):
        with pytest.raises(ConfigError, match="parameter 'budget'"):
            resolve_points([*TINY, f"results_dir={tmp_path}/r", "method=h2o", f"method.params.budget={value}"])
    assert math.isfinite(numbers.number("x", "3", 0, 5))
