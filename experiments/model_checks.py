"""Parameters checked against the model and the workload they run on (issue 25, item 6).

Decided per parameter (a refusal is one ConfigError line; a warning is one ``warning:`` line on
stderr, once per process, and the run goes on):

==========================================  ====================================================
parameter                                    when it exceeds the model / the context
==========================================  ====================================================
``model.num_layers``                         refused: more layers than the checkpoint has
``dense_layers`` (quest, magicpig), set      refused: >= the run's layers means every layer
in ``method.params``                         runs dense (the method would be full attention)
``dense_layers`` left at the method default  warning: the tiny (num_layers-cut) model runs dense
a token budget (``'512t'``)                  warning: >= prompt + generation keeps every token
``sinks`` + ``window`` (streamingllm,        warning: >= prompt + generation keeps every token
magicpig, snapkv's observation ``window``)
==========================================  ====================================================

A warning and not a refusal where a smoke run (``model.num_layers=1``, 8-token prompts) meets a
method's defaults: the result is still correct (full attention), and the warning says so.
"""
from __future__ import annotations

import sys
from typing import Any, Set

from omegaconf import DictConfig, OmegaConf

from hybridgen.errors import ConfigError

_WARNED: Set[str] = set()


def warn(message: str) -> None:
    """One ``warning:`` line on stderr, once per process."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def check_against_model(cfg: DictConfig, method: Any) -> None:
    """Refuse or warn (see the module table) for ``cfg`` and its built ``method``."""
    from hybridgen.model import model_spec

    spec = model_spec(cfg.model.name)
    model = cfg.model.name
    layers = spec.num_layers
    if cfg.model.num_layers is not None:
        if int(cfg.model.num_layers) > spec.num_layers:
            raise ConfigError(f"model.num_layers={cfg.model.num_layers} exceeds {model}'s {spec.num_layers} layers; "
                              f"use 1..{spec.num_layers} or null (all)")
        layers = int(cfg.model.num_layers)
    name = cfg.method.name
    explicit = OmegaConf.to_container(cfg.method.params, resolve=True) or {}
    dense = getattr(method, "dense_layers", None)
    if isinstance(dense, int) and dense >= layers and dense > 0:
        what = f"dense_layers={dense} covers all {layers} layer(s) of {model}: every layer runs dense (full attention)"
        if "dense_layers" in explicit:
            raise ConfigError(f"method {name!r}: {what}; use dense_layers <= {layers - 1} or method=full")
        warn(f"method {name!r}: its default {what} in this run")
    if cfg.exp.kind != "generate":
        return
    context = int(cfg.workload.prompt_len) + int(cfg.workload.gen_len)
    budget = getattr(method, "budget", None)
    tokens = getattr(budget, "tokens", None)
    if isinstance(tokens, int) and tokens >= context:
        warn(f"method {name!r}: budget {tokens}t >= the context ({context} tokens): every token is kept")
    parts = [k for k in ("sinks", "window") if isinstance(getattr(method, k, None), int)]
    kept = sum(getattr(method, k) for k in parts)
    if kept and kept >= context and name != "hybridgen":  # hybridgen's sinks are a gpu share, not a cut
        warn(f"method {name!r}: {' + '.join(parts)} = {kept} >= the context ({context} tokens): every token is kept")
