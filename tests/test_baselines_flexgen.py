"""FlexGen: policy validation, placement, streamed bytes, prefetch one layer ahead, CPU attention."""
import pytest
import torch

from baselines.flexgen import FlexGen
from hybridgen.errors import ConfigError
from hybridgen.methods import build_method
from tests._baselines_cases import make_ctx, rel_err, run_method


@pytest.mark.parametrize("gpu_budget", [-0.1, 1.5, "half", True, 1])
def test_gpu_budget_is_validated(gpu_budget):
    with pytest.raises(ConfigError, match="gpu_budget"):
        build_method("flexgen", gpu_budget=gpu_budget)


def test_policy_and_options():
    assert FlexGen(gpu_budget=0.25).gpu_budget.resolve(100) == 25
    assert FlexGen().gpu_budget.resolve(100) == 0
    with pytest.raises(ConfigError):
        build_method("flexgen", attention_on="tpu")
    with pytest.raises(ConfigError):
        build_method("flexgen", host_tier="gpu")
    with pytest.raises(ConfigError):
        build_method("flexgen", compress_kv=True, group_size=7)


def test_kv_lives_on_host_and_is_streamed_every_step():
    B, Hq, Hkv, D, T, steps, L = 2, 4, 2, 16, 30, 4, 3
    method = FlexGen()
    run = run_method(method, (B, Hq, Hkv, D, T), steps, 0, layers=L)
    tok = B * Hkv * D * 4 * 2  # K + V bytes per token, float32
    # every step copies each layer's host KV (prompt + earlier new tokens) to the GPU
    expect = sum(L * (T + s) * tok for s in range(steps))
    assert method.stats["bytes_h2d"] == expect
    assert method.stats["bytes_d2h"] == L * (T + steps) * tok
    store = run.ctx.store
    dram = store["dram"].bytes_by_owner()
    assert dram["layer0/host/k"] == B * Hkv * (T + steps) * D * 4
    gpu = store["gpu"].bytes_by_owner()
    # the GPU holds only the two staging slots (FlexGen's double buffer), not L layers of KV
    assert set(gpu) == {f"shared/stage{i}/{p}" for i in (0, 1) for p in ("k", "v")}
    assert sum(gpu.values()) == 2 * (T + steps) * tok


def test_compressed_cache_moves_fewer_bytes():
    B, Hq, Hkv, D, T, steps = 1, 2, 2, 64, 40, 3
    plain, comp = FlexGen(), FlexGen(compress_kv=True)
    run_method(plain, (B, Hq, Hkv, D, T), steps, 0)
    run = run_method(comp, (B, Hq, Hkv, D, T), steps, 0)
    # fp32: 256 B per vector -> 32 B codes + 8 B (min, scale)
    assert comp.stats["bytes_h2d"] * 256 == plain.stats["bytes_h2d"] * 40
    dram = run.ctx.store["dram"].bytes_by_owner()
    assert dram["layer0/host_codes/k"] == B * Hkv * (T + steps) * 32


def test_prefetch_one_layer_ahead_through_hooks():
    """on_layer_input(l) starts layer l+1's copy; decode(l+1) consumes it (CPU fallback path)."""
    B, Hq, Hkv, D, T, L = 1, 2, 1, 8, 12, 3
    ctx = make_ctx(B, Hq, Hkv, D, T, 2, layers=L)
    m = FlexGen()
    m.bind(ctx)
    assert not m.prefetcher.async_mode  # no CUDA here: the tested fallback
    g = torch.Generator().manual_seed(0)
    for layer in range(L):
        m.prefill(layer, torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
                  torch.randn(B, Hkv, T, D, generator=g), None)
    hidden = torch.zeros(B, 1, 8)
    m.on_layer_input(0, hidden)
    assert m.prefetcher.pending(0) and m.prefetcher.pending(1) and not m.prefetcher.pending(2)
    before = m.stats["bytes_h2d"]
    m.decode(0, torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D))
    assert not m.prefetcher.pending(0) and m.prefetcher.pending(1)
    assert m.stats["bytes_h2d"] == before  # consumed the prefetched copy, no second transfer
    m.on_layer_input(1, hidden)
    assert m.prefetcher.pending(2)
    # layer 1 and 2 use different staging slots, so layer 2's copy did not clobber layer 1's
    slot1 = m.stage[1]["k"].t[:, :, :T].clone()
    m.decode(1, torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D))
    assert torch.equal(slot1, m.host[1].k[:, :, :T])
    m.release()
    assert sum(ctx.store.bytes_by_tier().values()) == 0


def test_cpu_attention_ships_q_and_output_not_kv():
    B, Hq, Hkv, D, T, steps = 2, 4, 2, 16, 100, 3
    gpu_mode, cpu_mode = FlexGen(), FlexGen(attention_on="cpu")
    a = run_method(gpu_mode, (B, Hq, Hkv, D, T), steps, 0)
    b = run_method(cpu_mode, (B, Hq, Hkv, D, T), steps, 0)
    for ra, rb in zip(a.records, b.records):
        assert rel_err(ra.out, rb.out) < 1e-6
    # per layer per step: out [B, Hq, 1, D] fp32 + lse [B, Hq, 1] fp32 come back
    assert cpu_mode.stats["bytes_h2d"] == 2 * steps * (B * Hq * D * 4 + B * Hq * 4)
    assert cpu_mode.stats["bytes_h2d"] * 50 < gpu_mode.stats["bytes_h2d"]
    assert "shared/stage0/k" not in b.ctx.store["gpu"].bytes_by_owner()  # no staging needed


def test_gpu_share_of_the_policy():
    B, Hq, Hkv, D, T, steps = 1, 2, 1, 8, 20, 5
    m = FlexGen(gpu_budget=0.4)
    run_method(m, (B, Hq, Hkv, D, T), steps, 0)
    assert m.n_gpu == 10 and m.gpu[0].length == 10 and m.host[0].length == T + steps - 10
