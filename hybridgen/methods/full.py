"""Full attention: every token's KV on the gpu tier, dense attention. The reference, not a baseline."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridgen.attention import partial_attention
from hybridgen.kv import KVSegment
from hybridgen.methods.protocol import KVMethod, MethodContext

#: SDPA backends of a decode step, in torch's order, without cuDNN's: cuDNN builds an execution
#: graph per key length, and a decode step's length is new every step (on the H200 every step of
#: a Llama-3.1-8B layer took ~60 ms of graph building whatever the context, against ~0.1-1 ms of
#: attention: ``results/gpu/``)
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_decode(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Torch's scaled_dot_product_attention (flash / memory-efficient on CUDA: DECODE_BACKENDS) over GQA KV.

    The G = Hq / Hkv query heads of a KV head are G query rows over its keys (no causal mask at
    one decode token), so every backend takes it without repeating KV heads.
    q [B, Hq, 1, D]; k, v [B, Hkv, T, D] (views with stride 1 in D); returns [B, Hq, 1, D].
    """
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    with sdpa_kernel(DECODE_BACKENDS):
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), k, v, scale=scale)
    return out.reshape(B, Hq, 1, D)


def dense_decode(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor] = None) -> Tensor:
    """``full``'s decode attention over all of a layer's KV: torch's fused SDPA on CUDA without a
    mask (:func:`sdpa_decode`), ``partial_attention`` otherwise. HybridGen runs this very
    function when a layer has nothing on the host, so both give the same bits.

    q [B, Hq, 1, D]; k, v [B, Hkv, T, D]; mask [B, Hkv, T]-broadcastable bool or None.
    Returns [B, Hq, 1, D] in q's dtype.
    """
    if q.is_cuda and mask is None:  # the GPU reference runs torch's fused kernels, not ours
        return sdpa_decode(q, k, v, scale)
    out, _ = partial_attention(q, k, v, scale, mask)
    return out


@dataclass
class Full(KVMethod):
    """Dense attention over the whole context with all KV on the gpu tier.

    Capacity for prompt + generated tokens is reserved at prefill, so decode never reallocates.
    Decode runs :func:`dense_decode`: on CUDA without padding torch's fused SDPA, so the
    reference is as fast as torch makes dense attention; elsewhere ``partial_attention``.
    """

    name: ClassVar[str] = "full"

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.segments: List[Optional[KVSegment]] = [None] * ctx.num_layers

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        seg = KVSegment(ctx.store["gpu"], k.shape[0], ctx.num_kv_heads, ctx.head_dim, k.dtype,
                        f"layer{layer}/gpu", capacity=ctx.max_len,
                        with_mask=valid is not None and not bool(valid.all()))
        seg.append(k, v, valid)
        self.segments[layer] = seg

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        seg = self.segments[layer]
        seg.append(k, v)
        return dense_decode(q, seg.k, seg.v, self.ctx.scale, seg.mask)

    def release(self) -> None:
        for seg in getattr(self, "segments", []):
            if seg is not None:
                seg.release()
        self.segments = []

    def footprint(self, shape: "KVShape") -> "Footprint":
        """Every token's KV (and its mask when padded) on the gpu tier, per layer."""
        from hybridgen.methods.footprint import Footprint

        return Footprint(gpu_tokens=shape.context, tier_bytes={"gpu": shape.kv_bytes(shape.context)})

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """All KV on the GPU: nothing to derive; refused when its footprint does not fit."""
        from hybridgen.methods.footprint import fit_first

        return fit_first(self, gpu_kv_bytes, shape, [{}], "the whole KV cache")

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost: dense attention over the whole context on the GPU."""
        from hybridgen.methods.footprint import with_memory
        from hybridgen.perf.costs import full_cost

        shape = c.kv_shape()
        return with_memory(full_cost(c), self.footprint(shape), shape)
