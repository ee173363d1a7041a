"""The performance model prices HybridGen's scheduler-owned knobs where the scheduler settles.

:func:`hybridgen.hybrid.cost.settled_knobs` runs the feedback scheduler itself on modelled branch
times; these tests feed it synthetic costs whose balance points are known in closed form.
"""
import dataclasses
import math

import pytest

from hybridgen.hybrid.cost import SETTLE_DECISIONS, settled_knobs
from hybridgen.hybrid.scheduler import SchedulerConfig
from hybridgen.methods import build_method
from hybridgen.perf import LayerCost, Workload, predict_step

CFG = SchedulerConfig()


def _linear(cpu_per_ratio, cpu_fixed, gpu, host=1000.0, scan_s=1.0, copy_s=0.5):
    """Costs of a layer: CPU = fixed + cpu_per_ratio * ratio, scanned share (1 - f) at scan_s per
    host, streamed share f at copy_s per host (the three-way flows), GPU constant."""
    calls = []

    def price(ratio, fraction):
        calls.append((ratio, fraction))
        f = fraction or 0.0
        cpu = cpu_fixed + cpu_per_ratio * ratio + (1 - f) * scan_s
        bd = {"streamed_tokens": f * host, "stream_copy_s": f * copy_s} if fraction is not None else {}
        return LayerCost(attn=cpu, layer=max(cpu, gpu), cpu=cpu, gpu=gpu, breakdown=bd)

    return price, calls


def test_the_ratio_settles_at_the_floor_when_the_cpu_branch_is_always_the_bottleneck():
    price, calls = _linear(cpu_per_ratio=1.0, cpu_fixed=5.0, gpu=1.0)
    ratio, fraction = settled_knobs(build_method("hybridgen", three_way=False), price)
    assert ratio == pytest.approx(CFG.min_ratio) and fraction is None
    assert len(calls) == SETTLE_DECISIONS


def test_the_ratio_settles_at_the_cap_when_the_cpu_branch_is_always_hidden():
    price, _ = _linear(cpu_per_ratio=1.0, cpu_fixed=0.0, gpu=10.0, scan_s=0.0)
    assert settled_knobs(build_method("hybridgen", three_way=False), price)[0] == pytest.approx(CFG.max_ratio)


@pytest.mark.parametrize("balance", [0.02, 0.07, 0.2])
def test_the_ratio_settles_around_the_balance_of_cpu_and_gpu(balance):
    # cpu = 10 * ratio + 1 (scan 1) equals gpu at ratio = balance: the rule oscillates x1.2 / x0.8 around it
    price, _ = _linear(cpu_per_ratio=10.0, cpu_fixed=0.0, gpu=10.0 * balance + 1.0)
    ratio, _ = settled_knobs(build_method("hybridgen", three_way=False), price)
    assert balance * CFG.shrink <= ratio <= balance * CFG.grow


@pytest.mark.parametrize("scan_s,copy_s", [(1.0, 0.5), (1.0, 3.0), (2.0, 1.0)])
def test_the_streamed_fraction_settles_where_the_rule_balances_scan_and_copy(scan_s, copy_s):
    # the rule's target f = c / (c + p), c: CPU seconds per scanned host token, p: copy seconds per
    # streamed token; with the ratio at its floor the CPU is fixed 0.2 + 0.01 + (1 - f) scan_s over (1 - f) host
    host, fixed = 1000.0, 0.2 + 0.01
    price, _ = _linear(cpu_per_ratio=1.0, cpu_fixed=0.2, gpu=0.0, host=host, scan_s=scan_s, copy_s=copy_s)
    _, f = settled_knobs(build_method("hybridgen"), price)
    c = (fixed + (1 - f) * scan_s) / ((1 - f) * host)
    p = copy_s / host
    assert f == pytest.approx(min(CFG.max_stream, c / (c + p)), abs=1e-4)


def test_pinned_knobs_are_priced_as_they_are():
    price, calls = _linear(cpu_per_ratio=1.0, cpu_fixed=5.0, gpu=1.0)
    assert settled_knobs(build_method("hybridgen", topk_ratio=0.2, stream_ratio=0.3), price) == (0.2, 0.3)
    assert settled_knobs(build_method("hybridgen", topk_ratio=0.2, three_way=False), price) == (0.2, None)
    assert not calls


def test_the_default_is_priced_where_its_scheduler_settles_not_at_its_start():
    """On an H200 host at Llama-3.1-8B 8 x 32K the CPU branch is the bottleneck: the ratio falls to its
    floor and the streamed share moves off its start; the prediction says so in its breakdown."""
    w = Workload(batch=8, context=32768)
    default = predict_step(build_method("hybridgen"), "llama-3.1-8b", w, "h200-host")
    assert default.breakdown["topk_ratio"] == pytest.approx(CFG.min_ratio)
    assert not math.isclose(default.breakdown["stream_ratio"], CFG.start_stream, abs_tol=0.02)
    at_start = predict_step(build_method("hybridgen", topk_ratio=CFG.start_ratio, stream_ratio=CFG.start_stream),
                            "llama-3.1-8b", w, "h200-host")
    assert default.total_s < at_start.total_s  # balancing pays where the CPU is the bottleneck
    plain = predict_step(build_method("hybridgen", three_way=False), "llama-3.1-8b", w, "h200-host")
    assert default.total_s < plain.total_s


def test_the_model_caps_the_selection_at_the_scanned_tokens_as_the_code_does():
    """k counts every host token but is at most the (1 - f) scanned ones: a ratio above 1 - f is
    priced at the scanned tokens, not beyond them."""
    w = Workload(batch=8, context=32768)
    over = predict_step(build_method("hybridgen", topk_ratio=0.5, stream_ratio=0.7), "llama-3.1-8b", w, "h200-host")
    at_cap = predict_step(build_method("hybridgen", topk_ratio=0.3, stream_ratio=0.7), "llama-3.1-8b", w, "h200-host")
    host = over.breakdown["streamed_tokens"] / 0.7
    assert over.breakdown["topk_tokens"] == at_cap.breakdown["topk_tokens"] <= math.ceil(0.3 * host)
    assert over.total_s == pytest.approx(at_cap.total_s)


def _slow_gpu(hw, factor):
    """The profile with its GPU's rates divided by ``factor`` (factor 1: unchanged)."""
    g = hw.gpu
    return dataclasses.replace(hw, gpu=dataclasses.replace(
        g, hbm_gbps=g.hbm_gbps / factor, attention_gbps=g.attention_gbps / factor,
        gqa_attention_gbps=g.gqa_attention_gbps / factor if g.gqa_attention_gbps else None))


@pytest.mark.parametrize("profile,emulated,slow", [("h200-host", False, 1), ("a100-80gb", False, 1),
                                                   ("h200-host", True, 1), ("h200-host", False, 300)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_the_three_way_cost_with_nothing_streamed_is_the_plain_split_cost(profile, emulated, slow, pipelined):
    """f = 0 streams nothing: the variant's layer and attention are hybridgen_cost's exactly, where
    the CPU branch bounds the layer and where the GPU path does (slow: the GPU's rates / 300). It
    used to leave the exact recompute off the GPU path and overlap the after-wait work with the
    CPU branch; and not pipelined, ship='partial''s pass over the V rows stays in the CPU branch."""
    from hybridgen.hybrid.cost import hybridgen_cost, hybridgen_variant_cost
    from hybridgen.perf import CostContext, as_model_shape, load_profile

    hw = load_profile(profile)
    hw = _slow_gpu(dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, emulated_on_host=emulated)), slow)
    gpu_bound = []
    for batch, context in ((8, 32768), (1, 4096)):
        c = CostContext(as_model_shape("llama-3.1-8b"), Workload(batch=batch, context=context), hw)
        assert c.emulated == emulated
        plain = hybridgen_cost(c, 0.1, 0.05, pipelined=pipelined, scan="bf16dot")
        variant = hybridgen_variant_cost(c, 0.1, 0.05, three_way=True, stream_ratio=0.0, pipelined=pipelined,
                                         scan="bf16dot")
        assert variant.layer == pytest.approx(plain.layer, rel=1e-12)
        assert variant.attn == pytest.approx(plain.attn, rel=1e-12)
        gpu_bound.append(plain.gpu > plain.cpu)
        streamed = hybridgen_variant_cost(c, 0.1, 0.05, three_way=True, stream_ratio=0.3, pipelined=pipelined,
                                          scan="bf16dot")
        assert streamed.layer != pytest.approx(plain.layer, rel=1e-6)  # and streaming does change it
        if not pipelined:  # as hybridgen_cost: layer = rest + attn, the partial pass inside attn
            partial = hybridgen_variant_cost(c, 0.1, 0.05, ship="partial", three_way=True, stream_ratio=0.0,
                                             pipelined=False, scan="bf16dot")
            assert partial.layer == pytest.approx(c.rest + partial.attn, rel=1e-12)
    assert any(gpu_bound) == (slow > 1)  # the slow GPU does bound the layer
