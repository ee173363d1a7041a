"""Performance model: shipped profiles, validation, monotonicity, bytes, overlap semantics."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hybridgen import perfmodel as pm
from hybridgen.errors import ConfigError, HybridGenError

LLAMA8B = pm.ModelShape(name="llama-3.1-8b-shape", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, vocab_size=128256)
PAPER_PROFILES = ("a100-80gb", "h100-80gb", "rtx5090")


def test_all_shipped_profiles_load_and_validate():
    names = pm.available_profiles()
    expected = {p + s for p in (*PAPER_PROFILES, "h200-host") for s in ("", "-cxl")}
    assert expected <= set(names)
    assert not any(n.startswith("_") for n in names)
    for name in names:
        prof = pm.load_profile(name)
        assert prof.name == name and prof.measured is False
        assert prof.gpu.hbm_gbps > prof.gpu.attention_gbps > 0
        assert prof.link.h2d_pinned_gbps > prof.link.h2d_pageable_gbps > 0
        assert prof.host.dram_read_gbps > 0 and prof.host.cores > 0
        assert (prof.cxl is not None) == name.endswith("-cxl")
        kinds = [n.kind for n in prof.host.numa_nodes]
        assert kinds.count("dram") == 1 and kinds.count("cxl") == (1 if prof.cxl else 0)
        if prof.cxl:
            assert prof.cxl.read_gbps < prof.host.dram_read_gbps
            assert 100 <= prof.cxl.added_latency_ns <= 200
            assert any("CXL" in s or "cxl" in k for k, s in prof.sources.items())


def test_h200_profile_carries_the_measured_host_numbers():
    prof = pm.load_profile("h200-host")
    assert prof.link.h2d_pinned_gbps == 55 and prof.link.h2d_pageable_gbps == 18.6
    assert prof.host.dram_read_gbps == 152
    assert 60 <= prof.host.cpu_attention_gbps["bf16"] <= 76


def test_cxl_variant_extends_its_base():
    base, cxl = pm.load_profile("a100-80gb"), pm.load_profile("a100-80gb-cxl")
    assert cxl.gpu == base.gpu and cxl.link == base.link
    assert cxl.host.dram_read_gbps == base.host.dram_read_gbps
    assert "cxl.read_gbps" in cxl.sources and "gpu.hbm_gbps" in cxl.sources


def test_bad_profile_name_lists_choices():
    with pytest.raises(ConfigError) as err:
        pm.load_profile("a100-40gb")
    msg = str(err.value)
    assert "a100-40gb" in msg and "a100-80gb" in msg and "h200-host" in msg
    assert "\n" not in msg


def _h200_raw():
    return pm._read_raw("h200-host")


def test_profile_without_a_source_is_rejected(tmp_path):
    raw = _h200_raw()
    del raw["sources"]["gpu.hbm_gbps"]
    with pytest.raises(ConfigError, match="gpu.hbm_gbps"):
        pm.profile_from_dict(raw)


@pytest.mark.parametrize("mutate,needle", [
    (lambda r: r["link"].__setitem__("h2d_pinned_gbps", -1), "h2d_pinned_gbps"),
    (lambda r: r["gpu"].__setitem__("hbm_tbps", 4.8), "unknown keys"),
    (lambda r: r["host"].pop("cores"), "lacks cores"),
    (lambda r: r.pop("sources"), "lacks sources"),
])
def test_profile_validation_errors(mutate, needle):
    raw = _h200_raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=needle):
        pm.profile_from_dict(raw)


def test_profile_file_roundtrip(tmp_path):
    prof = pm.load_profile("h100-80gb-cxl")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    again = pm.load_profile(str(path))
    assert again == prof


def test_missing_profile_file_is_a_user_error(tmp_path):
    with pytest.raises(HybridGenError, match="hybridgen.profile"):
        pm.load_profile(str(tmp_path / "nope.json"))


def test_predictions_are_labelled_projected():
    pred = pm.predict_step("hybridgen", LLAMA8B, pm.Workload(), "h200-host")
    assert pred.projected is True
    assert "projected" in str(pred)
    assert pred.total_s > 0 and pred.tokens_per_s(8) > 0


@pytest.mark.parametrize("method", sorted(pm.METHODS))
def test_more_context_is_slower(method):
    times = [pm.predict_step(method, LLAMA8B, pm.Workload(context=s), "h100-80gb-cxl")
             for s in (8192, 16384, 32768, 65536)]
    for a, b in zip(times, times[1:]):
        assert b.total_s > a.total_s
        assert b.attention_layer_s > a.attention_layer_s


def test_more_host_share_makes_flexgen_stream_slower():
    times = [pm.predict_step("flexgen", LLAMA8B, pm.Workload(host_share=h), "a100-80gb").attention_layer_s
             for h in (0.5, 0.75, 0.9, 0.95)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]


def test_hybridgen_ships_topk_rows_flexgen_ships_the_host_kv():
    w = pm.Workload(batch=8, context=32768, host_share=0.9, topk_ratio=0.05, per_head=False)
    hg = pm.predict_step("hybridgen", LLAMA8B, w, "h200-host").breakdown
    fg = pm.predict_step("flexgen", LLAMA8B, w, "h200-host").breakdown
    S_h = round(0.9 * 32768)
    k = math.ceil(0.05 * S_h)
    B, Hq, Hkv, D, b = 8, 32, 8, 128, 2
    assert hg["topk_tokens"] == k
    assert hg["h2d_bytes"] == B * k * (Hq * 4 + Hkv * D * b)       # fp32 logits + shared V rows
    assert fg["h2d_bytes"] == B * S_h * 2 * Hkv * D * b             # K and V of every host token
    per_head = pm.predict_step("hybridgen", LLAMA8B, dataclasses.replace(w, per_head=True), "h200-host").breakdown
    assert per_head["h2d_bytes"] == B * k * (Hq * 4 + Hq * D * b)
    assert fg["h2d_bytes"] / hg["h2d_bytes"] > 10


def _with_host(profile, **host):
    prof = pm.load_profile(profile)
    return dataclasses.replace(prof, host=dataclasses.replace(prof.host, **host))


def test_hybridgen_overlap_is_a_max_of_branches():
    w = pm.Workload(context=32768, host_share=0.9)
    slow_cpu = _with_host("h200-host", key_scan_gbps={"bf16": 5.0})
    fast_cpu = _with_host("h200-host", key_scan_gbps={"bf16": 5000.0}, topk_gbps=5000.0, dram_read_gbps=5000.0)
    faster_cpu = _with_host("h200-host", key_scan_gbps={"bf16": 50000.0}, topk_gbps=50000.0, dram_read_gbps=50000.0)
    L = LLAMA8B.num_layers
    for prof in (slow_cpu, fast_cpu):
        p = pm.predict_step("hybridgen", LLAMA8B, w, prof)
        cpu, gpu = p.cpu_branch_s / L, (p.gpu_branch_s - p.breakdown["lm_head_s"]) / L
        assert p.layer_s == pytest.approx(max(cpu, gpu))
        assert p.attention_layer_s == pytest.approx(max(cpu, p.breakdown["gpu_attn_s"]))
    slow = pm.predict_step("hybridgen", LLAMA8B, w, slow_cpu)
    assert slow.layer_s == pytest.approx(slow.cpu_branch_s / L)      # CPU-bound: CPU branch shows
    gpu_heavy = pm.Workload(context=32768, host_share=0.5, topk_ratio=0.01)
    a = pm.predict_step("hybridgen", LLAMA8B, gpu_heavy, fast_cpu)
    b = pm.predict_step("hybridgen", LLAMA8B, gpu_heavy, faster_cpu)
    assert a.cpu_branch_s < a.gpu_branch_s
    assert a.total_s == pytest.approx(b.total_s)                     # hidden: a faster CPU changes nothing
    assert b.cpu_branch_s < a.cpu_branch_s


def test_without_pipelining_the_rest_of_the_layer_adds_up():
    w = pm.Workload(pipelined=False)
    p = pm.predict_step("hybridgen", LLAMA8B, w, "h100-80gb")
    assert p.layer_s == pytest.approx(p.breakdown["rest_s"] + p.attention_layer_s)
    piped = pm.predict_step("hybridgen", LLAMA8B, pm.Workload(pipelined=True), "h100-80gb")
    assert piped.layer_s <= p.layer_s + 1e-12


def test_hybrid_exact_overlaps_cpu_and_gpu_partials():
    w = pm.Workload(host_share=0.5, context=65536)
    p = pm.predict_step("hybrid-exact", LLAMA8B, w, "h200-host")
    br = p.breakdown
    cpu = br["cpu_attn_s"] + br["transfer_s"]
    launch = pm.load_profile("h200-host").gpu.launch_us * 1e-6
    assert p.attention_layer_s == pytest.approx(max(cpu, br["gpu_attn_s"]) + launch)


def test_semantic_mapping_puts_values_on_cxl():
    w = pm.Workload()
    dram = pm.predict_step("hybridgen", LLAMA8B, w, "h100-80gb")
    cxl = pm.predict_step("hybridgen", LLAMA8B, w, "h100-80gb-cxl")
    all_cxl = pm.predict_step("hybridgen", LLAMA8B, dataclasses.replace(w, mapping="cxl"), "h100-80gb-cxl")
    assert cxl.breakdown["gather_s"] > dram.breakdown["gather_s"]       # values read from the slower node
    assert cxl.breakdown["scan_s"] == pytest.approx(dram.breakdown["scan_s"])  # keys stay on DRAM
    assert all_cxl.breakdown["scan_s"] > 2 * cxl.breakdown["scan_s"]    # keys on CXL: the scan slows


def test_fits_gpu_flags_full_attention_over_capacity():
    w = pm.Workload(context=65536)
    assert not pm.predict_step("full", LLAMA8B, w, "rtx5090").fits_gpu
    assert pm.predict_step("full", LLAMA8B, w, "h200-host").fits_gpu
    assert pm.predict_step("hybridgen", LLAMA8B, w, "rtx5090").fits_gpu


def test_unknown_method_and_bad_workload_are_config_errors():
    with pytest.raises(ConfigError, match="flexgen"):
        pm.predict_step("flexgen2", LLAMA8B, pm.Workload(), "h200-host")
    with pytest.raises(ConfigError):
        pm.Workload(host_share=1.5)
    with pytest.raises(ConfigError):
        pm.Workload(dtype="int3")
    with pytest.raises(ConfigError, match="semantic"):
        pm.Workload(mapping="numa")


def test_profile_without_gpu_cannot_predict():
    raw = _h200_raw()
    raw["gpu"] = {k: None for k in raw["gpu"]}
    prof = pm.profile_from_dict(raw)
    with pytest.raises(ConfigError, match="gpu"):
        pm.predict_step("full", LLAMA8B, pm.Workload(), prof)


def test_model_shape_from_spec_and_names():
    spec = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "vocab_size": 100, "gated_mlp": False}
    shape = pm.ModelShape.from_spec(spec, "tiny")
    assert shape.mlp_matrices == 2 and shape.layer_params == 64 * 64 * 2 + 64 * 32 * 2 + 2 * 64 * 128
    named = pm.ModelShape.named("llama-3.1-8b")
    assert (named.num_layers, named.num_heads, named.num_kv_heads, named.head_dim) == (32, 32, 8, 128)
    with pytest.raises(ConfigError, match="llama-3.1-8b"):
        pm.ModelShape.named("llama-9")


def test_compare_to_measured_reports_error():
    preds = {"a": pm.predict_step("full", LLAMA8B, pm.Workload(), "h200-host"), "b": 0.002, "c": 0.001}
    meas = {"a": preds["a"].attention_layer_s * 2, "b": 0.001, "d": 0.5}
    table = pm.compare_to_measured(preds, meas)
    rows = {r.key: r for r in table.rows}
    assert rows["a"].error_pct == pytest.approx(-50.0)
    assert rows["b"].error_pct == pytest.approx(100.0)
    assert set(table.missing) == {"c", "d"}
    assert table.mean_abs_error_pct == pytest.approx(75.0)
    text = str(table)
    assert "projected" in text and "+100.0%" in text


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
