"""FlexGen: KV cache offloaded to host memory and streamed to the GPU layer by layer.

Sheng et al., "FlexGen: High-Throughput Generative Inference of Large Language Models with
a Single GPU", ICML 2023. FlexGen places each tensor class (weights, activations, KV cache)
by a policy of GPU / CPU / disk percentages; the cached KV of layer l+1 is loaded to the
GPU on a separate CUDA stream while layer l computes (its zig-zag block schedule overlaps
load, compute and store). With ``cpu_cache_compute`` the attention over the cache is
computed on the CPU instead, so only the query and the output cross PCIe. Its compressed
cache stores the KV in 4 bits, group-wise (group 64) with per-group min and scale.

What we implement (only the KV cache is placed; weights stay on the compute device):
- ``gpu_budget`` (FlexGen's cache_gpu_percent / 100) of the KV lives on the gpu tier, the
  rest (its cache_cpu_percent) on ``host_tier``; at each decode step the host part of layer l is copied into a
  preallocated, double-buffered gpu-tier staging buffer (see :mod:`hybridgen.kv.transfer`),
  started at ``on_layer_input(l - 1)`` so it overlaps layer l - 1; dense attention over the
  GPU part, the staged host part and the new token, merged exactly by log-sum-exp.
- ``attention_on="cpu"``: the host part's attention runs on the CPU attention pool next to
  the host KV (q goes down, out + lse come up), concurrently with the GPU part.
- ``compress_kv``: host KV stored as 4-bit codes + (min, scale) per group
  (:mod:`baselines.quant`); the compressed bytes are what crosses PCIe, and they are
  dequantized on the GPU into a gpu-tier buffer.
- ``compress_gpu_kv``: the GPU part stored the same way (~3.5x more tokens in the same bytes
  at group 64), dequantized each step into a model-wide gpu-tier buffer of the GPU share;
  with ``compress_kv`` the whole cache is compressed, as FlexGen's compressed cache is
  (the ``flexgen-int4`` preset).

Choices where the paper is silent or which differ from it:
- the GPU/host split is by token (positions [0, n_gpu) of prompt + generated tokens, with
  n_gpu = gpu_budget.resolve(max length), rounded up), not along batch x heads as FlexGen's mixed
  device does: the same bytes, and it composes with append-only decoding; new tokens fill
  the GPU share first, then go to the host;
- the default policy is FlexGen's for long contexts: 0% GPU, 100% CPU; there is no disk tier;
- layer 0's copy starts at its own ``on_layer_input(0)`` (not during the previous step's
  last layer), so the first layer's transfer is not hidden; without the engine's hooks
  (method-level use) every copy happens in ``decode`` (still correct, nothing overlapped);
- on CUDA a partially filled host buffer is copied row by row (one async copy per batch x
  head), because a strided source would go through a pageable temporary;
- ``attention_on="cpu"`` with ``compress_kv`` dequantizes on the CPU into a transient buffer;
  the query goes down through :class:`hybridgen.kv.transfer.DeviceToHost` (pinned buffer +
  event) and the pool's worker waits on the event before reading it;
- the new token is attended at full precision on the compute device, where it is computed
  (also when it joins a compressed GPU part, and with ``attention_on="cpu"``, merged with the
  host partial); it is written to the host (quantized when compressing) after the step's attention;
- 'bytes_h2d' counts staged bytes (K, V, mask, or codes + meta); in CPU mode the output and
  LSE rows; 'bytes_d2h' counts KV written to the host (and q in CPU mode);
  'prefetched_ahead' counts copies started one layer ahead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, FrozenSet, List, Literal, Optional, Tuple

import torch
from torch import Tensor

from baselines import quant
from hybridgen.methods.tensors import needs_mask
from hybridgen.methods.tiered import TieredMethod
from hybridgen.attention import merge_partials
from hybridgen.attention.cuda import partial_attention  # flash / CuPy on CUDA, torch otherwise
from hybridgen.attention.cpu_pool import default_pool
from hybridgen.kv.transfer import DeviceToHost, HostToDevice, after_copy
from hybridgen.methods import Budget, MethodContext, PositiveInt


@dataclass
class FlexGen(TieredMethod):
    """KV offloaded to host memory, streamed to the GPU one layer ahead (or attended on CPU).

    gpu_budget: share of prompt + generated tokens whose KV lives on the gpu tier (FlexGen's
        cache_gpu_percent = 100 x gpu_budget; the rest, its cache_cpu_percent, on host_tier).
    host_tier: 'dram' or 'cxl'. attention_on: 'gpu' (stream KV) or 'cpu' (compute on host).
    compress_kv: 4-bit group-wise host KV (group_size elements per group).
    compress_gpu_kv: the GPU part 4-bit group-wise too.
    prefetch: start layer l+1's copy during layer l (False: copy on use).
    async_copy: use a CUDA stream when CUDA is there (False: the plain-copy fallback).
    """

    name: ClassVar[str] = "flexgen"
    # the per-layer runs `python -m hybridgen_harness.perf.validate` times against the projection
    # (hybridgen_harness.perf.local_rows.validation_methods): (row label, parameters on top of its gpu share)
    validation_rows: ClassVar[Tuple[Tuple[str, Dict[str, Any]], ...]] = (
        ("flexgen-stream", {}), ("flexgen-cpu", {"attention_on": "cpu"}),
        ("flexgen-int4", {"compress_kv": True, "compress_gpu_kv": True}))
    gpu_budget: Budget = Budget(ratio=0.0)
    host_tier: Literal["dram", "cxl"] = "dram"
    attention_on: Literal["gpu", "cpu"] = "gpu"
    compress_kv: bool = False
    compress_gpu_kv: bool = False
    group_size: PositiveInt = 64
    prefetch: bool = True
    async_copy: bool = True
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"host_tier", "attention_on", "prefetch", "async_copy"})

    def output_config(self) -> Dict[str, Any]:  # the split matters only when its parts are stored differently
        same = self.compress_kv == self.compress_gpu_kv
        return {k: v for k, v in super().output_config().items() if not (same and k == "gpu_budget")}

    def check(self) -> None:
        if self.compress_kv or self.compress_gpu_kv:
            quant.check_group(self.group_size)

    # ------------------------------------------------------------------ setup
    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.n_gpu, self.host_cap = self.split(ctx.max_len)
        self.gpu: List[Optional[object]] = [None] * L
        self.host: List[Optional[object]] = [None] * L  # KVSegment, or (codes, meta) segments
        self.stage: Optional[list] = None  # two staging slots, allocated at the first prefill
        self.deq = None
        self.gpu_deq = None  # compress_gpu_kv: the GPU part dequantized, [B, Hkv, n_gpu, D] (k, v)
        self.prefetcher = HostToDevice(ctx.compute_device, force_sync=not self.async_copy)
        self.staged_len = [0] * L
        self.pool = (ctx.pool or default_pool()) if self.attention_on == "cpu" else None
        self.q_down = DeviceToHost(ctx.compute_device)  # CPU attention: q -> pinned host buffer + event
        self.with_mask = False

    def _alloc_stage(self) -> None:
        """Two gpu-tier slots that can each hold one layer's host part (FlexGen's double buffer)."""
        ctx = self.ctx
        B, H, D, cap = ctx.batch_size, ctx.num_kv_heads, ctx.head_dim, self.host_cap
        self.stage = []
        for i in range(2):
            slot = {}
            if self.compress_kv:
                cb, me = quant.packed_shapes(D, self.group_size)
                for part in ("k", "v"):
                    slot[part] = self.buffer("gpu", f"shared/stage{i}/{part}_codes", (B, H, cap, cb), torch.uint8)
                    slot[part + "_meta"] = self.buffer("gpu", f"shared/stage{i}/{part}_meta", (B, H, cap, me), ctx.dtype)
            else:
                for part in ("k", "v"):
                    slot[part] = self.buffer("gpu", f"shared/stage{i}/{part}", (B, H, cap, D), ctx.dtype)
            if self.with_mask:
                slot["mask"] = self.buffer("gpu", f"shared/stage{i}/mask", (B, H, cap), torch.bool)
            self.stage.append(slot)
        if self.compress_kv:
            self.deq = {p: self.buffer("gpu", f"shared/dequant/{p}", (B, H, cap, D), ctx.dtype) for p in ("k", "v")}

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        T = k.shape[2]
        if layer == 0:
            self.with_mask = needs_mask(valid)
        g = min(self.n_gpu, T)
        m = (lambda a, b: None if valid is None else valid[:, a:b])
        if self.n_gpu > 0:
            if self.compress_gpu_kv:
                self.gpu[layer] = self._quant_segments("gpu", f"layer{layer}/gpu", self.n_gpu)
                self._append_quantized(self.gpu[layer], k[:, :, :g], v[:, :, :g], m(0, g))
                if self.gpu_deq is None:
                    shape = (ctx.batch_size, ctx.num_kv_heads, self.n_gpu, ctx.head_dim)
                    self.gpu_deq = {p: self.buffer("gpu", f"shared/gpu_dequant/{p}", shape, ctx.dtype) for p in "kv"}
            else:
                seg = self.segment("gpu", f"layer{layer}/gpu", self.n_gpu, self.with_mask)
                seg.append(k[:, :, :g], v[:, :, :g], m(0, g))
                self.gpu[layer] = seg
        if self.host_cap > 0:
            if self.compress_kv:
                self.host[layer] = self._quant_segments(self.host_tier, f"layer{layer}/host", self.host_cap)
            else:
                self.host[layer] = self.segment(self.host_tier, f"layer{layer}/host", self.host_cap, self.with_mask)
            self._host_append(layer, k[:, :, g:], v[:, :, g:], m(g, T))
            if self.attention_on == "gpu" and self.stage is None:
                self._alloc_stage()

    # ------------------------------------------------------------------ storage
    def _quant_segments(self, tier: str, owner: str, cap: int):
        """(codes, meta) KVSegments of ``cap`` tokens on ``tier``: 4-bit codes [B, Hkv, cap, cb]
        uint8 (+ the mask) and (min, scale) meta [B, Hkv, cap, me] in the model dtype."""
        cb, me = quant.packed_shapes(self.ctx.head_dim, self.group_size)
        return (self.segment(tier, f"{owner}_codes", cap, self.with_mask, head_dim=cb, dtype=torch.uint8),
                self.segment(tier, f"{owner}_meta", cap, False, head_dim=me, dtype=self.ctx.dtype))

    def _append_quantized(self, pair, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> int:
        """k, v [B, Hkv, n, D] quantized onto ``pair`` (codes, meta); returns the bytes written."""
        if k.shape[2] == 0:
            return 0
        ck, mk = quant.quantize(k, self.group_size)
        cv, mv = quant.quantize(v, self.group_size)
        codes, meta = pair
        codes.append(ck.to(codes.device), cv.to(codes.device), None if mask is None else mask.to(codes.device))
        meta.append(mk.to(meta.device), mv.to(meta.device))
        return sum(self.kv_bytes(t) for t in (ck, cv, mk, mv))

    def _gpu_len(self, layer: int) -> int:
        gpu = self.gpu[layer]
        if gpu is None:
            return 0
        return gpu[0].length if self.compress_gpu_kv else gpu.length

    def _gpu_kv(self, layer: int):
        """(k, v, mask) of the GPU part (dequantized into the GPU share's buffer when compressed),
        or None when it holds nothing."""
        gpu, n = self.gpu[layer], self._gpu_len(layer)
        if not n:
            return None
        if not self.compress_gpu_kv:
            return gpu.k, gpu.v, gpu.mask
        codes, meta = gpu
        D = self.ctx.head_dim
        return (quant.dequantize(codes.k, meta.k, D, self.group_size, out=self.gpu_deq["k"].t[:, :, :n]),
                quant.dequantize(codes.v, meta.v, D, self.group_size, out=self.gpu_deq["v"].t[:, :, :n]), codes.mask)

    def _host_append(self, layer: int, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> None:
        if k.shape[2] == 0:
            return
        host = self.host[layer]
        if self.compress_kv:
            self.count("bytes_d2h", self._append_quantized(host, k, v, mask))
        else:
            host.append(k.to(host.device), v.to(host.device), None if mask is None else mask.to(host.device))
            self.count("bytes_d2h", self.kv_bytes(k) + self.kv_bytes(v))

    def _host_len(self, layer: int) -> int:
        host = self.host[layer]
        if host is None:
            return 0
        return host[0].length if self.compress_kv else host.length

    # ------------------------------------------------------------------ streaming
    def _start_fetch(self, layer: int) -> None:
        """Enqueue the copy of ``layer``'s host part into staging slot layer % 2."""
        if self.attention_on != "gpu" or layer >= self.ctx.num_layers or self.prefetcher.pending(layer):
            return
        n = self._host_len(layer)
        self.staged_len[layer] = n
        if n == 0:
            return
        slot = self.stage[layer % 2]
        host = self.host[layer]
        if self.compress_kv:
            codes, meta = host
            pairs = [(slot["k"].t[:, :, :n], codes.k), (slot["v"].t[:, :, :n], codes.v),
                     (slot["k_meta"].t[:, :, :n], meta.k), (slot["v_meta"].t[:, :, :n], meta.v)]
            mask = codes.mask
        else:
            pairs = [(slot["k"].t[:, :, :n], host.k), (slot["v"].t[:, :, :n], host.v)]
            mask = host.mask
        if mask is not None:
            pairs.append((slot["mask"].t[:, :, :n], mask))
        self.count("bytes_h2d", self.prefetcher.start(layer, pairs))

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        if self.attention_on != "gpu":
            return
        self._start_fetch(layer)  # no-op when already in flight
        if self.prefetch and layer + 1 < self.ctx.num_layers and not self.prefetcher.pending(layer + 1):
            self._start_fetch(layer + 1)
            self.count("prefetched_ahead", 1)

    def _staged(self, layer: int):
        """(k, v, mask) of ``layer``'s host part on the compute device, after the copy landed."""
        self._start_fetch(layer)
        self.prefetcher.wait(layer)
        n = self.staged_len[layer]
        slot = self.stage[layer % 2]
        mask = slot["mask"].t[:, :, :n] if "mask" in slot else None
        if self.compress_kv:
            D = self.ctx.head_dim
            k = quant.dequantize(slot["k"].t[:, :, :n], slot["k_meta"].t[:, :, :n], D, self.group_size,
                                 out=self.deq["k"].t[:, :, :n])
            v = quant.dequantize(slot["v"].t[:, :, :n], slot["v_meta"].t[:, :, :n], D, self.group_size,
                                 out=self.deq["v"].t[:, :, :n])
            return k, v, mask
        return slot["k"].t[:, :, :n], slot["v"].t[:, :, :n], mask

    def _host_kv_cpu(self, layer: int):
        """(k, v, mask) of the host part on the host (dequantized when compressed)."""
        host = self.host[layer]
        if self.compress_kv:
            codes, meta = host
            D = self.ctx.head_dim
            return (quant.dequantize(codes.k, meta.k, D, self.group_size),
                    quant.dequantize(codes.v, meta.v, D, self.group_size), codes.mask)
        return host.k, host.v, host.mask

    # ------------------------------------------------------------------ decode
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scale = self.ctx.scale
        gpu = self.gpu[layer]
        new_on_gpu = gpu is not None and self._gpu_len(layer) < self.n_gpu
        # the new token on its own, at full precision: unless it joins an uncompressed GPU part
        own_new = not new_on_gpu or self.compress_gpu_kv
        if self.compress_gpu_kv:
            gpu_kv = self._gpu_kv(layer)  # before the new token joins it
            if new_on_gpu:
                self._append_quantized(gpu, k, v, None)
        else:
            if new_on_gpu:
                gpu.append(k, v)
            gpu_kv = self._gpu_kv(layer)
        parts = []
        if self.attention_on == "gpu":
            if self._host_len(layer) > 0 or self.prefetcher.pending(layer):
                sk, sv, sm = self._staged(layer)
                if sk.shape[2]:
                    parts.append(partial_attention(q, sk, sv, scale, sm))
            if own_new:
                parts.append(partial_attention(q, k, v, scale))
            if not new_on_gpu:
                self._host_append(layer, k, v, None)
            if gpu_kv is not None:
                parts.append(partial_attention(q, *gpu_kv[:2], scale, gpu_kv[2]))
        else:
            fut = None
            if self._host_len(layer) > 0:
                hk, hv, hm = self._host_kv_cpu(layer)
                q_host, q_ready = self.q_down.send(layer, q)  # the worker waits on q_ready first
                self.count("bytes_d2h", self.kv_bytes(q))
                fut = self.pool.submit(after_copy, q_ready, partial_attention, q_host, hk, hv, scale, hm)
            if gpu_kv is not None:
                parts.append(partial_attention(q, *gpu_kv[:2], scale, gpu_kv[2]))
            if own_new:
                parts.append(partial_attention(q, k, v, scale))
            if fut is not None:
                h_out, h_lse = fut.result()
                self.count("bytes_h2d", self.kv_bytes(h_out) + self.kv_bytes(h_lse))
                parts.append((h_out.to(q.device), h_lse.to(q.device)))
            if not new_on_gpu:
                self._host_append(layer, k, v, None)
        out, _ = merge_partials(parts)
        return out

    def release(self) -> None:
        if getattr(self, "prefetcher", None) is not None:
            self.prefetcher.drain()
        super().release()
        self.gpu, self.host, self.stage, self.deq, self.gpu_deq = [], [], None, None, None

    # ------------------------------------------------------------------ memory, placement, cost
    def split(self, context: int) -> Tuple[int, int]:
        """(gpu tokens, host tokens) per row and layer of a ``context``-token run (what bind allocates)."""
        n_gpu = self.gpu_budget.resolve(context)
        return n_gpu, context - n_gpu

    def footprint(self, shape: "KVShape") -> "Footprint":
        """Per layer n = gpu_budget.resolve(context) tokens on the gpu tier and the rest on
        ``host_tier`` (4-bit codes + per-group meta when ``compress_kv``; the GPU part too when
        ``compress_gpu_kv``, plus a model-wide K/V dequantisation buffer of its n tokens); attention on the GPU adds two
        model-wide staging slots of one layer's host part (+ two dequantisation buffers when
        compressed). Masks: one byte per KV head and token when padded."""
        from hybridgen.methods.footprint import Footprint, add_bytes

        L, B, H, D, b, m = shape.layers, shape.batch, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.mask_bytes
        n_gpu, host = self.split(shape.context)
        cb, me = quant.packed_shapes(D, self.group_size)
        packed_tok, plain_tok = B * (2 * H * cb + m + 2 * H * me * b), B * (shape.token_bytes + m)  # codes (+ mask), meta
        host_tok = packed_tok if self.compress_kv else plain_tok
        dequant = 2 * B * H * host * D * b if self.compress_kv else 0
        gpu_tok = packed_tok if self.compress_gpu_kv else plain_tok
        gpu_dequant = 2 * B * H * n_gpu * D * b if self.compress_gpu_kv and n_gpu else 0
        shared = 2 * host * host_tok + dequant if self.attention_on == "gpu" and host > 0 else 0
        return Footprint(gpu_tokens=n_gpu, host_tokens=host, staging_tokens=2 * host if shared else 0,
                         tier_bytes=add_bytes({"gpu": L * n_gpu * gpu_tok + shared + gpu_dequant},
                                              {self.host_tier: L * host * host_tok}),
                         shared_gpu_bytes=shared + gpu_dequant)

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """FlexGen's cache_gpu_percent from the budget: the largest gpu share whose footprint
        (with the staging slots when attention is on the GPU) fits; when even the slots alone do
        not, the host part is attended on the CPU (FlexGen's cpu_cache_compute), which needs none."""
        from hybridgen.errors import ConfigError
        from hybridgen.methods.footprint import fit_share
        from hybridgen.methods.placement import as_budget

        if self.attention_on == "gpu":
            try:
                return fit_share(self, gpu_kv_bytes, shape, lambda n: {"gpu_budget": as_budget(n)})
            except ConfigError:
                pass
        return fit_share(self, gpu_kv_bytes, shape, lambda n: {"gpu_budget": as_budget(n), "attention_on": "cpu"})

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost (:func:`baselines.flexgen_cost.flexgen_cost`); memory: the
        footprint (compressed GPU part: ~3.5x the GPU tokens in the same bytes)."""
        from baselines.flexgen_cost import flexgen_cost
        from hybridgen.methods.footprint import with_memory

        shape = c.kv_shape()
        lay = flexgen_cost(c, c.fraction(self.gpu_budget), self.group_size, self.compress_kv, self.compress_gpu_kv,
                           self.attention_on, self.host_tier)
        return with_memory(lay, self.footprint(shape), shape)
