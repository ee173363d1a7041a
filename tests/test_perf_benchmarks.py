"""The benchmarks that use the performance model: projected tables and the GPU script's CPU smoke run."""
from __future__ import annotations

import pytest

from hybridgen import perf as pm


def test_projected_table_script_writes_labelled_outputs(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "benchmarks/projected_table.py", "--profiles", "a100-80gb-cxl,rtx5090",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=pm.PROFILE_DIR.parents[1])
    assert res.returncode == 0, res.stderr[-2000:]
    md = (tmp_path / "projected.md").read_text()
    assert md.startswith("# PROJECTED") and md.count("PROJECTED") >= 3
    rows = (tmp_path / "a100-80gb-cxl.csv").read_text().splitlines()
    assert rows[0].startswith("profile,context,host_share,projected") and len(rows) == 1 + 16
    assert (tmp_path / "rtx5090-e2e.csv").exists()


@pytest.mark.slow
def test_bench_gpu_cpu_smoke_runs(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    env.pop("OUT", None)
    res = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--cpu-smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=pm.PROFILE_DIR.parents[1], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    md = (tmp_path / "bench_gpu.md").read_text()
    assert "CPU SMOKE RUN" in md and "## Targets" in md
    csv_text = (tmp_path / "bench_gpu.csv").read_text()
    for method in ("full", "hybrid-exact", "hybridgen", "flexgen-stream", "flexgen-cpu"):
        assert f",{method}," in csv_text


def test_cpu_branch_benchmark_writes_its_numbers(tmp_path):
    """benchmarks/bench_cpu_scan.py on a tiny shape: the JSON the issue's targets are read from
    (read / scan / branch GB/s, sketch and bf16-limit tokens/s, thread counts, provenance)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "quick.json"
    res = subprocess.run([sys.executable, "benchmarks/bench_cpu_scan.py", "--batch", "1", "--kv-heads", "2",
                          "--tokens", "1024", "--reps", "1", "--copies", "1", "--threads", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=pm.PROFILE_DIR.parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in ("read_gbps", "scan_gbps", "branch_gbps", "sketch_tokens_per_s", "bf16_limit_tokens_per_s"):
        assert data[key] > 0, key
    assert data["threads"] == 1 and set(data["targets_met"]) == {"scan_over_read", "branch_over_read",
                                                                 "sketch_over_bf16_limit", "default_branch_over_read"}
    assert data["ratios"]["scan_over_read"] == pytest.approx(data["scan_gbps"] / data["read_gbps"])
    # the whole CPU branch of hybridgen's default configuration (issue 22): bf16-dot scan + re-rank
    assert data["default_branch_gbps"] > 0 and data["ratios"]["default_branch_over_read"] == pytest.approx(
        data["default_branch_gbps"] / data["read_gbps"])
    assert data["default_config"]["precision"] == "bf16dot" and data["default_config"]["scan_oversample"] == 1.25
    assert data["default_recall"] >= 0.99 and data["default_recall_random"] >= 0.99
    assert "default branch" in data["by_threads"]["1"]["branch_stages_ms"] and "default branch (" in res.stdout
    assert data["code"]["commit"] is None or len(data["code"]["commit"]) == 40
    assert "targets:" in res.stdout and "recall of the exact top-" in res.stdout
