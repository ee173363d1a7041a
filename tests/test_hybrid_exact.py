"""`hybrid-exact` equals `full` (and the float64 reference) at the method level, for every split."""
import random

import pytest
import torch

from hybridgen.methods.full import Full
from hybridgen.attention import dense_attention_reference
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.errors import ConfigError
from hybridgen.hybrid.exact import HybridExact
from hybridgen.methods import Budget, build_method
from hybridgen.testing import Shape, drive, left_padding, method_context
from tests._attention_cases import GQA_RATIOS, TOL, rel_err

POOL = CPUAttentionPool(workers=1)


def _ctx(B, Hq, Hkv, D, T, steps, dtype, layers=2):
    return method_context(Shape(B, Hq, Hkv, D, T), steps, dtype=dtype, layers=layers, pool=POOL)


def _run(method, shape, dtype, seed, steps, valid):
    """Prefill + ``steps`` decode steps over 2 layers with seeded random q/k/v (hybridgen.testing).

    Returns the decode outputs [(layer, step, q, out, k_hist, v_hist)] and the method's
    context (its store still holds the method's KV).
    """
    run = drive(method, shape, steps, seed=seed, valid=valid, dtype=dtype, pool=POOL)
    return [(r.layer, r.step, r.q, r.out, r.k, r.v) for r in run.records], run.ctx


def _random_shape(gen, seed):
    """(B, Hq, Hkv, D, T): GQA ratio and prompt length cycle with the seed, the rest is random."""
    Hkv = gen.randint(1, 3)
    G = GQA_RATIOS[seed % len(GQA_RATIOS)]
    T = (13, 1, 7, 2, 5, 11, 3, 8)[seed % 8]
    return (gen.randint(1, 3), Hkv * G, Hkv, gen.choice((8, 16)), T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(8))
def test_hybrid_exact_equals_full_at_every_split(seed, dtype):
    gen = random.Random(seed)
    shape = _random_shape(gen, seed)
    B, Hq, Hkv, D, T = shape
    steps = gen.randint(2, 4)
    valid = left_padding(gen, B, T) if seed % 2 else None  # >= 1 real token per row
    full_outs, full_ctx = _run(Full(), shape, dtype, seed, steps, valid)
    budgets = [Budget(tokens=n) for n in range(T + steps + 2)] + [Budget(ratio=r) for r in (0.0, 0.3, 0.5, 1.0)]
    for budget in budgets:
        for sinks in (0, 1, T + steps + 5):  # 0, some, more than any budget
            method = HybridExact(gpu_budget=budget, sinks=sinks)
            outs, ctx = _run(method, shape, dtype, seed, steps, valid)
            for (layer, step, q, out, k, v), (_, _, _, ref_out, _, _) in zip(outs, full_outs):
                assert out.dtype == dtype and out.shape == (B, Hq, 1, D)
                err = rel_err(out, ref_out)
                assert err < TOL[dtype], (budget, sinks, layer, step, err)
                mask = None if valid is None else torch.cat([valid, torch.ones(B, step + 1, dtype=torch.bool)], 1)
                dense = dense_attention_reference(q, k, v, ctx.scale, None if mask is None else mask[:, None])
                assert rel_err(out, dense) < TOL[dtype], (budget, sinks, layer, step)
            method.release()
            assert ctx.store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}


@pytest.mark.parametrize("seed", range(6))
def test_placement_follows_budget_sinks_and_recency(seed):
    """Tag each token's V with its position: the GPU holds sinks + the most recent tokens, exactly
    budget.resolve(n) of them; GPU and host together hold every token once."""
    gen = random.Random(seed)
    B, Hkv, D, T, steps = 1, 1, 4, gen.randint(3, 12), gen.randint(1, 12)
    budget = gen.choice([Budget(tokens=gen.randint(0, T + steps)), Budget(ratio=gen.choice((0.0, 0.25, 0.5, 1.0)))])
    sinks = gen.choice((0, 1, 2, 4, 50))
    ctx = _ctx(B, Hkv, Hkv, D, T, steps, torch.float32, layers=1)
    m = HybridExact(gpu_budget=budget, sinks=sinks)
    m.bind(ctx)
    pos = torch.arange(T, dtype=torch.float32).view(1, 1, T, 1).expand(1, 1, T, D).contiguous()
    m.prefill(0, pos.clone(), pos, pos, None)
    for n in range(T, T + steps + 1):
        gpu, host = m.gpu[0], m.host[0]
        on_gpu = sorted(int(x) for x in gpu.v[0, 0, :, 0])
        on_host = sorted(int(x) for x in host.v[0, 0, :, 0])
        assert sorted(on_gpu + on_host) == list(range(n))
        assert len(on_gpu) == budget.resolve(n), (budget, n)
        s = m.n_sinks[0]
        assert s <= sinks and on_gpu[:s] == list(range(s))
        recent = on_gpu[s:]
        assert recent == list(range(n - len(recent), n))  # a contiguous most-recent window
        if n < T + steps:
            tok = torch.full((1, 1, 1, D), float(n))
            m.decode(0, tok, tok, tok)
    m.release()


def test_all_host_and_empty_host_extremes_hold_memory_where_expected():
    B, Hq, Hkv, D, T, steps = 2, 6, 2, 8, 9, 3
    for budget, gpu_empty, host_empty in ((Budget(tokens=0), True, False), (Budget(ratio=1.0), False, True),
                                          (Budget(tokens=T + steps), False, True)):
        m = HybridExact(gpu_budget=budget, sinks=4)
        outs, ctx = _run(m, (B, Hq, Hkv, D, T), torch.float32, 0, steps, None)
        assert (m.gpu[0].length == 0) == gpu_empty and (m.host[0].length == 0) == host_empty
        held = {"gpu": 0, "dram": 0, "cxl": 0}
        for seg in m.gpu + m.host:
            held["gpu" if seg.key_tier is ctx.store["gpu"] else "dram"] += seg.nbytes
        assert ctx.store.bytes_by_tier() == held
        if host_empty:
            assert m.stats["bytes_h2d"] == 0  # the CPU pool was never used
        if gpu_empty:
            assert held["gpu"] == 0
        m.release()


def test_host_keys_and_values_on_separate_tiers():
    m = HybridExact(gpu_budget=Budget(tokens=3), sinks=1, key_tier="dram", value_tier="cxl")
    outs, ctx = _run(m, (1, 4, 2, 8, 11), torch.float32, 3, 2, None)
    full_outs, _ = _run(Full(), (1, 4, 2, 8, 11), torch.float32, 3, 2, None)
    for a, b in zip(outs, full_outs):
        assert rel_err(a[3], b[3]) < 1e-5
    by = ctx.store.bytes_by_tier()
    assert by["dram"] > 0 and by["cxl"] > 0 and by["dram"] == by["cxl"]  # K on dram, V on cxl
    m.release()


def test_build_and_bad_parameters():
    m = build_method("hybrid-exact", gpu_budget="25%", sinks=2)
    assert m.gpu_budget == Budget(ratio=0.25) and m.config()["gpu_budget"] == "0.25"
    with pytest.raises(ConfigError):
        build_method("hybrid-exact", gpu_budget="-3")
    with pytest.raises(ConfigError):
        HybridExact(sinks=-1).bind(_ctx(1, 1, 1, 4, 4, 1, torch.float32))
    with pytest.raises(ConfigError):
        HybridExact(key_tier="gpu").bind(_ctx(1, 1, 1, 4, 4, 1, torch.float32))
