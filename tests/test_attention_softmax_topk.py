"""topk_per_group and softmax_over_parts (the paper's one-softmax merge) against float64."""
import random

import pytest
import torch

from hybridgen.attention import attention_logits, dense_attention_reference, softmax_over_parts, topk_per_group
from hybridgen.attention.partial import _mask_logits
from tests._attention_cases import TOL, random_case, rel_err

DTYPES = [torch.float32, torch.bfloat16]


def _masked_logits(c, k, mask):
    return _mask_logits(attention_logits(c.q, k, c.scale), mask, c.num_kv_heads)


def _full_mask(c):
    B, Hkv, T = c.k.shape[0], c.num_kv_heads, c.k.shape[2]
    return c.mask.expand(B, Hkv, T).clone() if c.mask is not None else torch.ones(B, Hkv, T, dtype=torch.bool)


@pytest.mark.parametrize("seed", range(16))
def test_topk_per_head(seed):
    c = random_case(seed, mask_kind="none")
    logits = attention_logits(c.q, c.k, c.scale)
    T = logits.shape[-1]
    k = random.Random(seed).randint(0, T + 3)  # may exceed T: clamped
    vals, idx = topk_per_group(logits, k, c.num_kv_heads, per_head=True)
    kk = min(k, T)
    B, Hq = logits.shape[:2]
    assert vals.shape == (B, Hq, 1, kk) and idx.shape == (B, Hq, kk)
    assert torch.equal(torch.gather(logits[:, :, 0], -1, idx), vals[:, :, 0])  # values match indices
    best = torch.sort(logits[:, :, 0], -1, descending=True).values[..., :kk]
    assert torch.equal(torch.sort(vals[:, :, 0], -1, descending=True).values, best)


@pytest.mark.parametrize("seed", range(16))
def test_topk_per_group_uses_group_scores(seed):
    c = random_case(seed, mask_kind="none")
    logits = attention_logits(c.q, c.k, c.scale)
    B, Hq, _, T = logits.shape
    Hkv = c.num_kv_heads
    g = Hq // Hkv
    k = random.Random(seed).randint(1, T + 2)
    kk = min(k, T)
    vals, idx = topk_per_group(logits, k, Hkv, per_head=False)
    assert vals.shape == (B, Hq, 1, kk) and idx.shape == (B, Hkv, kk)
    score = logits.double().view(B, Hkv, g, T).sum(2)  # [B, Hkv, T]
    best = torch.sort(score, -1, descending=True).values[..., :kk]
    chosen = torch.sort(torch.gather(score, -1, idx), -1, descending=True).values
    torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-5)
    assert len(set(idx[0, 0].tolist())) == kk  # distinct tokens
    # every head of a group gets its own logits at the group's indices
    expect = torch.gather(logits[:, :, 0], -1, idx.repeat_interleave(g, 1))
    assert torch.equal(vals[:, :, 0], expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(16))
def test_softmax_over_parts_shared_values_equals_dense(seed, dtype):
    """Parts with per-group values [B, Hkv, Ti, D]: one softmax == dense attention over all."""
    gen = random.Random(seed)
    c = random_case(seed, dtype)
    T = c.k.shape[2]
    mask = _full_mask(c)
    cuts = sorted({0, T, *(gen.randint(0, T) for _ in range(gen.randint(0, 3)))})
    parts = [(_masked_logits(c, c.k[:, :, a:b], mask[:, :, a:b]), c.v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    parts.append((torch.zeros(*c.q.shape[:3], 0), c.v[:, :, :0]))  # an empty part
    out = softmax_over_parts(parts, c.num_kv_heads)
    ref = dense_attention_reference(c.q, c.k, c.v, c.scale, mask)
    assert out.dtype == dtype and out.shape == c.q.shape
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_softmax_over_topk_and_window_equals_softmax_over_selected_set(seed, per_head, dtype):
    """Host top-k (per head or per group) + GPU window in one softmax == dense over the selection."""
    gen = random.Random(seed)
    c = random_case(seed, dtype, T=gen.choice((9, 21, 40)))
    B, Hkv, T, D = c.k.shape
    Hq = c.q.shape[1]
    g = Hq // Hkv
    split = gen.randint(0, T)  # host [0, split), GPU [split, T)
    mask = _full_mask(c)
    host_logits = _masked_logits(c, c.k[:, :, :split], mask[:, :, :split])
    kk = gen.randint(0, split + 1)
    vals, idx = topk_per_group(host_logits, kk, Hkv, per_head=per_head)
    n = idx.shape[-1]
    if per_head:  # one V row set per query head: [B, Hq, n, D]
        v_host = torch.gather(c.v[:, :, :split].repeat_interleave(g, 1), 2, idx[..., None].expand(-1, -1, -1, D))
    else:  # shared by the group: [B, Hkv, n, D]
        v_host = torch.gather(c.v[:, :, :split], 2, idx[..., None].expand(-1, -1, -1, D))
    gpu_logits = _masked_logits(c, c.k[:, :, split:], mask[:, :, split:])
    out = softmax_over_parts([(vals, v_host), (gpu_logits, c.v[:, :, split:])], Hkv)

    # Reference: per query head, dense softmax over (selected host tokens) + (GPU tokens).
    sel = torch.zeros(B, Hq, T, dtype=torch.bool)
    head_idx = idx if per_head else idx.repeat_interleave(g, 1)
    sel[:, :, :split].scatter_(2, head_idx, True)
    sel[:, :, split:] = True
    sel &= mask.repeat_interleave(g, 1)
    ref = dense_attention_reference(c.q, c.k.repeat_interleave(g, 1), c.v.repeat_interleave(g, 1), c.scale, sel)
    assert out.shape == (B, Hq, 1, D) and n == min(kk, split)
    assert rel_err(out, ref) < TOL[dtype]


def test_softmax_over_parts_all_masked_is_zero():
    q = torch.randn(1, 2, 1, 4)
    v = torch.randn(1, 1, 3, 4)
    logits = torch.full((1, 2, 1, 3), float("-inf"))
    out = softmax_over_parts([(logits, v), (torch.zeros(1, 2, 1, 0), v[:, :, :0])], 1)
    assert torch.equal(out, torch.zeros(1, 2, 1, 4))
    out = softmax_over_parts([(torch.zeros(1, 2, 1, 0), v[:, :, :0])], 1)
    assert torch.equal(out, torch.zeros(1, 2, 1, 4)) and q.shape[-1] == out.shape[-1]
