"""hybridgen.attention.cuda.flash: torch's flash kernel with its LSE as a decode step's partial attention.

The GQA view (the G query heads of a KV head as G query rows) and the LSE are checked on the
CPU, where the same view runs torch's CPU flash kernel, against the float64 reference on random
shapes, GQA ratios, odd lengths and capacity views of the KV; the CUDA kernel runs the same view
(tests/test_gpu_methods.py on a GPU). The dispatcher takes this path on CUDA only.
"""
import math
import random

import pytest
import torch

from hybridgen.attention import cuda as ck
from hybridgen.attention.cuda.flash import applies, flash_partial_attention
from hybridgen.attention.reference import dense_attention_reference
from tests._cuda_cases import ref_lse


def _case(seed: int, dtype: torch.dtype):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2, 4, 8))
    G = gen.choice((1, 3, 4, 8))
    B, T, D = gen.randint(1, 3), 2 * gen.randint(0, 400) + 1, gen.choice((64, 128, 256))
    extra = gen.randint(0, 40)  # a capacity view: the segment's buffer is longer than its tokens
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype)
    k = (3 * torch.randn(B, Hkv, T + extra, D, generator=g)).to(dtype)[:, :, :T]
    v = torch.randn(B, Hkv, T + extra, D, generator=g).to(dtype)[:, :, :T]
    return q, k, v, 0.7 / math.sqrt(D)  # not the kernel's default scale: a dropped scale= fails


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype,tol,lse_tol", [(torch.float32, 2e-6, 1e-5), (torch.bfloat16, 2e-2, 1e-3)])
def test_flash_partial_equals_the_float64_reference(seed, dtype, tol, lse_tol):
    q, k, v, scale = _case(seed, dtype)
    out, lse = flash_partial_attention(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    ref = dense_attention_reference(q, k, v, scale)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < tol
    assert torch.allclose(lse.double(), ref_lse(q, k, scale), atol=lse_tol, rtol=0)


def test_a_swapped_head_order_would_fail():
    """The view must pair query head h with KV head h // G (a plausible wrong pairing fails)."""
    q, k, v, scale = _case(3, torch.float32)  # Hq = 6, Hkv = 2
    B, Hq, _, D = q.shape
    assert Hq > k.shape[1] > 1
    out, _ = flash_partial_attention(q, k, v, scale)
    ref = dense_attention_reference(q, k, v, scale)
    wrong = dense_attention_reference(q.reshape(B, -1, k.shape[1], D).transpose(1, 2).reshape(B, Hq, 1, D), k, v,
                                      scale)
    assert torch.allclose(out.double(), ref, atol=1e-5) and not torch.allclose(out.double(), wrong, atol=1e-3)


def test_applies_only_where_the_kernel_does():
    q, k, v, _ = _case(1, torch.bfloat16)
    assert applies(q, k, v)
    assert not applies(q.float(), k.float(), v.float())  # fp32: the CuPy kernel or torch
    assert not applies(torch.cat([q, q], 2), k, v)  # more than one query token
    assert not applies(q, k[:, :, :0], v[:, :, :0])  # no key
    assert not applies(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)  # last dim not contiguous
    assert not applies(q[..., :12], k[..., :12], v[..., :12])  # head dim not a multiple of 8
    assert applies(q.half(), k.half(), v.half())
    assert not applies(q, k.half(), v)  # mixed dtypes
    q3, k2 = torch.zeros(1, 3, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 5, 64, dtype=torch.bfloat16)
    assert not applies(q3, k2, k2)  # Hq not a multiple of Hkv
    wide = torch.zeros(1, 2, 1, 264, dtype=torch.bfloat16)
    assert not applies(wide, wide, wide)  # head dim > 256
    strided = torch.zeros(q.shape[:-1] + (2 * q.shape[-1],), dtype=q.dtype)[..., ::2]
    assert not applies(strided, k, v)  # q's last dim not contiguous


def test_the_dispatcher_keeps_cpu_tensors_on_torch():
    q, k, v, scale = _case(2, torch.bfloat16)
    before = dict(ck.dispatch_counts)
    ck.partial_attention(q, k, v, scale)
    assert ck.dispatch_counts["flash"] == before["flash"] and ck.dispatch_counts["torch"] == before["torch"] + 1


@pytest.fixture()
def flash_on_cpu(monkeypatch):
    """The dispatcher's flash branch driven on CPU tensors (flash.py runs torch's CPU flash kernel),
    with fresh verification state."""
    from hybridgen.attention.cuda import dispatch, state

    monkeypatch.setattr(dispatch, "_on_cuda", lambda *t: True)
    monkeypatch.setattr(state, "kernels_available", lambda: False)  # no CuPy: the fallback is torch
    for name in ("verified", "rejected", "warned"):
        monkeypatch.setattr(state, name, set())
    return dispatch


def test_the_dispatcher_takes_flash_verifies_it_once_and_counts_it(flash_on_cpu):
    q, k, v, scale = _case(5, torch.bfloat16)
    before = dict(ck.dispatch_counts)
    out, lse = flash_on_cpu.partial_attention(q, k, v, scale)
    flash_on_cpu.partial_attention(q, k, v, scale)
    assert ck.dispatch_counts["flash"] == before["flash"] + 2 and ck.dispatch_counts["torch"] == before["torch"]
    ref = dense_attention_reference(q, k, v, scale)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-2
    # a mask, fp32 or several query tokens never take it
    flash_on_cpu.partial_attention(q.float(), k.float(), v.float(), scale)
    flash_on_cpu.partial_attention(q, k, v, scale, torch.ones(1, 1, k.shape[2], dtype=torch.bool))
    assert ck.dispatch_counts["flash"] == before["flash"] + 2


def test_a_wrong_flash_result_is_rejected_with_one_warning(flash_on_cpu, monkeypatch):
    from hybridgen.attention.cuda import flash

    q, k, v, scale = _case(6, torch.bfloat16)
    monkeypatch.setattr(flash, "flash_partial_attention", lambda q, k, v, s: (q * 0, q.new_zeros(q.shape[:3]).float()))
    with pytest.warns(RuntimeWarning, match="disagrees with torch"):
        out, _ = flash_on_cpu.partial_attention(q, k, v, scale)
    ref = dense_attention_reference(q, k, v, scale)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-2  # the torch result, not the wrong one
    before = ck.dispatch_counts["flash"]
    flash_on_cpu.partial_attention(q, k, v, scale)
    assert ck.dispatch_counts["flash"] == before  # switched off for the process


def test_a_failing_flash_kernel_falls_back_once_loudly_or_raises_under_strict(flash_on_cpu, monkeypatch):
    from hybridgen.attention.cuda import flash

    q, k, v, scale = _case(7, torch.bfloat16)

    def broken(*a):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(flash, "flash_partial_attention", broken)
    monkeypatch.setenv("HYBRIDGEN_CUPY", "strict")
    with pytest.raises(RuntimeError, match="no kernel image"):
        flash_on_cpu.partial_attention(q, k, v, scale)
    monkeypatch.setenv("HYBRIDGEN_CUPY", "1")
    with pytest.warns(RuntimeWarning, match="flash attention with LSE failed"):
        flash_on_cpu.partial_attention(q, k, v, scale)
