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


def test_all_runs_of_nothing_is_refused_in_one_line_naming_the_directory(tmp_path):
    """Issue 26: a wrong path used to return an empty frame without a word."""
    import pytest

    from hybridgen.errors import ConfigError

    for root, exps in ((tmp_path / "missing", None), (tmp_path, None), (tmp_path, ["speedup"])):
        with pytest.raises(ConfigError) as info:
            plotdata.all_runs(root, exps=exps)
        msg = str(info.value)
        assert "\n" not in msg and str(root.resolve()) in msg and "all_runs('outputs')" in msg


def test_all_runs_says_which_directory_it_read(tmp_path, caplog):
    import logging

    _run(results.ResultsStore(tmp_path, "quickstart"), "q-full", "full")
    with caplog.at_level(logging.INFO, logger="hybridgen_harness.plotdata"):
        df = plotdata.all_runs(tmp_path)
    assert df.attrs["results_dir"] == str(tmp_path.resolve())
    assert f"1 run(s) of 1 experiment(s) from {tmp_path.resolve()} (given)" in caplog.text


def test_all_runs_outside_a_checkout_reads_the_current_directory_not_the_installed_one(tmp_path, monkeypatch):
    import pytest

    from hybridgen.errors import ConfigError

    monkeypatch.delenv("HYBRIDGEN_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)                       # no conf/config.yaml here or above
    with pytest.raises(ConfigError) as info:          # not this checkout's committed results/
        plotdata.all_runs()
    assert str(tmp_path.resolve() / "results") in str(info.value)
    _run(results.ResultsStore(tmp_path / "results", "quickstart"), "q-full", "full")
    assert plotdata.all_runs().attrs["results_dir"] == str((tmp_path / "results").resolve())
