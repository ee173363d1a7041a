"""hybridgen.runtime: the thread/environment settings every entry point applies, and their record."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hybridgen import runtime
from hybridgen.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MANAGED = (*runtime.THREAD_ENV, *runtime.OFFLINE_ENV, runtime.SCAN_THREADS_VAR)


@pytest.fixture
def clean(monkeypatch):
    """No managed variable set, a fresh record, torch's thread count restored afterwards."""
    for key in MANAGED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(runtime, "_record", {})
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


def _fresh_python(code: str, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in MANAGED}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_apply_sets_variables_before_torch_loads_and_thread_counts():
    res = _fresh_python("""
        import json, os, sys
        from hybridgen import runtime
        assert "torch" not in sys.modules
        rec = runtime.apply(torch_threads=1, scan_threads=3)
        import torch
        print(json.dumps({"rec": rec, "torch": torch.get_num_threads(), "scan": runtime.scan_threads(),
                          "env": {k: os.environ.get(k) for k in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY",
                                  "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HYBRIDGEN_SCAN_THREADS")}}))
    """)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["env"] == {"NUMBA_THREADING_LAYER": "workqueue", "OMP_WAIT_POLICY": "passive",
                          "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": None, "HYBRIDGEN_SCAN_THREADS": "3"}
    assert out["torch"] == 1 and out["scan"] == 3
    rec = out["rec"]
    assert rec["applied"] is True and rec["torch_loaded_before"] is False and rec["given"] == []
    assert rec["torch_threads"] == 1 and rec["scan_threads"] == 3
    assert rec["env"]["OMP_WAIT_POLICY"] == "passive" and rec["env"]["HYBRIDGEN_SCAN_THREADS"] == "3"


def test_a_value_already_set_wins_and_is_recorded_as_given(clean):
    clean.setenv("OMP_WAIT_POLICY", "active")
    rec = runtime.apply(offline=False)
    assert os.environ["OMP_WAIT_POLICY"] == "active" and os.environ["NUMBA_THREADING_LAYER"] == "workqueue"
    assert rec["given"] == ["OMP_WAIT_POLICY"] and "HF_HUB_OFFLINE" not in rec["env"]
    assert rec["torch_loaded_before"] is True  # this test process imported torch first
    assert rec["scan_threads"] == torch.get_num_threads()  # no HYBRIDGEN_SCAN_THREADS: follow torch


@pytest.mark.parametrize("bad", ["four", "2.5", "0", "-1"])
def test_bad_scan_threads_is_one_line_config_error(clean, bad):
    clean.setenv("HYBRIDGEN_SCAN_THREADS", bad)
    with pytest.raises(ConfigError) as err:
        runtime.apply()
    msg = str(err.value)
    assert "\n" not in msg and "HYBRIDGEN_SCAN_THREADS" in msg and repr(bad) in msg
    with pytest.raises(ConfigError):
        runtime.scan_threads()  # what the key scan calls per use
    with pytest.raises(ConfigError, match="scan_threads"):
        runtime.apply(scan_threads="x")
    with pytest.raises(ConfigError, match="torch_threads"):
        runtime.apply(torch_threads=0)


def test_bad_scan_threads_at_an_entry_point_prints_one_line_and_exits_2():
    res = _fresh_python("from hybridgen import runtime; runtime.apply_or_exit(); print('ran')",
                        {"HYBRIDGEN_SCAN_THREADS": "lots"})
    assert res.returncode == 2 and "ran" not in res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: HYBRIDGEN_SCAN_THREADS"), res.stderr


def test_recorded_in_the_environment_dict(clean):
    from hybridgen.eval.environment import environment

    assert runtime.record() == {"applied": False}
    runtime.apply(scan_threads=2)
    env = environment()
    assert env["runtime"]["applied"] is True and env["runtime"]["scan_threads"] == 2
    assert env["runtime"]["env"]["NUMBA_THREADING_LAYER"] == "workqueue"
    assert env["env_vars"]["OMP_WAIT_POLICY"] == "passive" and env["env_vars"]["HYBRIDGEN_SCAN_THREADS"] == "2"
    json.dumps(env)  # goes into environment.json as it is


def test_a_second_call_keeps_what_the_first_saw(clean):
    clean.setenv("OMP_WAIT_POLICY", "active")
    runtime.apply()
    rec = runtime.apply(torch_threads=1, scan_threads=1)  # e.g. after the command line was parsed
    assert rec["given"] == ["OMP_WAIT_POLICY"] and rec["torch_threads"] == 1 and rec["scan_threads"] == 1


_FAULTS = """
    import json, resource
    from hybridgen import runtime
    rec = runtime.apply()
    import torch
    x = torch.randn(8, 8192, 128)
    idx = torch.arange(0, 8192, 5)
    def step():  # a decode step's temporaries: two row gathers of 6.7 MB and what is computed from them
        k, v = x.index_select(1, idx), x.index_select(1, idx)
        return (k * 2 + v).sum()
    for _ in range(40):  # warm-up: the heap grows to the steps' high-water mark
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(60):
        step()
    print(json.dumps({"malloc": rec["malloc"], "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 60}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_tuned_malloc_keeps_a_steps_temporaries_off_fresh_pages():
    """Tuned, a step's few-MB temporaries reuse the heap's pages: no page fault per step after
    the warm-up; with HYBRIDGEN_MALLOC_TUNE=0 glibc maps them afresh (~330 faults per step on
    the development VM's glibc 2.36; 80 in some test processes)."""
    tuned = _fresh_python(_FAULTS)
    plain = _fresh_python(_FAULTS, {"HYBRIDGEN_MALLOC_TUNE": "0"})
    assert tuned.returncode == 0 and plain.returncode == 0, (tuned.stderr + plain.stderr)[-2000:]
    t, p = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (tuned, plain))
    assert p["malloc"] == {"applied": False, "why": "HYBRIDGEN_MALLOC_TUNE=0"}
    if not t["malloc"]["applied"]:
        pytest.skip(f"not tuned here: {t['malloc']}")
    assert t["malloc"]["mmap_threshold"] == 32 << 20 and t["malloc"]["trim_threshold"] == 1 << 30
    if p["faults"] < 20:
        pytest.skip(f"this allocator does not fault on these temporaries even untuned ({p['faults']} per step)")
    assert t["faults"] < 5, (t, p)


def test_glibc_variables_win_and_a_bad_switch_fails_before_anything_changes(clean):
    clean.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    clean.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    out = runtime.tune_malloc()
    if out.get("why") != "not glibc":
        assert out["trim_threshold"] == "MALLOC_TRIM_THRESHOLD_=12345"
        assert out["mmap_threshold"] == "GLIBC_TUNABLES" and out["applied"] is True
    clean.setenv("HYBRIDGEN_MALLOC_TUNE", "")  # empty is unset, as the other variables
    assert runtime.tune_malloc().get("why") != "HYBRIDGEN_MALLOC_TUNE=0"
    clean.setenv("HYBRIDGEN_MALLOC_TUNE", "yes")
    with pytest.raises(ConfigError, match="HYBRIDGEN_MALLOC_TUNE must be 1 .* or 0"):
        runtime.apply()
    assert "OMP_WAIT_POLICY" not in os.environ and runtime.record() == {"applied": False}
