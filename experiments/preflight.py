"""Whole-sweep validation before the first point runs: a Hydra callback over Hydra's own expansion.

Hydra expands the sweep (its BasicSweeper: ``key=a,b``, ``glob(h2*)``, ``range(1,4)``, plus the
experiment's ``hydra.sweeper.params``) and its launcher runs one job per point. Before it does,
:class:`Preflight` (``hydra.callbacks.preflight`` in conf/config.yaml) expands the same overrides
the same way (:func:`sweep_overrides`), composes every point exactly as the launcher will
(``config_loader.load_sweep_config``: ``--config-dir`` and ``hydra.searchpath`` count) and checks
it (:func:`experiments.validate.validate`). A bad point stops everything with one line naming the
point, before any model loads or any directory is made.

Hydra's callback runner turns an exception into a warning and carries on, so a rejection is a
:class:`SweepRejected` (a ``SystemExit``, status 2) raised after its ``error:`` line is printed.
"""
from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.validate import friendly_error, to_run_config, validate
from hybridgen.errors import ConfigError, HybridGenError

MAX_POINTS = 10000
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
UNION_SWEEPER = "hydra_plugins.hybridgen_sweeper.UnionSweeper"  # Hydra takes sweepers from hydra_plugins only


class Point(NamedTuple):
    """One job of the sweep: its overrides (as Hydra's sweeper writes them) and its run config."""

    overrides: List[str]
    cfg: DictConfig


class Skipped(NamedTuple):
    """A finished point dropped before launch (experiments/skip_finished.py): its place in the
    sweep, the point, and its 'skipped' Outcome (experiments.session.Outcome) for the table."""

    position: int
    point: Point
    outcome: Any


@dataclass
class Plan:
    """What the preflight of the sweep running in this process found (read by experiments/run.py)."""

    points: Optional[List[Point]] = None   # None: another sweeper; each job is checked when it starts
    # (after the union sweeper's launch: only the launched points, in job-number order)
    skipped: List[Skipped] = field(default_factory=list)   # finished points the sweeper did not launch
    sweep_dir: Optional[Path] = None
    existed: Optional[Path] = None        # the deepest ancestor of sweep_dir that existed before


PLAN = Plan()


class SweepRejected(SystemExit):
    """A point of the sweep is invalid (its one line is already printed): exit status 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def sweep_overrides(master: DictConfig, config_loader) -> Optional[List[List[str]]]:
    """Every job's overrides, expanded by Hydra's BasicSweeper exactly as it will for this sweep
    (the experiment's ``hydra.sweeper.params`` first, the command line replacing a key it names;
    with ``hydra/sweeper=union``, the union over ``hydra.sweeper.parts``); None when another
    sweeper is configured (it chooses its own points)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    target = OmegaConf.select(master, "hydra.sweeper._target_")
    if target not in (BASIC_SWEEPER, UNION_SWEEPER):
        return None
    parser = OverridesParser.create(config_loader=config_loader)
    sw = master.hydra.sweeper
    params = parser.parse_overrides(_as_overrides(sw.params))
    parts = [parser.parse_overrides(_as_overrides(part)) for part in (sw.get("parts") or [])]
    args = parser.parse_overrides(OmegaConf.to_container(master.hydra.overrides.task, resolve=False))
    jobs = union_of_products(params, parts, args)
    if not jobs:
        raise ConfigError(no_points_message([*params, *(o for p in parts for o in p), *args]))
    return jobs


def no_points_message(overrides) -> str:
    """The one line of a sweep that expands to no point, naming the empty sweeps (glob, range, ...)."""
    empty = []
    for o in overrides:
        try:
            if o.is_sweep_override() and not list(o.sweep_string_iterator()):
                empty.append(o.input_line or o.key_or_group)
        except Exception:  # noqa: BLE001 - naming is a hint only
            continue
    what = ", ".join(empty) if empty else "the sweep"
    return (f"{what} expands to no point: nothing would run; fix the pattern or bounds "
            "(glob(h2*) must match a name, range(start, stop) needs start < stop)")


def _as_overrides(node) -> List[str]:
    """``{key: value}`` of a sweeper config as override strings (what BasicSweeper does with params)."""
    if not node:
        return []
    return [f"{k}={v}" for k, v in OmegaConf.to_container(node, resolve=True).items()]


def union_of_products(params, parts, args) -> List[List[str]]:
    """The jobs of BasicSweeper's product of ``params + part + args`` (parsed overrides; a later key
    replaces an earlier one), for each part in turn (no parts: one product), without repeats."""
    out, seen = [], set()
    for part in parts or [[]]:
        for job in BasicSweeper.split_arguments([*params, *part, *args], None)[0]:
            if tuple(job) not in seen:
                seen.add(tuple(job))
                out.append(list(job))
    return out


def _label(pt: Sequence[str], points: Sequence[Sequence[str]]) -> str:
    """The overrides that make ``pt`` differ from the other points of the sweep."""
    shared = set(points[0]).intersection(*map(set, points[1:]))
    return " ".join(o for o in pt if o not in shared) or " ".join(pt)


def resolve(master: DictConfig, config_loader, points: Sequence[Sequence[str]]) -> List[Point]:
    """Compose and validate every point; ConfigError with one line on the first bad one."""
    if len(points) > MAX_POINTS:
        raise ConfigError(f"the sweep has {len(points)} points; narrow it (at most {MAX_POINTS})")
    out = []
    for pt in points:
        where = f" (at sweep point {_label(pt, points)})" if len(points) > 1 else ""
        try:
            cfg = to_run_config(config_loader.load_sweep_config(master, list(pt)))
        except HybridGenError as err:
            raise ConfigError(f"{err}{where}") from None
        except Exception as err:  # hydra/omegaconf composition errors
            raise ConfigError(friendly_error(err, pt) + where) from None
        try:
            validate(cfg)
        except HybridGenError as err:
            if not where:
                raise
            raise ConfigError(f"{err}{where[:-1]}; a plain override applies to every point of the sweep: run "
                              "such points in separate commands)") from None
        out.append(Point(list(pt), cfg))
    return out


def check_results_dirs(cfgs: Sequence[DictConfig]) -> None:
    """An unwritable results_dir is refused before any measurement, not after."""
    from hybridgen_harness.results import check_writable

    for root in sorted({str(c.results_dir) for c in cfgs}):
        check_writable(root)


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class Preflight(Callback):
    """Validate the whole sweep at ``on_multirun_start`` (a single run at ``on_run_start``)."""

    def __init__(self, log: bool = True):
        self.log = log

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        def check() -> None:
            _loggers_back_on()
            loader = GlobalHydra.instance().config_loader()
            jobs = sweep_overrides(config, loader)
            PLAN.points = None if jobs is None else resolve(config, loader, jobs)
            if PLAN.points is not None:
                check_results_dirs([p.cfg for p in PLAN.points])
            PLAN.sweep_dir = Path(str(config.hydra.sweep.dir))
            PLAN.existed = _existing_ancestor(PLAN.sweep_dir)
            if self.log:
                exp = PLAN.points[0].cfg.exp.name if PLAN.points else config.exp.name
                n = f"{len(PLAN.points)} point(s)" if PLAN.points is not None else "points chosen by the sweeper"
                logging.getLogger(__name__).info("%s: %s", exp, n)

        _guard(check)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        def check() -> None:  # hydra.mode=RUN: one job, this very config
            cfg = to_run_config(config)
            validate(cfg)
            check_results_dirs([cfg])
            PLAN.points, PLAN.sweep_dir, PLAN.existed = [Point(list(config.hydra.overrides.task), cfg)], None, None

        _guard(check)


def _loggers_back_on() -> None:
    """Our loggers on again, at the level the command line set: Hydra's ``hydra_logging`` config
    (``disable_existing_loggers``) has just switched off every logger that existed, so a second
    sweep in one process would lose the lines logged before its first job (this callback's, the
    sweeper's ``skip (done)``)."""
    from hybridgen import log

    if log.verbosity_was_set():
        log.set_verbosity(log.get_verbosity())


def _guard(check) -> None:
    try:
        check()
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SweepRejected(str(err)) from None
    except Exception as err:  # noqa: BLE001 - a bug here must stop the sweep too, not become a warning
        traceback.print_exc()
        print(f"error: the sweep could not be checked: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        raise SweepRejected(str(err)) from None


def prune_bookkeeping() -> None:
    """Remove the sweep directory Hydra made for an in-process sweep when it holds nothing but
    ``multirun.yaml`` and empty job directories (``hydra.output_subdir`` is null), and the empty
    parents it created: results directories hold runs, not bookkeeping. A launcher that writes
    there (submitit's logs) keeps it."""
    d, stop = PLAN.sweep_dir, PLAN.existed
    if d is None or not d.is_dir():
        return
    files = [p for p in d.rglob("*") if not p.is_dir()]
    if any(p != d / "multirun.yaml" for p in files):
        return
    for p in files:
        p.unlink()
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        sub.rmdir()
    while d != stop and d != d.parent and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def resolve_points(overrides: Sequence[str], config_name: str = "config") -> List[Point]:
    """Hydra's expansion of ``overrides`` (as on the command line; ``-m`` is implied), every point
    composed and validated: what ``experiments/run.py`` checks before the first job. Uses conf/
    plus whatever ``hydra.searchpath=[...]`` adds; raises ConfigError with one line."""
    with _hydra() as gh:
        master = _master(gh, overrides, config_name)
        jobs = sweep_overrides(master, gh.config_loader())
        if jobs is None:
            raise ConfigError(f"{OmegaConf.select(master, 'hydra.sweeper._target_')} chooses its own points; "
                              "only Hydra's basic sweeper can be expanded ahead")
        return resolve(master, gh.config_loader(), jobs)


def expand(overrides: Sequence[str], config_name: str = "config") -> List[List[str]]:
    """Only the expansion: every job's overrides, nothing composed per point."""
    with _hydra() as gh:
        return sweep_overrides(_master(gh, overrides, config_name), gh.config_loader()) or [list(overrides)]


def compose(overrides: Sequence[str], config_name: str = "config") -> DictConfig:
    """One point's run config (no hydra node, resolved), composed as a job of the sweep is."""
    with _hydra() as gh:
        master = _master(gh, [], config_name)
        try:
            return to_run_config(gh.config_loader().load_sweep_config(master, list(overrides)))
        except HybridGenError:
            raise
        except Exception as err:
            raise ConfigError(friendly_error(err, overrides)) from None


def _master(gh, overrides: Sequence[str], config_name: str) -> DictConfig:
    from hydra.types import RunMode

    from experiments.validate import method_param_overrides

    try:
        return gh.hydra.compose_config(config_name=config_name, overrides=method_param_overrides(overrides),
                                       run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    except HybridGenError:
        raise
    except Exception as err:
        raise ConfigError(friendly_error(err, overrides)) from None


class _hydra:
    """Hydra initialised on conf/ for the duration (reused when it already is)."""

    def __enter__(self):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from experiments.schema import register_configs
        from experiments.validate import CONF_DIR

        register_configs()
        self._ctx = None
        if not GlobalHydra.instance().is_initialized():
            self._ctx = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="run")
            self._ctx.__enter__()
        return GlobalHydra.instance()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False
