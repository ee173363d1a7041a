"""HybridGen's default CPU branch fused per (batch, KV head) row (``csrc/branch.c``, issue 22 items
2-3): it selects exactly what the stagewise branch (each stage over every row, then the next)
selects, with the same exact logits and V rows, bit for bit, on random shapes, GQA ratios, odd
lengths, strided segment views and over-selection factors, with the bf16-dot scan or a key
sketch's (its tail, the keys it does not hold, bf16-dot scanned); its logits are the float64
reference's at the selected tokens; where it does not fit, the stagewise branch runs."""
import pytest
import torch

from hybridgen.attention import native
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.attention.cpu_scan import exact_logits_at, scan_logits_stats, select
from hybridgen.attention.cpu_select import fused_branch_fits, fused_branch_pays, rerank_exact
from hybridgen.attention.key_sketch import SKETCH_BLOCK, KeySketch
from hybridgen.kv import TieredStore
from hybridgen.hybrid import host_branch as host_branch_module
from hybridgen.hybrid.host_branch import host_branch
from tests._scan_cases import host_segment, ref_logits

# the fused branch runs where the C kernels build with their vector bodies (native_fits)
fits_here = pytest.mark.skipif(not (native.available() and native.has_avx2()),
                               reason="the C kernels' vector bodies do not run here: the stagewise branch runs")
POOL = CPUAttentionPool(workers=1, split_threads=2)
# (B, Hkv, G, D, T, k, query scale): odd lengths, GQA ratios 1-8, k > T, k = T, peaked queries
CASES = [(2, 2, 4, 128, 1001, 37, 2), (1, 3, 1, 64, 513, 20, 2), (3, 2, 2, 32, 700, 50, 2),
         (2, 1, 8, 128, 2050, 100, 2), (1, 2, 3, 96, 77, 77, 2), (2, 2, 5, 64, 300, 400, 2),
         (2, 4, 4, 64, 3000, 150, 8), (2, 2, 4, 128, 1001, 37, 6)]


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused kernel's calls from host_branch (so a dispatch that never fires fails)."""
    calls = []
    real = host_branch_module.fused_branch
    monkeypatch.setattr(host_branch_module, "fused_branch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@fits_here
@pytest.mark.parametrize("B,Hkv,G,D,T,k,qs", CASES)
@pytest.mark.parametrize("oversample", [1.0, 1.25, 2.0])
@pytest.mark.parametrize("how", ["max", "sum"])
def test_fused_branch_equals_the_stagewise_branch(B, Hkv, G, D, T, k, qs, oversample, how, fused_calls):
    seg = host_segment(B, Hkv, T, D, torch.bfloat16, seed=T + G + qs)
    q = torch.randn(B, Hkv * G, D, generator=torch.Generator().manual_seed(D + k + qs)) * qs
    kw = dict(precision="bf16dot", oversample=oversample, group_score=how, keep_keys=True, pool=POOL)
    assert fused_branch_fits(q, seg.k, seg.v, k, False, None)
    stagewise = host_branch(q, seg.k, seg.v, D ** -0.5, k, False, fused=False, **kw)
    assert not fused_calls
    kk = min(k, T)
    v_out = torch.full((B * Hkv * kk * D + 5,), float("nan"), dtype=torch.bfloat16)
    fused = host_branch(q, seg.k, seg.v, D ** -0.5, k, False, v_out=v_out, **kw)
    assert fused_calls == [1]
    assert torch.equal(fused.idx, stagewise.idx)
    assert torch.equal(fused.logits, stagewise.logits)
    assert torch.equal(fused.v_rows, stagewise.v_rows) and fused.v_rows.data_ptr() == v_out.data_ptr()
    assert torch.isnan(v_out[B * Hkv * kk * D:].float()).all()  # nothing written past the rows
    assert torch.equal(fused.k_rows, stagewise.k_rows)
    assert fused.exact and fused.mask is None and fused.scan_s > 0 and fused.gather_s >= 0
    # the logits are the exact ones at the selected tokens (float64 reference of the bf16 keys)
    ref = ref_logits(q, seg.k, D ** -0.5).view(B, Hkv, G, T)
    at = ref.gather(3, fused.idx[:, :, None, :].expand(B, Hkv, G, kk).contiguous()).view(B, Hkv * G, kk)
    torch.testing.assert_close(fused.logits.double(), at, rtol=1e-5, atol=1e-5)
    assert (fused.idx.sort(dim=-1).values == fused.idx).all()  # ascending token order, as the stagewise one


@fits_here
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("B,Hkv,G,D,T,offset,held,k", [
    (2, 2, 4, 128, 1001, 0, 896, 40),      # the sketch's whole blocks, a bf16-dot tail of 105
    (1, 3, 3, 64, 1300, 200, 1280, 60),    # keys from token 200 of the segment, tail of 220
    (2, 1, 8, 128, 640, 0, 640, 32),       # the sketch holds every key: no tail
    (2, 2, 1, 32, 400, 384, 384, 9),       # the sketch holds none of these keys: all tail
    (3, 2, 5, 96, 2100, 129, 1920, 100),   # an offset inside a sketch block
    (2, 2, 4, 64, 500, 100, 768, 30)])     # the sketch holds more than these keys: all from its codes
@pytest.mark.parametrize("oversample,how", [(1.0, "max"), (1.5, "max"), (1.5, "sum")])
def test_fused_sketch_branch_equals_the_stagewise_one(kind, B, Hkv, G, D, T, offset, held, k, oversample, how,
                                                      fused_calls):
    seg = host_segment(B, Hkv, max(offset + T, held), D, torch.bfloat16, seed=T + G)
    q = torch.randn(B, Hkv * G, D, generator=torch.Generator().manual_seed(D + k)) * 3
    sk = KeySketch(TieredStore()["dram"], kind, B, Hkv, D, seg.k.shape[2], "test/sketch")
    sk.sync(seg.k[:, :, :held])
    assert sk.length == held // SKETCH_BLOCK * SKETCH_BLOCK == held
    keys, vals = seg.k[:, :, offset:offset + T], seg.v[:, :, offset:offset + T]
    kw = dict(precision="bf16dot", oversample=oversample, keep_keys=True, pool=POOL, sketch=sk,
              sketch_offset=offset, group_score=how)
    stagewise = host_branch(q, keys, vals, D ** -0.5, k, False, fused=False, **kw)
    assert not fused_calls
    v_out = torch.full((B * Hkv * k * D,), float("nan"), dtype=torch.bfloat16)
    fused = host_branch(q, keys, vals, D ** -0.5, k, False, v_out=v_out, **kw)
    assert fused.v_rows.data_ptr() == v_out.data_ptr()
    assert fused_calls == [1]
    assert torch.equal(fused.idx, stagewise.idx)
    assert torch.equal(fused.logits, stagewise.logits)
    assert torch.equal(fused.v_rows, stagewise.v_rows) and torch.equal(fused.k_rows, stagewise.k_rows)
    ref = ref_logits(q, keys, D ** -0.5).view(B, Hkv, G, T)
    at = ref.gather(3, fused.idx[:, :, None, :].expand(B, Hkv, G, k).contiguous()).view(B, Hkv * G, k)
    torch.testing.assert_close(fused.logits.double(), at, rtol=1e-5, atol=1e-5)
    if oversample == 1.0 and held > offset:
        # the sketch's own top k differs from the bf16-dot scan's here: a fused branch that
        # ignored the sketch would fail the equality above
        plain = host_branch(q, keys, vals, D ** -0.5, k, False, precision="bf16dot", oversample=1.0, pool=POOL)
        assert not torch.equal(plain.idx, fused.idx)


@pytest.mark.parametrize("case", ["mask", "fp32 keys", "exact tail"])
def test_with_a_sketch_where_it_does_not_fit_the_stagewise_branch_runs(case, fused_calls):
    B, Hkv, G, D, T, k = 2, 2, 4, 32, 300, 12
    dtype = torch.float32 if case == "fp32 keys" else torch.bfloat16
    seg = host_segment(B, Hkv, T, D, dtype, seed=5)
    sk = KeySketch(TieredStore()["dram"], "int4", B, Hkv, D, T, "test/sketch")
    sk.sync(seg.k)
    q = torch.randn(B, Hkv * G, D)
    mask = torch.rand(B, Hkv, T) > 0.3 if case == "mask" else None
    kw = dict(sketch=sk, oversample=1.5, mask=mask, precision="exact" if case == "exact tail" else "bf16dot")
    a = host_branch(q, seg.k, seg.v, 0.2, k, False, **kw)
    b = host_branch(q, seg.k, seg.v, 0.2, k, False, fused=False, **kw)
    assert not fused_calls
    assert torch.equal(a.idx, b.idx) and torch.equal(a.logits, b.logits) and torch.equal(a.v_rows, b.v_rows)


@fits_here
def test_the_re_rank_and_its_corrected_logsumexp_matter_on_these_cases():
    """On the cases above the re-ranked k differ from the bf16-dot scan's own top k, and the
    re-rank without the logsumexp corrected by the candidates' exact logits picks differently
    too: a fused branch that skipped either would fail the equality test."""
    skipped_rerank = skipped_correction = False
    for B, Hkv, G, D, T, k, qs in CASES:
        seg = host_segment(B, Hkv, T, D, torch.bfloat16, seed=T + G + qs)
        q = torch.randn(B, Hkv * G, D, generator=torch.Generator().manual_seed(D + k + qs)) * qs
        k = min(k, T)
        kc = min(T, -(-5 * k // 4))  # oversample 1.25
        logits, _, stats = scan_logits_stats(q, seg.k, D ** -0.5, precision="bf16dot")
        cand, approx = select(logits, Hkv, kc, False, "max", stats=stats)
        exact = exact_logits_at(q, seg.k, cand, D ** -0.5)
        full, _ = rerank_exact(exact, approx, cand, k, "max", logits, stats)
        uncorrected, _ = rerank_exact(exact, None, cand, k, "max", logits, stats)
        top, _ = select(logits, Hkv, k, False, "max", stats=stats)
        as_sets = lambda x: [set(r.tolist()) for r in x.reshape(-1, k)]  # noqa: E731
        skipped_rerank |= as_sets(full) != as_sets(top)
        skipped_correction |= as_sets(full) != as_sets(uncorrected)
    assert skipped_rerank and skipped_correction


@fits_here
def test_keys_and_values_of_different_capacities():
    B, Hkv, G, D, T, k = 2, 2, 4, 64, 400, 30
    keys = host_segment(B, Hkv, T, D, torch.bfloat16, seed=1, extra=7)
    vals = host_segment(B, Hkv, T, D, torch.bfloat16, seed=2, extra=60)
    q = torch.randn(B, Hkv * G, D)
    a = host_branch(q, keys.k, vals.v, D ** -0.5, k, False, precision="bf16dot", oversample=1.25)
    b = host_branch(q, keys.k, vals.v, D ** -0.5, k, False, precision="bf16dot", oversample=1.25, fused=False)
    assert torch.equal(a.idx, b.idx) and torch.equal(a.logits, b.logits) and torch.equal(a.v_rows, b.v_rows)


@pytest.mark.parametrize("case", ["mask", "per_head", "fp32 keys", "k=0", "torch top-k", "numba scan", "G=9",
                                  "fp32 values"])
def test_where_it_does_not_fit_the_stagewise_branch_runs(case, fused_calls):
    B, Hkv, G, D, T, k = 2, 2, 9 if case == "G=9" else 2, 32, 90, 9
    seg = host_segment(B, Hkv, T, D, torch.float32 if case == "fp32 keys" else torch.bfloat16, seed=3)
    q = torch.randn(B, Hkv * G, D)
    vals = seg.v.float() if case == "fp32 values" else seg.v
    mask = torch.rand(B, Hkv, T) > 0.3 if case == "mask" else None
    per_head = case == "per_head"
    args = dict(mask=mask, topk_backend="torch" if case == "torch top-k" else "auto",
                backend="numba" if case == "numba scan" else "auto")
    kk = 0 if case == "k=0" else k
    assert not fused_branch_fits(q, seg.k, vals, kk, per_head, mask, args["backend"], args["topk_backend"])
    a = host_branch(q, seg.k, vals, 0.2, kk, per_head, precision="bf16dot", oversample=1.5, **args)
    b = host_branch(q, seg.k, vals, 0.2, kk, per_head, precision="bf16dot", oversample=1.5, fused=False, **args)
    assert not fused_calls
    assert torch.equal(a.idx, b.idx) and torch.equal(a.logits, b.logits) and torch.equal(a.v_rows, b.v_rows)


@pytest.mark.parametrize("rows,threads,pays", [(1, 2, False), (3, 2, True), (2, 2, True), (64, 15, True),
                                               (8, 15, False), (16, 15, False), (32, 15, True), (1, 1, True),
                                               (0, 4, True), (2, 3, True), (4, 3, True), (5, 4, False)])
def test_fused_branch_pays_only_while_it_keeps_the_threads_busy(rows, threads, pays):
    assert fused_branch_pays(rows, threads) is pays


@fits_here
def test_one_row_on_two_threads_runs_stagewise_with_the_same_result(fused_calls):
    """1 (batch, KV head) row on 2 threads: the fused branch would leave a thread idle, so the
    stagewise branch (its scan split over the row's tokens) runs; with 2 rows the fused one."""
    seg = host_segment(1, 1, 5000, 64, torch.bfloat16, seed=11)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
    kw = dict(precision="bf16dot", oversample=1.25, pool=POOL)
    a = host_branch(q, seg.k, seg.v, 0.125, 100, False, **kw)
    assert not fused_calls
    b = host_branch(q, seg.k, seg.v, 0.125, 100, False, fused=False, **kw)
    assert torch.equal(a.idx, b.idx) and torch.equal(a.logits, b.logits) and torch.equal(a.v_rows, b.v_rows)
    two = host_segment(2, 1, 5000, 64, torch.bfloat16, seed=11)
    host_branch(torch.randn(2, 4, 64), two.k, two.v, 0.125, 100, False, **kw)
    assert fused_calls == [1]
