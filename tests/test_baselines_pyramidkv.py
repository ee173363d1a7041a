"""PyramidKV: per-layer budgets fall with depth and average to the budget; selection is SnapKV's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baselines.pyramidkv import PyramidKV, pyramid_budgets
from baselines.snapkv import snapkv_selection
from hybridgen.attention import dense_attention_reference
from hybridgen.errors import ConfigError
from hybridgen.methods import build_method
from hybridgen.methods.offloaded import Offloaded
from hybridgen.testing import dense_reference, drive
from tests._baselines_cases import left_padding, rel_err

ROOT = Path(__file__).resolve().parents[1]


def test_budgets_by_hand():
    # keep 40, window 8 -> prefix 32 per layer on average; beta 4 -> smallest 8, largest 56,
    # ramp 56, 44, 32, 20, 8 (+ the window 8 each)
    assert pyramid_budgets(40, 8, 200, 5, 4) == [64, 52, 40, 28, 16]
    # prefix 92 of 112: largest 2*92 - 92/20 > 112 is capped at 112, smallest raised to 72
    assert pyramid_budgets(100, 8, 120, 3, 20) == [120, 100, 80]
    # a budget covering the prompt keeps it all; a budget inside the window is uniform
    assert pyramid_budgets(120, 8, 120, 4, 20) == [120] * 4
    assert pyramid_budgets(5, 8, 120, 4, 20) == [5] * 4
    assert pyramid_budgets(30, 8, 120, 1, 20) == [30]


@pytest.mark.parametrize("keep,window,T,L,beta", [(40, 8, 200, 5, 20), (17, 4, 41, 7, 3), (33, 32, 64, 24, 20),
                                                  (60, 8, 64, 6, 20), (90, 16, 1000, 30, 1), (12, 4, 30, 2, 2)])
def test_budgets_decrease_and_average_to_the_budget(keep, window, T, L, beta):
    b = pyramid_budgets(keep, window, T, L, beta)
    assert len(b) == L and sum(b) == L * keep
    assert all(x >= y for x, y in zip(b, b[1:]))
    assert min(window, keep) <= b[-1] and b[0] <= T
    if beta > 1 and b[0] < T and keep > window:
        assert b[0] > b[-1]  # a real pyramid, not SnapKV's uniform budget


@pytest.mark.parametrize("seed", range(3))
def test_each_layer_keeps_snapkvs_selection_at_its_budget(seed):
    B, Hq, Hkv, D, T, L, steps = 2, 4, 2, 8, 48, 4, 3
    valid = left_padding(__import__("random").Random(seed), B, T, min_real=20) if seed else None
    method = PyramidKV(budget="16t", window=4, kernel=3, beta=4)
    run = drive(method, (B, Hq, Hkv, D, T), steps, seed=seed, valid=valid, layers=L)
    budgets = pyramid_budgets(16, 4, T, L, 4)
    assert budgets == [25, 19, 13, 7]  # prefix 12: ramp 21, 15, 9, 3 (+ the window 4)
    for layer in range(L):
        q, k, v = run.prompt[layer]
        idx = snapkv_selection(q, k, run.ctx.scale, budgets[layer], 4, 3, valid)
        seg = method.cache[layer]
        assert seg.length == budgets[layer] + steps
        kept = budgets[layer]
        assert torch.equal(seg.k[:, :, :kept], torch.gather(k, 2, idx[..., None].expand(-1, -1, -1, D)))
    # decode: dense over the layer's kept prompt tokens + every generated token
    for rec in run.records:
        kept = budgets[rec.layer]
        seg = method.cache[rec.layer]
        ks = torch.cat([seg.k[:, :, :kept], rec.k[:, :, T:]], 2)
        vs = torch.cat([seg.v[:, :, :kept], rec.v[:, :, T:]], 2)
        mask = None if seg.mask is None else seg.mask[:, :, : kept + rec.step + 1]
        assert rel_err(rec.out, dense_attention_reference(rec.q, ks, vs, run.ctx.scale, mask)) < 1e-5


def test_full_budget_equals_full():
    shape, valid = (2, 6, 2, 16, 40), left_padding(__import__("random").Random(0), 2, 40, min_real=10)
    got = drive(PyramidKV(budget=1.0), shape, 4, seed=3, valid=valid, layers=3)
    ref = drive(build_method("full"), shape, 4, seed=3, valid=valid, layers=3)
    for a, b in zip(got.records, ref.records):
        assert torch.allclose(a.out, b.out, atol=1e-6)
        assert rel_err(a.out, dense_reference(a, got.ctx.scale)) < 1e-5


def test_bytes_held_match_the_layer_budgets():
    B, Hq, Hkv, D, T, L, steps = 1, 4, 2, 8, 64, 4, 2
    method = PyramidKV(budget=0.25, window=4, beta=5)
    run = drive(method, (B, Hq, Hkv, D, T), steps, layers=L)
    budgets = pyramid_budgets(16, 4, T, L, 5)
    row = B * Hkv * D * 4  # float32 bytes of one token's K (or V)
    expect = sum(2 * row * (n + steps) for n in budgets)
    assert method.held_bytes() == {"gpu": expect} and run.ctx.store["gpu"].used == expect
    assert expect == L * 2 * row * (16 + steps)  # the same memory as SnapKV at the same budget
    method.release()
    assert run.ctx.store["gpu"].used == 0


@pytest.mark.parametrize("params,fragment", [({"beta": 0}, "'beta' expects an integer >= 1"),
                                             ({"beta": "steep"}, "'beta' expects an integer"),
                                             ({"kernel": 4}, "odd integer"),
                                             ({"budget": 0}, "at least one token")])
def test_bad_parameters_are_one_line(params, fragment):
    with pytest.raises(ConfigError) as info:
        build_method("pyramidkv", **params)
    assert "\n" not in str(info.value) and fragment in str(info.value) and "'pyramidkv'" in str(info.value)


def _cost_context(model="smollm2-135m", batch=4, context=4096, profile="h200-host"):
    from hybridgen.perf import CostContext, Workload, as_model_shape, load_profile

    return CostContext(as_model_shape(model), Workload(batch=batch, context=context), load_profile(profile))


def test_projection_uses_the_mean_budget():
    c = _cost_context()
    got = PyramidKV(budget=0.2).layer_cost(c)
    keep = -(-4096 // 5)  # ceil(0.2 x 4096) = 820 tokens on average, as the method keeps them
    assert got.label == "pyramidkv" and got.gpu_tokens == pytest.approx(keep)
    assert got.attn == pytest.approx(build_method("snapkv", budget=f"{keep}t").layer_cost(c).attn)


@pytest.mark.parametrize("offload", ["stream", "cpu"])
def test_offloaded_projection_prices_each_layer_in_its_mode(offload):
    """Each layer is SnapKV at its own budget in the offload mode (offloaded_kept_cost); the
    stream's two staging slots hold the LARGEST layer (layer 0), not the mean."""
    c = _cost_context("llama-3.1-8b", batch=8, context=32768, profile="rtx5090")
    got = PyramidKV(offload=offload).layer_cost(c)
    keeps = pyramid_budgets(-(-32768 // 5), 32, 32768, 32, 20)
    per_layer = [build_method("snapkv", budget=f"{n}t", offload=offload).layer_cost(c) for n in keeps]
    assert got.label == f"pyramidkv-offload-{offload}"
    assert got.layer == pytest.approx(sum(p.layer for p in per_layer) / len(keeps))
    assert got.transfer == pytest.approx(sum(p.transfer for p in per_layer) / len(keeps))
    assert got.gpu_tokens == 0.0  # the kept KV lives on the host
    resident = PyramidKV().layer_cost(c)
    assert got.layer > resident.layer  # the copy (or the CPU pass) is priced, not the resident step
    if offload == "stream":
        assert got.staging_tokens == 2 * max(keeps) > 3 * sum(keeps) / len(keeps)
        assert got.breakdown["h2d_bytes"] == pytest.approx(8 * sum(keeps) / len(keeps) * c.kv_tok)
    else:
        assert got.staging_tokens == 0 and got.cpu > 0


def test_stream_placement_sizes_staging_for_the_largest_layer():
    """Between two slots of the MEAN layer and two slots of layer 0's budget the kept KV cannot
    stream within the budget: the placement falls back to the CPU, and a run with the gpu tier's
    capacity set to the budget stays inside it (a streamed run would overflow the ledger)."""
    from hybridgen.kv import TieredStore
    from hybridgen.methods.placement import KVShape, place
    from hybridgen.model import load_model

    engine = load_model("smollm2-135m", weights="random", num_layers=6, tokenizer=False, seed=0)
    sp, B, T, N = engine.spec, 2, 64, 4
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N)
    params = {"window": 4}
    keeps = pyramid_budgets(-(-T // 5), 4, T, sp.num_layers, 20)
    per_token = B * (shape.token_bytes + shape.mask_bytes)
    slots = 2 * (max(keeps) + N) * per_token
    mean_slots = 2 * (sum(keeps) / len(keeps) + N) * per_token
    assert mean_slots < slots - 1 and slots < sum(k + N for k in keeps) * per_token  # the case exists
    assert place("pyramidkv", slots, shape, params) == {**params, "offload": "stream"}
    assert place("pyramidkv", slots - 1, shape, params) == {**params, "offload": "cpu"}
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0  # padding: the masks are allocated, so the bytes are exact
    for G in (slots, slots - 1):
        store = TieredStore(gpu=G)  # a CapacityError here: the placement overflowed the budget
        res = engine.generate(ids, build_method("pyramidkv", **place("pyramidkv", G, shape, params)),
                              max_new_tokens=N, attention_mask=mask, store=store)
        assert res.tokens.shape == (B, N)
        assert store.peak_by_tier()["gpu"] == (slots if G == slots else 0)


@pytest.mark.parametrize("offload", ["stream", "cpu"])
def test_offloaded_pyramid_gives_the_resident_outputs(offload):
    shape = (2, 4, 2, 8, 48)
    ref = drive(PyramidKV(budget="16t", window=4, beta=4), shape, 3, seed=1, layers=3)
    method = Offloaded(PyramidKV(budget="16t", window=4, beta=4), offload)  # = PyramidKV(offload=...).composed()
    got = drive(method, shape, 3, seed=1, layers=3)
    for a, b in zip(got.records, ref.records):
        assert torch.allclose(a.out, b.out, atol=1e-6)
    assert method.held_bytes().get("dram", 0) > 0
    with pytest.raises(ConfigError, match="Offloaded wrapper"):  # never silently run resident
        drive(PyramidKV(budget="16t", window=4, beta=4, offload=offload), shape, 3, seed=1, layers=3)


def test_through_the_engine_and_the_experiment_runner(tmp_path):
    from hybridgen.model import load_model

    engine = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False, seed=0)
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, :11] = 0
    ref = engine.generate(ids, "full", max_new_tokens=5, attention_mask=mask, return_logits=True)
    res = engine.generate(ids, build_method("pyramidkv", budget=1.0), max_new_tokens=5, attention_mask=mask,
                          return_logits=True)
    assert torch.equal(res.tokens, ref.tokens)
    assert float((res.logits - ref.logits).abs().max()) < 1e-3 * float(ref.logits.abs().max())
    small = engine.generate(ids, build_method("pyramidkv", window=8), max_new_tokens=5, attention_mask=mask)
    assert sum(small.bytes_by_tier.values()) < sum(ref.bytes_by_tier.values())
    cmd = [sys.executable, str(ROOT / "experiments" / "run.py"), "method.name=pyramidkv", "method.params.window=4",
           "model=tiny-random", "workload=random", "workload.prompt_len=24", "workload.gen_len=3",
           "hardware=h200", "hardware.gpu_capacity=null", "hardware.dram_capacity=null", "hardware.cxl_capacity=null",
           f"results_dir={tmp_path / 'results'}", "progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pyramidkv" in out.stdout and "not modelled" not in out.stdout, out.stdout
