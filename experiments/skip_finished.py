"""Finished points are dropped before launch: a re-run of a finished sweep launches no job.

The union sweeper (``hydra_plugins/hybridgen_sweeper``, the default sweeper of conf/config.yaml)
hands its job list to :func:`launch_only_unfinished` before the launcher sees it. A job whose point
(composed by the preflight callback: ``experiments.preflight.PLAN.points``) is finished in the
results store, and not ``force=true``, is dropped with its ``skip (done): <run dir>`` line (the skip
decision is :func:`experiments.runner.finished_outcome`, the one a job makes for itself), and one
summary line says how many points were skipped and how many are launched. Afterwards
``PLAN.points`` holds the launched points in job-number order (Hydra numbers the launched jobs
0, 1, ...; experiments/run.py indexes ``PLAN.points`` by that number) and ``PLAN.skipped`` the
dropped ones with their outcomes and their place in the sweep, for the end-of-sweep table.

A launched job still checks again, under the run's lock (another process may finish the point in
the meantime). A sweeper whose jobs the preflight did not see launches them all unchanged.
"""
from __future__ import annotations

from typing import List, Sequence

from experiments.preflight import PLAN, Skipped


def launch_only_unfinished(jobs: Sequence[Sequence[str]]) -> List[List[str]]:
    """The jobs (each a list of overrides, as the sweeper writes them) still to launch.

    Unchanged when this process's preflight did not compose exactly these jobs (another entry
    point, another sweeper) or already chose among them; otherwise updates ``PLAN`` (see the
    module docstring) and logs the skipped points.
    """
    from experiments.runner import finished_outcome
    from experiments.session import shared_session

    jobs = [list(j) for j in jobs]
    points = PLAN.points
    if points is None or PLAN.skipped:
        return jobs
    by_overrides = {tuple(p.overrides): p for p in points}
    if len(by_overrides) != len(points) or sorted(map(tuple, jobs)) != sorted(by_overrides):
        return jobs
    session = shared_session()
    launched, skipped = [], []
    for position, job in enumerate(jobs):
        point = by_overrides[tuple(job)]
        outcome = finished_outcome(point.cfg, session)
        if outcome is None:
            launched.append(point)
        else:
            skipped.append(Skipped(position, point, outcome))
    PLAN.points, PLAN.skipped = launched, skipped
    if skipped:
        session.log(f"{len(skipped)} point(s) skipped (finished; force=true re-runs them), "
                    f"{len(launched)} to launch")
    return [list(p.overrides) for p in launched]
