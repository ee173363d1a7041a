"""NUMA discovery and node-bound host allocations (a CXL expander is a CPU-less NUMA node).

Reads the node layout from sysfs and binds anonymous mmap memory to a node with the
``mbind`` system call through ctypes (no libnuma needed). On a machine with one node
(or no Linux sysfs) binding is impossible and callers mark the tier emulated.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from hybridgen.errors import ConfigError

_SYSFS = Path("/sys/devices/system/node")
_MPOL_BIND = 2
_MPOL_MF_STRICT = 1
_MPOL_MF_MOVE = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its id, its CPUs (empty for a CXL memory expander) and total memory."""

    node: int
    cpus: tuple
    mem_bytes: int

    @property
    def cpu_less(self) -> bool:
        return not self.cpus


def _parse_cpulist(text: str) -> tuple:
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def numa_nodes() -> List[NumaNode]:
    """The machine's NUMA nodes (one pseudo node 0 when sysfs has none)."""
    nodes = []
    if _SYSFS.is_dir():
        for d in sorted(_SYSFS.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            cpus = _parse_cpulist((d / "cpulist").read_text()) if (d / "cpulist").exists() else ()
            mem = 0
            meminfo = d / "meminfo"
            if meminfo.exists():
                for line in meminfo.read_text().splitlines():
                    if "MemTotal" in line:
                        mem = int(line.split()[-2]) * 1024
            nodes.append(NumaNode(int(d.name[4:]), cpus, mem))
    return nodes or [NumaNode(0, tuple(range(os.cpu_count() or 1)), 0)]


def cxl_candidate_node() -> Optional[int]:
    """The first CPU-less node (how CXL memory appears), or None."""
    for n in numa_nodes():
        if n.cpu_less:
            return n.node
    return None


def binding_supported() -> bool:
    """True when memory can really be bound to a node here (Linux, >1 node, known syscall)."""
    return (platform.system() == "Linux" and len(numa_nodes()) > 1
            and platform.machine() in _SYS_MBIND)


def alloc_on_node(nbytes: int, node: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose pages are bound to NUMA ``node``.

    The memory is an anonymous mmap bound with mbind(MPOL_BIND) before first touch, then
    touched so the pages really live there. The mmap stays alive as long as the tensor.
    """
    nodes = {n.node for n in numa_nodes()}
    if node not in nodes:
        raise ConfigError(f"NUMA node {node} does not exist (nodes: {sorted(nodes)}); fix hardware.cxl_node")
    if not binding_supported():
        raise ConfigError("NUMA binding needs Linux with more than one NUMA node; use an emulated tier")
    size = max(nbytes, mmap.PAGESIZE)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    maxnode = max(nodes) + 2
    mask = (ctypes.c_ulong * ((maxnode + 63) // 64))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_MBIND[platform.machine()], ctypes.c_void_p(addr), ctypes.c_ulong(size),
                      _MPOL_BIND, mask, ctypes.c_ulong(maxnode), _MPOL_MF_STRICT | _MPOL_MF_MOVE)
    if rc != 0:
        err = ctypes.get_errno()
        raise ConfigError(f"mbind to NUMA node {node} failed ({os.strerror(err)}); check the node has free memory")
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    t.zero_()  # first touch: pages are faulted in on the bound node
    t._numa_mmap = buf  # keep the mapping alive with the tensor
    return t


def node_of_address(addr: int) -> Optional[int]:
    """The NUMA node currently backing the page at ``addr`` (move_pages query), or None."""
    if platform.machine() not in ("x86_64",):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (ctypes.c_void_p * 1)(addr & ~(mmap.PAGESIZE - 1))
    status = (ctypes.c_int * 1)(-1)
    rc = libc.syscall(279, 0, ctypes.c_ulong(1), pages, None, status, 0)  # move_pages
    return status[0] if rc == 0 and status[0] >= 0 else None
