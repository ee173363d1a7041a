"""Where a method's host bytes live in a projection: DRAM first, the rest on CXL, or "does not fit".

A method states its memory once, in its footprint (``tier_bytes`` per tier: 'gpu', 'dram',
'cxl'); everything not on the GPU is host bytes (KV, masks, INT4 codes, key sketches, ...).
The profile states the host capacities: DRAM ``host.dram_gb``, CXL ``cxl.capacity_gb`` (no
CXL node: none; a CXL node without a capacity: unlimited; ``host.dram_gb`` null: unlimited).
Model weights live on the GPU in every profile: they take no host memory (a choice).

  no CXL node        all host bytes on DRAM (also those a method places on 'cxl', as
                     CostContext.tiers reads them); fits: within the DRAM capacity
  DRAM               the method's DRAM bytes up to the DRAM capacity;
  CXL                the method's own CXL bytes (e.g. HybridGen's semantic mapping puts its cold
                     values there) + the DRAM bytes past the DRAM capacity (the spill);
  fits               CXL bytes <= the CXL capacity (and no spill without a CXL node)
  spill fraction f   spilled / the method's DRAM bytes: the share of every read the method's
                     cost makes from its 'dram' tier that CXL serves (CostContext.tier_shares)

The emulated runs spill the same way through the tier ledger (:class:`hybridgen.kv.TieredStore`
with ``spill=True``: a DRAM allocation past its capacity lands on the CXL tier).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from hybridgen.perf.profiles import HardwareProfile

__all__ = ["HostTiers", "host_capacities", "split_host_bytes", "place_host_bytes", "host_tiers_of"]


@dataclass(frozen=True)
class HostTiers:
    """A method's host bytes on one profile (bytes; capacities None = unlimited).

    dram_bytes / cxl_bytes: what lives on each host tier (cxl: the method's own + the spill);
    spilled_bytes: the method's DRAM bytes past the DRAM capacity (part of cxl_bytes);
    fits: the host holds them (cxl_bytes within the CXL capacity)."""

    dram_bytes: float = 0.0
    cxl_bytes: float = 0.0
    spilled_bytes: float = 0.0
    dram_capacity: Optional[float] = None
    cxl_capacity: Optional[float] = None
    fits: bool = True

    @property
    def spill_fraction(self) -> float:
        """Share of the method's DRAM-placed bytes that CXL holds (0 when nothing spilled)."""
        wanted = self.dram_bytes + self.spilled_bytes
        return self.spilled_bytes / wanted if wanted > 0 else 0.0

    def as_dict(self) -> Dict[str, float]:
        """{'dram': bytes, 'cxl': bytes}: what ``StepPrediction.host_bytes`` reports."""
        return {"dram": float(self.dram_bytes), "cxl": float(self.cxl_bytes)}


def host_capacities(hw: HardwareProfile) -> Tuple[Optional[float], Optional[float]]:
    """(DRAM bytes, CXL bytes) the profile's host holds: host.dram_gb, cxl.capacity_gb (x 1e9;
    None = unlimited; CXL 0 when the profile has no CXL node)."""
    dram = None if hw.host.dram_gb is None else hw.host.dram_gb * 1e9
    if hw.cxl is None:
        return dram, 0.0
    return dram, (None if hw.cxl.capacity_gb is None else hw.cxl.capacity_gb * 1e9)


def split_host_bytes(want_dram: float, want_cxl: float, dram_cap: Optional[float], cxl_cap: Optional[float],
                     has_cxl: bool = True) -> HostTiers:
    """The rule (module docstring): ``want_dram`` / ``want_cxl`` bytes a method places on each
    host tier, on a host of ``dram_cap`` / ``cxl_cap`` bytes (None = unlimited); ``has_cxl``
    False: no CXL node, everything on DRAM. Also the emulated run's preflight
    (:func:`hybridgen.methods.placement.check_host_capacity`) with the hardware config's capacities."""
    if not has_cxl:  # all on DRAM, whether it fits or not
        want = want_dram + want_cxl
        return HostTiers(dram_bytes=want, dram_capacity=dram_cap, cxl_capacity=0.0,
                         fits=dram_cap is None or want <= dram_cap)
    dram = want_dram if dram_cap is None else min(want_dram, dram_cap)
    spilled = want_dram - dram
    cxl = want_cxl + spilled
    return HostTiers(dram_bytes=dram, cxl_bytes=cxl, spilled_bytes=spilled, dram_capacity=dram_cap,
                     cxl_capacity=cxl_cap, fits=cxl_cap is None or cxl <= cxl_cap)


def place_host_bytes(tier_bytes: Mapping[str, float], hw: HardwareProfile) -> HostTiers:
    """The host bytes of ``tier_bytes`` (a footprint's) placed on ``hw`` (module docstring)."""
    dram_cap, cxl_cap = host_capacities(hw)
    return split_host_bytes(float(tier_bytes.get("dram", 0)), float(tier_bytes.get("cxl", 0)), dram_cap, cxl_cap,
                            has_cxl=hw.cxl is not None)


def host_tiers_of(method: Any, kv_shape: Any, hw: HardwareProfile) -> Optional[HostTiers]:
    """:func:`place_host_bytes` of ``method.footprint(kv_shape)``; None when the method states
    no footprint (its host bytes are unknown: nothing is checked or spilled)."""
    footprint = getattr(method, "footprint", None)
    fp = footprint(kv_shape) if callable(footprint) else None
    return None if fp is None else place_host_bytes(fp.tier_bytes, hw)
