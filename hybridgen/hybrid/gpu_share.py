"""HybridGen's GPU share of a layer's decode attention: fused, and joined to the host by the LSE merge.

Two cases, chosen per layer and step by :meth:`HybridGen.decode <hybridgen.hybrid.method.HybridGen.decode>`:

- nothing on the host (no host token, no streamed slice, the new token in the gpu
  segment): :func:`hybridgen.methods.full.dense_decode`, ``full``'s own decode attention (torch's
  fused SDPA on CUDA without padding, ``partial_attention`` otherwise), on the gpu segment, so
  the output is ``full``'s bit for bit where the segment holds the same tokens in the same order;
- host tokens: the gpu segment is attended before the wait for the CPU branch by the fused
  partial attention that returns the log-sum-exp (:func:`gpu_share_partial`: on CUDA torch's
  flash kernel with its LSE, :mod:`hybridgen.attention.cuda.flash`, or the CuPy kernel for masked
  and fp32 KV; torch's ``partial_attention`` otherwise), and after
  the wait :func:`merge_with_host` joins it to the CPU's shipped part (and a three-way streamed
  slice) by the exact LSE merge: the partial enters the one softmax as ONE entry per query
  head with logit ``lse`` and value ``out`` (exp(lse) * out is the share's unnormalised sum),
  as ``ship='partial'``'s host part does (:mod:`hybridgen.hybrid.ship`).

Shapes: q [B, Hq, 1, D]; gpu K/V [B, Hkv, T, D]; a softmax part is (logits [B, Hq, 1, m],
values [B, Hkv or Hq, m, D]) as :func:`hybridgen.attention.softmax_over_parts` takes it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from hybridgen.attention.cuda import partial_attention, softmax_over_parts  # flash / CuPy on CUDA, torch otherwise
from hybridgen.kv import KVSegment
from hybridgen.methods.full import dense_decode

Part = Tuple[Tensor, Tensor]

__all__ = ["dense_decode", "gpu_share_partial", "merge_with_host"]


def gpu_share_partial(q: Tensor, gpu: KVSegment, scale: float) -> Optional[Part]:
    """The gpu segment's partial attention as one softmax part: (lse [B, Hq, 1, 1] float32,
    out [B, Hq, 1, D] in q's dtype); None when the segment is empty."""
    if gpu.length == 0:
        return None
    out, lse = partial_attention(q, gpu.k, gpu.v, scale, gpu.mask)
    return lse[..., None], out


def merge_with_host(host_part: Optional[Part], other_parts: Sequence[Part], share: Optional[Part],
                    num_kv_heads: int, dtype) -> Tensor:
    """ONE softmax over the CPU's shipped part (first, when there is one), ``other_parts`` (a
    streamed slice's logits, the new token's own logits) and the GPU share's [lse, out] entry:
    the exact LSE merge. Returns [B, Hq, 1, D] in ``dtype``."""
    parts: List[Part] = ([host_part] if host_part is not None else []) + list(other_parts)
    if share is not None:
        parts.append(share)
    return softmax_over_parts(parts, num_kv_heads).to(dtype)
