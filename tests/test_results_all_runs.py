"""``hybridgen_harness.plotdata.all_runs``: every experiment's finished runs in one DataFrame."""

from hybridgen_harness import results
from hybridgen_harness import plotdata


def _run(store, name, method, **metrics):
    with store.writing(name) as d:
        results.write_json(d / "metrics.json", {"run": {"name": name}, "method": {"name": method}, **metrics})


def test_all_runs_joins_experiments_with_an_exp_column(tmp_path):
    a, b = results.ResultsStore(tmp_path, "speedup"), results.ResultsStore(tmp_path, "accuracy")
    _run(a, "s-full", "full", latency={"decode_s": 1.0})
    _run(a, "s-h2o", "h2o", latency={"decode_s": 0.5})
    _run(b, "a-full", "full", accuracy={"acc": 0.4})
    (tmp_path / "empty").mkdir()                      # an experiment with no finished run
    half = tmp_path / "speedup" / "half"              # a run that never finished (no DONE marker)
    half.mkdir()
    (half / "metrics.json").write_text("{}")
    df = plotdata.all_runs(tmp_path)
    assert list(df.columns[:1]) == ["exp"]
    assert sorted(zip(df["exp"], df["run.name"])) == [("accuracy", "a-full"), ("speedup", "s-full"),
                                                      ("speedup", "s-h2o")]
    row = df.set_index("run.name")
    assert row.loc["s-h2o", "latency.decode_s"] == 0.5 and row.loc["a-full", "accuracy.acc"] == 0.4
    assert row["accuracy.acc"].isna().sum() == 2      # columns are the union; missing ones are NaN
    assert plotdata.experiments(tmp_path) == ["accuracy", "speedup"]
    only = plotdata.all_runs(tmp_path, exps=["speedup"])
    assert set(only["exp"]) == {"speedup"} and len(only) == 2


def test_all_runs_of_nothing_is_an_empty_frame(tmp_path):
    df = plotdata.all_runs(tmp_path / "missing")
    assert len(df) == 0 and list(df.columns) == ["exp"]
