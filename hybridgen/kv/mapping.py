"""Semantic-aware KV mapping: which host tier holds a layer's keys and which its values.

HybridGen scans every host key at every decode step (dense, bandwidth-bound) but reads only
the top-k value rows (sparse). The paper therefore puts keys on the local DRAM node and
values on the slower, larger CXL node. The alternatives exist for the ablation:

=============  =====================================================================
policy         placement
=============  =====================================================================
semantic       keys -> dram, values -> cxl (the paper's mapping)
dram           keys and values -> dram (no CXL node used)
cxl            keys and values -> cxl (everything on the expander)
interleaved    even layers -> dram, odd layers -> cxl (keys and values together)
=============  =====================================================================

Choices where the paper is silent:
- ``interleaved`` alternates whole layers rather than splitting tokens or pages. Each layer's
  segment then stays one contiguous stream on one node (the scan streams it once), and over a
  decode step half of the host KV bytes are read from each node, the same bandwidth mix a
  page interleave gives. Because the tier depends on the layer, it can only be used by
  methods that place layers one by one (``hybridgen``); ``hybrid-exact`` takes one
  key/value tier pair for all layers (:meth:`MappingPolicy.uniform_tiers`).
- The mapping names tiers only. NUMA binding is done by the tier itself: the ``cxl`` tier is
  bound to the CPU-less NUMA node when the machine has one and is otherwise plain host
  memory marked ``emulated`` (see :class:`hybridgen.kv.tiers.Tier`);
  :meth:`MappingPolicy.describe` copies those labels next to the placement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from hybridgen.errors import ConfigError, unknown_name

MAPPING_POLICIES: Dict[str, str] = {
    "semantic": "keys on dram, values on cxl",
    "dram": "keys and values on dram",
    "cxl": "keys and values on cxl",
    "interleaved": "even layers on dram, odd layers on cxl",
}


@dataclass(frozen=True)
class Placement:
    """Host tiers of one layer: ``key_tier`` holds keys (and the padding mask), ``value_tier`` values."""

    key_tier: str
    value_tier: str


@dataclass(frozen=True)
class MappingPolicy:
    """A named KV mapping policy (see the module table).

    >>> MappingPolicy("semantic").placement(0)
    Placement(key_tier='dram', value_tier='cxl')
    """

    name: str = "semantic"

    def __post_init__(self):
        if self.name not in MAPPING_POLICIES:
            raise unknown_name("KV mapping policy", self.name, MAPPING_POLICIES)

    def placement(self, layer: int) -> Placement:
        """The tiers of ``layer``'s host keys and values."""
        if self.name == "semantic":
            return Placement("dram", "cxl")
        if self.name == "dram":
            return Placement("dram", "dram")
        if self.name == "cxl":
            return Placement("cxl", "cxl")
        tier = "dram" if layer % 2 == 0 else "cxl"
        return Placement(tier, tier)

    @property
    def layer_dependent(self) -> bool:
        return self.name == "interleaved"

    def uniform_tiers(self) -> Dict[str, str]:
        """``{'key_tier': ..., 'value_tier': ...}`` for methods with one placement for all layers
        (e.g. ``build_method('hybrid-exact', **MappingPolicy('semantic').uniform_tiers())``)."""
        if self.layer_dependent:
            raise ConfigError("mapping 'interleaved' places layers one by one; use semantic, dram or cxl "
                              "with this method, or use method hybridgen")
        p = self.placement(0)
        return {"key_tier": p.key_tier, "value_tier": p.value_tier}

    def describe(self, store=None, num_layers: Optional[int] = None) -> dict:
        """Placement summary for result files, with the tiers' NUMA/emulation labels when a store is given."""
        out: dict = {"policy": self.name, "meaning": MAPPING_POLICIES[self.name]}
        if num_layers is not None and self.layer_dependent:
            out["layers"] = {l: self.placement(l).__dict__ for l in range(num_layers)}
        if store is not None:
            used = {self.placement(l).key_tier for l in range(2)} | {self.placement(l).value_tier for l in range(2)}
            out["tiers"] = {name: {key: store[name].describe()[key] for key in ("numa_node", "numa_bound", "emulated")}
                            for name in sorted(used)}
        return out


def parse_mapping(value) -> MappingPolicy:
    """A policy from a name or a policy (one-line ConfigError for unknown names)."""
    return value if isinstance(value, MappingPolicy) else MappingPolicy(str(value))


def kv_bytes_by_tier(store, layer_prefix: str = "layer") -> Dict[str, Tuple[int, int]]:
    """{tier: (key bytes, value bytes)} from the store's ledger (owners named '.../k' and '.../v')."""
    out: Dict[str, Tuple[int, int]] = {}
    for name, tier in store.tiers.items():
        kb = vb = 0
        for owner, n in tier.bytes_by_owner().items():
            if not owner.startswith(layer_prefix):
                continue
            if owner.endswith("/k"):
                kb += n
            elif owner.endswith("/v"):
                vb += n
        out[name] = (kb, vb)
    return out
