"""Recall of the exact top-k by the CPU branch's selections, for ``bench_cpu_scan.py``.

Shapes: q [B, Hq, D] float32; keys [B, Hkv, T, D] bf16 (Hq = G * Hkv); k tokens per
(batch, KV head), shared selection, group score ``max``; recall = the share of the exact scan's
top-k that a selection keeps. "Real-like" keys: a few large channels and ~2% of tokens aligned
with the group's mean query, as in LLM caches.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from hybridgen.attention.cpu_select import select_bf16dot
from hybridgen.attention.key_sketch import KeySketch
from hybridgen.hybrid import HybridGen
from hybridgen.hybrid.host_branch import host_branch, pipelined_host_branch, scan_precision
from hybridgen.kv import TieredStore

DEFAULT = HybridGen()  # the default whose CPU branch ``default branch`` times, over the host keys given it


def real_like_keys(B: int, H: int, T: int, D: int, q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Keys with a few large channels and ~2% of tokens aligned with the group's mean query."""
    ch = torch.ones(D)
    ch[torch.randperm(D, generator=gen)[:4]] = 6.0
    k = torch.randn(B, H, T, D, generator=gen) * ch
    G = q.shape[1] // H
    qm = q.view(B, H, G, D).mean(dim=2)
    hit = torch.rand(B, H, T, generator=gen) < 0.02
    k += hit[..., None] * (2.0 * qm[:, :, None, :] / qm.norm(dim=-1, keepdim=True)[..., None] * D ** 0.5 * 0.3)
    return k


def recall(q: torch.Tensor, keys: torch.Tensor, kind: str, k: int, store: TieredStore, oversample: float) -> float:
    """Share of the exact top-k (shared selection, max group score) that the sketch's selection keeps."""
    B, H, T, D = keys.shape
    sk = KeySketch(store["dram"], kind, B, H, D, T, "bench/recall")
    sk.sync(keys)
    scale = D ** -0.5
    ex = host_branch(q, keys, keys, scale, k, per_head=False, backend="auto")
    sel = host_branch(q, keys, keys, scale, k, per_head=False, sketch=sk, oversample=oversample)
    sk.release()
    hits = 0
    for b in range(B):
        for h in range(H):
            a = set(ex.idx[b, h].tolist())
            hits += len(a & set(sel.idx[b, h].tolist()))
    return hits / (B * H * k)


def recall_bf16dot(q: torch.Tensor, keys: torch.Tensor, k: int, oversample: float) -> float:
    """Share of the exact top-k (shared selection, max group score) that :func:`select_bf16dot` keeps."""
    scale = keys.shape[-1] ** -0.5
    ex = host_branch(q, keys, keys, scale, k, per_head=False, backend="auto").idx
    got = select_bf16dot(q, keys, scale, k, oversample=oversample)[0]
    return (ex.unsqueeze(-1) == got.unsqueeze(-2)).any(-1).float().mean().item()


def default_branch(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, k: int, m: HybridGen = DEFAULT,
                   sketch: Optional[KeySketch] = None, **kw):
    """The CPU branch of ``hybridgen`` at its defaults (:data:`DEFAULT`, or ``m``) over bf16 keys
    [B, Hkv, T, D]: what ``HybridGen._cpu_task`` runs for a layer scanned with the true query;
    ``sketch``: the synced key sketch of these keys its ``key_sketch`` scans (None when it is 'none')."""
    if (sketch is None) != (m.key_sketch == "none"):
        raise ValueError(f"key_sketch={m.key_sketch!r} needs {'no' if m.key_sketch == 'none' else 'a'} synced sketch")
    return pipelined_host_branch(q, keys, vals, keys.shape[-1] ** -0.5, k, m.per_head, m.branch_pieces,
                                 backend=m.scan_backend, topk_backend=m.topk_backend, group_score=m.group_score,
                                 precision=scan_precision(m.scan, keys.dtype), sketch=sketch,
                                 oversample=m.scan_oversample if sketch is None else m.sketch_oversample, **kw)


def recall_default(q: torch.Tensor, keys: torch.Tensor, k: int, store: TieredStore) -> float:
    """Share of the exact scan's top-k (shared selection, max group score) that :func:`default_branch` keeps."""
    ex = host_branch(q, keys, keys, keys.shape[-1] ** -0.5, k, per_head=False, backend="auto").idx
    sk = None
    if DEFAULT.key_sketch != "none":
        sk = KeySketch(store["dram"], DEFAULT.key_sketch, *keys.shape[:2], keys.shape[-1], keys.shape[2], "bench/default")
        sk.sync(keys)
    got = default_branch(q, keys, keys, k, sketch=sk).idx
    if sk is not None:
        sk.release()
    return (ex.unsqueeze(-1) == got.unsqueeze(-2)).any(-1).float().mean().item()


def recall_table(q: torch.Tensor, keys: torch.Tensor, real_like: torch.Tensor, k: int, store: TieredStore,
                 sketches: List[str], oversample: float, bf16dot_oversample: float) -> Dict[str, float]:
    """{'<kind>@<oversample>_random' / '_real_like': recall} of each sketch's selection alone and
    re-ranked, of :func:`select_bf16dot`, and of the default branch ('default_random',
    'default_real_like'), on ``keys`` (random) and ``real_like`` [B, Hkv, T, D] bf16."""
    rec: Dict[str, float] = {}
    for kind in sketches:
        for o in sorted({1.0, oversample}):
            rec[f"{kind}@{o:g}_random"] = recall(q, keys, kind, k, store, o)
            rec[f"{kind}@{o:g}_real_like"] = recall(q, real_like, kind, k, store, o)
    for o in sorted({1.0, bf16dot_oversample}):
        rec[f"bf16dot@{o:g}_random"] = recall_bf16dot(q, keys, k, o)
        rec[f"bf16dot@{o:g}_real_like"] = recall_bf16dot(q, real_like, k, o)
    rec["default_random"] = recall_default(q, keys, k, store)
    rec["default_real_like"] = recall_default(q, real_like, k, store)
    return rec
