"""HybridGen's CPU branch for one layer: scan the host keys, take the top-k, gather the rows.

Built from the scan API of :mod:`hybridgen.attention.cpu_scan`. Shapes: q [B, Hq, D] or
[B, Hq, 1, D] (on the host); keys/values [B, Hkv, T, D] (segment views, read in place);
mask [B, Hkv, T] bool or None; Hq = G * Hkv. Shared selection (``per_head=False``) picks k
tokens per (batch, KV head), ranked by :func:`~hybridgen.attention.cpu_scan.group_scores`
(one V row serves the whole group: Hsel = Hkv); per-head selection picks k per query head
(Hsel = Hq).

Steps: (1) scan: exact logits of every host key (``backend``), or, with a
:class:`~hybridgen.attention.key_sketch.KeySketch`, approximate logits from the sketch's
int8/int4 codes (fewer bytes per key); (2) selection:
:func:`~hybridgen.attention.cpu_scan.select` (group score + partial top-k + the selected
logits in one pass per row); (3) with a sketch, the selected rows' logits are recomputed
exactly from the full-precision keys (:func:`~hybridgen.attention.cpu_scan.exact_logits_at`,
read in place; fusing it with the V gather measured slower: 37 vs 33 ms at batch 8 x 32K);
(4) gather of the V rows (into ``v_out``, e.g. a pinned staging buffer).
The scan's [B, Hq, T] logits go to a per-thread scratch buffer reused across calls (no
fresh 30+ MB allocation, and its page faults, per layer).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.attention.cpu_scan import NEG_INF, exact_logits_at, gather_mask, gather_rows, scan_logits_stats, select
from hybridgen.attention.key_sketch import KeySketch


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
                sketch: Optional[KeySketch] = None, sketch_offset: int = 0) -> HostSelection:
    """Scan + top-k + gather over one layer's host KV.

    q [B, Hq, D] or [B, Hq, 1, D] (CPU); keys/values [B, Hkv, T, D]; k tokens per
    (batch, KV head) (shared) or per (batch, query head) (per_head), clamped to T.
    v_out: optional buffer (e.g. pinned) the V rows are gathered into.
    pool: whose threads run the kernels' slices (default: the default pool).
    sketch: scan this (already synced) key sketch for the selection instead of ``keys``;
    ``keys`` are token ``sketch_offset`` onwards of the sketch's segment. The returned logits
    are then recomputed exactly from ``keys`` (``exact`` True).
    """
    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq = q.shape[0], q.shape[1]
    Hkv, T = keys.shape[1], keys.shape[2]
    k = max(0, min(k, T))
    buf = scratch_logits(B * Hq * T)
    t0 = time.perf_counter()
    if sketch is not None:
        logits, stats = sketch.scan_stats(q, scale, sketch_offset, sketch_offset + T, out=buf, pool=pool)
        if mask is not None:
            G = Hq // Hkv
            logits.view(B, Hkv, G, T).masked_fill_(~mask.expand(B, Hkv, T)[:, :, None, :], NEG_INF)
            stats = None  # the block statistics saw the masked tokens
        exact = True
    else:
        logits, exact, stats = scan_logits_stats(q, keys, scale, mask, backend, out=buf, pool=pool)
    t1 = time.perf_counter()
    idx, sel_logits = select(logits, Hkv, k, per_head, group_score, topk_backend, pool=pool,
                             stats=stats)  # [B, Hsel, k]
    t2 = time.perf_counter()
    if sketch is not None:
        sel_logits = exact_logits_at(q, keys, idx, scale, pool=pool)
    t3 = time.perf_counter()
    v_rows = gather_rows(values, idx, out=v_out, pool=pool)
    k_rows = gather_rows(keys, idx, pool=pool) if keep_keys else None
    sel_mask = gather_mask(mask, idx)
    if sketch is not None and sel_mask is not None:
        m = sel_mask if sel_mask.shape[1] == Hq else sel_mask.repeat_interleave(Hq // sel_mask.shape[1], dim=1)
        sel_logits = sel_logits.masked_fill(~m, NEG_INF)
    t4 = time.perf_counter()
    return HostSelection(idx, sel_logits, v_rows, k_rows, sel_mask, exact, t1 - t0, t2 - t1, t4 - t3,
                         recompute_s=t3 - t2)


def topk_count(ratio: float, host_tokens: int, minimum: int = 1) -> int:
    """Tokens to select for a ratio of the host tokens: ceil(ratio * n), at least ``minimum``, at most n."""
    if host_tokens <= 0:
        return 0
    return min(host_tokens, max(minimum, int(math.ceil(ratio * host_tokens - 1e-9))))
