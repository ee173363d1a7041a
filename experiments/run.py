"""The one entry point: ``python experiments/run.py +exp=NAME [key=value ...]`` (add ``-m`` for Hydra multirun).

Plain run: the experiment's sweep (``hydra.sweeper.params`` in conf/exp/NAME.yaml, plus any
``key=a,b`` on the command line) runs point by point in this process, then a table is printed.
``-m``: Hydra's sweeper makes one job per point and the chosen launcher runs them
(``hydra/launcher=joblib`` locally in parallel, ``hydra/launcher=submitit_slurm`` on SLURM,
``hydra/launcher=submitit_local`` to try the SLURM path on this machine).

Either way every point is composed and validated first: a misspelt key, an unknown method or
parameter, a bad value -> one line on stderr, exit status 2. Finished runs are skipped
(``force=true`` replaces them), so re-running an interrupted sweep completes only what is
missing. Results: outputs/<exp>/<run-name>/ by default (results_dir=...; see hybridgen/results.py);
``python experiments/aggregate.py <exp>`` collects them into one table. An unwritable results_dir
is refused before anything runs. A point that fails at run time (a capacity, a damaged model, NaN
logits) prints one line and the others still run (the table shows it as failed, exit status 2);
``fail_fast=true`` stops at the first failure.
"""
from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `experiments` and `hybridgen` importable
    sys.path.insert(0, str(_ROOT))

from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()  # thread/env settings before torch loads (docs/design.md, thread runtime)

import torch  # noqa: E402  (before anything that may import numba: docs/design.md)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from experiments.schema import register_configs  # noqa: E402
from hybridgen.errors import HybridGenError  # noqa: E402

register_configs()

# Hydra flags that take a value, and flags after which we let Hydra do everything itself.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun"}
_PASSTHROUGH = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc",
                "--version", "--resolve"}
_FAILURES: list = []


def _split_argv(argv):
    """(overrides, multirun?, passthrough?)"""
    overrides, multirun, passthrough = [], False, False
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("-m", "--multirun"):
            multirun = True
        elif a.split("=")[0] in _PASSTHROUGH:
            passthrough = True
            skip = a in _VALUE_FLAGS
        elif a in _VALUE_FLAGS:
            skip = True
        elif a.startswith("-"):
            continue
        else:
            overrides.append(a)
    return overrides, multirun, passthrough


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def hydra_job(cfg: DictConfig) -> None:
    """One job of a multirun (or a passthrough invocation): runs its single point."""
    from hydra.core.hydra_config import HydraConfig

    from experiments import runner, sweep

    try:
        cfg = sweep.to_run_config(cfg)
        sweep.validate(cfg)
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        _FAILURES.append(str(err))
        return
    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:
        overrides = []
    session = runner.Session()
    try:
        out = runner.run_point(cfg, session, overrides)
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        _FAILURES.append(str(err))
        return "failed"
    if out.status == "failed":
        _FAILURES.append(out.error)
    runner.print_table([out])
    return out.status


def main(argv=None) -> int:
    from experiments.sweep import method_param_overrides

    argv = method_param_overrides(list(sys.argv[1:] if argv is None else argv))
    sys.argv[1:] = argv  # Hydra's own parse (passthrough, -m) sees the same overrides
    overrides, multirun, passthrough = _split_argv(argv)
    if passthrough:
        hydra_job()
        return 0
    from experiments import runner, sweep

    from hybridgen.results import check_writable

    try:
        points = sweep.resolve_points(overrides)
        for results_root in sorted({str(cfg.results_dir) for _, cfg in points}):
            check_writable(results_root)  # before any measurement, not after
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    exp = points[0][1].exp.name
    results_dir = points[0][1].results_dir
    if multirun:
        print(f"{exp}: {len(points)} point(s) -> Hydra multirun", file=sys.stderr)
        hydra_job()
        _print_experiment(results_dir, exp, [p[1] for p in points])
        return 2 if _FAILURES else 0
    print(f"{exp}: {len(points)} point(s)", file=sys.stderr)
    session = runner.Session()
    outcomes = []
    for i, (pt, cfg) in enumerate(points, 1):
        session.log(f"[{i}/{len(points)}] {' '.join(pt)}")
        try:
            outcomes.append(runner.run_point(cfg, session, pt))
        except HybridGenError as err:
            print(f"error: {err}", file=sys.stderr)
            if len(points) == 1 or cfg.fail_fast:  # fail_fast=true: stop at the first failing point
                return 2
            outcomes.append(runner.Outcome(_point_name(runner, cfg), "failed", {"method": cfg.method.name}, str(err)))
            continue
        if outcomes[-1].status == "failed" and cfg.fail_fast:
            runner.print_table(outcomes)
            return 2
    print()
    runner.print_table(outcomes)
    if points[0][1].exp.kind == "generate":
        _print_samples(results_dir, exp, outcomes)
    print(f"\nresults: {Path(results_dir) / exp}/   (aggregate: python experiments/aggregate.py {exp})")
    if not torch.cuda.is_available() and points[0][1].exp.kind == "generate":
        print("no CUDA here: the gpu tier is emulated on the CPU (timings show CPU cost, not GPU speed)")
    return 2 if any(o.status == "failed" for o in outcomes) else 0


def _point_name(runner, cfg) -> str:
    """The run name of a failed point (its config text when even naming failed)."""
    try:
        return runner.name_of(cfg)
    except Exception:  # noqa: BLE001 - naming is what failed: fall back to the method
        return f"{cfg.exp.name}/{cfg.method.name}"


def _print_samples(results_dir, exp, outcomes, width: int = 100) -> None:
    """One line per finished run: the start of its first generated text (row 0 of the batch)."""
    from hybridgen.results import ResultsStore, load_run

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


def _print_experiment(results_dir, exp, cfgs) -> None:
    """After a multirun: the table of this sweep's points, read back from the results store."""
    from experiments import runner
    from hybridgen.results import ResultsStore, load_run

    store = ResultsStore(results_dir, exp)
    outcomes = []
    for cfg in cfgs:
        name = runner.name_of(cfg)
        if store.is_done(name):
            outcomes.append(runner.Outcome(name, "done", runner._safe_row(cfg, load_run(store.run_dir(name)))))
        else:
            outcomes.append(runner.Outcome(name, "missing", {"method": cfg.method.name}))
    print()
    runner.print_table(outcomes)


if __name__ == "__main__":
    sys.exit(main())
