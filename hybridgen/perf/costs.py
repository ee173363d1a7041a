"""Per-layer cost primitives (PROJECTED; symbols in :mod:`hybridgen.perf.context`).

Each method's ``layer_cost(c)`` calls one of these with its own parameters (a float share of
the context, never a Budget) or writes its own next to its code (FlexGen, InfiniGen, ShadowKV,
MagicPIG, UVM price themselves in their own modules); the GPU memory a cost reports comes from
the method's footprint (:func:`hybridgen.methods.footprint.with_memory`).
S_g, S_h = c.split(gpu_share); r = a budget's fraction of the context (c.fraction).

  full            attn = gpu_attn(S, fused) + fixed(g=FULL_KERNELS);    layer = rest + attn
  stream (PCIe)   xfer = copy(B*S_h*wire) (two copies, K and V; wire = kv_tok, or a compressed
                  cache's bytes per token); gpu = one partial per part (PARTIAL_KERNELS
                  each; at the fused rate where ``c.partial_fused``: torch's flash kernel)
                  + the LSE merge (MERGE_KERNELS) when both parts exist + the method's own GPU
                  work (e.g. a dequantisation pass)
                  attn = xfer + gpu;  layer = max(xfer, rest + gpu)   (next layer's KV prefetched)
  cpu attention   cpu = B*S_h*kv_tok / cpu_attention rate (pinned or pageable host KV)
                        + SPLIT_HOST_OPS * op_us + q down, out+lse up
  split           gpu = gpu_attn(S_g, partial_fused) + (PARTIAL_KERNELS-1) launches
                  attn = overlap(cpu, gpu) + merge (MERGE_KERNELS launches, after the wait)
                  (``serial``: cpu + gpu, the CPU starting once the GPU part is done, as a
                  blocking q.to('cpu') behind the GPU partial does);  layer = rest + attn
                  (hybrid-exact, the host part attended on the CPU)
  gpu resident    attn = gpu_attn(kept) + the method's own pass (an evicting method's own cost,
                  beside it, e.g. baselines/kept_costs.py)
  offloaded kept KV (offload='stream', "H2O on FlexGen"): n = tokens streamed (the kept set,
                  or what the method says it streams), xfer = copy(B*n*kv_tok) at the host tier's rate
                  (K and V), gpu = the resident method's attention; layer = max(xfer, rest + gpu)
                  (next layer prefetched: the overlap);  (offload='cpu'): the step on the host, after the
                  GPU's projections: cpu = B*n_read*kv_tok / cpu_attention rate + the method's
                  own host passes + SPLIT_HOST_OPS*op_us + q,k,v down, out up; layer = rest + cpu

Host placement: the host-KV methods here default to DRAM ('dram'); HybridGen's own cost
(:mod:`hybridgen.hybrid.cost`) to 'semantic'; a workload's ``mapping`` overrides both. Every
host read goes through CostContext.stream_time / gather_time / host_copy, which read the share
of a 'dram' tier that spilled past the DRAM capacity at the CXL rate
(:mod:`hybridgen.perf.host_tiers`); predict_step's breakdown states the split and the rates.
"""
from __future__ import annotations

from typing import Optional

from hybridgen.perf.context import CostContext, LayerCost, Placement

# Per-layer op counts behind the fixed costs (model assumptions counted from the code paths;
# each op costs gpu.launch_us on the GPU or host.op_us on the host, see CostContext.fixed).
FULL_KERNELS = 3          # append K, append V, fused SDPA
PARTIAL_KERNELS = 8       # unfused partial attention: logits, scale, max, exp, sum, weighted sum, ...
MERGE_KERNELS = 10        # LSE merge of two partials
SPLIT_HOST_OPS = 12       # the CPU partial attention: torch ops, each a thread fork/join

__all__ = ["CostContext", "LayerCost", "full_cost", "stream_cost", "cpu_attention_split_cost",
           "gpu_resident_cost", "offloaded_kept_cost"]


def full_cost(c: CostContext) -> LayerCost:
    """Dense attention over the whole context, all KV on the GPU (the fused kernel)."""
    fixed = c.fixed(gpu_kernels=FULL_KERNELS - 1)
    attn = c.gpu_attn(c.S, fused=True) + fixed
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + attn, gpu_tokens=c.S,
                     breakdown={"gpu_attn_s": attn, "rest_s": c.rest, "fixed_s": fixed}, label="full")


def stream_cost(c: CostContext, gpu_share: float, wire_bytes: Optional[float] = None, gpu_extra: float = 0.0,
                mapping: Placement = "dram", label: str = "stream", fused: Optional[bool] = None) -> LayerCost:
    """The host part of the KV (S_h of c.split(gpu_share)) copied over PCIe to the GPU one layer
    ahead, ``wire_bytes`` per host token and sequence (default kv_tok; a compressed cache sends
    fewer), then dense GPU attention over both parts (one unfused partial per part, merged) and
    ``gpu_extra`` seconds of the method's own GPU work (e.g. a dequantisation pass). fused: the
    partials run torch's flash kernel (default :attr:`CostContext.partial_fused`, what the GPU
    dispatcher runs; False prices unfused partials, e.g. the H200 probe's plain torch)."""
    S_g, S_h = c.split(gpu_share)
    key_tier, _ = c.tiers(mapping)
    nbytes = c.B * S_h * (c.kv_tok if wire_bytes is None else wire_bytes)
    xfer = c.host_copy(nbytes / 2, key_tier) * 2 if nbytes else 0.0  # K and V, one copy each
    parts = int(S_g > 0) + int(S_h > 0)
    fixed = c.fixed(gpu_kernels=parts * (PARTIAL_KERNELS - 1) + (MERGE_KERNELS if parts == 2 else 0))
    fused = c.partial_fused if fused is None else fused
    gpu = c.gpu_attn(S_g, fused) + c.gpu_attn(S_h, fused) - (2 - parts) * c.launch + gpu_extra + fixed
    return LayerCost(attn=xfer + gpu, layer=max(xfer, c.rest + gpu), gpu=c.rest + gpu, transfer=xfer,
                     gpu_tokens=S_g, staging_tokens=2 * S_h,  # double-buffered staging of one layer
                     breakdown={"h2d_bytes": nbytes, "transfer_s": xfer, "gpu_attn_s": gpu, "rest_s": c.rest,
                                "fixed_s": fixed},
                     label=label)


def cpu_attention_split_cost(c: CostContext, gpu_share: float, merge: bool = True,
                             mapping: Placement = "dram", pinned: Optional[bool] = None,
                             serial: bool = False, fused: Optional[bool] = None) -> LayerCost:
    """Exact attention split: the CPU attends over the host KV (S_h of c.split(gpu_share)), the
    GPU over its part, concurrently (``serial``: the CPU starts when the GPU part is done);
    ``merge`` adds the LSE merge after the wait; ``pinned``: host KV page-locked (None: whenever
    a real GPU); fused: the GPU partial is torch's flash kernel (default
    :attr:`CostContext.partial_fused`; False: unfused, as the H200 probe's plain torch)."""
    S_g, S_h = c.split(gpu_share)
    key_tier, value_tier = c.tiers(mapping)
    rate = c.cpu_attention_rate(pinned)
    half = c.B * S_h * c.key_tok
    cpu_attn = c.stream_time(half, rate, key_tier) + c.stream_time(half, rate, value_tier) if S_h else 0.0
    small = c.B * c.Hq * c.D * c.b  # q down, out up (+ lse)
    xfer = (c.copy(small) + c.copy(small + c.B * c.Hq * 4)) if S_h and S_g else 0.0
    host_fixed = c.fixed(host_ops=SPLIT_HOST_OPS) if S_h else 0.0
    cpu = cpu_attn + host_fixed + xfer
    gpu_fixed = c.fixed(gpu_kernels=PARTIAL_KERNELS - 1) if S_g else 0.0
    gpu_attn = c.gpu_attn(S_g, c.partial_fused if fused is None else fused) + gpu_fixed if S_g else 0.0
    after = c.fixed(gpu_kernels=MERGE_KERNELS) if merge and S_g and S_h else 0.0
    both = cpu + gpu_attn if serial else c.overlap(cpu, gpu_attn)
    attn = both + after
    return LayerCost(attn=attn, layer=c.rest + attn, cpu=cpu, gpu=c.rest + gpu_attn + after, transfer=xfer,
                     gpu_tokens=S_g,
                     breakdown={"cpu_attn_s": cpu_attn, "transfer_s": xfer, "gpu_attn_s": gpu_attn, "rest_s": c.rest,
                                "after_wait_s": after, "fixed_s": host_fixed + gpu_fixed + after,
                                "cpu_rate_gbps": rate, "h2d_bytes": small + c.B * c.Hq * 4, "host_kv_bytes": 2 * half},
                     label="cpu-attention-split")


def gpu_resident_cost(c: CostContext, kept_tokens: float, extra: float = 0.0, resident: Optional[float] = None,
                      label: str = "gpu-resident") -> LayerCost:
    """A GPU-only method attending over kept_tokens (+ ``extra`` seconds of its own work);
    resident: KV tokens it holds on the GPU per layer (default kept_tokens)."""
    attn = c.gpu_attn(kept_tokens) + extra
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + attn,
                     gpu_tokens=kept_tokens if resident is None else resident,
                     breakdown={"gpu_attn_s": attn, "kept_tokens": kept_tokens, "rest_s": c.rest}, label=label)


def offloaded_kept_cost(c: CostContext, resident: LayerCost, streamed_tokens: float, read_tokens: float,
                        mode: str, mapping: Placement = "dram", host_extra_bytes: float = 0.0) -> LayerCost:
    """An evicting method with its kept KV on the host (``mode`` 'stream' or 'cpu').

    resident: the method's GPU-resident cost (its GPU attention and own work); streamed_tokens:
    KV tokens per sequence copied each layer-step ('stream'); read_tokens: KV tokens per
    sequence the host reads when the step runs on the CPU ('cpu'); host_extra_bytes: the
    method's other host passes per layer ('cpu': scores, page bounds), read at the host tier's
    rate (its spill included). The breakdown states streamed_tokens / read_tokens and
    ``overlapped`` (1: the copy hides behind the compute, 'stream'; 0: 'cpu').
    """
    key_tier, value_tier = c.tiers(mapping)
    label = resident.label + "-offload-" + mode
    if mode == "stream":
        nbytes = c.B * streamed_tokens * c.kv_tok
        xfer = c.host_copy(nbytes / 2, key_tier) + c.host_copy(nbytes / 2, value_tier) if nbytes else 0.0
        gpu = resident.attn
        bd = dict(resident.breakdown, h2d_bytes=nbytes, transfer_s=xfer, streamed_tokens=streamed_tokens,
                  overlapped=1.0)  # the copy hidden behind the layer's compute: layer = max(...)
        return LayerCost(attn=xfer + gpu, layer=max(xfer, c.rest + gpu), gpu=c.rest + gpu, transfer=xfer,
                         gpu_tokens=0.0, staging_tokens=2 * streamed_tokens, breakdown=bd, label=label)
    rate = c.cpu_attention_rate()
    half = c.B * read_tokens * c.key_tok
    cpu_attn = c.stream_time(half, rate, key_tier) + c.stream_time(half, rate, value_tier)
    extra = c.stream_time(host_extra_bytes, c.hw.host.dram_read_gbps, key_tier)  # on the host tier, with it
    small = c.B * (c.Hq + 2 * c.Hkv) * c.D * c.b  # q, k, v down
    xfer = c.copy(small) + c.copy(c.B * c.Hq * c.D * c.b)  # ... and the output up
    cpu = cpu_attn + extra + c.fixed(host_ops=SPLIT_HOST_OPS) + xfer
    bd = {"cpu_attn_s": cpu_attn, "host_extra_s": extra, "transfer_s": xfer, "rest_s": c.rest,
          "h2d_bytes": c.B * c.Hq * c.D * c.b, "host_kv_bytes": 2 * half, "read_tokens": read_tokens,
          "overlapped": 0.0}  # the step runs on the host after the GPU's projections
    return LayerCost(attn=cpu, layer=c.rest + cpu, cpu=cpu, gpu=c.rest, transfer=xfer, gpu_tokens=0.0,
                     breakdown=bd, label=label)
