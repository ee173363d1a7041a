"""Per-layer cost functions of the built-in methods (PROJECTED; symbols in :mod:`hybridgen.perf.context`).

Each method's ``layer_cost(c)`` calls one of these with its own parameters; a new method
writes its own ``layer_cost`` (reusing these or the context's primitives) next to its code.
S_g, S_h = c.split(gpu_budget); r = a budget's fraction of the context (c.fraction).

  full            attn = gpu_attn(S, fused) + fixed(g=FULL_KERNELS);    layer = rest + attn
  flexgen stream  xfer = copy(B*S_h*kv_tok) (two copies, K and V); gpu = one unfused partial per
                  part (PARTIAL_KERNELS each) + the LSE merge (MERGE_KERNELS) when both parts exist
                  attn = xfer + gpu;  layer = max(xfer, rest + gpu)   (next layer's KV prefetched)
  flexgen int4    as stream with (0.5 + 4/group) bytes per element over PCIe plus a GPU
                  dequantisation pass (read codes, write b-byte KV)
  cpu attention   cpu = B*S_h*kv_tok / cpu_attention rate (pinned or pageable host KV)
                        + SPLIT_HOST_OPS * op_us + q down, out+lse up
  split           gpu = gpu_attn(S_g) + (PARTIAL_KERNELS-1) launches
                  attn = overlap(cpu, gpu) + merge (MERGE_KERNELS launches, after the wait)
                  (``serial``: cpu + gpu, the CPU starting once the GPU part is done, as a
                  blocking q.to('cpu') behind the GPU partial does);  layer = rest + attn
                  (hybrid-exact, flexgen attention_on=cpu)
  infinigen       all KV on the host (S_h = S); spec = B*S*Hkv*(partial_ratio*D)*b / attention_gbps
                  fetch = gather(B*r*S_h*kv_tok) + copy(same); n = r*S_h
                  attn = spec + fetch + gpu_attn(n); layer = max(fetch, rest + spec + gpu_attn(n))
  h2o             attn = gpu_attn(r*S) + score update (B*Hq*r*S*4*2 / hbm)
  snapkv          attn = gpu_attn(r*S)
  streamingllm    attn = gpu_attn(min(S, max(r*S, sinks)))
  quest           attn = page bounds (B*Hkv*(S/page)*2*D*b / attention_gbps) + gpu_attn(r*S)
  (h2o, snapkv, streamingllm, quest with offload='none' keep their KV on the GPU)
  offloaded kept KV (offload='stream', "H2O on FlexGen"): n = tokens streamed (the kept set;
                  quest: the whole context), xfer = copy(B*n*kv_tok) at the host tier's rate
                  (K and V), gpu = the resident method's attention; layer = max(xfer, rest + gpu)
                  (next layer prefetched);  (offload='cpu'): the step on the host, after the
                  GPU's projections: cpu = B*n_read*kv_tok / cpu_attention rate + the method's
                  own host passes + SPLIT_HOST_OPS*op_us + q,k,v down, out up; layer = rest + cpu
  uvm (projected only: oversubscribed managed memory can hang a shared GPU, so it is not run)
                  the KV that does not fit the GPU (S_h of the kept tokens, UVM+H2O: r*S kept)
                  migrates by page faults each step: B*S_h*kv_tok at UVM_MIGRATION_SHARE of the
                  pinned link rate + one fault-batch latency per UVM_FAULT_BATCH_BYTES; the
                  kernel stalls on its faults (no overlap): layer = rest + gpu_attn(kept) + migrate

Host placement: the host-KV methods here default to DRAM ('dram'); HybridGen's own cost
(:mod:`hybridgen.hybrid.cost`) to 'semantic'; a workload's ``mapping`` overrides both.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from hybridgen.perf.context import CostContext, LayerCost, Placement

# Per-layer op counts behind the fixed costs (model assumptions counted from the code paths;
# each op costs gpu.launch_us on the GPU or host.op_us on the host, see CostContext.fixed).
FULL_KERNELS = 3          # append K, append V, fused SDPA
PARTIAL_KERNELS = 8       # unfused partial attention: logits, scale, max, exp, sum, weighted sum, ...
MERGE_KERNELS = 10        # LSE merge of two partials
SPLIT_HOST_OPS = 12       # the CPU partial attention: torch ops, each a thread fork/join
# UVM demand paging (model assumptions, not measured here: UVM is never run, see uvm_cost):
# fault-driven migration reaches a fraction of the pinned copy rate, and each batch of faults
# (about 2 MiB of pages) pays a fault-handling latency on top
UVM_MIGRATION_SHARE = 0.5
UVM_FAULT_BATCH_BYTES = 2 << 20
UVM_FAULT_US = 30.0

__all__ = ["CostContext", "LayerCost", "full_cost", "flexgen_stream_cost", "cpu_attention_split_cost",
           "infinigen_cost", "gpu_resident_cost", "h2o_cost", "snapkv_cost",
           "streamingllm_cost", "quest_cost", "offloaded_kept_cost", "uvm_cost"]


def full_cost(c: CostContext) -> LayerCost:
    """Dense attention over the whole context, all KV on the GPU (the fused kernel)."""
    fixed = c.fixed(gpu_kernels=FULL_KERNELS - 1)
    attn = c.gpu_attn(c.S, fused=True) + fixed
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + attn, gpu_tokens=c.S,
                     breakdown={"gpu_attn_s": attn, "rest_s": c.rest, "fixed_s": fixed}, label="full")


def flexgen_stream_cost(c: CostContext, gpu_budget: Any, int4_group: Optional[int] = None,
                        mapping: Placement = "dram") -> LayerCost:
    """The host part of the KV copied to the GPU one layer ahead (4-bit codes when int4_group
    is set: group size in elements), dense GPU attention over the whole context (one unfused
    partial per part, merged)."""
    S_g, S_h = c.split(gpu_budget)
    key_tier, _ = c.tiers(mapping)
    if int4_group is not None:
        per_elem = 0.5 + 4.0 / int4_group  # 4-bit code + fp16 (min, scale) per group
        nbytes = c.B * S_h * 2 * c.Hkv * c.D * per_elem
        dequant = (nbytes + c.B * S_h * c.kv_tok) / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    else:
        nbytes = c.B * S_h * c.kv_tok
        dequant = 0.0
    xfer = c.copy(nbytes / 2, c.tier_read(key_tier)) * 2 if nbytes else 0.0  # K and V, one copy each
    parts = int(S_g > 0) + int(S_h > 0)
    fixed = c.fixed(gpu_kernels=parts * (PARTIAL_KERNELS - 1) + (MERGE_KERNELS if parts == 2 else 0))
    gpu = c.gpu_attn(S_g) + c.gpu_attn(S_h) - (2 - parts) * c.launch + dequant + fixed
    return LayerCost(attn=xfer + gpu, layer=max(xfer, c.rest + gpu), gpu=c.rest + gpu, transfer=xfer,
                     gpu_tokens=S_g, staging_tokens=2 * S_h,  # double-buffered staging of one layer
                     breakdown={"h2d_bytes": nbytes, "transfer_s": xfer, "gpu_attn_s": gpu, "dequant_s": dequant,
                                "rest_s": c.rest, "fixed_s": fixed},
                     label="flexgen-int4" if int4_group is not None else "flexgen-stream")


def cpu_attention_split_cost(c: CostContext, gpu_budget: Any, merge: bool = True,
                             mapping: Placement = "dram", pinned: Optional[bool] = None,
                             serial: bool = False) -> LayerCost:
    """Exact attention split: the CPU attends over the host KV, the GPU over its part,
    concurrently (``serial``: the CPU starts when the GPU part is done); ``merge`` adds the
    LSE merge after the wait; ``pinned``: host KV page-locked (None: whenever a real GPU)."""
    S_g, S_h = c.split(gpu_budget)
    key_tier, value_tier = c.tiers(mapping)
    rate = c.cpu_attention_rate(pinned)
    half = c.B * S_h * c.key_tok
    cpu_attn = c.stream_time(half, rate, key_tier) + c.stream_time(half, rate, value_tier) if S_h else 0.0
    small = c.B * c.Hq * c.D * c.b  # q down, out up (+ lse)
    xfer = (c.copy(small) + c.copy(small + c.B * c.Hq * 4)) if S_h and S_g else 0.0
    host_fixed = c.fixed(host_ops=SPLIT_HOST_OPS) if S_h else 0.0
    cpu = cpu_attn + host_fixed + xfer
    gpu_fixed = c.fixed(gpu_kernels=PARTIAL_KERNELS - 1) if S_g else 0.0
    gpu_attn = c.gpu_attn(S_g) + gpu_fixed if S_g else 0.0
    after = c.fixed(gpu_kernels=MERGE_KERNELS) if merge and S_g and S_h else 0.0
    both = cpu + gpu_attn if serial else c.overlap(cpu, gpu_attn)
    attn = both + after
    return LayerCost(attn=attn, layer=c.rest + attn, cpu=cpu, gpu=c.rest + gpu_attn + after, transfer=xfer,
                     gpu_tokens=S_g,
                     breakdown={"cpu_attn_s": cpu_attn, "transfer_s": xfer, "gpu_attn_s": gpu_attn, "rest_s": c.rest,
                                "after_wait_s": after, "fixed_s": host_fixed + gpu_fixed + after,
                                "cpu_rate_gbps": rate, "h2d_bytes": small + c.B * c.Hq * 4, "host_kv_bytes": 2 * half},
                     label="cpu-attention-split")


def infinigen_cost(c: CostContext, budget_ratio: float, partial_ratio: float,
                   mapping: Placement = "dram") -> LayerCost:
    """InfiniGen: all KV on the host, partial keys on the GPU; speculation picks budget_ratio
    of the context, gathered on the host and copied one layer ahead."""
    S_g, S_h = 0, c.S  # the host keeps all KV
    key_tier, value_tier = c.tiers(mapping)
    fetched = budget_ratio * S_h
    spec = c.B * c.S * c.Hkv * (partial_ratio * c.D) * c.b / (c.hw.gpu.attention_gbps * 1e9) + c.launch
    nbytes = c.B * fetched * c.kv_tok
    gather = c.gather_time(c.B * c.Hkv * fetched, 2 * c.D * c.b, value_tier)
    xfer = c.copy(nbytes)
    fetch = gather + xfer
    gpu = spec + c.gpu_attn(S_g + fetched)
    return LayerCost(attn=fetch + gpu, layer=max(fetch, c.rest + gpu), cpu=gather, gpu=c.rest + gpu, transfer=xfer,
                     gpu_tokens=S_g + partial_ratio * c.S / 2, staging_tokens=2 * fetched,
                     breakdown={"speculation_s": spec, "gather_s": gather, "transfer_s": xfer,
                                "gpu_attn_s": gpu - spec, "rest_s": c.rest, "h2d_bytes": nbytes},
                     label="infinigen")


def gpu_resident_cost(c: CostContext, kept_tokens: float, extra: float = 0.0, resident: Optional[float] = None,
                      label: str = "gpu-resident") -> LayerCost:
    """A GPU-only method attending over kept_tokens (+ ``extra`` seconds of its own work);
    resident: KV tokens it holds on the GPU per layer (default kept_tokens)."""
    attn = c.gpu_attn(kept_tokens) + extra
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + attn,
                     gpu_tokens=kept_tokens if resident is None else resident,
                     breakdown={"gpu_attn_s": attn, "kept_tokens": kept_tokens, "rest_s": c.rest}, label=label)


def h2o_cost(c: CostContext, budget_ratio: float) -> LayerCost:
    """H2O: attention over the kept heavy hitters + recent tokens and the score update."""
    n = budget_ratio * c.S
    score = c.B * c.Hq * n * 4 * 2 / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    return gpu_resident_cost(c, n, score, label="h2o")


def snapkv_cost(c: CostContext, budget_ratio: float) -> LayerCost:
    """SnapKV: attention over the tokens selected at prefill."""
    return gpu_resident_cost(c, budget_ratio * c.S, label="snapkv")


def streamingllm_cost(c: CostContext, budget_ratio: float, sinks: int) -> LayerCost:
    """StreamingLLM: attention over the sinks + the recent window."""
    return gpu_resident_cost(c, min(c.S, max(budget_ratio * c.S, sinks)), label="streamingllm")


def quest_cost(c: CostContext, budget_ratio: float, page_size: int) -> LayerCost:
    """Quest: page-bound scoring over every page, then attention over the selected pages."""
    pages = math.ceil(c.S / page_size)
    bounds = c.B * c.Hkv * pages * 2 * c.D * c.b / (c.hw.gpu.attention_gbps * 1e9) + c.launch
    return gpu_resident_cost(c, budget_ratio * c.S, bounds, resident=c.S + 2 * pages, label="quest")


def offloaded_kept_cost(c: CostContext, resident: LayerCost, streamed_tokens: float, read_tokens: float,
                        mode: str, mapping: Placement = "dram", host_extra_bytes: float = 0.0) -> LayerCost:
    """An evicting method with its kept KV on the host (``mode`` 'stream' or 'cpu').

    resident: the method's GPU-resident cost (its GPU attention and own work); streamed_tokens:
    KV tokens per sequence copied each layer-step ('stream'); read_tokens: KV tokens per
    sequence the host reads when the step runs on the CPU ('cpu'); host_extra_bytes: the
    method's other host passes per layer ('cpu': scores, page bounds), read at DRAM rate.
    """
    key_tier, value_tier = c.tiers(mapping)
    label = resident.label + "-offload-" + mode
    if mode == "stream":
        nbytes = c.B * streamed_tokens * c.kv_tok
        xfer = c.copy(nbytes / 2, c.tier_read(key_tier)) + c.copy(nbytes / 2, c.tier_read(value_tier)) if nbytes else 0.0
        gpu = resident.attn
        bd = dict(resident.breakdown, h2d_bytes=nbytes, transfer_s=xfer)
        return LayerCost(attn=xfer + gpu, layer=max(xfer, c.rest + gpu), gpu=c.rest + gpu, transfer=xfer,
                         gpu_tokens=0.0, staging_tokens=2 * streamed_tokens, breakdown=bd, label=label)
    rate = c.cpu_attention_rate()
    half = c.B * read_tokens * c.key_tok
    cpu_attn = c.stream_time(half, rate, key_tier) + c.stream_time(half, rate, value_tier)
    extra = host_extra_bytes / (c.hw.host.dram_read_gbps * 1e9)
    small = c.B * (c.Hq + 2 * c.Hkv) * c.D * c.b  # q, k, v down
    xfer = c.copy(small) + c.copy(c.B * c.Hq * c.D * c.b)  # ... and the output up
    cpu = cpu_attn + extra + c.fixed(host_ops=SPLIT_HOST_OPS) + xfer
    bd = {"cpu_attn_s": cpu_attn, "host_extra_s": extra, "transfer_s": xfer, "rest_s": c.rest,
          "h2d_bytes": c.B * c.Hq * c.D * c.b, "host_kv_bytes": 2 * half}
    return LayerCost(attn=cpu, layer=c.rest + cpu, cpu=cpu, gpu=c.rest, transfer=xfer, gpu_tokens=0.0,
                     breakdown=bd, label=label)


def uvm_cost(c: CostContext, kept_ratio: float = 1.0, gpu_kv_bytes: Optional[float] = None) -> LayerCost:
    """UVM (managed memory, oversubscribed) over the kept ``kept_ratio`` of the context
    (1.0: plain UVM; an H2O budget: UVM + H2O). gpu_kv_bytes: GPU memory left for KV (None:
    profile GPU memory minus the weights); the kept KV beyond it migrates by page faults every
    step (module docstring). PROJECTED only: never run (oversubscription can hang a shared GPU)."""
    L = c.shape.num_layers
    kept = kept_ratio * c.S
    total = L * c.B * kept * c.kv_tok
    room = (c.hw.gpu.memory_gb * 1e9 - c.weights_bytes) if gpu_kv_bytes is None else float(gpu_kv_bytes)
    spill = max(0.0, total - max(0.0, room)) / L  # bytes per layer that do not stay resident
    rate = UVM_MIGRATION_SHARE * c.hw.link.h2d_pinned_gbps * 1e9
    migrate = spill / rate + math.ceil(spill / UVM_FAULT_BATCH_BYTES) * UVM_FAULT_US * 1e-6 if spill else 0.0
    gpu = c.gpu_attn(kept)
    if kept_ratio < 1.0:  # H2O's score update
        gpu += c.B * c.Hq * kept * 4 * 2 / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    attn = gpu + migrate
    resident = kept - spill / max(c.B * c.kv_tok, 1)
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + gpu, transfer=migrate, gpu_tokens=resident,
                     breakdown={"migrated_bytes": spill, "migrate_s": migrate, "gpu_attn_s": gpu, "rest_s": c.rest,
                                "kept_tokens": kept},
                     label="uvm" if kept_ratio >= 1.0 else "uvm-h2o")
