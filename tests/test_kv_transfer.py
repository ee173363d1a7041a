"""Host -> device transfers (hybridgen.kv.transfer): copies into preallocated destinations
(FlexGen, InfiniGen) and shipping of CPU results (HybridGen), on the CPU fallback and on CUDA."""
import pytest
import torch

from hybridgen.kv.transfer import HostToDevice, cuda_streams_available


def test_start_copies_into_preallocated_buffers_cpu_fallback():
    pf = HostToDevice(torch.device("cpu"))
    assert not pf.async_mode
    src = torch.randn(2, 3, 10, 4)[:, :, :7]  # strided, like a partly filled segment
    dst = torch.zeros(2, 3, 10, 4)
    n = pf.start("l1", [(dst[:, :, :7], src)])
    assert n == src.numel() * 4 and pf.pending("l1")
    pf.wait("l1")
    assert not pf.pending("l1")
    assert torch.equal(dst[:, :, :7], src) and bool((dst[:, :, 7:] == 0).all())
    pf.reuse("any")  # no-op without CUDA
    pf.drain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_start_cuda_stream_path():
    pf = HostToDevice(torch.device("cuda"))
    assert pf.async_mode and cuda_streams_available(torch.device("cuda"))
    src = torch.randn(2, 3, 10, 4).pin_memory()
    dst = torch.zeros(2, 3, 10, 4, device="cuda")
    pf.start(0, [(dst[:, :, :7], src[:, :, :7])], buffer="s")
    pf.wait(0)
    pf.reuse("s")
    assert torch.equal(dst[:, :, :7].cpu(), src[:, :, :7])


def test_send_cpu_fallback():
    st = HostToDevice(torch.device("cpu"))
    assert not st.async_mode and st.staging((0, "v"), 10, torch.float32) is None
    t = torch.randn(3, 4)
    out, ev = st.send((0, "v"), t)
    assert ev is None and out.data_ptr() == t.data_ptr()
    out, ev = st.send((0, "s"), t, copy=True)
    assert out.data_ptr() != t.data_ptr() and torch.equal(out, t)
    st.wait_event(None)
