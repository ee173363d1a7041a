"""The key sketch (hybridgen.attention.key_sketch): an exact sketch selects exactly what the
exact scan selects; quantization error bounds; incremental sync; ledger-counted memory;
recall of the exact top-k on random and real-like keys; the torch fallback."""
import pytest
import torch

from hybridgen.attention import cpu_scan as cs
from hybridgen.attention import native
from hybridgen.attention.key_sketch import SKETCH_BLOCK, KeySketch, quantize_query
from hybridgen.errors import ConfigError
from hybridgen.host_branch import host_branch
from hybridgen.kv import KVSegment, TieredStore

QMAX = {"int8": 127, "int4": 7}


def _exact_keys(B, H, T, D, kind, gen):
    """Integer keys with every block's maximum at qmax: the sketch represents them exactly."""
    qm = QMAX[kind]
    k = torch.randint(-qm, qm + 1, (B, H, T, D), generator=gen).float()
    k[:, :, ::SKETCH_BLOCK, 0] = qm
    return k.to(torch.bfloat16)


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
    q = torch.randint(-64, 65, (B, H * G, D), generator=gen).float()
    for scale in (1.0, 0.125):
        lg_s = sk.scan(q, scale, 0, T)
        lg_e, _ = cs.scan_logits(q, keys, scale, None, "auto")
        assert torch.equal(lg_s, lg_e)
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
    q = torch.randint(-20, 21, (B, H * G, D), generator=gen).float()
    lg_s = sk.scan(q, 0.5, lo, T)
    lg_e, _ = cs.scan_logits(q, keys[:, :, lo:], 0.5, None, "auto")
    assert torch.equal(lg_s, lg_e)
    mask = torch.rand(B, H, T - lo, generator=gen) > 0.3
    sel = host_branch(q, keys[:, :, lo:], keys[:, :, lo:], 0.5, 9, False, mask=mask, sketch=sk, sketch_offset=lo)
    ref = host_branch(q, keys[:, :, lo:], keys[:, :, lo:], 0.5, 9, False, mask=mask)
    assert torch.equal(sel.idx.sort(-1).values, ref.idx.sort(-1).values)
    assert bool(sel.mask.all())  # 9 of ~110 real tokens: only real ones are picked


@pytest.mark.parametrize("kind,tol", [("int8", 0.02), ("int4", 0.35)])
def test_sketch_logits_close_to_exact_on_random_keys(kind, tol):
    gen = torch.Generator().manual_seed(2)
    B, H, G, D, T = 2, 2, 4, 64, 400
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    store = TieredStore()
    sk = KeySketch(store["dram"], kind, B, H, D, T, "l/sketch")
    sk.sync(keys)
    q = torch.randn(B, H * G, D, generator=gen)
    ref = (q.double().view(B, H, G, D) @ keys.double().transpose(-1, -2)).view(B, H * G, T)
    err = (sk.scan(q, 1.0, 0, T).double() - ref).abs().max() / ref.abs().max()
    assert float(err) < tol


@pytest.mark.parametrize("kind,floor", [("int8", 0.9), ("int4", 0.6)])
def test_recall_of_exact_topk(kind, floor):
    """Recall of the exact top-k (5% of 2048 tokens) by the sketch's selection, random keys."""
    gen = torch.Generator().manual_seed(3)
    B, H, G, D, T, k = 2, 4, 4, 64, 2048, 103
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    store = TieredStore()
    sk = KeySketch(store["dram"], kind, B, H, D, T, "l/sketch")
    sk.sync(keys)
    q = torch.randn(B, H * G, D, generator=gen)
    a = host_branch(q, keys, keys, D ** -0.5, k, False)
    b = host_branch(q, keys, keys, D ** -0.5, k, False, sketch=sk)
    hits = sum(len(set(a.idx[i, h].tolist()) & set(b.idx[i, h].tolist())) for i in range(B) for h in range(H))
    assert hits / (B * H * k) >= floor


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
        assert sk.length == seg.length
        assert torch.equal(sk.codes[:, :, :seg.length], fresh.codes[:, :, :seg.length])
        assert torch.equal(sk.scales[:, :, :-(-seg.length // SKETCH_BLOCK)],
                           fresh.scales[:, :, :-(-seg.length // SKETCH_BLOCK)])
    seg.pop_front(50)  # same buffer, the front moved: rebuilt even once it has grown back
    seg.append(torch.randn(B, H, 60, D, generator=gen).to(torch.bfloat16),
               torch.randn(B, H, 60, D, generator=gen).to(torch.bfloat16))
    sk.sync(seg.k)
    full = KeySketch(store["dram"], "int8", B, H, D, 300, "full")
    full.sync(seg.k)
    assert torch.equal(sk.codes[:, :, :seg.length], full.codes[:, :, :seg.length])


def test_sketch_memory_is_ledger_counted_and_released():
    store = TieredStore()
    tier = store["dram"]
    before = tier.used
    sk = KeySketch(tier, "int4", 2, 4, 64, 1000, "layer3/host/sketch")
    owners = tier.bytes_by_owner()
    assert owners["layer3/host/sketch/codes"] == 2 * 4 * 1000 * 32
    assert owners["layer3/host/sketch/scales"] == 2 * 4 * -(-1000 // SKETCH_BLOCK) * 4
    assert tier.used - before == sk.nbytes
    sk.release()
    assert tier.used == before


def test_quantize_query_power_of_two_scale_and_errors():
    q = torch.tensor([[64.0, -3.0, 1.0], [0.0, 0.0, 0.0], [1e-3, 2e-3, -7e-4]])
    codes, s = quantize_query(q)
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))
    assert codes.abs().max() <= 32767
    assert torch.equal(codes[0].float() * s[0], q[0])  # small integers stay exact
    assert float((codes[2].float() * s[2] - q[2]).abs().max()) <= float(s[2])
    with pytest.raises(ConfigError):
        KeySketch(TieredStore()["dram"], "int2", 1, 1, 8, 8, "x")
    with pytest.raises(ConfigError):
        KeySketch(TieredStore()["dram"], "int4", 1, 1, 7, 8, "x")


def test_torch_fallback_matches_native(monkeypatch):
    """Without the C kernels the sketch scan dequantizes in torch: the same logits."""
    gen = torch.Generator().manual_seed(5)
    B, H, G, D, T = 1, 2, 4, 32, 150
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen)
    for kind in ("int8", "int4"):
        for src in (keys, keys.float()):
            sk = KeySketch(TieredStore()["dram"], kind, B, H, D, T + 9, "s")
            sk.sync(src)
            a = sk.scan(q, 0.3, 3, T)
            monkeypatch.setattr(native, "lib", lambda: None)
            ref = KeySketch(TieredStore()["dram"], kind, B, H, D, T + 9, "s")
            ref.sync(src)  # torch quantization: the same codes and scales as the C kernel
            b = sk.scan(q, 0.3, 3, T)
            monkeypatch.undo()
            assert torch.equal(sk.codes[:, :, :T], ref.codes[:, :, :T]) and torch.equal(sk.scales, ref.scales)
            assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


def test_portable_c_bodies_match_the_avx2_ones(monkeypatch):
    """The C kernels' portable bodies (non-x86 CPUs, no AVX2) against the AVX2 ones and float64."""
    portable = native.load_portable()
    if portable is None or not native.has_avx2():
        pytest.skip("needs a C compiler and an AVX2 build to compare with")
    gen = torch.Generator().manual_seed(6)
    B, H, G, D, T = 2, 2, 4, 64, 613
    keys = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    vals = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, H * G, D, generator=gen)
    fast = {kind: KeySketch(TieredStore()["dram"], kind, B, H, D, T, "s") for kind in ("int8", "int4")}
    for sk in fast.values():
        sk.sync(keys)
    a = {kind: sk.scan(q, 0.2, 5, T) for kind, sk in fast.items()}
    exact_a, _ = cs.scan_logits(q, keys, 0.2, None, "native")
    sel_a = host_branch(q, keys, vals, 0.2, 31, False)
    monkeypatch.setattr(native, "lib", lambda: portable)
    slow = {kind: KeySketch(TieredStore()["dram"], kind, B, H, D, T, "s") for kind in ("int8", "int4")}
    for kind, sk in slow.items():
        sk.sync(keys)
        assert torch.equal(sk.codes, fast[kind].codes) and torch.equal(sk.scales, fast[kind].scales)
        b = sk.scan(q, 0.2, 5, T)
        assert float((a[kind] - b).abs().max()) <= 1e-5 * float(a[kind].abs().max())
    ref = (q.double().view(B, H, G, D) @ keys.double().transpose(-1, -2)).view(B, H * G, T) * 0.2
    for fn, k in ((portable.hg_scan_bf16, keys), (portable.hg_scan_f32, keys.float())):
        out = torch.empty(B * H, G, T)
        qg = q.reshape(B * H, G, D).contiguous()
        fn(qg.data_ptr(), k.data_ptr(), T, out.data_ptr(), 0.2, T, D, G, 512, None, 0, B * H * 2)
        assert float((out.view(B, H * G, T).double() - ref).abs().max()) < 1e-4
    assert float((exact_a.double() - ref).abs().max()) < 1e-4
    sel_b = host_branch(q, keys, vals, 0.2, 31, False)  # numba scan, portable C select + gather
    assert torch.equal(sel_a.idx.sort(-1).values, sel_b.idx.sort(-1).values)
