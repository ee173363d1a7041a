"""Per-layer cost primitives (PROJECTED; symbols in :mod:`hybridgen.perf.context`).

Each method's ``layer_cost(c)`` calls one of these with its own parameters (a float share of
the context, never a Budget) or writes its own next to its code (FlexGen, InfiniGen, ShadowKV,
MagicPIG, UVM price themselves in their own modules); the GPU memory a cost reports comes from
the method's footprint (:func:`hybridgen.methods.footprint.with_memory`).
S_g, S_h = c.split(gpu_share); r = a budget's fraction of the context (c.fraction).

  full            attn = gpu_attn(S, fused) + fixed(g=FULL_KERNELS);    layer = rest + attn
  stream (PCIe)   xfer = copy(B*S_h*wire) (two copies, K and V; wire = kv_tok, or a compressed
                  cache's bytes per token); gpu = one unfused partial per part (PARTIAL_KERNELS
                  each) + the LSE merge (MERGE_KERNELS) when both parts exist + the method's
                  own GPU work (e.g. a dequantisation pass)
                  attn = xfer + gpu;  layer = max(xfer, rest + gpu)   (next layer's KV prefetched)
  cpu attention   cpu = B*S_h*kv_tok / cpu_attention rate (pinned or pageable host KV)
                        + SPLIT_HOST_OPS * op_us + q down, out+lse up
  split           gpu = gpu_attn(S_g) + (PARTIAL_KERNELS-1) launches
                  attn = overlap(cpu, gpu) + merge (MERGE_KERNELS launches, after the wait)
                  (``serial``: cpu + gpu, the CPU starting once the GPU part is done, as a
                  blocking q.to('cpu') behind the GPU partial does);  layer = rest + attn
                  (hybrid-exact, the host part attended on the CPU)
  hybridgen       k = ceil(topk_ratio*S_h), Hsel = Hq (per_head) or Hkv
                  cpu = scan(B*S_h*key_tok / key_scan rate, pinned or pageable keys)
                        + group score(B*Hq*S_h*4 / group_score_gbps; shared selection only)
                        + topk(B*Hsel*S_h*4 / topk_gbps)
                        + gather(B*Hsel*k*D*b at the value tier, + CXL latency term)
                        + host_ops * op_us + copy(B*Hq*k*4 + B*Hsel*k*D*b, pinned staging or not)
                  gpu_pre   = gpu_keys(S_g)                       (GPU logits, before the wait)
                  after     = gpu_values(S_g + k*Hsel/Hkv) + softmax over the S_g + k logits
                              + gpu_kernels launches              (ONE softmax, after the wait)
                  attn = overlap(cpu, gpu_pre) + after            (``serial``: cpu + gpu_pre + after)
                  pipelined (CPU runs a layer ahead, exact logits of the k rows recomputed after
                  the wait: exact = gather of the k key rows + 1 host op):
                    layer = max(cpu + exact, rest + gpu_pre + exact + after)
                  otherwise: layer = rest + attn
  gpu resident    attn = gpu_attn(kept) + the method's own pass (an evicting method's own cost,
                  beside it, e.g. baselines/kept_costs.py)
  offloaded kept KV (offload='stream', "H2O on FlexGen"): n = tokens streamed (the kept set,
                  or what the method says it streams), xfer = copy(B*n*kv_tok) at the host tier's rate
                  (K and V), gpu = the resident method's attention; layer = max(xfer, rest + gpu)
                  (next layer prefetched);  (offload='cpu'): the step on the host, after the
                  GPU's projections: cpu = B*n_read*kv_tok / cpu_attention rate + the method's
                  own host passes + SPLIT_HOST_OPS*op_us + q,k,v down, out up; layer = rest + cpu

Host placement: the host-KV methods other than ``hybridgen`` default to DRAM ('dram');
``hybridgen`` to 'semantic' (keys on DRAM, values on CXL when the profile has a CXL node);
a workload's ``mapping`` overrides both.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from hybridgen.perf.context import CostContext, LayerCost, Placement

# Per-layer op counts behind the fixed costs (model assumptions counted from the code paths;
# each op costs gpu.launch_us on the GPU or host.op_us on the host, see CostContext.fixed).
FULL_KERNELS = 3          # append K, append V, fused SDPA
PARTIAL_KERNELS = 8       # unfused partial attention: logits, scale, max, exp, sum, weighted sum, ...
MERGE_KERNELS = 10        # LSE merge of two partials
SPLIT_HOST_OPS = 12       # the CPU partial attention: torch ops, each a thread fork/join
# hybridgen: torch.profiler counts 75 top-level aten ops per layer-step of its decode on the CPU
# (full: 33), most of them views; of the rest ~14 are in the CPU branch (scan, group score:
# logsumexp/where/max, top-k, logits at idx, gathers, staging) and ~20 launch GPU kernels
HYBRIDGEN_HOST_OPS = 14
HYBRIDGEN_GPU_KERNELS = 20
# key_sketch adds 26 torch calls per layer to the CPU branch (a TorchFunctionMode around
# host_branch + KeySketch.sync: 42 calls against 16 without the sketch), ~10 of them real
# (the sync's front check, the exact tail's scan and its copy, the statistics' concatenation,
# the re-rank's buffers, the candidates' gather) and the rest views or no-op conversions
SKETCH_HOST_OPS = 10

__all__ = ["CostContext", "LayerCost", "full_cost", "stream_cost", "cpu_attention_split_cost",
           "hybridgen_cost", "gpu_resident_cost", "offloaded_kept_cost"]


def full_cost(c: CostContext) -> LayerCost:
    """Dense attention over the whole context, all KV on the GPU (the fused kernel)."""
    fixed = c.fixed(gpu_kernels=FULL_KERNELS - 1)
    attn = c.gpu_attn(c.S, fused=True) + fixed
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + attn, gpu_tokens=c.S,
                     breakdown={"gpu_attn_s": attn, "rest_s": c.rest, "fixed_s": fixed}, label="full")


def stream_cost(c: CostContext, gpu_share: float, wire_bytes: Optional[float] = None, gpu_extra: float = 0.0,
                mapping: Placement = "dram", label: str = "stream") -> LayerCost:
    """The host part of the KV (S_h of c.split(gpu_share)) copied over PCIe to the GPU one layer
    ahead, ``wire_bytes`` per host token and sequence (default kv_tok; a compressed cache sends
    fewer), then dense GPU attention over both parts (one unfused partial per part, merged) and
    ``gpu_extra`` seconds of the method's own GPU work (e.g. a dequantisation pass)."""
    S_g, S_h = c.split(gpu_share)
    key_tier, _ = c.tiers(mapping)
    nbytes = c.B * S_h * (c.kv_tok if wire_bytes is None else wire_bytes)
    xfer = c.copy(nbytes / 2, c.tier_read(key_tier)) * 2 if nbytes else 0.0  # K and V, one copy each
    parts = int(S_g > 0) + int(S_h > 0)
    fixed = c.fixed(gpu_kernels=parts * (PARTIAL_KERNELS - 1) + (MERGE_KERNELS if parts == 2 else 0))
    gpu = c.gpu_attn(S_g) + c.gpu_attn(S_h) - (2 - parts) * c.launch + gpu_extra + fixed
    return LayerCost(attn=xfer + gpu, layer=max(xfer, c.rest + gpu), gpu=c.rest + gpu, transfer=xfer,
                     gpu_tokens=S_g, staging_tokens=2 * S_h,  # double-buffered staging of one layer
                     breakdown={"h2d_bytes": nbytes, "transfer_s": xfer, "gpu_attn_s": gpu, "rest_s": c.rest,
                                "fixed_s": fixed},
                     label=label)


def cpu_attention_split_cost(c: CostContext, gpu_share: float, merge: bool = True,
                             mapping: Placement = "dram", pinned: Optional[bool] = None,
                             serial: bool = False) -> LayerCost:
    """Exact attention split: the CPU attends over the host KV (S_h of c.split(gpu_share)), the
    GPU over its part, concurrently (``serial``: the CPU starts when the GPU part is done);
    ``merge`` adds the LSE merge after the wait; ``pinned``: host KV page-locked (None: whenever
    a real GPU)."""
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


def hybridgen_cost(c: CostContext, gpu_budget: Any, topk_ratio: float, per_head: bool = False,
                   pipelined: bool = True, mapping: Placement = "semantic", pinned: Optional[bool] = None,
                   staging_pinned: bool = True, serial: bool = False, host_ops: int = HYBRIDGEN_HOST_OPS,
                   gpu_kernels: int = HYBRIDGEN_GPU_KERNELS, key_sketch: Optional[str] = None,
                   oversample: float = 1.0, fused_select: bool = True) -> LayerCost:
    """HybridGen: CPU key scan + group score + top-k over the host keys, the selected rows'
    logits and V rows shipped to the GPU, ONE softmax with the GPU window after the wait.

    pipelined: the CPU branch runs a layer ahead (stand-in queries) and the selected rows'
    logits are recomputed exactly after the wait; pinned: host keys page-locked (None:
    whenever a real GPU, as kv/tiers.py does); staging_pinned: the shipped rows leave from a
    pinned staging buffer (False: a pageable copy); serial: the CPU branch starts only when
    the GPU logits are done (a blocking q.to('cpu')); host_ops / gpu_kernels: the fixed ops
    of the CPU branch / of the GPU work after the wait; key_sketch ('int8' / 'int4'): the scan
    reads the sketch (:func:`~hybridgen.attention.key_sketch.sketch_bytes_per_token` per
    (sequence, KV head, token), at :meth:`~hybridgen.perf.context.CostContext.sketch_rate`) and
    the branch then reads ceil(oversample * k) exact key rows and re-ranks them (``rerank_s``);
    the keys' last, partial block is scanned exactly (the sketch holds whole blocks), and the
    branch pays SKETCH_HOST_OPS more host ops;
    fused_select: the selection is the code's fused C pass (host.select_gbps where the profile
    has it); False prices torch's group score + top-k (the H200 probe's plain-torch step).
    """
    hw = c.hw
    S_g, S_h = c.split(gpu_budget)
    key_tier, value_tier = c.tiers(mapping)
    k = min(S_h, math.ceil(topk_ratio * S_h)) if S_h else 0
    Hsel = c.Hq if per_head else c.Hkv
    row = c.D * c.b
    rerank = 0.0
    if key_sketch:
        from hybridgen.attention.key_sketch import SKETCH_BLOCK, sketch_bytes_per_token

        # the sketch holds whole blocks: the keys' last, partial one (half a block on average)
        # is scanned exactly, and a block is quantized every SKETCH_BLOCK steps (a token a step)
        tail = min(S_h, SKETCH_BLOCK / 2)
        scanned = c.B * (S_h - tail) * c.Hkv * sketch_bytes_per_token(key_sketch, c.D)
        scan_rate, rate_measured = c.sketch_rate(key_sketch)
        exact_tail = c.stream_time(c.B * (tail + 1) * c.key_tok, c.scan_rate(pinned=False), key_tier)
        kc = min(S_h, math.ceil(oversample * k))
        rerank = c.gather_time(c.B * Hsel * kc, row, key_tier) + c.topk_time(c.B * c.Hq * kc * 4) if kc else 0.0
        host_ops += SKETCH_HOST_OPS
    else:
        scanned, scan_rate, rate_measured = c.B * S_h * c.key_tok, c.scan_rate(pinned), True
        exact_tail = 0.0
    scan = c.stream_time(scanned, scan_rate, key_tier) + exact_tail
    if fused_select:
        group, topk, fused = c.select_time(c.B * c.Hq * S_h * 4, c.B * Hsel * S_h * 4, per_head)
    else:
        group = 0.0 if per_head else c.group_score_time(c.B * c.Hq * S_h * 4)
        topk, fused = c.topk_time(c.B * Hsel * S_h * 4), False
    gather = c.gather_time(c.B * Hsel * k, row, value_tier)
    h2d_bytes = c.B * c.Hq * k * 4 + c.B * Hsel * k * row
    xfer = c.copy(h2d_bytes, pageable=not staging_pinned) if k else 0.0
    host_fixed = c.fixed(host_ops=host_ops) if S_h else 0.0
    cpu = scan + group + topk + rerank + gather + host_fixed + xfer if S_h else 0.0
    exact = c.gather_time(c.B * Hsel * k, row, key_tier) + c.fixed(host_ops=1) if pipelined and k else 0.0
    gpu_pre = c.gpu_keys(S_g) if S_g else 0.0
    softmax = c.B * c.Hq * (S_g + k) * 4 * 2 / (hw.gpu.hbm_gbps * 1e9)
    gpu_fixed = c.fixed(gpu_kernels=gpu_kernels)
    after = c.gpu_values(S_g + k * Hsel / c.Hkv) + softmax + gpu_fixed
    attn = (cpu + gpu_pre if serial else c.overlap(cpu, gpu_pre)) + after
    if not pipelined or c.emulated:
        layer = c.rest + attn + exact
    else:
        layer = max(cpu + exact, c.rest + gpu_pre + exact + after)
    return LayerCost(attn=attn, layer=layer, cpu=cpu + exact, gpu=c.rest + gpu_pre + after, transfer=xfer,
                     gpu_tokens=S_g, staging_tokens=2 * k * (Hsel / c.Hkv),
                     breakdown={"scan_s": scan, "group_score_s": group, "topk_s": topk, "rerank_s": rerank,
                                "gather_s": gather, "scan_rate_measured": rate_measured, "fused_select": fused,
                                "exact_logits_s": exact, "transfer_s": xfer, "gpu_pre_s": gpu_pre,
                                "after_wait_s": after, "gpu_attn_s": gpu_pre + after, "rest_s": c.rest,
                                "fixed_s": host_fixed + gpu_fixed, "scan_rate_gbps": scan_rate, "topk_tokens": k,
                                "h2d_bytes": h2d_bytes, "scanned_key_bytes": scanned},
                     label="hybridgen" + (f"-sketch-{key_sketch}" if key_sketch else ""))


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


def hybridgen_variant_cost(c: CostContext, gpu_budget: Any, topk_ratio: float, ship: str = "logits",
                           three_way: bool = False, stream_ratio: Optional[float] = None,
                           **hybridgen_kw: Any) -> LayerCost:
    """HybridGen's options on top of :func:`hybridgen_cost` (``hybridgen_kw`` pass through).

    ship='partial': the CPU ships [out, lse] per query head (B*Hq*(D*b + 4) bytes) instead of
    the selected logits + V rows; it pays one more pass over the gathered V rows (at the
    host's read rate, after the wait when pipelined) and the GPU's after-wait work loses the
    k selected rows (one entry per head instead).
    three_way: the oldest f of the host tokens are copied over PCIe a layer ahead (pinned,
    B*f*S_h*kv_tok bytes) and attended on the GPU; the CPU branch's token-proportional part
    shrinks by (1 - f) (fixed ops stay); layer = max(CPU branch, GPU path + streamed
    attention, copy). stream_ratio None: the f in [0, 0.9] (step 0.01) that minimises the
    layer, which is where the scheduler's rule (CPU branch = copy) settles when those two
    dominate.
    """
    base = hybridgen_cost(c, gpu_budget, topk_ratio, **hybridgen_kw)
    per_head = bool(hybridgen_kw.get("per_head", False))
    pipelined = bool(hybridgen_kw.get("pipelined", True))
    bd = dict(base.breakdown)
    k = bd.get("topk_tokens", 0)
    Hsel = c.Hq if per_head else c.Hkv
    row = c.D * c.b
    cpu, gpu, xfer = base.cpu, base.gpu, base.transfer
    exact = bd.get("exact_logits_s", 0.0)
    if ship == "partial" and k:
        rows_bytes = c.B * Hsel * k * row
        partial_bytes = c.B * c.Hq * (row + 4)
        new_xfer = c.copy(partial_bytes)
        extra_cpu = rows_bytes / (c.hw.host.dram_read_gbps * 1e9)
        saved_gpu = c.gpu_values(k * Hsel / c.Hkv) - c.gpu_values(c.Hq / c.Hkv)
        cpu = cpu - xfer + new_xfer + extra_cpu
        gpu = gpu - max(0.0, saved_gpu)
        exact += extra_cpu
        xfer = new_xfer
        bd.update(h2d_bytes=partial_bytes, transfer_s=new_xfer, partial_s=extra_cpu)
    S_g, S_h = c.split(gpu_budget)

    def compose(f: float) -> Tuple[float, float, float, float]:
        fixed = min(bd.get("fixed_s", 0.0), cpu)
        cpu_f = fixed + (1.0 - f) * (cpu - fixed)
        n = f * S_h
        copy_f = c.copy(c.B * n * c.kv_tok) if n else 0.0
        gpu_f = gpu + (c.gpu_keys(n) + c.gpu_values(n) if n else 0.0)
        if pipelined and not c.emulated:
            layer = max(cpu_f, gpu_f, copy_f)
        else:
            layer = max(cpu_f - exact, gpu_f - c.rest, copy_f) + c.rest + exact
        return layer, cpu_f, gpu_f, copy_f

    if three_way:
        grid = [stream_ratio] if stream_ratio is not None else [i / 100 for i in range(91)]
        f = min(grid, key=lambda x: compose(x)[0])
    else:
        f = 0.0
    layer, cpu_f, gpu_f, copy_f = compose(f)
    bd.update(stream_ratio=f, streamed_tokens=f * S_h, stream_copy_s=copy_f,
              stream_bytes=c.B * f * S_h * c.kv_tok)
    label = "hybridgen" + ("-partial" if ship == "partial" else "") + ("-three-way" if three_way else "")
    return LayerCost(attn=max(cpu_f, gpu_f - c.rest, copy_f), layer=layer, cpu=cpu_f, gpu=gpu_f,
                     transfer=xfer + copy_f, gpu_tokens=base.gpu_tokens,
                     staging_tokens=base.staging_tokens + (2 * f * S_h if three_way else 0.0),
                     breakdown=bd, label=label)
