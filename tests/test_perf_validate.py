"""hybridgen_harness.perf.validate: projected vs measured error tables and the validation command."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridgen import perf as pm
from hybridgen_harness.perf import probe_rows, validate

LLAMA8B = pm.ModelShape(name="llama-3.1-8b-shape", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, vocab_size=128256)


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


def test_validation_rows_on_a_tiny_shape(tmp_path, capsys):
    """The command's row computation end to end: no probe files -> one line, part (a) skipped;
    this machine: a measured profile and every method at the tiny shape."""
    out = tmp_path / "v.json"
    md = tmp_path / "v.md"
    assert validate.main(["--json", str(out), "--md", str(md), "--quick", "--probe-dir", str(tmp_path / "none")]) == 0
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if "part (a) skipped" in line]
    assert len(skipped) == 1
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {r["source"] for r in rows} == {"this-machine"}
    assert {r["method"] for r in rows if r["dtype"] == "fp32"} == {
        "full", "hybrid-exact", "hybridgen", "hybridgen-sketch-int4", "hybridgen-three-way", "flexgen-stream", "flexgen-cpu", "flexgen-int4",
        "infinigen", "snapkv", "snapkv-offload-stream", "quest", "quest-offload-stream", "streamingllm",
        "streamingllm-offload-stream"}
    # bf16 KV: the default bf16-dot (fused) branch, timed only there, beside full and the exact scan
    bf16 = {r["name"] for r in rows if r["dtype"] == "bf16"}
    assert bf16 == {f"{m} bf16 B=1 Hq=8 Hkv=2 D=64 T=1024" for m in ("full", "hybridgen", "hybridgen-sketch-int4",
                                                                     "hybridgen-scan-exact")}
    for r in rows:
        assert {"name", "source", "predicted_s", "measured_s", "error_pct"} <= set(r)
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"], abs=0.01)
        # one round: the prediction is the model's plus the residual measured at the short context
        assert r["small_tokens"] == 256 and r["model_only_s"] > 0
        assert r["predicted_s"] == pytest.approx(r["model_only_s"] + r["per_call_residual_s"], rel=1e-9)
        assert r["model_only_error_pct"] == pytest.approx(
            100 * (r["model_only_s"] - r["measured_s"]) / r["measured_s"], abs=0.01)
    assert res["summary"]["model_only"]["rows"] == len(rows)
    prof = pm.profile_from_dict(res["this_machine_profiles"][0])
    assert prof.measured and prof.host.op_us > 0 and prof.host.group_score_gbps > 0
    assert set(prof.host.key_sketch_gbps) == {"int8", "int4"}  # the sketch scan is measured, not assumed
    bf16_prof = pm.profile_from_dict(res["this_machine_profiles"][1])  # the bf16 rows' profile
    from hybridgen.attention import native

    if native.available():  # the default scan's own rate prices its rows
        assert bf16_prof.host.key_scan_bf16dot_gbps > 0
    text = md.read_text()
    assert "Performance model vs measurements" in text and "model alone error" in text
    assert "the model alone (no per-call residual)" in text


def test_emulated_profile_prices_the_local_runs_with_added_branches():
    from hybridgen_harness.perf.local_rows import TINY, measure_profile

    raw = measure_profile(TINY[0], reps=3)
    prof = pm.profile_from_dict(raw)
    if prof.gpu.emulated_on_host:
        assert prof.gpu.attention_gbps == prof.host.cpu_attention_gbps["fp32"]
        assert prof.link.h2d_pinned_gbps == prof.link.h2d_pageable_gbps > 0


@pytest.mark.skipif(not probe_rows.PROBE_DIR.is_dir(), reason="the shared H200-host probe files are not here")
def test_probe_rows_cover_the_headline_measurements_within_25pct():
    rows, not_modelled = probe_rows.probe_rows()
    by_name = {r.name: r for r in rows}
    for name in ("GQA L=32768 90% host: FlexGen stream", "GQA L=32768 90% host: CPU attention split",
                 "MHA L=32768 exact split, GPU share 0.9", "GQA L=32768 90% host: HybridGen step",
                 "GQA L=8192 90% host: HybridGen step", "MHA L=4096 exact split, GPU share 0.98"):
        assert abs(by_name[name].error_pct) <= 25, name
    assert by_name["GQA L=8192 90% host: HybridGen step"].fitted == ""    # an independent check
    assert any("KT" in r["name"] for r in not_modelled)                     # the transposed layout is not priced


def test_every_baseline_declares_rows_of_its_own_and_keeps_its_budget():
    """The validation measures each baseline's cost on this machine (labelled by the cost that
    prices it); a subclass does not inherit its parent's rows; only split methods get gpu_budget."""
    from hybridgen_harness.perf.local_rows import validation_methods

    rows = {label: (name, params) for label, name, params in validation_methods()}
    for label in ("snapkv", "snapkv-offload-stream", "streamingllm",
                  "streamingllm-offload-stream", "quest", "quest-offload-stream", "infinigen"):
        assert label in rows and "gpu_budget" not in rows[label][1], label
    assert rows["snapkv"][0] == "snapkv"  # not PyramidKV's inherited copy
    assert not any(name == "pyramidkv" for name, _ in rows.values())
    assert rows["flexgen-stream"][1]["gpu_budget"] == 0.1


def test_a_cost_is_validated_by_the_rows_labelled_with_it():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.paper_speedup import model_error

    validation = {"rows": [{"name": "h2o B=1", "method": "h2o", "error_pct": -30.0},
                           {"name": "h2o B=2", "method": "h2o", "error_pct": 12.0},
                           {"name": "h2o-offload-stream B=1", "method": "h2o-offload-stream", "error_pct": 99.0},
                           {"name": "x", "method": "quest", "error_pct": 5.0, "fitted": "host.op_us"}]}
    assert model_error("h2o", validation) == 30.0
    assert model_error("h2o-offload-stream", validation) == 99.0
    assert model_error("quest", validation) is None  # a fitted row validates nothing
    assert model_error("snapkv", validation) is None and model_error(None, validation) is None
    # a projection is the model alone: a row's error without its measured per-call residual counts
    validation["rows"].append({"name": "streamingllm B=1", "method": "streamingllm", "error_pct": 3.0,
                               "model_only_error_pct": -41.8})
    assert model_error("streamingllm", validation) == 41.8
