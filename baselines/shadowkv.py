"""ShadowKV: low-rank pre-RoPE keys and chunk landmarks on the GPU, values on the host.

Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference",
ICML 2025. At prefill the pre-RoPE keys of the prompt are factorised by a truncated SVD
(rank 160 for Llama-3-8B) and only the factors stay on the GPU; the values go to host memory.
The prompt is cut into chunks of 8 tokens; each chunk's *landmark* is the mean of its post-RoPE
keys. Chunks whose keys are least like their landmark (lowest cosine similarity) are
*outliers*, kept exactly on the GPU with their values, as is a local window of the last chunks.
At each decode step the query scores the landmarks on the GPU, the top chunks (the sparse
budget, 1.56% of the context in the paper: 2048 tokens at 128K) are selected, only their
values are fetched from the host, their keys are rebuilt from the factors and rotated to their
positions, and attention is exact over [selected chunks + outliers + local window + generated
tokens] (one softmax).

Paper / reference defaults kept here: rank 160, chunk 8, local window 4 chunks, outlier chunks
= (budget // 1024) * 24 per KV head at budget 2048 (48 chunks = 0.1875 of the budget's chunks:
``outlier_ratio``), landmark scoring by softmax(q . landmark * scale) per query head, reduced
by the MAX over each KV group's heads, top chunks per KV head; the SVD is per sequence over the
keys of all KV heads together ([T, Hkv*D]), U [T, r] shared by the heads and S V^T split per
head ([Hkv, r, D]).

Choices where the paper is silent (or which we adapt):
- the engine hands keys with rotary applied; the pre-RoPE keys are recovered by the exact
  inverse of the engine's map through its own cos/sin values (:func:`unrotate`: divide by
  cos^2 + sin^2 of the values the forward rotation used), not by rotating by -positions;
- learned positions (OPT, ``ctx.rotary`` None): the keys carry no rotation, they are factorised
  as they are and rebuilt keys are attended as they are;
- the SVD covers only the chunked part of the prompt (tokens [0, C*8), C = T // 8 - local
  chunks, outlier chunks included): the local window (the last 4 chunks + the T mod 8 tail) is
  exact on the GPU and never rebuilt; the effective rank is min(rank, C*8, Hkv*D) (at full rank
  the reconstruction is exact up to rounding); factors are stored in the model dtype;
- ``budget`` is the number of tokens fetched per step (selected chunks x 8), resolved against
  the padded prompt length T (the selectable chunks are the prompt's); it counts neither the
  outliers, the local window nor the generated tokens, which are always attended;
  selected chunks = max(1, budget // 8), at most the non-outlier chunks; outlier chunks =
  floor(outlier_ratio x selected-chunk budget), at most C;
- generated tokens are appended exactly (post-RoPE K and V) to the GPU local window and never
  factorised (the prompt's factorisation is not updated during decoding);
- the host keeps the values of the chunked part (outlier chunks' included, so a chunk id is a
  row offset); selected values are gathered on the host into a staging buffer on the host tier
  and copied into a gpu-tier fetch buffer (synchronously: no cross-layer prefetch);
- left padding: padded keys are zeroed before the SVD and left out of landmarks and cosine
  similarities; an all-padding chunk is never an outlier and never selected unless the budget
  exceeds the real chunks (its tokens are masked);
- under one GPU memory budget (``placement_for``) nothing is derived: the gpu tier holds what
  its footprint counts (:func:`gpu_layout`: the ledger's bytes, masks included), or the method
  is refused;
- the projected cost (:func:`baselines.shadowkv_cost.shadowkv_cost`) follows the code: scoring, the ids down, the host
  gather, the copy up, the key rebuild and attention one after the other;
- stats: 'bytes_h2d' = fetched value rows (B x Hkv x selected tokens x D x bytes), 'bytes_d2h'
  = prompt values written to the host + the selected chunk ids sent to it, 'fetched_tokens'
  = tokens fetched per KV head, summed over layer-steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, FrozenSet, List, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.methods.tensors import NEG_INF, gather_mask, gather_tokens, needs_mask
from hybridgen.methods.tiered import TieredMethod, TierBuffer
from hybridgen.attention import attention_logits, softmax_over_parts
from hybridgen.kv import KVSegment
from hybridgen.methods import Budget, Fraction, HostTier, KeptBudget, MethodContext, NonNegInt, PositiveInt
from hybridgen.model.rotary import rotate_half


# ----------------------------------------------------------------------------- rotary
def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def unrotate(rotary, x: Tensor, positions: Tensor) -> Tensor:
    """The pre-RoPE keys of keys ``x`` [B, H, T, D] rotated by ``rotary.rotate(x, positions)``.

    positions [B, T]. Uses the same cos/sin values (cast to x's dtype as the forward map does) and
    the exact inverse of that 2x2 map, (y c - rot_half(y) s) / (c^2 + s^2), in float64 for
    float64 input, else float32. Returns the work dtype (not cast back)."""
    work = _work_dtype(x.dtype)
    cos, sin = rotary.cos_sin(positions)
    c, s = cos.to(x.dtype).to(work).to(x.device), sin.to(x.dtype).to(work).to(x.device)
    y = x.to(work)
    return (y * c - rotate_half(y) * s) / (c * c + s * s)


def rotate_per_head(rotary, x: Tensor, positions: Tensor) -> Tensor:
    """x [B, H, n, D] rotated with per-head positions [B, H, n] (the engine's rotation)."""
    B, H, n, D = x.shape
    return rotary.rotate(x.reshape(B * H, 1, n, D), positions.reshape(B * H, n)).reshape(B, H, n, D)


# ----------------------------------------------------------------------------- prefill pieces
def low_rank_keys(k_pre: Tensor, rank: int):
    """Truncated SVD of pre-RoPE keys across heads. k_pre [B, H, T, D] (padding zeroed).

    Returns (U [B, T, r], SV [B, H, r, D]) with K[b, h, t] = U[b, t] @ SV[b, h], r = min(rank, T, H*D)."""
    B, H, T, D = k_pre.shape
    flat = k_pre.to(_work_dtype(k_pre.dtype)).permute(0, 2, 1, 3).reshape(B, T, H * D)
    u, s, vh = torch.linalg.svd(flat, full_matrices=False)
    r = min(rank, s.shape[-1])
    sv = (s[:, :r, None] * vh[:, :r]).reshape(B, r, H, D).permute(0, 2, 1, 3)
    return u[:, :, :r], sv


def chunk_landmarks(k: Tensor, valid: Optional[Tensor], chunk: int):
    """Landmarks of post-RoPE keys k [B, H, C*chunk, D]; valid [B, C*chunk] or None.

    Returns (landmark [B, H, C, D] = mean of the chunk's real keys, min_cos [B, H, C] = the
    lowest cosine similarity of a real key with its landmark (+inf for an all-padding chunk),
    real [B, C] bool: the chunk has a real token)."""
    B, H, T, D = k.shape
    C = T // chunk
    kc = k.to(_work_dtype(k.dtype)).reshape(B, H, C, chunk, D)
    m = torch.ones(B, C, chunk, dtype=torch.bool, device=k.device) if valid is None else valid.reshape(B, C, chunk)
    mf = m[:, None, :, :, None].to(kc.dtype)
    count = mf.sum(dim=3).clamp(min=1)
    lm = (kc * mf).sum(dim=3) / count
    cos = torch.nn.functional.cosine_similarity(kc, lm[:, :, :, None, :].expand_as(kc), dim=-1)
    cos = cos.masked_fill(~m[:, None], math.inf).amin(dim=-1)
    return lm, cos, m.any(dim=-1)


def chunk_tokens(chunks: Tensor, chunk: int) -> Tensor:
    """Token indices [B, H, n*chunk] of chunk ids [B, H, n]."""
    return (chunks[..., None] * chunk + torch.arange(chunk, device=chunks.device)).flatten(2)


def plan_chunks(prompt: int, kv_dims: int, budget_tokens: int, rank: int, chunk: int, local_chunks: int,
                outlier_ratio: float) -> Tuple[int, int, int, int]:
    """(C chunks, O outlier chunks, selected chunks, effective rank) for a padded prompt of
    ``prompt`` tokens, Hkv*D = ``kv_dims`` and a fetch budget of ``budget_tokens`` (the
    effective rank assumes full-rank keys)."""
    C = max(0, prompt // chunk - local_chunks)
    budget_chunks = max(1, budget_tokens // chunk)
    O = min(C, int(math.floor(outlier_ratio * budget_chunks)))
    return C, O, min(budget_chunks, C - O), min(rank, C * chunk, kv_dims) if C else 0


def gpu_layout(plan: Tuple[int, int, int, int], chunk: int, batch: int, kv_heads: int, head_dim: int,
               dtype_bytes: int, prompt: int, new_tokens: int, masked: bool) -> Tuple[int, int]:
    """(bytes per layer, shared bytes) the method allocates on the gpu tier (what the ledger
    counts): per layer U, S V^T, landmarks + chunk ids, exact outlier and local K/V (+ masks
    when ``masked``); shared: positions (+ validity) and the two fetch buffers."""
    C, O, n_sel, r = plan
    b, B, H, D, T = dtype_bytes, batch, kv_heads, head_dim, prompt
    exact = O * chunk + T - C * chunk + new_tokens  # outlier + local tokens per (row, head)
    per_layer = (B * C * chunk * r + B * H * r * D) * b + B * H * (C - O) * (D * b + 8) + 2 * B * H * exact * D * b
    shared = B * T * 8 + 2 * B * H * n_sel * chunk * D * b
    if masked:
        per_layer += B * H * ((C - O) + exact)
        shared += B * T
    return per_layer, shared


def _masked(logits: Tensor, mask: Optional[Tensor]) -> Tensor:
    """logits [B, Hq, 1, n] with -inf where mask [B, Hkv, n] is False."""
    if mask is None:
        return logits
    B, Hq, Tq, n = logits.shape
    Hkv = mask.shape[1]
    return logits.view(B, Hkv, Hq // Hkv, Tq, n).masked_fill(~mask[:, :, None, None, :], NEG_INF).view_as(logits)


@dataclass
class ShadowKV(TieredMethod):
    """Low-rank pre-RoPE keys + landmarks + outliers + local window on gpu, values on the host.

    budget: tokens fetched per step (paper: 1.56%, 2048 at 128K). rank: SVD rank of the
    pre-RoPE keys across heads (160). chunk_size: tokens per chunk (8). local_chunks: last
    chunks of the prompt kept exact on the GPU (4). outlier_ratio: outlier chunks per KV head as
    a fraction of the selected chunks (0.1875: 48 at budget 2048). host_tier: where values live.
    """

    name: ClassVar[str] = "shadowkv"
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"host_tier"})
    budget: KeptBudget = Budget(ratio=0.015625)
    rank: PositiveInt = 160
    chunk_size: PositiveInt = 8
    local_chunks: NonNegInt = 4
    outlier_ratio: Fraction = 0.1875
    host_tier: HostTier = "dram"

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.u: List[Optional[TierBuffer]] = [None] * L         # [B, Tc, r]
        self.sv: List[Optional[TierBuffer]] = [None] * L        # [B, Hkv, r, D]
        self.landmarks: List[Optional[TierBuffer]] = [None] * L  # [B, Hkv, C - O, D]
        self.landmark_ids: List[Optional[TierBuffer]] = [None] * L  # chunk id of each landmark [B, Hkv, C - O]
        self.landmark_real: List[Optional[TierBuffer]] = [None] * L  # [B, Hkv, C - O] bool (padding only)
        self.outliers: List[Optional[KVSegment]] = [None] * L
        self.local: List[Optional[KVSegment]] = [None] * L
        self.values: List[Optional[TierBuffer]] = [None] * L    # host [B, Hkv, Tc, D]
        self.last_chunks: List[Optional[Tensor]] = [None] * L   # selected chunk ids [B, Hkv, n]
        self.stats["fetched_tokens"] = 0
        self.effective_rank = 0  # the SVD rank actually kept (min(rank, chunked tokens, Hkv*D))

    # ------------------------------------------------------------------ prefill
    def _plan(self, T: int, valid: Optional[Tensor], device: torch.device) -> None:
        """Chunk counts, prompt positions and the shared buffers (once per generation)."""
        ctx, cs = self.ctx, self.chunk_size
        B, H, D = ctx.batch_size, ctx.num_kv_heads, ctx.head_dim
        self.C, self.O, self.n_sel, _ = self.plan(T, H * D)
        self.Tc = self.C * cs
        self.with_mask = needs_mask(valid)
        self.pos = self.buffer("gpu", "shared/positions", (B, T), torch.long)
        self.pos.t.copy_(torch.arange(T, device=device).expand(B, T) if valid is None
                         else (valid.long().cumsum(-1) - 1).clamp(min=0))
        self.valid = None
        if self.with_mask:
            self.valid = self.buffer("gpu", "shared/valid", (B, T), torch.bool)
            self.valid.t.copy_(valid)
        n = self.n_sel * cs
        self.fetch_k = self.buffer("gpu", "shared/fetch_k", (B, H, n, D), ctx.dtype)
        self.fetch_v = self.buffer("gpu", "shared/fetch_v", (B, H, n, D), ctx.dtype)
        self.stage_v = self.buffer(self.host_tier, "shared/stage_v", (B, H, n, D), ctx.dtype)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx, cs = self.ctx, self.chunk_size
        B, H, T, D = k.shape
        if layer == 0:
            self._plan(T, valid, k.device)
        C, Tc, O = self.C, self.Tc, self.O
        vc = None if valid is None else valid[:, :Tc]
        if C:
            pre = k[:, :, :Tc] if ctx.rotary is None else unrotate(ctx.rotary, k[:, :, :Tc], self.pos.t[:, :Tc])
            if vc is not None:
                pre = pre * vc[:, None, :, None]
            u, sv = low_rank_keys(pre, self.rank)
            r = u.shape[-1]
            self.u[layer] = self.buffer("gpu", f"layer{layer}/lowrank_u", (B, Tc, r), ctx.dtype)
            self.u[layer].t.copy_(u)
            self.sv[layer] = self.buffer("gpu", f"layer{layer}/lowrank_sv", (B, H, r, D), ctx.dtype)
            self.sv[layer].t.copy_(sv)
            self.effective_rank = r
            lm, min_cos, real = chunk_landmarks(k[:, :, :Tc], vc, cs)
            out_ids = torch.topk(min_cos, O, dim=-1, largest=False).indices.sort(dim=-1).values  # [B, H, O]
            is_out = torch.zeros(B, H, C, dtype=torch.long, device=k.device).scatter_(-1, out_ids, 1)
            order = torch.arange(C, device=k.device) + C * is_out
            rest = order.sort(dim=-1).values[..., :C - O]  # non-outlier chunk ids, ascending
            self.landmarks[layer] = self.buffer("gpu", f"layer{layer}/landmarks", (B, H, C - O, D), ctx.dtype)
            self.landmarks[layer].t.copy_(torch.gather(lm, 2, rest[..., None].expand(-1, -1, -1, D)))
            self.landmark_ids[layer] = self.buffer("gpu", f"layer{layer}/landmark_ids", (B, H, C - O), torch.long)
            self.landmark_ids[layer].t.copy_(rest)
            if self.with_mask:
                self.landmark_real[layer] = self.buffer("gpu", f"layer{layer}/landmark_real", (B, H, C - O), torch.bool)
                self.landmark_real[layer].t.copy_(torch.gather(real[:, None].expand(B, H, C), 2, rest))
            tok = chunk_tokens(out_ids, cs)
            outl = self.segment("gpu", f"layer{layer}/outliers", O * cs, self.with_mask)
            outl.append(gather_tokens(k, tok), gather_tokens(v, tok), gather_mask(valid, tok))
            self.outliers[layer] = outl
            vals = self.buffer(self.host_tier, f"layer{layer}/values", (B, H, Tc, D), ctx.dtype)
            vals.t.copy_(v[:, :, :Tc])
            self.values[layer] = vals
            self.count("bytes_d2h", self.kv_bytes(vals.t))
        local = self.segment("gpu", f"layer{layer}/local", T - Tc + ctx.max_new_tokens, self.with_mask)
        local.append(k[:, :, Tc:], v[:, :, Tc:], None if valid is None else valid[:, Tc:])
        self.local[layer] = local

    # ------------------------------------------------------------------ decode
    def select_chunks(self, layer: int, q: Tensor) -> Tensor:
        """Chunk ids [B, Hkv, n_sel] (ascending) of the top landmarks for query q [B, Hq, 1, D]."""
        H = self.ctx.num_kv_heads
        real = self.landmark_real[layer]
        logits = _masked(attention_logits(q, self.landmarks[layer].t, self.ctx.scale), None if real is None else real.t)
        probs = torch.softmax(logits[:, :, 0], dim=-1).nan_to_num(0.0)  # [B, Hq, C - O]
        if real is not None:  # an all-padding landmark never beats a real one, even at score 0
            probs = probs.masked_fill(~real.t.repeat_interleave(q.shape[1] // H, dim=1), -1.0)
        score = probs.reshape(q.shape[0], H, q.shape[1] // H, -1).amax(dim=2)  # [B, Hkv, C - O]
        top = torch.topk(score, self.n_sel, dim=-1).indices
        return torch.gather(self.landmark_ids[layer].t, 2, top).sort(dim=-1).values

    def _fetch(self, layer: int, chunks: Tensor):
        """Values of ``chunks`` from the host, keys rebuilt from the factors and rotated.
        Returns (k, v [B, Hkv, n, D] views of the fetch buffers, mask [B, Hkv, n] or None)."""
        ctx, cs = self.ctx, self.chunk_size
        tok = chunk_tokens(chunks, cs)  # [B, H, n]
        B, H, n = tok.shape
        D = ctx.head_dim
        vals = self.values[layer].t
        self.count("bytes_d2h", self.kv_bytes(chunks))  # the chunk ids sent to the host
        tok_h = tok.to(vals.device)
        torch.gather(vals, 2, tok_h[..., None].expand(-1, -1, -1, D), out=self.stage_v.t)
        self.fetch_v.t.copy_(self.stage_v.t)
        self.count("bytes_h2d", self.kv_bytes(self.stage_v.t))
        self.count("fetched_tokens", n)
        u = self.u[layer].t
        u_sel = torch.gather(u[:, None].expand(B, H, -1, -1), 2, tok[..., None].expand(-1, -1, -1, u.shape[-1]))
        keys = torch.matmul(u_sel, self.sv[layer].t)  # [B, H, n, D]
        if ctx.rotary is not None:
            keys = rotate_per_head(ctx.rotary, keys, torch.gather(self.pos.t[:, None].expand(B, H, -1), 2, tok))
        self.fetch_k.t.copy_(keys)
        mask = None if self.valid is None else gather_mask(self.valid.t, tok)
        return self.fetch_k.t, self.fetch_v.t, mask

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx = self.ctx
        local = self.local[layer]
        local.append(k, v)
        parts = [(local.k, local.v, local.mask)]
        if self.outliers[layer] is not None:
            o = self.outliers[layer]
            parts.append((o.k, o.v, o.mask))
        if self.n_sel > 0:
            chunks = self.select_chunks(layer, q)
            self.last_chunks[layer] = chunks
            parts.append(self._fetch(layer, chunks))
        logits = [(_masked(attention_logits(q, pk, ctx.scale), pm), pv) for pk, pv, pm in parts]
        return softmax_over_parts(logits, ctx.num_kv_heads).to(q.dtype)

    def release(self) -> None:
        super().release()
        for name in ("u", "sv", "landmarks", "landmark_ids", "landmark_real", "outliers", "local", "values"):
            setattr(self, name, [])

    # ------------------------------------------------------------------ memory
    def plan(self, prompt: int, kv_dims: int):
        """(C chunks, O outlier chunks, selected chunks, effective rank) for a padded prompt of
        ``prompt`` tokens and Hkv*D = ``kv_dims`` (:func:`plan_chunks`)."""
        return plan_chunks(prompt, kv_dims, self.budget.resolve(prompt), self.rank, self.chunk_size,
                           self.local_chunks, self.outlier_ratio)

    def footprint(self, shape: "KVShape") -> "Footprint":
        """The chunk plan of the prompt (:meth:`plan`); on the gpu tier what :func:`gpu_layout`
        counts (per layer the factors, landmarks, outliers and local window; model-wide the
        positions and fetch buffers), on ``host_tier`` the chunked part's values per layer and
        the staging buffer of the fetched values."""
        from hybridgen.methods.footprint import Footprint, add_bytes

        B, H, D, b = shape.batch, shape.kv_heads, shape.head_dim, shape.dtype_bytes
        plan = self.plan(shape.prompt, H * D)
        C, O, n_sel, _ = plan
        per_layer, shared = gpu_layout(plan, self.chunk_size, B, H, D, b, shape.prompt, shape.new_tokens,
                                       shape.masked)
        n = n_sel * self.chunk_size
        return Footprint(gpu_tokens=O * self.chunk_size + shape.prompt - C * self.chunk_size + shape.new_tokens,
                         host_tokens=C * self.chunk_size, staging_tokens=n,
                         tier_bytes=add_bytes({"gpu": shape.layers * per_layer + shared},
                                              {self.host_tier: shape.layers * B * H * C * self.chunk_size * D * b
                                               + B * H * n * D * b}),
                         shared_gpu_bytes=shared)

    def gpu_bytes(self, layers: int, batch: int, kv_heads: int, head_dim: int, dtype_bytes: int, prompt: int,
                  new_tokens: int, masked: bool) -> int:
        """Bytes this method allocates on the gpu tier for a run of that shape (its footprint's)."""
        from hybridgen.methods.footprint import KVShape

        return self.footprint(KVShape(layers, kv_heads, head_dim, dtype_bytes, batch, prompt + new_tokens, new_tokens,
                                      masked)).gpu_bytes

    def placement_for(self, gpu_kv_bytes: int, shape) -> "Optional[dict]":
        """Values on the host, the rest on the GPU (the footprint, masks counted): nothing to
        derive; refused when it does not fit."""
        from hybridgen.methods.footprint import fit_first

        return fit_first(self, gpu_kv_bytes, shape, [{}], "its key factors, landmarks, outliers and local window")

    # ------------------------------------------------------------------ performance model
    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost (:func:`baselines.shadowkv_cost.shadowkv_cost`); memory: the
        footprint (unpadded, the S context tokens as the prompt)."""
        from baselines.shadowkv_cost import shadowkv_cost
        from hybridgen.methods.footprint import with_memory

        shape = c.kv_shape()
        lay = shadowkv_cost(c, c.fraction(self.budget), self.rank, self.chunk_size, self.local_chunks,
                            self.outlier_ratio, mapping=self.host_tier)
        return with_memory(lay, self.footprint(shape), shape)
