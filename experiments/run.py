"""The one entry point: ``python experiments/run.py +exp=NAME [key=value ...]``.

Every invocation is a Hydra multirun (``hydra.mode: MULTIRUN`` in conf/config.yaml; ``-m`` is
accepted and changes nothing): Hydra's sweeper expands the experiment's sweep
(``hydra.sweeper.params`` in conf/exp/NAME.yaml) with the command line's (``key=a,b``,
``method=glob(h2*)``, ``workload.batch=range(1,5)``; a key named there replaces the experiment's
sweep of it), and the launcher runs one job per point. The default launcher runs them in turn in
this process, sharing the loaded model and the fidelity reference (experiments/runner.py);
``hydra/launcher=parallel`` (joblib), ``slurm`` or ``local`` (submitit) run them elsewhere.
``--config-dir DIR`` adds your own config files (``hardware=myhw`` from DIR/hardware/myhw.yaml).

Before the first job, every point is composed and validated (experiments/preflight.py, a Hydra
callback): a misspelt key, an unknown method or parameter, a bad value -> one line on stderr,
exit status 2. ``-q`` hides progress messages and bars (``-qq``: errors only), ``-v`` (or Hydra's
``hydra.verbose=true``) adds debug messages; ``HYBRIDGEN_LOG_LEVEL`` sets the default (hybridgen/log.py).
``--methods`` lists every registered method with its parameters. Finished points are not even launched
(one ``skip (done): <run dir>`` line each, experiments/skip_finished.py; ``force=true`` replaces them), so
re-running an interrupted sweep launches only what is missing. Results: outputs/<exp>/<run-name>/ by default
(results_dir=...; see hybridgen_harness/results.py); ``python experiments/aggregate.py <exp>`` collects
them into one table. An unwritable results_dir is refused before anything runs. A point that
fails at run time (a capacity, a damaged model, NaN logits) prints one line and the others still
run (the table shows it as failed, exit status 2); ``fail_fast=true`` stops at the first failure.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `experiments` and `hybridgen` importable
    sys.path.insert(0, str(_ROOT))

from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()  # thread/env settings before torch loads (docs/design.md, thread runtime)

import torch  # noqa: E402  (before anything that may import numba: docs/design.md)

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from experiments.locations import CONF_DIR  # noqa: E402
from experiments.schema import register_configs  # noqa: E402
from experiments import preflight  # noqa: E402
from hybridgen import log  # noqa: E402
from hybridgen.errors import HybridGenError  # noqa: E402

register_configs()

_OUTCOMES: dict = {}       # job number -> Outcome, for the jobs run in this process
_STATE = {"stop": False, "user_error": False, "level": None}


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_job(cfg: DictConfig) -> Optional[str]:
    """One job of the sweep: runs its point with the process's shared session."""
    from hydra.core.hydra_config import HydraConfig

    from experiments import runner
    from experiments.session import Outcome, shared_session
    from experiments.validate import to_run_config, validate

    log.set_verbosity(_STATE["level"])  # again: Hydra's job logging (dictConfig) ran since main()
    hc = HydraConfig.get()
    num = int(OmegaConf.select(hc.job, "num", default=0, throw_on_missing=False) or 0)  # hydra.mode=RUN: none
    overrides = list(hc.overrides.task)
    if _STATE["stop"]:  # fail_fast=true after a failed point: the launcher still calls us for the rest
        return "not run"
    session = shared_session()
    run_cfg = to_run_config(cfg)
    logging.getLogger("experiments.run").debug("point %d, resolved config:\n%s", num + 1, OmegaConf.to_yaml(run_cfg))
    try:
        if preflight.PLAN.points is None or len(preflight.PLAN.points) <= num:
            validate(run_cfg)  # a job the preflight of this process did not see (another process, sweeper)
        total = len(preflight.PLAN.points) if preflight.PLAN.points else "?"
        session.log(f"[{num + 1}/{total}] {' '.join(overrides)}")
        out = runner.run_point(run_cfg, session, overrides)
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        out = Outcome(_point_name(run_cfg), "failed", {"method": run_cfg.method.name}, str(err))
        _STATE["user_error"] = True
        if run_cfg.fail_fast:
            _STATE["stop"] = True
    else:
        if out.status == "failed" and run_cfg.fail_fast:
            _STATE["stop"] = True
    _OUTCOMES[num] = out
    return out.status


_COMMANDS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc",
             "--version"}


def main(argv=None) -> int:
    """Run the sweep of ``argv`` (default: the command line); the exit status."""
    import os

    from experiments.session import shared_session
    from experiments.validate import friendly_error, method_param_overrides

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--methods" in argv:
        from hybridgen.methods.catalog import format_catalog

        print(format_catalog())
        return 0
    try:
        argv, level = verbosity(argv)
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    argv = method_param_overrides(argv)
    command = any(a.split("=")[0] in _COMMANDS for a in argv)  # --cfg job, --help ...: Hydra alone
    _OUTCOMES.clear()
    _STATE.update(stop=False, user_error=False, level=level)
    log.set_verbosity(level)
    preflight.PLAN.__init__()
    shared_session(fresh=True)
    saved_argv, saved_env = list(sys.argv), os.environ.get("HYDRA_FULL_ERROR")
    sys.argv[1:] = argv
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composition errors reach us (one line below), not Hydra's printer
    try:
        hydra_job()
    except preflight.SweepRejected:
        return 2  # its one line is printed
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf composition errors: one line
        print(f"error: {friendly_error(err, [a for a in argv if not a.startswith('-')])}", file=sys.stderr)
        return 2
    finally:
        sys.argv[:] = saved_argv
        if saved_env is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_env
        preflight.prune_bookkeeping()
    if command:
        return 0
    return _report()


_QUIET = {"-q": 1, "--quiet": 1, "-qq": 2}
_VERBOSE = ("-v", "--verbose", "-vv")


def verbosity(argv):
    """(argv without our -q/-qq/-v flags, the log level): the flags, else Hydra's ``hydra.verbose``
    (true, or naming one of our loggers: debug), else ``$HYBRIDGEN_LOG_LEVEL``, else info."""
    quiet = sum(_QUIET.get(a, 0) for a in argv)
    verbose = sum(a in _VERBOSE for a in argv)
    rest = [a for a in argv if a not in _QUIET and a not in _VERBOSE]
    if not (quiet or verbose):
        said = [a.split("=", 1)[1] for a in rest if a.lstrip("+").startswith("hydra.verbose=")]
        names = said[-1].strip("[]").replace(" ", "").split(",") if said else []
        if said and (said[-1].lower() == "true" or any(n.split(".")[0] in log.NAMES for n in names)):
            verbose = 1
    return rest, log.level_from_flags(verbose, quiet)


def _report() -> int:
    """The end-of-sweep table (points run elsewhere are read back from the results store)."""
    from experiments import runner
    from experiments.point import name_of
    from experiments.session import Outcome
    from hybridgen_harness.results import ResultsStore, load_run

    points, skipped = preflight.PLAN.points, preflight.PLAN.skipped
    outcomes = [o for _, o in sorted(_OUTCOMES.items())]
    if points and _STATE["user_error"] and (len(points) + len(skipped) == 1 or _STATE["stop"]):
        return 2  # one point (or fail_fast) stopped by a user error: its one line says it all
    if points is not None:
        outcomes = []
        for i, pt in enumerate(points):  # the launched points, by job number
            if i in _OUTCOMES:
                outcomes.append(_OUTCOMES[i])
                continue
            if _STATE["stop"]:
                continue  # not run: fail_fast stopped the sweep before it
            name = name_of(pt.cfg)
            store = ResultsStore(pt.cfg.results_dir, pt.cfg.exp.name)
            if store.is_done(name):
                outcomes.append(Outcome(name, "done", runner._safe_row(pt.cfg, load_run(store.run_dir(name)))))
            else:
                outcomes.append(Outcome(name, "missing", {"method": pt.cfg.method.name}))
        for s in skipped:  # the finished points the sweeper did not launch, back in their place
            outcomes.insert(s.position, s.outcome)
    if not outcomes:
        return 0
    first = (points or [s.point for s in skipped])[0].cfg if points is not None else None
    print()
    runner.print_table(outcomes)
    if first is not None:
        exp, results_dir = first.exp.name, first.results_dir
        if first.exp.kind == "generate":
            _print_samples(results_dir, exp, outcomes)
        print(f"\nresults: {Path(results_dir) / exp}/   (aggregate: python experiments/aggregate.py {exp})")
        if not torch.cuda.is_available() and first.exp.kind == "generate":
            print("no CUDA here: the gpu tier is emulated on the CPU (timings show CPU cost, not GPU speed)")
    return 2 if any(o.status in ("failed", "missing") for o in outcomes) else 0


def _point_name(cfg) -> str:
    """The run name of a failed point (its config text when even naming failed)."""
    from experiments.point import name_of

    try:
        return name_of(cfg)
    except Exception:  # noqa: BLE001 - naming is what failed: fall back to the method
        return f"{cfg.exp.name}/{cfg.method.name}"


def _print_samples(results_dir, exp, outcomes, width: int = 100) -> None:
    """One line per finished run: the start of its first generated text (row 0 of the batch)."""
    from hybridgen_harness.results import ResultsStore, load_run

    store = ResultsStore(results_dir, exp)
    lines = []
    for o in outcomes:
        if not store.is_done(o.name):
            continue
        text = (load_run(store.run_dir(o.name)).get("sample") or {}).get("text")
        if text:
            flat = " ".join(text.split())
            lines.append(f"  {o.row.get('method', o.name)}: {flat[:width]}{'...' if len(flat) > width else ''}")
    if lines:
        print("\ngenerated text (first row):")
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
