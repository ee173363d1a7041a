"""InfiniGen: speculative prefetch of the important KV from host memory.

Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic
KV Cache Management", OSDI 2024. The KV cache lives in host memory. Offline, the query and key
of every head are *skewed* by an orthogonal matrix A (from an SVD of the query, so
(Q A)(K A)ᵀ = Q Kᵀ while a few columns carry most of the magnitude); the top
``partial_weight_ratio`` columns form partial query weights and a partial key cache kept on
the GPU. While layer l runs, InfiniGen computes layer l+1's approximate attention from layer
l's input with the partial query weights against the partial keys, and prefetches the tokens
whose speculative score is within ``alpha`` of the maximum (capped at ``max_num_kv``).
Layer l+1 then attends exactly over the prefetched tokens (+ the new token).

Choices where the paper is silent or which we adapt:
- skewing is computed at prefill from the prompt's own (rotated) queries, per KV head: A is
  the right singular vectors of the group's stacked queries (eigenvectors of Σ qqᵀ, largest
  first); the paper uses a sample input offline. For RoPE models A cannot be folded into
  W_q / W_k (the rotation sits between them), so it is applied after rotary: q A and k A.
  The dot products are unchanged either way (A orthogonal);
- the partial columns per KV head are the r = round(ratio x D) columns with the largest
  (Σ_t |q̃_tc|) x (Σ_t |k̃_tc|) over the prompt; the partial query is the full stand-in query
  (``engine.stand_in_query(l + 1, hidden_l, positions)``, :mod:`hybridgen.hybrid.speculation`) projected
  on those r skewed columns;
- GQA: a token's speculative score for a KV head is the MAX over the group's query heads
  (one fetch per KV head serves the group; alpha keeps its logit units);
- the number fetched is the mean over batch and KV heads of the per-head count of tokens
  within alpha of that head's max (rounded, at least 1), capped by ``budget`` (max_num_kv:
  the tokens attended, new token included, are at most budget.resolve(context so far));
  then the top-n per head. Tokens are gathered on the host into a staging buffer and copied
  to a double-buffered gpu-tier fetch buffer (async on a CUDA stream when available);
- layer 0 has no previous layer to speculate from: it selects with its own exact query
  (skewed, partial columns) at decode time; so does every layer when there is no engine
  (method-level use) or ``speculate=False``;
- the host pool's eviction policy (for host memory limits) is not implemented: the host
  keeps all KV;
- 'fetched_tokens' / 'fetch_context_tokens' (stats, in the run's metrics): the fraction of the
  context it fetched, what the cost prices when given (:func:`measured_fetch_fraction`);
- 'bytes_h2d' counts fetched K/V rows (+ mask); 'bytes_d2h' the KV written to the host
  and the selected indices sent down; 'speculated' counts layers selected from the previous
  layer's input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Dict, FrozenSet, List, Literal, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.methods.tensors import attend_with_new, gather_tokens, needs_mask
from hybridgen.methods.tiered import TieredMethod, TierBuffer
from hybridgen.kv import KVSegment
from hybridgen.kv.transfer import HostToDevice
from hybridgen.hybrid.speculation import DecodePositions, next_layer, stand_in_query
from hybridgen.methods import Budget, KeptBudget, MethodContext, Range


def skew_matrices(q: Tensor, num_kv_heads: int, valid: Optional[Tensor] = None) -> Tensor:
    """Orthogonal skewing matrices A [Hkv, D, D] from queries q [B, Hq, T, D].

    Columns are the eigenvectors of Σ q qᵀ over the group's heads and real tokens, largest
    eigenvalue first (= right singular vectors of the stacked queries).
    """
    B, Hq, T, D = q.shape
    qd = q.double()
    if valid is not None:
        qd = qd * valid[:, None, :, None]
    qg = qd.reshape(B, num_kv_heads, Hq // num_kv_heads, T, D)
    cov = torch.einsum("bhgtd,bhgte->hde", qg, qg)
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    return evecs.flip(-1).to(q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32)


def partial_columns(q: Tensor, k: Tensor, A: Tensor, r: int, valid: Optional[Tensor] = None) -> Tensor:
    """Indices [Hkv, r] of the skewed columns with the largest Σ|q̃| x Σ|k̃|."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    qs = torch.einsum("bhgtd,hde->bhgte", q.float().reshape(B, Hkv, Hq // Hkv, T, D), A.float())
    ks = torch.einsum("bhtd,hde->bhte", k.float(), A.float())
    if valid is not None:
        qs = qs * valid[:, None, None, :, None]
        ks = ks * valid[:, None, :, None]
    score = qs.abs().sum(dim=(0, 2, 3)) * ks.abs().sum(dim=(0, 2))  # [Hkv, D]
    return torch.topk(score, r, dim=-1).indices.sort(dim=-1).values


def fetch_count(score: Tensor, alpha: float, cap: int) -> int:
    """InfiniGen's fetch size: mean per-head count of scores >= max - alpha, capped. score [B, H, n]."""
    mx = score.amax(dim=-1, keepdim=True)
    count = (score >= mx - alpha).sum(dim=-1).float()
    return int(min(cap, max(1, round(float(count.mean())))))


@dataclass
class InfiniGen(TieredMethod):
    """Speculative top-KV prefetch from host memory with SVD-skewed partial Q/K.

    budget: max_num_kv, tokens attended per step (ratio of the context so far, or tokens).
    alpha: speculative-score margin below the max (4). partial_weight_ratio: skewed columns
    kept (0.2). host_tier: where the full KV lives. speculate: use layer l's input to select
    layer l+1's tokens (needs the engine). async_copy: CUDA stream when available.
    """

    name: ClassVar[str] = "infinigen"
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"host_tier", "async_copy"})
    validation_rows: ClassVar[Tuple[Tuple[str, Dict[str, Any]], ...]] = (("infinigen", {}),)  # local_rows.py
    budget: KeptBudget = Budget(ratio=0.2)
    alpha: Annotated[float, Range(lo=0.0, inf_ok=True)] = 4.0  # inf: always the budget's cap
    partial_weight_ratio: Annotated[float, Range(0.0, 1.0, lo_open=True)] = 0.2
    host_tier: Literal["dram", "cxl"] = "dram"
    speculate: bool = True
    async_copy: bool = True

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.r = self.partial_dims(ctx.head_dim)
        self.host: List[Optional[KVSegment]] = [None] * L
        self.pkeys: List[Optional[TierBuffer]] = [None] * L  # [B, Hkv, max_len, r] on gpu
        self.pweights: List[Optional[TierBuffer]] = [None] * L  # A[:, :, cols] [Hkv, D, r] on gpu
        self.plen = [0] * L
        self.slots: Optional[list] = None
        self.fetched: List[Optional[Tuple[int, int]]] = [None] * L  # (slot, n) ready for decode
        self.prefetcher = HostToDevice(ctx.compute_device, force_sync=not self.async_copy)
        self.with_mask = False
        self.last_fetch = [0] * L
        self.positions = DecodePositions()

    def _alloc_slots(self) -> None:
        ctx = self.ctx
        B, H, D = ctx.batch_size, ctx.num_kv_heads, ctx.head_dim
        cap = self.fetch_cap = self.fetch_slot_tokens(ctx.max_len)
        self.slots = []
        for i in range(2):
            slot = {}
            for tier, where in (("gpu", "dev"), (self.host_tier, "host")):
                slot[where + "_k"] = self.buffer(tier, f"shared/fetch{i}/{where}_k", (B * H * cap * D,), ctx.dtype)
                slot[where + "_v"] = self.buffer(tier, f"shared/fetch{i}/{where}_v", (B * H * cap * D,), ctx.dtype)
                if self.with_mask:
                    slot[where + "_m"] = self.buffer(tier, f"shared/fetch{i}/{where}_mask", (B * H * cap,), torch.bool)
            self.slots.append(slot)

    # ------------------------------------------------------------------ prefill
    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        B, H, T, D = k.shape
        if layer == 0:
            self.with_mask = needs_mask(valid)
            self.positions.start(valid, B, T, k.device)
        A = skew_matrices(q, H, valid)
        cols = partial_columns(q, k, A, self.r, valid)  # [Hkv, r]
        pw = self.buffer("gpu", f"layer{layer}/partial_weight", (H, D, self.r), A.dtype)
        pw.t.copy_(torch.gather(A, 2, cols[:, None, :].expand(H, D, self.r)))
        pk = self.buffer("gpu", f"layer{layer}/partial_keys", (B, H, ctx.max_len, self.r), k.dtype)
        pk.t[:, :, :T] = self._project(k, pw.t)
        self.plen[layer] = T
        host = self.segment(self.host_tier, f"layer{layer}/host", ctx.max_len, self.with_mask)
        host.append(k.to(host.device), v.to(host.device), None if valid is None else valid.to(host.device))
        self.count("bytes_d2h", self.kv_bytes(k) + self.kv_bytes(v))
        self.host[layer], self.pkeys[layer], self.pweights[layer] = host, pk, pw
        if self.slots is None:
            self._alloc_slots()

    @staticmethod
    def _project(k: Tensor, pw: Tensor) -> Tensor:
        """k [B, Hkv, T, D] x pw [Hkv, D, r] -> [B, Hkv, T, r]."""
        return torch.einsum("bhtd,hdr->bhtr", k, pw.to(k.dtype))

    # ------------------------------------------------------------------ selection + fetch
    def speculative_scores(self, layer: int, q: Tensor) -> Tensor:
        """Partial logits [B, Hkv, n] (max over each group's query heads) of q [B, Hq, 1, D]."""
        ctx = self.ctx
        B, Hq, _, D = q.shape
        H = ctx.num_kv_heads
        pw = self.pweights[layer].t
        qp = torch.einsum("bhgd,hdr->bhgr", q.reshape(B, H, Hq // H, D), pw.to(q.dtype))
        n = self.plen[layer]
        logits = torch.matmul(qp, self.pkeys[layer].t[:, :, :n].transpose(-1, -2)).float() * ctx.scale
        score = logits.amax(dim=2)  # [B, Hkv, n]
        mask = self.host[layer].mask
        if mask is not None:
            score = score.masked_fill(~mask.to(score.device), float("-inf"))
        return score

    def _select_and_fetch(self, layer: int, q: Tensor) -> None:
        n_ctx = self.plen[layer]
        cap = max(0, self.budget.resolve(n_ctx + 1) - 1)
        slot_id = layer % 2
        self.count("fetch_context_tokens", n_ctx)  # fetched_tokens / this: the fetch fraction
        if cap == 0 or n_ctx == 0:
            self.fetched[layer] = (slot_id, 0)
            return
        score = self.speculative_scores(layer, q)
        n = fetch_count(score, self.alpha, cap)
        self.count("fetched_tokens", n)
        idx = torch.topk(score, n, dim=-1).indices  # [B, Hkv, n]
        host = self.host[layer]
        idx_h = idx.to(host.device)
        self.count("bytes_d2h", self.kv_bytes(idx))
        B, H, _, D = host.k.shape
        slot = self.slots[slot_id]
        self.prefetcher.reuse(slot_id)  # the previous copy out of this host staging slot is done
        hk = slot["host_k"].t[: B * H * n * D].view(B, H, n, D)
        hv = slot["host_v"].t[: B * H * n * D].view(B, H, n, D)
        gather_tokens(host.k, idx_h, out=hk)  # one row copy per token (torch.gather: ~5x slower on a CPU)
        gather_tokens(host.v, idx_h, out=hv)
        pairs = [(slot["dev_k"].t[: hk.numel()], hk.view(-1)), (slot["dev_v"].t[: hv.numel()], hv.view(-1))]
        if "host_m" in slot:
            hm = slot["host_m"].t[: B * H * n].view(B, H, n)
            torch.gather(host.mask, 2, idx_h, out=hm)
            pairs.append((slot["dev_m"].t[: hm.numel()], hm.view(-1)))
        self.count("bytes_h2d", self.prefetcher.start(layer, pairs, buffer=slot_id))
        self.fetched[layer] = (slot_id, n)
        self.last_fetch[layer] = n

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        nxt = next_layer(self.ctx, layer)
        if not self.speculate or nxt is None or self.host[nxt] is None:
            return
        q_spec = stand_in_query(self.ctx, nxt, hidden, self.positions.current())
        self._select_and_fetch(nxt, q_spec)
        self.count("speculated", 1)

    def end_step(self) -> None:
        super().end_step()
        self.positions.advance()

    # ------------------------------------------------------------------ decode
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx = self.ctx
        if self.fetched[layer] is None:
            self._select_and_fetch(layer, q)
        slot_id, n = self.fetched[layer]
        self.fetched[layer] = None
        self.prefetcher.wait(layer)
        B, H, _, D = k.shape
        slot = self.slots[slot_id]
        fk = slot["dev_k"].t[: B * H * n * D].view(B, H, n, D)
        fv = slot["dev_v"].t[: B * H * n * D].view(B, H, n, D)
        fm = slot["dev_m"].t[: B * H * n].view(B, H, n) if "dev_m" in slot else None
        out, _ = attend_with_new(q, fk, fv, fm, k, v, ctx.scale)
        # store the new token: full KV to the host, partial key on the GPU
        host = self.host[layer]
        host.append(k.to(host.device), v.to(host.device))
        self.count("bytes_d2h", self.kv_bytes(k) + self.kv_bytes(v))
        p = self.plen[layer]
        self.pkeys[layer].t[:, :, p:p + 1] = self._project(k, self.pweights[layer].t)
        self.plen[layer] = p + 1
        return out

    def release(self) -> None:
        if getattr(self, "prefetcher", None) is not None:
            self.prefetcher.drain()
        super().release()
        self.host, self.pkeys, self.pweights, self.slots = [], [], [], None

    # ------------------------------------------------------------------ memory, placement, cost
    def partial_dims(self, head_dim: int) -> int:
        """r: the skewed columns kept per KV head (partial weights and keys)."""
        return max(1, int(round(self.partial_weight_ratio * head_dim)))

    def fetch_slot_tokens(self, context: int) -> int:
        """Tokens one fetch slot holds for a ``context``-token run (the budget's, at least 1)."""
        return max(1, self.budget.resolve(context))

    def footprint(self, shape: "KVShape") -> "Footprint":
        """All KV (+ masks) on ``host_tier``; per layer the partial weights (float32, float64 for
        float64 models) and partial keys (r = round(ratio x D) columns of every token) on the
        gpu tier; two fetch slots of budget.resolve(context) tokens on each side (K, V, masks)."""
        from hybridgen.methods.footprint import Footprint, add_bytes

        L, B, H, D, b, T = shape.layers, shape.batch, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.context
        r, cap = self.partial_dims(D), self.fetch_slot_tokens(T)
        slots = 2 * cap * B * (shape.token_bytes + shape.mask_bytes)
        per_layer = H * D * r * max(4, b) + B * H * T * r * b
        return Footprint(gpu_tokens=0.0, host_tokens=T, staging_tokens=2 * cap,
                         tier_bytes=add_bytes({"gpu": L * per_layer + slots},
                                              {self.host_tier: shape.kv_bytes(T) + slots}),
                         shared_gpu_bytes=slots)

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """All KV on the host; the GPU holds the partial keys and weights and two fetch slots:
        nothing to derive, refused when its footprint does not fit."""
        from hybridgen.methods.footprint import fit_first

        return fit_first(self, gpu_kv_bytes, shape, [{}], "its partial keys and fetch slots")

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost (:func:`infinigen_cost`) at the fetch fraction an emulated run
        measured (``c.measured['fetch_fraction']``, :func:`measured_fetch_fraction` of its
        method_stats; at most the budget's cap), else at the budget's cap; the breakdown states
        which (fetch_fraction, fetch_cap, fetch_measured 1/0). Memory: the footprint."""
        from hybridgen.methods.footprint import with_memory

        shape = c.kv_shape()
        cap = c.fraction(self.budget)
        measured = c.measured.get("fetch_fraction")
        frac = cap if measured is None else min(float(measured), cap)
        lay = infinigen_cost(c, frac, self.partial_weight_ratio, mapping=self.host_tier)
        lay.breakdown.update(fetch_fraction=frac, fetch_cap=cap, fetch_measured=float(measured is not None))
        return with_memory(lay, self.footprint(shape), shape)


def measured_fetch_fraction(method_stats: "dict") -> "Optional[float]":
    """The fraction of the context InfiniGen fetched in a run: its method_stats' fetched_tokens /
    fetch_context_tokens (every speculative or exact selection of every layer and step, as the
    run's metrics record them); None when it never fetched."""
    ctx = float(method_stats.get("fetch_context_tokens", 0))
    return float(method_stats.get("fetched_tokens", 0)) / ctx if ctx > 0 else None


def infinigen_cost(c: "CostContext", budget_ratio: float, partial_ratio: float, mapping: str = "dram") -> "LayerCost":
    """PROJECTED InfiniGen layer: all KV on the host (S_h = S); speculation over the partial keys
    on the GPU, spec = B*S*Hkv*(partial_ratio*D)*b / attention_gbps; the budget_ratio*S tokens
    it picks are gathered on the host and copied one layer ahead, fetch = gather + copy of
    B*r*S*kv_tok; attn = spec + fetch + gpu_attn(r*S); layer = max(fetch, rest + spec + gpu_attn)."""
    from hybridgen.perf.context import LayerCost

    S_h = c.S  # the host keeps all KV
    _, value_tier = c.tiers(mapping)
    fetched = budget_ratio * S_h
    spec = c.B * c.S * c.Hkv * (partial_ratio * c.D) * c.b / (c.hw.gpu.attention_gbps * 1e9) + c.launch
    nbytes = c.B * fetched * c.kv_tok
    gather = c.gather_time(c.B * c.Hkv * fetched, 2 * c.D * c.b, value_tier)
    xfer = c.copy(nbytes)
    fetch = gather + xfer
    gpu = spec + c.gpu_attn(fetched)
    return LayerCost(attn=fetch + gpu, layer=max(fetch, c.rest + gpu), cpu=gather, gpu=c.rest + gpu, transfer=xfer,
                     breakdown={"speculation_s": spec, "gather_s": gather, "transfer_s": xfer,
                                "gpu_attn_s": gpu - spec, "rest_s": c.rest, "h2d_bytes": nbytes},
                     label="infinigen")
