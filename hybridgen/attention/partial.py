"""Partial attention with log-sum-exp, exact LSE merging, and the one-softmax merge.

Shapes follow one convention throughout:
  q: [B, Hq, Tq, D]      k, v: [B, Hkv, T, D]      Hq = G * Hkv (GQA group size G)
GQA is handled by viewing q as [B, Hkv, G*Tq, D] so each key is read once per group; K/V
are never repeated in memory.

Masks are bool (True = attend) broadcastable to [B, Hkv, T].

Precision: logits are the matmul's output in the input dtype, then float32 (softmax, LSE and
the merge run in float32). For bf16 inputs the matmul rounds each logit to bf16, as the GPU
does; measured against float64 over the same bf16 values, outputs sit at a median ~3e-3 and
at most ~1e-2 relative error (300 random cases, tests/test_attention_partial.py); fp32 inputs
give ~1e-7. Upcasting K to fp32 would fix bf16 logits but triples the host partial's memory
traffic, so we do not.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

NEG_INF = float("-inf")


def _grouped(q: Tensor, num_kv_heads: int) -> Tensor:
    """[B, Hq, Tq, D] -> [B, Hkv, G*Tq, D] (a view when q is contiguous)."""
    B, Hq, Tq, D = q.shape
    return q.reshape(B, num_kv_heads, (Hq // num_kv_heads) * Tq, D)


def head_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` over 4-D operands [B, H, M, K] @ [B, H, K, N] -> [B, H, M, N].

    On the CPU in bf16 / fp16 with an operand whose batch dims are not packed (a KV segment's
    ``[:, :, :T]`` view of its capacity), torch's batched matmul leaves oneDNN's fast path:
    measured on this machine (1 thread, Llama-3.1-8B layer, 8,192 tokens) the logits' bf16
    matmul took 15.8 ms over the view against 4.1 ms over a contiguous copy, while one 2-D
    matmul per (sequence, head) over the same view took 4.3 ms. So that case runs per head;
    every other case (CUDA, fp32, packed operands) is one batched matmul, unchanged.
    """
    if a.is_cuda or a.dtype == torch.float32 or a.shape[:2] != b.shape[:2] or (a.is_contiguous() and _packed(b)):
        return torch.matmul(a, b)
    out = a.new_empty(a.shape[0], a.shape[1], a.shape[2], b.shape[3])
    for i in range(a.shape[0]):
        for h in range(a.shape[1]):
            torch.matmul(a[i, h], b[i, h], out=out[i, h])
    return out


def _packed(b: Tensor) -> bool:
    """Whether b [B, H, K, N] (or its last-two-dims transpose) is contiguous."""
    return b.is_contiguous() or b.transpose(-1, -2).is_contiguous()


def attention_logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled logits q·kᵀ for every query head.

    q: [B, Hq, Tq, D]; k: [B, Hkv, T, D]. Returns float32 [B, Hq, Tq, T].
    """
    B, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = _grouped(q, Hkv)
    logits = head_matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*Tq, T]
    return logits.reshape(B, Hq, Tq, T)


def _mask_logits(logits: Tensor, mask: Optional[Tensor], num_kv_heads: int) -> Tensor:
    """Apply a [B, Hkv, T]-broadcastable mask to logits [B, Hq, Tq, T]."""
    if mask is None:
        return logits
    B, Hq, Tq, T = logits.shape
    m = mask.expand(B, num_kv_heads, T)
    g = Hq // num_kv_heads
    view = logits.view(B, num_kv_heads, g, Tq, T)
    return view.masked_fill(~m[:, :, None, None, :], NEG_INF).view(B, Hq, Tq, T)


def partial_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention of q over one part of the KV, normalised within the part.

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, T, D] (T may be 0); mask: [B, Hkv, T]-broadcastable.
    Returns (out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] float32). A query that sees no
    key (T == 0 or all masked) has lse = -inf and out = 0, so it vanishes in a merge.
    """
    B, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    if T == 0:
        return q.new_zeros(B, Hq, Tq, D), q.new_full((B, Hq, Tq), NEG_INF, dtype=torch.float32)
    logits = _mask_logits(attention_logits(q, k, scale), mask, Hkv)  # [B, Hq, Tq, T] fp32
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hq, Tq]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse[..., None])  # masked -> exp(-inf) = 0
    probs_g = probs.to(v.dtype).reshape(B, Hkv, (Hq // Hkv) * Tq, T)
    out = head_matmul(probs_g, v).reshape(B, Hq, Tq, D)
    return out.to(q.dtype), lse


def merge_partials(parts: Sequence[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    """Exact merge of partial attentions over disjoint KV parts.

    parts: (out [B, Hq, Tq, D], lse [B, Hq, Tq]) each. Returns the (out, lse) of attention
    over the union: out = Σ_i exp(lse_i - lse) · out_i with lse = logsumexp_i lse_i.
    """
    if not parts:
        raise ValueError("merge_partials needs at least one part")
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse.float() for _, lse in parts])  # [P, B, Hq, Tq]
    total = torch.logsumexp(lses, dim=0)
    safe_total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.exp(lses - safe_total)  # all -inf -> 0
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts))
    return out.to(parts[0][0].dtype), total


def topk_per_group(logits: Tensor, k: int, num_kv_heads: int, per_head: bool = True) -> Tuple[Tensor, Tensor]:
    """Top-k selection of decode logits.

    logits: [B, Hq, 1, T] float32. per_head=True selects per query head and returns
    (values [B, Hq, 1, k], indices [B, Hq, k]). per_head=False selects per KV group by the
    group's summed logits, so one V row serves the whole group, and returns
    (values [B, Hq, 1, k] gathered for every head, indices [B, Hkv, k]).
    k is clamped to T.
    """
    B, Hq, Tq, T = logits.shape
    k = min(k, T)
    if per_head:
        vals, idx = torch.topk(logits, k, dim=-1, sorted=False)
        return vals, idx[:, :, 0, :]
    g = Hq // num_kv_heads
    group_score = logits.view(B, num_kv_heads, g, Tq, T).sum(dim=(2, 3))  # [B, Hkv, T]
    idx = torch.topk(group_score, k, dim=-1, sorted=False).indices  # [B, Hkv, k]
    idx_q = idx.repeat_interleave(g, dim=1)[:, :, None, :].expand(B, Hq, Tq, k)
    return torch.gather(logits, -1, idx_q), idx


def softmax_over_parts(parts: Sequence[Tuple[Tensor, Tensor]], num_kv_heads: int) -> Tensor:
    """ONE softmax over concatenated logits of several parts and one weighted sum of values.

    parts: (logits [B, Hq, Tq, Ti] float32, values) where values is either
    [B, Hkv, Ti, D] (shared by the query heads of a group) or [B, Hq, Ti, D] (one row set
    per query head, e.g. per-head top-k rows). Masked entries carry -inf logits.
    Returns [B, Hq, Tq, D] in the first values' dtype.
    """
    B, Hq, Tq, _ = parts[0][0].shape
    m = torch.stack([lg.amax(dim=-1) if lg.shape[-1] else lg.new_full((B, Hq, Tq), NEG_INF)
                     for lg, _ in parts]).amax(dim=0)  # [B, Hq, Tq]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    num = None
    den = torch.zeros(B, Hq, Tq, dtype=torch.float32, device=m.device)
    g = Hq // num_kv_heads
    for logits, values in parts:
        if logits.shape[-1] == 0:
            continue
        p = torch.exp(logits - m[..., None])  # [B, Hq, Tq, Ti]
        den = den + p.sum(dim=-1)
        if values.shape[1] == Hq:
            contrib = torch.matmul(p.to(values.dtype), values)
        else:
            ti = logits.shape[-1]
            pg = p.to(values.dtype).reshape(B, num_kv_heads, g * Tq, ti)
            contrib = head_matmul(pg, values).reshape(B, Hq, Tq, -1)
        num = contrib.float() if num is None else num + contrib.float()
    dtype = parts[0][1].dtype
    if num is None:
        D = parts[0][1].shape[-1]
        return torch.zeros(B, Hq, Tq, D, dtype=dtype, device=m.device)
    return (num / den.clamp_min(1e-30)[..., None]).to(dtype)
