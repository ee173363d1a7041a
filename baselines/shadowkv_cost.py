"""ShadowKV's PROJECTED layer cost, beside the method (:mod:`baselines.shadowkv`).

The cost prices time only; the GPU memory a ShadowKV row reports is its footprint
(:meth:`baselines.shadowkv.ShadowKV.footprint`, set by ``ShadowKV.layer_cost``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from baselines.shadowkv import plan_chunks

if TYPE_CHECKING:
    from hybridgen.perf.context import CostContext, LayerCost

# GPU kernels / host ops of one decode step, counted from ShadowKV.select_chunks, _fetch and decode
SCORE_KERNELS = 7    # landmark logits, padding mask, softmax, group max, top-k, chunk-id gather, sort
REBUILD_KERNELS = 6  # chunk -> token ids, U-row gather, matmul by S V^T, position gather, rotation, fetch copy
PARTS_KERNELS = 4    # logits of the two extra parts (outliers, fetched chunks) and their masks
FETCH_HOST_OPS = 3   # token ids to host rows, the value gather into the staging buffer, the copy up
# memory touches of the key rebuild per fetched (token, KV head): rows of U ([r]) read by the
# gather, written, read by the matmul; rebuilt keys ([D]) written, read and written by the
# rotation (pre-RoPE x cos, rotate_half x sin), read and written by the copy into the fetch buffer
REBUILD_TOUCHES_R = 3
REBUILD_TOUCHES_D = 5


def shadowkv_cost(c: "CostContext", budget_ratio: float, rank: int, chunk: int, local_chunks: int,
                  outlier_ratio: float, mapping: str = "dram") -> "LayerCost":
    """PROJECTED ShadowKV layer as the code runs it, one step after the other (the paper overlaps
    the value fetch with the key rebuild; ``ShadowKV._fetch`` waits for the chunk ids, gathers on
    the host and copies synchronously before it rebuilds):

      score   = gpu_keys(C - O landmarks) + SCORE_KERNELS launches
      ids     = the selected chunk ids copied down (B*Hkv*n_sel*8 bytes; the host waits for them)
      gather  = the host gather of n = n_sel*chunk value rows per KV head (value tier) + FETCH_HOST_OPS
      copy    = those rows up (B*n*key_tok bytes, pinned staging)
      rebuild = max(B*Hkv*n*(REBUILD_TOUCHES_R*r + REBUILD_TOUCHES_D*D)*b / hbm, 2*B*Hkv*n*r*D / matmul)
                + REBUILD_KERNELS launches
      attn    = gpu_attn(n + outliers + local) (one softmax over the parts) + PARTS_KERNELS launches
      layer   = rest + score + ids + gather + copy + rebuild + attn   (no cross-layer prefetch)

    The chunk plan is the method's (:func:`plan_chunks`) over the context S. GPU residency is
    not stated here: ``ShadowKV.layer_cost`` sets it from the method's footprint.
    """
    from hybridgen.perf.context import LayerCost

    S, B, Hkv, D, b = c.S, c.B, c.Hkv, c.D, c.b
    budget = int(math.ceil(round(budget_ratio * S, 6)))
    plan = plan_chunks(S, Hkv * D, budget, rank, chunk, local_chunks, outlier_ratio)
    C, O, n_sel, r = plan
    n, outl, local = n_sel * chunk, O * chunk, S - C * chunk
    _, value_tier = c.tiers(mapping)
    score = c.gpu_keys(C - O) + c.fixed(gpu_kernels=SCORE_KERNELS - 1) if C else 0.0
    ids = c.copy(B * Hkv * n_sel * 8) if n else 0.0
    gather = c.gather_time(B * Hkv * n, D * b, value_tier) + c.fixed(host_ops=FETCH_HOST_OPS) if n else 0.0
    h2d = B * n * c.key_tok
    copy = c.copy(h2d)
    rebuild_bytes = B * Hkv * n * (REBUILD_TOUCHES_R * r + REBUILD_TOUCHES_D * D) * b + B * Hkv * r * D * b
    rebuild = 0.0
    if n:
        rebuild = max(rebuild_bytes / (c.hw.gpu.hbm_gbps * 1e9), 2 * B * Hkv * n * r * D / (c.hw.gpu.matmul_tflops * 1e12))
        rebuild += c.fixed(gpu_kernels=REBUILD_KERNELS)
    attn_gpu = c.gpu_attn(n + outl + local) + c.fixed(gpu_kernels=PARTS_KERNELS)
    attn = score + ids + gather + copy + rebuild + attn_gpu
    return LayerCost(attn=attn, layer=c.rest + attn, cpu=gather, gpu=c.rest + score + rebuild + attn_gpu,
                     transfer=ids + copy,
                     breakdown={"score_s": score, "ids_s": ids, "gather_s": gather, "copy_s": copy,
                                "fetch_s": ids + gather + copy, "rebuild_s": rebuild, "gpu_attn_s": attn_gpu,
                                "rest_s": c.rest, "h2d_bytes": h2d, "d2h_bytes": B * Hkv * n_sel * 8, "rank": r,
                                "fetched_tokens": n, "outlier_tokens": outl, "local_tokens": local},
                     label="shadowkv")
