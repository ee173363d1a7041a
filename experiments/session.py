"""State shared by the run points of one process: the loaded engine, the fidelity reference
and the environment record (a sweep over methods loads its model once)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from experiments.point import method_params
from hybridgen.errors import HybridGenError


@dataclass
class Outcome:
    name: str
    status: str                      # 'done' | 'skipped' | 'failed'
    row: Dict[str, Any] = field(default_factory=dict)
    error: str = ""
    note: str = ""                   # e.g. a skipped run measured at another commit


class Session:
    """State shared by the points of one process: the engine and the reference generations."""

    def __init__(self, log: Callable[[str], None] = None):
        self.log = log or logging.getLogger(__name__).info  # progress messages: hidden by -q (hybridgen/log.py)
        self._engine_key: Optional[str] = None
        self._engine = None
        self._refs: Dict[str, Any] = {}
        self.warmed: set = set()
        self._env: Optional[Dict[str, Any]] = None
        self.loads = 0                   # models loaded by this session (a sweep over methods: 1)

    def environment(self) -> Dict[str, Any]:
        if self._env is None:
            from hybridgen.eval.environment import environment

            self._env = environment()
        return self._env

    def engine(self, cfg: DictConfig):
        from hybridgen.model import load_model

        m = cfg.model
        backend = str(m.get("backend", "auto"))
        key = f"{m.name}|{m.weights}|{m.dtype}|{m.num_layers}|{cfg.seed}|{backend}|{_weights_location(m.name)}"
        failed = getattr(self, "_load_error", None)
        if failed is not None and failed[0] == key:
            raise failed[1]  # the same model failed to load for an earlier point: do not retry
        if key != self._engine_key:
            self._engine, self._engine_key, self._refs = None, None, {}
            t0 = time.perf_counter()
            try:
                self._engine = load_model(m.name, weights=m.weights, dtype=m.dtype, seed=int(cfg.seed),
                                          num_layers=m.num_layers, backend=backend)
            except HybridGenError as err:
                self._load_error = (key, err)
                raise
            self._engine_key = key
            self.loads += 1
            self.log(f"loaded {self._engine!r} in {time.perf_counter() - t0:.1f}s")
        return self._engine

    @staticmethod
    def _ref_key(cfg: DictConfig) -> Tuple[str, str, Dict[str, Any]]:
        from experiments.validate import reference_method

        name, params = reference_method(cfg.exp.reference)
        key = f"{name}|{params}|{OmegaConf.to_container(cfg.workload)}|{cfg.seed}"
        return key, name, params

    def offer_reference(self, cfg: DictConfig, result) -> None:
        """Keep ``result`` as the reference when this run IS the reference method with its defaults."""
        key, name, params = self._ref_key(cfg)
        if result.logits is not None and cfg.method.name == name and method_params(cfg) == params:
            self._refs = {key: result}

    def reference(self, cfg: DictConfig, engine, ids, mask) -> Any:
        """Greedy generation (tokens + logits) of exp.reference for this workload (cached in memory)."""
        from hybridgen.eval.generation import make_store
        from hybridgen.methods import build_method

        key, name, params = self._ref_key(cfg)
        if key not in self._refs:
            self.log(f"reference generation ({cfg.exp.reference}) for fidelity ...")
            method = build_method(name, **params)
            # the reference is the method's ideal, not a competitor: it runs without the tier
            # capacities the method under test lives with (a method that fits must not lose its
            # measurement because the dense reference would not fit)
            unlimited = {**OmegaConf.to_container(cfg.hardware, resolve=True),
                         "gpu_capacity": None, "dram_capacity": None, "cxl_capacity": None}
            self._refs = {key: engine.generate(ids, method, max_new_tokens=int(cfg.workload.gen_len),
                                               attention_mask=mask, store=make_store(unlimited, engine),
                                               return_logits=True, progress=bool(cfg.progress))}
        return self._refs[key]


_SHARED: Optional[Session] = None


def shared_session(fresh: bool = False) -> Session:
    """The Session of this process (``fresh=True``: a new one, as each ``run.py`` invocation starts)."""
    global _SHARED
    if _SHARED is None or fresh:
        _SHARED = Session()
    return _SHARED


def _weights_location(name: str) -> str:
    """Where the weights of ``name`` are read from (part of the engine's cache key): the prepared
    SmolLM2 cache (``HYBRIDGEN_CACHE``), a checkpoint directory, or the name itself (hub id,
    shipped shapes)."""
    import os

    from hybridgen.model import gemma3, smollm2

    if str(name) == smollm2.MODEL_NAME:
        return str(smollm2.prepared_dir())
    if str(name) == gemma3.MODEL_NAME:
        return str(gemma3.prepared_dir())
    path = Path(str(name)).expanduser()
    return str(path.resolve()) if path.exists() else f"{name}|{os.environ.get('HF_HUB_CACHE', '')}"
