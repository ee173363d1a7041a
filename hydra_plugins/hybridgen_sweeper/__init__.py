"""``hydra/sweeper=union``: Hydra's BasicSweeper run over several products, their union the sweep.
The default sweeper of conf/config.yaml (with no ``parts`` it is the basic product); it drops the
finished points before launch (experiments/skip_finished.py).

An experiment whose points are not one product (``+exp=paper_speedup``: projected profiles x cases
x methods, plus methods on this machine) lists the products as ``hydra.sweeper.parts``; each part's
keys are laid over ``hydra.sweeper.params`` and the command line still replaces any key it names.
Hydra instantiates sweepers only from the ``hydra_plugins`` namespace, hence this package; the
expansion itself is :func:`experiments.preflight.union_of_products`, which the preflight check of
experiments/run.py uses too, so both see the same points.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore


@dataclass
class UnionSweeperConf:
    """``hydra/sweeper=union``: Hydra's basic sweeper over several products, one per part."""

    _target_: str = "hydra_plugins.hybridgen_sweeper.UnionSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None
    parts: Optional[List[Dict[str, Any]]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="union", node=UnionSweeperConf, provider="hybridgen")


class UnionSweeper(BasicSweeper):
    """BasicSweeper whose jobs are the union of one product per entry of ``parts`` (no parts: the
    basic product), less the finished points (experiments/skip_finished.py). Launching, batching
    (``max_batch_size``) and job numbering are BasicSweeper's."""

    def __init__(self, max_batch_size: Optional[int], params: Optional[Dict[str, str]] = None,
                 parts: Optional[List[Dict[str, Any]]] = None):
        super().__init__(max_batch_size, params)
        self.parts = [dict(p) for p in (parts or [])]

    def split_arguments(self, overrides, max_batch_size):  # BasicSweeper.sweep calls it on self
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from experiments.preflight import union_of_products
        from experiments.skip_finished import launch_only_unfinished

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        n = len(self._parse_config())  # sweep() parsed params, then the command line
        parts = [parser.parse_overrides([f"{k}={v}" for k, v in p.items()]) for p in self.parts]
        jobs = launch_only_unfinished(union_of_products(overrides[:n], parts, overrides[n:]))
        if not jobs:  # every point finished: no batch, sweep() launches nothing
            return []
        return [list(c) for c in BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size)]
