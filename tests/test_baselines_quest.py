"""Quest: page bounds are true upper bounds; top-K pages by the bound; exact attention over them."""
import random

import pytest
import torch

from hybridgen.methods.tensors import group_reduce
from baselines.quest import Quest, page_bounds, upper_bound
from hybridgen.attention import attention_logits, dense_attention_reference
from hybridgen.errors import ConfigError
from hybridgen.methods import Budget, build_method
from tests._baselines_cases import left_padding, rel_err, run_method

# Tokens the budget allows at context T+1, ..., T+5 (the new token included), worked out by hand
# (not by Budget.resolve): a ratio allows ceil(ratio * n), a token count min(tokens, n).
#   0.3 x 51..55 = 15.3 15.6 15.9 16.2 16.5 -> 16 16 16 17 17
#   0.3 x 78..82 = 23.4 23.7 24.0 24.3 24.6 -> 24 24 24 25 25
#   24t: every context here is >= 51 tokens, so 24
ALLOWED_BY_CONTEXT = {
    (Budget(ratio=0.3), 50): [16, 16, 16, 17, 17],
    (Budget(ratio=0.3), 77): [24, 24, 24, 25, 25],
    (Budget(tokens=24), 50): [24] * 5, (Budget(tokens=24), 77): [24] * 5,
}


@pytest.mark.parametrize("seed", range(5))
def test_page_bound_is_at_least_the_true_max_score(seed):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2))
    B, Hq, D, T, page = 2, Hkv * gen.choice((1, 4)), 16, gen.choice((31, 64)), gen.choice((4, 16))
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, Hq, 1, D, generator=g), torch.randn(B, Hkv, T, D, generator=g) * 3
    valid = left_padding(gen, B, T)
    kmin, kmax, pv = page_bounds(k, valid[:, None, :], page)
    ub = upper_bound(q, kmin, kmax)  # [B, Hq, P]
    s = attention_logits(q, k, 1.0)[:, :, 0]  # [B, Hq, T]
    P = kmin.shape[2]
    G = Hq // Hkv
    checked = 0
    for b in range(B):
        for h in range(Hq):
            for p in range(P):
                toks = [j for j in range(p * page, min(T, (p + 1) * page)) if valid[b, j]]
                if not toks:
                    assert not pv[b, h // G, p]
                    continue
                true_max = float(s[b, h, toks].max())
                assert float(ub[b, h, p]) >= true_max - 1e-4
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("seed", range(4))
def test_quest_selects_top_pages_and_attends_exactly(seed):
    gen = random.Random(seed)
    Hkv = gen.choice((1, 2))
    B, Hq, D, T = gen.choice((1, 2)), Hkv * gen.choice((1, 3)), 16, gen.choice((50, 77))
    page = gen.choice((4, 8))
    valid = left_padding(gen, B, T, min_real=10) if seed % 2 else None
    budget = gen.choice((Budget(ratio=0.3), Budget(tokens=24)))
    method = Quest(budget=budget, page_size=page, dense_layers=1)
    allowed = ALLOWED_BY_CONTEXT[budget, T]
    attended = []

    def after(m, step):
        sel = m.last_selected[1]
        attended.append(None if sel is None else sel.shape[-1] * page)

    run = run_method(method, (B, Hq, Hkv, D, T), 5, seed, valid, layers=2, after_step=after)
    for rec in run.records:
        if rec.layer == 0:  # dense layer
            mask = None if rec.valid is None else rec.valid[:, None, :]
            assert rel_err(rec.out, dense_attention_reference(rec.q, rec.k, rec.v, run.ctx.scale, mask)) < 1e-5
            continue
        total = rec.k.shape[2]
        allowed_now = allowed[total - T - 1]  # total = T + step + 1
        n_pages = max(1, allowed_now // page)
        P = -(-total // page)
        vm = None if rec.valid is None else rec.valid[:, None, :]
        kmin, kmax, pv = page_bounds(rec.k, vm, page)
        ub = group_reduce(upper_bound(rec.q, kmin, kmax), Hkv, "sum").masked_fill(~pv, float("-inf"))
        ub[..., P - 1] = float("inf")
        expect = torch.topk(ub, n_pages, dim=-1).indices.sort(-1).values
        # exact attention over the chosen pages' tokens
        tok_mask = torch.zeros(B, Hkv, total, dtype=torch.bool)
        for b in range(B):
            for h in range(Hkv):
                for p in expect[b, h].tolist():
                    tok_mask[b, h, p * page:(p + 1) * page] = True
        if rec.valid is not None:
            tok_mask &= rec.valid[:, None, :]
        assert int(tok_mask.sum(-1).max()) <= max(allowed_now, page)  # budget respected
        ref = dense_attention_reference(rec.q, rec.k, rec.v, run.ctx.scale, tok_mask)
        assert rel_err(rec.out, ref) < 1e-5, (rec.step,)
    assert all(a is not None and a <= max(allowed[-1], page) for a in attended)  # allowed[-1]: context T + 5
    # full KV resident (Quest saves reads, not memory)
    assert method.kv[1].length == T + 5


def test_quest_bad_parameters():
    with pytest.raises(ConfigError):
        build_method("quest", page_size=0)
    with pytest.raises(ConfigError):
        build_method("quest", dense_layers=-1)
