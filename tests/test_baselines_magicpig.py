"""MagicPIG: SimHash collisions by definition, the sampling probability, an unbiased estimate,
exact attention when every key is collected, memory on the tiers of its design."""
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baselines.magicpig import (MagicPIG, build_tables, collect, expected_sample_rate, log_sample_prob,
                                sampled_attention, simhash_codes)
from hybridgen.errors import ConfigError
from hybridgen.methods import build_method
from hybridgen.testing import dense_reference, drive, left_padding
from tests._baselines_cases import rel_err

ROOT = Path(__file__).resolve().parents[1]


def test_codes_and_collisions_by_definition():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, n, D, K, L = 2, 4, 2, 9, 8, 3, 5
    planes = torch.randn(D, L * K, generator=g)
    k = torch.randn(B, Hkv, n, D, generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    kc, qc = simhash_codes(k, planes, K, L), simhash_codes(q, planes, K, L)
    for b in range(B):
        for h in range(Hkv):
            for i in range(n):
                for t in range(L):
                    want = sum((1 << j) for j in range(K) if float(k[b, h, i] @ planes[:, t * K + j]) > 0)
                    assert int(kc[b, h, i, t]) == want
    tables = build_tables(kc)
    for m in (1, 2, 3):
        bi, hi, ii = collect(qc, *tables, m)
        got = set(zip(bi.tolist(), hi.tolist(), ii.tolist()))
        want = {(b, hq, i) for b in range(B) for hq in range(Hq) for i in range(n)
                if sum(int(qc[b, hq, t]) == int(kc[b, hq // 2, i, t]) for t in range(L)) >= m}
        assert got == want and len(bi) == len(got), m
    assert any(len(collect(qc, *tables, m)[0]) for m in (2, 3))  # the case is not vacuous


def test_sample_probability_is_the_binomial_tail_and_matches_simulation():
    K, L, m = 2, 12, 3
    cos = torch.tensor([-0.3, 0.0, 0.5, 0.9])
    got = log_sample_prob(cos, K, L, m).exp()
    for c, u in zip(cos.tolist(), got.tolist()):
        p = (1 - math.acos(c) / math.pi) ** K
        assert u == pytest.approx(sum(math.comb(L, j) * p ** j * (1 - p) ** (L - j) for j in range(m, L + 1)), rel=1e-9)
    assert log_sample_prob(cos, K, L, 0).abs().max() == 0.0  # m = 0 collects every key
    # Monte Carlo over random hyperplanes: a key at angle θ is collected at rate u
    g = torch.Generator().manual_seed(1)
    D, trials = 16, 4000
    q = torch.randn(D, generator=g)
    e = torch.randn(D, generator=g)
    e = e - (e @ q) / (q @ q) * q
    c = 0.5
    kvec = c * q / q.norm() + math.sqrt(1 - c * c) * e / e.norm()
    planes = torch.randn(trials, D, L * K, generator=g)
    same = simhash_codes(q.expand(trials, 1, D), planes, K, L) == simhash_codes(kvec.expand(trials, 1, D), planes, K, L)
    hits = int((same.sum(-1) >= m).sum())
    u = float(log_sample_prob(torch.tensor([c]), K, L, m).exp())
    assert abs(hits / trials - u) < 4 * math.sqrt(u * (1 - u) / trials)


def test_estimate_is_unbiased():
    """Σ_S exp(logit)/u and Σ_S exp(logit) v/u are unbiased for the exact sums (mean over hyperplanes)."""
    g = torch.Generator().manual_seed(2)
    D, n, K, L, m, trials = 8, 24, 2, 8, 2, 3000
    q = torch.randn(1, 1, 1, D, generator=g)
    k = torch.randn(1, 1, n, D, generator=g)
    v = torch.randn(1, 1, n, D, generator=g)
    scale = D ** -0.5
    logits = (q[0, 0, 0] @ k[0, 0].T).double() * scale
    den_exact = logits.exp().sum()
    num_exact = (logits.exp()[:, None] * v[0, 0].double()).sum(0)
    planes = torch.randn(trials, D, L * K, generator=g)  # one hyperplane draw per "sequence" of the batch
    q_codes = simhash_codes(q[:, :, 0].expand(trials, -1, -1), planes, K, L)  # [trials, 1, L]
    k_codes = simhash_codes(k.expand(trials, -1, -1, -1), planes[:, None], K, L)  # [trials, 1, n, L]
    out, lse, _ = sampled_attention(q.expand(trials, -1, -1, -1), q_codes, k.expand(trials, -1, -1, -1),
                                    v.expand(trials, -1, -1, -1), build_tables(k_codes), None, scale, K, m)
    z = lse.double().exp().reshape(trials)
    den, num = z.mean(), (z[:, None] * out.double().reshape(trials, D)).mean(0)
    assert float(den / den_exact) == pytest.approx(1.0, abs=0.05)
    assert float((num - num_exact).norm() / num_exact.norm()) < 0.1


@pytest.mark.parametrize("seed", range(3))
def test_every_key_collected_equals_exact_attention(seed):
    valid = left_padding(random.Random(seed), 2, 40, min_real=5) if seed else None
    method = MagicPIG(min_collisions=0, sinks=3, window=5, bits=4, tables=16)
    run = drive(method, (2, 6, 2, 16, 40), 4, seed=seed, valid=valid, layers=2)
    ref = drive(build_method("full"), (2, 6, 2, 16, 40), 4, seed=seed, valid=valid, layers=2)
    for a, b in zip(run.records, ref.records):
        assert rel_err(a.out, dense_reference(a, run.ctx.scale)) < 1e-5
        assert torch.allclose(a.out, b.out, atol=1e-5)
    real_host = 2 * 32 if valid is None else sum(max(0, 32 - int((~valid[b, 3:35]).sum())) for b in range(2))
    assert method.stats["host_keys"] == 4 * 2 * (2 * 6 * 32)  # steps x layers x (B x Hq x host tokens)
    assert method.stats["sampled"] == 4 * 2 * 6 * real_host  # every real host key, per query head


def test_sampling_collects_a_subset_and_stays_close():
    method = MagicPIG(sinks=2, window=8, bits=4, tables=40, min_collisions=3)
    run = drive(method, (1, 4, 2, 32, 200), 3, seed=4, layers=1)
    assert 0 < method.stats["sampled"] < method.stats["host_keys"]
    from hybridgen.attention import dense_attention_reference

    gpu = method.gpu[0]
    for r in run.records:  # the estimate of the host part improves on dropping it
        n = 10 + r.step + 1
        gpu_only = dense_attention_reference(r.q, gpu.k[:, :, :n], gpu.v[:, :, :n], run.ctx.scale)
        ref = dense_reference(r, run.ctx.scale)
        assert rel_err(r.out, ref) < rel_err(gpu_only, ref)


def test_prompt_inside_sinks_and_window_is_all_gpu_and_exact():
    method = MagicPIG(sinks=4, window=64)
    run = drive(method, (2, 4, 2, 8, 30), 3, seed=5)
    held = {t: b for t, b in method.held_bytes().items() if b}
    assert held == {"gpu": 2 * 2 * 2 * 8 * 4 * (30 + 3) * 2}  # 2 layers, K+V, B, Hkv, D, fp32
    for r in run.records:
        assert rel_err(r.out, dense_reference(r, run.ctx.scale)) < 1e-5


def test_bytes_held_per_tier_and_moved_per_step():
    B, Hq, Hkv, D, T, steps, layers = 2, 4, 2, 16, 50, 3, 2
    s, w, K, L = 2, 6, 3, 20
    method = MagicPIG(sinks=s, window=w, bits=K, tables=L, tier="cxl")
    run = drive(method, (B, Hq, Hkv, D, T), steps, layers=layers)
    tok = B * Hkv * D * 4  # float32 bytes of one token's K (or V)
    n = T - s - w
    gpu = layers * (2 * tok * (s + w + steps) + D * L * K * 4)  # KV + the hyperplanes
    host = layers * (2 * tok * n + B * Hkv * n * L * (2 + 4))  # KV + tables (int16 code, int32 id per entry)
    assert method.held_bytes() == {"gpu": gpu, "cxl": host}
    assert run.ctx.store["gpu"].used == gpu and run.ctx.store["cxl"].used == host and run.ctx.store["dram"].used == 0
    per_step_down = B * Hq * D * 4 + B * Hq * L * 2  # q + its codes
    per_step_up = B * Hq * D * 4 + B * Hq * 4  # out + lse
    assert method.stats["bytes_d2h"] == layers * (2 * tok * n + B * Hkv * n * L * 2) + steps * layers * per_step_down
    assert method.lsh[0][0].t.shape == (B, Hkv, L, n) and method.lsh[0][1].t.dtype == torch.int32
    assert method.stats["bytes_h2d"] == steps * layers * per_step_up
    method.release()
    assert run.ctx.store["gpu"].used == 0 and run.ctx.store["cxl"].used == 0


def test_dense_layers_keep_everything_on_the_gpu():
    method = MagicPIG(sinks=1, window=2, bits=3, tables=8, dense_layers=1)
    run = drive(method, (1, 2, 1, 8, 20), 2, layers=2)
    assert method.host[0].length == 0 and method.host[1].length == 17
    for r in run.records:
        if r.layer == 0:
            assert rel_err(r.out, dense_reference(r, run.ctx.scale)) < 1e-5


@pytest.mark.parametrize("params,fragment", [({"bits": 0}, "'bits' expects an integer in [1, 30]"),
                                             ({"bits": 31}, "in [1, 30]"),
                                             ({"tables": 0}, "'tables' expects an integer >= 1"),
                                             ({"min_collisions": -1}, ">= 0"),
                                             ({"min_collisions": 9, "tables": 8}, "at most 'tables' (8)"),
                                             ({"tier": "gpu"}, "one of 'dram', 'cxl'"),
                                             ({"window": "wide"}, "expects an integer")])
def test_bad_parameters_are_one_line(params, fragment):
    with pytest.raises(ConfigError) as info:
        build_method("magicpig", **params)
    msg = str(info.value)
    assert "\n" not in msg and fragment in msg and "'magicpig'" in msg, msg


def test_projection_prices_the_cpu_part():
    from hybridgen.perf import CostContext, Workload, as_model_shape, load_profile

    c = CostContext(as_model_shape("smollm2-135m"), Workload(batch=4, context=8192), load_profile("h200-host"))
    cost = MagicPIG().layer_cost(c)
    planes = 64 * 150 * 10 * 4  # float32 hyperplanes of one layer, in KV tokens of the batch below
    assert cost.label == "magicpig" and cost.gpu_tokens == pytest.approx(68 + planes / (4 * c.kv_tok))
    assert cost.cpu > 0 and cost.transfer > 0
    assert cost.breakdown["sample_rate"] == pytest.approx(expected_sample_rate(10, 150, 2, head_dim=64))
    assert 0.005 < expected_sample_rate(10, 150, 2) < cost.breakdown["sample_rate"] < 0.05  # spread raises it
    bd = cost.breakdown  # the CPU's parts, each scaling with what it reads
    parts = ("search_s", "bucket_s", "collect_s", "pairs_s", "rows_s", "tail_s")
    assert all(bd[k] > 0 for k in parts) and cost.cpu > sum(bd[k] for k in parts)  # + the host ops
    assert bd["sampled_pairs"] == pytest.approx(4 * 9 * (8192 - 68) * bd["sample_rate"])
    assert bd["candidates"] == pytest.approx(4 * 9 * 150 * (8192 - 68) / 1024)
    # hash and copy down before the CPU starts; copy up and merge after it: more than the branches alone
    assert cost.attn > cost.cpu + bd["hash_s"] and cost.layer == pytest.approx(c.rest + cost.attn)
    longer = MagicPIG().layer_cost(CostContext(c.shape, Workload(batch=4, context=32768), c.hw))
    scaled = [sum(x.breakdown[k] for k in parts[1:]) for x in (cost, longer)]  # all but the log-depth searches
    assert longer.cpu > cost.cpu and scaled[1] == pytest.approx(scaled[0] * (32768 - 68) / (8192 - 68), rel=0.01)
    assert longer.breakdown["tail_s"] > longer.breakdown["rows_s"]  # the sampling probabilities dominate


def test_projection_prices_dense_layers_on_the_gpu():
    from hybridgen.perf import CostContext, Workload, as_model_shape, load_profile

    c = CostContext(as_model_shape("smollm2-135m"), Workload(batch=4, context=8192), load_profile("h200-host"))
    L = c.shape.num_layers
    dense = MagicPIG(dense_layers=L).layer_cost(c)
    assert dense.cpu == 0 and dense.transfer == 0 and dense.gpu_tokens == 8192
    sampled = MagicPIG().layer_cost(c)
    mixed = MagicPIG(dense_layers=3).layer_cost(c)
    assert mixed.layer == pytest.approx((3 * dense.layer + (L - 3) * sampled.layer) / L)
    assert mixed.gpu_tokens == pytest.approx((3 * 8192 + (L - 3) * sampled.gpu_tokens) / L)


def test_sample_rate_model_matches_random_keys():
    """The projection's sampled share (mean collection probability of keys in random directions
    of dimension D) against the collected / candidate pairs of a run on random keys."""
    D, T = 64, 1500
    method = MagicPIG(sinks=0, window=0)
    drive(method, (1, 4, 2, D, T), 4, seed=3, layers=1)
    got = method.stats["sampled"] / method.stats["host_keys"]
    want = expected_sample_rate(10, 150, 2, head_dim=D)
    assert abs(got / want - 1) < 0.25, (got, want)
    assert abs(got / expected_sample_rate(10, 150, 2) - 1) > 0.5  # orthogonal keys would be far off


@pytest.mark.parametrize("padded", [False, True])
def test_gpu_bytes_and_placement_match_the_ledger(padded):
    from hybridgen.methods.placement import KVShape

    B, Hq, Hkv, D, T, steps, layers = 3, 4, 2, 16, 60, 4, 3
    valid = left_padding(random.Random(2), B, T, min_real=20) if padded else None
    m = MagicPIG(sinks=2, window=6, bits=4, tables=8, dense_layers=1)
    run = drive(m, (B, Hq, Hkv, D, T), steps, seed=2, layers=layers, valid=valid)
    gpu = run.ctx.store.bytes_by_tier()["gpu"]
    assert m.gpu_bytes(layers, B, Hkv, D, 4, T, steps, masked=padded) == gpu
    shape = KVShape(layers=layers, kv_heads=Hkv, head_dim=D, dtype_bytes=4, batch=B, context=T + steps,
                    new_tokens=steps)
    need = m.gpu_bytes(layers, B, Hkv, D, 4, T, steps, masked=True)  # masks counted: an upper bound
    assert m.placement_for(need, shape) == {}
    with pytest.raises(ConfigError, match="'magicpig' needs .* of GPU memory") as info:
        m.placement_for(need - 1, shape)
    assert "\n" not in str(info.value)


def test_through_the_engine_and_the_experiment_runner(tmp_path):
    from hybridgen.model import load_model

    engine = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False, seed=0)
    ids = torch.randint(3, 1000, (2, 80), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, :11] = 0
    ref = engine.generate(ids, "full", max_new_tokens=5, attention_mask=mask, return_logits=True)
    exact = engine.generate(ids, build_method("magicpig", min_collisions=0, sinks=4, window=16), max_new_tokens=5,
                            attention_mask=mask, return_logits=True)
    assert torch.equal(exact.tokens, ref.tokens)
    assert float((exact.logits - ref.logits).abs().max()) < 1e-3 * float(ref.logits.abs().max())
    sampled = engine.generate(ids, build_method("magicpig", window=16), max_new_tokens=5, attention_mask=mask,
                              return_logits=True)
    assert bool(torch.isfinite(sampled.logits).all()) and sampled.bytes_by_tier["dram"] > 0
    assert sampled.method_stats["bytes_h2d"] > 0 and 0 < sampled.method_stats["sampled"]
    cmd = [sys.executable, str(ROOT / "experiments" / "run.py"), "method.name=magicpig", "method.params.window=8",
           "model=tiny-random", "workload=random", "workload.prompt_len=24", "workload.gen_len=3",
           "hardware=h200", "hardware.gpu_capacity=null", "hardware.dram_capacity=null", "hardware.cxl_capacity=null",
           f"results_dir={tmp_path / 'results'}", "progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "magicpig" in out.stdout and "not modelled" not in out.stdout, out.stdout
