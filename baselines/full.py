"""Full attention: every token's KV on the gpu tier, dense attention. The reference, not a baseline."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from torch import Tensor

from hybridgen.attention import partial_attention
from hybridgen.kv import KVSegment
from hybridgen.methods import KVMethod, MethodContext, register


@register("full")
@dataclass
class Full(KVMethod):
    """Dense attention over the whole context with all KV on the gpu tier.

    Capacity for prompt + generated tokens is reserved at prefill, so decode never reallocates.
    """

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
        out, _ = partial_attention(q, seg.k, seg.v, self.ctx.scale, seg.mask)
        return out

    def release(self) -> None:
        for seg in getattr(self, "segments", []):
            if seg is not None:
                seg.release()
        self.segments = []
