"""What a method's cost function works with: the shared quantities of one prediction and the
device / host primitives, and what it returns (one layer's costs).

Symbols (per layer, per decode step): B batch, S context tokens, Hq / Hkv query / KV heads,
D head dim, b bytes per KV element; S_g / S_h the context tokens a method keeps on the GPU /
on the host (:meth:`CostContext.split` of its ``gpu_budget``).

  kv_tok  = 2*Hkv*D*b            K+V bytes of one token of one sequence
  key_tok = Hkv*D*b
  gpu_attn(n)  = B*n*kv_tok / R_gpu + launch     R_gpu = gpu.attention_gbps (fused: ``full``, and
                 the dispatcher's partials of 16-bit KV on a real GPU, ``partial_fused``: torch's
                 flash kernel with its LSE) or, for the unfused partials of a GQA layer
                 (Hq > Hkv), gpu.gqa_attention_gbps
  gpu_keys(n) / gpu_values(n): the logits half / the weighted-sum half of gpu_attn(n)
  rest         = max(W_layer / gpu.hbm_gbps, 2*B*P_layer / gpu.matmul_tflops) + 10*launch
                 (W_layer, P_layer: bytes / parameters of the layer's projections and MLP)
  copy(x)      = x / link.h2d_pinned_gbps + link.latency  (pageable=True: h2d_pageable_gbps)
  fixed(h, g, s) = h*host.op_us + g*launch + s*link.latency   (h host ops, g GPU kernels, s syncs
                 of a layer: the per-layer cost that does not scale with the context)
  overlap(a, b)  = max(a, b); a + b when gpu.emulated_on_host (both branches on the same cores)
  host reads of a tier: keys/values on DRAM or on CXL read at min(kernel rate, tier read bandwidth);
  spill f (``spill``, :mod:`hybridgen.perf.host_tiers`): the share of the method's DRAM bytes that
  lives on CXL; a read of n bytes from 'dram' is (1-f)*n from DRAM + f*n from CXL (tier_shares),
  each at its own rate; a host->GPU copy of them at min(link, tier read) per share (host_copy)
  kernel rates over pinned host memory (``pinned``: where the host KV lives; default: pinned
  whenever the profile has a real GPU, as ``kv/tiers.py`` does) use host.*_pinned_gbps

Choice: a CXL gather pays ``rows * added_latency / (cores * 10)`` on top of its bytes (about
ten outstanding misses per core).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

from hybridgen.errors import ConfigError
from hybridgen.methods.budget import Budget
from hybridgen.methods.footprint import KVShape
from hybridgen.perf.profiles import HardwareProfile, available_profiles
from hybridgen.shapes import ModelShape, Workload

REST_KERNELS = 10          # kernel launches of a layer outside attention (norms, projections, MLP)
MISSES_PER_CORE = 10       # outstanding cache misses per core (CXL gather latency term)

# A host-KV placement: a mapping name ('semantic' | 'dram' | 'cxl' | 'interleaved') or an
# explicit (key tier, value tier) pair such as ('dram', 'cxl').
Placement = Union[str, Tuple[str, str]]


@dataclass
class LayerCost:
    """Per-layer costs of one method at one workload (seconds; bytes and counts in breakdown).

    attn: attention of the layer run alone; layer: steady-state per-layer time inside the model
    (with the method's cross-layer overlap); cpu / gpu / transfer: the branches' busy times;
    gpu_tokens: KV tokens resident on the GPU per layer; staging_tokens: KV tokens of model-wide
    GPU staging buffers (not per layer); label: which cost function priced it.
    """

    attn: float
    layer: float
    cpu: float = 0.0
    gpu: float = 0.0
    transfer: float = 0.0
    gpu_tokens: float = 0.0
    staging_tokens: float = 0.0
    breakdown: Dict[str, float] = field(default_factory=dict)
    label: str = ""


class CostContext:
    """Shared quantities of one prediction (model shape x workload x hardware profile).

    Attributes: shape, w (the Workload), hw (the HardwareProfile); B, S, Hq, Hkv, D, b,
    kv_tok, key_tok (bytes, see the module docstring); launch, link_lat (s); rest (s: the
    layer outside attention), head (s: the LM head), weights_bytes; spill: the share of the
    method's DRAM-placed host bytes that spilled to CXL (0 until ``predict_step`` sets it from
    the method's footprint, :mod:`hybridgen.perf.host_tiers`); measured: what an emulated run of
    the method measured, for its cost to price instead of an assumption (e.g. InfiniGen's
    'fetch_fraction'; ``predict_step(..., measured=...)``; empty: none).
    """

    def __init__(self, shape: ModelShape, w: Workload, hw: HardwareProfile):
        self.shape, self.w, self.hw = shape, w, hw
        g = hw.gpu
        for fname in ("hbm_gbps", "attention_gbps", "matmul_tflops", "memory_gb"):
            if getattr(g, fname) is None:
                raise ConfigError(f"profile {hw.name!r} has no gpu.{fname} (no GPU was measured); "
                                  f"use a GPU profile: {', '.join(available_profiles())}")
        if hw.link.h2d_pinned_gbps is None:
            raise ConfigError(f"profile {hw.name!r} has no link.h2d_pinned_gbps; use a GPU profile")
        if hw.host.dram_read_gbps is None:
            raise ConfigError(f"profile {hw.name!r} has no host.dram_read_gbps; fix the profile")
        self.B, self.S = w.batch, w.context
        self.Hq, self.Hkv, self.D = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.b = w.kv_bytes
        self.kv_tok = 2 * self.Hkv * self.D * self.b
        self.key_tok = self.Hkv * self.D * self.b
        self.launch = (g.launch_us or 0.0) * 1e-6
        self.link_lat = (hw.link.latency_us or 0.0) * 1e-6
        self.op = (hw.host.op_us or 0.0) * 1e-6
        self.emulated = bool(g.emulated_on_host)
        wb = shape.weight_bytes
        layer_bytes = shape.layer_params * wb
        self.rest = max(layer_bytes / (g.hbm_gbps * 1e9),
                        2 * self.B * shape.layer_params / (g.matmul_tflops * 1e12)) + REST_KERNELS * self.launch
        head_params = shape.vocab_size * shape.hidden_size
        self.head = max(head_params * wb / (g.hbm_gbps * 1e9), 2 * self.B * head_params / (g.matmul_tflops * 1e12))
        self.weights_bytes = shape.weights_bytes()
        self.spill = 0.0
        self.measured: Dict[str, float] = {}

    def kv_shape(self):
        """This prediction's workload as a :class:`hybridgen.methods.footprint.KVShape`, the
        shape a method's ``footprint`` takes (the cost's gpu_tokens derive from it): the S
        context tokens, an unpadded batch (no validity masks)."""
        return KVShape(self.shape.num_layers, self.Hkv, self.D, self.b, self.B, self.S, masked=False)

    # -- a method's budgets ------------------------------------------------------------
    def fraction(self, budget: Any) -> float:
        """A Budget (or budget text / number) as a fraction of the context: its ratio, or its
        token count divided by S (at most 1)."""
        bud = Budget.parse(budget)
        if bud.ratio is not None:
            return float(bud.ratio)
        return min(1.0, bud.tokens / self.S)

    def split(self, gpu_budget: Any) -> Tuple[int, int]:
        """(S_g, S_h): context tokens on the GPU and on the host for a method's gpu_budget;
        S_h = round((1 - fraction(gpu_budget)) * S), S_g = S - S_h."""
        S_h = int(round((1.0 - self.fraction(gpu_budget)) * self.S))
        return self.S - S_h, S_h

    # -- device primitives -------------------------------------------------------------
    def gpu_rate(self, fused: bool = False) -> float:
        """GB/s of KV read by GPU decode attention: the fused kernel's (``fused``, or an MHA
        layer) or the unfused GQA partial's (gpu.gqa_attention_gbps when the profile has it)."""
        g = self.hw.gpu
        if fused or self.Hq == self.Hkv or g.gqa_attention_gbps is None:
            return g.attention_gbps
        return g.gqa_attention_gbps

    @property
    def partial_fused(self) -> bool:
        """A partial attention through the GPU dispatcher (:func:`hybridgen.attention.cuda.partial_attention`:
        hybrid-exact's and FlexGen's GPU parts) runs torch's flash kernel with its LSE: 16-bit KV on
        a real GPU (:mod:`hybridgen.attention.cuda.flash`); fp32 and a CPU-emulated GPU run unfused."""
        return self.w.dtype_key in ("bf16", "fp16") and not self.emulated

    def gpu_attn(self, tokens: float, fused: bool = False) -> float:
        """Dense decode attention over ``tokens`` KV tokens per sequence on the GPU."""
        return self.B * tokens * self.kv_tok / (self.gpu_rate(fused) * 1e9) + self.launch

    def gpu_keys(self, tokens: float) -> float:
        """The logits half of an unfused GPU partial: q . K over ``tokens`` keys (+ one launch)."""
        return self.B * tokens * self.key_tok / (self.gpu_rate() * 1e9) + self.launch

    def gpu_values(self, rows: float) -> float:
        """The weighted-sum half of an unfused GPU partial: ``rows`` V rows per (sequence, KV
        head) (+ one launch)."""
        return self.B * rows * self.key_tok / (self.gpu_rate() * 1e9) + self.launch

    def copy(self, nbytes: float, src_gbps: Optional[float] = None, pageable: bool = False) -> float:
        """A host->GPU copy of nbytes (pinned rate, pageable's when ``pageable``, or the
        source's read rate if slower)."""
        bw = self.link_gbps(pageable)
        if src_gbps is not None:
            bw = min(bw, src_gbps)
        return nbytes / (bw * 1e9) + self.link_lat if nbytes > 0 else 0.0

    def link_gbps(self, pageable: bool = False) -> float:
        """The host->GPU link's copy bandwidth (GB/s): pinned, or pageable's when ``pageable``."""
        link = self.hw.link
        return (link.h2d_pageable_gbps or link.h2d_pinned_gbps) if pageable else link.h2d_pinned_gbps

    def fixed(self, host_ops: float = 0, gpu_kernels: float = 0, syncs: float = 0) -> float:
        """The per-layer cost that does not scale with the context: host ops x host.op_us +
        GPU kernels x gpu.launch_us + synchronised copies x link.latency_us."""
        return host_ops * self.op + gpu_kernels * self.launch + syncs * self.link_lat

    def overlap(self, a: float, b: float) -> float:
        """Two concurrent branches: max(a, b), or a + b when the 'gpu' is the host's own cores."""
        return a + b if self.emulated else max(a, b)

    # -- host kernels ------------------------------------------------------------------
    def host_pinned(self, pinned: Optional[bool]) -> bool:
        """Whether host KV is page-locked: ``pinned``, or by default whenever the profile has a
        real GPU (``kv/tiers.py`` pins host tiers when CUDA exists)."""
        return (not self.emulated) if pinned is None else bool(pinned)

    def scan_rate(self, pinned: Optional[bool] = None) -> float:
        """GB/s of the key scan over the host keys: host.key_scan_pinned_gbps when the keys are
        pinned and the table has the workload's dtype, else host.key_scan_gbps."""
        host = self.hw.host
        if self.host_pinned(pinned) and self.w.dtype_key in host.key_scan_pinned_gbps:
            return host.key_scan_pinned_gbps[self.w.dtype_key]
        return self.rate(host.key_scan_gbps, host.dram_read_gbps)

    def bf16dot_scan_rate(self, pinned: Optional[bool] = None) -> Tuple[float, bool]:
        """(GB/s of bf16 keys through the bf16-dot selection scan, measured):
        host.key_scan_bf16dot_gbps, else the key scan's rate (an assumption: measured False)."""
        got = self.hw.host.key_scan_bf16dot_gbps
        return (got, True) if got else (self.scan_rate(pinned), False)

    def sketch_rate(self, kind: str) -> Tuple[float, bool]:
        """(GB/s of key-sketch bytes the sketch scan reads, measured): host.key_sketch_gbps[kind],
        else the pageable key scan's rate (an assumption: measured False)."""
        got = self.hw.host.key_sketch_gbps.get(kind)
        return (got, True) if got else (self.scan_rate(pinned=False), False)

    def cpu_attention_rate(self, pinned: Optional[bool] = None) -> float:
        """GB/s of CPU decode attention over the host KV (pinned table as in :meth:`scan_rate`)."""
        host = self.hw.host
        if self.host_pinned(pinned) and self.w.dtype_key in host.cpu_attention_pinned_gbps:
            return host.cpu_attention_pinned_gbps[self.w.dtype_key]
        return self.rate(host.cpu_attention_gbps, host.dram_read_gbps)

    def topk_time(self, score_bytes: float) -> float:
        """A top-k over score_bytes of fp32 scores (host.topk_gbps; the read bandwidth if unset)."""
        return score_bytes / ((self.hw.host.topk_gbps or self.hw.host.dram_read_gbps) * 1e9)

    def group_score_time(self, logit_bytes: float) -> float:
        """Reducing logit_bytes of fp32 logits to one score per KV group (host.group_score_gbps,
        else host.topk_gbps, else the read bandwidth)."""
        host = self.hw.host
        return logit_bytes / ((host.group_score_gbps or host.topk_gbps or host.dram_read_gbps) * 1e9)

    def select_time(self, logit_bytes: float, score_bytes: float, per_head: bool) -> Tuple[float, float, bool]:
        """(group score s, top-k s, fused) of a selection over logit_bytes of fp32 logits: the
        code's fused C selection at host.select_gbps (all in the top-k term), else torch's group
        score (shared selection only) + a top-k over score_bytes of scores (fused False)."""
        host = self.hw.host
        if host.select_gbps:
            return 0.0, logit_bytes / (host.select_gbps * 1e9), True
        return (0.0 if per_head else self.group_score_time(logit_bytes)), self.topk_time(score_bytes), False

    def rate(self, table: Dict[str, float], fallback: Optional[float]) -> float:
        """A host kernel's rate (GB/s) for the workload's dtype, bf16's, or ``fallback``."""
        val = table.get(self.w.dtype_key) or table.get("bf16") or fallback
        if val is None:
            raise ConfigError(f"profile {self.hw.name!r} has no host rate for dtype {self.w.dtype_key}")
        return val

    # -- host tiers ----------------------------------------------------------------------
    def tiers(self, method_default: Placement) -> Tuple[str, str]:
        """(key tier, value tier) of the host KV: 'dram', 'cxl' or 'interleaved'.

        The workload's ``mapping`` overrides the method's own placement; without a CXL node
        everything is on DRAM.
        """
        mapping = self.w.mapping or method_default
        has_cxl = self.hw.cxl is not None
        if isinstance(mapping, tuple):
            return tuple(t if has_cxl else "dram" for t in mapping)  # type: ignore[return-value]
        if mapping == "semantic":
            return "dram", ("cxl" if has_cxl else "dram")
        if mapping in ("cxl", "interleaved") and not has_cxl:
            return "dram", "dram"
        return mapping, mapping

    def tier_read(self, tier: str) -> float:
        """Read bandwidth (GB/s) of a host tier ('interleaved': pages alternate between nodes)."""
        dram = self.hw.host.dram_read_gbps
        if tier == "dram" or self.hw.cxl is None:
            return dram
        if tier == "cxl":
            return self.hw.cxl.read_gbps
        return 2 / (1 / dram + 1 / self.hw.cxl.read_gbps)

    def tier_shares(self, tier: str) -> Tuple[Tuple[str, float], ...]:
        """Where the bytes a cost reads from ``tier`` (as c.tiers names it) live: ((tier, share),
        ...); 'dram' with a spill f > 0 onto a CXL node is ((dram, 1-f), (cxl, f))."""
        if tier == "dram" and self.spill > 0 and self.hw.cxl is not None:
            return (("cxl", 1.0),) if self.spill >= 1 else (("dram", 1.0 - self.spill), ("cxl", self.spill))
        return ((tier, 1.0),)

    def host_rates(self) -> Dict[str, float]:
        """The breakdown's statement of the host tiers a cost read: the spill fraction and the
        DRAM / CXL read bandwidths (GB/s; CXL 0 without a CXL node)."""
        return {"cxl_spill_fraction": self.spill, "dram_gbps": self.hw.host.dram_read_gbps,
                "cxl_gbps": self.hw.cxl.read_gbps if self.hw.cxl is not None else 0.0}

    def stream_time(self, nbytes: float, kernel_gbps: float, tier: str) -> float:
        """A dense host pass over nbytes on ``tier`` by a kernel that runs at kernel_gbps (each
        share of :meth:`tier_shares` at min(kernel, its tier's read bandwidth))."""
        return sum(nbytes * s / (min(kernel_gbps, self.tier_read(t)) * 1e9) for t, s in self.tier_shares(tier))

    def host_copy(self, nbytes: float, tier: Placement, pageable: bool = False) -> float:
        """A host->GPU copy of nbytes that live on ``tier`` (or, for a (key tier, value tier)
        pair, half on each): each share of :meth:`tier_shares` at min(link, its tier's read
        bandwidth), one link latency."""
        halves = tier if isinstance(tier, tuple) else (tier,)
        shares: Dict[str, float] = {}
        for h in halves:
            for t, s in self.tier_shares(h):
                shares[t] = shares.get(t, 0.0) + s / len(halves)
        if nbytes <= 0 or len(shares) == 1:
            return self.copy(nbytes, self.tier_read(next(iter(shares))), pageable)
        link = self.link_gbps(pageable)
        return sum(nbytes * s / (min(link, self.tier_read(t)) * 1e9) for t, s in shares.items()) + self.link_lat

    def gather_time(self, rows: float, row_bytes: float, tier: str) -> float:
        """A host gather of ``rows`` rows of row_bytes each on ``tier`` (each share of
        :meth:`tier_shares`: its rows at the slower of the tier's read bandwidth and
        host.gather_gbps (random rows), + the CXL latency term)."""
        return sum(self._gather_one(rows * s, row_bytes, t) for t, s in self.tier_shares(tier))

    def _gather_one(self, rows: float, row_bytes: float, tier: str) -> float:
        bw = self.tier_read(tier)
        if self.hw.host.gather_gbps:
            bw = min(bw, self.hw.host.gather_gbps)
        t = rows * row_bytes / (bw * 1e9)
        if tier in ("cxl", "interleaved") and self.hw.cxl is not None:
            share = 1.0 if tier == "cxl" else 0.5
            mlp = max(1, (self.hw.host.cores or 1) * MISSES_PER_CORE)
            t += share * rows * self.hw.cxl.added_latency_ns * 1e-9 / mlp
        return t
