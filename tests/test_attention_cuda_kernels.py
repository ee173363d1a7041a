"""hybridgen.attention.cuda kernels: the source (package data), launch planning, emulated and real runs.

Checks, from cheapest to the GPU:
- launch planning (configs, token splits, argument order against the kernels' C signatures);
- the kernel source runs on the CPU in a small C++ emulator of the CUDA thread model
  (tests/_cuda_emulator.py) driven by the same launch plans the CuPy executor uses, so
  indexing, splitting and the one-softmax merge are checked here (skipped without g++);
- the source compiles to PTX with NVRTC alone (skipped without an NVRTC library);
- on a CUDA machine the real CuPy kernels are compared with the dense reference.
"""
from __future__ import annotations

import math
import re
from importlib import resources

import pytest
import torch

from hybridgen.attention import cuda as ck
from hybridgen.attention import partial as tp
from hybridgen.attention.cuda import compiler, planning, source
from hybridgen.attention.reference import dense_attention_reference
from tests._cuda_cases import decode_inputs as _inputs
from tests._cuda_cases import logits64 as _logits64
from tests._cuda_cases import ref_lse as _ref_lse
from tests._cuda_cases import rel as _rel
from tests._cuda_emulator import EmulatorUnavailable, KernelEmulator, run_plan_emulated

CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ source and launch planning
def test_kernel_source_is_package_data():
    cu = resources.files("hybridgen.attention.cuda").joinpath(source.SOURCE_FILE)
    assert cu.is_file()
    assert source.KERNEL_SOURCE == cu.read_text(encoding="utf-8")
    for name in source.KERNEL_NAMES:
        entry = rf'extern "C" __global__ void (__launch_bounds__\(.*?\) )?{name}\('
        assert re.search(entry, source.KERNEL_SOURCE), name


def test_kernel_config_rejects_unsupported_shapes():
    assert planning.kernel_config(torch.bfloat16, 128)["lpr"] == 16
    assert planning.kernel_config(torch.float32, 256)["vpl"] == 2
    assert planning.kernel_config(torch.bfloat16, 80) is None  # 10 vectors: not a power of two
    assert planning.kernel_config(torch.float64, 128) is None
    assert planning.shared_bytes(torch.bfloat16, 128, 4) <= planning.MAX_SHARED_BYTES


def test_num_splits_cover_every_token():
    for blocks, tokens, sms in [(64, 32768, 132), (1, 300, 2), (256, 100, 132), (8, 1000, 8)]:
        splits, per = planning.num_splits(blocks, tokens, sms)
        assert splits >= 1 and splits * per >= tokens and (splits - 1) * per < tokens


def _kernel_params(signature: str) -> list:
    """[(name, kind)] of a C parameter list (kind: ptr, i64, i32, f32)."""
    out = []
    for p in signature.replace("\\", " ").split(","):
        p = " ".join(p.split())
        name = p.split(" ")[-1].lstrip("*")
        kind = "ptr" if "*" in p else "i64" if "long long" in p else "i32" if p.startswith("int ") else \
            "f32" if p.startswith("float ") else "?"
        out.append((name, kind))
    return out


def test_plan_arguments_match_kernel_signatures():
    """The CuPy executor passes a plan's arguments positionally: order and C types must match."""
    src = source.KERNEL_SOURCE
    partial_sig = re.search(r"#define HG_PARTIAL_ARGS(.*?)\n#define", src, re.S).group(1)
    combine_sig = re.search(r"void hg_combine\((.*?)\)\s*\{", src, re.S).group(1)
    partial, combine = _kernel_params(partial_sig), _kernel_params(combine_sig)
    assert [n for n, _ in partial] == list(source.PARTIAL_ARG_NAMES)
    assert [n for n, _ in combine] == list(source.COMBINE_ARG_NAMES)
    q, kg, vg = _inputs(2, 8, 2, 40, 16)
    hl = torch.randn(2, 8, 5)
    hv = torch.randn(2, 8, 5, 16)
    plan, out = planning.plan_hybrid_decode_attention(q, hl, hv, kg, vg, 0.25,
                                                      torch.ones(2, 1, 40, dtype=torch.bool), 4)
    launches = plan.launches(torch.empty(plan.workspace_numel()), out, None)
    assert [l[0] for l in launches] == ["hg_partial_given_perhead", "hg_partial_qk", "hg_combine"]
    for kernel, grid, block, smem, args in launches:
        expect = combine if kernel == "hg_combine" else partial
        assert [kind for kind, _ in args] == [kind for _, kind in expect], kernel
        assert block[0] <= source.THREADS and all(g >= 1 for g in grid)


# ------------------------------------------------------------------ the kernel source, emulated on the CPU
@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """build(dtype, head_dim, group) -> ctypes library of the kernel source compiled as C++."""
    try:
        emu = KernelEmulator(tmp_path_factory.mktemp("cuda_emu"))
    except EmulatorUnavailable as err:
        pytest.skip(str(err))

    def build(dtype, head_dim, group):
        try:
            return emu.library(dtype, head_dim, group)
        except EmulatorUnavailable as err:
            pytest.skip(str(err))

    return build


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype,B,Hq,Hkv,T,D,sms,masked,strided", [
    (torch.bfloat16, 2, 6, 2, 300, 64, 2, False, False),   # two splits, G = 3, bf16
    (torch.float32, 2, 4, 4, 37, 32, 1, True, False),      # G = 1, mask, one split
    (torch.float32, 1, 8, 2, 600, 128, 8, True, True),     # G = 4, strided KV (segment views), 3 splits
    (torch.float32, 1, 2, 1, 40, 256, 1, False, False),    # two vectors per lane
])
def test_emulated_partial_kernel_equals_reference(emulator, dtype, B, Hq, Hkv, T, D, sms, masked, strided):
    q, k, v = _inputs(B, Hq, Hkv, T, D, dtype=dtype, seed=T)
    if strided:  # a KVSegment view: capacity larger than the length
        kb, vb = torch.zeros(B, Hkv, T + 24, D, dtype=dtype), torch.zeros(B, Hkv, T + 24, D, dtype=dtype)
        kb[:, :, :T], vb[:, :, :T] = k, v
        k, v = kb[:, :, :T], vb[:, :, :T]
    mask = None
    if masked:
        mask = torch.rand(B, Hkv, T, generator=torch.Generator().manual_seed(9)) > 0.3
        mask[0, 0] = False  # one KV head sees nothing: out 0, lse -inf
    scale = 1 / math.sqrt(D)
    plan, out, lse = planning.plan_partial_attention(q, k, v, scale, mask, sms)
    run_plan_emulated(emulator(dtype, D, Hq // Hkv), plan, out, lse)
    exp_lse = _ref_lse(q, k, scale, mask)
    exp_out = torch.nan_to_num(dense_attention_reference(q, k, v, scale, mask=mask))  # no key -> 0
    assert _rel(out, exp_out) < TOL[dtype]
    finite = torch.isfinite(exp_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), exp_lse[finite], atol=5 * TOL[dtype])
    if masked:
        g = Hq // Hkv
        assert torch.all(out[0, :g] == 0)


@pytest.mark.parametrize("per_head", [True, False])
def test_emulated_hybrid_kernel_equals_one_softmax(emulator, per_head):
    B, Hq, Hkv, D, K, Tg = 2, 8, 2, 64, 50, 290
    dtype = torch.bfloat16
    q, kg, vg = _inputs(B, Hq, Hkv, Tg, D, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    Hv = Hq if per_head else Hkv
    host_logits = torch.randn(B, Hq, K, generator=g) * 2
    host_logits[:, :, -3:] = float("-inf")  # padding slots
    host_values = torch.randn(B, Hv, K, D, generator=g).to(dtype)
    scale = 1 / math.sqrt(D)
    plan, out = planning.plan_hybrid_decode_attention(q, host_logits, host_values, kg, vg, scale, None, 2)
    assert len(plan.parts) == 2
    run_plan_emulated(emulator(dtype, D, Hq // Hkv), plan, out)
    gl = _logits64(q, kg, scale)
    ref = tp.softmax_over_parts([(host_logits[:, :, None].double(), host_values.double()), (gl, vg.double())], Hkv)
    assert _rel(out, ref) < 1e-2


def test_emulated_softmax_over_parts_fp32(emulator):
    B, Hq, Hkv, D = 1, 4, 2, 32
    g = torch.Generator().manual_seed(4)
    parts = [(torch.randn(B, Hq, 1, 30, generator=g), torch.randn(B, Hq, 30, D, generator=g)),
             (torch.randn(B, Hq, 1, 270, generator=g), torch.randn(B, Hkv, 270, D, generator=g))]
    plan, out = planning.plan_softmax_over_parts(parts, Hkv, 4)
    run_plan_emulated(emulator(torch.float32, D, Hq // Hkv), plan, out)
    assert _rel(out, tp.softmax_over_parts([(lg.double(), v.double()) for lg, v in parts], Hkv)) < 1e-5


# ------------------------------------------------------------------ source compiles (NVRTC), GPU runs
@pytest.mark.skipif(compiler.find_nvrtc() is None, reason="no NVRTC library (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_source_compiles_with_nvrtc(dtype):
    ptx, _ = compiler.nvrtc_compile(dtype, 128, 4)
    for name in source.KERNEL_NAMES:
        assert f".entry {name}" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_source_compiles_with_cupy():
    pytest.importorskip("cupy")
    funcs = compiler.cupy_kernels(torch.bfloat16, 128, 4, torch.cuda.current_device())
    assert set(funcs) == set(source.KERNEL_NAMES)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,masked", [(1, False), (4099, True), (40000, False)])
def test_gpu_partial_kernel_equals_reference(dtype, T, masked):
    pytest.importorskip("cupy")
    assert ck.kernels_available()
    B, Hq, Hkv, D = 2, 32, 8, 128
    q, k, v = _inputs(B, Hq, Hkv, T, D, dtype=dtype, device="cuda", seed=T)
    mask = (torch.rand(B, 1, T, device="cuda") > 0.2) if masked else None
    out, lse = ck.cupy_partial_attention(q, k, v, 1 / math.sqrt(D), mask)
    torch.cuda.synchronize()
    ref = dense_attention_reference(q.cpu(), k.cpu(), v.cpu(), 1 / math.sqrt(D),
                                    mask=None if mask is None else mask.cpu())
    assert _rel(out, ref) < (1e-4 if dtype == torch.float32 else 1e-2)
    exp_lse = _ref_lse(q.cpu(), k.cpu(), 1 / math.sqrt(D), None if mask is None else mask.cpu())
    assert torch.allclose(lse.cpu().double(), exp_lse, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("per_head", [True, False])
def test_gpu_hybrid_kernel_and_dispatch(per_head):
    pytest.importorskip("cupy")
    B, Hq, Hkv, D, K, Tg = 8, 32, 8, 128, 1500, 3300
    q, kg, vg = _inputs(B, Hq, Hkv, Tg, D, dtype=torch.bfloat16, device="cuda", seed=3)
    Hv = Hq if per_head else Hkv
    host_logits = torch.randn(B, Hq, K, device="cuda")
    host_values = torch.randn(B, Hv, K, D, device="cuda").to(torch.bfloat16)
    before = ck.dispatch_counts["cupy"]
    out = ck.hybrid_decode_attention(q, host_logits, host_values, kg, vg, 1 / math.sqrt(D))
    assert ck.dispatch_counts["cupy"] == before + 1
    gl = _logits64(q, kg, 1 / math.sqrt(D))
    ref = tp.softmax_over_parts([(host_logits[:, :, None].double(), host_values.double()), (gl, vg.double())], Hkv)
    assert _rel(out, ref) < 1e-2
