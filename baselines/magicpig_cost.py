"""MagicPIG's PROJECTED layer cost, beside the method (:mod:`baselines.magicpig`).

The cost prices time only; the GPU memory a MagicPIG row reports is its footprint
(:meth:`baselines.magicpig.MagicPIG.footprint`, set by ``MagicPIG.layer_cost``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from baselines.magicpig import expected_sample_rate

if TYPE_CHECKING:
    from hybridgen.perf.context import CostContext, LayerCost

# The CPU part's work per layer-step, counted from :func:`collect` and :func:`sampled_attention`
# (torch.profiler: 103 top-level non-view ops per call). The passes below are the ops over arrays
# that grow with the context; SMALL_OPS are those over per-(query head, table) arrays (searches,
# bucket bounds, the per-head max, sums and merge); each of these costs one host op (a thread
# fork/join); the other ~44 ops work on scalars and are left out.
COLLECT_PASSES = 18   # elementwise int64 passes over the candidates (entry ids, offsets, key ids, pair keys)
PAIR_PASSES = 6       # passes over the collected pairs (count filter, pair -> (b, head, key), group ids)
ROW_PASSES = 9        # passes over the sampled rows [N, D] (gathers, float casts, dot, norms, weighted V)
TAIL_OPS = 5          # float64 ops over the binomial tail [N, tables - m + 1] (xlogy, xlog1py, adds, logsumexp)
TAIL_TOUCHES = 8      # float64 array reads / writes per tail term (the ops' outputs, logsumexp's passes)
SMALL_OPS = 21
HOST_OPS = COLLECT_PASSES + PAIR_PASSES + ROW_PASSES + TAIL_OPS + SMALL_OPS
# The tail's arithmetic (two logarithms and an exponential per term), seconds per term on one
# core, measured on the development machine (AMD EPYC, 1 torch thread, log_sample_prob over
# 500-2000 cosines x 149 terms in cache: 16-21 ns, the fastest taken); an assumption on other
# hosts. Its memory traffic (TAIL_TOUCHES x 8 B per term) is priced on top at the DRAM rate.
TAIL_TERM_S = 16e-9
HASH_KERNELS = 6      # the query's SimHash on the compute device (matmul, sign, reshape, cast, weights, sum)
APPEND_KERNELS = 2    # the new token's K and V into the gpu segment
CACHE_LINE = 64       # bytes one probe of a binary search reads

def magicpig_cost(c: "CostContext", bits: int, tables: int, min_collisions: int, gpu_tokens: int,
                  tier: str = "dram") -> "LayerCost":
    """PROJECTED MagicPIG layer as the code runs it (symbols: :mod:`hybridgen.perf.context`).

    n = S - gpu_tokens host keys per sequence; the sampled share u = the mean collection
    probability of keys in random directions (:func:`expected_sample_rate` with head_dim D);
    candidates N_c = B*Hq*L*n/2^K (one bucket per query head and table); sampled pairs
    N_s = B*Hq*n*u; J = L - m + 1 tail terms.

      pre  = SimHash of q (planes [D, L*K] read at HBM rate, or its FLOPs) + HASH_KERNELS and
             APPEND_KERNELS launches, then q + codes copied down (the host waits for them)
      cpu  = binary searches (2*B*Hq*L*log2 n probes of a cache line, gather rate)
             + bucket ids read (N_c x 4 B, gather rate) + COLLECT_PASSES int64 passes over N_c
             + the count (a sort of N_c int64 keys, at the top-k rate) + PAIR_PASSES over N_s
             + K and V rows of the sampled pairs (gather, at the KV tier) + ROW_PASSES fp32
             passes over [N_s, D] + the sampling probabilities (N_s*J tail terms: TAIL_TERM_S
             per term and core + TAIL_TOUCHES x 8 B) + HOST_OPS host ops; passes read and
             write (2x bytes) at the DRAM read rate
      gpu  = the exact partial over the gpu_tokens (unfused: logits, softmax, weighted sum)
      post = out + lse copied up, then the LSE merge (MERGE_KERNELS)
      attn = pre + overlap(cpu, gpu) + post;  layer = rest + attn  (no cross-layer overlap)

    GPU residency is not stated here: ``MagicPIG.layer_cost`` sets it from the method's footprint.
    """
    from hybridgen.perf.costs import MERGE_KERNELS, PARTIAL_KERNELS
    from hybridgen.perf.context import LayerCost

    key_tier, _ = c.tiers(tier)
    B, Hq, D, b = c.B, c.Hq, c.D, c.b
    n_gpu = min(c.S, gpu_tokens)
    n = c.S - n_gpu
    planes_bytes = D * tables * bits * 4
    cb = 2 if bits <= 15 else 4
    rate = expected_sample_rate(bits, tables, min_collisions, head_dim=D)
    sampled = B * Hq * n * rate
    candidates = B * Hq * tables * n * 0.5 ** bits
    J = tables - min_collisions + 1
    hbm, flops = c.hw.gpu.hbm_gbps * 1e9, c.hw.gpu.matmul_tflops * 1e12
    hash_s = max(planes_bytes / hbm, 2 * B * Hq * D * tables * bits / flops)
    pre_gpu = hash_s + c.fixed(gpu_kernels=HASH_KERNELS + APPEND_KERNELS)
    down = B * Hq * (D * b + tables * cb)
    up = B * Hq * (D * b + 4)
    dram = c.hw.host.dram_read_gbps * 1e9
    if n:
        search = c.gather_time(2 * B * Hq * tables * math.ceil(math.log2(max(n, 2))), CACHE_LINE, key_tier)
        buckets = c.gather_time(candidates, 4, key_tier)
        collect_s = COLLECT_PASSES * candidates * 8 * 2 / dram + c.topk_time(candidates * 8)
        pairs = PAIR_PASSES * sampled * 8 * 2 / dram
        rows = c.gather_time(sampled, 2 * D * b, key_tier) + ROW_PASSES * sampled * D * 4 * 2 / dram
        tail = sampled * J * (TAIL_TERM_S / (c.hw.host.cores or 1) + TAIL_TOUCHES * 8 / dram)
        cpu = search + buckets + collect_s + pairs + rows + tail + c.fixed(host_ops=HOST_OPS)
        xfer_down, xfer_up = c.copy(down), c.copy(up)
    else:
        search = buckets = collect_s = pairs = rows = tail = cpu = xfer_down = xfer_up = 0.0
    gpu_attn = c.gpu_attn(n_gpu) + c.fixed(gpu_kernels=PARTIAL_KERNELS - 1)
    merge = c.fixed(gpu_kernels=MERGE_KERNELS) if n else 0.0
    attn = pre_gpu + xfer_down + (c.overlap(cpu, gpu_attn) if n else gpu_attn) + xfer_up + merge
    return LayerCost(attn=attn, layer=c.rest + attn, cpu=cpu, gpu=c.rest + pre_gpu + gpu_attn + merge,
                     transfer=xfer_down + xfer_up,
                     breakdown={"hash_s": pre_gpu, "search_s": search, "bucket_s": buckets, "collect_s": collect_s,
                                "pairs_s": pairs, "rows_s": rows, "tail_s": tail, "candidates": candidates,
                                "sampled_pairs": sampled, "sample_rate": rate, "gpu_attn_s": gpu_attn,
                                "transfer_s": xfer_down + xfer_up, "rest_s": c.rest, "h2d_bytes": up,
                                "d2h_bytes": down, "host_kv_bytes": B * n * c.kv_tok,
                                "host_table_bytes": B * c.Hkv * tables * n * (cb + 4)},
                     label="magicpig")
