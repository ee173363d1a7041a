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
  (:meth:`MagicPIG.gpu_bytes`, what the ledger counts); a budget below that is refused;
- the projected cost (:func:`magicpig_cost`) prices the code as it runs: the query's hash and
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
from typing import Annotated, ClassVar, List, Optional, Tuple

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
# The CPU part's work per layer-step, counted from :func:`collect` and :func:`sampled_attention`
# (torch.profiler: 103 top-level non-view ops per call). The passes below are the ops over arrays
# that grow with the context; SMALL_OPS are those over per-(query head, table) arrays (searches,
# bucket bounds, the per-head max, sums and merge); each of these costs one host op (a thread
# fork/join); the other ~44 ops work on scalars and are left out.
COLLECT_PASSES = 18   # elementwise int64 passes over the candidates (entry ids, offsets, key ids, pair keys)
PAIR_PASSES = 6       # passes over the collected pairs (count filter, pair -> (b, head, key), group ids)
ROW_PASSES = 9        # passes over the sampled rows [N, D] (gathers, float casts, dot, norms, weighted V)
TAIL_OPS = 5          # float64 ops over the binomial tail [N, tables - m + 1] (xlogy, xlog1py, adds, logsumexp)
TAIL_TOUCHES = 8      # float64 array reads / writes per tail term (the ops' outputs, logsumexp's passes)
SMALL_OPS = 21
HOST_OPS = COLLECT_PASSES + PAIR_PASSES + ROW_PASSES + TAIL_OPS + SMALL_OPS
# The tail's arithmetic (two logarithms and an exponential per term), seconds per term on one
# core, measured on the development machine (AMD EPYC, 1 torch thread, log_sample_prob over
# 500-2000 cosines x 149 terms in cache: 16-21 ns, the fastest taken); an assumption on other
# hosts. Its memory traffic (TAIL_TOUCHES x 8 B per term) is priced on top at the DRAM rate.
TAIL_TERM_S = 16e-9
RATE_GRID = 4001      # points of the cos θ grid of expected_sample_rate(head_dim=...)
HASH_KERNELS = 6      # the query's SimHash on the compute device (matmul, sign, reshape, cast, weights, sum)
APPEND_KERNELS = 2    # the new token's K and V into the gpu segment
CACHE_LINE = 64       # bytes one probe of a binary search reads


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
        s = min(self.sinks, T)
        w = min(self.window, T - s)
        if layer < self.dense_layers:
            s, w = T, 0
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
    def gpu_layers(self, num_layers: int, prompt: int, head_dim: int):
        """Per layer: (gpu tokens before generation, hyperplane bytes) for a prompt of ``prompt``
        tokens: every prompt token in a dense layer; sinks + window (and the planes, when any
        token is left for the host) in a sampled one."""
        out = []
        for layer in range(num_layers):
            if layer < self.dense_layers:
                out.append((prompt, 0))
                continue
            s = min(self.sinks, prompt)
            w = min(self.window, prompt - s)
            out.append((s + w, head_dim * self.tables * self.bits * 4 if prompt - w > s else 0))
        return out

    def gpu_bytes(self, layers: int, batch: int, kv_heads: int, head_dim: int, dtype_bytes: int, prompt: int,
                  new_tokens: int, masked: bool) -> int:
        """Bytes this method allocates on the gpu tier for a run of that shape (what the ledger
        counts): per layer the gpu segment (its tokens + every generated one, K and V, + a mask
        byte per KV head when ``masked``) and the hyperplanes (float32 [D, tables x bits])."""
        per_token = batch * kv_heads * (2 * head_dim * dtype_bytes + (1 if masked else 0))
        return sum((n + new_tokens) * per_token + planes for n, planes in self.gpu_layers(layers, prompt, head_dim))

    def placement_for(self, gpu_kv_bytes: int, shape) -> "Optional[dict]":
        """Prompt KV and hash tables on the host tier, sinks + window + generated tokens and the
        hyperplanes on the GPU (:meth:`gpu_bytes`, masks counted): nothing to derive; refused
        when they do not fit."""
        from hybridgen.methods.placement import refuse

        need = self.gpu_bytes(shape.layers, shape.batch, shape.kv_heads, shape.head_dim, shape.dtype_bytes,
                              shape.prompt, shape.new_tokens, masked=True)
        if need > gpu_kv_bytes:
            raise refuse(self.name, need, gpu_kv_bytes, "its sinks, local window, generated tokens and hyperplanes")
        return {}

    # ------------------------------------------------------------------ performance model
    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost (:func:`magicpig_cost`; dense leading layers priced as dense GPU
        attention over the context, the mean layer taken)."""
        from baselines.layer_costs import mean_layer_cost
        from hybridgen.perf.costs import PARTIAL_KERNELS, gpu_resident_cost

        L = c.shape.num_layers
        dense = min(self.dense_layers, L)
        sampled = magicpig_cost(c, self.bits, self.tables, self.min_collisions, self.sinks + self.window, self.tier)
        if not dense:
            return sampled
        full_layer = gpu_resident_cost(c, c.S, c.fixed(gpu_kernels=PARTIAL_KERNELS + APPEND_KERNELS - 1),
                                       label="magicpig")
        return mean_layer_cost([full_layer] * dense + [sampled] * (L - dense), label="magicpig")


def magicpig_cost(c: "CostContext", bits: int, tables: int, min_collisions: int, gpu_tokens: int,
                  tier: str = "dram") -> "LayerCost":
    """PROJECTED MagicPIG layer as the code runs it (symbols: :mod:`hybridgen.perf.context`).

    n = S - gpu_tokens host keys per sequence; the sampled share u = the mean collection
    probability of keys in random directions (:func:`expected_sample_rate` with head_dim D);
    candidates N_c = B*Hq*L*n/2^K (one bucket per query head and table); sampled pairs
    N_s = B*Hq*n*u; J = L - m + 1 tail terms.

      pre  = SimHash of q (planes [D, L*K] read at HBM rate, or its FLOPs) + HASH_KERNELS and
             APPEND_KERNELS launches, then q + codes copied down (the host waits for them)
      cpu  = binary searches (2*B*Hq*L*log2 n probes of a cache line, gather rate)
             + bucket ids read (N_c x 4 B, gather rate) + COLLECT_PASSES int64 passes over N_c
             + the count (a sort of N_c int64 keys, at the top-k rate) + PAIR_PASSES over N_s
             + K and V rows of the sampled pairs (gather, at the KV tier) + ROW_PASSES fp32
             passes over [N_s, D] + the sampling probabilities (N_s*J tail terms: TAIL_TERM_S
             per term and core + TAIL_TOUCHES x 8 B) + HOST_OPS host ops; passes read and
             write (2x bytes) at the DRAM read rate
      gpu  = the exact partial over the gpu_tokens (unfused: logits, softmax, weighted sum)
      post = out + lse copied up, then the LSE merge (MERGE_KERNELS)
      attn = pre + overlap(cpu, gpu) + post;  layer = rest + attn  (no cross-layer overlap)
    """
    from hybridgen.perf.costs import MERGE_KERNELS, PARTIAL_KERNELS
    from hybridgen.perf.context import LayerCost

    key_tier, _ = c.tiers(tier)
    B, Hq, D, b = c.B, c.Hq, c.D, c.b
    n_gpu = min(c.S, gpu_tokens)
    n = c.S - n_gpu
    planes_bytes = D * tables * bits * 4
    cb = 2 if bits <= 15 else 4
    rate = expected_sample_rate(bits, tables, min_collisions, head_dim=D)
    sampled = B * Hq * n * rate
    candidates = B * Hq * tables * n * 0.5 ** bits
    J = tables - min_collisions + 1
    hbm, flops = c.hw.gpu.hbm_gbps * 1e9, c.hw.gpu.matmul_tflops * 1e12
    hash_s = max(planes_bytes / hbm, 2 * B * Hq * D * tables * bits / flops)
    pre_gpu = hash_s + c.fixed(gpu_kernels=HASH_KERNELS + APPEND_KERNELS)
    down = B * Hq * (D * b + tables * cb)
    up = B * Hq * (D * b + 4)
    dram = c.hw.host.dram_read_gbps * 1e9
    if n:
        search = c.gather_time(2 * B * Hq * tables * math.ceil(math.log2(max(n, 2))), CACHE_LINE, key_tier)
        buckets = c.gather_time(candidates, 4, key_tier)
        collect_s = COLLECT_PASSES * candidates * 8 * 2 / dram + c.topk_time(candidates * 8)
        pairs = PAIR_PASSES * sampled * 8 * 2 / dram
        rows = c.gather_time(sampled, 2 * D * b, key_tier) + ROW_PASSES * sampled * D * 4 * 2 / dram
        tail = sampled * J * (TAIL_TERM_S / (c.hw.host.cores or 1) + TAIL_TOUCHES * 8 / dram)
        cpu = search + buckets + collect_s + pairs + rows + tail + c.fixed(host_ops=HOST_OPS)
        xfer_down, xfer_up = c.copy(down), c.copy(up)
    else:
        search = buckets = collect_s = pairs = rows = tail = cpu = xfer_down = xfer_up = 0.0
    gpu_attn = c.gpu_attn(n_gpu) + c.fixed(gpu_kernels=PARTIAL_KERNELS - 1)
    merge = c.fixed(gpu_kernels=MERGE_KERNELS) if n else 0.0
    attn = pre_gpu + xfer_down + (c.overlap(cpu, gpu_attn) if n else gpu_attn) + xfer_up + merge
    resident = n_gpu + planes_bytes / (B * c.kv_tok) if n else n_gpu
    return LayerCost(attn=attn, layer=c.rest + attn, cpu=cpu, gpu=c.rest + pre_gpu + gpu_attn + merge,
                     transfer=xfer_down + xfer_up, gpu_tokens=resident,
                     breakdown={"hash_s": pre_gpu, "search_s": search, "bucket_s": buckets, "collect_s": collect_s,
                                "pairs_s": pairs, "rows_s": rows, "tail_s": tail, "candidates": candidates,
                                "sampled_pairs": sampled, "sample_rate": rate, "gpu_attn_s": gpu_attn,
                                "transfer_s": xfer_down + xfer_up, "rest_s": c.rest, "h2d_bytes": up,
                                "d2h_bytes": down, "host_kv_bytes": B * n * c.kv_tok,
                                "host_table_bytes": B * c.Hkv * tables * n * (cb + 4)},
                     label="magicpig")
