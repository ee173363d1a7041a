"""The checks of one run config, and one-line messages for what Hydra rejects.

:func:`validate` checks what a schema type cannot (choices, ranges, the method's own parameter
dataclass, datasets and checkpoints on disk); :func:`friendly_error` turns a Hydra/OmegaConf
composition error into one line. ``experiments/preflight.py`` applies both to every point of a
sweep before the first one runs.
"""
from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from experiments.locations import CONF_DIR
from hybridgen.errors import ConfigError, HybridGenError


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def method_param_overrides(overrides: Sequence[str]) -> List[str]:
    """``method.params.X=V`` rewritten as ``++method.params.X=V`` (set whether or not the YAML has X).

    A method's YAML names only what it overrides, so most parameters are not keys of
    ``method.params`` until the user sets them; the method's dataclass checks the name and value.
    """
    return ["++" + o if o.startswith("method.params.") else o for o in overrides]


def to_run_config(cfg: DictConfig) -> DictConfig:
    """Drop the hydra node and resolve interpolations: the config a run records."""
    c = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    c = OmegaConf.create(OmegaConf.to_container(c, resolve=True))
    return c


def validate(cfg: DictConfig) -> None:
    """Values a schema type cannot check; one-line ConfigError naming the fix."""
    from experiments import schema
    from hybridgen.methods import build_method

    def choice(path: str, allowed: Sequence[str]) -> None:
        val = OmegaConf.select(cfg, path)
        if val not in allowed:
            raise ConfigError(f"{path}={val!r} is not valid; choose one of: {', '.join(allowed)}")

    choice("model.weights", schema.WEIGHTS)
    choice("model.dtype", schema.DTYPES)
    choice("model.backend", schema.BACKENDS)
    choice("workload.source", schema.SOURCES)
    choice("exp.kind", schema.KINDS)
    choice("exp.accuracy.score_mode", ("decode", "prefill"))
    from experiments.field_checks import check_fields

    check_fields(cfg)  # every number through its kind's parser, the field named
    _check_numa_nodes(cfg.hardware)
    if cfg.exp.kind == "accuracy" and not cfg.exp.accuracy.tasks:
        raise ConfigError("exp.kind=accuracy needs exp.accuracy.tasks (e.g. exp.accuracy.tasks=[hg_bigbench_social_iqa])")
    from experiments.point import method_params

    method = build_method(cfg.method.name, **method_params(cfg))
    if cfg.exp.kind == "project" and not cfg.hardware.profile:
        raise ConfigError("exp.kind=project needs a hardware profile (e.g. hardware=h100)")
    if cfg.exp.kind != "project":
        from hybridgen.model.loading import check_checkpoint

        check_checkpoint(cfg.model.name, cfg.model.weights)  # a damaged cache or checkpoint: one line, now
    from experiments.model_checks import check_against_model

    check_against_model(cfg, method)  # layers, dense layers, windows against the model (refuse or warn)
    if cfg.exp.kind == "accuracy":
        from hybridgen.eval.tasks_data import check_tasks

        check_tasks(list(cfg.exp.accuracy.tasks))
    elif cfg.exp.kind == "generate":
        from hybridgen.data.sources import check_available
        from hybridgen.model import model_spec

        check_available(cfg.workload.source)
        w, positions = cfg.workload, model_spec(cfg.model.name).max_positions
        if int(w.prompt_len) + int(w.gen_len) > positions:
            raise ConfigError(f"workload.prompt_len={w.prompt_len} + workload.gen_len={w.gen_len} exceeds "
                              f"{cfg.model.name}'s {positions} positions; shorten the prompt or the generation")
        from hybridgen.methods.placement import check_host_capacity, run_kv_shape

        # the store's host tiers (DRAM, spilling to CXL) must hold the method's host bytes
        check_host_capacity(method, run_kv_shape(cfg.model, cfg.workload), cfg.hardware)
    if cfg.exp.fidelity or (cfg.exp.kind == "accuracy" and cfg.exp.accuracy.fidelity):
        reference_method(cfg.exp.reference)


def _check_numa_nodes(hw) -> None:
    """hardware.cxl_node: 'auto', null or an existing NUMA node; hardware.dram_node: null or an existing node."""
    from hybridgen.kv import numa

    nodes = sorted(n.node for n in numa.numa_nodes())
    for key, allowed in (("cxl_node", "auto, null"), ("dram_node", "null")):
        val = hw.get(key)
        if val is None or (key == "cxl_node" and val == "auto"):
            continue
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ConfigError(f"hardware.{key}={val!r} is not valid; use {allowed} or a NUMA node number "
                              f"(this machine has: {', '.join(map(str, nodes))})")
        if val not in nodes:
            raise ConfigError(f"hardware.{key}={val} is not a NUMA node of this machine (nodes: "
                              f"{', '.join(map(str, nodes))}); use {allowed} or one of those")


def reference_method(name: str) -> Tuple[str, Dict]:
    """(method name, params) of the fidelity reference ``name``: a conf/method preset or a method name."""
    from hybridgen.methods import build_method

    preset = CONF_DIR / "method" / f"{name}.yaml"
    if preset.exists():
        conf = OmegaConf.load(preset)
        params = conf.get("params")
        method, params = str(conf.name), (OmegaConf.to_container(params, resolve=True) if params else {})
    else:
        method, params = name, {}
    build_method(method, **params)  # unknown name or bad preset: one line
    return method, params


def friendly_error(err: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for a Hydra/OmegaConf composition error (unknown key, unknown option, bad type)."""
    if isinstance(err, HybridGenError):
        return str(err)
    text = str(err)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    m = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        return f"unknown {group} {option!r}; choose one of: {', '.join(group_options(group))}"
    cause = err.__cause__ or err.__context__
    full_key = None
    for e in (cause, err):
        fk = getattr(e, "full_key", None)
        if fk:
            full_key = str(fk)
            break
    ctext = str(cause) if cause is not None else ""
    m = re.search(r"Could not override '([^']+)'", text)
    key = full_key or (m.group(1) if m else None)
    if key and key.startswith("method.params.") and ("not in" in ctext or m):
        return _method_param_error(key.split(".", 2)[2], overrides)
    append = re.search(r"To append to your default list use (\S+)", text)
    if key and append:  # e.g. exp=quickstart: a config group with no default to override; keep Hydra's hint
        return (f"config group '{key}' has no default to override (unknown config key '{key}' without '+'); "
                f"to append to your default list use {append.group(1)}")
    if key and ("not in" in ctext or "not in struct" in text or m):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        valid = _valid_keys(parent)
        hint = f"; valid keys under '{parent or '<root>'}': {', '.join(valid)}" if valid else ""
        return f"unknown config key '{key}'{hint}"
    m = re.search(r"Value '([^']*)' of type '\w+' could not be converted to (\w+)", ctext)
    if m:
        return f"'{full_key}={m.group(1)}' must be of type {m.group(2).lower()}"
    if cause is not None and ctext.strip():
        first = ctext.strip().splitlines()[0]
        return f"{lines[0] if lines else type(err).__name__}: {first}"
    return " | ".join(lines[:3]) if lines else type(err).__name__


def group_options(group: str) -> List[str]:
    """The options of a config group on Hydra's search path (``--config-dir`` and
    ``hydra.searchpath`` included while Hydra runs), else those under conf/ (and, for ``method``,
    every registered method)."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        try:
            return sorted(GlobalHydra.instance().config_loader().get_group_options(group))
        except Exception:  # noqa: BLE001 - a listing is a hint only
            pass
    names = {p.stem for p in (CONF_DIR / group).glob("*.yaml")} if (CONF_DIR / group).is_dir() else set()
    if group == "method":  # experiments.schema.register_method_options adds them while Hydra runs
        from hybridgen.methods import available_methods

        names |= set(available_methods())
    return sorted(names)


def _method_param_error(param: str, overrides: Sequence[str]) -> str:
    """The registry's own one-line message for an unknown method parameter."""
    from hybridgen.methods import build_method

    method = "full"
    for o in overrides:
        k, _, v = o.lstrip("+~").partition("=")
        if k == "method":
            method = v
    yaml = CONF_DIR / "method" / f"{method}.yaml"
    name = OmegaConf.load(yaml).get("name", method) if yaml.exists() else method
    try:
        build_method(name, **{param: None})
    except HybridGenError as err:
        return str(err)
    return f"unknown method parameter '{param}'"


def _valid_keys(parent: str) -> List[str]:
    from experiments.schema import RunConfig

    node = OmegaConf.structured(RunConfig)
    sub = OmegaConf.select(node, parent) if parent else node
    if isinstance(sub, DictConfig) and OmegaConf.get_type(sub) is not dict:
        return sorted(str(k) for k in sub.keys())
    return []
