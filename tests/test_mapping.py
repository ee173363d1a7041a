"""Semantic-aware KV mapping: K and V land on the configured tiers (checked in the tier ledger)."""
import pytest

from hybridgen.errors import ConfigError
from hybridgen.hybrid import HybridGen
from hybridgen.hybrid.exact import HybridExact
from hybridgen.kv import TieredStore
from hybridgen.kv.mapping import MAPPING_POLICIES, MappingPolicy, Placement, kv_bytes_by_tier
from hybridgen.methods import Budget
from hybridgen.testing import MethodDriver

B, Hq, Hkv, D, T, L = 1, 4, 2, 8, 40, 4


def _prefill(method):
    """Bind (room for 2 decode steps) and prefill L layers on random q/k/v; the run's store (its tier ledger)."""
    driver = MethodDriver(method, (B, Hq, Hkv, D, T), 2, layers=L)
    driver.prefill()
    return driver.ctx.store


def _owners(store, tier, suffix):
    return sorted(o.split("/")[0] for o in store[tier].bytes_by_owner() if o.endswith("host/" + suffix))


def test_placements():
    assert MappingPolicy("semantic").placement(3) == Placement("dram", "cxl")
    assert MappingPolicy("dram").placement(1) == Placement("dram", "dram")
    assert MappingPolicy("cxl").placement(0) == Placement("cxl", "cxl")
    il = MappingPolicy("interleaved")
    assert [il.placement(l).key_tier for l in range(4)] == ["dram", "cxl", "dram", "cxl"]
    assert all(il.placement(l).key_tier == il.placement(l).value_tier for l in range(4))
    with pytest.raises(ConfigError, match="choose one of"):
        MappingPolicy("nvme")


def test_semantic_keys_on_dram_values_on_cxl_in_the_ledger():
    m = HybridGen(gpu_budget=Budget(tokens=8), mapping="semantic")
    store = _prefill(m)
    layers = [f"layer{l}" for l in range(L)]
    assert _owners(store, "dram", "k") == layers and _owners(store, "dram", "v") == []
    assert _owners(store, "cxl", "v") == layers and _owners(store, "cxl", "k") == []
    by = kv_bytes_by_tier(store)
    assert by["dram"][0] > 0 and by["dram"][1] == 0 and by["cxl"][1] == by["dram"][0] and by["cxl"][0] == 0
    assert by["gpu"][0] > 0  # sinks + window stay on the gpu tier
    m.release()
    assert store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}


@pytest.mark.parametrize("policy", ["dram", "cxl"])
def test_single_tier_policies(policy):
    store = _prefill(HybridGen(gpu_budget=Budget(tokens=8), mapping=policy))
    other = "cxl" if policy == "dram" else "dram"
    assert len(_owners(store, policy, "k")) == L and len(_owners(store, policy, "v")) == L
    assert store[other].used == 0


def test_interleaved_alternates_layers():
    store = _prefill(HybridGen(gpu_budget=Budget(tokens=8), mapping="interleaved"))
    assert _owners(store, "dram", "k") == _owners(store, "dram", "v") == ["layer0", "layer2"]
    assert _owners(store, "cxl", "k") == _owners(store, "cxl", "v") == ["layer1", "layer3"]
    assert store["dram"].used == store["cxl"].used


def test_hybrid_exact_uses_uniform_tiers():
    store = _prefill(HybridExact(gpu_budget=Budget(tokens=8), **MappingPolicy("semantic").uniform_tiers()))
    assert len(_owners(store, "dram", "k")) == L and len(_owners(store, "cxl", "v")) == L
    with pytest.raises(ConfigError, match="interleaved"):
        MappingPolicy("interleaved").uniform_tiers()


def test_describe_labels_emulation():
    store = TieredStore()
    d = MappingPolicy("semantic").describe(store, num_layers=2)
    assert d["policy"] == "semantic" and set(d["tiers"]) == {"dram", "cxl"}
    assert d["tiers"]["cxl"]["emulated"] == store["cxl"].emulated
    assert set(MAPPING_POLICIES) == {"semantic", "dram", "cxl", "interleaved"}
    assert "layers" in MappingPolicy("interleaved").describe(num_layers=2)
