"""SnapKV's kept set equals a direct computation from its definition; decode is dense over it."""
import random

import pytest
import torch

from baselines.snapkv import SnapKV, snapkv_votes
from hybridgen.attention import dense_attention_reference
from hybridgen.errors import ConfigError
from hybridgen.methods import Budget, build_method
from tests._baselines_cases import left_padding, rel_err, run_method

# Prompt tokens kept for a prompt of T tokens, worked out by hand (not by Budget.resolve):
# ratio 0.4: ceil(0.4 x 30 = 12.0) = 12, ceil(0.4 x 41 = 16.4) = 17; a token count n <= T keeps n.
KEEP_BY_PROMPT = {
    (Budget(ratio=0.4), 30): 12, (Budget(ratio=0.4), 41): 17,
    (Budget(tokens=15), 30): 15, (Budget(tokens=15), 41): 15,
    (Budget(tokens=4), 30): 4, (Budget(tokens=4), 41): 4,
    (Budget(tokens=8), 30): 8, (Budget(tokens=8), 41): 8,
}


def _direct_selection(q, k, valid, keep, window, kernel, scale, Hkv):
    """Loops straight from the paper: window votes -> sum -> mean over group -> max-pool.

    Returns {(b, h): pooled votes of the T - window prefix tokens} (-inf for padding)."""
    B, Hq, T, D = q.shape
    G = Hq // Hkv
    w = min(window, keep)
    out = {}
    for b in range(B):
        real = [j for j in range(T) if valid is None or valid[b, j]]
        for h in range(Hkv):
            vote = [0.0] * (T - w)
            for g in range(G):
                for i in range(T - w, T):
                    if valid is not None and not valid[b, i]:
                        continue
                    keys = [j for j in real if j <= i]
                    p = torch.softmax(torch.stack([q[b, h * G + g, i] @ k[b, h, j] for j in keys]) * scale, 0)
                    for j, pj in zip(keys, p):
                        if j < T - w:
                            vote[j] += float(pj) / G
            half = kernel // 2
            pooled = [max(vote[max(0, j - half): j + half + 1]) for j in range(T - w)]
            pooled = [pv if (valid is None or valid[b, j]) else float("-inf") for j, pv in enumerate(pooled)]
            out[b, h] = pooled
    return out


@pytest.mark.parametrize("seed", range(6))
def test_snapkv_selection_equals_definition(seed):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2))
    B, Hq, D, T = gen.choice((1, 2)), Hkv * gen.choice((1, 2, 3)), 8, gen.choice((30, 41))
    valid = left_padding(gen, B, T, min_real=12) if seed % 2 else None
    window, kernel = gen.choice((4, 8)), gen.choice((1, 3, 7))
    budget = gen.choice((Budget(ratio=0.4), Budget(tokens=15), Budget(tokens=window)))
    method = SnapKV(budget=budget, window=window, kernel=kernel)
    run = run_method(method, (B, Hq, Hkv, D, T), 0, seed, valid, layers=1)
    q, k, v = run.prompt[0]
    keep = KEEP_BY_PROMPT[budget, T]
    w = min(window, keep)
    ref = _direct_selection(q, k, valid, keep, window, kernel, run.ctx.scale, Hkv)
    votes = snapkv_votes(q, k, run.ctx.scale, w, kernel, valid)
    seg = method.cache[0]
    assert seg.length == min(keep, T)
    for b in range(B):
        for h in range(Hkv):
            pooled = torch.tensor(ref[b, h], dtype=torch.float32)
            assert torch.allclose(votes[b, h], pooled, atol=1e-6)
            kept = {int(torch.nonzero((k[b, h] == seg.k[b, h, i]).all(-1))[0]) for i in range(seg.length)}
            assert set(range(T - w, T)) <= kept  # the observation window
            prefix = sorted(kept - set(range(T - w, T)))
            assert len(prefix) == keep - w
            others = [j for j in range(T - w) if j not in kept]
            if prefix and others:  # a top-k (ties in the pooled votes may break either way)
                assert float(pooled[prefix].min()) >= float(pooled[others].max()) - 1e-6


def test_snapkv_decode_dense_over_kept_plus_generated_and_budget():
    B, Hq, Hkv, D, T = 2, 6, 2, 16, 80
    budget = Budget(ratio=0.25)
    steps = 5
    lengths = []
    method = SnapKV(budget=budget, window=8)
    run = run_method(method, (B, Hq, Hkv, D, T), steps, 1, layers=2,
                     after_step=lambda m, s: lengths.append(m.cache[0].length))
    keep = 20  # 0.25 x 80 = 20.0 -> 20 prompt tokens kept
    # prompt budget respected; generated tokens are appended (the paper compresses the prompt only)
    assert lengths == [keep + s + 1 for s in range(steps)]
    # decode output = dense attention over the kept prompt tokens + every generated token
    for rec in run.records:
        seg = method.cache[rec.layer]
        kept_k = seg.k[:, :, :keep]
        kept_v = seg.v[:, :, :keep]
        k = torch.cat([kept_k, rec.k[:, :, T:]], 2)
        v = torch.cat([kept_v, rec.v[:, :, T:]], 2)
        assert rel_err(rec.out, dense_attention_reference(rec.q, k, v, run.ctx.scale)) < 1e-5
    # the window is always kept
    q, k, v = run.prompt[0]
    assert torch.equal(method.cache[0].k[:, :, keep - 8: keep], k[:, :, T - 8:])


def test_snapkv_bad_parameters():
    with pytest.raises(ConfigError):
        build_method("snapkv", kernel=4)
    with pytest.raises(ConfigError):
        build_method("snapkv", window=0)
    with pytest.raises(ConfigError):
        build_method("snapkv", pooling="median")
