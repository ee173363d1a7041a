"""ShadowKV: exact un-rotation, exact low-rank at full rank, landmark chunk selection, memory per
tier, bytes fetched per step, and equality with `full` when the budget keeps everything."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baselines.shadowkv import ShadowKV, chunk_landmarks, low_rank_keys, unrotate
from baselines.shadowkv_cost import shadowkv_cost
from hybridgen import perf as pm
from hybridgen.errors import ConfigError
from hybridgen.methods import Budget, build_method
from hybridgen.model import load_model
from hybridgen.model.rotary import RotaryEmbedding
from hybridgen.testing import dense_reference, drive, left_padding

ROOT = Path(__file__).resolve().parents[1]
D = 16  # head dim of the method-level cases
ROT = RotaryEmbedding(D, 10000.0)


def rope_fn(valid, B):
    """kv_fn rotating q and k at the engine's positions (left padding numbered from the first real token)."""
    T = None if valid is None else valid.shape[1]

    def fn(layer, pos, q, k):
        n = q.shape[2]
        if n > 1:  # prefill
            P = torch.arange(n).expand(B, n) if valid is None else (valid.long().cumsum(-1) - 1).clamp(min=0)
        else:
            real = torch.full((B,), int(pos[0])) if valid is None else valid.sum(-1) + int(pos[0]) - T
            P = real[:, None]
        return ROT.rotate(q, P), ROT.rotate(k, P)
    return fn


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_unrotation_round_trips_exactly_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=g, dtype=torch.float64) * 5
    pos = torch.randint(0, 100000, (2, 40), generator=g)
    y = ROT.rotate(x, pos)
    assert float((unrotate(ROT, y, pos) - x).abs().max()) < 1e-12
    assert float((ROT.rotate(unrotate(ROT, y, pos), pos) - y).abs().max()) < 1e-12
    # rotating by -positions is only approximately the inverse (the float32 cos/sin tables): not exact
    assert float((ROT.rotate(y, -pos) - x).abs().max()) > 1e-9


def test_low_rank_reconstruction_exact_at_full_rank_and_truncated_below():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 48, 8, generator=g, dtype=torch.float64)
    u, sv = low_rank_keys(k, 10 ** 6)
    assert u.shape == (2, 48, 24) and sv.shape == (2, 3, 24, 8)  # rank min(T, Hkv*D) = 24
    assert float((torch.matmul(u[:, None], sv) - k).abs().max()) < 1e-12
    u4, sv4 = low_rank_keys(k, 4)
    approx = torch.matmul(u4[:, None], sv4)
    # the rank-4 SVD error is the tail of the singular values (Eckart-Young), across heads
    s = torch.linalg.svdvals(k.permute(0, 2, 1, 3).reshape(2, 48, 24))
    err = (approx - k).pow(2).sum(dim=(1, 2, 3))
    assert torch.allclose(err, s[:, 4:].pow(2).sum(-1), rtol=1e-9)


def test_landmarks_are_chunk_means_and_outlier_score_ignores_padding():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 1, 16, 4, generator=g, dtype=torch.float64)
    valid = torch.ones(1, 16, dtype=torch.bool)
    valid[0, :3] = False
    lm, cos, real = chunk_landmarks(k, valid, 8)
    assert torch.allclose(lm[0, 0, 0], k[0, 0, 3:8].mean(0)) and torch.allclose(lm[0, 0, 1], k[0, 0, 8:].mean(0))
    want = min(float(torch.cosine_similarity(k[0, 0, t], lm[0, 0, 0], dim=0)) for t in range(3, 8))
    assert cos[0, 0, 0].item() == pytest.approx(want) and bool(real.all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_budget_keeping_everything_at_full_rank_equals_full(dtype, padded):
    B, Hq, Hkv, D, T = 2, 4, 2, 16, 75
    valid = left_padding(random.Random(3), B, T, min_real=20) if padded else None
    kw = dict(seed=4, dtype=dtype, valid=valid, rotary=ROT, kv_fn=rope_fn(valid, B))
    m = build_method("shadowkv", budget=1.0, rank=10 ** 6)
    run = drive(m, (B, Hq, Hkv, D, T), 4, **kw)
    ref = drive(build_method("full"), (B, Hq, Hkv, D, T), 4, **kw)
    assert m.effective_rank == Hkv * D and m.n_sel == m.C - m.O and m.O > 0  # outliers, selection and local all used
    tol = {torch.float64: 1e-6, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]  # bf16: factors stored in bf16
    for a, b in zip(run.records, ref.records):
        assert rel(a.out, b.out) < tol and rel(a.out, dense_reference(a, run.ctx.scale)) < tol
    # a truncated rank is not exact: the test can tell
    low = drive(build_method("shadowkv", budget=1.0, rank=4), (B, Hq, Hkv, D, T), 1, **kw)
    assert max(rel(r.out, dense_reference(r, low.ctx.scale)) for r in low.records) > 1e-3


def test_learned_positions_factorise_keys_directly():
    """rotary None (OPT): keys are pre-rotation already; full budget and rank equals dense."""
    m = build_method("shadowkv", budget=1.0, rank=10 ** 6)
    run = drive(m, (2, 4, 2, 16, 64), 3, seed=5, dtype=torch.float64)
    assert m.n_sel > 0
    for rec in run.records:
        assert rel(rec.out, dense_reference(rec, run.ctx.scale)) < 1e-6


def expected_chunks(rec, m):
    """(selected, outlier) chunk ids per [b][h] by the paper's rule, from the record's own keys
    (post-RoPE) and query, not from the method's state."""
    cs, C, Tc = m.chunk_size, m.C, m.Tc
    B, Hkv = rec.k.shape[:2]
    G = rec.q.shape[1] // Hkv
    kc = rec.k[:, :, :Tc].double().reshape(B, Hkv, C, cs, -1)
    lm = kc.mean(3)
    cos = torch.cosine_similarity(kc, lm[:, :, :, None].expand_as(kc), dim=-1).amin(-1)
    sel, outl = [], []
    for b in range(B):
        sel.append([]), outl.append([])
        for h in range(Hkv):
            out_h = sorted(torch.argsort(cos[b, h])[: m.O].tolist())
            rest = [c for c in range(C) if c not in out_h]
            logits = torch.stack([rec.q[b, h * G + j, 0].double() @ lm[b, h, rest].T for j in range(G)]) * D ** -0.5
            score = torch.softmax(logits, -1).amax(0)
            sel[b].append(sorted(rest[i] for i in torch.topk(score, m.n_sel).indices.tolist()))
            outl[b].append(out_h)
    return sel, outl


def test_small_budget_selects_top_landmarks_and_attends_exactly_over_its_tokens():
    from hybridgen.attention import dense_attention_reference

    B, Hq, Hkv, T = 2, 4, 2, 131
    m = ShadowKV(budget="32t", rank=10 ** 6, outlier_ratio=0.5)
    seen = []
    run = drive(m, (B, Hq, Hkv, D, T), 3, seed=6, dtype=torch.float64, rotary=ROT, kv_fn=rope_fn(None, B),
                after_step=lambda mm, s: seen.append([c.clone() for c in mm.last_chunks]))
    assert (m.C, m.O, m.n_sel) == (T // 8 - 4, 2, 4)
    for rec in run.records:
        sel, outl = expected_chunks(rec, m)
        assert seen[rec.step][rec.layer].tolist() == sel
        # the outlier chunks' exact keys are what the method keeps on the GPU
        for b in range(B):
            for h in range(Hkv):
                want = torch.cat([rec.k[b, h, c * 8:(c + 1) * 8] for c in outl[b][h]])
                assert torch.equal(m.outliers[rec.layer].k[b, h], want)
        # attended: selected + outlier chunks + local window + generated tokens (the new one included)
        mask = torch.zeros(B, Hkv, rec.k.shape[2], dtype=torch.bool)
        mask[:, :, m.Tc:] = True
        for b in range(B):
            for h in range(Hkv):
                for c in sel[b][h] + outl[b][h]:
                    mask[b, h, c * 8:(c + 1) * 8] = True
        assert int(mask[:, :, :m.Tc].sum()) == B * Hkv * (m.n_sel + m.O) * 8
        assert rel(rec.out, dense_attention_reference(rec.q, rec.k, rec.v, run.ctx.scale, mask)) < 1e-6


def test_memory_per_tier_and_bytes_fetched_per_step():
    B, Hq, Hkv, T, steps, layers = 2, 4, 2, 200, 3, 2
    m = ShadowKV(budget="40t", rank=6)
    run = drive(m, (B, Hq, Hkv, D, T), steps, seed=7, layers=layers, rotary=ROT, kv_fn=rope_fn(None, B))
    e = 4  # float32
    C, O, n, Tc = m.C, m.O, m.n_sel * 8, m.Tc
    assert (C, O, m.n_sel) == (21, 0, 5)
    local = T - Tc + steps
    per_layer_gpu = (B * Tc * 6 * e + B * Hkv * 6 * D * e          # U, S V^T
                     + B * Hkv * (C - O) * (D * e + 8)             # landmarks + their chunk ids
                     + 2 * B * Hkv * (O * 8 + local) * D * e)      # exact outliers + local window K/V
    shared_gpu = B * T * 8 + 2 * B * Hkv * n * D * e               # positions, fetch buffers (K rebuilt, V)
    held = run.ctx.store.bytes_by_tier()
    assert held == {**m.held_bytes(), "cxl": 0}                       # the ledger is what the method holds
    assert held["gpu"] == layers * per_layer_gpu + shared_gpu
    assert held["dram"] == layers * B * Hkv * Tc * D * e + B * Hkv * n * D * e  # values + host staging
    full = drive(build_method("full"), (B, Hq, Hkv, D, T), steps, seed=7, layers=layers)
    assert held["gpu"] < 0.5 * full.ctx.store.bytes_by_tier()["gpu"]
    # per layer-step: exactly the selected chunks' value rows cross to the GPU
    assert m.stats["bytes_h2d"] == steps * layers * B * Hkv * m.n_sel * 8 * D * e
    assert m.stats["fetched_tokens"] == steps * layers * n  # tokens per KV head
    m.release()
    assert run.ctx.store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}


@pytest.mark.parametrize("param,value,fragment", [
    ("rank", 0, "expects an integer >= 1"), ("chunk_size", "eight", "expects an integer"),
    ("local_chunks", -1, "expects an integer >= 0"), ("outlier_ratio", 1.5, "in [0, 1]"),
    ("budget", 0, "at least one token"), ("host_tier", "gpu", "one of 'dram', 'cxl'"),
])
def test_bad_parameters_refused_in_one_line(param, value, fragment):
    with pytest.raises(ConfigError) as info:
        build_method("shadowkv", **{param: value})
    msg = str(info.value)
    assert "\n" not in msg and fragment in msg and "'shadowkv'" in msg and param in msg, msg


def test_defaults_are_the_papers_and_config_round_trips():
    m = build_method("shadowkv")
    assert (m.budget, m.rank, m.chunk_size, m.local_chunks) == (Budget(ratio=0.015625), 160, 8, 4)
    assert int(m.outlier_ratio * 2048 // 8) == 48  # 48 outlier chunks at budget 2048
    assert build_method("shadowkv", **m.config()) == m


def test_layer_cost_moves_the_right_way():
    shape = pm.ModelShape(name="llama-3.1-8b-shape", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate_size=14336, vocab_size=128256)
    c = pm.CostContext(shape, pm.Workload(batch=8, context=131072), pm.load_profile("h200-host"))
    m = ShadowKV(budget="2048t")
    lay = m.layer_cost(c)
    assert lay.label == "shadowkv" and lay.breakdown["h2d_bytes"] == 8 * 2048 * 8 * 128 * c.b
    br = lay.breakdown  # as _fetch runs: scoring, ids down, host gather, copy up, rebuild, attention in turn
    assert lay.attn == pytest.approx(br["score_s"] + br["ids_s"] + br["gather_s"] + br["copy_s"] + br["rebuild_s"]
                                     + br["gpu_attn_s"])
    assert br["fetch_s"] == pytest.approx(br["ids_s"] + br["gather_s"] + br["copy_s"]) and br["rebuild_s"] > 0
    assert lay.layer == pytest.approx(c.rest + lay.attn)  # no cross-layer prefetch in the code
    # GPU residency is the ledger's layout (unpadded, at the context S, nothing generated)
    on_gpu = (shape.num_layers * lay.gpu_tokens + lay.staging_tokens) * c.B * c.kv_tok
    assert on_gpu == pytest.approx(m.gpu_bytes(shape.num_layers, 8, 8, 128, c.b, c.S, 0, masked=False))
    inf = build_method("infinigen", budget="2048t").layer_cost(c)  # fetches K and V of as many tokens
    assert br["h2d_bytes"] == pytest.approx(inf.breakdown["h2d_bytes"] / 2)
    assert shadowkv_cost(c, 0.1, 160, 8, 4, 0.1875).attn > lay.attn
    assert lay.gpu_tokens < 0.2 * c.S  # rank 160 of 1024 key dims, values on the host


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name, weights="random", num_layers=2, tokenizer=False, seed=0)
            for name in ("smollm2-135m", "opt-125m")}


@pytest.mark.parametrize("name", ["smollm2-135m", "opt-125m"])
def test_through_the_engine(models, name):
    engine = models[name]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (2, 90), generator=g)
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, :11] = 0
    ref = engine.generate(ids, "full", max_new_tokens=5, attention_mask=mask, return_logits=True)
    res = engine.generate(ids, build_method("shadowkv", budget=1.0, rank=10 ** 6), max_new_tokens=5,
                          attention_mask=mask, return_logits=True)
    assert torch.equal(res.tokens, ref.tokens)
    assert float((res.logits - ref.logits).abs().max()) < 1e-3 * float(ref.logits.abs().max())
    small = engine.generate(ids, build_method("shadowkv", budget="16t", rank=32), max_new_tokens=5,
                            attention_mask=mask, return_logits=True)
    assert bool(torch.isfinite(small.logits).all()) and small.bytes_by_tier["dram"] > 0
    assert small.method_stats["bytes_h2d"] > 0 and small.bytes_by_tier["gpu"] < ref.bytes_by_tier["gpu"]


def test_through_the_experiment_runner(tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / "run.py"), "method.name=shadowkv", "method.params.budget=16t",
           "model=tiny-random", "workload=random", "workload.prompt_len=64", "workload.gen_len=3",
           "hardware=h200", "hardware.gpu_capacity=null", "hardware.dram_capacity=null", "hardware.cxl_capacity=null",
           f"results_dir={tmp_path / 'results'}", "progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shadowkv" in out.stdout and "not modelled" not in out.stdout, out.stdout


@pytest.mark.parametrize("padded", [False, True])
def test_gpu_bytes_and_placement_match_the_ledger(padded):
    from hybridgen.methods.placement import KVShape

    B, Hq, Hkv, T, steps, layers = 3, 4, 2, 150, 4, 3
    valid = left_padding(random.Random(8), B, T, min_real=30) if padded else None
    m = ShadowKV(budget="24t", rank=12, outlier_ratio=0.5)
    run = drive(m, (B, Hq, Hkv, D, T), steps, seed=8, layers=layers, valid=valid, rotary=ROT,
                kv_fn=rope_fn(valid, B))
    gpu = run.ctx.store.bytes_by_tier()["gpu"]
    assert m.gpu_bytes(layers, B, Hkv, D, 4, T, steps, masked=padded) == gpu
    shape = KVShape(layers=layers, kv_heads=Hkv, head_dim=D, dtype_bytes=4, batch=B, context=T + steps,
                    new_tokens=steps)
    assert m.placement_for(gpu + B * T + layers * B * Hkv * 200, shape) == {}  # masks counted: an upper bound
    with pytest.raises(ConfigError, match="'shadowkv' needs .* of GPU memory") as info:
        m.placement_for(gpu // 2, shape)
    assert "\n" not in str(info.value)
