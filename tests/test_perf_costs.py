"""hybridgen.perf cost terms: each one moves the prediction the way it should."""
from __future__ import annotations

import dataclasses

import pytest

from hybridgen import perf as pm
from hybridgen.hybrid.cost import hybridgen_cost
from hybridgen.perf.costs import cpu_attention_split_cost, full_cost

LLAMA8B = pm.ModelShape(name="llama-3.1-8b-shape", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, vocab_size=128256)
MHA = dataclasses.replace(LLAMA8B, name="mha", num_kv_heads=32)
W = pm.Workload(batch=8, context=32768)


def ctx(shape=LLAMA8B, w=W, gpu=None, **host) -> pm.CostContext:
    prof = pm.load_profile("h200-host")
    prof = dataclasses.replace(prof, host=dataclasses.replace(prof.host, **host))
    if gpu:
        prof = dataclasses.replace(prof, gpu=dataclasses.replace(prof.gpu, **gpu))
    return pm.CostContext(shape, w, prof)


def hg(c, **kw):
    args = dict(gpu_budget=0.1, topk_ratio=0.05, pipelined=False, mapping="dram")
    args.update(kw)
    return hybridgen_cost(c, **args)


def test_fixed_per_layer_cost_grows_with_op_and_launch_costs():
    cheap, dear = ctx(op_us=1.0), ctx(op_us=100.0)
    for cost in (lambda c: hg(c), lambda c: cpu_attention_split_cost(c, 0.1)):
        a, b = cost(cheap), cost(dear)
        assert b.attn > a.attn and b.breakdown["fixed_s"] > a.breakdown["fixed_s"]
    slow_launch = ctx(gpu={"launch_us": 50.0})
    assert full_cost(slow_launch).attn > full_cost(ctx()).attn
    # at a 98% GPU share the fixed cost dominates the split: ~1 ms measured on the H200, not ~0.2
    split = cpu_attention_split_cost(pm.CostContext(MHA, pm.Workload(batch=8, context=4096), pm.load_profile("h200-host")),
                                     0.98, pinned=False, serial=True)
    assert 0.8e-3 < split.attn < 1.2e-3


def test_work_after_the_wait_is_serial_not_inside_the_max():
    c = ctx(key_scan_pinned_gbps={"bf16": 5000.0}, topk_gbps=5000.0, group_score_gbps=5000.0, select_gbps=5000.0, op_us=0.0,
            dram_read_gbps=5000.0, gather_gbps=5000.0)
    lay = hg(c, gpu_budget=0.5, topk_ratio=0.01)
    br = lay.breakdown
    assert lay.cpu < br["gpu_pre_s"]                          # the CPU branch is hidden
    assert lay.attn == pytest.approx(br["gpu_pre_s"] + br["after_wait_s"])
    assert lay.attn > max(lay.cpu, br["gpu_pre_s"])            # the softmax after the wait adds
    slow = hg(ctx(), gpu_budget=0.5, topk_ratio=0.01)          # CPU-bound: CPU branch + after
    assert slow.attn == pytest.approx(slow.cpu + slow.breakdown["after_wait_s"])
    split = cpu_attention_split_cost(ctx(), 0.5)
    assert split.attn == pytest.approx(max(split.cpu, split.breakdown["gpu_attn_s"]) + split.breakdown["after_wait_s"])


def test_serial_start_adds_the_gpu_part():
    c = ctx()
    assert hg(c, serial=True).attn > hg(c).attn
    assert cpu_attention_split_cost(c, 0.5, serial=True).attn > cpu_attention_split_cost(c, 0.5).attn


def test_pinned_host_keys_scan_slower_and_are_the_default_with_a_gpu():
    c = ctx()
    pinned, pageable = hg(c, pinned=True), hg(c, pinned=False)
    assert pinned.breakdown["scan_rate_gbps"] == c.hw.host.key_scan_pinned_gbps["bf16"]
    assert pageable.breakdown["scan_rate_gbps"] == c.hw.host.key_scan_gbps["bf16"]
    assert pinned.attn > pageable.attn
    assert hg(c).attn == pinned.attn                           # kv/tiers.py pins host KV when CUDA exists
    exact_p, exact_u = cpu_attention_split_cost(c, 0.1, pinned=True), cpu_attention_split_cost(c, 0.1, pinned=False)
    assert exact_p.breakdown["cpu_attn_s"] > exact_u.breakdown["cpu_attn_s"]
    emulated = ctx(gpu={"emulated_on_host": True})
    assert hg(emulated).breakdown["scan_rate_gbps"] == c.hw.host.key_scan_gbps["bf16"]  # nothing pinned there
    # an fp32 workload has no pinned fp32 figure: the pageable fp32 (row-major) rate
    c32 = ctx(w=pm.Workload(batch=8, context=32768, dtype="fp32"))
    assert hg(c32).breakdown["scan_rate_gbps"] == c.hw.host.key_scan_gbps["fp32"] == 61.5


def test_group_score_and_topk_rates_are_priced():
    """Without the fused selection's rate (torch's group score + top-k, as the probe's step)."""
    fast, slow_group, slow_topk = ctx(select_gbps=None), ctx(group_score_gbps=0.5, select_gbps=None), \
        ctx(topk_gbps=0.5, select_gbps=None)
    base = hg(fast)
    assert base.breakdown["group_score_s"] > 0
    assert hg(slow_group).attn > base.attn and hg(slow_topk).attn > base.attn
    per_head = hg(fast, per_head=True)
    assert per_head.breakdown["group_score_s"] == 0.0         # per-head selection has no group score
    assert per_head.breakdown["topk_s"] == pytest.approx(4 * base.breakdown["topk_s"])  # Hq rows, not Hkv
    # without a group-score figure the top-k rate prices it
    no_group = ctx(group_score_gbps=None, topk_gbps=1.0, select_gbps=None)
    assert hg(no_group).breakdown["group_score_s"] == pytest.approx(8 * 32 * round(0.9 * 32768) * 4 / 1e9)


def test_gqa_rate_prices_the_unfused_partials_not_full_or_mha():
    """The unfused rate prices a GQA partial only where it runs unfused: fp32 KV, or a CPU-emulated
    GPU; a 16-bit partial on a real GPU is torch's flash kernel, priced at the fused rate."""
    slow_gqa = {"gqa_attention_gbps": 100.0}
    assert full_cost(ctx(gpu=slow_gqa)).attn == pytest.approx(full_cost(ctx()).attn)     # fused SDPA
    fp32 = pm.Workload(batch=W.batch, context=W.context, dtype="fp32")
    a, b = cpu_attention_split_cost(ctx(w=fp32), 0.5), cpu_attention_split_cost(ctx(w=fp32, gpu=slow_gqa), 0.5)
    assert b.breakdown["gpu_attn_s"] > a.breakdown["gpu_attn_s"]
    emulated = {"emulated_on_host": True}
    a = cpu_attention_split_cost(ctx(gpu=emulated), 0.5)
    assert cpu_attention_split_cost(ctx(gpu={**emulated, **slow_gqa}), 0.5).breakdown["gpu_attn_s"] > \
        a.breakdown["gpu_attn_s"]
    flash = cpu_attention_split_cost(ctx(gpu=slow_gqa), 0.5).breakdown["gpu_attn_s"]  # bf16 on the H200
    assert flash == pytest.approx(cpu_attention_split_cost(ctx(), 0.5).breakdown["gpu_attn_s"])
    mha = cpu_attention_split_cost(ctx(MHA, w=fp32, gpu=slow_gqa), 0.5).breakdown["gpu_attn_s"]
    assert mha == pytest.approx(cpu_attention_split_cost(ctx(MHA, w=fp32), 0.5).breakdown["gpu_attn_s"])


def test_an_emulated_gpu_adds_the_branches():
    real, emulated = ctx(), ctx(gpu={"emulated_on_host": True})
    r, e = cpu_attention_split_cost(real, 0.5, pinned=False), cpu_attention_split_cost(emulated, 0.5, pinned=False)
    assert e.attn == pytest.approx(e.cpu + e.breakdown["gpu_attn_s"] + e.breakdown["after_wait_s"])
    assert e.attn > r.attn


def test_a_measured_row_gather_rate_slows_the_gathers():
    base = hg(ctx(), pipelined=True)
    slow = hg(ctx(gather_gbps=0.5), pipelined=True)
    assert slow.breakdown["gather_s"] > base.breakdown["gather_s"]
    assert slow.breakdown["kept_keys_s"] > base.breakdown["kept_keys_s"]  # the kept key rows: a gather too
    assert slow.breakdown["exact_logits_s"] == pytest.approx(base.breakdown["exact_logits_s"])  # a dense pass
    assert slow.attn > base.attn


def test_hybridgen_key_sketch_prices_fewer_scanned_bytes_and_the_rerank():
    """key_sketch: the scan reads sketch bytes at the measured sketch rate (else the key scan's
    rate, flagged), and the branch pays the exact rows of ceil(oversample * k) candidates."""
    import dataclasses

    from hybridgen.attention.key_sketch import sketch_bytes_per_token
    from hybridgen.hybrid import HybridGen
    from hybridgen.perf import predict_step
    from hybridgen.perf.profiles import load_profile
    from hybridgen.shapes import Workload

    hw = load_profile("h200-host")  # which measured the sketch's rate: here as if it had not
    hw = dataclasses.replace(hw, host=dataclasses.replace(hw.host, key_sketch_gbps={}))
    work = Workload(batch=8, context=32768, dtype="bf16")
    base = HybridGen(topk_ratio=0.05, scan="exact", key_sketch="none")  # against the exact key scan
    exact = predict_step(base, "llama-3.1-8b", work, hw).breakdown
    sk = predict_step(dataclasses.replace(base, key_sketch="int4"), "llama-3.1-8b", work, hw).breakdown
    ratio = sketch_bytes_per_token("int4", 128) / (128 * 2)
    from hybridgen.attention.key_sketch import SKETCH_BLOCK
    from hybridgen.shapes import as_model_shape

    S_h = pm.CostContext(as_model_shape("llama-3.1-8b"), work, hw).split(base.gpu_budget)[1]

    tail = SKETCH_BLOCK / 2  # the keys' partial block, scanned exactly
    assert sk["scanned_key_bytes"] == pytest.approx(8 * (S_h - tail) * 8 * sketch_bytes_per_token("int4", 128))
    assert exact["scan_s"] * ratio < sk["scan_s"] < exact["scan_s"] * ratio * 1.05  # no sketch rate: the key scan's
    assert sk["scan_rate_measured"] is False and exact["scan_rate_measured"] is True
    assert exact["rerank_s"] == 0 and sk["rerank_s"] > 0
    more = predict_step(dataclasses.replace(base, key_sketch="int4", sketch_oversample=2.0), "llama-3.1-8b", work,
                        hw).breakdown
    assert more["rerank_s"] > sk["rerank_s"]
    fast = dataclasses.replace(hw, host=dataclasses.replace(hw.host, key_sketch_gbps={"int4": 1000.0}))
    measured = predict_step(dataclasses.replace(base, key_sketch="int4"), "llama-3.1-8b", work, fast).breakdown
    assert measured["scan_rate_measured"] is True and measured["scan_s"] < sk["scan_s"]


def test_hybridgen_bf16dot_scan_prices_the_rerank_at_the_assumed_scan_rate():
    """scan='bf16dot' (the default) on bf16 keys, on a profile that did not measure its rate:
    the same key bytes at the exact scan's rate (flagged as not measured), plus the exact rows of
    ceil(scan_oversample * k) candidates and BF16DOT_HOST_OPS; on fp32 keys it is the exact
    scan, priced as such."""
    import dataclasses

    from hybridgen.hybrid import HybridGen
    from hybridgen.hybrid.cost import BF16DOT_HOST_OPS
    from hybridgen.perf import predict_step
    from hybridgen.perf.profiles import load_profile
    from hybridgen.shapes import Workload

    hw = load_profile("h200-host")  # which measured the scan's rate: here as if it had not
    hw = dataclasses.replace(hw, host=dataclasses.replace(hw.host, key_scan_bf16dot_gbps=None))
    work = Workload(batch=8, context=32768, dtype="bf16")
    dot = HybridGen(topk_ratio=0.05, key_sketch="none")
    assert dot.scan == "bf16dot"
    exact = predict_step(dataclasses.replace(dot, scan="exact"), "llama-3.1-8b", work, hw).breakdown
    got = predict_step(dot, "llama-3.1-8b", work, hw).breakdown
    assert got["scan_s"] == pytest.approx(exact["scan_s"]) and got["scanned_key_bytes"] == exact["scanned_key_bytes"]
    assert got["scan_rate_measured"] is False and exact["scan_rate_measured"] is True
    assert exact["rerank_s"] == 0 and got["rerank_s"] > 0
    assert got["fixed_s"] - exact["fixed_s"] == pytest.approx(BF16DOT_HOST_OPS * hw.host.op_us * 1e-6)
    more = predict_step(dataclasses.replace(dot, scan_oversample=2.0), "llama-3.1-8b", work, hw).breakdown
    assert more["rerank_s"] > got["rerank_s"]
    fast = dataclasses.replace(hw, host=dataclasses.replace(hw.host, key_scan_bf16dot_gbps=1000.0))
    measured = predict_step(dot, "llama-3.1-8b", work, fast).breakdown  # a profile that measured the scan
    assert measured["scan_rate_measured"] is True and measured["scan_rate_gbps"] == 1000.0
    assert measured["scan_s"] < got["scan_s"] and measured["rerank_s"] == pytest.approx(got["rerank_s"])
    fp32 = Workload(batch=8, context=32768, dtype="fp32")
    assert (predict_step(dot, "llama-3.1-8b", fp32, hw).breakdown
            == predict_step(dataclasses.replace(dot, scan="exact"), "llama-3.1-8b", fp32, hw).breakdown)


def test_selection_is_priced_as_the_code_does_it():
    """fused_select (the code's C selection) at host.select_gbps where the profile has it; the
    probe's plain-torch step (fused_select False) and a profile without the rate price torch's
    group score + top-k."""
    fused = hg(ctx(select_gbps=50.0), topk_ratio=0.05)
    torch_sel = hg(ctx(select_gbps=50.0), topk_ratio=0.05, fused_select=False)
    missing = hg(ctx(select_gbps=None), topk_ratio=0.05)
    assert fused.breakdown["fused_select"] and fused.breakdown["group_score_s"] == 0.0
    c = ctx()
    logit_bytes = c.B * c.Hq * c.split(0.1)[1] * 4
    assert fused.breakdown["topk_s"] == pytest.approx(logit_bytes / 50e9)
    for lay in (torch_sel, missing):
        assert not lay.breakdown["fused_select"] and lay.breakdown["group_score_s"] > 0
    assert torch_sel.breakdown["topk_s"] == pytest.approx(missing.breakdown["topk_s"])


def test_the_branch_is_priced_in_the_rounds_of_rows_its_threads_take():
    """The fused bf16-dot branch hands whole (batch, KV head) rows to the threads: 64 rows on 15
    threads take 5 rounds, not 4.27 (every stage x 75/64); the stagewise branch (exact scan, or too
    few rows to keep the threads busy) splits its scan's tokens but the later stages' rows: 8 rows
    on 16 threads run those stages at half the threads (x 2)."""
    from hybridgen.hybrid.cost import row_rounds

    assert row_rounds(64, 16, fused=True) == (1.0, 1.0)
    assert row_rounds(64, 15, fused=True) == (pytest.approx(75 / 64), 1.0)
    assert row_rounds(8, 16, fused=True) == (1.0, 2.0)    # fused_branch_pays(8, 16) is False: stagewise
    assert row_rounds(64, 15, fused=False) == (1.0, 1.0)
    assert row_rounds(64, None, fused=True) == (1.0, 1.0) and row_rounds(64, 1, fused=True) == (1.0, 1.0)
    w8 = pm.Workload(batch=8, context=32768, dtype="bf16")
    on16, on15 = ctx(w=w8, cores=16), ctx(w=w8, cores=15)
    args = dict(gpu_budget=0.1, topk_ratio=0.05, pipelined=False, mapping="dram", scan="bf16dot")
    a, b = hybridgen_cost(on16, **args).breakdown, hybridgen_cost(on15, **args).breakdown
    for stage in ("scan_s", "topk_s", "rerank_s", "gather_s"):
        assert b[stage] == pytest.approx(a[stage] * 75 / 64)
    assert (a["row_rounds_factor"], b["row_rounds_factor"]) == (1.0, pytest.approx(75 / 64))
    w1 = pm.Workload(batch=1, context=32768, dtype="bf16")  # 8 rows on 16 threads: stagewise
    one = hybridgen_cost(ctx(w=w1, cores=16), **args).breakdown
    even = hybridgen_cost(ctx(w=w1, cores=8), **args).breakdown
    assert one["scan_s"] == pytest.approx(even["scan_s"]) and one["gather_s"] == pytest.approx(2 * even["gather_s"])


def test_the_rerank_is_priced_at_the_selection_that_runs_it():
    """The candidates' re-rank runs the C selection (host.select_gbps), not torch's top-k: its
    price moves with select_gbps and not with topk_gbps; the plain-torch step (fused_select
    False) the other way round."""
    args = dict(gpu_budget=0.1, topk_ratio=0.05, pipelined=False, mapping="dram", scan="bf16dot")
    base = hybridgen_cost(ctx(), **args).breakdown["rerank_s"]
    assert hybridgen_cost(ctx(topk_gbps=1000.0), **args).breakdown["rerank_s"] == pytest.approx(base)
    assert hybridgen_cost(ctx(select_gbps=1000.0), **args).breakdown["rerank_s"] < base
    torch_args = dict(args, fused_select=False)
    slow = hybridgen_cost(ctx(), **torch_args).breakdown["rerank_s"]
    assert hybridgen_cost(ctx(topk_gbps=1000.0), **torch_args).breakdown["rerank_s"] < slow


@pytest.mark.parametrize("batch,fused", [(8, True), (1, False)])
def test_hybridgen_default_sketch_pays_the_host_ops_of_the_branch_that_runs(batch, fused):
    """The default int4 sketch over bf16 keys: fused per row where the rows keep the host's
    cores busy (batch 8: 64 rows on h200-host's 16 cores), then the bf16-dot branch's host ops
    plus the sync's; otherwise (batch 1: 8 rows) the stagewise sketch branch's."""
    import dataclasses

    from hybridgen.hybrid import HybridGen
    from hybridgen.hybrid.cost import BF16DOT_HOST_OPS, SKETCH_FUSED_HOST_OPS, SKETCH_HOST_OPS
    from hybridgen.perf import predict_step
    from hybridgen.perf.profiles import load_profile
    from hybridgen.shapes import Workload

    hw = load_profile("h200-host")
    work = Workload(batch=batch, context=32768, dtype="bf16")
    plain = HybridGen(topk_ratio=0.05, three_way=False, key_sketch="none")
    assert HybridGen().key_sketch == "int4"
    none = predict_step(plain, "llama-3.1-8b", work, hw).breakdown
    sk = predict_step(dataclasses.replace(plain, key_sketch="int4"), "llama-3.1-8b", work, hw).breakdown
    extra = SKETCH_FUSED_HOST_OPS if fused else SKETCH_HOST_OPS - BF16DOT_HOST_OPS
    assert sk["fixed_s"] - none["fixed_s"] == pytest.approx(extra * hw.host.op_us * 1e-6)
    assert (sk["row_rounds_factor"] == 1.0) is fused  # 64 rows on 16 cores: whole rounds
    assert sk["scan_s"] < 0.6 * none["scan_s"]  # 72 of 256 bytes per key, at the measured sketch rate
