"""Hardware profiles and a roofline-style performance model of one decode step (PROJECTED).

Every number this module returns is a projection from datasheet or measured bandwidths,
never a measurement: each :class:`StepPrediction` carries ``projected=True`` and prints as
"projected". ``compare_to_measured`` reports the prediction error wherever the hardware
exists.

Hardware profiles
-----------------
``hybridgen/profiles/<name>.json`` (``available_profiles()``, ``load_profile(name_or_path)``).
Sections ``gpu`` (memory, HBM and effective decode-attention bandwidth, matmul rate, launch
cost), ``link`` (host<->GPU copy bandwidths, pinned and pageable), ``host`` (cores, DRAM read
bandwidth, CPU attention / key-scan / top-k bytes per second by dtype, NUMA nodes), ``cxl``
(null, or a CXL memory expander's read bandwidth and added latency) and ``sources`` (a
citation for every figure, by dotted path or section). ``extends`` merges parent files first
(files whose name starts with ``_`` are abstract building blocks). ``python -m
hybridgen.profile`` writes a measured profile with the same schema (``measured: true``).

The model (per layer, per decode step; B batch, S context, S_h = round(host_share*S) host
tokens, S_g = S - S_h, Hq/Hkv heads, D head dim, b bytes per KV element)
--------------------------------------------------------------------------------------
  kv_tok  = 2*Hkv*D*b            K+V bytes of one token of one sequence
  key_tok = Hkv*D*b
  gpu_attn(n) = B*n*kv_tok / gpu.attention_gbps + launch
  rest        = max(W_layer / gpu.hbm_gbps, 2*B*P_layer / gpu.matmul_tflops) + 10*launch
                (W_layer, P_layer: bytes / parameters of the layer's projections and MLP)
  copy(x)     = x / link.h2d_pinned_gbps + link.latency
  host reads of a tier: keys/values on DRAM or on CXL (``mapping``) read at
                min(kernel rate, tier read bandwidth)

  full            attn = gpu_attn(S);                          layer = rest + attn
  flexgen(-stream) xfer = copy(B*S_h*kv_tok); attn = xfer + gpu_attn(S)
                  layer = max(xfer, rest + gpu_attn(S))        (next layer's KV prefetched)
  flexgen-int4    as stream with (0.5 + 4/group) bytes per element over PCIe plus a GPU
                  dequantisation pass (read codes, write b-byte KV)
  flexgen-cpu     cpu = B*S_h*kv_tok / cpu_attention_gbps (+ q down, out+lse up)
  hybrid-exact    same as flexgen-cpu plus an LSE merge:
                  attn = max(cpu, gpu_attn(S_g)) + launch;     layer = rest + attn
  hybridgen       k = ceil(topk_ratio*S_h), Hsel = Hq (per_head) or Hkv
                  cpu = scan(B*S_h*key_tok / key_scan_gbps) + topk(B*Hq*S_h*4 / topk_gbps)
                        + gather(B*Hsel*k*D*b at the value tier, + CXL latency term)
                        + exact-logit rows (pipelined) + copy(B*Hq*k*4 + B*Hsel*k*D*b)
                  gpu_attn_part = gpu_attn(S_g) + B*Hsel*k*D*b / attention_gbps
                  attn = max(cpu, gpu_attn_part)               (branches overlap in a layer)
                  layer = max(cpu, rest + gpu_attn_part)  if pipelined (CPU runs a layer ahead)
                          rest + attn                     otherwise
  infinigen       spec = B*S*Hkv*(partial_ratio*D)*b / attention_gbps (partial keys on GPU)
                  fetch = gather(B*r*S_h*kv_tok) + copy(same); n = S_g + r*S_h
                  attn = spec + fetch + gpu_attn(n); layer = max(fetch, rest + spec + gpu_attn(n))
  h2o             attn = gpu_attn(r*S) + score update (B*Hq*r*S*4*2 / hbm)
  snapkv          attn = gpu_attn(r*S)
  streamingllm    attn = gpu_attn(min(S, max(r*S, sinks)))
  quest           attn = page bounds (B*Hkv*(S/page)*2*D*b / attention_gbps) + gpu_attn(r*S)
  (h2o, snapkv, streamingllm, quest keep their KV on the GPU; host_share does not apply)

  step total = L * layer + lm_head (vocab*hidden*b / hbm);  cpu/gpu/transfer totals = L * per layer

``attention_layer_s`` is the attention of one layer run alone (what a single-layer decode
benchmark times); ``layer_s`` is the steady-state per-layer time inside the model, with the
method's cross-layer overlap.

Choices (documented assumptions, change them in the profile or the workload):
- a CXL gather pays ``rows * added_latency / (cores * 10)`` on top of its bytes (about ten
  outstanding misses per core);
- host-KV methods other than ``hybridgen`` keep keys and values on DRAM unless the workload
  sets ``mapping``; ``hybridgen`` defaults to 'semantic' (keys on DRAM, values on CXL when
  the profile has a CXL node);
- host memory capacity is not checked; GPU capacity is (``fits_gpu`` in the prediction).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from hybridgen.errors import ConfigError, MissingDataError, unknown_name

PROFILE_DIR = Path(__file__).with_name("profiles")
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
REST_KERNELS = 10          # kernel launches of a layer outside attention (norms, projections, MLP)
MISSES_PER_CORE = 10       # outstanding cache misses per core (CXL gather latency term)
MAPPINGS = ("semantic", "dram", "cxl", "interleaved")


# ------------------------------------------------------------------ profiles
@dataclass(frozen=True)
class GPUSpec:
    """The GPU: memory (GB), HBM bandwidth and the effective bandwidth of decode attention
    (GB/s of KV read), dense bf16/fp16 matmul rate (TFLOP/s), launch/sync cost (us)."""

    name: Optional[str]
    memory_gb: Optional[float]
    hbm_gbps: Optional[float]
    attention_gbps: Optional[float]
    matmul_tflops: Optional[float]
    launch_us: Optional[float]


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
    """The host CPU side. *_gbps dicts are keyed by KV dtype ('bf16', 'fp16', 'fp32')."""

    cpu: Optional[str]
    cores: Optional[int]
    dram_gb: Optional[float]
    dram_read_gbps: Optional[float]
    cpu_attention_gbps: Dict[str, float]
    key_scan_gbps: Dict[str, float]
    topk_gbps: Optional[float]
    numa_nodes: Tuple[NodeSpec, ...] = ()


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
        raise MissingDataError(f"hardware profile file {text} does not exist; run `python -m hybridgen.profile --out {text}`")
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
        if val < 0 or (val == 0 and path.endswith(("gbps", "tflops"))):
            raise ConfigError(f"{where}: {path} = {val} must be positive; fix the profile")
        if not _has_source(path, sources):
            raise ConfigError(f"{where}: {path} has no entry in 'sources'; cite where the figure comes from")
    host = dict(sections["host"])
    host.setdefault("numa_nodes", [])
    for key in ("cpu_attention_gbps", "key_scan_gbps"):
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


# ------------------------------------------------------------------ model shape and workload
@dataclass(frozen=True)
class ModelShape:
    """What the model needs of an architecture. weight_bytes: bytes per weight element."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mlp_matrices: int = 3
    weight_bytes: int = 2

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "mlp_matrices", "weight_bytes"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model shape {self.name!r}: {f} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model shape {self.name!r}: num_heads must be a multiple of num_kv_heads")

    @property
    def layer_params(self) -> int:
        """Parameters of one layer's attention projections and MLP (norms and biases ignored)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + self.mlp_matrices * h * self.intermediate_size

    @classmethod
    def from_spec(cls, spec: Any, name: str = "", weight_bytes: int = 2) -> "ModelShape":
        """From an engine ModelSpec (or anything with its attribute names, or such a dict)."""
        get = (lambda k, d=None: spec.get(k, d)) if isinstance(spec, Mapping) else \
            (lambda k, d=None: getattr(spec, k, d))
        gated = get("gated_mlp", True)
        return cls(name=name or str(get("name", "") or "model"), num_layers=int(get("num_layers")),
                   hidden_size=int(get("hidden_size")), num_heads=int(get("num_heads")),
                   num_kv_heads=int(get("num_kv_heads") or get("num_heads")), head_dim=int(get("head_dim")),
                   intermediate_size=int(get("intermediate_size")), vocab_size=int(get("vocab_size")),
                   mlp_matrices=3 if gated else 2, weight_bytes=weight_bytes)

    @classmethod
    def named(cls, name: str, weight_bytes: int = 2) -> "ModelShape":
        """A shipped model config by name (``hybridgen/model/configs``)."""
        try:
            from hybridgen.model.spec import ModelSpec, list_models, shipped_config
        except ImportError as err:  # pragma: no cover - engine missing
            raise ConfigError(f"model configs unavailable ({err}); pass a ModelShape") from None
        if name not in list_models():
            raise unknown_name("model", name, list_models())
        return cls.from_spec(ModelSpec.from_hf_config(shipped_config(name), name), name, weight_bytes)


def as_model_shape(model: Union[str, ModelShape, Any]) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return ModelShape.named(model)
    return ModelShape.from_spec(model)


@dataclass(frozen=True)
class Workload:
    """One decode step's workload.

    batch, context (tokens per sequence), host_share (fraction of the context's KV on the
    host for host-KV methods), topk_ratio (hybridgen: fraction of host tokens selected),
    dtype ('bf16' | 'fp16' | 'fp32': KV and weights), budget_ratio (h2o/snapkv/streamingllm/
    quest/infinigen: fraction of the context kept or fetched), per_head (hybridgen
    selection), pipelined (hybridgen cross-layer pipelining), mapping (None = the method's
    default, else 'semantic' | 'dram' | 'cxl' | 'interleaved'), sinks, page_size (quest),
    partial_ratio (infinigen), int4_group (flexgen-int4).
    """

    batch: int = 8
    context: int = 32768
    host_share: float = 0.9
    topk_ratio: float = 0.05
    dtype: str = "bf16"
    budget_ratio: float = 0.2
    per_head: bool = False
    pipelined: bool = True
    mapping: Optional[str] = None
    sinks: int = 4
    page_size: int = 16
    partial_ratio: float = 0.2
    int4_group: int = 64

    def __post_init__(self):
        if self.batch <= 0 or self.context <= 0:
            raise ConfigError("workload: batch and context must be positive")
        for name in ("host_share", "topk_ratio", "budget_ratio", "partial_ratio"):
            val = getattr(self, name)
            if not (0.0 <= val <= 1.0):
                raise ConfigError(f"workload: {name} must be in [0, 1], got {val}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"workload: unknown dtype {self.dtype!r}; choose one of: bf16, fp16, fp32")
        if self.mapping is not None and self.mapping not in MAPPINGS:
            raise unknown_name("mapping", self.mapping, MAPPINGS)
        if self.page_size <= 0 or self.int4_group <= 0 or self.sinks < 0:
            raise ConfigError("workload: page_size and int4_group must be positive, sinks >= 0")

    @property
    def kv_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def dtype_key(self) -> str:
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)


# ------------------------------------------------------------------ predictions
@dataclass(frozen=True)
class StepPrediction:
    """A PROJECTED decode step (seconds). cpu/gpu/transfer are totals over the layers;
    attention_layer_s and layer_s are per layer; breakdown holds per-layer components and
    bytes. ``projected`` is always True: this is a model, not a measurement."""

    method: str
    profile: str
    total_s: float
    cpu_branch_s: float
    gpu_branch_s: float
    transfer_s: float
    attention_layer_s: float
    layer_s: float
    breakdown: Dict[str, float]
    fits_gpu: bool
    projected: bool = True

    def tokens_per_s(self, batch: int) -> float:
        return batch / self.total_s if self.total_s > 0 else float("inf")

    def __str__(self) -> str:
        return (f"[projected] {self.method} on {self.profile}: step {self.total_s * 1e3:.2f} ms, "
                f"attention/layer {self.attention_layer_s * 1e3:.3f} ms (cpu {self.cpu_branch_s * 1e3:.2f} ms, "
                f"gpu {self.gpu_branch_s * 1e3:.2f} ms, transfer {self.transfer_s * 1e3:.2f} ms)"
                + ("" if self.fits_gpu else " [does not fit in GPU memory]"))


@dataclass
class _Layer:
    """Per-layer costs of one method (seconds; bytes in breakdown)."""

    attn: float
    layer: float
    cpu: float = 0.0
    gpu: float = 0.0
    transfer: float = 0.0
    gpu_tokens: float = 0.0      # KV tokens resident on the GPU per layer
    staging_tokens: float = 0.0  # KV tokens of model-wide GPU staging buffers (not per layer)
    breakdown: Dict[str, float] = field(default_factory=dict)


class _Ctx:
    """Shared quantities of one prediction."""

    def __init__(self, shape: ModelShape, w: Workload, hw: HardwareProfile):
        self.shape, self.w, self.hw = shape, w, hw
        g = hw.gpu
        for fname in ("hbm_gbps", "attention_gbps", "matmul_tflops", "memory_gb"):
            if getattr(g, fname) is None:
                raise ConfigError(f"profile {hw.name!r} has no gpu.{fname} (no GPU was measured); "
                                  f"use a GPU profile: {', '.join(available_profiles())}")
        if hw.link.h2d_pinned_gbps is None:
            raise ConfigError(f"profile {hw.name!r} has no link.h2d_pinned_gbps; use a GPU profile")
        if hw.host.dram_read_gbps is None:
            raise ConfigError(f"profile {hw.name!r} has no host.dram_read_gbps; fix the profile")
        self.B, self.S = w.batch, w.context
        self.S_h = int(round(w.host_share * w.context))
        self.S_g = self.S - self.S_h
        self.Hq, self.Hkv, self.D = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.b = w.kv_bytes
        self.kv_tok = 2 * self.Hkv * self.D * self.b
        self.key_tok = self.Hkv * self.D * self.b
        self.launch = (g.launch_us or 0.0) * 1e-6
        self.link_lat = (hw.link.latency_us or 0.0) * 1e-6
        wb = shape.weight_bytes
        layer_bytes = shape.layer_params * wb
        self.rest = max(layer_bytes / (g.hbm_gbps * 1e9),
                        2 * self.B * shape.layer_params / (g.matmul_tflops * 1e12)) + REST_KERNELS * self.launch
        head_params = shape.vocab_size * shape.hidden_size
        self.head = max(head_params * wb / (g.hbm_gbps * 1e9), 2 * self.B * head_params / (g.matmul_tflops * 1e12))
        self.weights_bytes = shape.num_layers * layer_bytes + head_params * wb * 2

    # -- device primitives -------------------------------------------------------
    def gpu_attn(self, tokens: float) -> float:
        return self.B * tokens * self.kv_tok / (self.hw.gpu.attention_gbps * 1e9) + self.launch

    def copy(self, nbytes: float, src_gbps: Optional[float] = None) -> float:
        bw = self.hw.link.h2d_pinned_gbps
        if src_gbps is not None:
            bw = min(bw, src_gbps)
        return nbytes / (bw * 1e9) + self.link_lat if nbytes > 0 else 0.0

    def rate(self, table: Dict[str, float], fallback: Optional[float]) -> float:
        val = table.get(self.w.dtype_key) or table.get("bf16") or fallback
        if val is None:
            raise ConfigError(f"profile {self.hw.name!r} has no host rate for dtype {self.w.dtype_key}")
        return val

    # -- host tiers ----------------------------------------------------------------
    def tiers(self, method_default: str) -> Tuple[str, str]:
        """(key tier, value tier) of the host KV: 'dram', 'cxl' or 'interleaved'."""
        mapping = self.w.mapping or method_default
        has_cxl = self.hw.cxl is not None
        if mapping == "semantic":
            return "dram", ("cxl" if has_cxl else "dram")
        if mapping in ("cxl", "interleaved") and not has_cxl:
            return "dram", "dram"
        return mapping, mapping

    def tier_read(self, tier: str) -> float:
        dram = self.hw.host.dram_read_gbps
        if tier == "dram" or self.hw.cxl is None:
            return dram
        if tier == "cxl":
            return self.hw.cxl.read_gbps
        return 2 / (1 / dram + 1 / self.hw.cxl.read_gbps)  # pages alternate between the nodes

    def stream_time(self, nbytes: float, kernel_gbps: float, tier: str) -> float:
        """A dense host pass over nbytes on ``tier`` by a kernel that runs at kernel_gbps."""
        return nbytes / (min(kernel_gbps, self.tier_read(tier)) * 1e9)

    def gather_time(self, rows: float, row_bytes: float, tier: str) -> float:
        t = rows * row_bytes / (self.tier_read(tier) * 1e9)
        if tier in ("cxl", "interleaved") and self.hw.cxl is not None:
            share = 1.0 if tier == "cxl" else 0.5
            mlp = max(1, (self.hw.host.cores or 1) * MISSES_PER_CORE)
            t += share * rows * self.hw.cxl.added_latency_ns * 1e-9 / mlp
        return t


# ------------------------------------------------------------------ methods
def _full(c: _Ctx) -> _Layer:
    attn = c.gpu_attn(c.S)
    return _Layer(attn=attn, layer=c.rest + attn, gpu=c.rest + attn, gpu_tokens=c.S,
                  breakdown={"gpu_attn_s": attn, "rest_s": c.rest})


def _flexgen_stream(c: _Ctx, int4: bool = False) -> _Layer:
    key_tier, _ = c.tiers("dram")
    if int4:
        per_elem = 0.5 + 4.0 / c.w.int4_group  # 4-bit code + fp16 (min, scale) per group
        nbytes = c.B * c.S_h * 2 * c.Hkv * c.D * per_elem
        dequant = (nbytes + c.B * c.S_h * c.kv_tok) / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    else:
        nbytes = c.B * c.S_h * c.kv_tok
        dequant = 0.0
    xfer = c.copy(nbytes, c.tier_read(key_tier))
    gpu = c.gpu_attn(c.S) + dequant
    return _Layer(attn=xfer + gpu, layer=max(xfer, c.rest + gpu), gpu=c.rest + gpu, transfer=xfer,
                  gpu_tokens=c.S_g, staging_tokens=2 * c.S_h,  # double-buffered staging of one layer
                  breakdown={"h2d_bytes": nbytes, "transfer_s": xfer, "gpu_attn_s": gpu, "dequant_s": dequant,
                             "rest_s": c.rest})


def _cpu_attention_split(c: _Ctx, merge: bool) -> _Layer:
    key_tier, value_tier = c.tiers("dram")
    rate = c.rate(c.hw.host.cpu_attention_gbps, c.hw.host.dram_read_gbps)
    half = c.B * c.S_h * c.key_tok
    cpu_attn = c.stream_time(half, rate, key_tier) + c.stream_time(half, rate, value_tier) if c.S_h else 0.0
    small = c.B * c.Hq * c.D * c.b  # q down, out up (+ lse)
    xfer = (c.copy(small) + c.copy(small + c.B * c.Hq * 4)) if c.S_h else 0.0
    cpu = cpu_attn + xfer
    gpu_attn = c.gpu_attn(c.S_g) if c.S_g else 0.0
    attn = max(cpu, gpu_attn) + (c.launch if merge else 0.0)
    return _Layer(attn=attn, layer=c.rest + attn, cpu=cpu, gpu=c.rest + gpu_attn, transfer=xfer, gpu_tokens=c.S_g,
                  breakdown={"cpu_attn_s": cpu_attn, "transfer_s": xfer, "gpu_attn_s": gpu_attn, "rest_s": c.rest,
                             "h2d_bytes": small + c.B * c.Hq * 4, "host_kv_bytes": 2 * half})


def _hybridgen(c: _Ctx) -> _Layer:
    w, hw = c.w, c.hw
    key_tier, value_tier = c.tiers("semantic")
    k = min(c.S_h, math.ceil(w.topk_ratio * c.S_h)) if c.S_h else 0
    Hsel = c.Hq if w.per_head else c.Hkv
    scan_rate = c.rate(hw.host.key_scan_gbps, hw.host.dram_read_gbps)
    scan = c.stream_time(c.B * c.S_h * c.key_tok, scan_rate, key_tier)
    logits_bytes = c.B * c.Hq * c.S_h * 4
    topk = logits_bytes / ((hw.host.topk_gbps or hw.host.dram_read_gbps) * 1e9)
    row = c.D * c.b
    gather = c.gather_time(c.B * Hsel * k, row, value_tier)
    exact = c.gather_time(c.B * Hsel * k, row, key_tier) if w.pipelined else 0.0  # key rows, exact logits
    h2d_bytes = c.B * c.Hq * k * 4 + c.B * Hsel * k * row
    xfer = c.copy(h2d_bytes) if k else 0.0
    cpu = scan + topk + gather + exact + xfer if c.S_h else 0.0
    gpu_attn = c.gpu_attn(c.S_g) + c.B * Hsel * k * row / (hw.gpu.attention_gbps * 1e9)
    attn = max(cpu, gpu_attn)
    layer = max(cpu, c.rest + gpu_attn) if w.pipelined else c.rest + attn
    return _Layer(attn=attn, layer=layer, cpu=cpu, gpu=c.rest + gpu_attn, transfer=xfer, gpu_tokens=c.S_g,
                  staging_tokens=2 * k * (Hsel / c.Hkv),
                  breakdown={"scan_s": scan, "topk_s": topk, "gather_s": gather, "exact_logits_s": exact,
                             "transfer_s": xfer, "gpu_attn_s": gpu_attn, "rest_s": c.rest, "topk_tokens": k,
                             "h2d_bytes": h2d_bytes, "scanned_key_bytes": c.B * c.S_h * c.key_tok})


def _infinigen(c: _Ctx) -> _Layer:
    key_tier, value_tier = c.tiers("dram")
    r = c.w.budget_ratio
    fetched = r * c.S_h
    spec = c.B * c.S * c.Hkv * (c.w.partial_ratio * c.D) * c.b / (c.hw.gpu.attention_gbps * 1e9) + c.launch
    nbytes = c.B * fetched * c.kv_tok
    gather = c.gather_time(c.B * c.Hkv * fetched, 2 * c.D * c.b, value_tier)
    xfer = c.copy(nbytes)
    fetch = gather + xfer
    gpu = spec + c.gpu_attn(c.S_g + fetched)
    return _Layer(attn=fetch + gpu, layer=max(fetch, c.rest + gpu), cpu=gather, gpu=c.rest + gpu, transfer=xfer,
                  gpu_tokens=c.S_g + c.w.partial_ratio * c.S / 2, staging_tokens=2 * fetched,
                  breakdown={"speculation_s": spec, "gather_s": gather, "transfer_s": xfer, "gpu_attn_s": gpu - spec,
                             "rest_s": c.rest, "h2d_bytes": nbytes})


def _gpu_only(c: _Ctx, tokens: float, extra: float = 0.0, resident: Optional[float] = None) -> _Layer:
    attn = c.gpu_attn(tokens) + extra
    return _Layer(attn=attn, layer=c.rest + attn, gpu=c.rest + attn,
                  gpu_tokens=tokens if resident is None else resident,
                  breakdown={"gpu_attn_s": attn, "kept_tokens": tokens, "rest_s": c.rest})


def _h2o(c: _Ctx) -> _Layer:
    n = c.w.budget_ratio * c.S
    score = c.B * c.Hq * n * 4 * 2 / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    return _gpu_only(c, n, score)


def _snapkv(c: _Ctx) -> _Layer:
    return _gpu_only(c, c.w.budget_ratio * c.S)


def _streamingllm(c: _Ctx) -> _Layer:
    return _gpu_only(c, min(c.S, max(c.w.budget_ratio * c.S, c.w.sinks)))


def _quest(c: _Ctx) -> _Layer:
    pages = math.ceil(c.S / c.w.page_size)
    bounds = c.B * c.Hkv * pages * 2 * c.D * c.b / (c.hw.gpu.attention_gbps * 1e9) + c.launch
    return _gpu_only(c, c.w.budget_ratio * c.S, bounds, resident=c.S + 2 * pages)


METHODS: Dict[str, Callable[[_Ctx], _Layer]] = {
    "full": _full,
    "hybrid-exact": lambda c: _cpu_attention_split(c, merge=True),
    "hybridgen": _hybridgen,
    "flexgen": _flexgen_stream,
    "flexgen-stream": _flexgen_stream,
    "flexgen-cpu": lambda c: _cpu_attention_split(c, merge=True),
    "flexgen-int4": lambda c: _flexgen_stream(c, int4=True),
    "infinigen": _infinigen,
    "h2o": _h2o,
    "snapkv": _snapkv,
    "streamingllm": _streamingllm,
    "quest": _quest,
}


def predict_step(method_name: str, model: Union[str, ModelShape, Any], workload: Workload,
                 profile: Union[str, Path, HardwareProfile]) -> StepPrediction:
    """PROJECTED time of one decode step of ``method_name`` (see the module docstring).

    model: a ModelShape, an engine ModelSpec or a shipped model name; profile: a profile
    name, a profile JSON path, or a HardwareProfile.
    """
    if method_name not in METHODS:
        raise unknown_name("method for the performance model", method_name, METHODS)
    shape = as_model_shape(model)
    hw = load_profile(profile)
    c = _Ctx(shape, workload, hw)
    lay = METHODS[method_name](c)
    L = shape.num_layers
    gpu_bytes = c.weights_bytes + (L * lay.gpu_tokens + lay.staging_tokens) * c.B * c.kv_tok
    breakdown = dict(lay.breakdown)
    breakdown.update({"lm_head_s": c.head, "gpu_resident_bytes": gpu_bytes, "layers": L})
    return StepPrediction(method=method_name, profile=hw.name, total_s=L * lay.layer + c.head,
                          cpu_branch_s=L * lay.cpu, gpu_branch_s=L * lay.gpu + c.head, transfer_s=L * lay.transfer,
                          attention_layer_s=lay.attn, layer_s=lay.layer, breakdown=breakdown,
                          fits_gpu=gpu_bytes <= hw.gpu.memory_gb * 1e9)


# ------------------------------------------------------------------ prediction error
@dataclass(frozen=True)
class ErrorRow:
    key: str
    predicted_s: float
    measured_s: float

    @property
    def error_pct(self) -> float:
        """(predicted - measured) / measured, in percent (positive: the model is pessimistic)."""
        return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s else float("nan")


@dataclass(frozen=True)
class ErrorTable:
    """Projected vs measured times. missing: keys present on one side only."""

    rows: Tuple[ErrorRow, ...]
    missing: Tuple[str, ...]
    field: str

    @property
    def mean_abs_error_pct(self) -> float:
        errs = [abs(r.error_pct) for r in self.rows if math.isfinite(r.error_pct)]
        return sum(errs) / len(errs) if errs else float("nan")

    def to_markdown(self) -> str:
        lines = [f"| key | projected {self.field} (ms) | measured (ms) | error |", "|---|---:|---:|---:|"]
        for r in self.rows:
            lines.append(f"| {r.key} | {r.predicted_s * 1e3:.3f} | {r.measured_s * 1e3:.3f} | {r.error_pct:+.1f}% |")
        lines.append(f"| mean absolute error | | | {self.mean_abs_error_pct:.1f}% |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"prediction error (projected vs measured, {self.field})\n" + self.to_markdown()


def compare_to_measured(predictions: Mapping[str, Union[StepPrediction, float]], measurements: Mapping[str, float],
                        field: str = "attention_layer_s") -> ErrorTable:
    """Prediction error per key present in both mappings (seconds).

    predictions: key -> StepPrediction (its ``field`` is compared) or a float; measurements:
    key -> measured seconds (None or non-finite values are treated as missing).
    """
    rows, missing = [], []
    for key in sorted(set(predictions) | set(measurements), key=str):
        pred, meas = predictions.get(key), measurements.get(key)
        if isinstance(pred, StepPrediction):
            pred = getattr(pred, field)
        if pred is None or meas is None or not math.isfinite(float(meas)) or not math.isfinite(float(pred)):
            missing.append(str(key))
            continue
        rows.append(ErrorRow(str(key), float(pred), float(meas)))
    return ErrorTable(tuple(rows), tuple(missing), field)
