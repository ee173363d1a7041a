"""The key sketch (hybridgen.attention.key_sketch): an exact sketch selects exactly what the
exact scan selects; over-selection with an exact re-rank; error bounds; per-channel codes on
keys with outlier channels; incremental sync; ledger-counted memory; the block query; every
instruction-set level and the torch fallback give the same numbers."""
import pytest
import torch

from hybridgen.attention import cpu_scan as cs
from hybridgen.attention import native
from hybridgen.attention.key_sketch import SKETCH_BLOCK, TILE, KeySketch, block_query, sketch_bytes_per_token
from hybridgen.errors import ConfigError
from hybridgen.attention.cpu_select import corrected_lse, head_lse
from hybridgen.hybrid.host_branch import host_branch, rerank
from hybridgen.kv import KVSegment, TieredStore

LEVELS = {"int8": 255, "int4": 15}


def _exact_keys(B, H, T, D, kind, gen):
    """Integer keys that the codes represent exactly: in every block each channel spans
    [lo, lo + L] (lo random), so every scale is 1. |k| <= 255: exact in bf16."""
    L = LEVELS[kind]
    lo = torch.randint(-L, 1, (B, H, -(-T // SKETCH_BLOCK), 1, D), generator=gen).float()
    k = torch.randint(0, L + 1, (B, H, -(-T // SKETCH_BLOCK), SKETCH_BLOCK, D), generator=gen).float()
    k[:, :, :, 0], k[:, :, :, 1] = 0, L
    return (k + lo).view(B, H, -1, D)[:, :, :T].to(torch.bfloat16)


def _exact_query(B, Hq, D, gen):
    """Integer queries whose largest magnitude per head is 127: the block query keeps them."""
    q = torch.randint(-127, 128, (B, Hq, D), generator=gen).float()
    q[:, :, 0] = 127
    return q


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("G,D,T,per_head,how", [(4, 64, 300, False, "max"), (1, 32, 129, False, "max"),
                                                (3, 128, 77, True, "max"), (8, 64, 513, False, "sum"),
                                                (2, 16, 1100, False, "max")])
def test_exact_sketch_selects_what_the_exact_scan_selects(kind, G, D, T, per_head, how):
    gen = torch.Generator().manual_seed(G * 1000 + D + T)
    B, H = 2, 2
    keys = _exact_keys(B, H, T, D, kind, gen)
    vals = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    store = TieredStore()
    sk = KeySketch(store["dram"], kind, B, H, D, T + 5, "layer0/host/sketch")
    sk.sync(keys)
    q = _exact_query(B, H * G, D, gen)
    n = sk.length  # the whole blocks; host_branch scans the rest exactly
    assert n == T // SKETCH_BLOCK * SKETCH_BLOCK
    for scale in (1.0, 0.125):
        lg_s = sk.scan(q, scale, 0, n)
        lg_e, _ = cs.scan_logits(q, keys, scale, None, "auto")
        assert torch.equal(lg_s, lg_e[:, :, :n])
        a = host_branch(q, keys, vals, scale, 23, per_head, group_score=how)
        b = host_branch(q, keys, vals, scale, 23, per_head, group_score=how, sketch=sk)
        assert torch.equal(a.idx.sort(-1).values, b.idx.sort(-1).values)
        order_a, order_b = a.idx.argsort(-1), b.idx.argsort(-1)
        Hq = q.shape[1]
        rep = Hq // a.idx.shape[1]
        la = a.logits.gather(2, order_a.repeat_interleave(rep, dim=1))
        lb = b.logits.gather(2, order_b.repeat_interleave(rep, dim=1))
        assert torch.equal(la, lb)
        assert torch.equal(a.v_rows.gather(2, order_a[..., None].expand(-1, -1, -1, D)),
                           b.v_rows.gather(2, order_b[..., None].expand(-1, -1, -1, D)))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_sketch_scan_offset_and_mask(kind):
    gen = torch.Generator().manual_seed(1)
    B, H, G, D, T, lo = 1, 2, 2, 32, 200, 37
    keys = _exact_keys(B, H, T, D, kind, gen)
    store = TieredStore()
    sk = KeySketch(store["dram"], kind, B, H, D, T, "l/sketch")
    sk.sync(keys)
    q = _exact_query(B, H * G, D, gen)
    lg_s = sk.scan(q, 0.5, lo, sk.length)
    lg_e, _ = cs.scan_logits(q, keys[:, :, lo:sk.length], 0.5, None, "auto")
    assert torch.equal(lg_s, lg_e)
    mask = torch.rand(B, H, T - lo, generator=gen) > 0.3
    for over in (1.0, 3.0):  # 27 candidates for 9: masked ones must never win the re-rank
        sel = host_branch(q, keys[:, :, lo:], keys[:, :, lo:], 0.5, 9, False, mask=mask, sketch=sk, sketch_offset=lo,
                          oversample=over)
        ref = host_branch(q, keys[:, :, lo:], keys[:, :, lo:], 0.5, 9, False, mask=mask)
        assert torch.equal(sel.idx.sort(-1).values, ref.idx.sort(-1).values)
        assert bool(sel.mask.all())  # 9 of ~110 real tokens: only real ones are picked


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_oversampling_everything_selects_what_the_exact_scan_selects(kind):
    """With every token a candidate, the re-rank by exact logits (normalised by the corrected
    logsumexp, which is then the exact one) is the exact scan's selection, however coarse the sketch."""
    gen = torch.Generator().manual_seed(7)
    B, H, G, D, T, k = 2, 2, 4, 64, 640, 31
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen)
    sk = KeySketch(TieredStore()["dram"], kind, B, H, D, T, "s")
    sk.sync(keys)
    for per_head, how in ((False, "max"), (False, "sum"), (True, "max")):
        a = host_branch(q, keys, keys, D ** -0.5, k, per_head, group_score=how)
        b = host_branch(q, keys, keys, D ** -0.5, k, per_head, group_score=how, sketch=sk, oversample=T / k + 1)
        assert torch.equal(a.idx.sort(-1).values, b.idx.sort(-1).values)
        c = host_branch(q, keys, keys, D ** -0.5, k, per_head, group_score=how, sketch=sk, oversample=1.0)
        assert not torch.equal(a.idx.sort(-1).values, c.idx.sort(-1).values) or kind == "int8"


def test_rerank_keeps_the_best_exact_scores_and_ties_go_to_the_lower_token():
    cand = torch.tensor([[[2, 5, 9, 11]]])
    logits = torch.tensor([[[1.0, 3.0, 3.0, -1.0]]])
    idx, sel = rerank(logits, cand, 2, "max")
    assert sorted(idx.flatten().tolist()) == [5, 9] and sorted(sel.flatten().tolist()) == [3.0, 3.0]
    idx, _ = rerank(torch.tensor([[[2.0, 2.0, 2.0, 2.0]]]), cand, 2, "max")
    assert sorted(idx.flatten().tolist()) == [2, 5]
    # shared selection, 'max' group score: head 1 (small lse) wants token 11 most
    lg = torch.tensor([[[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    stats = torch.tensor([6.0, 1.0, 1.5, 1.0]).view(1, 1, 2, 2)  # one block per head: (max, sum exp) = its lse
    scan = torch.cat([torch.full((1, 1, 2), 6.0), torch.full((1, 1, 2), 1.5)], 1) - torch.log(torch.tensor(2.0))
    for lib in (native.lib(), None):
        for st, sl in ((stats, None), (None, scan)):  # from the statistics, or from the scan's logits
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(native, "lib", lambda: lib)
                idx, sel = rerank(lg, cand, 1, "max", sl, st)
            assert idx.flatten().tolist() == [11] and sel.flatten().tolist() == [0.0, 1.0]
    # the same with the logsumexp corrected: head 0's scan saw token 2 at 9.0 (its lse then
    # ~9.05), exactly it is 5.0, so head 0's corrected lse is ~5.3 and token 2 wins again
    approx = torch.tensor([[[9.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    for lib in (native.lib(), None):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "lib", lambda: lib)
            idx, _ = rerank(lg, cand, 1, "max", approx, None, approx)  # the scan saw just these 4 tokens
        assert idx.flatten().tolist() == [2]
    idx, _ = rerank(lg, cand, 1, "sum")
    assert idx.flatten().tolist() == [2]


def test_head_lse_from_statistics_and_the_corrected_lse():
    gen = torch.Generator().manual_seed(8)
    B, H, G, D, T = 1, 2, 2, 32, 1300
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen)
    logits, _, stats = cs.scan_logits_stats(q, keys, 0.2, None, "native")
    ref = torch.logsumexp(logits.double().view(B, H, G, T), dim=-1)
    if stats is not None:
        assert float((head_lse(logits, stats, H).double() - ref).abs().max()) < 1e-5
    assert float((head_lse(logits, None, H).double() - ref).abs().max()) < 1e-5
    approx = logits[:, :, :100] - 0.5  # candidates scored 0.5 too low: the correction puts them back
    corr = corrected_lse(torch.logsumexp((logits - torch.cat([torch.full_like(approx, 0.5), torch.zeros_like(
        logits[:, :, 100:])], -1)).view(B, H, G, T), -1), approx, logits[:, :, :100])
    assert float((corr.double() - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("kind,tol", [("int8", 0.03), ("int4", 0.12)])
def test_sketch_logits_close_to_exact_on_random_keys(kind, tol):
    gen = torch.Generator().manual_seed(2)
    B, H, G, D, T = 2, 2, 4, 64, 400
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    store = TieredStore()
    sk = KeySketch(store["dram"], kind, B, H, D, T, "l/sketch")
    sk.sync(keys)
    q = torch.randn(B, H * G, D, generator=gen)
    n = sk.length
    ref = (q.double().view(B, H, G, D) @ keys[:, :, :n].double().transpose(-1, -2)).view(B, H * G, n)
    err = (sk.scan(q, 1.0, 0, n).double() - ref).abs().max() / ref.abs().max()
    assert float(err) < tol
    # the codes themselves: within half a step of every key
    step = sk.params[:, :, :, 0].repeat_interleave(SKETCH_BLOCK, dim=2)[:, :, :n]
    assert bool(((sk.dequantized(0, n) - keys[:, :, :n].float()).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("kind,floor,floor_over", [("int8", 0.97, 0.99), ("int4", 0.85, 0.95)])
def test_recall_of_exact_topk(kind, floor, floor_over):
    """Recall of the exact top-k (5% of 2048 tokens) by the sketch's selection, random keys,
    without and with over-selection (1.5x candidates re-ranked exactly)."""
    gen = torch.Generator().manual_seed(3)
    B, H, G, D, T, k = 2, 4, 4, 64, 2048, 103
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    store = TieredStore()
    sk = KeySketch(store["dram"], kind, B, H, D, T, "l/sketch")
    sk.sync(keys)
    q = torch.randn(B, H * G, D, generator=gen)
    a = host_branch(q, keys, keys, D ** -0.5, k, False)
    for over, fl in ((1.0, floor), (1.5, floor_over)):
        b = host_branch(q, keys, keys, D ** -0.5, k, False, sketch=sk, oversample=over)
        hits = sum(len(set(a.idx[i, h].tolist()) & set(b.idx[i, h].tolist())) for i in range(B) for h in range(H))
        assert hits / (B * H * k) >= fl


def test_channel_scales_resolve_keys_with_outlier_channels():
    """Keys with a few channels 20x larger: a scale per channel keeps the other channels' codes
    fine, so the int4 sketch's logits stay close (one scale per block would round the small
    channels to about 1 level)."""
    gen = torch.Generator().manual_seed(4)
    B, H, G, D, T = 1, 2, 4, 64, 512
    ch = torch.ones(D)
    ch[:3] = 20.0
    keys = (torch.randn(B, H, T, D, generator=gen) * ch).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen) / ch  # the outliers do not dominate the logits
    sk = KeySketch(TieredStore()["dram"], "int4", B, H, D, T, "s")
    sk.sync(keys)
    ref = (q.double().view(B, H, G, D) @ keys.double().transpose(-1, -2)).view(B, H * G, T)
    err = float((sk.scan(q, 1.0, 0, T).double() - ref).abs().max() / ref.abs().max())
    codes = sk.unpacked(0, T)
    assert len(torch.unique(codes[..., 10])) >= 10  # a small channel uses most of the 16 levels
    assert err < 0.15


def test_sync_follows_appends_and_rebuilds_after_compaction():
    gen = torch.Generator().manual_seed(4)
    B, H, D = 1, 2, 16
    store = TieredStore()
    seg = KVSegment(store["dram"], B, H, D, torch.bfloat16, "layer0/host", capacity=300)
    sk = KeySketch(store["dram"], "int8", B, H, D, 300, "layer0/host/sketch")
    fresh = KeySketch(store["dram"], "int8", B, H, D, 300, "fresh")
    for n in (70, 1, 1, 60, 5):  # crosses block boundaries, partial blocks re-quantized
        seg.append(torch.randn(B, H, n, D, generator=gen).to(torch.bfloat16),
                   torch.randn(B, H, n, D, generator=gen).to(torch.bfloat16))
        sk.sync(seg.k)
        fresh.release()
        fresh = KeySketch(store["dram"], "int8", B, H, D, 300, "fresh")
        fresh.sync(seg.k)
        assert sk.length == seg.length // SKETCH_BLOCK * SKETCH_BLOCK  # whole blocks only
        tiles, blocks = sk.length // TILE, sk.length // SKETCH_BLOCK
        assert torch.equal(sk.codes[:, :, :tiles], fresh.codes[:, :, :tiles])
        assert torch.equal(sk.params[:, :, :blocks], fresh.params[:, :, :blocks])
    seg.pop_front(50)  # same buffer, the front moved: rebuilt even once it has grown back
    seg.append(torch.randn(B, H, 60, D, generator=gen).to(torch.bfloat16),
               torch.randn(B, H, 60, D, generator=gen).to(torch.bfloat16))
    sk.sync(seg.k)
    full = KeySketch(store["dram"], "int8", B, H, D, 300, "full")
    full.sync(seg.k)
    tiles = sk.length // TILE
    assert sk.length == full.length and torch.equal(sk.codes[:, :, :tiles], full.codes[:, :, :tiles])


def test_sketch_memory_is_ledger_counted_and_released():
    store = TieredStore()
    tier = store["dram"]
    before = tier.used
    sk = KeySketch(tier, "int4", 2, 4, 64, 1000, "layer3/host/sketch")
    owners = tier.bytes_by_owner()
    assert owners["layer3/host/sketch/codes"] == 2 * 4 * 1024 * 32  # capacity rounded up to a block
    assert owners["layer3/host/sketch/params"] == 2 * 4 * (1024 // SKETCH_BLOCK) * 2 * 64 * 4
    assert tier.used - before == sk.nbytes
    assert sk.bytes_per_token == sketch_bytes_per_token("int4", 64) == 32 + 2 * 4 * 64 / SKETCH_BLOCK
    sk.release()
    assert tier.used == before


def test_block_query_and_bad_inputs():
    q = torch.tensor([[[127.0, -3.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-3, 2e-3, -7e-4, 0.0]]])
    s = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    lo = torch.tensor([[2.0, -1.0, 0.5, 4.0]])
    q8, qs, z = block_query(q, s, lo)
    assert torch.equal(q8[0, 0], q[0, 0]) and float(qs[0, 0]) == 1.0  # integers up to 127 stay exact
    assert torch.equal(q8[0, 1], torch.zeros(4)) and float(qs[0, 1]) == 1.0
    assert float(q8[0, 2].abs().max()) == 127.0 and float(q8[0, 2, 3]) == 0.0  # a constant channel: s = 0
    assert torch.allclose(z, (q.double() * lo.double()).sum(-1))
    with pytest.raises(ConfigError):
        KeySketch(TieredStore()["dram"], "int2", 1, 1, 8, 8, "x")
    with pytest.raises(ConfigError, match="multiple of 8"):
        KeySketch(TieredStore()["dram"], "int4", 1, 1, 12, 8, "x")


def test_torch_fallback_matches_native(monkeypatch):
    """Without the C kernels the sketch quantizes and scans in torch: the same codes and logits."""
    gen = torch.Generator().manual_seed(5)
    B, H, G, D, T = 1, 2, 4, 32, 150
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen)
    for kind in ("int8", "int4"):
        for src in (keys, keys.float()):
            sk = KeySketch(TieredStore()["dram"], kind, B, H, D, T + 9, "s")
            sk.sync(src)
            a = sk.scan(q, 0.3, 3, sk.length)
            monkeypatch.setattr(native, "lib", lambda: None)
            ref = KeySketch(TieredStore()["dram"], kind, B, H, D, T + 9, "s")
            ref.sync(src)  # torch quantization: the same codes and parameters as the C kernel
            b = sk.scan(q, 0.3, 3, sk.length)
            monkeypatch.undo()
            tiles = -(-T // TILE)
            assert torch.equal(sk.codes[:, :, :tiles], ref.codes[:, :, :tiles]) and torch.equal(sk.params, ref.params)
            assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


@pytest.fixture
def every_level():
    """The instruction-set levels this machine runs (portable C is a separate build)."""
    if not native.available():
        pytest.skip("needs a C compiler")
    top = native.isa()
    yield list(range(1, top + 1))
    native.set_isa_limit(top)


def test_every_instruction_set_level_gives_the_same_numbers(monkeypatch, every_level):
    """The portable C bodies, AVX2 and AVX-512 (where the CPU has them) against each other and
    float64: identical sketch codes, parameters and logits, exact scans within fp32 rounding,
    the same selection."""
    gen = torch.Generator().manual_seed(6)
    B, H, G, D, T = 2, 2, 4, 64, 613
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    vals = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen)
    ref = (q.double().view(B, H, G, D) @ keys.double().transpose(-1, -2)).view(B, H * G, T) * 0.2

    def run():
        sk = {kind: KeySketch(TieredStore()["dram"], kind, B, H, D, T, "s") for kind in ("int8", "int4")}
        for s in sk.values():
            s.sync(keys)
        exact, _ = cs.scan_logits(q, keys, 0.2, None, "native")
        sel = host_branch(q, keys, vals, 0.2, 31, False, sketch=sk["int4"], oversample=1.5)
        return {k: (s.codes.clone(), s.params.clone(), s.scan(q, 0.2, 5, s.length)) for k, s in sk.items()}, exact, sel

    results = {}
    for level in every_level:
        native.set_isa_limit(level)
        results[level] = run()
    portable = native.load_portable()
    monkeypatch.setattr(native, "lib", lambda: portable)
    results[0] = run()
    monkeypatch.undo()
    base, exact0, sel0 = results[0]
    for level, (sk, exact, sel) in results.items():
        for kind in sk:
            assert all(torch.equal(a, b) for a, b in zip(sk[kind], base[kind])), (level, kind)
        assert float((exact.double() - ref).abs().max()) < 1e-4
        assert torch.equal(sel.idx.sort(-1).values, sel0.idx.sort(-1).values)


def test_isa_cap_from_the_environment(monkeypatch):
    from hybridgen import runtime

    monkeypatch.setenv("HYBRIDGEN_CPU_ISA", "sse9")
    with pytest.raises(ConfigError, match="HYBRIDGEN_CPU_ISA"):
        runtime.apply()
    monkeypatch.setenv("HYBRIDGEN_CPU_ISA", "AVX2")
    assert runtime.cpu_isa_cap() == 1


def test_a_decode_step_quantizes_nothing_until_its_block_fills(monkeypatch):
    """The sketch holds whole blocks; a step's new token lands in the keys' partial block, which
    the branch scans exactly: no quantization per step, one block's worth when a block fills."""
    gen = torch.Generator().manual_seed(12)
    B, H, G, D = 1, 2, 2, 32
    store = TieredStore()
    seg = KVSegment(store["dram"], B, H, D, torch.bfloat16, "l/host", capacity=400)
    seg.append(torch.randn(B, H, SKETCH_BLOCK + 120, D, generator=gen).to(torch.bfloat16),
               torch.zeros(B, H, SKETCH_BLOCK + 120, D).to(torch.bfloat16))
    sk = KeySketch(store["dram"], "int4", B, H, D, 400, "s")
    sk.sync(seg.k)
    calls = []
    orig = KeySketch._quantize
    monkeypatch.setattr(KeySketch, "_quantize", lambda self, k, t0, t1: calls.append((t0, t1)) or orig(self, k, t0, t1))
    q = torch.randn(B, H * G, D, generator=gen)
    for step in range(9):  # 120 -> 129 tokens in the second block
        seg.append(torch.randn(B, H, 1, D, generator=gen).to(torch.bfloat16), torch.zeros(B, H, 1, D).to(torch.bfloat16))
        sk.sync(seg.k)
        sel = host_branch(q, seg.k, seg.v, 0.2, 40, False, sketch=sk, oversample=float(seg.length))  # every token
        ref = host_branch(q, seg.k, seg.v, 0.2, 40, False)
        assert torch.equal(sel.idx.sort(-1).values, ref.idx.sort(-1).values)
    assert calls == [(SKETCH_BLOCK, 2 * SKETCH_BLOCK)]  # once, when the second block filled


def test_the_default_sketch_refuses_a_head_dim_it_cannot_hold_when_bound_naming_the_fix():
    """HybridGen's default int4 sketch needs a head dim that is a multiple of 8: binding it to
    keys of head dim 12 is a one-line ConfigError naming key_sketch='none' before any KV
    exists; with the sketch off the same context binds."""
    from hybridgen.hybrid import HybridGen
    from tests._baselines_cases import make_ctx

    ctx = make_ctx(1, 4, 2, 12, 40, 2)
    with pytest.raises(ConfigError, match="key_sketch='none'"):
        HybridGen(gpu_budget=0.5).bind(ctx)
    HybridGen(gpu_budget=0.5, key_sketch="none").bind(ctx)
