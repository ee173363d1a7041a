"""The split methods on a CUDA device: exact where they claim to be, ``full``'s bits with nothing on the host.

The CPU suite checks these on the torch fallback; here the same checks run with the compute
device on the GPU, so the CuPy partial kernel (HybridGen's fused share with host tokens), the
CUDA SDPA path (``full``, and HybridGen with the whole KV on the GPU), pinned host tiers and the
host-to-device copies are the ones exercised. Skipped without CUDA (CI has none; the lent H200
runs them: ``results/gpu/``).
"""
import random

import pytest
import torch

from hybridgen.attention import dense_attention_reference
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.hybrid import HybridExact, HybridGen
from hybridgen.methods import Budget, build_method
from hybridgen.methods.full import Full
from hybridgen.testing import dense_reference, drive, left_padding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
POOL = CPUAttentionPool(workers=2)


def _shape(seed: int):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2, 4))
    G = (1, 3, 4, 8)[seed % 4]
    T = 2 * gen.randint(20, 300) + 1  # odd prompt lengths
    shape = (gen.randint(1, 3), Hkv * G, Hkv, gen.choice((64, 128)), T)
    valid = left_padding(gen, shape[0], T) if seed % 2 else None
    return gen, shape, valid


def _max_rel(run) -> float:
    """Largest |out - ref| / max |ref| over every record, against the float64 reference."""
    worst = 0.0
    for r in run.records:
        ref = dense_reference(r, run.ctx.scale)
        worst = max(worst, float((r.out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
    return worst


@pytest.mark.parametrize("seed", range(4))
def test_hybridgen_without_host_tokens_is_full_bit_for_bit_on_cuda(seed):
    _, shape, valid = _shape(seed)
    ref = drive(Full(), shape, 5, seed=seed, valid=valid, device="cuda", pool=POOL)
    m = HybridGen(gpu_budget=1.0)
    run = drive(m, shape, 5, seed=seed, valid=valid, device="cuda", pool=POOL)
    for r, g in zip(ref.records, run.records):
        assert g.out.device.type == "cuda"
        assert torch.equal(g.out, r.out)
    assert all(h.length == 0 for h in m.host)


@pytest.mark.parametrize("seed", range(6))
def test_merged_share_on_cuda_equals_the_float64_reference(seed):
    """Top-k = every host token: the CuPy share's [out, lse] + the CPU's shipped part, exact."""
    gen, shape, valid = _shape(100 + seed)
    split = gen.randint(1, shape[-1] - 1)
    m = HybridGen(gpu_budget=Budget(tokens=split), sinks=gen.choice((0, 4)), topk_ratio=1.0, min_topk=0,
                  ship=("logits", "partial")[seed % 2], three_way=seed % 3 == 2,
                  stream_ratio=0.5 if seed % 3 == 2 else None)
    run = drive(m, shape, 5, seed=seed, valid=valid, device="cuda", pool=POOL)
    assert _max_rel(run) < 1e-5, seed
    assert m.stats["topk_selected"] > 0 and m.stats["bytes_h2d"] > 0  # the merged path ran


@pytest.mark.parametrize("name,params", [
    ("hybrid-exact", {"gpu_budget": 0.3}),
    ("flexgen", {"gpu_budget": 0.2, "attention_on": "gpu"}),
    ("flexgen", {"gpu_budget": 0.2, "attention_on": "cpu"}),
])
@pytest.mark.parametrize("seed", range(3))
def test_lossless_splits_on_cuda_equal_the_float64_reference(name, params, seed):
    _, shape, valid = _shape(200 + seed)
    run = drive(build_method(name, **params), shape, 4, seed=seed, valid=valid, device="cuda", pool=POOL)
    assert run.records[0].out.device.type == "cuda"
    assert _max_rel(run) < 1e-5, (name, params, seed)


def test_bf16_split_on_cuda_is_within_bf16_rounding():
    _, shape, valid = _shape(7)
    run = drive(HybridExact(gpu_budget=Budget(ratio=0.5)), shape, 4, seed=7, valid=valid, device="cuda",
                dtype=torch.bfloat16, pool=POOL)
    assert _max_rel(run) < 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed", range(3))
def test_full_on_cuda_equals_the_float64_reference(dtype, tol, seed):
    """``full``'s decode SDPA (cuDNN left out, GQA as query rows) on random GQA shapes."""
    _, shape, _ = _shape(300 + seed)
    run = drive(Full(), shape, 4, seed=seed, device="cuda", dtype=dtype, pool=POOL)
    assert _max_rel(run) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,T", [(2, 32, 8, 1), (8, 32, 8, 4099), (1, 4, 1, 40000), (3, 12, 4, 777)])
def test_flash_share_on_cuda_equals_the_reference_and_is_dispatched(dtype, B, Hq, Hkv, T):
    from hybridgen.attention import cuda as ck
    from tests._cuda_cases import ref_lse

    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(B, Hq, 1, 128, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, T + 16, 128, generator=g, device="cuda").to(dtype)[:, :, :T]  # a capacity view
    v = torch.randn(B, Hkv, T + 16, 128, generator=g, device="cuda").to(dtype)[:, :, :T]
    scale = 0.7 * 128 ** -0.5  # not the kernel's default: a dropped scale= fails
    before = ck.dispatch_counts["flash"]
    out, lse = ck.partial_attention(q, k, v, scale)
    assert ck.dispatch_counts["flash"] == before + 1
    ref = dense_attention_reference(q.cpu(), k.cpu(), v.cpu(), scale)
    assert float((out.cpu().double() - ref).abs().max() / ref.abs().max()) < 2e-2
    assert torch.allclose(lse.cpu().double(), ref_lse(q.cpu(), k.cpu(), scale), atol=5e-3, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_bf16_merged_share_on_cuda_is_within_bf16_rounding(seed):
    """The flash share's [out, lse] (bf16 on CUDA) merged with the shipped host part."""
    gen, shape, _ = _shape(400 + seed)
    split = gen.randint(1, shape[-1] - 1)
    m = HybridGen(gpu_budget=Budget(tokens=split), topk_ratio=1.0, min_topk=0, ship=("logits", "partial")[seed % 2])
    run = drive(m, shape, 4, seed=seed, device="cuda", dtype=torch.bfloat16, pool=POOL)
    assert _max_rel(run) < 2e-2
    assert m.stats["topk_selected"] > 0


@pytest.mark.parametrize("name,params", [("hybrid-exact", {"gpu_budget": 0.3}),
                                         ("flexgen", {"gpu_budget": 0.2, "attention_on": "gpu"})])
def test_bf16_splits_on_cuda_take_the_flash_partial(name, params):
    """Unpadded bf16: the splits' GPU partials go through torch's flash kernel, within bf16 rounding."""
    from hybridgen.attention import cuda as ck

    _, shape, valid = _shape(8)
    assert valid is None
    before = ck.dispatch_counts["flash"]
    run = drive(build_method(name, **params), shape, 4, seed=8, device="cuda", dtype=torch.bfloat16, pool=POOL)
    assert ck.dispatch_counts["flash"] > before
    assert _max_rel(run) < 2e-2
