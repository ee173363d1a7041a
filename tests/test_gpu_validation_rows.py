"""A lent GPU's per-layer runs as validation rows (benchmarks/gpu/validation_rows.py): re-priced by
the current model, labelled by the cost that priced them (variants by their own name), the runs
with nothing on the host left out, and picked up by the paper comparison's bands."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import validation_rows as vr  # noqa: E402
from benchmarks.gpu.config import BenchConfig, make_method  # noqa: E402
from hybridgen import perf as pm  # noqa: E402

CSV = ROOT / "results" / "gpu" / "bench_gpu.csv"
HEADER = "section,method,status,context,host_share,ms\n"


def _csv(tmp_path, lines):
    p = tmp_path / "bench_gpu.csv"
    p.write_text(HEADER + "".join(f"{ln}\n" for ln in lines))
    return p


def _predicted_s(name, context, share, cfg):
    method = make_method(name, share, cfg.topk_ratio if name in ("hybridgen", "hybridgen-plain") else None)
    if method.name == "hybridgen":
        method = dataclasses.replace(method, pipeline=False)
    shape = pm.ModelShape(name="llama-3.1-8b-layer", num_layers=32, hidden_size=cfg.heads * cfg.head_dim,
                          num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                          intermediate_size=14336, vocab_size=128256)
    return pm.predict_step(method, shape, pm.Workload(batch=cfg.batch, context=context, dtype=cfg.dtype_name),
                           cfg.profile).attention_layer_s


def test_runs_are_re_priced_labelled_by_their_cost_and_the_empty_host_left_out(tmp_path):
    path = _csv(tmp_path, ["layer,flexgen-stream,ok,32768,0.9,20.0", "layer,hybridgen,ok,32768,0.9,14.7",
                           "layer,hybridgen,ok,32768,0.0,0.3", "layer,hybridgen-sketch,ok,32768,0.9,30.0",
                           "layer,hybridgen-no-sketch,ok,32768,0.9,15.0",
                           "layer,full,ok,8192,0.5,0.142", "layer,flexgen-cpu,failed,8192,0.5,1.0",
                           "projection,hybridgen @ 32768 / 90%,ok,,,14.7"])
    cfg = BenchConfig()
    out = vr.validation_rows(path, cfg, gpu="H200")
    by = {r["name"]: r for r in out["rows"]}
    assert sorted(by) == ["H200 run: flexgen-stream @ 32768 / 90%", "H200 run: full @ 8192 / 50%",
                          "H200 run: hybridgen @ 32768 / 90%", "H200 run: hybridgen-no-sketch @ 32768 / 90%",
                          "H200 run: hybridgen-sketch @ 32768 / 90%"]
    assert out["left_out"] == ["hybridgen @ 32768 / 0%: nothing on the host"]
    stream = by["H200 run: flexgen-stream @ 32768 / 90%"]
    assert stream["predicted_s"] == pytest.approx(_predicted_s("flexgen-stream", 32768, 0.9, cfg))
    assert stream["measured_s"] == pytest.approx(0.020)
    assert stream["error_pct"] == pytest.approx(100 * (stream["predicted_s"] - 0.020) / 0.020)
    assert stream["source"] == vr.SOURCE and stream["method"] == "flexgen-stream"
    # the default hybridgen by the cost that priced it, and so the older sketch runs (the default's
    # sketch before it was the default: they widen its band); a variant by its own name
    assert by["H200 run: hybridgen @ 32768 / 90%"]["method"] == "hybridgen-three-way"
    assert by["H200 run: hybridgen-sketch @ 32768 / 90%"]["method"] == "hybridgen-three-way"
    assert by["H200 run: hybridgen-no-sketch @ 32768 / 90%"]["method"] == "hybridgen-no-sketch"
    # no environment.json beside the CSV: priced as the benchmark ran then (no sketch in hybridgen)
    assert by["H200 run: hybridgen @ 32768 / 90%"]["predicted_s"] == pytest.approx(
        by["H200 run: hybridgen-no-sketch @ 32768 / 90%"]["predicted_s"])


def test_the_committed_rows_are_what_the_command_makes_now_and_widen_the_bands():
    """results/perfmodel/gpu_runs/validation.json is the command's output on the committed CSV with
    the model as it is (a model change without re-running it fails here), and the paper summaries
    take hybridgen-three-way's band from it."""
    from experiments import paper_speedup as ps

    committed = json.loads((ROOT / "results" / "perfmodel" / "gpu_runs" / "validation.json").read_text())
    now = vr.validation_rows(CSV, gpu="H200")
    assert [r["name"] for r in committed["rows"]] == [r["name"] for r in now["rows"]]
    for a, b in zip(committed["rows"], now["rows"]):
        assert a["predicted_s"] == pytest.approx(b["predicted_s"], rel=1e-6), a["name"]
    gpu_only = {"rows": committed["rows"], "files": ["gpu_runs"]}
    worst = max(abs(r["error_pct"]) for r in committed["rows"] if r["method"] == "hybridgen-three-way")
    assert ps.model_error("hybridgen-three-way", gpu_only) == pytest.approx(worst)
    assert any(f.endswith("gpu_runs/validation.json") for f in ps.validation_files())
