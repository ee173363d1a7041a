"""HybridGen's per-layer cost (PROJECTED; symbols in :mod:`hybridgen.perf.context`).

``HybridGen.layer_cost(c)`` calls :func:`hybridgen_cost`, with the ``ship`` and three-way
options priced by :func:`hybridgen_variant_cost` on top of it. S_g, S_h = c.split(gpu_budget).
It prices what ``HybridGen.decode`` runs (:mod:`hybridgen.hybrid.gpu_share`):

  S_h == 0        nothing on the host: ``full``'s own attention (``dense_decode``), so the
                  cost is :func:`~hybridgen.perf.costs.full_cost`'s (fused rate, FULL_KERNELS)
  hybridgen       k = ceil(topk_ratio*S_h), Hsel = Hq (per_head) or Hkv
                  cpu = scan(B*S_h*key_tok / key_scan rate, pinned or pageable keys)
                        (+ rerank with the bf16-dot scan of bf16 keys, ``scan='bf16dot'``:
                        ceil(oversample*k) exact key rows gathered and ranked)
                        + group score(B*Hq*S_h*4 / group_score_gbps; shared selection only)
                        + topk(B*Hsel*S_h*4 / topk_gbps)
                        + gather(B*Hsel*k*D*b at the value tier, + CXL latency term)
                        + host_ops * op_us + copy(B*Hq*k*4 + B*Hsel*k*D*b, pinned staging or not)
                  gpu_pre   = gpu_attn(S_g, fused) + SHARE_PRE_KERNELS - 1 launches
                              (the GPU share: a fused partial with its LSE, before the wait,
                              at the rate ``full`` runs: gpu.attention_gbps)
                  after     = gpu_values(k*Hsel/Hkv + Hq/Hkv) + softmax over the k + 1 entries
                              + gpu_kernels launches   (ONE softmax: the shipped part and the
                              share's [lse, out] entry, the exact LSE merge, after the wait)
                  (fused_share=False: the GPU share's logits unfused, gpu_pre = gpu_keys(S_g),
                  after = gpu_values(S_g + k*Hsel/Hkv) + softmax over S_g + k: the H200 probe's
                  plain-torch step, hybridgen.perf.probe_rows)
                  attn = overlap(cpu, gpu_pre) + after            (``serial``: cpu + gpu_pre + after)
                  pipelined (CPU runs a layer ahead, exact logits of the k rows recomputed after
                  the wait: exact = gather of the k key rows + 1 host op):
                    layer = max(cpu + exact, rest + gpu_pre + exact + after)
                  otherwise: layer = rest + attn (+ exact on the CPU-emulated profile)

Host placement: 'semantic' by default (keys on DRAM, values on CXL when the profile has a CXL
node); a workload's ``mapping`` overrides it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Tuple

from hybridgen.hybrid.memory import hybridgen_footprint
from hybridgen.methods.footprint import with_memory
from hybridgen.hybrid.scheduler import FeedbackScheduler, SchedulerConfig
from hybridgen.perf.context import CostContext, LayerCost, Placement
from hybridgen.perf.costs import full_cost

# hybridgen: torch.profiler counts 75 top-level aten ops per layer-step of its decode on the CPU
# (full: 33), most of them views; of the rest ~14 are in the CPU branch (scan, group score:
# logsumexp/where/max, top-k, logits at idx, gathers, staging)
HYBRIDGEN_HOST_OPS = 14
# GPU launches of a layer-step with host tokens on the CUDA path (CuPy kernels), counted from
# the code: before the wait the query's copy down, place_new's K and V appends, and the share's
# partial kernel + its combine (attention/cuda/planning.py LaunchPlan.launches): 5; after the
# wait the one softmax's kernels, one per part (the shipped part, the share's [lse, out]) +
# its combine, then settle's four copies (the evicted token's K, V to the host, the new token's
# K, V into its slot): 7. On the torch fallback (no CuPy) a TorchDispatchMode around
# merge_with_host + RingWindow.settle counts 28 non-view aten ops per layer-step after the wait
# (SmolLM2-135M random, 3 layers, gpu_budget 0.25, top-k 0.1, both ship modes).
SHARE_PRE_KERNELS = 5
HYBRIDGEN_GPU_KERNELS = 7
# key_sketch adds 26 torch calls per layer to the CPU branch (a TorchFunctionMode around
# host_branch + KeySketch.sync: 42 calls against 16 without the sketch), ~10 of them real
# (the sync's front check, the exact tail's scan and its copy, the statistics' concatenation,
# the re-rank's buffers, the candidates' gather) and the rest views or no-op conversions
SKETCH_HOST_OPS = 10
# fused per row (csrc/branch.c), the sketch's stages are the C kernel's: the branch pays the
# bf16-dot branch's BF16DOT_HOST_OPS and the sync's front check (a clone and an equal: 13 more
# torch calls per layer than the fused bf16-dot branch, 2 of them real; a TorchFunctionMode
# around KeySketch.sync + host_branch, bf16 keys, no mask)
SKETCH_FUSED_HOST_OPS = 2
# scan='bf16dot' adds 33 torch calls per layer to the CPU branch (a TorchFunctionMode around
# host_branch, bf16 keys, no mask: 87 calls against 54 with 'exact'), 5 of them real (the
# query's bf16 rounding, its fp32 copy for the exact rows, two pool hand-offs: the exact rows'
# and the re-rank's C kernels, the candidates' gather); the rest views, empties and pointers
BF16DOT_HOST_OPS = 5

__all__ = ["hybridgen_cost", "hybridgen_variant_cost", "hybridgen_layer_cost"]


def hybridgen_cost(c: CostContext, gpu_budget: Any, topk_ratio: float, per_head: bool = False,
                   pipelined: bool = True, mapping: Placement = "semantic", pinned: Optional[bool] = None,
                   staging_pinned: bool = True, serial: bool = False, host_ops: int = HYBRIDGEN_HOST_OPS,
                   gpu_kernels: int = HYBRIDGEN_GPU_KERNELS, key_sketch: Optional[str] = None,
                   oversample: float = 1.0, fused_select: bool = True, fused_share: bool = True,
                   scan: str = "exact", scan_oversample: float = 1.25) -> LayerCost:
    """HybridGen: CPU key scan + group score + top-k over the host keys, the selected rows'
    logits and V rows shipped to the GPU, ONE softmax with the GPU share after the wait; with
    nothing on the host (S_h == 0), ``full``'s cost (the code runs ``full``'s attention).

    pipelined: the CPU branch runs a layer ahead (stand-in queries), keeps the selected rows'
    keys (a gather, ``kept_keys_s``, in the branch) and their logits are recomputed exactly
    after the wait (a dense pass over those rows, ``exact_logits_s``); pinned: host keys
    page-locked (None: whenever a real GPU, as kv/tiers.py does); staging_pinned: the shipped rows leave from a
    pinned staging buffer (False: a pageable copy); serial: the CPU branch starts only when
    the GPU logits are done (a blocking q.to('cpu')); host_ops / gpu_kernels: the fixed ops
    of the CPU branch / of the GPU work after the wait; key_sketch ('int8' / 'int4'): the scan
    reads the sketch (:func:`~hybridgen.attention.key_sketch.sketch_bytes_per_token` per
    (sequence, KV head, token), at :meth:`~hybridgen.perf.context.CostContext.sketch_rate`) and
    the branch then reads ceil(oversample * k) exact key rows and re-ranks them (``rerank_s``);
    the keys' last, partial block is scanned at the keys' precision (the sketch holds whole
    blocks), and the branch pays SKETCH_HOST_OPS more host ops (fused per row: the bf16-dot
    branch's BF16DOT_HOST_OPS + SKETCH_FUSED_HOST_OPS);
    scan='bf16dot' (bf16 keys only, as :func:`~hybridgen.hybrid.host_branch.scan_precision`):
    the keys are scanned at host.key_scan_bf16dot_gbps where the profile measured it, else at
    the pageable key scan's rate (an assumption: ``scan_rate_measured`` False), and ceil(scan_oversample * k)
    candidates' exact key rows are read and re-ranked (``rerank_s``), + BF16DOT_HOST_OPS;
    fused_select: the selection is the code's fused C pass (host.select_gbps where the profile
    has it); False prices torch's group score + top-k (the H200 probe's plain-torch step).
    fused_share: the GPU share is a fused partial with its LSE (the code); False prices its
    logits unfused and joined to the one softmax (the H200 probe's plain-torch step).
    """
    hw = c.hw
    S_g, S_h = c.split(gpu_budget)
    if fused_share and not S_h:
        return _full_path(c, "hybridgen" + (f"-sketch-{key_sketch}" if key_sketch else ""))
    key_tier, value_tier = c.tiers(mapping)
    k = min(S_h, math.ceil(topk_ratio * S_h)) if S_h else 0
    Hsel = c.Hq if per_head else c.Hkv
    row = c.D * c.b
    rerank = 0.0
    # the code fuses the branch's stages per row where bf16 keys are bf16-dot scanned, alone or past
    # a sketch's blocks, and the rows keep the threads busy (host_branch.host_branch)
    fused_rows = (scan == "bf16dot" and c.w.dtype_key == "bf16" and not per_head
                  and fused_runs(c.B * Hsel, c.hw.host.cores))
    if key_sketch:
        from hybridgen.attention.key_sketch import SKETCH_BLOCK, sketch_bytes_per_token

        # the sketch holds whole blocks: the keys' last, partial one (half a block on average)
        # is scanned exactly, and a block is quantized every SKETCH_BLOCK steps (a token a step)
        tail = min(S_h, SKETCH_BLOCK / 2)
        scanned = c.B * (S_h - tail) * c.Hkv * sketch_bytes_per_token(key_sketch, c.D)
        scan_rate, rate_measured = c.sketch_rate(key_sketch)
        tail_rate = (c.bf16dot_scan_rate(pinned=False)[0] if scan == "bf16dot" and c.w.dtype_key == "bf16"
                     else c.scan_rate(pinned=False))  # the tail at the scan's precision (host_branch.sketch_scan)
        tail_scan = c.stream_time(c.B * (tail + 1) * c.key_tok, tail_rate, key_tier)
        rerank = _rerank_time(c, min(S_h, math.ceil(oversample * k)), Hsel, key_tier, per_head, fused_select)
        host_ops += BF16DOT_HOST_OPS + SKETCH_FUSED_HOST_OPS if fused_rows else SKETCH_HOST_OPS
    else:
        scanned, scan_rate, rate_measured = c.B * S_h * c.key_tok, c.scan_rate(pinned), True
        tail_scan = 0.0
        if scan == "bf16dot" and c.w.dtype_key == "bf16":  # its own rate where the profile measured it
            scan_rate, rate_measured = c.bf16dot_scan_rate(pinned)
            rerank = _rerank_time(c, min(S_h, math.ceil(scan_oversample * k)), Hsel, key_tier, per_head,
                                  fused_select)
            host_ops += BF16DOT_HOST_OPS
    scan = c.stream_time(scanned, scan_rate, key_tier) + tail_scan
    if fused_select:
        group, topk, fused = c.select_time(c.B * c.Hq * S_h * 4, c.B * Hsel * S_h * 4, per_head)
    else:
        group = 0.0 if per_head else c.group_score_time(c.B * c.Hq * S_h * 4)
        topk, fused = c.topk_time(c.B * Hsel * S_h * 4), False
    gather = c.gather_time(c.B * Hsel * k, row, value_tier)
    # the branch's threads work in whole (batch, KV head) rows (fused) or split the rows of the
    # stages after the scan (stagewise): the rounds of rows the threads take, not a perfect share
    whole, per_row = row_rounds(c.B * Hsel, c.hw.host.cores, fused_rows)
    scan, group, topk, rerank, gather = (scan * whole, group * whole * per_row, topk * whole * per_row,
                                         rerank * whole * per_row, gather * whole * per_row)
    h2d_bytes = c.B * c.Hq * k * 4 + c.B * Hsel * k * row
    xfer = c.copy(h2d_bytes, pageable=not staging_pinned) if k else 0.0
    host_fixed = c.fixed(host_ops=host_ops) if S_h else 0.0
    # pipelined: the branch keeps the k selected key rows (a gather, before the wait); at the layer
    # the true query's logits over them are one dense pass (rows_logits, after the wait; method._finish)
    keep = c.gather_time(c.B * Hsel * k, row, key_tier) if pipelined and k else 0.0
    cpu = scan + group + topk + rerank + gather + keep + host_fixed + xfer if S_h else 0.0
    exact = (c.stream_time(c.B * Hsel * k * row, c.scan_rate(pinned=False), "dram") + c.fixed(host_ops=1)
             if pipelined and k else 0.0)
    if fused_share:  # the share's [lse, out]: one softmax entry per query head after the wait
        gpu_pre = c.gpu_attn(S_g, c.partial_fused) + c.fixed(gpu_kernels=SHARE_PRE_KERNELS - 1) if S_g else 0.0
        entries, rows = k + 1, k * Hsel / c.Hkv + c.Hq / c.Hkv
    else:
        gpu_pre = c.gpu_keys(S_g) if S_g else 0.0
        entries, rows = S_g + k, S_g + k * Hsel / c.Hkv
    softmax = c.B * c.Hq * entries * 4 * 2 / (hw.gpu.hbm_gbps * 1e9)
    gpu_fixed = c.fixed(gpu_kernels=gpu_kernels)
    after = c.gpu_values(rows) + softmax + gpu_fixed
    attn = (cpu + gpu_pre if serial else c.overlap(cpu, gpu_pre)) + after
    if not pipelined or c.emulated:
        layer = c.rest + attn + exact
    else:
        layer = max(cpu + exact, c.rest + gpu_pre + exact + after)
    return LayerCost(attn=attn, layer=layer, cpu=cpu + exact, gpu=c.rest + gpu_pre + after, transfer=xfer,
                     gpu_tokens=S_g, staging_tokens=2 * k * (Hsel / c.Hkv),
                     breakdown={"scan_s": scan, "group_score_s": group, "topk_s": topk, "rerank_s": rerank,
                                "gather_s": gather, "kept_keys_s": keep, "scan_rate_measured": rate_measured,
                                "fused_select": fused,
                                "exact_logits_s": exact, "transfer_s": xfer, "gpu_pre_s": gpu_pre,
                                "after_wait_s": after, "gpu_attn_s": gpu_pre + after, "rest_s": c.rest,
                                "fixed_s": host_fixed + gpu_fixed, "scan_rate_gbps": scan_rate, "topk_tokens": k,
                                "h2d_bytes": h2d_bytes, "scanned_key_bytes": scanned,
                                "row_rounds_factor": whole * per_row},
                     label="hybridgen" + (f"-sketch-{key_sketch}" if key_sketch else ""))


def _rerank_time(c: CostContext, kc: int, Hsel: int, key_tier: str, per_head: bool, fused_select: bool) -> float:
    """The exact re-rank after an approximate scan (a key sketch, the bf16-dot scan): the kc
    candidates' key rows read from the key tier, their B*Hq*kc fp32 logits ranked by the
    selection that runs them (fused_select: the C selection, ``CostContext.select_time``; else
    torch's top-k)."""
    if not kc:
        return 0.0
    logits = c.B * c.Hq * kc * 4
    if fused_select:
        group, topk, _ = c.select_time(logits, c.B * Hsel * kc * 4, per_head)
        ranked = group + topk
    else:
        ranked = c.topk_time(logits)
    return c.gather_time(c.B * Hsel * kc, c.D * c.b, key_tier) + ranked


def row_rounds(rows: int, threads: Optional[int], fused: bool) -> Tuple[float, float]:
    """(factor on every stage of the fused branch, factor on the stagewise branch's stages after
    its scan) for ``rows`` (batch, KV head) rows on ``threads`` (the profile's host cores; None:
    1.0, 1.0). The fused branch (where the code runs it: ``fused`` and
    :func:`~hybridgen.attention.cpu_select.fused_branch_pays`) hands whole rows to the threads,
    so it takes ceil(rows / threads) row-times, not rows / threads: 64 rows on 16 threads 1.0, on
    15 threads 5 / 4.27 = 1.17. Otherwise the scan splits every row's tokens over all threads
    and the selection, re-rank and gather split over the rows: threads / min(rows, threads) (8
    rows on 16 threads: 2.0)."""
    if not threads or threads <= 1 or rows <= 0:
        return 1.0, 1.0
    if fused and fused_runs(rows, threads):
        return math.ceil(rows / threads) / (rows / threads), 1.0
    return 1.0, threads / min(rows, threads)


def fused_runs(rows: int, threads: Optional[int]) -> bool:
    """Whether the code's fused branch runs for ``rows`` (batch, KV head) rows on ``threads``
    (the profile's host cores; None: one thread): :func:`~hybridgen.attention.cpu_select.fused_branch_pays`."""
    from hybridgen.attention.cpu_select import fused_branch_pays

    return fused_branch_pays(rows, threads or 1)


def _full_path(c: CostContext, label: str) -> LayerCost:
    """HybridGen with nothing on the host: ``full``'s cost, with HybridGen's breakdown keys at 0."""
    cost = full_cost(c)
    bd = {key: 0.0 for key in ("scan_s", "group_score_s", "topk_s", "rerank_s", "gather_s", "kept_keys_s",
                               "exact_logits_s",
                               "transfer_s", "gpu_pre_s", "after_wait_s", "topk_tokens", "h2d_bytes",
                               "scanned_key_bytes")}
    bd.update(cost.breakdown, full_path=True)
    return dataclasses.replace(cost, breakdown=bd, label=label)


def hybridgen_variant_cost(c: CostContext, gpu_budget: Any, topk_ratio: float, ship: str = "logits",
                           three_way: bool = False, stream_ratio: float = 0.0,
                           **hybridgen_kw: Any) -> LayerCost:
    """HybridGen's options on top of :func:`hybridgen_cost` (``hybridgen_kw`` pass through).

    ship='partial': the CPU ships [out, lse] per query head (B*Hq*(D*b + 4) bytes) instead of
    the selected logits + V rows; it pays one more pass over the gathered V rows (at the
    host's read rate, after the wait when pipelined) and the GPU's after-wait work loses the
    k selected rows (one entry per head instead).
    three_way: the oldest f of the host tokens are copied over PCIe a layer ahead (pinned,
    B*f*S_h*kv_tok bytes, keys and values each at min(link, their tier's read rate)) and attended on the GPU; the CPU branch's scan and
    selection shrink by (1 - f) (the k selected rows, a share of every host token, and the fixed ops
    stay); pipelined: layer = max(CPU branch, GPU path + streamed attention + exact, copy);
    otherwise layer = rest + overlap(CPU branch, share + streamed attention, copy) + exact + after
    (``CostContext.overlap``: added where the 'gpu' is the host's own cores), so f = 0 is
    :func:`hybridgen_cost` exactly; f = ``stream_ratio`` (a scheduler-owned f is priced where the
    scheduler settles: :func:`settled_knobs`).
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
    after = bd.get("after_wait_s", 0.0)  # the GPU's work after the wait (the shipped rows' values, the softmax)
    if ship == "partial" and k:
        rows_bytes = c.B * Hsel * k * row
        partial_bytes = c.B * c.Hq * (row + 4)
        new_xfer = c.copy(partial_bytes)
        extra_cpu = rows_bytes / (c.hw.host.dram_read_gbps * 1e9)
        saved_gpu = c.gpu_values(k * Hsel / c.Hkv) - c.gpu_values(c.Hq / c.Hkv)
        cpu = cpu - xfer + new_xfer + extra_cpu
        gpu = gpu - max(0.0, saved_gpu)
        after = after - max(0.0, saved_gpu)
        exact += extra_cpu
        xfer = new_xfer
        bd.update(h2d_bytes=partial_bytes, transfer_s=new_xfer, partial_s=extra_cpu)
    S_g, S_h = c.split(gpu_budget)
    tiers = c.tiers(hybridgen_kw.get("mapping", "semantic"))

    f = float(stream_ratio) if three_way else 0.0
    n = f * S_h
    # the scan and selection shrink by (1 - f); k (a share of every host token) and the fixed ops do not
    cpu_f = cpu - f * (bd.get("scan_s", 0.0) + bd.get("group_score_s", 0.0) + bd.get("topk_s", 0.0))
    copy_f = c.host_copy(c.B * n * c.kv_tok, tiers) if n else 0.0  # keys and values from their tiers
    gpu_f = gpu + (c.gpu_keys(n) + c.gpu_values(n) if n else 0.0)
    # before the wait the share and the streamed slice run beside the CPU branch and the copy; after
    # it, the GPU's work follows the branch. Pipelined, the exact recompute (and ship='partial''s pass
    # over the V rows) runs after the wait on both paths; otherwise that pass is part of the branch.
    post = exact if pipelined else 0.0
    before = c.overlap(c.overlap(cpu_f - post, gpu_f - c.rest - after), copy_f)
    if pipelined and not c.emulated:
        layer = max(cpu_f, gpu_f + post, copy_f)
    else:  # concurrent branches, added where the 'gpu' is the host's own cores (CostContext.overlap)
        layer = c.rest + before + post + after
    bd.update(stream_ratio=f, streamed_tokens=f * S_h, stream_copy_s=copy_f,
              stream_bytes=c.B * f * S_h * c.kv_tok)
    label = "hybridgen" + ("-partial" if ship == "partial" else "") + ("-three-way" if three_way else "")
    return LayerCost(attn=before + after, layer=layer, cpu=cpu_f, gpu=gpu_f,
                     transfer=xfer + copy_f, gpu_tokens=base.gpu_tokens,
                     staging_tokens=base.staging_tokens + (2 * f * S_h if three_way else 0.0),
                     breakdown=bd, label=label)


# decisions of the feedback rule the model simulates (a decision per step): from the start
# ratio 0.05 the ratio reaches its floor 0.01 in 8 and its cap 0.5 in 13, and the streamed
# fraction (damping 0.5) is within 1e-6 of its target after 20
SETTLE_DECISIONS = 48
# the ratio oscillates x1.2 / x0.8 around the balance: its geometric mean over the last decisions
SETTLE_TAIL = 8


def settled_knobs(m: Any, price: Callable[[float, Optional[float]], LayerCost]) -> Tuple[float, Optional[float]]:
    """The top-k ratio and streamed fraction HybridGen's feedback scheduler settles at when the branch
    times are the model's: the scheduler itself (:class:`~hybridgen.hybrid.scheduler.FeedbackScheduler`,
    one unit, a decision every step) fed ``price(ratio, fraction)``'s CPU and GPU branch times and
    three-way flows at its current knobs for :data:`SETTLE_DECISIONS` decisions. Returns (ratio, fraction):
    the ratio's geometric mean over the last :data:`SETTLE_TAIL` decisions (or ``m.topk_ratio`` when
    pinned), the fraction's last value (``m.stream_ratio`` when pinned; None without three-way)."""
    owned = m.scheduled_params()
    adapt_ratio, adapt_stream = "topk_ratio" in owned, "stream_ratio" in owned
    start = SchedulerConfig()
    ratio = m.topk_ratio if not adapt_ratio else start.start_ratio
    fraction = None if not m.three_way else (m.stream_ratio if not adapt_stream else start.start_stream)
    if not (adapt_ratio or adapt_stream):
        return ratio, fraction
    sched = FeedbackScheduler(dataclasses.replace(start, interval=1, adapt_ratio=adapt_ratio,
                                                  adapt_stream=adapt_stream), num_layers=1)
    ratios = []
    for _ in range(SETTLE_DECISIONS):
        r = sched.ratio(0) if adapt_ratio else ratio
        f = sched.stream_fraction(0) if adapt_stream else fraction
        cost = price(r, f)
        sched.record(0, cost.cpu, cost.gpu)
        if adapt_stream:
            streamed = cost.breakdown.get("streamed_tokens", 0.0)
            host = streamed / f if f else 0.0
            sched.record_stream(0, cost.cpu, host - streamed, cost.breakdown.get("stream_copy_s", 0.0), streamed)
        sched.end_step()
        ratios.append(r)
    if adapt_ratio:
        tail = ratios[-SETTLE_TAIL:]
        ratio = math.exp(sum(math.log(x) for x in tail) / len(tail))
    return ratio, (sched.stream_fraction(0) if adapt_stream else fraction)


def hybridgen_layer_cost(m: Any, c: CostContext) -> LayerCost:
    """``HybridGen.layer_cost``: :func:`hybridgen_cost` with ``m``'s parameters, its ``ship`` and
    three-way options priced by :func:`hybridgen_variant_cost`, every knob the scheduler owns (a
    None ``topk_ratio`` / ``stream_ratio``) at the value it settles at under these costs
    (:func:`settled_knobs`; the breakdown's ``topk_ratio`` and ``stream_ratio``). gpu_tokens /
    staging_tokens are the footprint's (:func:`hybridgen.hybrid.memory.hybridgen_footprint`, through
    :func:`~hybridgen.methods.footprint.with_memory`) at the ratio priced; the shipped rows'
    device copies are outside it (set aside by the placement, :func:`ship_staging_bytes`)."""
    # host segments are pageable (kv/tiers.py view): the scan runs at the pageable rate
    kw = dict(per_head=m.per_head, pipelined=m.pipeline, mapping=m.mapping, pinned=False,
              key_sketch=None if m.key_sketch == "none" else m.key_sketch, oversample=m.sketch_oversample,
              scan=m.scan, scan_oversample=m.scan_oversample)

    def price(ratio: float, fraction: Optional[float]) -> LayerCost:
        if m.ship == "logits" and not m.three_way:
            return hybridgen_cost(c, m.gpu_budget, ratio, **kw)
        # k counts every host token but is at most the scanned ones, (1 - f) of them (host_branch.topk_count)
        return hybridgen_variant_cost(c, m.gpu_budget, min(ratio, 1.0 - (fraction or 0.0)), ship=m.ship,
                                      three_way=m.three_way, stream_ratio=fraction or 0.0, **kw)

    ratio, fraction = settled_knobs(m, price)
    cost = price(ratio, fraction)
    cost.breakdown["topk_ratio"] = ratio
    shape = c.kv_shape()
    return with_memory(cost, hybridgen_footprint(dataclasses.replace(m, topk_ratio=ratio), shape), shape)
