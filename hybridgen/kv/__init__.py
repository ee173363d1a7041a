"""Tiered KV store: tiers with capacities and NUMA binding, append-only per-layer segments."""
from hybridgen.kv.segment import KVSegment
from hybridgen.kv.tiers import TIER_NAMES, Tier, TieredStore, parse_bytes

__all__ = ["KVSegment", "TIER_NAMES", "Tier", "TieredStore", "parse_bytes"]
