"""attention_logits, partial_attention and merge_partials against the float64 reference."""
import random

import pytest
import torch

from hybridgen.attention import attention_logits, dense_attention_reference, merge_partials, partial_attention
from hybridgen.attention.partial import head_matmul
from tests._attention_cases import TOL, random_case, rel_err

DTYPES = [torch.float32, torch.bfloat16]


def _ref_lse(c):
    """float64 log-sum-exp of the masked logits, [B, Hq, Tq]."""
    g = c.q.shape[1] // c.num_kv_heads
    kk = c.k.double().repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", c.q.double(), kk) * c.scale
    if c.mask is not None:
        m = c.mask.expand(c.k.shape[0], c.num_kv_heads, c.k.shape[2]).repeat_interleave(g, 1)
        s = s.masked_fill(~m[:, :, None, :], float("-inf"))
    return torch.logsumexp(s, -1)


@pytest.mark.parametrize("seed", range(8))
def test_attention_logits_match_float64(seed):
    c = random_case(seed, Tq=2)
    g = c.q.shape[1] // c.num_kv_heads
    ref = torch.einsum("bhqd,bhkd->bhqk", c.q.double(), c.k.double().repeat_interleave(g, 1)) * c.scale
    out = attention_logits(c.q, c.k, c.scale)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(24))
def test_partial_attention_matches_reference(seed, dtype):
    c = random_case(seed, dtype, Tq=1 + seed % 3)
    out, lse = partial_attention(c.q, c.k, c.v, c.scale, c.mask)
    ref = dense_attention_reference(c.q, c.k, c.v, c.scale, c.mask)
    assert out.dtype == dtype and out.shape == c.q.shape
    assert lse.dtype == torch.float32 and lse.shape == c.q.shape[:3]
    assert rel_err(out, ref) < TOL[dtype]
    ref_lse = _ref_lse(c)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # -inf exactly where no key is visible
    assert rel_err(lse[finite], ref_lse[finite]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_reduced_precision_over_a_capacity_view(seed, dtype):
    """A KV segment's [:, :, :T] view of its capacity takes head_matmul's per-head path on the
    CPU: the same result as one batched matmul over contiguous copies, and partial_attention
    over the view still matches the float64 reference."""
    c = random_case(seed, dtype, Tq=1 + seed % 2)
    B, Hkv, T, D = c.k.shape
    spare = 3 + seed

    def capacity_view(x):
        buf = torch.randn(B, Hkv, T + spare, D).to(dtype)
        buf[:, :, :T] = x
        return buf[:, :, :T]

    k, v = capacity_view(c.k), capacity_view(c.v)
    assert k.is_contiguous() == (B * Hkv == 1)  # one (sequence, head): the view is packed anyway
    qg = c.q.reshape(B, Hkv, -1, D)
    assert torch.equal(head_matmul(qg, k.transpose(-1, -2)), torch.matmul(qg, c.k.transpose(-1, -2)))
    p = torch.randn(B, Hkv, qg.shape[2], T).to(dtype)
    assert torch.equal(head_matmul(p, v), torch.matmul(p, c.v))
    out, _ = partial_attention(c.q, k, v, c.scale, c.mask)
    assert rel_err(out, dense_attention_reference(c.q, c.k, c.v, c.scale, c.mask)) < TOL[torch.bfloat16]


def test_partial_attention_empty_and_all_masked():
    q = torch.randn(2, 4, 1, 8)
    k = torch.randn(2, 2, 0, 8)
    out, lse = partial_attention(q, k, k, 0.3)
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())
    k = torch.randn(2, 2, 5, 8)
    mask = torch.zeros(2, 2, 5, dtype=torch.bool)
    mask[0] = True  # batch 1 sees nothing
    out, lse = partial_attention(q, k, k, 0.3, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isneginf(lse[1]).all())
    assert bool(torch.isfinite(lse[0]).all()) and not bool(torch.isnan(out).any())


def _split_points(gen, T, parts):
    cuts = sorted(gen.randint(0, T) for _ in range(parts - 1))
    return [0, *cuts, T]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(24))
def test_merge_partials_of_any_number_of_parts(seed, dtype):
    """Split the KV at random points (empty parts allowed), mask some parts out completely."""
    gen = random.Random(1000 + seed)
    c = random_case(seed, dtype, Tq=1 + seed % 2)
    T = c.k.shape[2]
    B, Hkv = c.k.shape[:2]
    mask = c.mask.expand(B, Hkv, T).clone() if c.mask is not None else torch.ones(B, Hkv, T, dtype=torch.bool)
    n_parts = gen.randint(1, 6)
    pts = _split_points(gen, T, n_parts)
    for a, b in zip(pts, pts[1:]):
        if gen.random() < 0.25:
            mask[:, :, a:b] = False  # an all-masked part
    parts = [partial_attention(c.q, c.k[:, :, a:b], c.v[:, :, a:b], c.scale, mask[:, :, a:b])
             for a, b in zip(pts, pts[1:])]
    gen.shuffle(parts)  # the merge is order-free
    out, lse = merge_partials(parts)
    ref = dense_attention_reference(c.q, c.k, c.v, c.scale, mask)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    whole_out, whole_lse = partial_attention(c.q, c.k, c.v, c.scale, mask)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(whole_lse))
    fin = torch.isfinite(whole_lse)
    assert rel_err(lse[fin], whole_lse[fin]) < TOL[dtype]


def test_merge_partials_all_parts_empty_and_no_parts():
    q = torch.randn(1, 2, 1, 4)
    empty = torch.randn(1, 1, 0, 4)
    out, lse = merge_partials([partial_attention(q, empty, empty, 1.0)] * 3)
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())
    with pytest.raises(ValueError):
        merge_partials([])


def test_partial_attention_large_logits_are_stable():
    """Logits far beyond exp's range still give finite, exact results (max-subtraction)."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 16) * 10
    k = torch.randn(1, 2, 33, 16) * 10
    v = torch.randn(1, 2, 33, 16)
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], 1.0) for a, b in ((0, 10), (10, 33))]
    out, _ = merge_partials(parts)
    ref = dense_attention_reference(q, k, v, 1.0)
    assert bool(torch.isfinite(out).all())
    assert rel_err(out, ref) < 1e-5
