"""HybridGen's fused GPU share (hybridgen.hybrid.gpu_share) and the cost that prices it.

With nothing on the host, ``decode`` runs ``full``'s own attention: outputs, logits and greedy
tokens equal ``full``'s bit for bit (CPU path), and a budget that covers the context keeps the
host empty. With host tokens, the share's [out, lse] and the CPU's shipped part merge exactly:
equal to the dense float64 reference when the top-k takes every host token. The performance
model prices what the code runs: at gpu_budget=1.0 within 1.10x of ``full`` and never slower
for a larger GPU share.
"""
import random

import pytest
import torch

from hybridgen import perf as pm
from hybridgen.attention import dense_attention_reference
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.hybrid import HybridGen
from hybridgen.kv import TieredStore
from hybridgen.methods import Budget
from hybridgen.methods.footprint import KVShape
from hybridgen.methods.full import Full
from hybridgen.model import load_model
from hybridgen.perf.context import CostContext
from hybridgen.perf.costs import full_cost
from hybridgen.testing import drive, left_padding

POOL = CPUAttentionPool(workers=1)
B, T, N = 2, 37, 9


@pytest.fixture(scope="module")
def tiny():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def _prompt(padded: bool):
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, :6] = 0
    return ids, mask


# ---------------------------------------------------------------------- nothing on the host: full's bits
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("budget", [Budget(ratio=1.0), Budget(tokens=T + N)])
def test_engine_without_host_tokens_equals_full_bit_for_bit(tiny, padded, budget):
    ids, mask = _prompt(padded)
    ref = tiny.generate(ids, "full", max_new_tokens=N, attention_mask=mask, return_logits=True)
    store = TieredStore()
    m = HybridGen(gpu_budget=budget)
    got = tiny.generate(ids, m, max_new_tokens=N, attention_mask=mask, return_logits=True, store=store)
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.logits, ref.logits)  # identical, not close
    st = got.method_stats
    assert st["host_tokens_scanned"] == 0 and st["bytes_h2d"] == 0 and st["decode_steps"] == N - 1
    sp = tiny.spec
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N, masked=padded)
    peak = {t: n for t, n in store.peak_by_tier().items() if n}
    assert peak == {t: n for t, n in m.footprint(shape).tier_bytes.items() if n}
    assert m.footprint(shape).host_tokens == 1  # the host segment's one empty slot


@pytest.mark.parametrize("seed", range(4))
def test_method_without_host_tokens_equals_full_bit_for_bit(seed):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2))
    shape = (gen.randint(1, 3), Hkv * gen.choice((1, 3, 4)), Hkv, gen.choice((8, 16)), gen.randint(3, 31))
    valid = left_padding(gen, shape[0], shape[-1]) if seed % 2 else None
    ref = drive(Full(), shape, 6, seed=seed, valid=valid, pool=POOL)
    m = HybridGen(gpu_budget=1.0, sinks=gen.choice((0, 2, 4)))
    run = drive(m, shape, 6, seed=seed, valid=valid, pool=POOL)
    for r, g in zip(ref.records, run.records):
        assert torch.equal(g.out, r.out)
    assert all(h.length == 0 for h in m.host)


def test_a_token_budget_above_the_prompt_keeps_new_tokens_until_it_is_full():
    shape = (1, 2, 1, 8, 10)
    m = HybridGen(gpu_budget=Budget(tokens=13), sinks=2, topk_ratio=1.0, min_topk=0)
    drive(m, shape, 6, pool=POOL)
    assert [m.gpu[layer].length for layer in range(2)] == [13, 13]
    assert [m.host[layer].length for layer in range(2)] == [3, 3]  # 16 tokens seen, 13 on the GPU


# ---------------------------------------------------------------------- host tokens: the exact LSE merge
@pytest.mark.parametrize("seed", range(10))
def test_merged_share_equals_the_float64_reference(seed):
    """Top-k = every host token: the share's [lse, out] entry + the shipped part (logits + V rows,
    or the CPU's own [out, lse]) + a streamed slice equal dense float64 attention."""
    gen = random.Random(100 + seed)
    Hkv = gen.choice((1, 2))
    G = (1, 3, 4)[seed % 3]
    T = 2 * gen.randint(2, 20) + 1  # odd prompt lengths
    shape = (gen.randint(1, 3), Hkv * G, Hkv, gen.choice((8, 16)), T)
    valid = left_padding(gen, shape[0], T) if seed % 2 else None
    split = gen.randint(1, T - 1)  # odd and even split points
    m = HybridGen(gpu_budget=Budget(tokens=split), sinks=gen.choice((0, 1, 3)), topk_ratio=1.0, min_topk=0,
                  per_head=gen.random() < 0.5, ship=("logits", "partial")[seed % 2],
                  three_way=seed % 4 == 3, stream_ratio=0.5 if seed % 4 == 3 else None, pipeline=False)
    run = drive(m, shape, 5, seed=seed, valid=valid, dtype=torch.float32, pool=POOL)
    scale = run.ctx.scale
    for r in run.records:
        mask = r.valid[:, None, :] if r.valid is not None else None
        ref = dense_attention_reference(r.q, r.k, r.v, scale, mask)
        err = float((r.out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        assert err < 2e-6, (seed, r.layer, r.step)
    assert m.stats["topk_selected"] > 0 and m.stats["bytes_h2d"] > 0  # the merged path ran


# ---------------------------------------------------------------------- the cost prices what runs
CELLS = [(prof, batch) for prof in ("h200-host", "a100-80gb") for batch in (8, 1)]


@pytest.mark.parametrize("profile,batch", CELLS)
def test_projected_step_with_the_whole_kv_on_the_gpu_is_full_and_never_grows(profile, batch):
    w = pm.Workload(batch=batch, context=32768)
    full = pm.predict_step("full", "llama-3.1-8b", w, profile)
    steps = [pm.predict_step(HybridGen(gpu_budget=g), "llama-3.1-8b", w, profile) for g in (0.1, 0.5, 1.0)]
    assert all(p.fits_gpu for p in steps)
    assert steps[-1].total_s <= 1.10 * full.total_s
    assert steps[0].total_s >= steps[1].total_s >= steps[2].total_s


def test_the_share_is_priced_at_the_fused_rate_and_nothing_on_the_host_is_full():
    from hybridgen.hybrid.cost import SHARE_PRE_KERNELS, hybridgen_cost

    c = CostContext(pm.as_model_shape("llama-3.1-8b"), pm.Workload(batch=8, context=32768),
                    pm.load_profile("a100-80gb"))
    whole, fused = hybridgen_cost(c, 1.0, 0.05), full_cost(c)
    assert (whole.layer, whole.attn, whole.gpu, whole.cpu) == (fused.layer, fused.attn, fused.gpu, 0.0)
    S_g, S_h = c.split(0.5)
    half = hybridgen_cost(c, 0.5, 0.05)
    share = c.gpu_attn(S_g, fused=True) + c.fixed(gpu_kernels=SHARE_PRE_KERNELS - 1)
    assert half.breakdown["gpu_pre_s"] == pytest.approx(share)
    unfused = hybridgen_cost(c, 0.5, 0.05, fused_share=False)  # the H200 probe's plain-torch step
    assert unfused.breakdown["gpu_pre_s"] == pytest.approx(c.gpu_keys(S_g))
    assert unfused.breakdown["after_wait_s"] > half.breakdown["after_wait_s"]
