"""Compose run configs from conf/ and expand an experiment's sweep into points.

An experiment declares its sweep once, as ``hydra.sweeper.params`` in its conf/exp file.
``python experiments/run.py +exp=X`` expands it here and runs every point in one process
(the model loads once); ``-m`` hands the same sweep to Hydra's sweeper and launcher (one job
per point). Command-line sweeps (``key=a,b``) join the product; a key given on the command
line replaces the experiment's sweep of that key.

Every point is composed and validated before anything runs, so a misspelt key, an unknown
method or parameter, or a bad value fails at start with one line (:func:`friendly_error`).
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from hybridgen.errors import ConfigError, HybridGenError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, List[str]]]:
    """(plain overrides, {key: [values]} of sweep overrides like ``method=full,h2o``)."""
    plain, sweeps = [], {}
    parser = _parser()
    for text in overrides:
        try:
            ov = parser.parse_overrides([text])[0]
        except Exception as err:  # hydra's OverrideParseException
            raise ConfigError(f"cannot parse override {text!r}: {_first_line(err)}") from None
        if ov.is_sweep_override():
            sweeps[_key_text(ov)] = list(ov.sweep_string_iterator())
        else:
            plain.append(text)
    return plain, sweeps


def _key_text(ov) -> str:
    return ov.get_key_element()


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _bare(key: str) -> str:
    return key.lstrip("+~")


def method_param_overrides(overrides: Sequence[str]) -> List[str]:
    """``method.params.X=V`` rewritten as ``++method.params.X=V`` (set whether or not the YAML has X).

    A method's YAML names only what it overrides, so most parameters are not keys of
    ``method.params`` until the user sets them; the method's dataclass checks the name and value.
    """
    return ["++" + o if o.startswith("method.params.") else o for o in overrides]


def compose(overrides: Sequence[str]) -> DictConfig:
    """The run config (with its ``hydra`` node) for ``overrides``; needs an initialised Hydra."""
    from hydra import compose as hydra_compose

    from experiments.schema import register_configs

    register_configs()
    return hydra_compose(config_name="config", overrides=method_param_overrides(overrides),
                         return_hydra_config=True)


def expand(overrides: Sequence[str]) -> List[List[str]]:
    """Every point of the sweep as a list of plain overrides (needs an initialised Hydra)."""
    plain, cli_sweeps = split_overrides(overrides)
    base = compose(plain + [f"{k}={v[0]}" for k, v in cli_sweeps.items()])
    exp_sweeps: Dict[str, List[str]] = {}
    params = OmegaConf.select(base, "hydra.sweeper.params") or {}
    cli_keys = {_bare(k) for k in cli_sweeps} | {_bare(_parser().parse_overrides([p])[0].get_key_element())
                                                 for p in plain}
    for key, val in params.items():
        if _bare(key) in cli_keys:
            continue
        _, sw = split_overrides([f"{key}={val}"])
        exp_sweeps[key] = sw.get(key, [str(val)])
    sweeps = {**exp_sweeps, **cli_sweeps}
    if not sweeps:
        return [list(plain)]
    keys = list(sweeps)
    return [list(plain) + [f"{k}={v}" for k, v in zip(keys, combo)]
            for combo in itertools.product(*(sweeps[k] for k in keys))]


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
    choice("workload.source", schema.SOURCES)
    choice("exp.kind", schema.KINDS)
    choice("exp.accuracy.score_mode", ("decode", "prefill"))
    for path in ("workload.batch", "workload.prompt_len", "workload.gen_len", "exp.repeats"):
        if int(OmegaConf.select(cfg, path)) < 1:
            raise ConfigError(f"{path} must be >= 1, got {OmegaConf.select(cfg, path)}")
    if cfg.model.num_layers is not None and cfg.model.num_layers < 1:
        raise ConfigError(f"model.num_layers must be >= 1 or null, got {cfg.model.num_layers}")
    if cfg.hardware.threads is not None and int(cfg.hardware.threads) < 1:
        raise ConfigError(f"hardware.threads must be >= 1 (torch CPU threads) or null, got {cfg.hardware.threads}")
    _check_numa_nodes(cfg.hardware)
    if cfg.exp.kind == "accuracy" and not cfg.exp.accuracy.tasks:
        raise ConfigError("exp.kind=accuracy needs exp.accuracy.tasks (e.g. exp.accuracy.tasks=[hg_bigbench_social_iqa])")
    params = OmegaConf.to_container(cfg.method.params, resolve=True) or {}
    build_method(cfg.method.name, **params)
    if cfg.exp.kind == "project" and not cfg.hardware.profile:
        raise ConfigError("exp.kind=project needs a hardware profile (e.g. hardware=h100)")
    if cfg.exp.kind != "project":
        from hybridgen.model.loading import check_checkpoint

        check_checkpoint(cfg.model.name, cfg.model.weights)  # a damaged cache or checkpoint: one line, now
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
        avail = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) if (CONF_DIR / group).is_dir() else []
        return f"unknown {group} {option!r}; choose one of: {', '.join(avail)}"
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


def _point_label(pt: Sequence[str], points: Sequence[Sequence[str]]) -> str:
    """The overrides that make ``pt`` differ from the other points of the sweep."""
    shared = set(points[0]).intersection(*map(set, points[1:]))
    return " ".join(o for o in pt if o not in shared) or " ".join(pt)


def resolve_points(overrides: Sequence[str]) -> List[Tuple[List[str], DictConfig]]:
    """Compose and validate every point; raises ConfigError with one line on the first bad one."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    out = []
    ctx = None
    if not GlobalHydra.instance().is_initialized():
        ctx = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="run")
        ctx.__enter__()
    try:
        try:
            points = expand(overrides)
        except HybridGenError:
            raise
        except Exception as err:
            raise ConfigError(friendly_error(err, overrides)) from None
        if len(points) > 10000:
            raise ConfigError(f"the sweep has {len(points)} points; narrow it (at most 10000)")
        for pt in points:
            try:
                cfg = to_run_config(compose(pt))
            except HybridGenError:
                raise
            except Exception as err:
                raise ConfigError(friendly_error(err, pt)) from None
            try:
                validate(cfg)
            except HybridGenError as err:
                if len(points) == 1:
                    raise
                raise ConfigError(f"{err} (at sweep point {_point_label(pt, points)}; a plain override "
                                  "applies to every point of the sweep: run such points in separate "
                                  "commands)") from None
            out.append((pt, cfg))
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return out
