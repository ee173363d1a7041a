"""A compact key sketch kept next to a host segment's keys and scanned instead of them for SELECTION.

The CPU branch reads every host key each step; a sketch cuts the bytes per scanned key
(bf16: 2 bytes per element; ``int8``: 1; ``int4``: 1/2, plus one float32 scale per
(batch, KV head, ``SKETCH_BLOCK`` tokens)). Only the ranking uses it: the selected rows'
logits are recomputed exactly from the full-precision keys
(:func:`hybridgen.attention.cpu_scan.exact_logits_at`), so the softmax stays exact over
what is selected; the sketch changes *which* tokens are selected, never their weights.

Codes (symmetric, per (batch, KV head, block) scale s = max|k| / qmax over the block's
tokens and channels; qmax 127 for int8, 7 for int4):
- int8: ``codes [B, Hkv, cap, D]`` int8 = round(k / s);
- int4: ``codes [B, Hkv, cap, D // 2]`` uint8, byte j = (c[j] + 8) | (c[j + D/2] + 8) << 4;
- ``scales [B, Hkv, nblocks]`` float32 (nblocks = ceil(cap / SKETCH_BLOCK)).
The query is quantized per (batch, query head) with a power-of-two scale (so a query of
small integers stays exact), to int16 for int8 codes and to int8 for int4 codes (whose scan
multiplies unsigned nibbles by signed bytes, 32 products per AVX2 instruction), and the
scan accumulates integer dot products
(``hg_scan_i8`` / ``hg_scan_i4`` of :mod:`hybridgen.attention.native`; a torch fallback
dequantizes). Keys that are exactly representable (integers with a block maximum of qmax)
give exactly the bf16 scan's logits, hence the same selection (tests/test_attention_key_sketch.py).

Memory comes from the segment's key tier (:meth:`hybridgen.kv.tiers.Tier.allocate`, owner
``<segment owner>/sketch``): it is counted in the ledger like the keys themselves.
:meth:`KeySketch.sync` keeps the sketch in step with an append-only segment: only the blocks
from the last partial one onwards are re-quantized; a segment that shrank or moved
(``keep``, ``pop_front``, regrowth) is re-quantized whole.
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.attention import native
from hybridgen.attention.cpu_pool import CPUAttentionPool, default_pool
from hybridgen.attention.cpu_scan import rows_view
from hybridgen.errors import ConfigError

SKETCH_KINDS = ("int8", "int4")
SKETCH_BLOCK = 64  # tokens per scale block
SCAN_BLOCK = 512  # tokens per scan work item (= cpu_scan.TOKEN_BLOCK: the same block statistics)
_QMAX = {"int8": 127, "int4": 7}
SketchKind = Literal["int8", "int4"]


def quantize_query(q: Tensor, bits: int = 16) -> Tuple[Tensor, Tensor]:
    """q [R, D] float -> (int codes [R, D], float32 scales [R]) with q ~= codes * scale.

    bits 16 (int16 codes, the int8 sketch's scan) or 8 (int8 codes, the int4 sketch's). The
    scale is the smallest power of two with max|q| / scale <= 2^(bits-1) - 1 (a query of
    small integers stays exact); a zero row gets scale 1.
    """
    top = float(2 ** (bits - 1) - 1)
    qf = q.float()
    amax = qf.abs().amax(dim=-1).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / top))
    scale = torch.exp2(e)
    scale = torch.where(amax / scale > top, scale * 2, scale)
    codes = torch.round(qf / scale[:, None]).clamp_(-top, top).to(torch.int16 if bits == 16 else torch.int8)
    return codes.contiguous(), scale.float().contiguous()


class KeySketch:
    """int8 / int4 codes of one host segment's keys, for the selection scan.

    tier: where the codes and scales are allocated (the segment's key tier); kind: 'int8' or
    'int4'; batch, kv_heads, head_dim, capacity: the segment's shape (capacity in tokens).
    """

    def __init__(self, tier, kind: str, batch: int, kv_heads: int, head_dim: int, capacity: int, owner: str):
        if kind not in SKETCH_KINDS:
            raise ConfigError(f"unknown key sketch {kind!r}; choose one of: none, {', '.join(SKETCH_KINDS)}")
        if kind == "int4" and head_dim % 2:
            raise ConfigError(f"the int4 key sketch needs an even head dim, got {head_dim}; use key_sketch='int8'")
        self.tier, self.kind, self.owner = tier, kind, owner
        self.B, self.H, self.D = batch, kv_heads, head_dim
        self.qmax = _QMAX[kind]
        self.codes: Optional[Tensor] = None
        self.scales: Optional[Tensor] = None
        self.capacity = 0
        self.length = 0  # tokens quantized (the last block may be partial)
        self._src: Tuple[int, int] = (0, 0)  # (data_ptr, capacity stride) of the keys last synced
        self._head: Optional[Tensor] = None  # their token 0 [B, Hkv, D]
        self._alloc(max(int(capacity), 1))

    # ------------------------------------------------------------------ memory
    def _alloc(self, capacity: int) -> None:
        self.release()
        width = self.D if self.kind == "int8" else self.D // 2
        dtype = torch.int8 if self.kind == "int8" else torch.uint8
        nblk = -(-capacity // SKETCH_BLOCK)
        self.codes = self.tier.allocate((self.B, self.H, capacity, width), dtype, f"{self.owner}/codes")
        self.scales = self.tier.allocate((self.B, self.H, nblk), torch.float32, f"{self.owner}/scales")
        self.capacity, self.length = capacity, 0

    def release(self) -> None:
        """Return the codes and scales to the tier."""
        for t in (self.codes, self.scales):
            if t is not None:
                self.tier.release(t)
        self.codes = self.scales = None
        self.capacity = self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales) if t is not None)

    @property
    def bytes_per_token(self) -> float:
        """Bytes the scan reads per (batch, KV head, token): codes plus the amortised scale."""
        return self.codes.shape[-1] * self.codes.element_size() + 4.0 / SKETCH_BLOCK

    # ------------------------------------------------------------------ quantization
    def sync(self, keys: Tensor) -> None:
        """Bring the sketch up to date with ``keys`` [B, Hkv, T, D] (a segment view from token 0).

        Appended tokens cost re-quantizing the blocks from the last partial one; keys that
        moved, shrank, changed their first token (``pop_front``) or outgrew the sketch are
        re-quantized whole.
        """
        B, H, T, D = keys.shape
        if (B, H, D) != (self.B, self.H, self.D):
            raise ConfigError(f"key sketch of shape {(self.B, self.H, self.D)} cannot follow keys of shape "
                              f"{(B, H, D)}; build one sketch per segment")
        src = (keys.data_ptr(), keys.stride(1))
        if T > self.capacity:
            self._alloc(max(T, 2 * self.capacity))
        head = keys[:, :, 0].clone() if T else None  # a moved front (pop_front) changes token 0
        if src != self._src or T < self.length or (self.length and not torch.equal(head, self._head)):
            self.length = 0
        self._src, self._head = src, head
        if T == self.length:
            return
        b0 = self.length // SKETCH_BLOCK
        self._quantize(keys, b0 * SKETCH_BLOCK, T)
        self.length = T

    def _quantize(self, keys: Tensor, t0: int, t1: int, chunk_blocks: int = 64) -> None:
        """Quantize tokens [t0, t1) (t0 block-aligned): the C kernel (``hg_quantize``, one job
        per (batch, head, block) on the default pool) when it builds, else torch, block by
        block, ``chunk_blocks`` at a time (the same codes and scales either way)."""
        B, H, _, D = keys.shape
        lib = native.lib()
        if lib is not None and keys.dtype in (torch.bfloat16, torch.float32) and t1 > t0:
            rows, cap = rows_view(keys)
            b0, nb = t0 // SKETCH_BLOCK, -(-t1 // SKETCH_BLOCK) - t0 // SKETCH_BLOCK
            default_pool().run_split(lib.hg_quantize, B * H * nb, rows.data_ptr(), int(keys.dtype == torch.bfloat16),
                                     cap, self.codes.data_ptr(), self.codes.shape[2], self.scales.data_ptr(),
                                     self.scales.shape[-1], SKETCH_BLOCK, 8 if self.kind == "int8" else 4, b0, nb,
                                     t1, D)
            return
        for c0 in range(t0, t1, chunk_blocks * SKETCH_BLOCK):
            c1 = min(t1, c0 + chunk_blocks * SKETCH_BLOCK)
            n = c1 - c0
            nb = -(-n // SKETCH_BLOCK)
            x = keys[:, :, c0:c1].float()
            if n % SKETCH_BLOCK:
                x = torch.cat([x, x.new_zeros(B, H, nb * SKETCH_BLOCK - n, D)], dim=2)
            xb = x.view(B, H, nb, SKETCH_BLOCK, D)
            amax = xb.abs().amax(dim=(3, 4))
            s = torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax))
            codes = torch.round(xb / s[..., None, None]).clamp_(-self.qmax, self.qmax).view(B, H, -1, D)[:, :, :n]
            self.scales[:, :, c0 // SKETCH_BLOCK:c0 // SKETCH_BLOCK + nb] = s
            if self.kind == "int8":
                self.codes[:, :, c0:c1] = codes.to(torch.int8)
            else:
                u = (codes + 8).to(torch.uint8)
                self.codes[:, :, c0:c1] = u[..., :D // 2] | (u[..., D // 2:] << 4)

    def dequantized(self, lo: int, hi: int) -> Tensor:
        """The keys the sketch stands for, tokens [lo, hi): [B, Hkv, hi - lo, D] float32."""
        if self.kind == "int8":
            c = self.codes[:, :, lo:hi].float()
        else:
            u = self.codes[:, :, lo:hi]
            c = torch.cat([(u & 15).float(), (u >> 4).float()], dim=-1) - 8.0
        blk = torch.arange(lo, hi) // SKETCH_BLOCK
        return c * self.scales[:, :, blk][..., None]

    # ------------------------------------------------------------------ scan
    def scan(self, q: Tensor, scale: float, lo: int, hi: int, out: Optional[Tensor] = None,
             pool: Optional[CPUAttentionPool] = None) -> Tensor:
        """Approximate logits of every query head against the sketch's tokens [lo, hi).

        q [B, Hq, D] or [B, Hq, 1, D] (Hq = G * Hkv); out: optional float32 buffer with
        B*Hq*(hi-lo) elements. Returns [B, Hq, hi - lo] float32 (for ranking only).
        """
        return self.scan_stats(q, scale, lo, hi, out, pool)[0]

    def scan_stats(self, q: Tensor, scale: float, lo: int, hi: int, out: Optional[Tensor] = None,
                   pool: Optional[CPUAttentionPool] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`scan` plus the per-block softmax statistics of the C kernels
        ([B*Hkv, ceil((hi-lo) / SCAN_BLOCK), G, 2], as
        :func:`hybridgen.attention.cpu_scan.scan_logits_stats`), None on the torch fallback."""
        if q.dim() == 4:
            q = q[:, :, 0]
        B, Hq, D = q.shape
        H, T = self.H, hi - lo
        G = Hq // H
        if hi > self.length or lo < 0:
            raise ConfigError(f"key sketch holds {self.length} tokens, asked for [{lo}, {hi}); call sync() first")
        res = out.view(B * H, G, T) if out is not None else torch.empty(B * H, G, T, dtype=torch.float32)
        if T == 0:
            return res.view(B, Hq, T), None
        qc, qs = quantize_query(q.reshape(B * Hq, D), 16 if self.kind == "int8" else 8)
        lib = native.lib()
        fits = lib is not None and G <= 8 and D <= 2048
        if not fits:
            keys = self.dequantized(lo, hi)  # torch fallback: same quantized query, float math
            qd = (qc.float() * qs[:, None]).view(B, H, G, D)
            res.view(B, H, G, T).copy_(torch.matmul(qd, keys.transpose(-1, -2)).mul_(scale))
            return res.view(B, Hq, T), None
        nblk = -(-T // SCAN_BLOCK)
        nsb = self.scales.shape[-1]
        cap = self.codes.shape[2]
        p = (pool or default_pool())
        stats = torch.empty(B * H, nblk, G, 2, dtype=torch.float32)
        if self.kind == "int8":
            p.run_split(lib.hg_scan_i8, B * H * nblk, qc.data_ptr(), qs.data_ptr(), self.codes.data_ptr(),
                        self.scales.data_ptr(), nsb, SKETCH_BLOCK, lo, cap, res.data_ptr(), float(scale), T, D, G,
                        SCAN_BLOCK, stats.data_ptr())
        else:
            qsum = qc.to(torch.int32).sum(dim=-1).to(torch.int32).contiguous()
            p.run_split(lib.hg_scan_i4, B * H * nblk, qc.data_ptr(), qs.data_ptr(), qsum.data_ptr(),
                        self.codes.data_ptr(), self.scales.data_ptr(), nsb, SKETCH_BLOCK, lo, cap, res.data_ptr(),
                        float(scale), T, D, G, SCAN_BLOCK, stats.data_ptr())
        return res.view(B, Hq, T), stats


def sketch_bytes_per_token(kind: str, head_dim: int) -> float:
    """Bytes a sketch scan reads per (batch, KV head, token) for ``kind`` at ``head_dim``."""
    if kind not in SKETCH_KINDS:
        raise ConfigError(f"unknown key sketch {kind!r}; choose one of: {', '.join(SKETCH_KINDS)}")
    return (head_dim if kind == "int8" else math.ceil(head_dim / 2)) + 4.0 / SKETCH_BLOCK
