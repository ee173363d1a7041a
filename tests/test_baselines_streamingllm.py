"""StreamingLLM: sinks + window always kept, budget respected, rotary positions re-assigned in cache."""
import random

import pytest
import torch

from baselines.streamingllm import StreamingLLM
from hybridgen.attention import dense_attention_reference
from hybridgen.errors import ConfigError
from hybridgen.methods import Budget, build_method
from hybridgen.model.rotary import RotaryEmbedding
from tests._baselines_cases import left_padding, make_ctx, rel_err

# Tokens the budget allows at context T, T+1, ..., T+7, worked out by hand (not by Budget.resolve):
# a ratio allows ceil(ratio * n), a token count min(tokens, n).
#   0.3 x 20..27 = 6.0 6.3 6.6 6.9 7.2 7.5 7.8 8.1      -> 6 7 7 7 8 8 8 9
#   0.3 x 33..40 = 9.9 10.2 10.5 10.8 11.1 11.4 11.7 12.0 -> 10 11 11 11 12 12 12 12
#   10t: every context here is >= 20 tokens, so 10
ALLOWED_BY_CONTEXT = {
    (Budget(ratio=0.3), 20): [6, 7, 7, 7, 8, 8, 8, 9],
    (Budget(ratio=0.3), 33): [10, 11, 11, 11, 12, 12, 12, 12],
    (Budget(tokens=10), 20): [10] * 8, (Budget(tokens=10), 33): [10] * 8,
}


def _run(method, B, Hq, Hkv, D, T, steps, valid, rotary, seed=0):
    """Feed pre-rotary q/k rotated at their text positions (left padding excluded, as the
    engine does). Returns per step (q0, k0_hist, v_hist, text positions of the history)."""
    ctx = make_ctx(B, Hq, Hkv, D, T, steps, layers=1, rotary=rotary)
    method.bind(ctx)
    g = torch.Generator().manual_seed(seed)
    vmask = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
    pos = (vmask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
    rot = (lambda x, p: x if rotary is None else rotary.rotate(x, p))
    q0, k0, v = torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g), \
        torch.randn(B, Hkv, T, D, generator=g)
    method.prefill(0, rot(q0, pos), rot(k0, pos), v, valid)
    hist_k0, hist_v, hist_valid, hist_pos = k0, v, vmask, pos
    out = []
    for step in range(steps):
        p = hist_pos[:, -1:] + 1
        qn, kn, vn = torch.randn(B, Hq, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g), \
            torch.randn(B, Hkv, 1, D, generator=g)
        o = method.decode(0, rot(qn, p), rot(kn, p), vn)
        method.end_step()
        hist_k0 = torch.cat([hist_k0, kn], 2)
        hist_v = torch.cat([hist_v, vn], 2)
        hist_valid = torch.cat([hist_valid, torch.ones(B, 1, dtype=torch.bool)], 1)
        hist_pos = torch.cat([hist_pos, p], 1)
        out.append((o, qn, hist_k0, hist_v, hist_valid, hist_pos))
    return ctx, out


def _expected_cache(hist_valid, sinks, budget_tokens, t_total):
    """Per row: the history indices StreamingLLM keeps: first `sinks` real tokens + most recent."""
    B = hist_valid.shape[0]
    kept = []
    for b in range(B):
        real = [j for j in range(t_total) if hist_valid[b, j]]
        s = real[:sinks]
        w = budget_tokens - len(s)
        rest = [j for j in range(t_total) if j not in s]
        kept.append(sorted(s + rest[len(rest) - w:] if w > 0 else s))
    return kept


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_sinks_window_kept_and_positions_reassigned(seed, shift):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2))
    B, Hq, D, T = gen.choice((1, 3)), Hkv * gen.choice((1, 3)), 16, gen.choice((20, 33))
    valid = left_padding(gen, B, T, min_real=8) if seed % 2 else None
    sinks = gen.choice((1, 4))
    budget = gen.choice((Budget(tokens=10), Budget(ratio=0.3)))
    steps = 7
    rotary = RotaryEmbedding(D, theta=10000.0)
    method = StreamingLLM(budget=budget, sinks=sinks, shift_positions=shift)
    ctx, out = _run(method, B, Hq, Hkv, D, T, steps, valid, rotary, seed)
    allowed = ALLOWED_BY_CONTEXT[budget, T]
    for step, (o, q0, k0, v, hv, hp) in enumerate(out):
        n_before = T + step  # the cache attended at this step holds tokens < n_before, + the new one
        bt_prev = allowed[step]  # the budget at context n_before = T + step
        kept = _expected_cache(hv[:, :n_before], sinks, bt_prev, n_before)
        # expected attention: cached keys at CACHE positions (shift) or text positions (naive)
        exp = torch.zeros(B, Hq, 1, D, dtype=torch.float64)
        for b in range(B):
            idx = kept[b] + [n_before]
            real = [j for j in idx if hv[b, j]]
            if shift:
                kpos = torch.arange(len(real))[None]
                qpos = torch.tensor([[len(real) - 1]])
            else:
                kpos = hp[b, real][None]
                qpos = hp[b, -1:][None]
            k = rotary.rotate(k0[b:b + 1, :, real], kpos)
            q = rotary.rotate(q0[b:b + 1], qpos)
            exp[b] = dense_attention_reference(q, k, v[b:b + 1, :, real], ctx.scale)[0]
        assert rel_err(o, exp) < 1e-5, (step, shift)
    # budget respected and sinks + window kept after every step
    total = T + steps
    bt = allowed[steps]  # context T + 7
    kept = _expected_cache(out[-1][4], sinks, bt, total)
    wk, sk = method.segments("window")[0], method.segments("sinks")[0]
    assert sk.length + wk.length <= bt
    for b in range(B):
        cached = sorted([j for j in method.window_pos[0].t[b, : wk.length].tolist() if j >= 0])
        real_sinks = [j for j in range(total) if out[-1][4][b, j]][:sinks]
        assert cached == [j for j in kept[b] if j not in real_sinks and out[-1][4][b, j]]


def test_budget_every_step_and_memory_bounded():
    B, Hq, Hkv, D, T = 2, 4, 2, 8, 100
    budget = Budget(ratio=0.1)
    method = StreamingLLM(budget=budget)
    ctx, out = _run(method, B, Hq, Hkv, D, T, 30, None, RotaryEmbedding(D))
    cap = 13  # the budget at the longest context, 130: 0.1 x 130 = 13.0 -> 13 tokens
    assert method.segments("sinks")[0].length + method.segments("window")[0].length <= cap
    held = ctx.store.bytes_by_tier()["gpu"]
    # sinks + window capacity, K and V, float32, plus int64 positions
    assert held == B * Hkv * cap * D * 4 * 2 + B * (cap - 4) * 8
    assert int(method.evicted[0].min()) == T + 30 - cap


def test_opt_without_rotary_falls_back_to_naive():
    B, Hq, Hkv, D, T = 2, 4, 4, 8, 30
    a = StreamingLLM(budget=Budget(tokens=8), shift_positions=True)
    b = StreamingLLM(budget=Budget(tokens=8), shift_positions=False)
    _, out_a = _run(a, B, Hq, Hkv, D, T, 5, None, None)
    _, out_b = _run(b, B, Hq, Hkv, D, T, 5, None, None)
    assert a.stats["position_shift"] == 0
    for (oa, *_), (ob, *_) in zip(out_a, out_b):
        assert torch.equal(oa, ob)


def test_bad_parameters():
    with pytest.raises(ConfigError):
        build_method("streamingllm", sinks=-1)
    with pytest.raises(ConfigError):
        build_method("streamingllm", bogus=1)
