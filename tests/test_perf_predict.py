"""hybridgen.perf.predict + costs: each method prices itself; monotonicity, bytes, overlap semantics."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest

from hybridgen import perf as pm
from hybridgen.errors import ConfigError
from hybridgen.methods import KVMethod, build_method
from hybridgen.perf.profiles import _read_raw

LLAMA8B = pm.ModelShape(name="llama-3.1-8b-shape", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, vocab_size=128256)
# every built-in cost, at 90% of the KV on the host for the methods that place it
VARIANTS = {
    "full": ("full", {}),
    "hybrid-exact": ("hybrid-exact", {"gpu_budget": 0.1}),
    "hybridgen": ("hybridgen", {"gpu_budget": 0.1, "topk_ratio": 0.05, "three_way": False}),  # the plain split
    "flexgen-stream": ("flexgen", {"gpu_budget": 0.1}),
    "flexgen-cpu": ("flexgen", {"gpu_budget": 0.1, "attention_on": "cpu"}),
    "flexgen-int4": ("flexgen", {"gpu_budget": 0.1, "compress_kv": True}),
    "infinigen": ("infinigen", {}),
    "h2o": ("h2o", {}),
    "snapkv": ("snapkv", {}),
    "streamingllm": ("streamingllm", {}),
    "quest": ("quest", {}),
}


def variant(label: str, **over) -> KVMethod:
    name, params = VARIANTS[label]
    return build_method(name, **{**params, **over})


def hybridgen(**over) -> KVMethod:
    return variant("hybridgen", **over)


def test_predictions_are_labelled_projected():
    pred = pm.predict_step("hybridgen", LLAMA8B, pm.Workload(), "h200-host")
    assert pred.projected is True
    assert "projected" in str(pred)
    assert pred.total_s > 0 and pred.tokens_per_s(8) > 0


@pytest.mark.parametrize("label", sorted(VARIANTS))
def test_more_context_is_slower(label):
    times = [pm.predict_step(variant(label), LLAMA8B, pm.Workload(context=s), "h100-80gb-cxl")
             for s in (8192, 16384, 32768, 65536)]
    for a, b in zip(times, times[1:]):
        assert b.total_s > a.total_s
        assert b.attention_layer_s > a.attention_layer_s


@pytest.mark.parametrize("label,cost", [("full", "full"), ("hybrid-exact", "cpu-attention-split"),
                                        ("hybridgen", "hybridgen-sketch-int4"), ("flexgen-stream", "flexgen-stream"),
                                        ("flexgen-cpu", "cpu-attention-split"), ("flexgen-int4", "flexgen-int4"),
                                        ("infinigen", "infinigen"), ("h2o", "h2o"), ("quest", "quest")])
def test_each_method_prices_itself_from_its_own_parameters(label, cost):
    pred = pm.predict_step(variant(label), LLAMA8B, pm.Workload(), "h200-host")
    assert pred.method == VARIANTS[label][0] and pred.cost == cost


def test_a_method_name_is_built_with_its_defaults():
    by_name = pm.predict_step("hybridgen", LLAMA8B, pm.Workload(), "h200-host")
    built = pm.predict_step(build_method("hybridgen"), LLAMA8B, pm.Workload(), "h200-host")
    assert by_name == built
    # the scheduler owns topk_ratio and the streamed fraction (None): priced where it settles
    bd = by_name.breakdown
    pinned = hybridgen(topk_ratio=bd["topk_ratio"], three_way=True, stream_ratio=bd["stream_ratio"])
    assert pm.predict_step(pinned, LLAMA8B, pm.Workload(), "h200-host").total_s == pytest.approx(by_name.total_s)


def test_split_resolves_ratio_and_token_budgets():
    c = pm.CostContext(LLAMA8B, pm.Workload(context=1000), pm.load_profile("h200-host"))
    assert c.split(0.1) == (100, 900)
    assert c.split("25%") == (250, 750)
    assert c.split("512t") == (512, 488)
    assert c.split("4000t") == (1000, 0)
    assert c.fraction("250t") == 0.25


def test_budget_share_of_a_gpu_only_method_drives_its_cost():
    w = pm.Workload(context=32768)
    small = pm.predict_step(build_method("h2o", budget="10%"), LLAMA8B, w, "h200-host").breakdown
    tokens = pm.predict_step(build_method("h2o", budget="3277t"), LLAMA8B, w, "h200-host").breakdown
    assert small["kept_tokens"] == pytest.approx(0.1 * 32768)
    assert tokens["kept_tokens"] == pytest.approx(3277)


@dataclass
class NoCost(KVMethod):
    name: ClassVar[str] = "no-cost"


def test_a_method_without_a_cost_is_not_modelled():
    with pytest.raises(pm.NotModelled, match="no-cost has no performance-model cost \\(not modelled\\)") as err:
        pm.predict_step(NoCost(), LLAMA8B, pm.Workload(), "h200-host")
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    # hybridgen's three-way split is modelled now (hybridgen_variant_cost)
    assert pm.predict_step(hybridgen(three_way=True), LLAMA8B, pm.Workload(), "h200-host").cost == "hybridgen-three-way"


def test_more_host_share_makes_flexgen_stream_slower():
    times = [pm.predict_step(variant("flexgen-stream", gpu_budget=round(1 - h, 6)), LLAMA8B, pm.Workload(),
                             "a100-80gb").attention_layer_s
             for h in (0.5, 0.75, 0.9, 0.95)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]


def test_hybridgen_ships_topk_rows_flexgen_ships_the_host_kv():
    w = pm.Workload(batch=8, context=32768)
    hg = pm.predict_step(hybridgen(per_head=False), LLAMA8B, w, "h200-host").breakdown
    fg = pm.predict_step(variant("flexgen-stream"), LLAMA8B, w, "h200-host").breakdown
    S_h = round(0.9 * 32768)
    k = math.ceil(0.05 * S_h)
    B, Hq, Hkv, D, b = 8, 32, 8, 128, 2
    assert hg["topk_tokens"] == k
    assert hg["h2d_bytes"] == B * k * (Hq * 4 + Hkv * D * b)       # fp32 logits + shared V rows
    assert fg["h2d_bytes"] == B * S_h * 2 * Hkv * D * b             # K and V of every host token
    per_head = pm.predict_step(hybridgen(per_head=True), LLAMA8B, w, "h200-host").breakdown
    assert per_head["h2d_bytes"] == B * k * (Hq * 4 + Hq * D * b)
    assert fg["h2d_bytes"] / hg["h2d_bytes"] > 10


def _with_host(profile, **host):
    prof = pm.load_profile(profile)
    return dataclasses.replace(prof, host=dataclasses.replace(prof.host, **host))


def test_hybridgen_overlap_is_a_max_of_branches():
    """Pipelined: the CPU branch (a layer ahead) overlaps the GPU's layer; the exact-logit
    recompute and the work after the wait (one softmax, weighted sum) are serial."""
    w = pm.Workload(context=32768)
    # hybridgen's host keys are pageable; its default scan is the bf16-dot one (its own rate)
    slow_cpu = _with_host("h200-host", key_scan_gbps={"bf16": 5.0}, key_scan_bf16dot_gbps=5.0)
    fast = dict(topk_gbps=5000.0, group_score_gbps=5000.0, select_gbps=5000.0, op_us=0.0)
    fast_cpu = _with_host("h200-host", key_scan_gbps={"bf16": 5000.0}, key_scan_bf16dot_gbps=5000.0,
                          dram_read_gbps=5000.0, gather_gbps=5000.0, **fast)
    faster_cpu = _with_host("h200-host", key_scan_gbps={"bf16": 50000.0}, key_scan_bf16dot_gbps=50000.0,
                            dram_read_gbps=50000.0, gather_gbps=50000.0, **fast)
    L = LLAMA8B.num_layers
    for prof in (slow_cpu, fast_cpu):
        p = pm.predict_step(hybridgen(), LLAMA8B, w, prof)
        br = p.breakdown
        cpu, gpu = p.cpu_branch_s / L, (p.gpu_branch_s - br["lm_head_s"]) / L
        assert p.layer_s == pytest.approx(max(cpu, gpu + br["exact_logits_s"]))
        branch = cpu - br["exact_logits_s"]
        assert p.attention_layer_s == pytest.approx(max(branch, br["gpu_pre_s"]) + br["after_wait_s"])
    slow = pm.predict_step(hybridgen(), LLAMA8B, w, slow_cpu)
    assert slow.layer_s == pytest.approx(slow.cpu_branch_s / L)      # CPU-bound: CPU branch shows
    # the GPU share runs at the fused rate: GPU-heavy takes 90% of the context on the GPU
    gpu_heavy = hybridgen(gpu_budget=0.9, topk_ratio=0.01)
    a = pm.predict_step(gpu_heavy, LLAMA8B, w, fast_cpu)
    b = pm.predict_step(gpu_heavy, LLAMA8B, w, faster_cpu)
    assert a.cpu_branch_s < a.gpu_branch_s
    assert a.total_s == pytest.approx(b.total_s, rel=1e-3)           # hidden: a faster CPU changes ~nothing
    assert b.cpu_branch_s < a.cpu_branch_s


def test_without_pipelining_the_rest_of_the_layer_adds_up():
    w = pm.Workload()
    p = pm.predict_step(hybridgen(pipeline=False), LLAMA8B, w, "h100-80gb")
    assert p.layer_s == pytest.approx(p.breakdown["rest_s"] + p.attention_layer_s)
    piped = pm.predict_step(hybridgen(pipeline=True), LLAMA8B, w, "h100-80gb")
    # pipelined, the branch also keeps the selected key rows and their logits are recomputed from
    # the true query: where the CPU bounds the layer that extra work shows; it never costs more
    extra = piped.breakdown["kept_keys_s"] + piped.breakdown["exact_logits_s"]
    assert extra > 0 and p.breakdown["kept_keys_s"] == 0 and p.breakdown["exact_logits_s"] == 0
    assert piped.layer_s <= p.layer_s + extra + 1e-12


def test_hybrid_exact_overlaps_cpu_and_gpu_partials():
    p = pm.predict_step(variant("hybrid-exact", gpu_budget=0.5), LLAMA8B, pm.Workload(context=65536), "h200-host")
    br = p.breakdown
    cpu = p.cpu_branch_s / LLAMA8B.num_layers
    launch = pm.load_profile("h200-host").gpu.launch_us * 1e-6
    assert br["after_wait_s"] == pytest.approx(10 * launch)          # the LSE merge, after the wait
    assert p.attention_layer_s == pytest.approx(max(cpu, br["gpu_attn_s"]) + br["after_wait_s"])


def test_semantic_mapping_puts_values_on_cxl():
    w = pm.Workload()
    dram = pm.predict_step(hybridgen(), LLAMA8B, w, "h100-80gb")
    cxl = pm.predict_step(hybridgen(), LLAMA8B, w, "h100-80gb-cxl")
    all_cxl = pm.predict_step(hybridgen(), LLAMA8B, dataclasses.replace(w, mapping="cxl"), "h100-80gb-cxl")
    assert cxl.breakdown["gather_s"] > dram.breakdown["gather_s"]       # values read from the slower node
    assert cxl.breakdown["scan_s"] == pytest.approx(dram.breakdown["scan_s"])  # keys stay on DRAM
    # keys on CXL: the scan slows to the CXL read bandwidth (from hybridgen's bf16-dot scan rate)
    prof = pm.load_profile("h100-80gb-cxl")
    plain = dict(key_sketch="none")
    on_cxl = pm.predict_step(hybridgen(**plain), LLAMA8B, dataclasses.replace(w, mapping="cxl"), "h100-80gb-cxl")
    on_dram = pm.predict_step(hybridgen(**plain), LLAMA8B, w, "h100-80gb-cxl")
    assert on_cxl.breakdown["scan_s"] / on_dram.breakdown["scan_s"] == pytest.approx(  # the bf16-dot scan
        prof.host.key_scan_bf16dot_gbps / prof.cxl.read_gbps)
    # the default's int4 sketch reads 72 of 256 bytes per key: slower on CXL too (its codes live on the key tier)
    assert all_cxl.breakdown["scan_s"] > 1.4 * cxl.breakdown["scan_s"]
    # the method's own placement is priced too: hybrid-exact with values on CXL
    exact_dram = pm.predict_step(variant("hybrid-exact"), LLAMA8B, w, "h100-80gb-cxl").breakdown
    exact_cxl = pm.predict_step(variant("hybrid-exact", value_tier="cxl"), LLAMA8B, w, "h100-80gb-cxl").breakdown
    assert exact_cxl["cpu_attn_s"] > exact_dram["cpu_attn_s"]


def test_fits_gpu_flags_full_attention_over_capacity():
    w = pm.Workload(context=65536)
    assert not pm.predict_step("full", LLAMA8B, w, "rtx5090").fits_gpu
    assert pm.predict_step("full", LLAMA8B, w, "h200-host").fits_gpu
    assert pm.predict_step(hybridgen(), LLAMA8B, w, "rtx5090").fits_gpu


def test_unknown_method_is_a_config_error():
    with pytest.raises(ConfigError, match="flexgen"):
        pm.predict_step("flexgen2", LLAMA8B, pm.Workload(), "h200-host")
    with pytest.raises(ConfigError):
        build_method("hybridgen", gpu_budget=1.5)   # a GPU share above 1 is refused where it is set


def test_profile_without_gpu_cannot_predict():
    raw = _read_raw("h200-host")
    raw["gpu"] = {k: None for k in raw["gpu"]}
    prof = pm.profile_from_dict(raw)
    with pytest.raises(ConfigError, match="gpu"):
        pm.predict_step("full", LLAMA8B, pm.Workload(), prof)


def test_quest_prices_its_dense_layers_and_its_gather():
    """Quest's first dense_layers attend densely: the per-layer attention is the mean over the
    model's layers: all layers dense cost attention over the whole context and nothing of
    Quest's own, and each dense layer trades Quest's own work for (S - r*S) more tokens."""
    w, hw = pm.Workload(context=32768), "h200-host"
    att = {d: pm.predict_step(variant("quest", dense_layers=d), LLAMA8B, w, hw).attention_layer_s for d in (0, 2, 32)}
    assert att[0] < att[2] < att[32]
    c = pm.CostContext(LLAMA8B, w, pm.load_profile(hw))
    assert att[32] == pytest.approx(c.gpu_attn(c.S), rel=1e-9)
    per_token = c.gpu_attn(2.0) - c.gpu_attn(1.0)
    own = att[0] - c.gpu_attn(0.2 * c.S)  # the page bounds and the gather: Quest's own work
    assert att[2] == pytest.approx(att[0] + 2 / 32 * (0.8 * c.S * per_token - own), rel=1e-6)
    assert own > 2 * 0.2 * c.S * c.kv_tok / (c.hw.gpu.hbm_gbps * 1e9)  # the gather is priced
