"""hybridgen.attention.cuda dispatch: availability probing, the torch fallback, first-use verification.

Without CUDA/CuPy every dispatcher falls back to the torch primitive and equals the dense
reference; the verification of the first CuPy result is exercised with stand-in kernels.
The kernel source itself is tested in tests/test_attention_cuda_kernels.py.
"""
from __future__ import annotations

import math
import subprocess
import sys
import types

import pytest
import torch

from hybridgen.attention import cuda as ck
from hybridgen.attention import partial as tp
from hybridgen.attention.cuda import dispatch, state
from hybridgen.attention.reference import dense_attention_reference
from tests._cuda_cases import decode_inputs as _inputs
from tests._cuda_cases import ref_lse as _ref_lse
from tests._cuda_cases import rel as _rel

CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ availability
@pytest.fixture
def fresh_probe():
    ck.kernels_available.cache_clear()
    yield
    ck.kernels_available.cache_clear()


def test_kernels_unavailable_here(fresh_probe):
    if CUDA:
        pytest.skip("this machine has CUDA")
    assert ck.kernels_available() is False
    q, k, v = _inputs(1, 2, 1, 4, 8)
    assert ck.backend(q, k, v) == "torch"


def test_unavailable_when_cupy_import_fails(fresh_probe, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert ck.kernels_available() is False


def test_unavailable_when_cupy_device_use_raises(fresh_probe, monkeypatch):
    class CUDARuntimeError(RuntimeError):
        pass

    def raise_driver():
        raise CUDARuntimeError("cudaErrorInsufficientDriver")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        is_available=lambda: True, runtime=types.SimpleNamespace(getDeviceCount=raise_driver)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert ck.kernels_available() is False


def test_unavailable_with_installed_cupy_but_no_driver(fresh_probe, monkeypatch):
    if CUDA:
        pytest.skip("this machine has CUDA")
    pytest.importorskip("cupy")  # the optional extra, when installed on a GPU-less machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ck.kernels_available() is False


def test_env_switch_turns_cupy_off(fresh_probe, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CUPY", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ck.kernels_available() is False


def test_module_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; "
            "import hybridgen.attention.cuda as c; print(c.kernels_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ CPU fallback
@pytest.mark.parametrize("B,Hq,Hkv,T,D", [(2, 8, 2, 37, 16), (1, 4, 4, 5, 8), (2, 6, 3, 0, 8)])
def test_fallback_partial_attention_equals_reference(B, Hq, Hkv, T, D):
    q, k, v = _inputs(B, Hq, Hkv, T, D, seed=T)
    scale = 1 / math.sqrt(D)
    before = ck.dispatch_counts["torch"]
    out, lse = ck.partial_attention(q, k, v, scale)
    assert ck.dispatch_counts["torch"] == before + 1
    assert out.shape == (B, Hq, 1, D) and lse.shape == (B, Hq, 1)
    if T == 0:
        assert torch.all(out == 0) and torch.all(torch.isinf(lse))
        return
    ref = dense_attention_reference(q, k, v, scale)
    assert _rel(out, ref) < 1e-5
    assert torch.allclose(lse.double(), _ref_lse(q, k, scale), atol=1e-5)


def test_fallback_partial_attention_with_mask():
    q, k, v = _inputs(2, 4, 2, 20, 8, seed=3)
    mask = torch.rand(2, 1, 20, generator=torch.Generator().manual_seed(1)) > 0.4
    out, lse = ck.partial_attention(q, k, v, 0.3, mask)
    ref = dense_attention_reference(q, k, v, 0.3, mask=mask)
    assert _rel(out, ref) < 1e-5
    assert torch.allclose(lse.double(), _ref_lse(q, k, 0.3, mask), atol=1e-5)


@pytest.mark.parametrize("per_head", [True, False])
def test_fallback_hybrid_decode_equals_dense_softmax_over_selection(per_head):
    B, Hq, Hkv, D, Th, Tg, K = 2, 8, 2, 16, 40, 12, 6
    q, kh, vh = _inputs(B, Hq, Hkv, Th, D, seed=5)
    _, kg, vg = _inputs(B, Hq, Hkv, Tg, D, seed=6)
    scale = 1 / math.sqrt(D)
    logits = tp.attention_logits(q, kh, scale)  # [B, Hq, 1, Th]
    vals, idx = tp.topk_per_group(logits, K, Hkv, per_head=per_head)
    if per_head:  # one row set per query head
        g = Hq // Hkv
        v_rows = torch.gather(vh.repeat_interleave(g, 1), 2, idx[..., None].expand(-1, -1, -1, D))
        k_rows = torch.gather(kh.repeat_interleave(g, 1), 2, idx[..., None].expand(-1, -1, -1, D))
    else:
        v_rows = torch.gather(vh, 2, idx[..., None].expand(-1, -1, -1, D))
        k_rows = torch.gather(kh, 2, idx[..., None].expand(-1, -1, -1, D))
    out = ck.hybrid_decode_attention(q, vals[:, :, 0, :], v_rows, kg, vg, scale)
    # Dense reference: softmax over [selected host keys ; gpu keys] for every query head.
    g = Hq // Hkv
    kr = k_rows if per_head else k_rows.repeat_interleave(g, 1)
    vr = v_rows if per_head else v_rows.repeat_interleave(g, 1)
    kall = torch.cat([kr, kg.repeat_interleave(g, 1)], dim=2).double()
    vall = torch.cat([vr, vg.repeat_interleave(g, 1)], dim=2).double()
    p = torch.softmax((q.double() @ kall.transpose(-1, -2)) * scale, dim=-1)
    assert _rel(out, p @ vall) < 1e-5


def test_fallback_softmax_over_parts_matches_torch_primitive():
    B, Hq, Hkv, D = 1, 4, 2, 8
    g = torch.Generator().manual_seed(2)
    parts = [(torch.randn(B, Hq, 1, 5, generator=g), torch.randn(B, Hq, 5, D, generator=g)),
             (torch.randn(B, Hq, 1, 9, generator=g), torch.randn(B, Hkv, 9, D, generator=g))]
    parts[0][0][0, 0, 0, 1] = float("-inf")
    out = ck.softmax_over_parts(parts, Hkv)
    assert torch.equal(out, tp.softmax_over_parts(parts, Hkv))


# ------------------------------------------------------------------ first-use verification
@pytest.fixture
def pretend_cupy(monkeypatch):
    """Make the dispatcher believe tensors are on CUDA and CuPy works (state reset per test)."""
    monkeypatch.setattr(dispatch, "_on_cuda", lambda *tensors: True)
    monkeypatch.setattr(state, "kernels_available", lambda: True)
    monkeypatch.setattr(state, "verified", set())
    monkeypatch.setattr(state, "rejected", set())
    monkeypatch.delenv("HYBRIDGEN_CUPY", raising=False)


def test_first_cupy_result_is_checked_and_a_wrong_kernel_is_switched_off(pretend_cupy):
    q, k, v = _inputs(2, 4, 2, 33, 16)
    calls = []

    def wrong_kernel(q, k, v, scale, mask):
        calls.append(1)
        out, lse = tp.partial_attention(q, k, v, scale, mask)
        return out + 0.1, lse

    ref = tp.partial_attention(q, k, v, 0.25, None)
    with pytest.warns(RuntimeWarning, match="disagrees with torch"):
        out, lse = dispatch._dispatch(wrong_kernel, tp.partial_attention, k.dtype, (q, k, v), q, k, v, 0.25, None)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])  # the torch result, not the kernel's
    out2, _ = dispatch._dispatch(wrong_kernel, tp.partial_attention, k.dtype, (q, k, v), q, k, v, 0.25, None)
    assert len(calls) == 1 and torch.equal(out2, ref[0])  # switched off: not called again


def test_a_matching_kernel_is_checked_once_then_trusted(pretend_cupy):
    q, k, v = _inputs(1, 4, 4, 20, 8)
    torch_calls = []

    def torch_fn(*args):
        torch_calls.append(1)
        return tp.partial_attention(*args)

    def kernel(*args):
        return tp.partial_attention(*args)

    for _ in range(3):
        dispatch._dispatch(kernel, torch_fn, k.dtype, (q, k, v), q, k, v, 0.5, None)
    assert len(torch_calls) == 1 and (kernel.__name__, torch.float32) in state.verified


def test_strict_mode_raises_on_a_wrong_kernel(pretend_cupy, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CUPY", "strict")
    x = torch.randn(3, 5)
    with pytest.raises(RuntimeError, match="disagrees with torch"):
        dispatch._dispatch(lambda t: t + 1, lambda t: t, x.dtype, (x,), x)


def test_split_methods_attend_through_the_dispatcher():
    from hybridgen.model import load_model

    engine = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False)
    before = dict(ck.dispatch_counts)
    for method in ("hybrid-exact", "hybridgen", "flexgen"):
        engine.generate(torch.randint(3, 1000, (1, 40)), method, max_new_tokens=3)
    assert ck.dispatch_counts["torch"] > before["torch"]  # no CUDA here: every call fell back
