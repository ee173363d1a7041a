"""The selection at the memory limit: a bf16-dot scan, over-selection, exact re-rank.

Shapes as :mod:`hybridgen.attention.cpu_scan`: q [B, Hq, D] or [B, Hq, 1, D]; keys
[B, Hkv, T, D] (a segment view, read in place); mask [B, Hkv, T] bool or None; Hq = G * Hkv.

:func:`select_bf16dot` (1) scans every host key with the bf16-dot scan
(:func:`~hybridgen.attention.cpu_scan.scan_logits_stats` ``precision='bf16dot'``: the query
rounded to bf16, bf16 x bf16 products, fp32 accumulation; AVX-512 BF16 ``vdpbf16ps`` where
the CPU has it), (2) selects ceil(oversample * k) candidates with the same group score as
the exact path (:func:`~hybridgen.attention.cpu_scan.select`), (3) recomputes the
candidates' logits exactly in fp32 from the keys in place
(:func:`~hybridgen.attention.cpu_scan.exact_logits_at`) and (4) keeps the k best by the same
group score over the exact logits (:func:`rerank_exact`: for ``how='max'`` each head is
normalised by the scan's logsumexp with the candidates' terms replaced by their exact ones,
so with every token a candidate it is the exact selection). What it returns is what
:func:`~hybridgen.attention.cpu_scan.select` returns for the exact scan: (idx, the exact
fp32 logits at idx).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Tuple

import torch
from torch import Tensor

from hybridgen.attention import native
from hybridgen.attention.cpu_pool import CPUAttentionPool, default_pool
from hybridgen.attention.cpu_scan import (NEG_INF, SELECT_HOW, exact_logits_at, gather_mask, group_scores,
                                          scan_logits_stats, select)
from hybridgen.errors import ConfigError

#: candidates per selected token, as the key sketch's ``sketch_oversample``
DEFAULT_OVERSAMPLE = 1.25


def candidate_count(k: int, oversample: float, tokens: int) -> int:
    """ceil(oversample * k) candidates, at most ``tokens``; oversample >= 1 (ConfigError otherwise)."""
    if not (isinstance(oversample, (int, float)) and math.isfinite(oversample) and oversample >= 1.0):
        raise ConfigError(f"oversample must be a number >= 1 (candidates per selected token), got {oversample!r}")
    return min(tokens, int(math.ceil(oversample * k - 1e-9)))


def head_lse(logits: Optional[Tensor], stats: Optional[Tensor], num_kv_heads: int) -> Tensor:
    """Each query head's logsumexp over the scanned tokens: [B, Hkv, G], from the scan's block
    statistics ([B*Hkv, nblk, G, 2] (max, sum exp)) when given, else from logits [B, Hq, T]
    (masked = -inf); 0 for a head with no finite logit (as the selection's group score)."""
    if stats is None:
        B, Hq, T = logits.shape
        lse = torch.logsumexp(logits.view(B, num_kv_heads, Hq // num_kv_heads, T), dim=-1)
    else:
        m, s = stats[..., 0], stats[..., 1]  # [B*Hkv, nblk, G]
        top = m.amax(dim=1, keepdim=True)
        safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        lse = (safe + torch.log((s * torch.exp(m - safe)).sum(dim=1, keepdim=True)))[:, 0]
        lse = lse.view(-1, num_kv_heads, stats.shape[2])
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def corrected_lse(lse: Tensor, approx: Tensor, exact: Tensor) -> Tensor:
    """A sketch's per-head logsumexp with the candidates' terms replaced by their exact ones.

    lse [B, Hkv, G] (over every scanned token, sketch logits); approx / exact [B, Hq, kc]: the
    candidates' sketch and exact logits. log(exp(lse) - sum exp(approx) + sum exp(exact)):
    the candidates carry most of the softmax mass, so this is close to the exact
    logsumexp that the exact scan's selection normalises each head by.
    """
    B, Hkv, G = lse.shape
    a = approx.view(B, Hkv, G, -1)
    e = exact.view(B, Hkv, G, -1)
    top = torch.maximum(lse, e.amax(dim=-1))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    rest = (torch.exp(lse - top) - torch.exp(a - top.unsqueeze(-1)).sum(dim=-1)).clamp_min(0.0)
    out = top + torch.log(rest + torch.exp(e - top.unsqueeze(-1)).sum(dim=-1))
    return torch.where(torch.isfinite(out), out, torch.zeros_like(out))


def rerank_exact(exact: Tensor, approx: Optional[Tensor], cand: Tensor, k: int, how: str,
                 scan_logits: Optional[Tensor], stats: Optional[Tensor],
                 pool: Optional[CPUAttentionPool] = None) -> Tuple[Tensor, Tensor]:
    """The k best of kc candidates by their exact logits, ranked by the selection's score.

    exact [B, Hq, kc]: the candidates' exact logits (-inf where masked); approx [B, Hq, kc]:
    their scan logits when the scan was approximate (a sketch, bf16 dots), else None; cand
    [B, Hsel, kc] token indices (Hsel = Hq: each head ranks its own); scan_logits [B, Hq, T]
    and/or stats [B*Hkv, nblk, G, 2]: the scan's, for each head's logsumexp (``how='max'``,
    corrected by :func:`corrected_lse` when ``approx`` is given).
    Returns (idx [B, Hsel, k], exact logits at idx [B, Hq, k]); the C kernel (``hg_select``,
    ties to the lower candidate) where it builds, else torch's top-k.
    """
    B, Hq, kc = exact.shape
    Hsel = cand.shape[1]
    G = Hq // Hsel
    use_lse = G > 1 and how == "max"
    lib = native.lib()
    if lib is not None and k > 0:
        lg = exact.contiguous()
        pos = torch.empty(B, Hsel, k, dtype=torch.int64)
        sel = torch.empty(B, Hq, k, dtype=torch.float32)
        st, nblk = (stats, stats.shape[1]) if use_lse and stats is not None else (None, 0)
        if use_lse and st is None:  # no statistics (a masked scan): one (max, sum) block per head, its lse
            lse = head_lse(scan_logits, None, Hsel)
            st, nblk = torch.stack([lse, torch.ones_like(lse)], dim=-1).view(B * Hsel, 1, G, 2), 1
        ap = approx.contiguous() if use_lse and approx is not None else None
        (pool or default_pool()).run_split(lib.hg_select, B * Hsel, lg.data_ptr(), kc, G,
                                           SELECT_HOW["raw" if G == 1 else how], k, pos.data_ptr(), sel.data_ptr(),
                                           st.data_ptr() if st is not None else None, nblk,
                                           ap.data_ptr() if ap is not None else None, work=B * Hq * kc)
        return cand.gather(2, pos), sel
    if G == 1:
        score = exact
    elif how == "sum":
        score = group_scores(exact, Hsel, "sum")
    else:
        lse = head_lse(scan_logits, stats, Hsel)
        if approx is not None:
            lse = corrected_lse(lse, approx, exact)
        score = (exact.view(B, Hsel, G, kc) - lse.unsqueeze(-1)).amax(dim=2)
    pos = torch.topk(score, k, dim=-1, sorted=False).indices
    return cand.gather(2, pos), exact.gather(2, pos.repeat_interleave(G, dim=1))


def _selection_args(q: Tensor, keys: Tensor, k: int, how: str, oversample: float) -> Tuple[Tensor, int, int]:
    """(q as [B, Hq, D], k clamped to [0, T], the candidates' count) of a bf16-dot selection;
    ConfigError for an unknown group score or an oversample below 1."""
    if how not in ("max", "sum"):
        raise ConfigError(f"unknown group score {how!r}; choose 'max' or 'sum'")
    if q.dim() == 4:
        q = q[:, :, 0]
    T = keys.shape[2]
    k = max(0, min(k, T))
    return q, k, candidate_count(k, oversample, T)


def select_bf16dot(q: Tensor, keys: Tensor, scale: float, k: int, per_head: bool = False, how: str = "max",
                   mask: Optional[Tensor] = None, oversample: float = DEFAULT_OVERSAMPLE, backend: str = "auto",
                   pool: Optional[CPUAttentionPool] = None, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Top-k host tokens by a bf16-dot scan re-ranked exactly; the drop-in for
    ``select(scan_logits_stats(q, keys, scale, mask)...)`` at the memory limit.

    q [B, Hq, D] or [B, Hq, 1, D]; keys [B, Hkv, T, D] (CPU, read in place); k tokens per
    (batch, KV head) (shared, ``how`` 'max'/'sum') or per query head (``per_head``);
    mask [B, Hkv, T] or None; oversample >= 1: ceil(oversample * k) candidates re-ranked by
    exact fp32 logits; out: optional float32 scratch of B*Hq*T elements for the scan's logits
    (reused across calls: no fresh allocation and its page faults per layer). Returns (idx [B, Hsel, k] int64, logits [B, Hq, k] float32: exact
    fp32 logits of q at idx, -inf where masked); Hsel = Hq (per_head) or Hkv.
    """
    q, k, kc = _selection_args(q, keys, k, how, oversample)
    Hq, Hkv = q.shape[1], keys.shape[1]
    logits, _, stats = scan_logits_stats(q, keys, scale, mask, backend, out, pool, precision="bf16dot")
    cand, approx = select(logits, Hkv, kc, per_head, how, pool=pool, stats=stats)
    if k == 0:
        return cand, approx
    exact = exact_logits_at(q, keys, cand, scale, pool=pool)
    if mask is not None:
        m = gather_mask(mask, cand)
        exact = exact.masked_fill(~m.repeat_interleave(Hq // m.shape[1], dim=1), NEG_INF)
    return rerank_exact(exact, approx, cand, k, how, logits, stats, pool=pool)


def fused_branch_fits(q: Tensor, keys: Tensor, values: Tensor, k: int, per_head: bool, mask: Optional[Tensor],
                      backend: str = "auto", topk_backend: str = "auto") -> bool:
    """True when :func:`fused_branch` runs this branch: the C kernels built, bf16 keys and
    values the C scan fits (one value row per key), shared selection, no mask, k > 0, the
    native scan and top-k."""
    from hybridgen.attention.cpu_scan import native_fits, resolve_backend

    Hq, Hkv, D = q.shape[1], keys.shape[1], keys.shape[-1]
    return (native.lib() is not None and not per_head and mask is None and k > 0 and keys.shape[2] > 0
            and keys.dtype == torch.bfloat16 and values.dtype == torch.bfloat16
            and values.shape[:2] == keys.shape[:2] and values.shape[2] >= keys.shape[2] and values.shape[-1] == D
            and Hq % Hkv == 0 and native_fits(keys.dtype, Hq // Hkv, D)
            and resolve_backend(backend, keys.dtype) == "native" and topk_backend in ("auto", "native"))


#: the fused branch runs one (batch, KV head) row per thread at a time; below this share of the
#: threads' time busy (rows / (threads * rounds of rows)) the stagewise branch, whose scan splits
#: every row's tokens over all threads, is faster. Measured on the 2-core VM (2 threads, bf16,
#: 8.4M host keys split into the rows, top-k 5%, medians of 9 rounds): 1 row (share 0.5) fused
#: 5.9 ms, stagewise 4.7; 3 rows (0.75) 4.5 against 4.8; 5 rows (0.83) 4.7 against 5.5; 8 rows
#: 4.1 against 5.1. Not measured on a many-core host.
FUSED_MIN_BUSY_SHARE = Fraction(2, 3)


def fused_branch_pays(rows: int, threads: int) -> bool:
    """True when the fused branch keeps ``threads`` busy enough over ``rows`` rows (at least
    :data:`FUSED_MIN_BUSY_SHARE` of their time): e.g. 64 rows on 15 threads (0.85) or 3 on 2
    (0.75); not 8 rows on 15 threads (0.53) or 1 on 2 (0.5). One thread: always."""
    threads, rows = max(1, int(threads)), int(rows)
    if threads == 1 or rows <= 0:
        return True
    rounds = -(-rows // threads)
    return Fraction(rows, threads * rounds) >= FUSED_MIN_BUSY_SHARE


def fused_branch(q: Tensor, keys: Tensor, values: Tensor, scale: float, k: int, how: str = "max",
                 oversample: float = DEFAULT_OVERSAMPLE, v_out: Optional[Tensor] = None,
                 pool: Optional[CPUAttentionPool] = None, sketch=None,
                 sketch_offset: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The approximate selection (a bf16-dot scan, or a key sketch's scan), its exact re-rank
    and the V-row gather fused per (batch, KV head) row (``csrc/branch.c``: a row's scan logits
    stay in this thread's cache for its selection, its candidates' keys for their exact logits):
    the same idx, logits and V rows as the stages run one after another over every row
    (:func:`select_bf16dot`, or ``host_branch`` with the sketch), bit for bit.

    q [B, Hq, D] or [B, Hq, 1, D]; keys / values [B, Hkv, T, D] bf16 (segment views, read in
    place); k tokens per (batch, KV head), shared selection by ``how``; v_out: optional
    contiguous buffer of >= B*Hkv*k*D bf16 (e.g. the pinned staging buffer); sketch: a synced
    :class:`~hybridgen.attention.key_sketch.KeySketch` of the keys' segment, ``keys`` being its
    tokens ``sketch_offset`` onwards (the keys past what it holds are bf16-dot scanned). Only
    where :func:`fused_branch_fits`. Returns (idx [B, Hkv, k] int64, exact logits [B, Hq, k]
    float32, V rows [B, Hkv, k, D], seconds [4]: scan, selection, exact logits + re-rank,
    gather, summed over rows and divided by the threads that ran them).
    """
    from hybridgen.attention.cpu_scan import SELECT_HOW, TOKEN_BLOCK, rows_view

    q, k, kc = _selection_args(q, keys, k, how, oversample)
    B, Hq, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    qx = q.float().reshape(B * Hkv, G, D).contiguous()
    qb = q.to(torch.bfloat16).float().reshape(B * Hkv, G, D).contiguous()
    kr, kcap = rows_view(keys)
    vr, vcap = rows_view(values)
    rows = B * Hkv
    if v_out is not None and (not v_out.is_contiguous() or v_out.numel() < rows * k * D or v_out.dtype != values.dtype):
        raise ValueError(f"v_out must be a contiguous {values.dtype} buffer of >= {rows * k * D} elements")
    idx = torch.empty(B, Hkv, k, dtype=torch.int64)
    sel = torch.empty(B, Hq, k, dtype=torch.float32)
    dst = v_out.view(-1)[:rows * k * D] if v_out is not None else torch.empty(rows * k * D, dtype=values.dtype)
    seconds = torch.full((rows, 4), float("nan"), dtype=torch.float64)
    pool = pool or default_pool()
    work = rows * G * T * D
    # rows a few at a time, claimed by whichever thread is free: about 4 claims per thread, so a
    # slowed or late thread leaves its rows to the others (1 row per claim on a many-core host)
    grain = max(1, rows // (4 * pool.split_threads))
    if sketch is None:
        codes = (0, 0, 0, 0, 0, 0, 0, 0)
    else:
        from hybridgen.attention.key_sketch import SKETCH_BLOCK

        if (sketch.codes.shape[:2] != keys.shape[:2] or sketch.D != D or sketch_offset < 0
                or not (sketch.codes.is_contiguous() and sketch.params.is_contiguous())):
            raise ValueError(f"the key sketch holds rows {tuple(sketch.codes.shape[:2])} of head dim {sketch.D}, "
                             f"the keys {tuple(keys.shape[:2])} of {D} (offset {sketch_offset}); it must match "
                             f"and be contiguous")
        ts = max(0, min(T, sketch.length - sketch_offset))  # tokens the sketch holds
        codes = (sketch.codes.data_ptr(), sketch.codes.shape[2], sketch.params.data_ptr(), sketch.params.shape[2],
                 SKETCH_BLOCK, sketch.bits, sketch_offset, ts)
    pool.run_split(native.lib().hg_branch, rows, qb.data_ptr(), qx.data_ptr(), kr.data_ptr(), vr.data_ptr(),
                   kcap, vcap, *codes, float(scale), T, D, G, TOKEN_BLOCK, SELECT_HOW["raw" if G == 1 else how], k, kc,
                   idx.data_ptr(), sel.data_ptr(), dst.data_ptr(), seconds.data_ptr(), work=work, grain=grain)
    if torch.isnan(seconds).any():
        raise MemoryError("the fused CPU branch could not allocate its per-thread scratch")
    threads = min(pool.threads_for(work), rows)  # as run_split splits
    return idx, sel, dst.view(B, Hkv, k, D), seconds.sum(dim=0) / max(1, threads)
