"""One GPU memory budget drives every method's placement.

A comparison names the GPU memory available to the KV cache (``gpu_kv``: bytes, '20GiB', or
'auto' = the hardware's ``gpu_memory x gpu_kv_fraction`` minus the model weights) and the
workload's shape (:class:`KVShape`); each method derives its own placement parameters from it
(:meth:`hybridgen.methods.KVMethod.placement_for`): the gpu share of full / hybrid-exact /
hybridgen / flexgen (``gpu_budget``), an evicting method's ``offload`` (resident when its kept
KV fits, else streamed, else attended on the CPU), InfiniGen's (all on the host; refused when
its partial keys do not fit). Parameters the user sets explicitly win (:func:`place`).

Everything a method allocates on the gpu tier counts against the budget (KV, staging buffers,
per-token metadata, masks), so a run whose gpu tier capacity is the budget never overflows
(tests/test_placement.py checks the tier ledger after real runs).

Shapes: ``token_bytes`` = K+V bytes of one token of one sequence in one layer (+ one mask byte
per KV head, ``mask_bytes``).

One run point resolves ``memory.gpu_kv`` ONCE into a :class:`Placement` (:func:`resolve_placement`):
the GPU bytes of the KV, the workload's shape, the method's parameters and the store's tier
capacities; the store, the run identity (through the parameters) and the projection read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

from hybridgen.errors import ConfigError, HybridGenError

# The shape and the footprint live in footprint.py; re-exported here for existing callers.
from hybridgen.methods.footprint import DTYPE_BYTES, Footprint, KVShape, fit_first, fit_share, refuse  # noqa: E402,F401


def is_auto(value: Any) -> bool:
    """Whether a size setting is 'auto' (the GPU's memory x fraction minus the weights)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def auto_gpu_kv(hardware: Optional[Mapping[str, Any]], weights_bytes: int, field: str = "memory.gpu_kv") -> int:
    """The one 'auto' formula: ``hardware['gpu_memory'] x hardware['gpu_kv_fraction']`` (0.9 by
    default) minus ``weights_bytes`` (the rest of the fraction is the engine's workspace);
    refused in one line, naming ``field``, without gpu_memory or when the weights leave nothing."""
    from hybridgen.kv.tiers import parse_bytes

    hw = dict(hardware or {})
    mem = parse_bytes(hw.get("gpu_memory"))
    if mem is None:
        raise ConfigError(f"{field}=auto needs hardware.gpu_memory (hardware {hw.get('name', '?')!r} "
                          f"has none); set {field} to a size such as 20GiB")
    frac = float(hw.get("gpu_kv_fraction", 0.9))
    out = int(mem * frac) - int(weights_bytes)
    if out <= 0:
        raise ConfigError(f"{field}=auto: the weights ({weights_bytes / 2**30:.2f} GiB) leave no KV "
                          f"space in {mem * frac / 2**30:.2f} GiB of GPU memory")
    return out


def gpu_kv_bytes(gpu_kv: Union[None, int, float, str], hardware: Optional[Mapping[str, Any]] = None,
                 weights_bytes: int = 0) -> int:
    """The GPU bytes available to the KV cache: ``gpu_kv`` as a size ('20GiB', bytes), or
    'auto' (:func:`auto_gpu_kv`). Refuses 0, negative, malformed sizes and an 'auto' budget the
    weights leave nothing of, in one line."""
    from hybridgen.kv.tiers import parse_bytes

    if is_auto(gpu_kv):
        return auto_gpu_kv(hardware, weights_bytes)
    if gpu_kv is None or isinstance(gpu_kv, bool):
        raise ConfigError(f"memory.gpu_kv expects a size such as '20GiB' or 'auto', got {gpu_kv!r}")
    try:
        n = parse_bytes(gpu_kv)
    except ConfigError as err:
        raise ConfigError(f"memory.gpu_kv: {err}") from None
    if n is None or n <= 0:
        raise ConfigError(f"memory.gpu_kv must be a positive size such as '20GiB' or 'auto', got {gpu_kv!r}")
    return n


def gpu_share(gpu_kv: int, shape: KVShape, per_layer_spare: int = 0, staging_layers: int = 0,
              stage_host: bool = False) -> int:
    """Tokens per sequence per layer a gpu share may hold: L layers of (tokens + per_layer_spare)
    plus ``staging_layers`` layer-sized staging slots of the host part (``stage_host``) fit."""
    L, T, X = shape.layers, shape.context, shape.batch * (shape.token_bytes + shape.mask_bytes)
    if stage_host and staging_layers:
        # L*(n + spare)*X + staging_layers*(T - n)*X <= G  ->  n <= (G/X - L*spare - s*T) / (L - s)
        if L <= staging_layers:
            return T if L * (T + per_layer_spare) * X <= gpu_kv else 0
        n = (gpu_kv / X - L * per_layer_spare - staging_layers * T) / (L - staging_layers)
    else:
        n = gpu_kv / (L * X) - per_layer_spare
    return max(0, min(T, int(n)))


def as_budget(tokens: int) -> Union[float, str]:
    """A gpu share in tokens as a budget value: 0.0 (nothing on the GPU) or 'Nt'."""
    return 0.0 if tokens <= 0 else f"{int(tokens)}t"


def place(method: Any, gpu_kv: int, shape: KVShape, explicit: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The parameters of ``method`` (a registry name) under a GPU KV budget of ``gpu_kv`` bytes:
    its own derived placement (:meth:`KVMethod.placement_for`) with the ``explicit`` parameters
    on top (they win). A method without a placement, or that cannot fit (as derived, or with the
    explicit parameters on top: e.g. a three-way stream asked for whose slots the placement would
    turn off), fails in one line."""
    from hybridgen.methods.registry import build_method

    explicit = dict(explicit or {})
    m = build_method(method, **explicit)
    derived = m.placement_for(int(gpu_kv), shape)
    if derived is None:
        raise ConfigError(f"method {method!r} cannot derive its placement from memory.gpu_kv (it has no "
                          f"placement_for); unset memory.gpu_kv or give its placement parameters")
    placed = {**derived, **explicit}
    if placed != derived:
        fp = build_method(method, **placed).footprint(shape)
        if fp is not None and not fp.fits(int(gpu_kv)):
            raise refuse(method, fp.gpu_bytes, int(gpu_kv), "its configuration with " +
                         ", ".join(f"{k}={v}" for k, v in sorted(explicit.items())))
    return placed


def store_capacities(hardware: Mapping[str, Any], gpu: Optional[int]) -> Dict[str, Optional[int]]:
    """Bytes per store tier: ``gpu`` as given, dram / cxl from hardware.dram_capacity /
    cxl_capacity (None = unlimited)."""
    from hybridgen.kv.tiers import parse_bytes

    return {"gpu": gpu, "dram": parse_bytes(hardware.get("dram_capacity")),
            "cxl": parse_bytes(hardware.get("cxl_capacity"))}


def check_host_capacity(method: Any, shape: KVShape, hardware: Mapping[str, Any]) -> None:
    """Refuse in one line (before any model loads) a run whose ``method`` (built, its placement
    applied) holds more host bytes on ``shape`` than hardware.dram_capacity + cxl_capacity: the
    store puts DRAM first and spills the rest to CXL (``TieredStore(spill=True)``), the rule of
    :func:`hybridgen.perf.host_tiers.split_host_bytes`. A method without a footprint passes."""
    from hybridgen.kv.tiers import _fmt
    from hybridgen.perf.host_tiers import split_host_bytes

    footprint = getattr(method, "footprint", None)
    fp = footprint(shape) if callable(footprint) else None
    if fp is None:
        return
    caps = store_capacities(hardware, None)
    tiers = split_host_bytes(fp.tier_bytes.get("dram", 0), fp.tier_bytes.get("cxl", 0), caps["dram"], caps["cxl"])
    if not tiers.fits:
        dram, cxl = caps["dram"] or 0, caps["cxl"] or 0
        raise ConfigError(f"method {getattr(method, 'name', method)!r} needs {_fmt(int(fp.host_bytes))} of host memory "
                          f"for this workload, hardware.dram_capacity ({_fmt(dram)}) + hardware.cxl_capacity "
                          f"({_fmt(cxl)}) hold {_fmt(dram + cxl)}; raise hardware.dram_capacity or "
                          f"hardware.cxl_capacity, or lower workload.batch / prompt_len / gen_len")


def run_kv_shape(model: Mapping[str, Any], workload: Mapping[str, Any]) -> KVShape:
    """The KVShape of a run config's model and workload nodes (left-padded batch: masked)."""
    from hybridgen.shapes import ModelShape

    dtype = str(model.get("dtype", "float32"))
    b = DTYPE_BYTES.get(dtype)
    if b is None:
        raise ConfigError(f"unknown model dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
    ms = ModelShape.named(str(model.get("name")), weight_bytes=b)
    layers = int(model.get("num_layers") or ms.num_layers)
    return KVShape(layers, ms.num_kv_heads, ms.head_dim, b, int(workload.get("batch", 1)),
                   int(workload.get("prompt_len")) + int(workload.get("gen_len")), int(workload.get("gen_len")))


@dataclass(frozen=True)
class Placement:
    """``memory.gpu_kv`` resolved once for one run point (:func:`resolve_placement`).

    gpu_kv_bytes: the GPU bytes of the KV cache; shape: the workload's KVShape; params: the
    method's parameters (its derived placement, the explicit ones on top); capacities: the
    store's bytes per tier (gpu = gpu_kv_bytes, so the tier ledger enforces the budget);
    refusal: the one line of a method that cannot fit (only where the caller accepts it:
    a projection records 'does not fit'), with params then the explicit ones.
    """

    gpu_kv_bytes: int
    shape: KVShape
    params: Mapping[str, Any]
    capacities: Mapping[str, Optional[int]]
    refusal: Optional[str] = None


def resolve_placement(method: str, explicit: Mapping[str, Any], gpu_kv: Union[int, str], hardware: Mapping[str, Any],
                      model: Mapping[str, Any], workload: Mapping[str, Any], accept_refusal: bool = False) -> Placement:
    """The :class:`Placement` of a run config's nodes (before any model loads).

    hardware / model / workload: the run config's nodes (model: name, dtype, num_layers;
    workload: batch, prompt_len, gen_len). 'auto' subtracts the model's weights (from its
    shipped config) from gpu_memory x gpu_kv_fraction. Explicit ``method.params`` win. A bad
    budget always raises; a method that cannot fit raises unless ``accept_refusal``.
    """
    g, shape = budget_and_shape(gpu_kv, hardware, model, workload)
    caps = store_capacities(hardware, g)
    try:
        params = place(method, g, shape, explicit)
    except HybridGenError as err:
        if not accept_refusal:
            raise
        return Placement(g, shape, dict(explicit), caps, refusal=str(err))
    return Placement(g, shape, params, caps)


def derive_params(method: str, explicit: Mapping[str, Any], gpu_kv: Union[int, str], hardware: Mapping[str, Any],
                  model: Mapping[str, Any], workload: Mapping[str, Any]) -> Dict[str, Any]:
    """An experiment point's method parameters under ``memory.gpu_kv`` (:func:`resolve_placement`)."""
    return dict(resolve_placement(method, explicit, gpu_kv, hardware, model, workload).params)


def budget_and_shape(gpu_kv: Union[int, str], hardware: Mapping[str, Any], model: Mapping[str, Any],
                     workload: Mapping[str, Any]):
    """(GPU KV bytes, KVShape) of a run config's nodes (see :func:`resolve_placement`)."""
    from hybridgen.shapes import ModelShape

    shape = run_kv_shape(model, workload)
    ms = ModelShape.named(str(model.get("name")), weight_bytes=shape.dtype_bytes)
    g = gpu_kv_bytes(gpu_kv, hardware, ms.weights_bytes(shape.layers))
    return g, shape
