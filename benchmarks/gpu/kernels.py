"""Section 6: the GPU attention kernels (``hybridgen.attention.cuda``) against torch on GPU-resident KV.

Per context T: q [B, Hq, 1, D], k and v [B, Hkv, T, D]; the partial kernels (out + LSE: torch's
plain ops, torch's flash kernel with its LSE as HybridGen's share runs it, the CuPy kernel);
``full``'s decode attention (:func:`hybridgen.methods.full.sdpa_decode`) at a fixed length and
with the key length growing by one per call, as in decoding, beside torch's default SDPA
backends (cuDNN included) likewise; and the fused GPU half of hybridgen (host top-k logits
[B, Hq, K] and V rows [B, Hkv, K, D] with K = 5% of 9x the GPU part, merged in one softmax
with the GPU-resident part). Median of ``cfg.kernel_reps``; a context is not started once the
clock has run out.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

import torch.nn.functional as F

from benchmarks.gpu.config import BenchConfig, Clock, Emit, error_row, free, rel_err, sync
from hybridgen.attention.cuda.flash import flash_partial_attention
from hybridgen.attention.partial import attention_logits, partial_attention, softmax_over_parts
from hybridgen.methods.full import sdpa_decode
from hybridgen.timing import median_time


def _growing(fn, k, v, reps: int):
    """A call of ``fn(k[:, :, :n], v[:, :, :n])`` whose length n grows by one per call (n ends at T)."""
    T = k.shape[2]
    n = [T - reps - 2]

    def call():
        n[0] = min(n[0] + 1, T)
        return fn(k[:, :, :n[0]], v[:, :, :n[0]])
    return call


def run_kernels(cfg: BenchConfig, device: torch.device, clock: Clock, emit: Emit) -> None:
    """Rows of ms, KV GB/s and error against torch for each kernel and context."""
    from hybridgen.attention import cuda as ck

    avail = ck.kernels_available()
    emit({"section": "kernels", "method": "cupy kernels available", "status": "ok" if avail else "unavailable"})
    B, Hq, Hkv, D = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    scale = cfg.scale

    def timed(fn):
        return median_time(fn, cfg.kernel_reps, sync=lambda: sync(device))

    g = torch.Generator(device=device).manual_seed(7)
    for T in cfg.kernel_contexts:
        if clock.expired():
            emit({"section": "kernels", "method": "*", "context": T, "status": "skipped (time guard)"})
            continue
        q = torch.randn(B, Hq, 1, D, generator=g, device=device).to(cfg.dtype)
        k = torch.randn(B, Hkv, T, D, generator=g, device=device).to(cfg.dtype)
        v = torch.randn(B, Hkv, T, D, generator=g, device=device).to(cfg.dtype)
        nbytes = 2 * k.numel() * k.element_size()
        ref = partial_attention(q.float(), k.float(), v.float(), scale)[0]
        def default_sdpa(kk, vv):
            return F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=Hq != Hkv)

        variants = [("partial torch", lambda: partial_attention(q, k, v, scale)),
                    ("partial flash (HybridGen's share)", lambda: flash_partial_attention(q, k, v, scale))]
        if avail:
            variants.append(("partial cupy", lambda: ck.cupy_partial_attention(q, k, v, scale)))
        variants += [("sdpa_decode (full), fixed length", lambda: (sdpa_decode(q, k, v, scale),)),
                     ("sdpa_decode (full), length +1 per call",
                      _growing(lambda kk, vv: (sdpa_decode(q, kk, vv, scale),), k, v, cfg.kernel_reps)),
                     ("sdpa default backends, fixed length", lambda: (default_sdpa(k, v),)),
                     ("sdpa default backends, length +1 per call",
                      _growing(lambda kk, vv: (default_sdpa(kk, vv),), k, v, cfg.kernel_reps))]
        for label, fn in variants:
            row: Dict[str, Any] = {"section": "kernels", "method": label, "context": T}
            try:
                s = timed(fn)
                err = rel_err(fn()[0], ref) if "length +1" not in label else None  # a shorter KV than ref's
                row.update(ms=s * 1e3, kv_gbps=nbytes / s / 1e9, rel_err=err, status="ok")
            except Exception as err:  # noqa: BLE001
                error_row(row, err)
            emit(row)
        K = max(1, int(0.05 * 9 * T))
        hl = torch.randn(B, Hq, K, generator=g, device=device)
        hv = torch.randn(B, Hkv, K, D, generator=g, device=device).to(cfg.dtype)

        def torch_hybrid():
            gl = attention_logits(q, k, scale)
            return softmax_over_parts([(hl[:, :, None], hv), (gl, v)], Hkv)

        href = torch_hybrid().float()
        variants = [("hybrid torch", torch_hybrid)]
        if avail:
            variants.append(("hybrid cupy", lambda: ck.cupy_hybrid_decode_attention(q, hl, hv, k, v, scale)))
        for label, fn in variants:
            row = {"section": "kernels", "method": label, "context": T, "host_rows": K}
            try:
                s = timed(fn)
                row.update(ms=s * 1e3, kv_gbps=(nbytes + hv.numel() * hv.element_size()) / s / 1e9,
                           rel_err=rel_err(fn(), href), status="ok")
            except Exception as err:  # noqa: BLE001
                error_row(row, err)
            emit(row)
        del q, k, v, ref, hl, hv
        free(device)
