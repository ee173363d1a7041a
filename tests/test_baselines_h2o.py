"""H2O keeps the heavy hitters by accumulated attention plus the recent window, evicting greedily."""
import random

import pytest
import torch

from baselines.h2o import H2O, recent_count
from hybridgen.errors import ConfigError
from hybridgen.methods import Budget, build_method
from tests._baselines_cases import left_padding, rel_err, run_method

# Tokens the budget allows at context T, T+1, ..., T+6, worked out by hand (not by Budget.resolve):
# a ratio keeps ceil(ratio * n), a token count keeps min(tokens, n).
#   0.4  x 12..18 = 4.8 5.2 5.6 6.0 6.4 6.8 7.2    -> 5 6 6 6 7 7 8
#   0.4  x 20..26 = 8.0 8.4 8.8 9.2 9.6 10.0 10.4  -> 8 9 9 10 10 10 11
#   0.25 x 12..18 = 3.0 3.25 3.5 3.75 4.0 4.25 4.5 -> 3 4 4 4 4 5 5
#   0.25 x 20..26 = 5.0 5.25 5.5 5.75 6.0 6.25 6.5 -> 5 6 6 6 6 7 7
#   7t and 5t: every context here is >= 12 tokens, so 7 and 5
ALLOWED_BY_CONTEXT = {
    (Budget(ratio=0.4), 12): [5, 6, 6, 6, 7, 7, 8],
    (Budget(ratio=0.4), 20): [8, 9, 9, 10, 10, 10, 11],
    (Budget(ratio=0.25), 12): [3, 4, 4, 4, 4, 5, 5],
    (Budget(ratio=0.25), 20): [5, 6, 6, 6, 6, 7, 7],
    (Budget(tokens=7), 12): [7] * 7, (Budget(tokens=7), 20): [7] * 7,
    (Budget(tokens=5), 12): [5] * 7, (Budget(tokens=5), 20): [5] * 7,
}


def _reference_h2o(prompt, decode_inputs, valid, allowed: list, recent_fraction, scale, Hkv):
    """Plain-Python H2O from its definition, per (batch, KV head): returns per step the kept
    position sets and the outputs [B, Hq, 1, D]. ``allowed[i]``: tokens the budget allows at
    context T + i (i = 0 .. len(decode_inputs))."""
    q, k, v = prompt
    B, Hq, T, D = q.shape
    G = Hq // Hkv
    keep = allowed[0]
    recent = recent_count(keep, recent_fraction)
    caches = {}
    for b in range(B):
        real = [j for j in range(T) if valid is None or valid[b, j]]
        for h in range(Hkv):
            score = {j: 0.0 for j in range(T)}
            for g in range(G):
                for i in real:
                    keys = [j for j in real if j <= i]
                    p = torch.softmax(torch.stack([q[b, h * G + g, i] @ k[b, h, j] for j in keys]) * scale, 0)
                    for j, pj in zip(keys, p):
                        score[j] += float(pj)
            older = [j for j in range(T - recent)]
            rank = sorted(older, key=lambda j: (-(score[j] if (valid is None or valid[b, j]) else -1e9), j))
            kept = set(rank[: keep - recent]) | set(range(T - recent, T))
            caches[b, h] = {j: [k[b, h, j], v[b, h, j], score[j] if (valid is None or valid[b, j]) else float("-inf"),
                                valid is None or bool(valid[b, j])] for j in kept}
    kept_sets, outs = [], []
    for step, (qn, kn, vn) in enumerate(decode_inputs):
        t = T + step
        out = torch.zeros(B, Hq, 1, D, dtype=torch.float64)
        for b in range(B):
            for h in range(Hkv):
                cache = caches[b, h]
                pos = sorted(cache)
                ks = torch.stack([cache[j][0] for j in pos] + [kn[b, h, 0]]).double()
                vs = torch.stack([cache[j][1] for j in pos] + [vn[b, h, 0]]).double()
                ok = torch.tensor([cache[j][3] for j in pos] + [True])
                psum = torch.zeros(len(pos) + 1, dtype=torch.float64)
                for g in range(G):
                    lg = (ks @ qn[b, h * G + g, 0].double()) * scale
                    p = torch.softmax(lg.masked_fill(~ok, float("-inf")), 0)
                    out[b, h * G + g, 0] = p @ vs
                    psum += p
                for j, pj in zip(pos, psum[:-1]):
                    cache[j][2] += float(pj)
                new_entry = [kn[b, h, 0], vn[b, h, 0], float(psum[-1]), True]
                bt = allowed[step + 1]  # context t + 1 = T + step + 1
                if len(cache) + 1 <= bt:
                    cache[t] = new_entry
                    continue
                r = recent_count(bt, recent_fraction)
                cand = [j for j in pos if j <= t - r]
                victim = min(cand, key=lambda j: cache[j][2]) if cand else min(pos)
                del cache[victim]
                cache[t] = new_entry
        kept_sets.append({key: set(c) for key, c in caches.items()})
        outs.append(out)
    return kept_sets, outs


@pytest.mark.parametrize("seed", range(4))
def test_h2o_matches_reference_definition(seed):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2))
    B, Hq, D, T = gen.choice((1, 2)), Hkv * gen.choice((1, 3)), 8, gen.choice((12, 20))
    valid = left_padding(gen, B, T, min_real=3) if seed % 2 else None
    budget = [Budget(ratio=0.4), Budget(tokens=7), Budget(ratio=0.25), Budget(tokens=5)][seed]
    frac = gen.choice((0.5, 0.3, 0.0))
    steps = 6
    method = H2O(budget=budget, recent_fraction=frac, chunk=5)
    kept_by_step = []

    def after(m, step):
        kept_by_step.append({(b, h): set(m.pos[0].t[b, h, : m.cache[0].length].tolist())
                             for b in range(B) for h in range(Hkv)})

    run = run_method(method, (B, Hq, Hkv, D, T), steps, seed, valid, layers=1, after_step=after)
    dec = [(r.q, r.k[:, :, -1:], r.v[:, :, -1:]) for r in run.records]
    allowed = ALLOWED_BY_CONTEXT[budget, T]
    ref_sets, ref_outs = _reference_h2o(run.prompt[0], dec, valid, allowed, frac, run.ctx.scale, Hkv)
    for step in range(steps):
        assert kept_by_step[step] == ref_sets[step], step
        assert rel_err(run.records[step].out, ref_outs[step]) < 1e-5


def test_h2o_budget_recent_window_and_top_scores_every_step():
    B, Hq, Hkv, D, T = 2, 6, 2, 16, 60
    budget = Budget(ratio=0.2)
    T_steps = 12
    # tokens allowed after step s (context T + s + 1 = 61..72), by hand: 0.2 x 61..72 =
    # 12.2 12.4 12.6 12.8 13.0 | 13.2 13.4 13.6 13.8 14.0 | 14.2 14.4 -> ceil: 13 x5, 14 x5, 15 x2
    allowed = [13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 15, 15]
    capacity = 15  # the budget at the longest context, 72: ceil(14.4) = 15
    seen = []

    def after(m, step):
        t = T + step
        bt = allowed[step]
        for layer in range(2):
            seg, _, ps = m.cache[layer], m.scores[layer].t, m.pos[layer].t
            n = seg.length
            assert n <= bt  # budget respected
            assert seg.capacity == capacity  # memory bounded, never regrown
            r = recent_count(bt, m.recent_fraction)
            for b in range(B):
                for h in range(Hkv):
                    kept = set(ps[b, h, :n].tolist())
                    assert set(range(t - r + 1, t + 1)) <= kept  # recent window always kept
        seen.append(step)

    method = H2O(budget=budget)
    run = run_method(method, (B, Hq, Hkv, D, T), T_steps, 3, after_step=after)
    assert len(seen) == T_steps and method.stats["evicted"] > 0
    # the memory held is the budget, not the context
    gpu = run.ctx.store["gpu"].bytes_by_owner()
    assert gpu["layer0/kv/k"] == B * Hkv * capacity * D * 4


def test_h2o_prefill_keeps_top_accumulated_scores():
    """After prefill, the non-recent kept tokens are exactly the top accumulated-attention ones."""
    from hybridgen.methods.tensors import causal_attention_colsum, group_reduce
    B, Hq, Hkv, D, T = 2, 4, 2, 8, 50
    method = H2O(budget=Budget(ratio=0.3), recent_fraction=0.4)
    run = run_method(method, (B, Hq, Hkv, D, T), 0, 7, layers=1)
    q, k, v = run.prompt[0]
    acc = group_reduce(causal_attention_colsum(q, k, run.ctx.scale, None, chunk=T), Hkv, "sum")
    keep = 15  # 0.3 x 50 = 15.0 -> 15 kept
    r = recent_count(keep, 0.4)
    top = torch.topk(acc[..., : T - r], keep - r, dim=-1).indices
    kept = method.pos[0].t[:, :, :keep]
    for b in range(B):
        for h in range(Hkv):
            assert set(kept[b, h].tolist()) == set(top[b, h].tolist()) | set(range(T - r, T))
            assert torch.equal(method.cache[0].k[b, h], k[b, h, kept[b, h]])


def test_h2o_bad_parameters():
    with pytest.raises(ConfigError):
        build_method("h2o", recent_fraction=1.5)
    with pytest.raises(ConfigError):
        build_method("h2o", budget="lots")
