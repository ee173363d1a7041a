"""HybridGen's CPU branch (hybridgen.hybrid.host_branch): exact logits of the selection, top-k counts."""
import torch

from hybridgen.attention import cpu_scan as cs
from hybridgen.hybrid.host_branch import host_branch, topk_count
from hybridgen.kv import TieredStore
from tests._scan_cases import host_segment as _segment, ref_logits as _ref_logits


def test_host_branch_exact_logits_and_counts():
    B, Hkv, G, D, T = 1, 2, 2, 8, 40
    seg = _segment(B, Hkv, T, D, torch.bfloat16)
    q = torch.randn(B, Hkv * G, D)
    sel = host_branch(q, seg.k, seg.v, 0.3, 7, per_head=False, keep_keys=True, backend="torch")
    assert sel.idx.shape == (B, Hkv, 7) and sel.v_rows.shape == (B, Hkv, 7, D) and sel.k_rows.shape == (B, Hkv, 7, D)
    exact = cs.rows_logits(q, sel.k_rows, 0.3)
    ref = _ref_logits(q, seg.k, 0.3).gather(2, sel.idx.repeat_interleave(G, dim=1))
    assert float((exact.double() - ref).abs().max()) < 1e-4
    assert topk_count(0.05, 100) == 5 and topk_count(0.05, 100, minimum=16) == 16
    assert topk_count(0.5, 0) == 0 and topk_count(1.0, 10, minimum=16) == 10
    # three-way: the streamed tokens count, the scanned ones cap (a scan window over 40 of 300 host
    # tokens with 90 streamed selects 0.1 * 130 = 13; 0.5 of them would be 65, capped at the 40 scanned)
    assert topk_count(0.1, 40, streamed=90) == 13 and topk_count(0.5, 40, streamed=90) == 40


# ------------------------------------------------------------------ the whole branch, every scan kind
import pytest  # noqa: E402

from hybridgen.attention.key_sketch import KeySketch  # noqa: E402
from hybridgen.hybrid import HybridGen  # noqa: E402
from hybridgen.methods import Budget  # noqa: E402
from hybridgen.methods.full import Full  # noqa: E402
from hybridgen.testing import drive  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "numba", "native"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_branch_backends_agree_with_float64(backend, per_head, masked):
    """Selection within rounding of the float64 top-k and fp32-exact logits of what was picked."""
    B, Hkv, G, D, T, k = 2, 2, 4, 32, 700, 33
    seg = _segment(B, Hkv, T, D, torch.bfloat16, seed=3)
    q = torch.randn(B, Hkv * G, D)
    mask = (torch.rand(B, Hkv, T) > 0.25) if masked else None
    sel = host_branch(q, seg.k, seg.v, 0.2, k, per_head, mask=mask, keep_keys=True, backend=backend)
    Hsel = Hkv * G if per_head else Hkv
    assert sel.idx.shape == (B, Hsel, k) and sel.v_rows.shape == (B, Hsel, k, D)
    ref = _ref_logits(q, seg.k, 0.2)
    if mask is not None:
        ref = ref.masked_fill(~mask.repeat_interleave(G, dim=1), float("-inf"))
    got = sel.logits.double()
    want = ref.gather(2, sel.idx.repeat_interleave(G, dim=1) if not per_head else sel.idx)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    tol = 1e-4 if sel.exact else 5e-2
    assert float((got[fin] - want[fin]).abs().max()) < tol
    vref = torch.gather(seg.v.repeat_interleave(G, dim=1) if per_head else seg.v, 2,
                        sel.idx[..., None].expand(-1, -1, -1, D))
    assert torch.equal(sel.v_rows, vref)
    if mask is not None:
        assert bool(sel.mask.all())  # 33 of ~525 real tokens: padding is never picked


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_hybridgen_with_a_key_sketch_selecting_everything_equals_full(kind):
    """topk 1.0 through the sketch: the recomputed logits are exact, so the output is `full`'s."""
    shape = (2, 8, 2, 32, 90)
    ref = drive(Full(), shape, 4, seed=5, dtype=torch.float32)
    m = HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=1.0, key_sketch=kind, min_topk=0)
    run = drive(m, shape, 4, seed=5, dtype=torch.float32)
    for a, b in zip(run.records, ref.records):
        assert float((a.out - b.out).abs().max() / b.out.abs().max()) < 1e-4
    owners = run.ctx.store["dram"].bytes_by_owner()
    assert any(o.endswith("/sketch/codes") for o in owners)
    m.release()
    assert run.ctx.store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}


def test_hybridgen_sketch_partial_selection_keeps_exact_logits():
    shape = (1, 8, 2, 32, 300)
    m = HybridGen(gpu_budget=Budget(tokens=16), topk_ratio=0.1, key_sketch="int8", min_topk=0)
    run = drive(m, shape, 3, seed=9, dtype=torch.float32)
    assert m.stats["exact_logit_recomputes"] == 0  # the branch itself recomputed them exactly
    assert all(torch.isfinite(r.out).all() for r in run.records)
    m.release()


def test_sketch_memory_comes_from_the_segment_tier():
    store = TieredStore()
    sk = KeySketch(store["dram"].view(pinned=False), "int8", 1, 2, 16, 100, "layer0/host/sketch")
    assert store["dram"].bytes_by_owner()["layer0/host/sketch/codes"] == 2 * 128 * 16  # 100 tokens -> one 128-token block
    sk.release()
    assert store["dram"].used == 0


def test_branch_without_the_c_kernels_selects_the_same(monkeypatch):
    """No compiler (native.lib() is None): numba/torch kernels, the same selection and logits."""
    from hybridgen.attention import native

    B, Hkv, G, D, T = 1, 2, 4, 64, 900
    seg = _segment(B, Hkv, T, D, torch.bfloat16, seed=11)
    q = torch.randn(B, Hkv * G, D)
    a = host_branch(q, seg.k, seg.v, 0.125, 40, False)
    monkeypatch.setattr(native, "lib", lambda: None)
    monkeypatch.setattr(native, "has_avx2", lambda: False)
    assert cs.resolve_backend("auto", torch.bfloat16) in ("numba", "torch")
    b = host_branch(q, seg.k, seg.v, 0.125, 40, False)
    assert torch.equal(a.idx.sort(-1).values, b.idx.sort(-1).values)
    oa, ob = a.idx.argsort(-1).repeat_interleave(G, dim=1), b.idx.argsort(-1).repeat_interleave(G, dim=1)
    tol = 1e-4 if b.exact else 5e-2
    assert float((a.logits.gather(2, oa) - b.logits.gather(2, ob)).abs().max()) < tol
