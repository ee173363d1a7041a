"""FlexGen's compressed GPU part (``compress_gpu_kv``, the ``flexgen-int4`` preset with
``compress_kv``): the GPU share stored as 4-bit codes too, as FlexGen's compressed cache is
(issue 23, item 3). Correct against the float64 reference over the dequantized KV; what the
ledger holds is its footprint; under one GPU budget it places ~3.5x the GPU tokens; its cost
reads the GPU part's codes in a dequantisation pass."""
import random

import pytest
import torch
import yaml
from pathlib import Path

from hybridgen.kv import TieredStore
from hybridgen.methods import build_method
from hybridgen.methods.footprint import KVShape
from hybridgen.methods.full import Full
from hybridgen.perf import Workload, predict_step
from tests._baselines_cases import left_padding, rel_err, run_method

CASES = [{"compress_gpu_kv": True, "gpu_budget": 0.6},
         {"compress_gpu_kv": True, "compress_kv": True, "gpu_budget": 0.4, "group_size": 32},
         {"compress_gpu_kv": True, "compress_kv": True, "gpu_budget": 0.5, "attention_on": "cpu"}]


@pytest.mark.parametrize("params", CASES, ids=["gpu-only", "both-g32", "both-cpu"])
def test_output_is_attention_over_the_dequantized_cache(params):
    from baselines import quant
    from hybridgen.attention import dense_attention_reference

    gen = random.Random(1)
    shape = (2, 4, 2, 64, 50)
    valid = left_padding(gen, 2, 50)
    full = run_method(Full(), shape, 3, 0, valid)
    method = build_method("flexgen", **params)
    run = run_method(method, shape, 3, 0, valid)
    g = method.group_size
    for rec, ref_rec in zip(run.records, full.records):
        T = rec.k.shape[2]
        kq = quant.dequantize(*quant.quantize(rec.k, g), 64, g)
        vq = quant.dequantize(*quant.quantize(rec.v, g), 64, g)
        lossy = torch.zeros(T, dtype=torch.bool)
        lossy[:method.n_gpu] = True  # the GPU share: compressed
        lossy[method.n_gpu:] = bool(params.get("compress_kv"))
        lossy[-1] = False  # the new token: attended at full precision
        k = torch.where(lossy[None, None, :, None], kq, rec.k)
        v = torch.where(lossy[None, None, :, None], vq, rec.v)
        ref = dense_attention_reference(rec.q.double(), k.double(), v.double(), run.ctx.scale, rec.valid[:, None, :])
        assert rel_err(rec.out, ref) < 1e-5, params
        assert rel_err(rec.out, ref_rec.out) > 1e-3  # the GPU part is lossy too


def test_ledger_is_the_footprint_and_the_gpu_holds_3_5x_the_tokens():
    from hybridgen.model import load_model
    from hybridgen.methods.placement import place

    tiny = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False, seed=0)
    sp, B, T, N = tiny.spec, 2, 70, 3
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N, masked=False)
    method = build_method("flexgen", compress_kv=True, compress_gpu_kv=True, gpu_budget="30t")
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(5))
    store = TieredStore()
    tiny.generate(ids, method, max_new_tokens=N, store=store)
    assert {t: n for t, n in store.peak_by_tier().items() if n} == dict(method.footprint(shape).tier_bytes)
    # Llama-3.1-8B bf16 at 128K, batch 8: one GPU budget, ~3.5x the GPU tokens when compressed
    big = KVShape.of_model("llama-3.1-8b", 8, 131072 - 128, 128, "bf16")
    budget = int(40e9)
    plain = place("flexgen", budget, big, {"compress_kv": True})
    both = place("flexgen", budget, big, {"compress_kv": True, "compress_gpu_kv": True})
    n_plain, n_both = (int(p["gpu_budget"].rstrip("t")) for p in (plain, both))
    assert 3.2 < n_both / n_plain < 3.6


def test_cost_reads_the_gpu_codes_and_the_preset_compresses_both_parts():
    preset = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "method" / "flexgen-int4.yaml").read_text())
    assert preset["params"] == {"compress_kv": True, "compress_gpu_kv": True}
    w = Workload(batch=8, context=131072)
    host_only = predict_step(build_method("flexgen", compress_kv=True, gpu_budget=0.3), "llama-3.1-8b", w, "h200-host")
    both = predict_step(build_method("flexgen", compress_kv=True, compress_gpu_kv=True, gpu_budget=0.3),
                        "llama-3.1-8b", w, "h200-host")
    assert host_only.breakdown["gpu_dequant_s"] == 0 < both.breakdown["gpu_dequant_s"]
    assert both.breakdown["dequant_s"] == pytest.approx(host_only.breakdown["dequant_s"] + both.breakdown["gpu_dequant_s"])
    assert both.breakdown["gpu_resident_bytes"] < host_only.breakdown["gpu_resident_bytes"]  # same share, fewer bytes
