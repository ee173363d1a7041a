"""Memory tiers (gpu, dram, cxl) with capacities and exact byte accounting.

A :class:`Tier` hands out tensors on its device and keeps a ledger of every live
allocation (owner -> bytes); a :class:`TieredStore` groups the three tiers of one run.
Without CUDA the ``gpu`` tier lives on the CPU and is marked emulated; without a second NUMA
node the ``cxl`` tier is plain host memory and is marked emulated. Every result records
these flags (``TieredStore.describe``).
"""
from __future__ import annotations

import math
import re
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from hybridgen.errors import CapacityError, ConfigError
from hybridgen.kv import numa

TIER_NAMES = ("gpu", "dram", "cxl")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_BYTES = 2 ** 60  #: the largest size accepted (1 EiB): past it, a number is a typo, not a machine


def parse_bytes(value: Union[None, int, float, str]) -> Optional[int]:
    """'24GiB', '1.5 GB', 1e9, None ('unlimited') -> bytes or None. Negative, malformed, NaN or
    above MAX_BYTES (1 EiB, also an overflow such as '1e309GiB') -> error; float('inf') and the
    words 'inf'/'unlimited'/'none' mean unlimited."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "unlimited", "inf")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value) if not abs(value) >= MAX_BYTES * 2 else (math.inf if value > 0 else -math.inf)  # NaN stays NaN
        if isinstance(value, float) and math.isinf(value) and value > 0:
            return None
        if math.isnan(n):
            raise ConfigError(f"cannot read {value!r} as a size; write e.g. '24GiB', '512MB' or a byte count")
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value), re.IGNORECASE)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"cannot read {value!r} as a size; write e.g. '24GiB', '512MB' or a byte count")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 0:
        raise ConfigError(f"a capacity must be >= 0, got {value!r}")
    if n > MAX_BYTES:  # also 1e309GiB (inf after the multiplication): int() of it would overflow
        raise ConfigError(f"a size must be at most 1 EiB ({MAX_BYTES} bytes), got {value!r}; "
                          "write 'unlimited' or null for no limit")
    return int(n)


def cuda_available() -> bool:
    return torch.cuda.is_available()


class Tier:
    """One memory tier: a device, an optional capacity in bytes, and a ledger of allocations.

    name: 'gpu' | 'dram' | 'cxl'. numa_node: bind host memory to this node (cxl tier).
    pinned: page-locked host memory (only when CUDA is available). gpu_device: where the gpu
    tier lives (default: CUDA when available, else the CPU, emulated); a CPU engine on a CUDA
    machine passes its own device.
    """

    def __init__(self, name: str, capacity: Optional[int] = None, numa_node: Optional[int] = None,
                 pin: bool = True, gpu_device: Union[None, str, torch.device] = None):
        if name not in TIER_NAMES:
            raise ConfigError(f"unknown tier {name!r}; tiers are {', '.join(TIER_NAMES)}")
        self.name = name
        self.capacity = capacity
        if name != "gpu":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device(gpu_device if gpu_device is not None else "cuda" if cuda_available() else "cpu")
        self.pinned = name != "gpu" and pin and cuda_available()
        self.numa_node = numa_node if name != "gpu" else None
        self.numa_bound = self.numa_node is not None and numa.binding_supported()
        # Emulated: the tier is not the hardware it stands for.
        if name == "gpu":
            self.emulated = self.device.type != "cuda"
        elif name == "cxl":
            self.emulated = not self.numa_bound
        else:
            self.emulated = False
        self._ledger: Dict[int, Tuple[str, int]] = {}
        self.used = 0
        self.peak = 0
        self.num_allocations = 0  # every allocate() call, for amortised-growth checks
        self.spill: Optional["Tier"] = None  # where an allocation past the capacity lands instead

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, owner: str,
                 pinned: Optional[bool] = None) -> torch.Tensor:
        """A zero-filled tensor on this tier, recorded under ``owner`` (e.g. 'layer3/k').

        pinned: page-lock it (None: the tier's default, :attr:`pinned`; True only takes effect
        where the tier can pin, i.e. a host tier with CUDA). Pageable host allocations of
        at least ``HUGE_PAGE_MIN`` bytes are advised onto transparent huge pages
        (:func:`huge_page_empty`)."""
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        pin = self.pinned if pinned is None else (bool(pinned) and self.name != "gpu" and cuda_available())
        if self.capacity is not None and self.used + nbytes > self.capacity:
            if self.spill is not None:  # DRAM full: the allocation lands on CXL (TieredStore spill)
                return self.spill.allocate(shape, dtype, owner, pinned=pinned)
            raise CapacityError(
                f"tier '{self.name}' cannot hold {owner} ({_fmt(nbytes)} more; {_fmt(self.used)} of "
                f"{_fmt(self.capacity)} used); raise the {self.name} capacity or lower the KV budget")
        if self.numa_bound:
            raw = numa.alloc_on_node(max(nbytes, 1), self.numa_node)
            t = raw[:nbytes].view(dtype).view(*shape) if nbytes else torch.zeros(shape, dtype=dtype)
            if pin and nbytes:
                torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        elif self.device.type == "cpu" and not pin and nbytes >= HUGE_PAGE_MIN:
            t = huge_page_empty(tuple(shape), dtype).zero_()
        else:
            t = torch.zeros(tuple(shape), dtype=dtype, device=self.device, pin_memory=pin)
        self._ledger[id(t)] = (owner, nbytes)
        self.num_allocations += 1
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return t

    def view(self, pinned: bool) -> "TierView":
        """This tier with another page-locking default (same device, capacity and ledger)."""
        return TierView(self, pinned)

    def release(self, t: torch.Tensor) -> None:
        """Forget an allocation made by :meth:`allocate` (the caller drops its reference; one
        that spilled is forgotten by the tier that holds it)."""
        if id(t) not in self._ledger and self.spill is not None:
            return self.spill.release(t)
        owner, nbytes = self._ledger.pop(id(t))
        self.used -= nbytes

    def bytes_by_owner(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for owner, n in self._ledger.values():
            out[owner] = out.get(owner, 0) + n
        return out

    def describe(self) -> dict:
        return {"device": str(self.device), "capacity": self.capacity, "numa_node": self.numa_node,
                "numa_bound": self.numa_bound, "pinned": self.pinned, "emulated": self.emulated,
                "used": self.used, "peak": self.peak}


class TierView:
    """A :class:`Tier` seen with another page-locking default: allocations are the tier's own
    (counted in its ledger, against its capacity); everything else reads through.

    HybridGen keeps the host keys it scans in pageable memory (``tier.view(pinned=False)``)
    while other methods stream theirs from the pinned tier (docs/design.md, placement).
    """

    def __init__(self, tier: Tier, pinned: bool):
        self._tier = tier
        self.pinned = bool(pinned) and tier.name != "gpu" and cuda_available()

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, owner: str,
                 pinned: Optional[bool] = None) -> torch.Tensor:
        return self._tier.allocate(shape, dtype, owner, pinned=self.pinned if pinned is None else pinned)

    def __getattr__(self, name: str):
        return getattr(self._tier, name)


HUGE_PAGE_MIN = 4 << 20  # pageable host allocations this large are advised onto huge pages
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc = None


def huge_page_empty(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose 2 MiB-aligned interior is advised ``MADV_HUGEPAGE``.

    With transparent huge pages in ``madvise`` mode (common), torch's large allocations get
    4 KiB pages; the scan's and gathers' TLB misses then cost: measured on the 2-core dev VM
    (537 MB of bf16 keys, 1 thread), the top-k row gather took 11-9 ms instead of 24-12 ms
    and the scan 94-112 ms instead of 147-117 ms. Where advice is unsupported (not Linux,
    THP off) this is a plain allocation; the memory is the same either way.
    """
    global _libc
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % _HUGE
    try:
        import ctypes

        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        span = (nbytes // _HUGE) * _HUGE
        if span:
            _libc.madvise(raw.data_ptr() + off, span, _MADV_HUGEPAGE)
    except (OSError, AttributeError):  # pragma: no cover - no libc madvise here
        pass
    return raw[off:off + nbytes].view(dtype).view(shape)


class TieredStore:
    """The gpu, dram and cxl tiers of one run.

    capacities: bytes per tier (None = unlimited). cxl_node: NUMA node of the CXL memory;
    'auto' picks the first CPU-less node when there is one. spill: a DRAM allocation past the
    DRAM capacity lands on the cxl tier (host memory expanded with CXL: the projection's rule,
    :mod:`hybridgen.perf.host_tiers`); without it the DRAM tier refuses (CapacityError).
    gpu_device: the gpu tier's device (default CUDA when available; an engine passes its own);
    the host tiers pin their memory only when that device is CUDA.
    """

    def __init__(self, gpu: Optional[int] = None, dram: Optional[int] = None, cxl: Optional[int] = None,
                 cxl_node: Union[None, int, str] = "auto", dram_node: Optional[int] = None, spill: bool = False,
                 gpu_device: Union[None, str, torch.device] = None):
        if cxl_node == "auto":
            cxl_node = numa.cxl_candidate_node()
        gpu_tier = Tier("gpu", parse_bytes(gpu), gpu_device=gpu_device)
        pin = gpu_tier.device.type == "cuda"  # host KV is copied to a real GPU only: pinned only then
        self.tiers: Dict[str, Tier] = {
            "gpu": gpu_tier,
            "dram": Tier("dram", parse_bytes(dram), numa_node=dram_node, pin=pin),
            "cxl": Tier("cxl", parse_bytes(cxl), numa_node=cxl_node, pin=pin),
        }
        if spill:
            self.tiers["dram"].spill = self.tiers["cxl"]

    def __getitem__(self, name: str) -> Tier:
        if name not in self.tiers:
            raise ConfigError(f"unknown tier {name!r}; tiers are {', '.join(TIER_NAMES)}")
        return self.tiers[name]

    def bytes_by_tier(self) -> Dict[str, int]:
        return {name: t.used for name, t in self.tiers.items()}

    def bytes_by_layer(self) -> Dict[str, Dict[str, int]]:
        """{tier: {layer-prefix: bytes}} where owners are named '<layer>/<part>'."""
        out: Dict[str, Dict[str, int]] = {}
        for name, t in self.tiers.items():
            per: Dict[str, int] = {}
            for owner, n in t.bytes_by_owner().items():
                key = owner.split("/")[0]
                per[key] = per.get(key, 0) + n
            out[name] = per
        return out

    def peak_by_tier(self) -> Dict[str, int]:
        return {name: t.peak for name, t in self.tiers.items()}

    def describe(self) -> dict:
        return {name: t.describe() for name, t in self.tiers.items()}


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
