"""HybridGen's CPU branch for one layer: scan the host keys, take the top-k, gather the rows.

Built from the scan API of :mod:`hybridgen.attention.cpu_scan`. Shapes: q [B, Hq, D] or
[B, Hq, 1, D] (on the host); keys/values [B, Hkv, T, D] (segment views, read in place);
mask [B, Hkv, T] bool or None; Hq = G * Hkv. Shared selection (``per_head=False``) picks k
tokens per (batch, KV head), ranked by :func:`~hybridgen.attention.cpu_scan.group_scores`
(one V row serves the whole group: Hsel = Hkv); per-head selection picks k per query head
(Hsel = Hq).

Steps: (1) scan: logits of every host key (``backend``) at ``precision``: 'exact' (fp32
query, fp32 accumulation) or 'bf16dot' (the selection scan at the memory limit: the query
rounded to bf16, bf16 x bf16 products summed in fp32,
:func:`~hybridgen.attention.cpu_scan.scan_logits_stats`), or, with a
:class:`~hybridgen.attention.key_sketch.KeySketch`, approximate logits from the sketch's
int8/int4 codes (fewer bytes per key; the keys' last partial block, which the sketch does
not hold yet, at ``precision``: :func:`sketch_scan`); (2) selection:
:func:`~hybridgen.attention.cpu_scan.select` (group score + partial top-k + the selected
logits in one pass per row); (3) after an approximate scan (a sketch or 'bf16dot'), the
selected rows' logits are recomputed exactly from the full-precision keys
(:func:`~hybridgen.attention.cpu_scan.exact_logits_at`, read in place; fusing it with the V
gather measured slower: 37 vs 33 ms at batch 8 x 32K); with ``oversample`` > 1 the
approximate scan proposes ceil(oversample * k) candidates and the k with the best exact
group score are kept (:func:`rerank`: the same score as the selection, the group's heads
normalised by the scan's logsumexp; ties to the lower token; as
:func:`hybridgen.attention.cpu_select.select_bf16dot`); (4) gather of the V rows (into
``v_out``, e.g. a pinned staging buffer).
The scan's [B, Hq, T] logits go to a per-thread scratch buffer reused across calls (no
fresh 30+ MB allocation, and its page faults, per layer).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from hybridgen.attention.cpu_pool import CPUAttentionPool, default_pool
from hybridgen.attention.cpu_scan import (NEG_INF, exact_logits_at, gather_mask, gather_rows,
                                          scan_logits_stats, select)
from hybridgen.attention.key_sketch import KeySketch
from hybridgen.attention.cpu_select import fused_branch, fused_branch_fits, fused_branch_pays, rerank_exact


@dataclass
class HostSelection:
    """What the CPU branch hands the GPU side for one layer.

    idx [B, Hsel, k]; logits [B, Hq, k] float32 (-inf where masked or padding);
    v_rows [B, Hsel, k, D]; k_rows [B, Hsel, k, D] or None (kept when exact logits are to be
    recomputed from a different query); mask [B, Hsel, k] or None; exact: logits are
    fp32-accurate for the scanned query; timings in seconds (scan, topk = selection,
    recompute = exact logits of the selection after a sketch scan, gather = V rows + K rows
    (keep_keys) + mask).
    """

    idx: Tensor
    logits: Tensor
    v_rows: Tensor
    k_rows: Optional[Tensor]
    mask: Optional[Tensor]
    exact: bool
    scan_s: float = 0.0
    topk_s: float = 0.0
    gather_s: float = 0.0
    offset: int = 0  # first scanned token of the segment (idx is relative to it)
    recompute_s: float = 0.0


_scratch = threading.local()


def scratch_logits(numel: int) -> Tensor:
    """This thread's float32 scratch of at least ``numel`` elements (grown, never shrunk)."""
    buf = getattr(_scratch, "logits", None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=torch.float32)
        _scratch.logits = buf
    return buf[:numel]


def host_branch(q: Tensor, keys: Tensor, values: Tensor, scale: float, k: int, per_head: bool,
                mask: Optional[Tensor] = None, keep_keys: bool = False, backend: str = "auto",
                topk_backend: str = "auto", group_score: str = "max",
                v_out: Optional[Tensor] = None, pool: Optional[CPUAttentionPool] = None,
                sketch: Optional[KeySketch] = None, sketch_offset: int = 0, oversample: float = 1.0,
                precision: str = "exact", fused: bool = True) -> HostSelection:
    """Scan + top-k + gather over one layer's host KV.

    q [B, Hq, D] or [B, Hq, 1, D] (CPU); keys/values [B, Hkv, T, D]; k tokens per
    (batch, KV head) (shared) or per (batch, query head) (per_head), clamped to T.
    v_out: optional buffer (e.g. pinned) the V rows are gathered into.
    pool: whose threads run the kernels' slices (default: the default pool).
    sketch: scan this (already synced) key sketch for the selection instead of ``keys``;
    ``keys`` are token ``sketch_offset`` onwards of the sketch's segment. The returned logits
    are then recomputed exactly from ``keys`` (``exact`` True); oversample (>= 1): an
    approximate scan (a sketch, or precision 'bf16dot') proposes ceil(oversample * k)
    candidates, re-ranked by their exact logits. precision: the scan of the keys, 'exact' or
    'bf16dot' (:func:`~hybridgen.attention.cpu_scan.scan_logits_stats`; with a sketch, of the
    tail it does not hold). fused: run a 'bf16dot' branch's stages (with or without a sketch) per
    (batch, KV head) row (:func:`~hybridgen.attention.cpu_select.fused_branch`, the same result) where it
    fits and keeps the pool's threads busy (``fused_branch_pays``: not 1 row on 2 threads);
    False runs each stage over every row before the next (to compare them).
    """
    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq = q.shape[0], q.shape[1]
    Hkv, T = keys.shape[1], keys.shape[2]
    k = max(0, min(k, T))
    if (fused and precision == "bf16dot" and (v_out is None or v_out.is_contiguous())
            and fused_branch_fits(q, keys, values, k, per_head, mask, backend, topk_backend)
            and fused_branch_pays(B * Hkv, (pool or default_pool()).threads_for(B * Hq * T * keys.shape[-1]))):
        return fused_host_branch(q, keys, values, scale, k, group_score, oversample, v_out, pool, keep_keys,
                                 sketch, sketch_offset)
    buf = scratch_logits(B * Hq * T)
    t0 = time.perf_counter()
    if sketch is not None:
        logits, stats = sketch_scan(q, keys, scale, sketch, sketch_offset, buf, backend, pool, precision)
        if mask is not None:
            G = Hq // Hkv
            logits.view(B, Hkv, G, T).masked_fill_(~mask.expand(B, Hkv, T)[:, :, None, :], NEG_INF)
            stats = None  # the block statistics saw the masked tokens
        exact = True
    else:
        logits, exact, stats = scan_logits_stats(q, keys, scale, mask, backend, out=buf, pool=pool,
                                                 precision=precision)
    approximate = sketch is not None or precision == "bf16dot"  # re-ranked by exact logits below
    exact = exact or approximate
    t1 = time.perf_counter()
    kc = min(T, math.ceil(oversample * k - 1e-9)) if approximate else k
    idx, sel_logits = select(logits, Hkv, kc, per_head, group_score, topk_backend, pool=pool,
                             stats=stats)  # [B, Hsel, kc]
    t2 = time.perf_counter()
    if approximate and k > 0:
        sketch_logits = sel_logits
        sel_logits = masked_heads(exact_logits_at(q, keys, idx, scale, pool=pool), gather_mask(mask, idx))
        if kc > k:
            idx, sel_logits = rerank(sel_logits, idx, k, group_score, logits, stats, sketch_logits, pool=pool)
    t3 = time.perf_counter()
    v_rows = gather_rows(values, idx, out=v_out, pool=pool)
    k_rows = gather_rows(keys, idx, pool=pool) if keep_keys else None
    sel_mask = gather_mask(mask, idx)
    t4 = time.perf_counter()
    return HostSelection(idx, sel_logits, v_rows, k_rows, sel_mask, exact, t1 - t0, t2 - t1, t4 - t3,
                         recompute_s=t3 - t2)


def fused_host_branch(q: Tensor, keys: Tensor, values: Tensor, scale: float, k: int, group_score: str = "max",
                      oversample: float = 1.0, v_out: Optional[Tensor] = None,
                      pool: Optional[CPUAttentionPool] = None, keep_keys: bool = False,
                      sketch: Optional[KeySketch] = None, sketch_offset: int = 0) -> HostSelection:
    """The bf16-dot or key-sketch branch fused per (batch, KV head) row
    (:func:`~hybridgen.attention.cpu_select.fused_branch`) as a :class:`HostSelection`,
    whether or not it keeps the threads busy (:func:`host_branch` runs it where it fits and pays;
    a benchmark runs it anyway to compare). q [B, Hq, D]; keys / values [B, Hkv, T, D] bf16."""
    idx, logits, v_rows, sec = fused_branch(q, keys, values, scale, k, group_score, oversample, v_out, pool,
                                            sketch, sketch_offset)
    t0 = time.perf_counter()
    k_rows = gather_rows(keys, idx, pool=pool) if keep_keys else None
    scan_s, topk_s, recompute_s, gather_s = sec.tolist()
    return HostSelection(idx, logits, v_rows, k_rows, None, True, scan_s, topk_s,
                         gather_s + time.perf_counter() - t0, recompute_s=recompute_s)


def pipelined_host_branch(q: Tensor, keys: Tensor, values: Tensor, scale: float, k: int, per_head: bool,
                          pieces: int, mask: Optional[Tensor] = None, v_out: Optional[Tensor] = None,
                          pool: Optional[CPUAttentionPool] = None, **branch) -> HostSelection:
    """:func:`host_branch` over ``pieces`` slices of the batch, pipelined on the pool's threads.

    Each thread takes the next batch slice and runs every stage on it (scan, selection,
    exact re-rank, gather) with its kernels inline, so one thread's memory-bound scan overlaps
    another's compute-bound selection, and a slice's logits are still in cache when its
    selection reads them. Every row's result is the serial branch's (the stages are per
    (batch, head) row). Shapes and ``branch`` (backend, precision, oversample, ...) as
    :func:`host_branch`; a sketch is not split (the serial branch runs). Stage times are summed
    over the slices (thread-seconds).
    """
    B = q.shape[0]
    pieces = min(int(pieces), B)
    if pieces <= 1 or branch.get("sketch") is not None or (v_out is not None and not v_out.is_contiguous()):
        return host_branch(q, keys, values, scale, k, per_head, mask=mask, v_out=v_out, pool=pool, **branch)
    from hybridgen.attention.cpu_pool import inline_pool

    bounds = [B * i // pieces for i in range(pieces + 1)]
    k = max(0, min(k, keys.shape[2]))
    row = (q.shape[1] if per_head else keys.shape[1]) * k * values.shape[-1]  # V elements per batch row
    flat_out = v_out.reshape(-1) if v_out is not None else torch.empty(B * row, dtype=values.dtype)

    def piece(lo: int, hi: int):
        m = mask[lo:hi] if mask is not None and mask.shape[0] == B else mask
        return lambda: host_branch(q[lo:hi], keys[lo:hi], values[lo:hi], scale, k, per_head, mask=m,
                                   v_out=flat_out[lo * row:hi * row], pool=inline_pool(), **branch)

    parts = (pool or default_pool()).run_each([piece(bounds[i], bounds[i + 1]) for i in range(pieces)])
    cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return HostSelection(cat("idx"), cat("logits"), flat_out[:B * row].view(B, -1, k, values.shape[-1]),
                         cat("k_rows"), cat("mask"), parts[0].exact,
                         *(sum(getattr(p, f) for p in parts) for f in ("scan_s", "topk_s", "gather_s")),
                         recompute_s=sum(p.recompute_s for p in parts))


def scan_precision(scan: str, dtype: torch.dtype) -> str:
    """The precision HybridGen's ``scan`` choice scans keys of ``dtype`` at: 'bf16dot' only for
    bf16 keys; keys of any other dtype are scanned 'exact' (the bf16-dot products need bf16
    keys: fp32 keys would need a converted copy, one more pass over them that saves nothing
    (the fp32 scan reads the same bytes), and fp16 keys are scanned by torch)."""
    return "bf16dot" if scan == "bf16dot" and dtype == torch.bfloat16 else "exact"


def sketch_scan(q: Tensor, keys: Tensor, scale: float, sketch: KeySketch, offset: int, buf: Tensor, backend: str,
                pool: Optional[CPUAttentionPool], precision: str = "exact") -> Tuple[Tensor, Optional[Tensor]]:
    """Selection logits of ``keys`` [B, Hkv, T, D] (tokens ``offset`` onwards of the sketch's
    segment) into ``buf`` (B*Hq*T floats): the sketch's tokens from its codes, the tail it does
    not hold yet (the last, partial block) from the keys at ``precision``. Returns (logits [B, Hq, T],
    block statistics [B*Hkv, blocks, G, 2] of both parts, or None)."""
    B, Hq = q.shape[0], q.shape[1]
    T = keys.shape[2]
    ts = max(0, min(T, sketch.length - offset))  # tokens the sketch holds
    logits = buf.view(B, Hq, T)
    stats = None
    if ts:
        _, stats = sketch.scan_stats(q, scale, offset, offset + ts, out=buf, pool=pool, row=T)
    if ts < T:
        tail, _, tail_stats = scan_logits_stats(q, keys[:, :, ts:], scale, None, backend, pool=pool,
                                                precision=precision)
        logits[:, :, ts:] = tail
        stats = None if (ts and stats is None) or tail_stats is None else (
            tail_stats if stats is None else torch.cat([stats, tail_stats], dim=1))
    return logits, stats


def masked_heads(logits: Tensor, sel_mask: Optional[Tensor]) -> Tensor:
    """logits [B, Hq, k] with -inf where sel_mask [B, Hsel, k] (Hsel = Hq or Hkv) is False."""
    if sel_mask is None:
        return logits
    m = sel_mask if sel_mask.shape[1] == logits.shape[1] else sel_mask.repeat_interleave(
        logits.shape[1] // sel_mask.shape[1], dim=1)
    return logits.masked_fill(~m, NEG_INF)


def rerank(cand_logits: Tensor, cand: Tensor, k: int, how: str, scan_logits: Optional[Tensor] = None,
           stats: Optional[Tensor] = None, approx: Optional[Tensor] = None,
           pool: Optional[CPUAttentionPool] = None) -> Tuple[Tensor, Tensor]:
    """Keep the k best of kc candidates by their exact logits: :func:`rerank_exact` with the
    key sketch's argument order (cand_logits [B, Hq, kc] exact, cand [B, Hsel, kc] ascending;
    approx, the candidates' sketch logits, corrects each head's logsumexp when given)."""
    return rerank_exact(cand_logits, approx, cand, k, how, scan_logits, stats, pool=pool)


def topk_count(ratio: float, host_tokens: int, minimum: int = 1, streamed: int = 0) -> int:
    """Tokens to select among ``host_tokens`` scanned ones: ceil(ratio * (n + streamed)), at least
    ``minimum``, at most n. ``streamed``: host tokens the three-way split attends exactly beside the
    selection; they count, so streaming only adds exact tokens to what the plain split selects."""
    if host_tokens <= 0:
        return 0
    return min(host_tokens, max(minimum, int(math.ceil(ratio * (host_tokens + streamed) - 1e-9))))
