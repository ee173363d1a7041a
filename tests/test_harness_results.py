"""Results store and runner: run naming, atomic writes, skip-if-done, force, resume after a
killed sweep, aggregation, and an end-to-end run on a tiny random model."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridgen_harness import result_tables, results  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "NUMBA_THREADING_LAYER": "workqueue"}
TINY = ["model.name=smollm2-135m", "model.weights=random", "model.num_layers=1", "workload.source=random",
        "workload.prompt_len=12", "workload.gen_len=3", "exp.warmup=false", "progress=false"]


def _name(**kw):
    args = dict(model="smollm2-135m", weights="real", method="h2o", key_params={"budget": "0.2"}, batch=1,
                prompt_len=1024, gen_len=32, source="pydoc", seed=0, identity={"a": 1})
    args.update(kw)
    return results.run_name(**args)


def test_run_name_encodes_config_and_is_filesystem_safe():
    n = _name()
    assert n.startswith("smollm2-135m__h2o-budget=0.2__b1-p1024-g32-pydoc__s0__")
    assert "/" not in _name(model="/some/dir/ckpt") and _name(model="/some/dir/ckpt").startswith("ckpt__")
    assert "-dummy__" in _name(weights="dummy")
    assert _name(identity={"a": 2}) != n                    # hash separates configs
    assert _name(identity={"a": 1}) == n                    # and is stable
    assert results.slug("a b/c:d") == "a_b_c_d"


def test_writing_is_atomic_and_never_overwrites_silently(tmp_path):
    store = results.ResultsStore(tmp_path, "exp")
    with pytest.raises(RuntimeError):
        with store.writing("r1") as d:
            (d / "metrics.json").write_text("{}")
            raise RuntimeError("boom")
    assert not store.run_dir("r1").exists() and not store.is_done("r1")
    assert not list(store.exp_dir.glob(".tmp-*"))
    with store.writing("r1") as d:
        (d / "metrics.json").write_text('{"run": {"name": "r1"}, "v": 1}')
    assert store.is_done("r1")
    with pytest.raises(ConfigError, match="force=true"):
        with store.writing("r1"):
            pass
    msgs = []
    with store.writing("r1", force=True, log=msgs.append) as d:
        (d / "metrics.json").write_text('{"run": {"name": "r1"}, "v": 2}')
    assert json.loads((store.run_dir("r1") / "metrics.json").read_text())["v"] == 2
    assert msgs and "replaced" in msgs[0]
    (store.exp_dir / "half").mkdir()
    with pytest.raises(ConfigError, match="no finished run"):
        with store.writing("half", force=True):
            pass


def test_stale_temp_dirs_of_dead_processes_are_cleaned(tmp_path):
    store = results.ResultsStore(tmp_path, "exp")
    store.exp_dir.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = store.exp_dir / f".tmp-run-{results._host()}-{dead.pid}"
    alive = store.exp_dir / f".tmp-run-{results._host()}-{os.getpid()}"
    stale.mkdir(), alive.mkdir()
    removed = store.clean_stale()
    assert stale in removed and not stale.exists() and alive.exists()


def test_aggregate_and_format_table(tmp_path):
    store = results.ResultsStore(tmp_path, "exp")
    for i, m in enumerate(["full", "h2o"]):
        with store.writing(f"r{i}") as d:
            results.write_json(d / "metrics.json", {"run": {"name": f"r{i}"}, "method": {"name": m},
                                                    "latency": {"prefill_s": 0.5 + i}, "x": [1, 2]})
    paths = result_tables.aggregate(tmp_path, "exp")
    import pandas as pd

    df = pd.read_csv(paths["csv"])
    assert list(df["method.name"]) == ["full", "h2o"]
    assert list(df["latency.prefill_s"]) == [0.5, 1.5]
    if "parquet" in paths:
        assert len(pd.read_parquet(paths["parquet"])) == 2
    with pytest.raises(ConfigError, match="no finished runs"):
        result_tables.aggregate(tmp_path, "empty")
    table = result_tables.format_table([{"a": 1.23456, "b": None}, {"a": 2, "b": "x"}])
    assert table.splitlines()[0].split() == ["a", "b"] and "1.235" in table and "-" in table
    lines = table.splitlines()  # right-aligned: every line ends at the same column, None shows as '-'
    assert len({len(x) for x in lines}) == 1 and lines[2].split() == ["1.235", "-"] and lines[3].split() == ["2", "x"]


def _run(args, timeout=300):
    return subprocess.run([sys.executable, "experiments/run.py", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_end_to_end_run_writes_everything_and_skips_when_done(tmp_path):
    args = ["+exp=quickstart", "method=full,hybrid-exact", f"results_dir={tmp_path}", *TINY]
    p = _run(args)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = results.ResultsStore(tmp_path, "quickstart").finished_runs()
    assert len(runs) == 2
    m = json.loads((runs[1] / "metrics.json").read_text())
    for key in ("latency", "throughput", "memory", "transfer", "fidelity", "environment", "hardware"):
        assert m[key] is not None, key
    assert m["latency"]["prefill_s"] > 0 and m["memory"]["host_peak_rss_bytes"] > 0
    assert set(m["memory"]["kv_peak_bytes_by_tier"]) == {"gpu", "dram", "cxl"}
    assert m["fidelity"]["top1_agreement"] == pytest.approx(1.0)      # hybrid-exact is lossless
    assert m["environment"]["packages"]["torch"]
    assert (runs[0] / "config.yaml").read_text().count("method:") == 1
    assert "top1" in p.stdout and "hybrid-exact" in p.stdout           # the end-of-run table
    mtimes = [(r / "metrics.json").stat().st_mtime for r in runs]
    again = _run(args)
    assert again.returncode == 0 and again.stderr.count("skip (done)") == 2
    assert [(r / "metrics.json").stat().st_mtime for r in runs] == mtimes


KILLER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from experiments import run, runner
    orig, calls = runner.write_json, []
    def write_json(path, data):
        if path.name == "metrics.json":
            calls.append(path)
            if len(calls) == 2:
                os._exit(137)          # a hard kill in the middle of the second run
        return orig(path, data)
    runner.write_json = write_json
    sys.exit(run.main({args!r}))
""")


def test_killed_sweep_resumes_only_the_missing_runs(tmp_path):
    args = ["+exp=quickstart", "method=full,h2o,streamingllm", "exp.fidelity=false", f"results_dir={tmp_path}", *TINY]
    k = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT), args=args)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert k.returncode == 137, k.stderr[-2000:]
    store = results.ResultsStore(tmp_path, "quickstart")
    done = store.finished_runs()
    assert len(done) == 1 and "__full__" in done[0].name
    assert len(list(store.exp_dir.glob(".tmp-*"))) == 1        # the killed run left only a temp dir
    first, first_mtime = done[0], (done[0] / "metrics.json").stat().st_mtime
    p = _run(args)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    assert sum(ln.startswith("skip (done)") for ln in lines) == 1 and sum(ln.startswith("run: ") for ln in lines) == 2
    done = store.finished_runs()
    assert len(done) == 3 and not list(store.exp_dir.glob(".tmp-*"))
    assert (first / "metrics.json").stat().st_mtime == first_mtime
    agg = subprocess.run([sys.executable, "experiments/aggregate.py", "quickstart", "--results-dir", str(tmp_path)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert agg.returncode == 0 and "3 run(s)" in agg.stdout


def test_projection_experiment_needs_no_model_run_and_is_labelled(tmp_path):
    p = _run(["+exp=speedup_projected", "hardware=h100", "method=full,hybridgen,flexgen", f"results_dir={tmp_path}"])
    assert p.returncode == 0, p.stderr[-2000:]
    runs = results.ResultsStore(tmp_path, "speedup_projected").finished_runs()
    assert len(runs) == 3
    for r in runs:
        m = json.loads((r / "metrics.json").read_text())
        pr = m["projected"]
        assert pr["projected"] is True and pr["profile"] == "h100-80gb-cxl" and pr["step_s"] > 0
        assert "latency" not in m                      # nothing measured, nothing pretended
    assert "(projected)" in p.stdout
