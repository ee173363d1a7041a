"""A compact key sketch kept next to a host segment's keys and scanned instead of them for SELECTION.

The CPU branch reads every host key each step; a sketch cuts the bytes per scanned key
(bf16: 2 bytes per element; ``int8``: 1 + 1/8 with its parameters; ``int4``: 1/2 + 1/8).
Only the ranking uses it: the selected rows' logits are recomputed exactly from the
full-precision keys (:func:`hybridgen.attention.cpu_scan.exact_logits_at`), so the softmax
stays exact over what is selected; the sketch changes *which* tokens are selected, never
their weights. HybridGen can also over-select from the sketch and keep the top-k of the
candidates by their exact logits (its ``sketch_oversample``, :func:`hybridgen.hybrid.host_branch.host_branch`).

Codes (``csrc/sketch.c`` has the byte layout): asymmetric per (batch, KV head, block of
``SKETCH_BLOCK`` tokens, channel): lo = the block's minimum of the channel, s = (max - lo) / L
(L = 255 for int8, 15 for int4; 0 for a constant channel), code = round((k - lo) / s) in
[0, L]. Keys have a few large outlier channels; one scale per channel keeps the others
resolved (on SmolLM2's keys, a single scale per block gave int4 a recall of ~0.8 of the
exact top 5%, a scale per channel ~0.95: ``benchmarks/bench_sketch_recall.py``).
- ``codes [B, Hkv, capacity / 16, 16 * D * bits / 8]`` uint8: token-major tiles of 16 tokens,
  so the scan's integer dot products run over 16 tokens per vector with no horizontal sums;
- ``params [B, Hkv, capacity / SKETCH_BLOCK, 2, D]`` float32: the scales s, then the minima lo.
The scan quantizes the query per block (q' = q * s, 8-bit with one scale per head) and
accumulates u8 x s8 dot products (AVX-512 VNNI, AVX2 or portable C: the same integers),
plus the exact offset sum_c q_c * lo_c; a torch fallback computes the same numbers.
Keys that the codes represent exactly (integers spanning [lo, lo + L] in every channel of a
block) with a query of integers whose largest magnitude per head is 127 give exactly the
bf16 scan's logits, hence the same selection (tests/test_attention_key_sketch.py).

Memory comes from the segment's key tier (:meth:`hybridgen.kv.tiers.Tier.allocate`, owner
``<segment owner>/sketch``): it is counted in the ledger like the keys themselves.
:meth:`KeySketch.sync` keeps the sketch in step with an append-only segment: only the blocks
from the last partial one onwards are re-quantized; a segment that shrank or moved
(``keep``, ``pop_front``, regrowth) is re-quantized whole.
"""
from __future__ import annotations

from typing import Literal, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.attention import native
from hybridgen.attention.cpu_pool import CPUAttentionPool, default_pool
from hybridgen.attention.cpu_scan import rows_view
from hybridgen.errors import ConfigError

SKETCH_KINDS = ("int8", "int4")
SKETCH_BLOCK = 128  # tokens per parameter block
TILE = 16  # tokens per code tile (SKETCH_BLOCK is a multiple)
SCAN_BLOCK = 512  # tokens per scan work item (= cpu_scan.TOKEN_BLOCK: the same block statistics)
_BITS = {"int8": 8, "int4": 4}
SketchKind = Literal["int8", "int4"]


def check_head_dim(kind: str, head_dim: int) -> None:
    """Raise ConfigError unless a ``kind`` sketch can hold keys of ``head_dim``."""
    if kind not in SKETCH_KINDS:
        raise ConfigError(f"unknown key sketch {kind!r}; choose one of: none, {', '.join(SKETCH_KINDS)}")
    if head_dim % 8:
        raise ConfigError(f"the key sketch needs a head dim that is a multiple of 8, got {head_dim}; "
                          f"use key_sketch='none'")


def block_query(q: Tensor, scales: Tensor, minima: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The query a sketch block is scanned with (the C kernels compute the same numbers).

    q [..., G, D] float32; scales, minima [..., D] (one block's parameters, broadcast over G).
    Returns (q8 [..., G, D] int8-valued float32, qs [..., G] float32, z [..., G] float64):
    q' = q * s, qs = max|q'| / 127 (1 when 0), q8 = round(q' * (1 / qs)), z = sum q * lo; the
    block's logits are (q8 . codes) * qs + z, times the softmax scale.
    """
    qp = q * scales.unsqueeze(-2)
    amax = qp.abs().amax(dim=-1)
    qs = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q8 = torch.round(qp * (1.0 / qs).unsqueeze(-1)).clamp_(-127.0, 127.0)
    z = (q.double() * minima.double().unsqueeze(-2)).sum(dim=-1)
    return q8, qs, z


class KeySketch:
    """int8 / int4 codes of one host segment's keys, for the selection scan.

    tier: where the codes and parameters are allocated (the segment's key tier); kind: 'int8'
    or 'int4'; batch, kv_heads, head_dim (a multiple of 8), capacity: the segment's shape
    (capacity in tokens).
    """

    def __init__(self, tier, kind: str, batch: int, kv_heads: int, head_dim: int, capacity: int, owner: str):
        check_head_dim(kind, head_dim)
        self.tier, self.kind, self.owner = tier, kind, owner
        self.B, self.H, self.D = batch, kv_heads, head_dim
        self.bits = _BITS[kind]
        self.levels = float(2 ** self.bits - 1)
        self.codes: Optional[Tensor] = None
        self.params: Optional[Tensor] = None
        self.capacity = 0
        self.length = 0  # tokens quantized: whole blocks only (the keys' last, partial block is not)
        self._src: Tuple[int, int] = (0, 0)  # (data_ptr, capacity stride) of the keys last synced
        self._head: Optional[Tensor] = None  # their token 0 [B, Hkv, D]
        self._alloc(max(int(capacity), 1))

    # ------------------------------------------------------------------ memory
    @property
    def tile_bytes(self) -> int:
        return TILE * self.D * self.bits // 8

    def _alloc(self, capacity: int) -> None:
        self.release()
        capacity = -(-capacity // SKETCH_BLOCK) * SKETCH_BLOCK
        self.codes = self.tier.allocate((self.B, self.H, capacity // TILE, self.tile_bytes), torch.uint8,
                                        f"{self.owner}/codes")
        self.params = self.tier.allocate((self.B, self.H, capacity // SKETCH_BLOCK, 2, self.D), torch.float32,
                                         f"{self.owner}/params")
        self.capacity, self.length = capacity, 0

    def release(self) -> None:
        """Return the codes and parameters to the tier."""
        for t in (self.codes, self.params):
            if t is not None:
                self.tier.release(t)
        self.codes = self.params = None
        self.capacity = self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.params) if t is not None)

    @property
    def bytes_per_token(self) -> float:
        """Bytes the scan reads per (batch, KV head, token): codes plus the amortised parameters."""
        return sketch_bytes_per_token(self.kind, self.D)

    # ------------------------------------------------------------------ quantization
    def sync(self, keys: Tensor) -> None:
        """Bring the sketch up to date with ``keys`` [B, Hkv, T, D] (a segment view from token 0).

        The sketch holds the keys' whole blocks only, tokens [0, T // SKETCH_BLOCK *
        SKETCH_BLOCK): a decode step's appended token lands in the last, partial block, which
        the CPU branch scans exactly (:func:`hybridgen.hybrid.host_branch.host_branch`), so a step
        costs no quantization until its block fills. Keys that moved, shrank, changed their
        first token (``pop_front``) or outgrew the sketch are re-quantized whole.
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
        whole = T // SKETCH_BLOCK * SKETCH_BLOCK
        if whole > self.length:
            self._quantize(keys, self.length, whole)
            self.length = whole

    def _quantize(self, keys: Tensor, t0: int, t1: int, chunk_blocks: int = 64) -> None:
        """Quantize tokens [t0, t1) (t0 block-aligned): the C kernel (``hg_sketch_quantize``, one
        job per (batch, head, block) on the default pool) when it builds, else torch,
        ``chunk_blocks`` blocks at a time (the same codes and parameters either way)."""
        B, H, _, D = keys.shape
        lib = native.lib()
        if t1 <= t0:
            return
        if lib is not None and keys.dtype in (torch.bfloat16, torch.float32):
            rows, cap = rows_view(keys)
            b0, nb = t0 // SKETCH_BLOCK, -(-t1 // SKETCH_BLOCK) - t0 // SKETCH_BLOCK
            default_pool().run_split(lib.hg_sketch_quantize, B * H * nb, rows.data_ptr(),
                                     int(keys.dtype == torch.bfloat16), cap, self.codes.data_ptr(),
                                     self.codes.shape[2], self.params.data_ptr(), self.params.shape[2], SKETCH_BLOCK,
                                     self.bits, b0, nb, t1, D, work=B * H * nb * SKETCH_BLOCK * D)
            return
        for c0 in range(t0, t1, chunk_blocks * SKETCH_BLOCK):
            self._quantize_torch(keys, c0, min(t1, c0 + chunk_blocks * SKETCH_BLOCK))

    def _quantize_torch(self, keys: Tensor, c0: int, c1: int) -> None:
        B, H, _, D = keys.shape
        n = c1 - c0
        nb = -(-n // SKETCH_BLOCK)
        x = keys[:, :, c0:c1].float()
        pad = nb * SKETCH_BLOCK - n
        inf = torch.full((B, H, pad, D), float("inf"))
        mn = torch.cat([x, inf], dim=2).view(B, H, nb, SKETCH_BLOCK, D).amin(dim=3)
        mx = torch.cat([x, -inf], dim=2).view(B, H, nb, SKETCH_BLOCK, D).amax(dim=3)
        s = torch.where(mx > mn, (mx - mn) / self.levels, torch.zeros_like(mn))
        b0 = c0 // SKETCH_BLOCK
        self.params[:, :, b0:b0 + nb, 0] = s
        self.params[:, :, b0:b0 + nb, 1] = mn
        per_tok = lambda t: t.repeat_interleave(SKETCH_BLOCK, dim=2)[:, :, :n]  # noqa: E731
        s_t, lo_t = per_tok(s), per_tok(mn)
        u = torch.where(s_t > 0, torch.round((x - lo_t) / torch.where(s_t > 0, s_t, torch.ones_like(s_t))),
                        torch.zeros_like(x)).clamp_(0, self.levels).to(torch.uint8)
        ntile = -(-n // TILE)
        u = torch.cat([u, u.new_zeros(B, H, ntile * TILE - n, D)], dim=2).view(B, H, ntile, TILE, D)
        if self.bits == 8:
            tiles = u.view(B, H, ntile, TILE, D // 4, 4).permute(0, 1, 2, 4, 3, 5)
        else:
            o = u.view(B, H, ntile, TILE, D // 8, 8)
            tiles = (o[..., :4] | (o[..., 4:] << 4)).permute(0, 1, 2, 4, 3, 5)
        self.codes[:, :, c0 // TILE:c0 // TILE + ntile] = tiles.reshape(B, H, ntile, self.tile_bytes)

    # ------------------------------------------------------------------ reading the codes back
    def unpacked(self, lo: int, hi: int) -> Tensor:
        """The codes of tokens [lo, hi) as [B, Hkv, hi - lo, D] uint8 (one code per element)."""
        B, H, D = self.B, self.H, self.D
        i0, i1 = lo // TILE, -(-hi // TILE)
        t = self.codes[:, :, i0:i1]
        if self.bits == 8:
            u = t.view(B, H, i1 - i0, D // 4, TILE, 4).permute(0, 1, 2, 4, 3, 5).reshape(B, H, -1, D)
        else:
            b = t.view(B, H, i1 - i0, D // 8, TILE, 4).permute(0, 1, 2, 4, 3, 5)
            u = torch.cat([b & 15, b >> 4], dim=-1).reshape(B, H, -1, D)
        return u[:, :, lo - i0 * TILE:hi - i0 * TILE]

    def dequantized(self, lo: int, hi: int) -> Tensor:
        """The keys the sketch stands for, tokens [lo, hi): [B, Hkv, hi - lo, D] float32."""
        blk = torch.arange(lo, hi) // SKETCH_BLOCK
        p = self.params[:, :, blk]  # [B, H, T, 2, D]
        return self.unpacked(lo, hi).float() * p[:, :, :, 0] + p[:, :, :, 1]

    # ------------------------------------------------------------------ scan
    def scan(self, q: Tensor, scale: float, lo: int, hi: int, out: Optional[Tensor] = None,
             pool: Optional[CPUAttentionPool] = None, row: Optional[int] = None) -> Tensor:
        """Approximate logits of every query head against the sketch's tokens [lo, hi).

        q [B, Hq, D] or [B, Hq, 1, D] (Hq = G * Hkv); out: optional float32 buffer with
        B*Hq*row elements, rows of ``row`` >= hi - lo elements (default hi - lo). Returns
        [B, Hq, hi - lo] float32 (for ranking only; a view of ``out`` when given).
        """
        return self.scan_stats(q, scale, lo, hi, out, pool, row)[0]

    def scan_stats(self, q: Tensor, scale: float, lo: int, hi: int, out: Optional[Tensor] = None,
                   pool: Optional[CPUAttentionPool] = None,
                   row: Optional[int] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`scan` plus the per-block softmax statistics of the C kernel
        ([B*Hkv, ceil((hi-lo) / SCAN_BLOCK), G, 2], as
        :func:`hybridgen.attention.cpu_scan.scan_logits_stats`), None on the torch fallback."""
        if q.dim() == 4:
            q = q[:, :, 0]
        B, Hq, D = q.shape
        H, T = self.H, hi - lo
        G = Hq // H
        row = T if row is None else row
        if hi > self.length or lo < 0 or row < T:
            raise ConfigError(f"key sketch holds {self.length} tokens, asked for [{lo}, {hi}) into rows of {row}; "
                              f"call sync() first")
        full = out.view(B * H, G, row) if out is not None else torch.empty(B * H, G, row, dtype=torch.float32)
        res = full[:, :, :T]
        if T == 0:
            return res.view(B, Hq, T), None
        qg = q.float().reshape(B * H, G, D).contiguous()
        lib = native.lib()
        if lib is None or G > 8 or D > 512:
            self._scan_torch(qg, scale, lo, hi, res)
            return res.view(B, Hq, T), None
        nblk = -(-T // SCAN_BLOCK)
        stats = torch.empty(B * H, nblk, G, 2, dtype=torch.float32)
        (pool or default_pool()).run_split(lib.hg_sketch_scan, B * H * nblk, qg.data_ptr(), self.codes.data_ptr(),
                                           self.codes.shape[2], self.params.data_ptr(), self.params.shape[2],
                                           SKETCH_BLOCK, self.bits, lo, full.data_ptr(), row, float(scale), T, D, G,
                                           SCAN_BLOCK, stats.data_ptr(), work=B * H * T * D)
        return res.view(B, Hq, T), stats

    def _scan_torch(self, qg: Tensor, scale: float, lo: int, hi: int, res: Tensor, chunk_blocks: int = 64) -> None:
        """The C scan's numbers in torch: qg [B*Hkv, G, D] float32 -> res [B*Hkv, G, hi - lo]."""
        BH, G, D = qg.shape
        q = qg.view(self.B, self.H, G, D)
        for b0 in range(lo // SKETCH_BLOCK, -(-hi // SKETCH_BLOCK), chunk_blocks):
            b1 = min(b0 + chunk_blocks, -(-hi // SKETCH_BLOCK))
            t0, t1 = max(lo, b0 * SKETCH_BLOCK), min(hi, b1 * SKETCH_BLOCK)
            u = self.unpacked(b0 * SKETCH_BLOCK, b1 * SKETCH_BLOCK).double()
            u = u.view(self.B, self.H, b1 - b0, SKETCH_BLOCK, D)
            p = self.params[:, :, b0:b1]
            q8, qs, z = block_query(q.unsqueeze(2), p[:, :, :, 0], p[:, :, :, 1])  # [B, H, nb, G, *]
            acc = torch.matmul(q8.double(), u.transpose(-1, -2))  # [B, H, nb, G, SKETCH_BLOCK], exact integers
            a = (qs * scale).double().unsqueeze(-1)
            c = (z * scale).float().double().unsqueeze(-1)
            lg = (acc * a + c).float().permute(0, 1, 3, 2, 4).reshape(BH, G, -1)
            res[:, :, t0 - lo:t1 - lo] = lg[:, :, t0 - b0 * SKETCH_BLOCK:t1 - b0 * SKETCH_BLOCK]


def sketch_bytes_per_token(kind: str, head_dim: int) -> float:
    """Bytes a sketch scan reads per (batch, KV head, token) for ``kind`` at ``head_dim``:
    the codes plus the per-block parameters (two float32 per channel per block)."""
    check_head_dim(kind, head_dim)
    return head_dim * _BITS[kind] / 8 + 2 * 4 * head_dim / SKETCH_BLOCK
