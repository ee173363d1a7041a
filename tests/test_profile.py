"""`python -m hybridgen_harness.profile --quick` writes a measured profile with the shipped schema."""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pytest
import torch

from hybridgen import perf as pm
from hybridgen.errors import ConfigError
from hybridgen.perf.profiles import _read_raw
from hybridgen_harness import profile as prof


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "sub" / "me.json"
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    res = subprocess.run([sys.executable, "-m", "hybridgen_harness.profile", "--quick", "--out", str(out), "--name", "ci-box"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res.stdout


def test_quick_profile_has_the_shipped_schema(measured):
    out, stdout = measured
    assert f"wrote {out}" in stdout
    raw = json.loads(out.read_text())
    shipped = _read_raw("h200-host")
    for section in ("gpu", "link", "host"):
        assert set(shipped[section]) <= set(raw[section]), section
    p = pm.load_profile(str(out))
    assert p.name == "ci-box" and p.measured is True
    assert dt.datetime.fromisoformat(p.date).year >= 2024
    assert p.host_info["quick"] is True and p.host_info["torch"] == torch.__version__


def test_quick_profile_measures_the_host(measured):
    p = pm.load_profile(str(measured[0]))
    assert p.host.cores == os.cpu_count()
    assert p.host.dram_read_gbps > 0
    assert len(p.host.numa_nodes) >= 1 and all(n.read_gbps > 0 for n in p.host.numa_nodes)
    for table in (p.host.cpu_attention_gbps, p.host.key_scan_gbps):
        assert set(table) == {"bf16", "fp32"} and all(v > 0 for v in table.values())
    assert p.host.topk_gbps > 0


def test_quick_profile_records_gpu_as_null_without_cuda(measured):
    p = pm.load_profile(str(measured[0]))
    if torch.cuda.is_available():
        assert p.gpu.hbm_gbps > 0 and p.link.h2d_pinned_gbps > 0
        return
    assert p.gpu.hbm_gbps is None and p.link.h2d_pinned_gbps is None and p.link.h2d_pageable_gbps is None
    assert "no CUDA" in p.sources["gpu"]
    with pytest.raises(ConfigError, match="no gpu"):
        pm.predict_step("full", "llama-3.1-8b", pm.Workload(), p)


def test_measure_gpu_is_none_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert prof.measure_gpu(prof.ProfileConfig.quick()) is None


def test_quick_config_is_smaller():
    q, full = prof.ProfileConfig.quick(), prof.ProfileConfig()
    assert q.dram_bytes < full.dram_bytes and q.cpu_tokens < full.cpu_tokens and q.reps <= full.reps


def test_multi_node_measurement_runs_one_pinned_child_per_node(monkeypatch):
    """Two nodes (one CPU-less, like a CXL expander): one child per node, CPU-less -> 'cxl'.

    Binding is impossible on this machine, so each child reports its failure and the entry
    records the error instead of a bandwidth (the parent does not crash)."""
    from hybridgen.kv import numa

    if numa.binding_supported():
        pytest.skip("real multi-node machine: the real path is exercised by the CLI test")
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    fake = [numa.NumaNode(0, cpus, 1 << 30), numa.NumaNode(1, (), 1 << 30)]
    monkeypatch.setattr(numa, "numa_nodes", lambda: fake)
    monkeypatch.setattr(numa, "binding_supported", lambda: True)
    cfg = prof.ProfileConfig(dram_bytes=1 << 20, reps=3)
    nodes = prof.measure_numa_nodes(cfg)
    assert [n["kind"] for n in nodes] == ["dram", "cxl"]
    assert all(n["cpus"] == len(cpus) for n in nodes)  # the CPU-less node is read from node 0's CPUs
    assert all(n["read_gbps"] is None and "error" in n for n in nodes)


def test_cold_cycles_over_copies_larger_than_the_caches():
    """profile_host.cold: consecutive calls hand out distinct copies (equal values) whose bytes
    together reach min_bytes, then start over; a tensor that large already is not copied."""
    from hybridgen_harness.profile_host import cold

    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    per_set = 2 * k.numel() * 4
    nxt = cold((k, v), min_bytes=5 * per_set - 1)
    sets = [nxt() for _ in range(6)]
    assert sets[0][0] is k and sets[0][1] is v and sets[5][0] is k  # 5 sets, then the first again
    ptrs = {s[0].data_ptr() for s in sets[:5]}
    assert len(ptrs) == 5
    assert all(torch.equal(s[0], k) and torch.equal(s[1], v) for s in sets)
    big = cold((k,), min_bytes=k.numel() * 4)
    assert big()[0] is k and big()[0] is k
