"""NUMA discovery and node binding (CXL memory is a CPU-less NUMA node)."""
import os

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.kv import Tier, numa


def test_numa_nodes_describe_this_machine():
    nodes = numa.numa_nodes()
    assert nodes and all(n.node >= 0 for n in nodes)
    assert len({n.node for n in nodes}) == len(nodes)
    cpus = [c for n in nodes for c in n.cpus]
    assert cpus and len(cpus) == len(set(cpus))  # every CPU belongs to one node
    assert numa.binding_supported() == (len(nodes) > 1 and os.uname().sysname == "Linux"
                                        and os.uname().machine in ("x86_64", "aarch64"))
    cand = numa.cxl_candidate_node()
    assert cand is None or not next(n for n in nodes if n.node == cand).cpus


def test_parse_cpulist():
    assert numa._parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert numa._parse_cpulist("\n") == ()


def test_alloc_on_node_refused_on_single_node_machine():
    if numa.binding_supported():
        pytest.skip("this machine has several NUMA nodes")
    with pytest.raises(ConfigError) as err:
        numa.alloc_on_node(4096, 0)
    assert "\n" not in str(err.value) and "NUMA" in str(err.value)
    with pytest.raises(ConfigError):
        numa.alloc_on_node(4096, 99)  # no such node


def _mbind_allowed() -> bool:
    """mbind(2) may be filtered in containers; the forced-binding tests need it."""
    try:
        import ctypes
        import mmap
        import platform
        buf = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        mask = (ctypes.c_ulong * 1)(1)
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(numa._SYS_MBIND[platform.machine()], ctypes.c_void_p(addr),
                          ctypes.c_ulong(mmap.PAGESIZE), numa._MPOL_BIND, mask, ctypes.c_ulong(2), 0)
        return rc == 0
    except Exception:
        return False


def test_binding_code_path_on_node0(monkeypatch):
    """Force the multi-node path onto node 0: the mbind + first-touch code really runs."""
    if not _mbind_allowed():
        pytest.skip("mbind is not permitted in this environment")
    monkeypatch.setattr(numa, "binding_supported", lambda: True)
    t = numa.alloc_on_node(3 * 4096 + 5, 0)
    assert t.dtype == torch.uint8 and t.numel() == 3 * 4096 + 5 and int(t.sum()) == 0
    t.fill_(7)
    assert int(t[-1]) == 7
    node = numa.node_of_address(t.data_ptr())
    assert node in (None, 0)
    tier = Tier("cxl", numa_node=0, pin=False)
    assert tier.numa_bound and not tier.emulated
    x = tier.allocate((2, 3, 5, 4), torch.bfloat16, "layer0/v")
    assert x.shape == (2, 3, 5, 4) and x.dtype == torch.bfloat16 and tier.used == x.numel() * 2
    x.normal_()
    assert bool(torch.isfinite(x.float()).all())
    tier.release(x)
    assert tier.used == 0
