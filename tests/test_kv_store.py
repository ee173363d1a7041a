"""Tiers, capacities, byte accounting and size/budget parsing of the tiered KV store."""
import math

import pytest
import torch

from hybridgen.errors import CapacityError, ConfigError, HybridGenError
from hybridgen.kv import KVSegment, Tier, TieredStore, parse_bytes
from hybridgen.kv import tiers as tiers_mod
from hybridgen.methods import Budget


def _held_bytes(segments):
    """Bytes of the tensors the segments actually hold (their buffers, capacity included)."""
    total = 0
    for s in segments:
        for t in (s._k, s._v, s._mask):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def _check_accounting(store, segments):
    by_tier = store.bytes_by_tier()
    assert sum(by_tier.values()) == _held_bytes(segments) == sum(s.nbytes for s in segments)
    for name in ("gpu", "dram", "cxl"):
        held = 0
        for s in segments:
            if s.key_tier is store[name]:
                held += sum(t.numel() * t.element_size() for t in (s._k, s._mask) if t is not None)
            if s.value_tier is store[name] and s._v is not None:
                held += s._v.numel() * s._v.element_size()
        assert by_tier[name] == held, name


def _kv(B, H, n, D, dtype=torch.float32):
    return torch.randn(B, H, n, D).to(dtype), torch.randn(B, H, n, D).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_follow_appends_growth_keep_pop_release(dtype):
    torch.manual_seed(0)
    store = TieredStore(gpu_device="cpu")  # CPU indices below; on a CUDA machine too (results/gpu/pytest_final.txt)
    B, H, D = 2, 3, 8
    a = KVSegment(store["gpu"], B, H, D, dtype, "layer0/gpu", capacity=5, with_mask=True)
    b = KVSegment(store["dram"], B, H, D, dtype, "layer0/host", value_tier=store["cxl"])
    segs = [a, b]
    _check_accounting(store, segs)
    for n in (3, 1, 9, 40):  # crosses several growths
        k, v = _kv(B, H, n, D, dtype)
        a.append(k, v, torch.rand(B, n) < 0.8)
        b.append(k, v)
        _check_accounting(store, segs)
    assert a.length == b.length == 53 and a.capacity >= 53
    assert store.bytes_by_layer()["dram"] == {"layer0": b._k.numel() * b._k.element_size()}
    assert store.bytes_by_layer()["cxl"] == {"layer0": b._v.numel() * b._v.element_size()}
    before = store.bytes_by_tier()["gpu"]
    keep = torch.randint(0, 53, (B, H, 7))
    expect_k = torch.gather(a.k, 2, keep[..., None].expand(-1, -1, -1, D))
    expect_m = torch.gather(a.mask, 2, keep)
    a.keep(keep)
    _check_accounting(store, segs)
    assert store.bytes_by_tier()["gpu"] < before  # eviction frees memory
    assert a.length == 7 and torch.equal(a.k, expect_k) and torch.equal(a.mask, expect_m)
    before_b = b.nbytes
    keep_b = torch.randint(0, 53, (B, H, 4))
    expect_v = torch.gather(b.v, 2, keep_b[..., None].expand(-1, -1, -1, D))
    b.keep(keep_b)  # keys on dram, values on cxl
    assert torch.equal(b.v, expect_v) and b.nbytes < before_b
    _check_accounting(store, segs)
    head_k = a.k[:, :, :2].clone()
    k, v, m = a.pop_front(2)
    assert torch.equal(k, head_k) and a.length == 5 and m.shape == (B, H, 2)
    _check_accounting(store, segs)
    a.release()
    b.release()
    assert store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}
    assert store["gpu"].peak > 0


def test_pop_front_and_write_content():
    s = KVSegment(Tier("dram"), 1, 1, 2, torch.float32, "l/x")
    vals = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 1, 10, 2).contiguous()
    s.append(vals, vals)
    s.pop_front(3)
    assert s.k[0, 0, :, 0].tolist() == [3.0, 4, 5, 6, 7, 8, 9]
    s.write(1, torch.full((1, 1, 2, 2), -1.0), torch.full((1, 1, 2, 2), -2.0))
    assert s.k[0, 0, :, 0].tolist() == [3.0, -1, -1, 6, 7, 8, 9]
    assert s.v[0, 0, 1:3, 0].tolist() == [-2.0, -2.0]
    assert s.pop_front(100)[0].shape[2] == 7 and s.length == 0


def test_amortised_growth_reallocates_logarithmically():
    tier = Tier("dram")
    seg = KVSegment(tier, 1, 2, 4, torch.float32, "layer0/host")
    start = tier.num_allocations
    N = 3000
    tok = torch.randn(1, 2, 1, 4)
    ptrs = set()
    for _ in range(N):
        seg.append(tok, tok)
        ptrs.add(seg._k.data_ptr())
    growths = (tier.num_allocations - start) // 2  # k and v per growth
    bound = math.ceil(math.log(N / 16, 1.5)) + 2
    assert seg.length == N
    assert growths <= bound, (growths, bound)
    assert len(ptrs) <= bound  # the buffer moved only at growths: no per-step full copy
    assert tier.used == seg.nbytes and seg.capacity < 2 * N


def test_capacity_exceeded_is_one_line():
    store = TieredStore(gpu="1KiB")
    seg = KVSegment(store["gpu"], 1, 1, 8, torch.float32, "layer0/gpu", capacity=4)
    seg.append(*_kv(1, 1, 4, 8))
    with pytest.raises(CapacityError) as err:
        seg.append(*_kv(1, 1, 40, 8))
    msg = str(err.value)
    assert "\n" not in msg and "gpu" in msg and "capacity" in msg
    assert isinstance(err.value, HybridGenError)
    assert store.bytes_by_tier()["gpu"] == seg.nbytes  # the failed growth left no trace
    with pytest.raises(CapacityError):
        KVSegment(TieredStore(dram=100)["dram"], 1, 1, 8, torch.float32, "l/h", capacity=10)


def test_failed_value_allocation_leaves_key_tier_clean():
    store = TieredStore(cxl="1KiB")
    seg = KVSegment(store["dram"], 1, 1, 8, torch.float32, "layer0/host", capacity=4, value_tier=store["cxl"])
    seg.append(*_kv(1, 1, 4, 8))
    before = store.bytes_by_tier()
    with pytest.raises(CapacityError):
        seg.append(*_kv(1, 1, 100, 8))  # K fits on dram, V does not fit on cxl
    assert store.bytes_by_tier() == before == {"gpu": 0, "dram": seg._k.nbytes, "cxl": seg._v.nbytes}
    assert seg.length == 4


@pytest.mark.parametrize("text,expect", [
    ("24GiB", 24 * 2**30), ("1.5 GB", 1_500_000_000), ("512MB", 512_000_000), ("1e9", 10**9),
    ("2KiB", 2048), ("100", 100), (4096, 4096), (2.5e3, 2500), ("8 gb", 8 * 10**9), ("1E3", 1000),
    (None, None), ("unlimited", None), ("", None), ("inf", None), (float("inf"), None), (0, 0),
])
def test_parse_bytes_good(text, expect):
    assert parse_bytes(text) == expect


@pytest.mark.parametrize("bad", ["-1GB", "abc", "12 parsecs", "1..5GB", -5, float("nan"), True, "GB", "5e"])
def test_parse_bytes_bad(bad):
    with pytest.raises(ConfigError) as err:
        parse_bytes(bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text,ratio,tokens", [
    ("20%", 0.2, None), (0.2, 0.2, None), ("0.5", 0.5, None), (512, None, 512), ("512", None, 512),
    ("512t", None, 512), ("64 tokens", None, 64), ("100%", 1.0, None), (0.0, 0.0, None), (0, None, 0),
    ({"ratio": 0.3}, 0.3, None), ({"tokens": 7}, None, 7), (1.0, 1.0, None),
])
def test_budget_parse_good(text, ratio, tokens):
    b = Budget.parse(text)
    assert (b.ratio, b.tokens) == (ratio, tokens)
    assert Budget.parse(b) is b


@pytest.mark.parametrize("bad", [-1, -0.2, "-20%", 1.5, "150%", "1.2", "abc", "", True, float("nan"),
                                 {"ratio": 0.2, "tokens": 3}, {"foo": 1}, {}, "20 %%", "0.2.1"])
def test_budget_parse_bad(bad):
    with pytest.raises(ConfigError) as err:
        Budget.parse(bad)
    assert "\n" not in str(err.value)


def test_budget_resolve():
    assert Budget.parse("50%").resolve(101) == 51
    assert Budget.parse(0.0).resolve(100) == 0
    assert Budget.parse(1.0).resolve(37) == 37
    assert Budget.parse(512).resolve(100) == 100
    assert Budget.parse(64).resolve(100) == 64


def test_tier_flags_without_cuda_and_numa():
    if tiers_mod.cuda_available():
        pytest.skip("CUDA present: this checks the CPU fallback")
    store = TieredStore()
    d = store.describe()
    assert d["gpu"]["emulated"] and d["gpu"]["device"] == "cpu"
    assert d["dram"]["pinned"] is False and d["cxl"]["pinned"] is False  # pinned only with CUDA
    t = Tier("dram", pin=True)
    x = t.allocate((4, 4), torch.float32, "l/k")
    assert not t.pinned and not x.is_pinned() and torch.equal(x, torch.zeros(4, 4))
    assert not d["dram"]["emulated"]


def test_cxl_tier_emulated_without_second_node(monkeypatch):
    from hybridgen.kv import numa
    if numa.binding_supported():
        pytest.skip("this machine has several NUMA nodes")
    store = TieredStore()
    assert store["cxl"].emulated and store.describe()["cxl"]["emulated"] is True
    assert not store["cxl"].numa_bound
    forced = TieredStore(cxl_node=0)  # even an explicit node cannot be bound here
    assert forced["cxl"].emulated and forced["cxl"].numa_node == 0 and not forced["cxl"].numa_bound


def test_unknown_tier_is_config_error():
    with pytest.raises(ConfigError):
        TieredStore()["hbm"]
    with pytest.raises(ConfigError):
        Tier("ssd")


def test_the_gpu_tier_follows_the_engine_device_on_a_cuda_machine(monkeypatch):
    """On a machine with CUDA, a CPU engine's default store keeps its gpu tier on the CPU
    (emulated) instead of refusing the run; without gpu_device the tier is CUDA's."""
    monkeypatch.setattr(tiers_mod, "cuda_available", lambda: True)
    assert TieredStore()["gpu"].device.type == "cuda" and not TieredStore()["gpu"].emulated
    assert TieredStore()["dram"].pinned and TieredStore()["cxl"].pinned  # copied to the GPU: pinned
    store = TieredStore(gpu_device="cpu")
    assert store["gpu"].device.type == "cpu" and store["gpu"].emulated
    assert not store["dram"].pinned and not store["cxl"].pinned  # nothing is copied to a GPU
