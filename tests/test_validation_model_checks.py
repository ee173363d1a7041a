"""Parameters against the model (issue 25, item 6): refused or warned, as experiments/model_checks.py decides."""
from __future__ import annotations

import contextlib
import io

import pytest

from experiments import model_checks
from experiments.preflight import resolve_points
from hybridgen.errors import ConfigError

BASE = ["model.weights=random", "workload.source=random", "workload.prompt_len=8", "workload.gen_len=2"]


def _resolve(tmp_path, *extra):
    model_checks._WARNED.clear()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        pts = resolve_points([*BASE, f"results_dir={tmp_path}/r", *extra])
    return pts, err.getvalue()


@pytest.mark.parametrize("method, layers, dense", [("quest", 2, 5), ("quest", 2, 2), ("magicpig", 1, 1), ("quest", 3, 7)])
def test_explicit_dense_layers_covering_the_model_are_refused(method, layers, dense, tmp_path):
    with pytest.raises(ConfigError, match=rf"method '{method}': dense_layers={dense} covers all {layers} layer"):
        _resolve(tmp_path, f"method={method}", f"model.num_layers={layers}", f"method.params.dense_layers={dense}")
    assert not (tmp_path / "r").exists()


def test_dense_layers_below_the_model_are_accepted_silently(tmp_path):
    _, err = _resolve(tmp_path, "method=quest", "model.num_layers=3", "method.params.dense_layers=2")
    assert "warning" not in err


def test_a_default_dense_layers_covering_a_cut_model_is_a_stated_warning(tmp_path):
    pts, err = _resolve(tmp_path, "method=quest", "model.num_layers=2")
    assert len(pts) == 1
    assert err.count("warning: method 'quest': its default dense_layers=2 covers all 2 layer(s)") == 1


def test_more_layers_than_the_model_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="model.num_layers=31 exceeds smollm2-135m's 30 layers"):
        _resolve(tmp_path, "model.num_layers=31")


@pytest.mark.parametrize("extra, text", [
    (["method=snapkv", "method.params.budget=64t"], "budget 64t >= the context (10 tokens)"),
    (["method=streamingllm", "method.params.sinks=12"], "sinks = 12 >= the context"),
    (["method=snapkv", "method.params.window=10"], "window = 10 >= the context"),
])
def test_windows_and_budgets_past_the_context_are_warned(extra, text, tmp_path):
    pts, err = _resolve(tmp_path, "model.num_layers=1", *extra)
    assert len(pts) == 1 and text in err and "every token is kept" in err


def test_a_budget_inside_the_context_says_nothing(tmp_path):
    _, err = _resolve(tmp_path, "model.num_layers=1", "method=snapkv", "method.params.budget=0.5",
                      "workload.prompt_len=64", "method.params.window=8")
    assert "warning" not in err
