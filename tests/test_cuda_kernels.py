"""CuPy decode-attention kernels: CPU fallback, availability probing, and the kernel source.

Three layers of checks:
- the dispatch functions fall back to torch without CUDA/CuPy and equal the dense reference;
- the kernel source itself runs on the CPU in a small C++ emulator (every GPU thread an OS
  thread, warp shuffles and __syncthreads as barriers) driven by the same launch plans the
  CuPy executor uses, so indexing, splitting and the one-softmax merge are checked here
  (skipped without g++);
- on a CUDA machine the real CuPy kernels are compared with the dense reference.
"""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
import sys
import types

import pytest
import torch

from hybridgen.attention import cuda_kernels as ck
from hybridgen.attention import partial as tp
from hybridgen.attention.reference import dense_attention_reference

CUDA = torch.cuda.is_available()


def _inputs(B, Hq, Hkv, T, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    return q, k, v


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _logits64(q, k, scale):
    """float64 logits [B, Hq, 1, T] (the torch primitive computes in float32)."""
    g = q.shape[1] // k.shape[1]
    return (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale


def _ref_lse(q, k, scale, mask=None):
    logits = tp._mask_logits(_logits64(q, k, scale), mask, k.shape[1])
    return torch.logsumexp(logits, dim=-1)


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
            "import hybridgen.attention.cuda_kernels as c; print(c.kernels_available())")
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


@pytest.fixture
def pretend_cupy(monkeypatch):
    """Make the dispatcher believe tensors are on CUDA and CuPy works (state reset per test)."""
    monkeypatch.setattr(ck, "_on_cuda", lambda *tensors: True)
    monkeypatch.setattr(ck, "kernels_available", lambda: True)
    monkeypatch.setattr(ck, "_verified", set())
    monkeypatch.setattr(ck, "_rejected", set())
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
        out, lse = ck._dispatch(wrong_kernel, tp.partial_attention, k.dtype, (q, k, v), q, k, v, 0.25, None)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])  # the torch result, not the kernel's
    out2, _ = ck._dispatch(wrong_kernel, tp.partial_attention, k.dtype, (q, k, v), q, k, v, 0.25, None)
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
        ck._dispatch(kernel, torch_fn, k.dtype, (q, k, v), q, k, v, 0.5, None)
    assert len(torch_calls) == 1 and (kernel.__name__, torch.float32) in ck._verified


def test_strict_mode_raises_on_a_wrong_kernel(pretend_cupy, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CUPY", "strict")
    x = torch.randn(3, 5)
    with pytest.raises(RuntimeError, match="disagrees with torch"):
        ck._dispatch(lambda t: t + 1, lambda t: t, x.dtype, (x,), x)


def test_split_methods_attend_through_the_dispatcher():
    from hybridgen.model import load_model

    engine = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False)
    before = dict(ck.dispatch_counts)
    for method in ("hybrid-exact", "hybridgen", "flexgen"):
        engine.generate(torch.randint(3, 1000, (1, 40)), method, max_new_tokens=3)
    assert ck.dispatch_counts["torch"] > before["torch"]  # no CUDA here: every call fell back


def test_kernel_config_rejects_unsupported_shapes():
    assert ck.kernel_config(torch.bfloat16, 128)["lpr"] == 16
    assert ck.kernel_config(torch.float32, 256)["vpl"] == 2
    assert ck.kernel_config(torch.bfloat16, 80) is None  # 10 vectors: not a power of two
    assert ck.kernel_config(torch.float64, 128) is None
    assert ck.shared_bytes(torch.bfloat16, 128, 4) <= ck.MAX_SHARED_BYTES


def test_num_splits_cover_every_token():
    for blocks, tokens, sms in [(64, 32768, 132), (1, 300, 2), (256, 100, 132), (8, 1000, 8)]:
        splits, per = ck.num_splits(blocks, tokens, sms)
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
    import re

    src = ck.KERNEL_SOURCE
    partial_sig = re.search(r"#define HG_PARTIAL_ARGS(.*?)\n#define", src, re.S).group(1)
    combine_sig = re.search(r"void hg_combine\((.*?)\)\s*\{", src, re.S).group(1)
    partial, combine = _kernel_params(partial_sig), _kernel_params(combine_sig)
    assert [n for n, _ in partial] == list(ck.PARTIAL_ARG_NAMES)
    assert [n for n, _ in combine] == list(ck.COMBINE_ARG_NAMES)
    q, kg, vg = _inputs(2, 8, 2, 40, 16)
    hl = torch.randn(2, 8, 5)
    hv = torch.randn(2, 8, 5, 16)
    plan, out = ck.plan_hybrid_decode_attention(q, hl, hv, kg, vg, 0.25, torch.ones(2, 1, 40, dtype=torch.bool), 4)
    launches = plan.launches(torch.empty(plan.workspace_numel()), out, None)
    assert [l[0] for l in launches] == ["hg_partial_given_perhead", "hg_partial_qk", "hg_combine"]
    for kernel, grid, block, smem, args in launches:
        expect = combine if kernel == "hg_combine" else partial
        assert [kind for kind, _ in args] == [kind for _, kind in expect], kernel
        assert block[0] <= ck.THREADS and all(g >= 1 for g in grid)


# ------------------------------------------------------------------ the kernel source, emulated on the CPU
EMU_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 0, y = 0, z = 0; };
struct uint4 { unsigned x, y, z, w; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
struct EmuBlock { std::barrier<>* bar; std::vector<std::barrier<>*> warp_bars; std::vector<float> warp_buf; float* smem; };
static thread_local EmuBlock* emu_block;
static thread_local int emu_warp, emu_lane;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline uint4 __ldg(const uint4* p) { return *p; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
  float* buf = &emu_block->warp_buf[emu_warp * 32];
  buf[emu_lane] = v;
  emu_block->warp_bars[emu_warp]->arrive_and_wait();
  float r = buf[emu_lane ^ off];
  emu_block->warp_bars[emu_warp]->arrive_and_wait();
  return r;
}
"""

EMU_LAUNCH = r"""
template <typename F>
static void emu_run(int gx, int gy, int bx, int smem_bytes, F body) {
  blockDim = {(unsigned)bx, 1, 1};
  gridDim = {(unsigned)gx, (unsigned)gy, 1};
  for (int y = 0; y < gy; ++y)
    for (int x = 0; x < gx; ++x) {
      std::barrier<> bar(bx);
      const int warps = (bx + 31) / 32;
      std::vector<std::barrier<>*> wb;
      for (int w = 0; w < warps; ++w) wb.push_back(new std::barrier<>(32));
      std::vector<float> smem(smem_bytes / 4 + 1, __int_as_float(0x7fc00000));  // poisoned
      EmuBlock blk{&bar, wb, std::vector<float>(warps * 32), smem.data()};
      std::vector<std::thread> threads;
      for (int t = 0; t < bx; ++t)
        threads.emplace_back([&, t] {
          threadIdx = {(unsigned)t, 0, 0};
          blockIdx = {(unsigned)x, (unsigned)y, 0};
          emu_block = &blk;
          emu_warp = t / 32;
          emu_lane = t % 32;
          body();
        });
      for (auto& th : threads) th.join();
      for (auto* p : wb) delete p;
    }
}
extern "C" void emu_partial(int which, int gx, int gy, int bx, int smem, void** p, long long* s, int H, int T,
                            int per, float scale, float* ws_m, float* ws_l, float* ws_acc, int off, int rows) {
  auto q = (const scalar_t*)p[0]; auto k = (const scalar_t*)p[1]; auto lg = (const float*)p[2];
  auto v = (const scalar_t*)p[3]; auto m = (const unsigned char*)p[4];
  emu_run(gx, gy, bx, smem, [&] {
    if (which == 0) hg_partial_qk(q, s[0], s[1], k, s[2], s[3], s[4], lg, s[5], s[6], v, s[7], s[8], s[9], m, s[10], s[11], H, T, per, scale, ws_m, ws_l, ws_acc, off, rows);
    else if (which == 1) hg_partial_given_grouped(q, s[0], s[1], k, s[2], s[3], s[4], lg, s[5], s[6], v, s[7], s[8], s[9], m, s[10], s[11], H, T, per, scale, ws_m, ws_l, ws_acc, off, rows);
    else hg_partial_given_perhead(q, s[0], s[1], k, s[2], s[3], s[4], lg, s[5], s[6], v, s[7], s[8], s[9], m, s[10], s[11], H, T, per, scale, ws_m, ws_l, ws_acc, off, rows);
  });
}
extern "C" void emu_combine(int gx, int bx, const float* ws_m, const float* ws_l, const float* ws_acc, int S, int R,
                            void* out, float* lse) {
  emu_run(gx, 1, bx, 0, [&] { hg_combine(ws_m, ws_l, ws_acc, S, R, (scalar_t*)out, lse); });
}
"""

_KERNEL_IDS = {"hg_partial_qk": 0, "hg_partial_given_grouped": 1, "hg_partial_given_perhead": 2}
_STRIDE_NAMES = ("q_sb", "q_sh", "k_sb", "k_sh", "k_st", "l_sb", "l_sh", "v_sb", "v_sh", "v_st", "m_sb", "m_sh")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """build(dtype, head_dim, group) -> ctypes library of the kernel source compiled as C++."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not available for the kernel emulator")
    cache = {}
    root = tmp_path_factory.mktemp("cuda_emu")

    def build(dtype, head_dim, group):
        key = (dtype, head_dim, group)
        if key not in cache:
            src = ck.KERNEL_SOURCE.replace("extern __shared__ float hg_smem[];", "float* hg_smem = emu_block->smem;")
            assert src != ck.KERNEL_SOURCE
            path = root / f"emu_{ck._DTYPE_IDS[dtype]}_{head_dim}_{group}"
            (path.with_suffix(".cpp")).write_text(EMU_PRELUDE + src + EMU_LAUNCH)
            defs = [o for o in ck.compile_options(dtype, head_dim, group) if o.startswith("-D")]
            res = subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                                  *defs, str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so"))],
                                 capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                if "barrier" in res.stderr and "No such file" in res.stderr:
                    pytest.skip("g++ without C++20 <barrier>")
                raise AssertionError(res.stderr[-4000:])
            lib = ctypes.CDLL(str(path.with_suffix(".so")))
            P, I, F, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
            lib.emu_partial.argtypes = [I, I, I, I, I, ctypes.POINTER(P), ctypes.POINTER(LL), I, I, I, F, P, P, P, I, I]
            lib.emu_combine.argtypes = [I, I, P, P, P, I, I, P, P]
            cache[key] = lib
        return cache[key]

    return build


def _run_emulated(lib, plan, out, lse=None):
    """Execute a LaunchPlan on the emulator; workspace and outputs start poisoned with NaN."""
    ws = torch.full((plan.workspace_numel(),), float("nan"))
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))

    def val(arg):
        kind, value = arg
        if kind == "ptr":
            return value.data_ptr() if value is not None else None
        return value

    for kernel, grid, block, smem, args in plan.launches(ws, out, lse):
        vals = [val(a) for a in args]
        if kernel == "hg_combine":
            lib.emu_combine(grid[0], block[0], *vals)
            continue
        named = dict(zip(ck.PARTIAL_ARG_NAMES, vals))
        ptrs = (ctypes.c_void_p * 5)(*[named[n] for n in ("q", "k", "logits", "v", "mask")])
        strides = (ctypes.c_longlong * 12)(*[named[n] for n in _STRIDE_NAMES])
        lib.emu_partial(_KERNEL_IDS[kernel], grid[0], grid[1], block[0], smem, ptrs, strides, named["H"], named["T"],
                        named["tokens_per_split"], named["scale"], named["ws_m"], named["ws_l"], named["ws_acc"],
                        named["split_offset"], named["rows_total"])
    assert not torch.isnan(ws).any(), "a workspace slot was never written"


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
    plan, out, lse = ck.plan_partial_attention(q, k, v, scale, mask, sms)
    _run_emulated(emulator(dtype, D, Hq // Hkv), plan, out, lse)
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
    plan, out = ck.plan_hybrid_decode_attention(q, host_logits, host_values, kg, vg, scale, None, 2)
    assert len(plan.parts) == 2
    _run_emulated(emulator(dtype, D, Hq // Hkv), plan, out)
    gl = _logits64(q, kg, scale)
    ref = tp.softmax_over_parts([(host_logits[:, :, None].double(), host_values.double()), (gl, vg.double())], Hkv)
    assert _rel(out, ref) < 1e-2


def test_emulated_softmax_over_parts_fp32(emulator):
    B, Hq, Hkv, D = 1, 4, 2, 32
    g = torch.Generator().manual_seed(4)
    parts = [(torch.randn(B, Hq, 1, 30, generator=g), torch.randn(B, Hq, 30, D, generator=g)),
             (torch.randn(B, Hq, 1, 270, generator=g), torch.randn(B, Hkv, 270, D, generator=g))]
    plan, out = ck.plan_softmax_over_parts(parts, Hkv, 4)
    _run_emulated(emulator(torch.float32, D, Hq // Hkv), plan, out)
    assert _rel(out, tp.softmax_over_parts([(lg.double(), v.double()) for lg, v in parts], Hkv)) < 1e-5


# ------------------------------------------------------------------ source compiles (NVRTC), GPU runs
@pytest.mark.skipif(ck._find_nvrtc() is None, reason="no NVRTC library (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_source_compiles_with_nvrtc(dtype):
    ptx, _ = ck.nvrtc_compile(dtype, 128, 4)
    for name in ck.KERNEL_NAMES:
        assert f".entry {name}" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_source_compiles_with_cupy():
    pytest.importorskip("cupy")
    funcs = ck._kernels(torch.bfloat16, 128, 4, torch.cuda.current_device())
    assert set(funcs) == set(ck.KERNEL_NAMES)


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
