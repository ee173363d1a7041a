"""Baseline helpers: int4 quantization bound, attention helpers, accounting."""
import pytest
import torch

from baselines import quant
from hybridgen.methods.tensors import attend_with_new, causal_attention_colsum, gather_tokens
from hybridgen.methods.tiered import TierBuffer, held_bytes_by_tier
from hybridgen.attention import dense_attention_reference
from hybridgen.errors import ConfigError
from hybridgen.kv import KVSegment, TieredStore


@pytest.mark.parametrize("D,group", [(64, 64), (128, 64), (64, 32), (80, 64), (6, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_round_trip_within_bound(D, group, dtype):
    g = torch.Generator().manual_seed(D + group)
    x = (torch.randn(3, 2, 17, D, generator=g) * torch.rand(3, 2, 17, 1, generator=g) * 4 + 1).to(dtype)
    x[0, 0, 0] = 0.5  # a constant vector: decodes exactly
    codes, meta = quant.quantize(x, group)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == quant.padded_dim(D, group) // 2
    assert meta.shape[-1] == 2 * quant.padded_dim(D, group) // group
    y = quant.dequantize(codes, meta, D, group)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - x.float()).abs()
    bound = quant.error_bound(x, group)
    eps = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert bool((err <= bound * (1 + eps) + eps * x.float().abs().amax(-1, keepdim=True)).all())
    assert float(err[0, 0, 0].max()) == 0.0
    # 4 bits really are used: the error is not trivially zero, and not larger than 16 levels allow
    assert float(err.max()) > 0
    # out= path writes the same values into a preallocated buffer
    out = torch.empty_like(x)
    quant.dequantize(codes, meta, D, group, out=out)
    assert torch.equal(out, y)


@pytest.mark.parametrize("D,group", [(128, 64), (80, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dequantize_over_capacity_views_is_the_formula(D, group, dtype):
    """Codes and meta as a KV segment holds them (the [:, :, :n] view of a longer buffer) decode to
    code * scale + min in the KV's dtype: the product rounded to it, then the sum (float64 here)."""
    g = torch.Generator().manual_seed(D)
    codes_cap, meta_cap = quant.quantize(torch.randn(2, 3, 40, D, generator=g).to(dtype), group)
    codes, meta = codes_cap[:, :, :29], meta_cap[:, :, :29]
    assert not codes.is_contiguous() and not meta.is_contiguous()
    y = quant.dequantize(codes, meta, D, group)
    dp = quant.padded_dim(D, group)
    c = torch.stack([codes & 0x0F, codes >> 4], -1).reshape(2, 3, 29, dp // group, group).double()
    m = meta.double().reshape(2, 3, 29, dp // group, 2)
    want = ((c * m[..., 1:2]).to(dtype).double() + m[..., 0:1]).to(dtype)
    assert torch.equal(y, want.reshape(2, 3, 29, dp)[..., :D])
    assert torch.equal(y, quant.dequantize(codes.contiguous(), meta.contiguous(), D, group))


def test_dequantize_moves_the_bytes_its_cost_prices():
    """baselines.quant.DEQUANT_PASSES / DEQUANT_PASS_BYTES (FlexGen's cost) are the torch passes
    dequantize runs: counted here by a dispatch mode (fp32 meta: no meta widening)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.slice, torch.ops.aten.unsqueeze,
             torch.ops.aten.expand, torch.ops.aten.alias, torch.ops.aten.reshape}

    def nbytes(t) -> int:
        if isinstance(t, (list, tuple)):
            return sum(nbytes(x) for x in t)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    class Count(TorchDispatchMode):
        """Passes over the data (non-view ops) and the bytes they read + write; copy_ reads only
        its source, an in-place op reads and writes its self."""

        def __init__(self):
            super().__init__()
            self.moved, self.passes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket not in views:
                self.passes += 1
                read = nbytes(args[1:]) if func.overloadpacket is torch.ops.aten.copy_ else nbytes(args)
                self.moved += read + nbytes(out)
            return out

    codes, meta = quant.quantize(torch.randn(1, 2, 256, 128), 64)
    out = torch.empty(1, 2, 300, 128)[:, :, :256]  # FlexGen's buffers: a capacity view, rows contiguous
    with Count() as n:
        quant.dequantize(codes, meta, 128, 64, out=out)
    assert n.passes == quant.DEQUANT_PASSES  # straight into out: no temporary copied over
    assert n.moved == pytest.approx(quant.dequant_bytes(out.numel(), 4), rel=0.02)
    assert torch.equal(out, quant.dequantize(codes, meta, 128, 64))
    assert quant.dequant_bytes(1, 2) == 15  # bf16: 5 + 5 x 2 bytes per element


def test_int4_bytes_and_bad_group():
    x = torch.randn(1, 1, 4, 64)
    codes, meta = quant.quantize(x, 64)
    assert codes.numel() * codes.element_size() == 4 * 32
    with pytest.raises(ConfigError):
        quant.quantize(x, 63)


@pytest.mark.parametrize("G", [1, 3])
def test_attend_with_new_matches_reference(G):
    g = torch.Generator().manual_seed(G)
    B, Hkv, n, D = 2, 2, 9, 8
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    kn, vn = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
    mask = torch.rand(B, Hkv, n, generator=g) > 0.3
    out, probs = attend_with_new(q, k, v, mask, kn, vn, D ** -0.5, return_probs=True)
    full_mask = torch.cat([mask, torch.ones(B, Hkv, 1, dtype=torch.bool)], -1)
    ref = dense_attention_reference(q, torch.cat([k, kn], 2), torch.cat([v, vn], 2), D ** -0.5, full_mask)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(B, Hkv * G), atol=1e-5)
    assert bool((probs[..., :n].view(B, Hkv, G, n)[~mask[:, :, None, :].expand(B, Hkv, G, n)] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,T,D,n,spare", [(1, 1, 5, 4, 3, 0), (2, 3, 17, 8, 5, 3), (3, 2, 9, 16, 9, 0)])
def test_gather_tokens_takes_rows_by_index(dtype, B, H, T, D, n, spare):
    """gather_tokens' row copy (a capacity view included) picks what a per-element loop picks;
    a layout whose rows are not contiguous takes torch.gather; a bad index raises."""
    g = torch.Generator().manual_seed(B * 100 + T)
    x = torch.randn(B, H, T + spare, D, generator=g).to(dtype)[:, :, :T]
    idx = torch.randint(0, T, (B, H, n), generator=g)
    want = torch.stack([torch.stack([x[b, h, idx[b, h]] for h in range(H)]) for b in range(B)])
    assert torch.equal(gather_tokens(x, idx), want)
    y = x.transpose(2, 3).contiguous().transpose(2, 3)  # rows strided by 1 element, not contiguous
    assert torch.equal(gather_tokens(y, idx), want)
    with pytest.raises((IndexError, RuntimeError)):
        gather_tokens(x, idx.clone().fill_(T))
    # into a staging buffer (InfiniGen's slots): the same rows, in that very buffer
    out = torch.full((B * H * n * D + 7,), float("nan"), dtype=dtype)[: B * H * n * D].view(B, H, n, D)
    assert gather_tokens(x, idx, out=out) is out and torch.equal(out, want)
    strided = torch.full((B, H, n, D + 3), float("nan"), dtype=dtype)[..., :D]  # not contiguous: torch.gather
    assert gather_tokens(x, idx, out=strided) is strided and torch.equal(strided, want)
    with pytest.raises(ValueError, match="out must be"):
        gather_tokens(x, idx, out=torch.empty(B, H, D, n, dtype=dtype))  # the right size, the wrong shape


def test_causal_colsum_matches_naive():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, D = 2, 4, 2, 11, 8
    q, k = torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :4] = False
    got = causal_attention_colsum(q, k, D ** -0.5, valid, chunk=3)
    ref = torch.zeros(B, Hq, T)
    for b in range(B):
        for h in range(Hq):
            for i in range(T):
                if not valid[b, i]:
                    continue
                keys = [j for j in range(i + 1) if valid[b, j]]
                s = torch.stack([q[b, h, i] @ k[b, h // (Hq // Hkv), j] for j in keys]) * D ** -0.5
                ref[b, h, keys] += torch.softmax(s, 0)
    assert torch.allclose(got, ref, atol=1e-5)


def test_tier_buffers_are_accounted_and_freed():
    store = TieredStore()
    buf = TierBuffer(store["gpu"], (3, 5), torch.float32, "x/buf")
    seg = KVSegment(store["dram"], 1, 2, 4, torch.float16, "x/seg", capacity=7, with_mask=True)
    held = held_bytes_by_tier([buf, seg])
    assert held == {"gpu": 60, "dram": 2 * (2 * 7 * 4 * 2) + 2 * 7}
    assert {k: v for k, v in store.bytes_by_tier().items() if v} == held
    buf.release()
    seg.release()
    assert sum(store.bytes_by_tier().values()) == 0
