"""MagicPIG: LSH sampling of the host keys, attention estimated on the CPU by importance sampling.

Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", ICLR 2025. At prefill
every key is hashed by SimHash into ``tables`` (L) tables of ``bits`` (K) random-hyperplane
sign bits each; the codes and the KV live in host memory. At a decode step the compute
device hashes the query the same way and sends its codes (and the query) to the host; the
CPU collects the keys that collide with the query in at least ``min_collisions`` (m) of the
L tables and returns the self-normalised importance-sampling estimate of attention over the
host keys,

    out = Σ_i∈S w_i v_i / Σ_i∈S w_i,   w_i = exp(q·k_i * scale) / u_i,

where u_i = P[Binomial(L, p_i) >= m] is key i's probability of being collected, with
p_i = (1 - θ_i/π)^K the probability that all K bits of one table agree and θ_i the angle
between q and k_i. The first ``sinks`` prompt tokens, the last ``window`` prompt tokens and
every generated token stay on the gpu tier and are attended exactly; the two parts are
merged by their log-sum-exps (the host part's "lse" is log Σ w_i), so with every key
collected (m = 0, u_i = 1) the output is exact attention.

Defaults: K = 10, L = 150 (one of the paper's configurations; it evaluates K of about 8-10
with L of about 75-150), m = 2 (a key is sampled when it collides in two tables), 4 sink and
64 local tokens exact on the GPU. These are our reading of the paper, not re-checked against
its text here; every one is a parameter.

Choices where the paper is silent (or that are ours):
- one set of K x L Gaussian hyperplanes per layer (seeded by ``seed``), shared by all heads,
  stored on the gpu tier (the query is hashed there; the keys too, once, at prefill);
- the hash tables (host TierBuffers, per sequence, KV head and table): the keys' codes sorted
  [B, Hkv, L, n] (int16 for K <= 15, so a bucket is a contiguous range found by binary
  search) and the key ids in that order [B, Hkv, L, n] int32: 2 + 4 bytes per key per table;
  the keys are hashed on the compute device, the codes sent down and sorted on the host;
- the CPU reads the query's bucket in every table, counts each candidate's tables (a sort of
  the candidates) and keeps those counted >= m;
- GQA: keys and codes are per KV head; each query head samples and estimates on its own;
- generated tokens are appended to the gpu part (exact), not hashed: only the prompt is
  sampled; ``dense_layers`` leading layers keep everything on the gpu (default 0: every
  layer samples; the paper's code keeps some layers dense, set it to match);
- a query head that collects no host key gets only the exact gpu part (lse -inf merge);
- left padding: padded keys are never collected; the query's bytes go down as well as its
  codes (the CPU needs q for the logits);
- under one GPU memory budget (``placement_for``) nothing is derived: the gpu tier holds the
  sinks, window, generated tokens (every prompt token of a dense layer) and the hyperplanes
  (:meth:`MagicPIG.footprint`, what the ledger counts); a budget below that is refused;
- the projected cost (:func:`baselines.magicpig_cost.magicpig_cost`) prices the code as it runs: the query's hash and
  copy down, then the CPU's searches, candidate passes, count (a sort), row gathers and the
  sampling probabilities (the binomial tail, tables - m + 1 float64 terms per sampled pair,
  which dominates at long contexts) concurrent with the GPU's exact part, then the copy up and
  the merge; no cross-layer overlap (the CPU starts after the layer's query exists).

stats: 'bytes_d2h' = host KV + key codes at prefill, q + query codes per step;
'bytes_h2d' = the host part's out + lse per step; 'sampled' / 'host_keys' = collected /
candidate (query head, key) pairs, summed over steps (their ratio is the sampling rate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, FrozenSet, List, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.methods.tensors import needs_mask
from hybridgen.methods.tiered import TieredMethod, TierBuffer
from hybridgen.attention import merge_partials, partial_attention
from hybridgen.attention.cpu_pool import default_pool
from hybridgen.errors import ConfigError
from hybridgen.kv import KVSegment
from hybridgen.kv.segment import split_prompt
from hybridgen.methods import HostTier, MethodContext, NonNegInt, PositiveInt, Range

NEG_INF = float("-inf")
RATE_GRID = 4001      # points of the cos θ grid of expected_sample_rate(head_dim=...)


def code_dtype(bits: int) -> torch.dtype:
    return torch.int16 if bits <= 15 else torch.int32


def simhash_codes(x: Tensor, planes: Tensor, bits: int, tables: int) -> Tensor:
    """SimHash codes of x [..., D] under planes [D, tables * bits]: [..., tables] integers whose
    bit j is the sign of the j-th hyperplane of that table (1 when x . w > 0)."""
    signs = (x.float() @ planes) > 0  # [..., L*K]
    signs = signs.reshape(*x.shape[:-1], tables, bits).to(torch.int32)
    weights = 2 ** torch.arange(bits, device=x.device, dtype=torch.int32)
    return (signs * weights).sum(-1).to(code_dtype(bits))


def log_sample_prob(cos: Tensor, bits: int, tables: int, min_collisions: int) -> Tensor:
    """log u: log P[Binomial(tables, p) >= min_collisions], p = (1 - acos(cos)/π)^bits. cos [N] -> [N] float64."""
    if min_collisions == 0:
        return torch.zeros_like(cos, dtype=torch.float64)
    theta = torch.acos(cos.double().clamp(-1.0, 1.0))
    p = (1.0 - theta / math.pi) ** bits  # [N]
    j = torch.arange(min_collisions, tables + 1, dtype=torch.float64, device=cos.device)  # [J]
    log_choose = torch.lgamma(torch.tensor(tables + 1.0, dtype=torch.float64)) - torch.lgamma(j + 1) \
        - torch.lgamma(tables - j + 1)
    terms = log_choose + torch.special.xlogy(j, p[:, None]) + torch.special.xlog1py(tables - j, -p[:, None])
    return torch.logsumexp(terms, dim=-1)


def build_tables(codes: Tensor) -> Tuple[Tensor, Tensor]:
    """Hash tables from key codes [B, Hkv, n, L]: per (sequence, KV head, table) the codes sorted
    (the buckets, contiguous) [B, Hkv, L, n] and the key ids in that order [B, Hkv, L, n] int32."""
    sorted_codes, order = torch.sort(codes.transpose(2, 3), dim=-1, stable=True)
    return sorted_codes.contiguous(), order.to(torch.int32).contiguous()


def collect(q_codes: Tensor, sorted_codes: Tensor, ids: Tensor, min_collisions: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(b, query head, key) of every key in the query head's bucket in >= min_collisions (>= 1) tables.

    q_codes [B, Hq, L]; sorted_codes, ids [B, Hkv, L, n] (:func:`build_tables`). Each bucket is a
    range of the sorted codes found by binary search; the candidates' ids are counted per
    (b, query head, key) and those counted >= min_collisions times returned, three [N] int64.
    """
    B, Hq, L = q_codes.shape
    Hkv, n = ids.shape[1], ids.shape[3]
    G = Hq // Hkv
    want = q_codes.reshape(B, Hkv, G, L).transpose(2, 3).contiguous()  # [B, Hkv, L, G]
    lo = torch.searchsorted(sorted_codes, want)
    hi = torch.searchsorted(sorted_codes, want, right=True)
    lengths = (hi - lo).flatten()  # one bucket per (b, kv head, table, group member)
    rows = torch.arange(B * Hkv * L, device=ids.device).reshape(B, Hkv, L, 1) * n
    starts = (rows + lo).flatten()
    entry = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    offset = torch.arange(entry.numel(), device=ids.device) - (torch.cumsum(lengths, 0) - lengths)[entry]
    key = ids.flatten()[starts[entry] + offset].long()
    b = entry // (Hkv * L * G)
    hq = (entry // (L * G)) % Hkv * G + entry % G
    pair, count = torch.unique((b * Hq + hq) * n + key, return_counts=True)
    pair = pair[count >= min_collisions]
    return pair // (Hq * n), (pair // n) % Hq, pair % n


def sampled_attention(q: Tensor, q_codes: Tensor, k: Tensor, v: Tensor, tables: Optional[Tuple[Tensor, Tensor]],
                      mask: Optional[Tensor], scale: float, bits: int, min_collisions: int) -> Tuple[Tensor, Tensor, int]:
    """The host part: importance-sampled attention over the keys colliding >= min_collisions times.

    q [B, Hq, 1, D]; q_codes [B, Hq, L]; k, v [B, Hkv, n, D]; tables: (sorted codes, ids)
    [B, Hkv, L, n] (unused when min_collisions = 0: every key is collected); mask [B, Hkv, n]
    or None. Returns (out [B, Hq, 1, D] in q's dtype, lse [B, Hq, 1] float32 = log Σ_S
    exp(logit)/u, collected pairs). Heads that collect nothing: out 0, lse -inf.
    """
    B, Hq, _, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    G = Hq // Hkv
    L = q_codes.shape[-1]
    if min_collisions == 0:
        bi, hi, ii = torch.ones(B, Hq, n, dtype=torch.bool).nonzero(as_tuple=True)
    else:
        bi, hi, ii = collect(q_codes, *tables, min_collisions)
    if mask is not None:
        real = mask[bi, hi // G, ii]
        bi, hi, ii = bi[real], hi[real], ii[real]
    krows, vrows = k[bi, hi // G, ii].float(), v[bi, hi // G, ii].float()  # [N, D]
    qrows = q[bi, hi, 0].float()
    dot = (qrows * krows).sum(-1)
    cos = dot / (qrows.norm(dim=-1) * krows.norm(dim=-1)).clamp_min(1e-30)
    lw = (dot * scale).double() - log_sample_prob(cos, bits, L, min_collisions)  # log w [N]
    group = bi * Hq + hi
    top = torch.full((B * Hq,), NEG_INF, dtype=torch.float64).scatter_reduce(0, group, lw, "amax")
    w = torch.exp(lw - top[group])
    den = torch.zeros(B * Hq, dtype=torch.float64).index_add_(0, group, w)
    num = torch.zeros(B * Hq, D, dtype=torch.float64).index_add_(0, group, w[:, None] * vrows.double())
    hit = den > 0
    out = torch.where(hit[:, None], num / den.clamp_min(1e-300)[:, None], torch.zeros_like(num))
    lse = torch.where(hit, top + torch.log(den.clamp_min(1e-300)), torch.full_like(den, NEG_INF))
    return out.reshape(B, Hq, 1, D).to(q.dtype), lse.reshape(B, Hq, 1).float(), int(bi.numel())


def expected_sample_rate(bits: int, tables: int, min_collisions: int, head_dim: Optional[int] = None) -> float:
    """The projection's model of the sampled share of the host keys: the collection probability
    of a key orthogonal to the query (θ = π/2), or with ``head_dim`` its mean over keys in random
    directions of that dimension (cos θ has density ∝ (1 - x²)^((D-3)/2); the probability is
    convex in cos θ, so the spread raises it: 0.023 at D = 64 against 0.0097 at θ = π/2). A run
    on random keys samples the mean (tests/test_baselines_magicpig.py); the real SmolLM2's keys
    sampled 0.0058 at D = 64 in results/paper_speedup (its emulated run)."""
    if head_dim is None or head_dim < 3:
        return float(log_sample_prob(torch.zeros(1), bits, tables, min_collisions).exp())
    x = torch.linspace(-1.0, 1.0, RATE_GRID + 2, dtype=torch.float64)[1:-1]
    w = (1 - x * x) ** ((head_dim - 3) / 2)
    return float((w * log_sample_prob(x, bits, tables, min_collisions).exp()).sum() / w.sum())


@dataclass
class MagicPIG(TieredMethod):
    """SimHash tables over the host keys; the CPU returns a sampled estimate of their attention.

    bits (K, 10) per table, tables (L, 150), min_collisions (m, 2); sinks (4) and window (64)
    prompt tokens kept exactly on the gpu tier with every generated token; tier: the host tier
    of the KV and the codes ('dram'); dense_layers: leading layers kept wholly on the gpu (0);
    seed: the hyperplanes' seed.
    """

    name: ClassVar[str] = "magicpig"
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"tier"})
    bits: Annotated[int, Range(1, 30)] = 10
    tables: PositiveInt = 150
    min_collisions: NonNegInt = 2
    sinks: NonNegInt = 4
    window: NonNegInt = 64
    tier: HostTier = "dram"
    dense_layers: NonNegInt = 0
    seed: NonNegInt = 0

    def check(self) -> None:
        if self.min_collisions > self.tables:
            raise ConfigError(f"method {type(self).name!r}: parameter 'min_collisions' expects at most 'tables' "
                              f"({self.tables}), got {self.min_collisions}")

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.pool = ctx.pool or default_pool()
        self.gpu: List[Optional[KVSegment]] = [None] * L
        self.host: List[Optional[KVSegment]] = [None] * L
        self.lsh: List[Optional[Tuple[TierBuffer, TierBuffer]]] = [None] * L  # sorted codes, ids [B, Hkv, tables, n]
        self.planes: List[Optional[TierBuffer]] = [None] * L  # [D, tables * bits] float32 on gpu
        self.stats.update(sampled=0, host_keys=0)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        """k, v: [B, Hkv, T, D]; valid: [B, T] bool or None."""
        ctx = self.ctx
        B, H, T, D = k.shape
        with_mask = needs_mask(valid)
        s, w = self.gpu_part(layer, T)
        host_end = T - w
        gpu = self.segment("gpu", f"layer{layer}/gpu", s + w + ctx.max_new_tokens, with_mask)
        host = self.segment(self.tier, f"layer{layer}/host", host_end - s, with_mask)
        self.count("bytes_d2h", split_prompt(gpu, host, k, v, valid, s, host_end))
        self.gpu[layer], self.host[layer] = gpu, host
        if host_end > s:
            gen = torch.Generator().manual_seed(self.seed * 100003 + layer)
            planes = self.buffer("gpu", f"layer{layer}/simhash", (D, self.tables * self.bits), torch.float32)
            planes.t.copy_(torch.randn(D, self.tables * self.bits, generator=gen))
            dev_codes = simhash_codes(k[:, :, s:host_end], planes.t, self.bits, self.tables)  # on the compute device
            self.count("bytes_d2h", self.kv_bytes(dev_codes))
            sorted_codes, ids = build_tables(dev_codes.to(host.k.device))  # on the host
            shape = (B, H, self.tables, host_end - s)
            tables = (self.buffer(self.tier, f"layer{layer}/buckets", shape, sorted_codes.dtype),
                      self.buffer(self.tier, f"layer{layer}/ids", shape, torch.int32))
            tables[0].t.copy_(sorted_codes)
            tables[1].t.copy_(ids)
            self.planes[layer], self.lsh[layer] = planes, tables

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, Hq, 1, D]; k, v: [B, Hkv, 1, D]. Returns [B, Hq, 1, D]."""
        gpu, host = self.gpu[layer], self.host[layer]
        gpu.append(k, v)
        scale = self.ctx.scale
        if host.length == 0:
            return partial_attention(q, gpu.k, gpu.v, scale, gpu.mask)[0]
        q_codes = simhash_codes(q[:, :, 0], self.planes[layer].t, self.bits, self.tables)  # [B, Hq, L]
        q_host, codes_host = q.to(host.k.device), q_codes.to(host.k.device)
        self.count("bytes_d2h", self.kv_bytes(q) + self.kv_bytes(q_codes))
        tables = tuple(t.t for t in self.lsh[layer])
        fut = self.pool.submit(sampled_attention, q_host, codes_host, host.k, host.v, tables, host.mask, scale,
                               self.bits, self.min_collisions)
        gpu_part = partial_attention(q, gpu.k, gpu.v, scale, gpu.mask)
        h_out, h_lse, n = fut.result()
        self.count("bytes_h2d", self.kv_bytes(h_out) + self.kv_bytes(h_lse))
        self.count("sampled", n)
        self.count("host_keys", q.shape[0] * q.shape[1] * host.length)
        out, _ = merge_partials([gpu_part, (h_out.to(q.device), h_lse.to(q.device))])
        return out

    # ------------------------------------------------------------------ memory
    def gpu_part(self, layer: int, prompt: int) -> Tuple[int, int]:
        """(sinks, window): the prompt tokens ``layer`` keeps exactly on the gpu tier (every one
        in a dense layer); the prompt tokens between them go to the host."""
        if layer < self.dense_layers:
            return prompt, 0
        s = min(self.sinks, prompt)
        return s, min(self.window, prompt - s)

    def footprint(self, shape: "KVShape") -> "Footprint":
        """Per layer: a gpu segment of its prompt tokens (every one in a dense layer; sinks +
        window in a sampled one) + every generated token, and in a sampled layer with a host part
        the float32 hyperplanes [D, tables x bits] on the gpu; the rest of the prompt and its hash
        tables (codes + int32 ids per key and table) on ``tier``. Masks when padded."""
        from hybridgen.methods.footprint import Footprint, add_bytes

        T, X = shape.prompt, shape.batch * (shape.token_bytes + shape.mask_bytes)
        cb = torch.empty((), dtype=code_dtype(self.bits)).element_size()  # one code per key and table
        gpu = host = gpu_tokens = host_tokens = 0
        for layer in range(shape.layers):
            s, w = self.gpu_part(layer, T)
            n = T - s - w
            gpu += (s + w + shape.new_tokens) * X + (shape.head_dim * self.tables * self.bits * 4 if n > 0 else 0)
            host += n * X + shape.batch * shape.kv_heads * self.tables * n * (cb + 4)
            gpu_tokens, host_tokens = gpu_tokens + s + w + shape.new_tokens, host_tokens + n
        return Footprint(gpu_tokens=gpu_tokens / shape.layers, host_tokens=host_tokens / shape.layers,
                         tier_bytes=add_bytes({"gpu": gpu}, {self.tier: host}))

    def gpu_bytes(self, layers: int, batch: int, kv_heads: int, head_dim: int, dtype_bytes: int, prompt: int,
                  new_tokens: int, masked: bool) -> int:
        """Bytes this method allocates on the gpu tier for a run of that shape (its footprint's)."""
        from hybridgen.methods.footprint import KVShape

        return self.footprint(KVShape(layers, kv_heads, head_dim, dtype_bytes, batch, prompt + new_tokens, new_tokens,
                                      masked)).gpu_bytes

    def placement_for(self, gpu_kv_bytes: int, shape) -> "Optional[dict]":
        """Prompt KV and hash tables on the host tier, sinks + window + generated tokens and the
        hyperplanes on the GPU (the footprint, masks counted): nothing to derive; refused when
        they do not fit."""
        from hybridgen.methods.footprint import fit_first

        return fit_first(self, gpu_kv_bytes, shape, [{}], "its sinks, local window, generated tokens and hyperplanes")

    # ------------------------------------------------------------------ performance model
    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost (:func:`baselines.magicpig_cost.magicpig_cost`; dense leading layers
        priced as dense GPU attention over the context, the mean layer taken); memory: the footprint."""
        from baselines.layer_costs import mean_layer_cost
        from baselines.magicpig_cost import APPEND_KERNELS, magicpig_cost
        from hybridgen.methods.footprint import with_memory
        from hybridgen.perf.costs import PARTIAL_KERNELS, gpu_resident_cost

        L, shape = c.shape.num_layers, c.kv_shape()
        dense = min(self.dense_layers, L)
        lay = magicpig_cost(c, self.bits, self.tables, self.min_collisions, self.sinks + self.window, self.tier)
        if dense:
            full_layer = gpu_resident_cost(c, c.S, c.fixed(gpu_kernels=PARTIAL_KERNELS + APPEND_KERNELS - 1),
                                           label="magicpig")
            lay = mean_layer_cost([full_layer] * dense + [lay] * (L - dense), label="magicpig")
        return with_memory(lay, self.footprint(shape), shape)
