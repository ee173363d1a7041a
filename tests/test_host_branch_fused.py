"""HybridGen's default CPU branch fused per (batch, KV head) row (``csrc/branch.c``, issue 22 items
2-3): it selects exactly what the stagewise branch (each stage over every row, then the next)
selects, with the same exact logits and V rows, bit for bit, on random shapes, GQA ratios, odd
lengths, strided segment views and over-selection factors; its logits are the float64
reference's at the selected tokens; where it does not fit, the stagewise branch runs."""
import pytest
import torch

from hybridgen.attention import native
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.attention.cpu_scan import scan_logits_stats, select
from hybridgen.attention.cpu_select import fused_branch_bf16dot, fused_branch_fits
from hybridgen.hybrid.host_branch import host_branch
from tests._scan_cases import host_segment, ref_logits

pytestmark = pytest.mark.skipif(not native.available(), reason="the C kernels do not build here")
POOL = CPUAttentionPool(workers=1, split_threads=2)


@pytest.mark.parametrize("B,Hkv,G,D,T,k", [(2, 2, 4, 128, 1001, 37), (1, 3, 1, 64, 513, 20), (3, 2, 2, 32, 700, 50),
                                           (2, 1, 8, 128, 2050, 100), (1, 2, 3, 96, 77, 77), (2, 2, 5, 64, 300, 400)])
@pytest.mark.parametrize("oversample", [1.0, 1.25, 2.0])
@pytest.mark.parametrize("how", ["max", "sum"])
def test_fused_branch_equals_the_stagewise_branch(B, Hkv, G, D, T, k, oversample, how):
    seg = host_segment(B, Hkv, T, D, torch.bfloat16, seed=T + G)
    q = torch.randn(B, Hkv * G, D, generator=torch.Generator().manual_seed(D + k)) * 2
    kw = dict(precision="bf16dot", oversample=oversample, group_score=how, keep_keys=True, pool=POOL)
    assert fused_branch_fits(q, seg.k, seg.v, k, False, None)
    stagewise = host_branch(q, seg.k, seg.v, D ** -0.5, k, False, fused=False, **kw)
    kk = min(k, T)
    v_out = torch.full((B * Hkv * kk * D + 5,), float("nan"), dtype=torch.bfloat16)
    fused = host_branch(q, seg.k, seg.v, D ** -0.5, k, False, v_out=v_out, **kw)
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


def test_the_re_rank_runs_inside_the_fused_branch():
    """Over-selection matters on these inputs (the re-ranked k differ from the bf16-dot scan's own
    top k), so a fused branch that skipped the re-rank would fail the test above."""
    B, Hkv, G, D, T, k = 2, 2, 4, 128, 1001, 37
    seg = host_segment(B, Hkv, T, D, torch.bfloat16, seed=T + G)
    q = torch.randn(B, Hkv * G, D, generator=torch.Generator().manual_seed(D + k)) * 2
    logits, _, stats = scan_logits_stats(q, seg.k, D ** -0.5, precision="bf16dot")
    scan_top, _ = select(logits, Hkv, k, False, "max", stats=stats)
    idx, _, _, _ = fused_branch_bf16dot(q, seg.k, seg.v, D ** -0.5, k, "max", 2.0, pool=POOL)
    differ = [set(a.tolist()) != set(b.tolist()) for a, b in zip(idx.view(-1, k), scan_top.view(-1, k))]
    assert any(differ)


@pytest.mark.parametrize("case", ["mask", "per_head", "fp32 keys", "k=0", "torch top-k", "fp32 values"])
def test_where_it_does_not_fit_the_stagewise_branch_runs(case):
    B, Hkv, G, D, T, k = 2, 2, 2, 32, 90, 9
    seg = host_segment(B, Hkv, T, D, torch.float32 if case == "fp32 keys" else torch.bfloat16, seed=3)
    q = torch.randn(B, Hkv * G, D)
    vals = seg.v.float() if case == "fp32 values" else seg.v
    mask = torch.rand(B, Hkv, T) > 0.3 if case == "mask" else None
    args = dict(per_head=case == "per_head", mask=mask, topk_backend="torch" if case == "torch top-k" else "auto")
    kk = 0 if case == "k=0" else k
    assert not fused_branch_fits(q, seg.k, vals, kk, args["per_head"], mask, topk_backend=args["topk_backend"])
    a = host_branch(q, seg.k, vals, 0.2, kk, args.pop("per_head"), precision="bf16dot", oversample=1.5, **args)
    b = host_branch(q, seg.k, vals, 0.2, kk, case == "per_head", precision="bf16dot", oversample=1.5, fused=False,
                    **args)
    assert torch.equal(a.idx, b.idx) and torch.equal(a.logits, b.logits) and torch.equal(a.v_rows, b.v_rows)
