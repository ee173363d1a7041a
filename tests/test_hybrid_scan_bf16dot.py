"""HybridGen's selection scan (``scan``): the default 'bf16dot' (bf16 x bf16 products, fp32
sums, ceil(scan_oversample * k) candidates re-ranked by exact fp32 logits) against the exact
fp32 scan and a float64 reference; fp32 keys scanned exactly; bad values refused."""
import pytest
import torch

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.errors import ConfigError
from hybridgen.hybrid import HybridGen
from hybridgen.hybrid import method as hybrid_method
from hybridgen.hybrid.host_branch import host_branch, pipelined_host_branch, scan_precision
from hybridgen.methods import Budget, build_method
from hybridgen.testing import drive

POOL = CPUAttentionPool(workers=1)


def _planted(B, Hkv, G, T, D, k, seed, dtype=torch.bfloat16):
    """q [B, Hq, D] (the G heads of a group close to one direction) and keys [B, Hkv, T, D]
    where k tokens per (batch, KV head), the planted set, point along that direction: their
    logits stand ~8 above every other token's, so any correct selection of k returns them."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(B, Hkv, 1, D, generator=g), dim=-1)
    q = (base + 0.05 * torch.randn(B, Hkv, G, D, generator=g)).reshape(B, Hkv * G, D) * D ** 0.5
    keys = torch.randn(B, Hkv, T, D, generator=g)
    planted = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(B * Hkv)]).view(B, Hkv, k)
    boost = torch.zeros(B, Hkv, T, 1).scatter_(2, planted[..., None], 8.0)
    keys = keys + boost * base  # planted logits ~ +8 (scale D**-0.5, |q| ~ sqrt(D))
    vals = torch.randn(B, Hkv, T, D, generator=g)
    return q, keys.to(dtype), vals.to(dtype), planted


def _reference_logits(q, keys, idx, scale):
    """float64 logits of q [B, Hq, D] at the shared selection idx [B, Hkv, k] -> [B, Hq, k]."""
    B, Hq, D = q.shape
    Hkv = keys.shape[1]
    rows = torch.gather(keys.double(), 2, idx[..., None].expand(-1, -1, -1, D))  # [B, Hkv, k, D]
    qg = q.double().view(B, Hkv, Hq // Hkv, D)
    return (qg @ rows.transpose(-1, -2) * scale).view(B, Hq, -1)


def _recall(a, b):
    """Share of b's selected tokens (per row of [.., k]) that a also selects."""
    k = a.shape[-1]
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.reshape(-1, k), b.reshape(-1, k))) / b.numel()


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_bf16dot_branch_selects_the_exact_scans_tokens_with_exact_logits(G, dtype, masked):
    """A well-separated top set: the bf16-dot branch returns the exact scan's tokens, the same V
    rows, and logits equal to the float64 reference (an unreranked scan's bf16 logits are off
    by ~1e-2 and fail); fp32 keys given straight to the branch (the bound method scans them
    exactly) take the same path with the bf16-rounded query."""
    B, Hkv, T, D, k = 2, 2, 1500, 64, 24
    q, keys, vals, planted = _planted(B, Hkv, G, T, D, k, seed=G)
    keys, vals = keys.to(dtype), vals.to(dtype)
    mask = None
    if masked:  # padding hides some tokens, never a planted one
        mask = torch.ones(B, Hkv, T, dtype=torch.bool)
        mask[:, :, :100] = True
        mask[0, :, 200:260] = False
        mask.scatter_(2, planted, True)
    scale = D ** -0.5
    ex = host_branch(q, keys, vals, scale, k, False, mask=mask, pool=POOL)
    dot = host_branch(q, keys, vals, scale, k, False, mask=mask, pool=POOL, precision="bf16dot", oversample=1.25)
    assert dot.exact
    for sel in (ex, dot):
        assert torch.equal(sel.idx.sort(-1).values, planted.sort(-1).values)
    order_d, order_e = dot.idx.argsort(-1), ex.idx.argsort(-1)
    v_d = torch.gather(dot.v_rows, 2, order_d[..., None].expand(-1, -1, -1, D))
    v_e = torch.gather(ex.v_rows, 2, order_e[..., None].expand(-1, -1, -1, D))
    assert torch.equal(v_d, v_e)
    ref = _reference_logits(q, keys, dot.idx, scale)
    assert torch.allclose(dot.logits.double(), ref, rtol=1e-5, atol=1e-5)


def _spread_keys(B, H, T, D, g):
    """Keys with a realistic spread: log-normal channel scales (a few large channels, as real
    keys have), a shared per-channel offset and a per-token norm."""
    ch = torch.exp(torch.randn(D, generator=g) * 0.8)
    tok = 1 + 0.3 * torch.randn(B, H, T, 1, generator=g).abs()
    return torch.randn(B, H, T, D, generator=g) * ch * tok + 0.5 * ch


def test_bf16dot_recall_of_the_exact_topk_on_spread_random_keys():
    """>= 0.99 of the exact scan's top-k (5% of 4096 tokens, SmolLM2's GQA 9/3, D 64), and
    the re-rank of 1.25 k candidates recovers what the bf16-dot order alone misses."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, T, D = 2, 3, 3, 4096, 64
    k = 205
    got, alone = [], []
    for _ in range(3):
        keys = _spread_keys(B, Hkv, T, D, g).to(torch.bfloat16)
        vals = torch.randn(B, Hkv, T, D, generator=g).to(torch.bfloat16)
        q = torch.randn(B, Hkv * G, D, generator=g) * torch.exp(torch.randn(D, generator=g) * 0.5)
        ex = host_branch(q, keys, vals, D ** -0.5, k, False, pool=POOL)
        dot = host_branch(q, keys, vals, D ** -0.5, k, False, pool=POOL, precision="bf16dot", oversample=1.25)
        one = host_branch(q, keys, vals, D ** -0.5, k, False, pool=POOL, precision="bf16dot", oversample=1.0)
        got.append(_recall(dot.idx, ex.idx))
        alone.append(_recall(one.idx, ex.idx))
    assert min(got) >= 0.99, got
    assert sum(got) > sum(alone), (got, alone)


# ------------------------------------------------------------------------------ the method
def _host_branch_calls(monkeypatch):
    """Record the precision / oversample each CPU branch of HybridGen runs with."""
    calls = []

    def recording(*args, **kwargs):
        calls.append((kwargs["precision"], kwargs["oversample"]))
        return pipelined_host_branch(*args, **kwargs)

    monkeypatch.setattr(hybrid_method, "pipelined_host_branch", recording)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keys_not_bf16_are_scanned_exactly_and_the_default_equals_scan_exact(dtype, monkeypatch):
    """fp32 (and fp16) keys: the default scan is the exact one (no converted copy of the keys),
    so its outputs equal scan='exact''s bit for bit."""
    shape = (2, 6, 2, 16, 48)
    calls = _host_branch_calls(monkeypatch)
    runs = []
    for m in (HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=0.2), HybridGen(gpu_budget=Budget(tokens=8),
                                                                                topk_ratio=0.2, scan="exact")):
        run = drive(m, shape, 4, seed=5, dtype=dtype, pool=POOL)
        assert m.parts.scan.precision == "exact"
        runs.append([r.out for r in run.records])
        m.release()
    assert calls and {c[0] for c in calls} == {"exact"}
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert scan_precision("bf16dot", dtype) == "exact" and scan_precision("bf16dot", torch.bfloat16) == "bf16dot"
    assert scan_precision("exact", torch.bfloat16) == "exact"


def test_bf16_keys_default_scans_bf16dot_and_scan_exact_keeps_the_exact_scan(monkeypatch):
    """bf16 keys: the default CPU branch runs the bf16-dot scan with scan_oversample; scan='exact'
    runs the exact scan (today's path, no over-selection); their selections agree on >= 0.95 of
    the tokens (random prompts at these sizes have near-ties) and both outputs stay within
    bf16 rounding of each other."""
    shape = (2, 6, 2, 16, 120)
    calls = _host_branch_calls(monkeypatch)
    sels, outs = [], []
    for m in (HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=0.2, scan_oversample=1.5, pipeline=False),
              HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=0.2, scan="exact", pipeline=False)):
        picked = []
        run = drive(m, shape, 4, seed=7, dtype=torch.bfloat16, pool=POOL,
                    after_step=lambda meth, step, picked=picked: picked.append(
                        {l: s[1].clone() for l, s in meth.last_selection.items()}))
        sels.append(picked)
        outs.append([r.out for r in run.records])
        m.release()
    precisions = [c[0] for c in calls]
    assert set(precisions[:len(precisions) // 2]) == {"bf16dot"} and set(precisions[len(precisions) // 2:]) == {"exact"}
    assert calls[0][1] == 1.5
    agree = [_recall(a[l], b[l]) for a, b in zip(*sels) for l in a]
    assert agree and sum(agree) / len(agree) >= 0.95
    for a, b in zip(*outs):
        assert float((a.float() - b.float()).abs().max()) < 0.1


def test_with_a_key_sketch_the_keys_tail_is_scanned_at_scans_precision(monkeypatch):
    """key_sketch + the default scan on bf16 keys: the sketch is the selection scan, the keys'
    tail it does not hold yet is scanned bf16-dot, and the candidates (sketch_oversample of
    them) are re-ranked exactly as before; scan='exact' scans that tail exactly."""
    from hybridgen.attention.key_sketch import SKETCH_BLOCK

    shape = (1, 4, 2, 16, SKETCH_BLOCK + 40)  # a partial tail block on the host
    calls = _host_branch_calls(monkeypatch)
    outs = []
    for scan in ("bf16dot", "exact"):
        m = HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=0.2, key_sketch="int8", sketch_oversample=1.5,
                      scan=scan, pipeline=False)
        run = drive(m, shape, 3, seed=11, dtype=torch.bfloat16, pool=POOL)
        assert m.parts.scan.precision == scan and m.parts.scan.exact
        outs.append([r.out for r in run.records])
        m.release()
    half = len(calls) // 2
    assert set(calls[:half]) == {("bf16dot", 1.5)} and set(calls[half:]) == {("exact", 1.5)}
    for a, b in zip(*outs):
        assert float((a.float() - b.float()).abs().max()) < 0.1


@pytest.mark.parametrize("bad", [{"scan": "fp8"}, {"scan": "BF16DOT"}, {"scan_oversample": 0.5},
                                 {"scan_oversample": float("nan")}])
def test_bad_scan_values_are_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as err:
        HybridGen(**bad)
    msg = str(err.value)
    assert "\n" not in msg and next(iter(bad)) in msg
    with pytest.raises(ConfigError):
        build_method("hybridgen", **bad)
