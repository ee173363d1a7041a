"""The harness's subcommands of ``hybridgen`` (declared in pyproject's ``hybridgen.commands``).

``hybridgen run ARGS`` is ``python experiments/run.py ARGS``; ``hybridgen figures`` aggregates
every experiment under a results directory and runs each figure notebook on it (the notebooks
are plain Python in jupytext's percent format; ``make figures`` also renders them as .ipynb).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import List


def run(argv: List[str]) -> int:
    """``hybridgen run +exp=NAME [key=value ...]``: experiments/run.py with these arguments."""
    from experiments import run as run_script

    return run_script.main(argv)


def figures(argv: List[str]) -> int:
    """``hybridgen figures [--results-dir DIR] [--only a,b]``: summary tables, then every notebook's PNGs under DIR/figures."""
    from experiments import aggregate
    from experiments.locations import NOTEBOOKS_DIR
    from hybridgen.errors import ConfigError

    p = argparse.ArgumentParser(prog="hybridgen figures", description=figures.__doc__.split(": ", 1)[1])
    p.add_argument("--results-dir", default="results",
                   help="the results to draw (default: ./results, relative to the current directory)")
    p.add_argument("--only", default="", help="comma-separated notebooks (default: all), e.g. memory,cpu_scan")
    args = p.parse_args(argv)
    notebooks = sorted(NOTEBOOKS_DIR.glob("*.py"))
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {nb.stem: nb for nb in notebooks}
        for n in wanted:
            if n not in known:
                from hybridgen.errors import unknown_name

                raise unknown_name("notebook", n, known)
        notebooks = [known[n] for n in wanted]
    root = Path(args.results_dir).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"--results-dir {root} is not a directory; run an experiment first "
                          "(hybridgen run +exp=quickstart results_dir=DIR) or name the results: --results-dir DIR")
    print(f"figures from {root}")
    aggregate.main(["--all", "--results-dir", str(root)])
    env = {**os.environ, "HYBRIDGEN_RESULTS": str(root), "MPLBACKEND": "Agg"}
    failed = []
    for nb in notebooks:
        done = subprocess.run([sys.executable, str(nb)], env=env, cwd=str(root))
        if done.returncode != 0:
            failed.append(nb.stem)
    if failed:
        print(f"error: notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0
