"""Outputs and paths (issue 25, items 5 and 7): zero-point sweeps, unfinished metrics, every output
path checked before the work and never overwritten without --force, strict benchmark flags."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hybridgen_harness import results  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402
from hybridgen.validation import paths  # noqa: E402

TINY = ["model.weights=random", "model.num_layers=1", "workload.source=random", "workload.prompt_len=8",
        "workload.gen_len=2", "exp.warmup=false", "progress=false"]


def _call(fn, *args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn(*args)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


# ---------------------------------------------------------------- zero-point sweeps
@pytest.mark.parametrize("sweep, named", [("method=glob(zz*)", "method=glob(zz*)"),
                                          ("workload.batch=range(5,1)", "workload.batch=range(5,1)"),
                                          ("seed=range(3,3)", "seed=range(3,3)")])
def test_a_sweep_of_no_point_exits_2_with_one_line(sweep, named, tmp_path):
    from experiments import run

    rc, _, err = _call(run.main, [sweep, *TINY, f"results_dir={tmp_path}/r"])
    assert rc == 2
    line = _one_error_line(err)
    assert named in line and "expands to no point" in line
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- a finished run's metrics
@pytest.mark.parametrize("text", ["{}", '{"run": {}}', '{"run": {"name": ""}}', '{"run": "x"}', '{"v": 1}'])
def test_metrics_without_what_a_finished_run_writes_are_damaged(text, tmp_path):
    store = results.ResultsStore(tmp_path, "exp")
    d = store.run_dir("r1")
    d.mkdir(parents=True)
    (d / results.DONE).write_text("x\n")
    (d / results.METRICS).write_text(text)
    state, why = store.state("r1")
    assert state == "damaged" and "lacks what a finished run writes" in why
    assert store.finished_runs() == [] and store.damaged_runs()[0][0] == d
    with store.writing("r1", log=lambda m: None) as tmp:  # re-run: replaced without force
        results.write_json(tmp / results.METRICS, {"run": {"name": "r1"}})
    assert store.is_done("r1")


# ---------------------------------------------------------------- paths
def test_tilde_is_expanded_by_the_check_and_by_the_store_alike(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    results.check_writable("~/x")
    store = results.ResultsStore("~/x", "exp")
    assert store.root == tmp_path / "home" / "x"
    with store.writing("r1") as d:
        results.write_json(d / results.METRICS, {"run": {"name": "r1"}})
    assert (tmp_path / "home" / "x" / "exp" / "r1").is_dir() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("value", ["", "   ", None])
def test_an_empty_path_is_refused(value):
    with pytest.raises(ConfigError, match="results_dir is empty"):
        results.check_writable(value)


def test_a_dangling_link_a_file_a_read_only_and_a_full_file_system_are_one_line(tmp_path, monkeypatch):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"link is a symbolic link to nothing|symbolic link to nothing"):
        results.check_writable(link / "sub")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        results.check_writable(tmp_path / "afile" / "sub")

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(results.tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigError, match=f"{tmp_path}/ro is not writable .*Read-only file system"):
        results.check_writable(tmp_path / "ro")
    monkeypatch.undo()
    monkeypatch.setattr(results.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096})())
    with pytest.raises(ConfigError, match="is full"):
        results.check_writable(tmp_path / "full")


def test_results_dir_empty_or_dangling_through_the_entry_point(tmp_path):
    from experiments import run

    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for value, text in (("''", "results_dir is empty"), (f"{tmp_path}/dangling/r", "symbolic link to nothing")):
        rc, _, err = _call(run.main, [*TINY, f"results_dir={value}"])
        assert rc == 2 and text in _one_error_line(err)
    assert not (tmp_path / "gone").exists()


def test_check_output_file_never_overwrites_without_force(tmp_path):
    f = tmp_path / "out.json"
    assert paths.check_output_file("--json", f) == f
    f.write_text("keep")
    with pytest.raises(ConfigError, match="already exists; pass --force"):
        paths.check_output_file("--json", f)
    assert paths.check_output_file("--json", f, force=True) == f
    with pytest.raises(ConfigError, match="is a directory"):
        paths.check_output_file("--json", tmp_path)
    assert f.read_text() == "keep"


# ---------------------------------------------------------------- the scripts
def test_perf_validate_json_is_not_overwritten_without_force(tmp_path):
    from hybridgen_harness.perf import validate

    out = tmp_path / "v.json"
    out.write_text("keep")
    rc, _, err = _call(validate.main, ["--json", str(out), "--quick", "--no-local", "--probe-dir", str(tmp_path)])
    assert rc == 2 and "already exists; pass --force" in _one_error_line(err) and out.read_text() == "keep"
    rc, _, err = _call(validate.main, ["--jso", str(out), "--quick"])  # no prefix matching
    assert rc == 2 and out.read_text() == "keep"


def test_bench_gpu_flags_are_exact_and_its_results_are_kept(tmp_path):
    from benchmarks.gpu import main as bench

    out = tmp_path / "smoke"
    out.mkdir()
    (out / "bench_gpu.csv").write_text("committed")
    rc, _, err = _call(bench.main, ["--cpu-smok", "--out", str(out)])
    assert rc == 2 and "unrecognized arguments: --cpu-smok" in err
    rc, _, err = _call(bench.main, ["--cpu-smoke", "--out", str(out)])
    assert rc == 2 and "already holds bench_gpu.csv; pass --force" in _one_error_line(err)
    for flags, text in ((["--budget-s", "-1"], "--budget-s must be >= 0"), (["--budget-s", "nan"], "finite"),
                        (["--contexts", "256,-5"], "--contexts values must be > 0"),
                        (["--shares", "0.5,1.5"], "--shares values must be in (0, 1]"),
                        (["--torch-threads", "-2"], "--torch-threads must be >= 0")):
        rc, _, err = _call(bench.main, ["--cpu-smoke", "--out", str(tmp_path / "new"), *flags])
        assert rc == 2 and text in _one_error_line(err), flags
    assert (out / "bench_gpu.csv").read_text() == "committed" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("script", ["bench_baselines", "bench_cpu_pool", "bench_cpu_scan", "bench_fixed_cost",
                                    "bench_foundation", "bench_sketch_recall", "projected_table"])
def test_every_benchmark_refuses_abbreviated_flags_and_negative_numbers(script):
    import importlib

    mod = importlib.import_module(f"benchmarks.{script}")
    rc, _, err = _call(mod.main, ["--nosuch-flag"])
    assert rc == 2 and "unrecognized arguments" in err
    import argparse

    from hybridgen.validation.cli import check_numbers

    with pytest.raises(ConfigError, match="--reps must be >= 0"):
        check_numbers(argparse.Namespace(reps=-1, quick=True))
    with pytest.raises(ConfigError, match="--tokens must be >= 0"):
        check_numbers(argparse.Namespace(tokens=[4096, -1]))


def test_json_outputs_of_benchmarks_are_kept(tmp_path):
    from benchmarks import bench_fixed_cost

    out = tmp_path / "f.json"
    out.write_text("keep")
    rc, _, err = _call(bench_fixed_cost.main, ["--json", str(out)])
    assert rc == 2 and "already exists; pass --force" in _one_error_line(err) and out.read_text() == "keep"


def test_a_negative_or_nan_probe_time_is_refused():
    from hybridgen_harness.perf.probe_rows import Row

    assert Row("copy", "probe.json", 1.0, 2.0).error_pct == -50.0
    for bad in (-0.5, 0.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="probe.json: the measured time of 'copy'"):
            Row("copy", "probe.json", 1.0, bad)


# ---------------------------------------------------------------- hybridgen-lm-eval
def test_lm_eval_output_path_and_device_are_checked_before_the_work(tmp_path):
    import _reliability_models as rm
    from hybridgen.eval import lm_eval_cli

    ckpt = rm.write_checkpoint(tmp_path / "ckpt")
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["--model", "hybridgen", "--model_args", f"model={ckpt}", "--tasks", "hg_ppl_pydoc", "--limit", "1"]
    rc, _, err = _call(lm_eval_cli.main, [*base, "--output_path", str(afile)])
    assert rc == 2 and "is a file, not a directory" in _one_error_line(err)
    rc, _, err = _call(lm_eval_cli.main, [*base, "--output_path", "/proc/nowhere/out"])
    assert rc == 2 and "--output_path=/proc/nowhere/out is not writable" in _one_error_line(err)
    import torch

    if not torch.cuda.is_available():
        rc, _, err = _call(lm_eval_cli.main, [*base, "--device", "cuda:3"])
        assert rc == 2 and "CUDA is not available" in _one_error_line(err)
    rc, _, err = _call(lm_eval_cli.main, [*base, "--device", "tpu"])
    assert rc == 2 and "unknown device 'tpu'" in _one_error_line(err)
    assert afile.read_text() == "x"


def test_the_lm_eval_adapter_passes_its_device_to_the_engine(tmp_path):
    import _reliability_models as rm
    from hybridgen.eval.lm_eval_model import HybridGenLM

    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        HybridGenLM(model=str(rm.write_checkpoint(tmp_path / "ckpt")), engine_device="tpu", progress=False)
    from test_eval_lm_adapter import _byte_tokenizer

    ok = rm.write_checkpoint(tmp_path / "ok")
    _byte_tokenizer().save_pretrained(ok)
    lm = HybridGenLM(model=str(ok), device="cuda:0", progress=False)  # lm-eval's default device: not the engine's
    assert lm.engine.device.type in ("cpu", "cuda")


def test_lm_eval_run_that_saved_nothing_is_detected(tmp_path):
    from hybridgen.eval.lm_eval_cli import saved_results

    out = tmp_path / "o" / "run" / "results.json"
    assert not saved_results(str(out), 0.0)
    out.parent.mkdir(parents=True)
    (out.parent / "results_2026-01-01.json").write_text(json.dumps({}))
    assert saved_results(str(out), 0.0) and not saved_results(str(out), os.path.getmtime(out.parent) + 100)


def test_bench_baselines_takes_method_parameters_and_refuses_bad_ones_before_loading_a_model():
    from benchmarks import bench_baselines

    m = bench_baselines._make("hybridgen:gpu_budget=0.07:topk_ratio=0.05", "0.2")
    assert (m.name, str(m.gpu_budget), m.topk_ratio) == ("hybridgen", "0.07", 0.05)
    m = bench_baselines._make("flexgen-int4:compress_gpu_kv=true", "0.2")  # a preset, then a parameter on top
    assert m.compress_kv and m.compress_gpu_kv
    for spec, text in (("hybridgen:gpu_budget", "is not key=value"), ("h2o:nosuch=1", "has no parameter 'nosuch'"),
                       ("h2o:budget=2x", "budget")):
        rc, _, err = _call(bench_baselines.main, ["--methods", spec, "--model", "nosuch-model"])
        assert rc == 2 and text in _one_error_line(err), spec
