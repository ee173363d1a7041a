"""No silent overwrite, no lost measurement: the run lock, two identical runs started together,
a SIGKILL in the middle of a sweep and its resume, damaged metrics files, a failing sweep point,
run identity (realized hardware, code version) and the unlimited fidelity reference."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybridgen_harness import result_tables, results  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402
from tests._inprocess import run_main as _main  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "NUMBA_THREADING_LAYER": "workqueue", "OMP_NUM_THREADS": "1"}
TINY = ["model.weights=random", "model.num_layers=1", "workload.source=random", "workload.prompt_len=8",
        "workload.gen_len=3", "exp.warmup=false", "progress=false"]


# ------------------------------------------------------------------------------ the lock
HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from hybridgen_harness.results import ResultsStore, write_json
    store = ResultsStore({tmp!r}, "exp")
    with store.writing("r1") as d:
        write_json(d / "metrics.json", {{"run": {{"name": "holder"}}}})
        print("holding", flush=True)
        time.sleep({hold})
""")


def test_a_second_writer_waits_for_the_lock_then_finds_the_run_finished(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), tmp=str(tmp_path), hold=1.5)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    store = results.ResultsStore(tmp_path, "exp")
    msgs = []
    t0 = time.perf_counter()
    with store.locked("r1", log=msgs.append):
        waited = time.perf_counter() - t0
        assert store.is_done("r1")                                   # the holder finished first
        with pytest.raises(ConfigError, match="force=true"):          # and nothing replaces it without force
            with store.writing("r1", log=msgs.append):
                pass
    assert holder.wait(30) == 0
    assert waited > 0.5 and msgs and msgs[0].startswith("waiting: another process is running")
    assert not any("replaced" in m for m in msgs)
    assert json.loads((store.run_dir("r1") / "metrics.json").read_text()) == {"run": {"name": "holder"}}
    assert not list(store.exp_dir.glob(".lock-*")) and not list(store.exp_dir.glob(".tmp-*"))


def test_a_killed_lock_holder_does_not_block_and_leaves_nothing_finished(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), tmp=str(tmp_path), hold=60)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(30)
    store = results.ResultsStore(tmp_path, "exp")
    assert not store.is_done("r1") and len(list(store.exp_dir.glob(".tmp-*"))) == 1
    msgs = []
    with store.writing("r1", log=msgs.append) as d:              # the kernel released the dead holder's lock
        results.write_json(d / "metrics.json", {"run": {"name": "second"}})
    assert store.is_done("r1") and not msgs
    assert store.clean_stale() and not list(store.exp_dir.glob(".tmp-*"))


def test_replacing_needs_force_and_only_then_says_replaced(tmp_path):
    store = results.ResultsStore(tmp_path, "exp")
    with store.writing("r1") as d:
        results.write_json(d / "metrics.json", {"run": {"name": "r1"}, "v": 1})
    msgs = []
    with pytest.raises(ConfigError, match="already finished; pass force=true"):
        with store.writing("r1", log=msgs.append):
            pass
    assert msgs == []
    with store.writing("r1", force=True, log=msgs.append) as d:
        results.write_json(d / "metrics.json", {"run": {"name": "r1"}, "v": 2})
    assert msgs == [f"replaced finished run {store.run_dir('r1')} (force=true)"]


def test_a_failed_run_leaves_no_directory_behind(tmp_path):
    root = tmp_path / "new-results"
    store = results.ResultsStore(root, "exp")
    with pytest.raises(RuntimeError):
        with store.writing("r1"):
            raise RuntimeError("boom")
    assert not root.exists()                                     # nothing written, not even empty dirs


# ------------------------------------------------------------------------------ damaged metrics
def test_damaged_metrics_count_as_unfinished_are_named_and_redone(tmp_path):
    store = results.ResultsStore(tmp_path, "exp")
    for name in ("good", "cut"):
        with store.writing(name) as d:
            results.write_json(d / "metrics.json", {"run": {"name": name}})
    (store.run_dir("cut") / "metrics.json").write_text('{"run": {"na')
    assert store.state("cut")[0] == "damaged" and not store.is_done("cut")
    assert [d.name for d in store.finished_runs()] == ["good"]
    assert [(d.name, "not valid JSON" in why) for d, why in store.damaged_runs()] == [("cut", True)]
    with pytest.raises(ConfigError, match="cut/metrics.json is not valid JSON"):
        results.load_run(store.run_dir("cut"))
    msgs = []
    paths = result_tables.aggregate(tmp_path, "exp", log=msgs.append)
    assert "cut" in msgs[0] and "metrics.json" in msgs[0] and paths["csv"].exists()
    with store.writing("cut", log=msgs.append) as d:             # redone without force, and said so
        results.write_json(d / "metrics.json", {"run": {"name": "cut"}})
    assert store.is_done("cut") and msgs[-1].startswith(f"re-ran damaged run {store.run_dir('cut')}")


def test_check_writable_creates_nothing(tmp_path):
    results.check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        results.check_writable(tmp_path / "f" / "sub")
    with pytest.raises(ConfigError, match="not writable"):
        results.check_writable("/proc/hybridgen-results")


# ------------------------------------------------------------------------------ whole runs
def test_two_identical_runs_started_together_give_one_result_and_no_replaced_line(tmp_path):
    """Must-show: `python experiments/run.py method=h2o results_dir=D ...` started twice at once."""
    args = ["experiments/run.py", "method=h2o", f"results_dir={tmp_path}", *TINY, "workload.gen_len=24"]
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    logs = [o + e for o, e in outs]
    assert not any("replaced" in log or "force=true" in log.replace("force=true re-runs", "") for log in logs)
    assert sum(log.count("\nrun: ") + log.startswith("run: ") for log in logs) == 1      # one computed ...
    assert sum(log.count("skip (done") for log in logs) == 1                              # ... one reused
    store = results.ResultsStore(tmp_path, "adhoc")
    assert len(store.finished_runs()) == 1
    assert not list(store.exp_dir.glob(".tmp-*")) and not list(store.exp_dir.glob(".lock-*"))


KILL_ARGS = ["+exp=quickstart", "method=full,h2o,streamingllm", "exp.fidelity=false", *TINY, "workload.gen_len=40"]


def test_sigkill_mid_sweep_then_resume_completes_only_the_missing_runs(tmp_path):
    args = [*KILL_ARGS, f"results_dir={tmp_path}"]
    p = subprocess.Popen([sys.executable, "experiments/run.py", *args], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = results.ResultsStore(tmp_path, "quickstart")
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if len(store.finished_runs()) == 1 and list(store.exp_dir.glob(".tmp-*")):
            break                                    # the first run is done, the second is being written
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    done = store.finished_runs()
    assert p.returncode == -signal.SIGKILL and len(done) == 1, "the sweep finished before it could be killed"
    first, first_bytes = done[0], (done[0] / "metrics.json").read_bytes()
    rc, out, err = _main(args)                       # resume in this process
    assert rc == 0, err[-2000:]
    lines = err.splitlines()
    assert sum(ln.startswith("skip (done)") for ln in lines) == 1 and sum(ln.startswith("run: ") for ln in lines) == 2
    assert len(store.finished_runs()) == 3 and not list(store.exp_dir.glob(".tmp-*"))
    assert (first / "metrics.json").read_bytes() == first_bytes            # the finished run was not touched
    assert "replaced" not in err


def test_a_failing_point_does_not_stop_the_others_unless_fail_fast(tmp_path):
    # full does not fit 10 KB of GPU tier; streamingllm (20% budget) does, and its fidelity reference
    # (full) runs without the tier limits, so its measurement is kept
    args = ["method=full,streamingllm", "hardware.gpu_capacity=10KB", "exp.fidelity=true",
            f"results_dir={tmp_path}", *TINY]
    rc, out, err = _main(args)
    assert rc == 2
    table = out.split("generated text")[0]
    assert "failed" in table and "done" in table and "streamingllm" in table
    assert "error: tier 'gpu' cannot hold" in err
    store = results.ResultsStore(tmp_path, "adhoc")
    (run,) = store.finished_runs()
    m = results.load_run(run)
    assert m["method"]["name"] == "streamingllm"
    assert m["fidelity"]["available"] is True and m["fidelity"]["reference_store"] == "unlimited tiers"
    rc, out, err = _main([*args, "fail_fast=true", "force=true"])
    assert rc == 2 and "streamingllm" not in out                        # stopped at the first point


def test_run_identity_names_the_realized_hardware_and_records_code_and_kernels(tmp_path):
    from experiments import point, preflight
    from hybridgen.eval.provenance import code_version, realized_device

    (pt, cfg), = preflight.resolve_points(["method=hybridgen", f"results_dir={tmp_path}", *TINY])
    name = point.name_of(cfg)
    device = realized_device()
    assert f"__{results.slug(device, 40)}-fp32-L1__" in name
    ident = point.identity(cfg)
    assert ident["realized"] == {"device": device, "dtype": "float32", "num_layers": 1}
    (_, cfg2), = preflight.resolve_points(["method=hybridgen", f"results_dir={tmp_path}", *TINY, "model.dtype=bfloat16"])
    assert point.name_of(cfg2) != name and "-bf16-L1__" in point.name_of(cfg2)
    rc, out, err = _main(["method=hybridgen", f"results_dir={tmp_path}", *TINY])
    assert rc == 0, err[-2000:]
    m = results.load_run(results.ResultsStore(tmp_path, "adhoc").run_dir(name))
    assert m["run"]["code"] == code_version() and m["run"]["realized"]["device"] == device
    k = m["kernels"]
    from hybridgen.attention.cpu_scan import SCAN_BACKENDS

    assert k["cpu_scan"] in set(SCAN_BACKENDS) - {"auto"} and set(k["cuda_attention"]) <= {"flash", "cupy", "torch"}


def test_a_run_from_another_commit_is_reused_with_a_visible_note(tmp_path):
    args = ["method=full", f"results_dir={tmp_path}", *TINY]
    rc, _, err = _main(args)
    assert rc == 0, err[-2000:]
    (run,) = results.ResultsStore(tmp_path, "adhoc").finished_runs()
    m = json.loads((run / "metrics.json").read_text())
    m["run"]["code"] = {"commit": "0" * 40, "dirty": False}
    (run / "metrics.json").write_text(json.dumps(m))
    rc, out, err = _main(args)
    assert rc == 0
    assert "measured at code 00000000" in err and "force=true re-runs it" in err
    assert "note: skipped" in out and "00000000" in out


def test_hardware_threads_is_applied(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        rc, _, err = _main(["method=full", f"results_dir={tmp_path}", *TINY, "hardware.threads=1"])
        assert rc == 0, err[-2000:]
        (run,) = results.ResultsStore(tmp_path, "adhoc").finished_runs()
        assert results.load_run(run)["run"]["threads"]["torch"] == 1
    finally:
        torch.set_num_threads(before)


def test_profile_checks_out_before_measuring_and_never_overwrites_silently(tmp_path, capsys):
    from hybridgen_harness import profile

    out = tmp_path / "p.json"
    out.write_text("{}")
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as ei:
        profile.main(["--quick", "--out", str(out)])
    assert ei.value.code == 2 and time.perf_counter() - t0 < 2          # refused before measuring
    assert "already exists; pass --force" in capsys.readouterr().err and out.read_text() == "{}"
    profile.check_out(out, force=True)                                  # --force is the way to replace it
