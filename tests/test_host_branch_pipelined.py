"""HybridGen's CPU branch pipelined over batch slices (host_branch.pipelined_host_branch, issue 22
item 3): it selects exactly what the serial branch selects, with the same logits and V rows,
for every scan precision, selection mode, mask and slice count; a failing slice raises."""
import pytest
import torch

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.hybrid.host_branch import host_branch, pipelined_host_branch
from tests._scan_cases import host_segment as _segment

POOL = CPUAttentionPool(workers=1, split_threads=2)


@pytest.mark.parametrize("precision,oversample", [("exact", 1.0), ("bf16dot", 1.25)])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("B,pieces", [(3, 2), (5, 5), (4, 9), (1, 2)])
def test_pipelined_branch_equals_the_serial_branch(precision, oversample, per_head, masked, B, pieces):
    Hkv, G, D, T, k = 2, 3, 32, 301, 17
    seg = _segment(B, Hkv, T, D, torch.bfloat16, seed=B + pieces)
    q = torch.randn(B, Hkv * G, D, generator=torch.Generator().manual_seed(7))
    mask = (torch.rand(B, Hkv, T, generator=torch.Generator().manual_seed(5)) > 0.3) if masked else None
    kw = dict(mask=mask, keep_keys=True, precision=precision, oversample=oversample)
    serial = host_branch(q, seg.k, seg.v, 0.2, k, per_head, pool=POOL, **kw)
    v_out = torch.full((B * (Hkv * G if per_head else Hkv) * k * D + 5,), float("nan"), dtype=seg.v.dtype)
    piped = pipelined_host_branch(q, seg.k, seg.v, 0.2, k, per_head, pieces, v_out=v_out, pool=POOL, **kw)
    assert torch.equal(piped.idx, serial.idx)
    assert torch.equal(piped.logits, serial.logits)
    assert torch.equal(piped.v_rows, serial.v_rows) and piped.v_rows.data_ptr() == v_out.data_ptr()
    assert torch.equal(piped.k_rows, serial.k_rows)
    assert (piped.mask is None) == (serial.mask is None) and (piped.mask is None or torch.equal(piped.mask, serial.mask))
    assert piped.exact == serial.exact


def test_a_broadcast_mask_and_no_output_buffer():
    B, Hkv, G, D, T, k = 4, 2, 2, 16, 90, 9
    seg = _segment(B, Hkv, T, D, torch.bfloat16, seed=1)
    q = torch.randn(B, Hkv * G, D)
    mask = torch.rand(1, Hkv, T) > 0.2  # one mask for every row
    serial = host_branch(q, seg.k, seg.v, 0.3, k, False, mask=mask, pool=POOL)
    piped = pipelined_host_branch(q, seg.k, seg.v, 0.3, k, False, 2, mask=mask, pool=POOL)
    assert torch.equal(piped.idx, serial.idx) and torch.equal(piped.v_rows, serial.v_rows)


def test_an_error_in_one_slice_is_raised():
    B, Hkv, G, D, T = 4, 2, 2, 16, 50
    seg = _segment(B, Hkv, T, D, torch.bfloat16)
    q = torch.randn(B, Hkv * G + 1, D)  # not a multiple of Hkv: every slice fails
    with pytest.raises(Exception):
        pipelined_host_branch(q, seg.k, seg.v, 0.3, 5, False, 2, pool=POOL)


def test_run_each_runs_every_task_once_in_order():
    seen = []
    out = POOL.run_each([lambda i=i: seen.append(i) or i * i for i in range(7)])
    assert out == [i * i for i in range(7)] and sorted(seen) == list(range(7))
