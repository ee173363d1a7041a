"""What a run point is: its method (with the placement derived from memory.gpu_kv), its
identity and its run name (hybridgen_harness.results names the directory from these).

Shared by the runner (experiments/runner.py), the preflight check and the validation of a
sweep's points (experiments/validate.py).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from hybridgen_harness.results import hardware_part, run_name


def placement(cfg: DictConfig) -> Optional[Any]:
    """The point's :class:`hybridgen.methods.placement.Placement`: memory.gpu_kv resolved ONCE
    (GPU KV bytes, the method's derived parameters, the store's tier capacities), or None when
    memory.gpu_kv is unset. A bad budget raises; a method that cannot fit raises too, except
    for exp.kind=project, whose record carries the refusal ('does not fit')."""
    gpu_kv = OmegaConf.select(cfg, "memory.gpu_kv", default=None)
    if gpu_kv is None:
        return None
    node = lambda n: json.dumps(OmegaConf.to_container(cfg[n], resolve=True), sort_keys=True, default=str)  # noqa: E731
    params = OmegaConf.to_container(cfg.method.params, resolve=True) or {}
    return _placement(cfg.method.name, json.dumps(params, sort_keys=True, default=str), str(gpu_kv),
                      node("hardware"), node("model"), node("workload"), cfg.exp.kind == "project")


@functools.lru_cache(maxsize=64)
def _placement(name: str, params: str, gpu_kv: str, hardware: str, model: str, workload: str, project: bool):
    from hybridgen.methods.placement import resolve_placement

    return resolve_placement(name, json.loads(params), gpu_kv, json.loads(hardware), json.loads(model),
                             json.loads(workload), accept_refusal=project)


def method_params(cfg: DictConfig) -> Dict[str, Any]:
    """The point's method parameters: method.params, plus the placement derived from
    memory.gpu_kv when it is set (explicit params win; :func:`placement`)."""
    p = placement(cfg)
    if p is None:
        return OmegaConf.to_container(cfg.method.params, resolve=True) or {}
    return dict(p.params)


def placement_refusal(cfg: DictConfig) -> Optional[str]:
    """exp.kind=project with memory.gpu_kv: the one line of a placement that cannot fit the budget
    (e.g. full's whole KV on a 32 GB GPU), else None. A projection records it as 'does not fit'
    instead of refusing the whole sweep; a bad budget text still raises, and so does every refusal
    of a run that would execute (kind=generate / accuracy)."""
    p = placement(cfg)
    return None if p is None else p.refusal


def store_capacities(cfg: DictConfig, engine=None) -> Dict[str, Optional[int]]:
    """Bytes per tier of the run's store: the placement's (gpu = memory.gpu_kv, so the tier
    ledger enforces the budget) when memory.gpu_kv is set, else the hardware node's."""
    p = placement(cfg)
    if p is not None:
        return dict(p.capacities)
    from hybridgen.eval.generation import resolve_capacities

    return resolve_capacities(OmegaConf.to_container(cfg.hardware, resolve=True), engine)


def build(cfg: DictConfig):
    """The point's method instance, built once per point (naming, running and projecting share it;
    ``bind`` resets its state for each generation)."""
    return _build(cfg.method.name, json.dumps(method_params(cfg), sort_keys=True, default=str))


@functools.lru_cache(maxsize=1)
def _build(name: str, params_json: str):
    from hybridgen.methods import build_method

    return build_method(name, **json.loads(params_json))


@functools.lru_cache(maxsize=None)
def _defaults(name: str) -> Dict[str, Any]:
    from hybridgen.methods import build_method

    return build_method(name).config()


def key_params(cfg: DictConfig) -> Dict[str, Any]:
    """Parameters shown in the run name: those differing from the method's defaults, and budgets."""
    full, defaults = build(cfg).config(), _defaults(cfg.method.name)
    return {k: v for k, v in full.items() if v != defaults.get(k) or k == "budget" or k.endswith("_budget")}


def identity(cfg: DictConfig) -> Dict[str, Any]:
    """Everything that identifies a run (its hash names the directory)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    hw = {k: v for k, v in c["hardware"].items() if k not in ("description",)}
    ident = {"model": c["model"], "method": {"name": cfg.method.name, "params": build(cfg).config()},
             "hardware": hw, "seed": c["seed"],
             "exp": {k: c["exp"][k] for k in ("kind", "fidelity", "reference", "repeats", "warmup")},
             "realized": realized(cfg)}
    if cfg.exp.kind == "accuracy":
        ident["accuracy"] = c["exp"]["accuracy"]
    else:
        ident["workload"] = c["workload"]
    return ident


def realized(cfg: DictConfig) -> Dict[str, Any]:
    """What the point's numbers come from beyond its config (part of its identity and name):
    the realized device (CUDA device name or 'cpu-emulated'; 'projected' for kind=project,
    which measures nothing), the dtype and the number of layers actually run."""
    from hybridgen.eval.provenance import realized_device
    from hybridgen.model import model_spec

    layers = int(cfg.model.num_layers) if cfg.model.num_layers else model_spec(cfg.model.name).num_layers
    device = "projected" if cfg.exp.kind == "project" else realized_device()
    return {"device": device, "dtype": str(cfg.model.dtype), "num_layers": layers}


def name_of(cfg: DictConfig) -> str:
    w = cfg.workload
    extra = ""
    r = realized(cfg)
    hw = hardware_part(r["device"], r["dtype"], r["num_layers"])
    if cfg.exp.kind == "accuracy":
        a = cfg.exp.accuracy
        extra = f"acc{len(a.tasks)}t-l{a.limit if a.limit is not None else 'all'}-f{a.num_fewshot}-{a.score_mode}"
        return run_name(cfg.model.name, cfg.model.weights, cfg.method.name, key_params(cfg), 0, 0, 0, "tasks",
                        cfg.seed, identity(cfg), extra=extra, hardware=hw).replace("__b0-p0-g0-tasks", "")
    return run_name(cfg.model.name, cfg.model.weights, cfg.method.name, key_params(cfg), w.batch,
                    w.prompt_len, w.gen_len, w.source, cfg.seed, identity(cfg), hardware=hw)
