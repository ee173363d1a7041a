"""Hardware profiles: the schema, loading with ``extends`` merging, and validation.

``hybridgen/profiles/<name>.json`` (``available_profiles()``, ``load_profile(name_or_path)``).
Sections ``gpu`` (memory, HBM and effective decode-attention bandwidth, fused and GQA
partial, matmul rate, launch cost), ``link`` (host<->GPU copy bandwidths, pinned and
pageable), ``host`` (cores, DRAM read bandwidth, CPU attention / key-scan bytes per second by
dtype on pageable and on pinned memory, top-k and group-score rates, the fixed cost of one
host-side op, NUMA nodes), ``cxl``
(null, or a CXL memory expander's read bandwidth and added latency) and ``sources`` (a
citation for every figure, by dotted path or section). ``extends`` merges parent files first
(files whose name starts with ``_`` are abstract building blocks). ``python -m
hybridgen_harness.profile`` writes a measured profile with the same schema (``measured: true``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from hybridgen.errors import ConfigError, MissingDataError, unknown_name

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"


@dataclass(frozen=True)
class GPUSpec:
    """The GPU: memory (GB), HBM bandwidth and the effective bandwidth of decode attention
    (GB/s of KV read), dense bf16/fp16 matmul rate (TFLOP/s), launch/sync cost (us).

    attention_gbps: fused decode attention (SDPA, what ``full`` runs on CUDA);
    gqa_attention_gbps: the unfused partial-attention path (logits, softmax, weighted sum) of
    a GQA layer (Hq > Hkv) that the split methods run on their GPU part (None: attention_gbps);
    emulated_on_host: the 'gpu' tier is the host CPU itself (no CUDA device; a measured
    profile of a CPU-only machine): the two branches then share the cores and add up.
    """

    name: Optional[str]
    memory_gb: Optional[float]
    hbm_gbps: Optional[float]
    attention_gbps: Optional[float]
    matmul_tflops: Optional[float]
    launch_us: Optional[float]
    gqa_attention_gbps: Optional[float] = None
    emulated_on_host: bool = False


@dataclass(frozen=True)
class LinkSpec:
    """Host<->GPU link: achieved copy bandwidths (GB/s) and a per-copy latency (us)."""

    name: Optional[str]
    h2d_pinned_gbps: Optional[float]
    h2d_pageable_gbps: Optional[float]
    d2h_pinned_gbps: Optional[float]
    latency_us: Optional[float]
    d2h_pageable_gbps: Optional[float] = None


@dataclass(frozen=True)
class NodeSpec:
    """One NUMA node's memory: 'dram' or 'cxl', read bandwidth from the CPUs (GB/s)."""

    node: int
    kind: str
    read_gbps: Optional[float]
    capacity_gb: Optional[float] = None


@dataclass(frozen=True)
class HostSpec:
    """The host CPU side. *_gbps dicts are keyed by KV dtype ('bf16', 'fp16', 'fp32').

    cpu_attention_gbps / key_scan_gbps: KV (key) bytes per second read from pageable memory;
    *_pinned_gbps: the same kernels over page-locked (pinned) host memory, where the code keeps
    host KV when CUDA exists (empty: as pageable); topk_gbps: bytes/s of fp32 scores ranked by
    the top-k; group_score_gbps: bytes/s of fp32 logits reduced to one score per KV group
    (None: topk_gbps); op_us: fixed cost of one small host-side step of a split layer (one
    torch CPU op / pool hand-off, threads forked and joined), us; gather_gbps: bytes/s of rows
    gathered at random token indices (None: the tier's read bandwidth); key_sketch_gbps: bytes/s
    of key-sketch codes + parameters read by the sketch scan, keyed by kind ('int8', 'int4';
    empty: the key scan's bytes/s, an assumption the cost's breakdown names); select_gbps:
    bytes/s of fp32 logits through the code's fused selection (group score + top-k in one C
    pass, ``cpu_scan.select``; None: the group score and top-k rates, which describe torch's
    ``group_scores`` + ``topk``); key_scan_bf16dot_gbps: bytes/s of bf16 keys through
    HybridGen's bf16-dot selection scan (``scan='bf16dot'``, the default on bf16 keys; None: not
    measured on this host, priced at the bf16 key scan's rate, an assumption the cost names).
    """

    cpu: Optional[str]
    cores: Optional[int]
    dram_gb: Optional[float]
    dram_read_gbps: Optional[float]
    cpu_attention_gbps: Dict[str, float]
    key_scan_gbps: Dict[str, float]
    topk_gbps: Optional[float]
    numa_nodes: Tuple[NodeSpec, ...] = ()
    key_scan_pinned_gbps: Dict[str, float] = field(default_factory=dict)
    cpu_attention_pinned_gbps: Dict[str, float] = field(default_factory=dict)
    group_score_gbps: Optional[float] = None
    op_us: Optional[float] = None
    gather_gbps: Optional[float] = None
    key_sketch_gbps: Dict[str, float] = field(default_factory=dict)
    select_gbps: Optional[float] = None
    key_scan_bf16dot_gbps: Optional[float] = None


@dataclass(frozen=True)
class CXLSpec:
    """A CXL memory expander (a CPU-less NUMA node)."""

    name: str
    link_gbps: float
    read_gbps: float
    added_latency_ns: float
    capacity_gb: Optional[float] = None


@dataclass(frozen=True)
class HardwareProfile:
    """One machine: GPU, link, host, optional CXL node, and a source for every figure."""

    name: str
    description: str
    measured: bool
    date: str
    gpu: GPUSpec
    link: LinkSpec
    host: HostSpec
    cxl: Optional[CXLSpec]
    sources: Dict[str, str]
    host_info: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (the schema of the files in hybridgen/profiles)."""
        d = asdict(self)
        d["host"]["numa_nodes"] = [asdict(n) for n in self.host.numa_nodes]
        return d


_SECTION_TYPES = {"gpu": GPUSpec, "link": LinkSpec, "host": HostSpec, "cxl": CXLSpec}
_REQUIRED_TOP = ("name", "description", "measured", "date", "gpu", "link", "host", "sources")


def available_profiles() -> List[str]:
    """Names of the shipped (non-abstract) profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json") if not p.stem.startswith("_"))


def _merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


def _read_raw(name_or_path: Union[str, Path], seen: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The profile dict with its ``extends`` chain merged in (parents first)."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".json") or path.exists()):
        path = PROFILE_DIR / f"{text}.json"
        if not path.exists():
            raise unknown_name("hardware profile", text, available_profiles())
    elif not path.exists():
        raise MissingDataError(f"hardware profile file {text} does not exist; run `python -m hybridgen_harness.profile --out {text}`")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"hardware profile {path} is not valid JSON ({err}); fix or regenerate it") from None
    parents = raw.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: Dict[str, Any] = {}
    for parent in parents:
        if parent in seen:
            raise ConfigError(f"hardware profile {path.name} extends itself through {parent!r}; fix 'extends'")
        merged = _merge(merged, _read_raw(parent, seen + (parent,)))
    return _merge(merged, raw)


def _section(cls, raw: Any, where: str) -> Dict[str, Any]:
    """Check one section's keys against its dataclass (required = fields without a default)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object; see hybridgen/profiles/h200-host.json")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(raw))
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; see hybridgen/profiles/h200-host.json")
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where} has unknown keys {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    return raw


def _numeric_paths(d: Dict[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    out = []
    for key, val in d.items():
        path = f"{prefix}{key}"
        if isinstance(val, dict):
            out.extend(_numeric_paths(val, path + "."))
        elif isinstance(val, list):
            for i, item in enumerate(val):
                if isinstance(item, dict):
                    out.extend(_numeric_paths(item, f"{path}[{i}]."))
        elif isinstance(val, (int, float)) and not isinstance(val, bool):
            out.append((path, val))
    return out


def _has_source(path: str, sources: Dict[str, str]) -> bool:
    parts = path.replace("[", ".[").split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i]).replace(".[", "[")
        key_nolist = key.split("[")[0]
        if key in sources or key_nolist in sources:
            return True
    return False


def profile_from_dict(raw: Dict[str, Any], where: str = "profile") -> HardwareProfile:
    """Validate a profile dict (``extends`` already merged) and build the dataclasses.

    Rules: every required key present, no unknown keys, every figure a non-negative number
    (bandwidths and rates > 0) or null, and every non-null figure cited in ``sources``
    (its dotted path, or a prefix of it such as the section name).
    """
    missing = [k for k in _REQUIRED_TOP if k not in raw]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; see hybridgen/profiles/h200-host.json")
    if not isinstance(raw["measured"], bool):
        raise ConfigError(f"{where}: 'measured' must be true or false")
    if not isinstance((raw.get("gpu") or {}).get("emulated_on_host", False), bool):
        raise ConfigError(f"{where}: gpu.emulated_on_host must be true or false")
    sources = raw["sources"]
    if not isinstance(sources, dict) or not sources:
        raise ConfigError(f"{where}: 'sources' must cite every figure (dotted path -> citation)")
    sections = {}
    for name in ("gpu", "link", "host"):
        sections[name] = _section(_SECTION_TYPES[name], raw[name], f"{where} section '{name}'")
    cxl_raw = raw.get("cxl")
    if cxl_raw is not None:
        _section(CXLSpec, cxl_raw, f"{where} section 'cxl'")
    for path, val in _numeric_paths({k: raw[k] for k in ("gpu", "link", "host", "cxl") if raw.get(k) is not None}):
        if not math.isfinite(val) or val < 0 or (val == 0 and path.endswith(("gbps", "tflops"))):
            raise ConfigError(f"{where}: {path} = {val} must be positive; fix the profile")
        if not _has_source(path, sources):
            raise ConfigError(f"{where}: {path} has no entry in 'sources'; cite where the figure comes from")
    host = dict(sections["host"])
    host.setdefault("numa_nodes", [])
    for key in ("cpu_attention_gbps", "key_scan_gbps", "key_scan_pinned_gbps", "cpu_attention_pinned_gbps",
                "key_sketch_gbps"):
        host[key] = dict(host.get(key) or {})
    nodes = [NodeSpec(**n) for n in host["numa_nodes"]]
    cxl = CXLSpec(**cxl_raw) if cxl_raw is not None else None
    if cxl is not None and not any(n.kind == "cxl" for n in nodes):
        nodes.append(NodeSpec(node=max([n.node for n in nodes], default=-1) + 1, kind="cxl",
                              read_gbps=cxl.read_gbps, capacity_gb=cxl.capacity_gb))
    host["numa_nodes"] = tuple(nodes)
    return HardwareProfile(
        name=str(raw["name"]), description=str(raw["description"]), measured=raw["measured"],
        date=str(raw["date"]), gpu=GPUSpec(**sections["gpu"]), link=LinkSpec(**sections["link"]),
        host=HostSpec(**host), cxl=cxl, sources=dict(sources), host_info=dict(raw.get("host_info") or {}))


def load_profile(name_or_path: Union[str, Path, HardwareProfile]) -> HardwareProfile:
    """A shipped profile by name (see :func:`available_profiles`) or a profile JSON file."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    raw = _read_raw(name_or_path)
    return profile_from_dict(raw, where=f"hardware profile {raw.get('name', name_or_path)!r}")
