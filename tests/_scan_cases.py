"""Shared inputs of the CPU scan and host-branch tests: strided host segments and the float64 logits."""
import torch

from hybridgen.kv import KVSegment, TieredStore


def host_segment(B, H, T, D, dtype, seed=0, extra=7):
    """A KVSegment [B, H, T, D] with spare capacity, so its views are strided like the real ones."""
    store = TieredStore()
    seg = KVSegment(store["dram"], B, H, D, dtype, "layer0/host", capacity=T + extra)
    g = torch.Generator().manual_seed(seed)
    seg.append(torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype))
    return seg


def ref_logits(q, keys, scale):
    """float64 GQA logits: q [B, Hq, D], keys [B, Hkv, T, D] -> [B, Hq, T]."""
    B, Hq, D = q.shape
    Hkv = keys.shape[1]
    qg = q.double().view(B, Hkv, Hq // Hkv, D)
    return (torch.matmul(qg, keys.double().transpose(-1, -2)) * scale).view(B, Hq, -1)
