"""Task selection: chance vs the reference's interval, and the items a 0.02 paired difference needs."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridgen.errors import ConfigError
from hybridgen.eval.paired import items_to_decide

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments import task_selection as ts  # noqa: E402


def _run(root: Path, name: str, scores, task="t", n_choices=2):
    d = root / f"run-{name}"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"method": {"name": name, "params": {}}}))
    with open(d / "samples.jsonl", "w") as fh:
        for i, s in enumerate(scores):
            fh.write(json.dumps({"task": task, "doc_id": i, "doc": {"choices": [" a"] * n_choices}, "acc": s,
                                 "acc_norm": s}) + "\n")


def test_items_to_decide_follows_the_normal_approximation():
    d = np.array([0] * 180 + [1] * 10 + [-1] * 10)  # 10% discordant items, no mean shift
    n = items_to_decide(d, 0.02)
    assert n == int(np.ceil((1.959964 + 0.841621) ** 2 * d.var(ddof=1) / 0.02 ** 2))
    assert 1900 < n < 2000
    assert items_to_decide(np.zeros(50)) is None  # nothing to scale from
    assert items_to_decide(d, 0.04) == pytest.approx(n / 4, rel=0.01)


def test_a_task_at_chance_is_flagged_and_one_above_is_not(tmp_path):
    rng = np.random.default_rng(0)
    at_chance = (rng.random(400) < 0.5).astype(float)
    _run(tmp_path / "a", "full", at_chance)
    _run(tmp_path / "a", "h2o", np.where(rng.random(400) < 0.1, 1 - at_chance, at_chance))
    rows = ts.selection(*ts.load_runs(tmp_path / "a"))
    assert rows[0]["chance"] == 0.5 and rows[0]["items"] == 400 and not rows[0]["above_chance"]
    assert rows[0]["methods"] == 1 and rows[0]["needed_median"] > 1000
    above = (rng.random(400) < 0.8).astype(float)
    _run(tmp_path / "b", "full", above, n_choices=4)
    rows = ts.selection(*ts.load_runs(tmp_path / "b"))
    assert rows[0]["chance"] == 0.25 and rows[0]["above_chance"] and rows[0]["needed_median"] is None
    assert "no other method run" in ts.markdown(rows, "full", 0.02)
    _run(tmp_path / "b", "hybrid-exact", above, n_choices=4)  # a lossless method: no discordant item
    rows = ts.selection(*ts.load_runs(tmp_path / "b"))
    assert rows[0]["compared"] == 1 and rows[0]["needed_median"] is None
    assert "the 1 other methods agree with `full` on every item" in ts.markdown(rows, "full", 0.02)


def test_no_reference_run_is_one_line(tmp_path):
    _run(tmp_path, "h2o", [1.0, 0.0])
    with pytest.raises(ConfigError, match="no 'full' run"):
        ts.selection(*ts.load_runs(tmp_path))
