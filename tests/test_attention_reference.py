"""The float64 reference itself, checked against a per-query loop and torch SDPA."""
import math

import pytest
import torch
import torch.nn.functional as F

from hybridgen.attention import dense_attention_reference
from tests._attention_cases import random_case


def _naive(q, k, v, scale, mask, causal):
    """Explicit loops over (b, h, i): softmax over the allowed keys, zero when none."""
    B, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    g = Hq // Hkv
    out = torch.zeros(B, Hq, Tq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // g
            for i in range(Tq):
                allowed = [j for j in range(T)
                           if (mask is None or bool(mask.expand(B, Hkv, T)[b, kv, j]))
                           and (not causal or j <= T - Tq + i)]
                if not allowed:
                    continue
                s = torch.stack([q[b, h, i].double() @ k[b, kv, j].double() * scale for j in allowed])
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[n] * v[b, kv, j].double() for n, j in enumerate(allowed))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_loops(seed, causal):
    c = random_case(seed, T=7, Tq=3 if causal else 2)
    ref = dense_attention_reference(c.q, c.k, c.v, c.scale, c.mask, causal=causal)
    assert ref.dtype == torch.float64
    torch.testing.assert_close(ref, _naive(c.q, c.k, c.v, c.scale, c.mask, causal), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_sdpa_causal(seed):
    c = random_case(seed, T=11, Tq=11, mask_kind="none")
    g = c.q.shape[1] // c.k.shape[1]
    sdpa = F.scaled_dot_product_attention(c.q.double(), c.k.double().repeat_interleave(g, 1),
                                          c.v.double().repeat_interleave(g, 1), is_causal=True, scale=c.scale)
    ref = dense_attention_reference(c.q, c.k, c.v, c.scale, None, causal=True)
    torch.testing.assert_close(ref, sdpa, rtol=1e-10, atol=1e-12)


def test_reference_no_visible_key_is_zero():
    q = torch.randn(1, 2, 1, 4)
    k = torch.randn(1, 1, 3, 4)
    out = dense_attention_reference(q, k, k, 0.5, torch.zeros(1, 1, 3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))
    assert not math.isnan(out.sum().item())
