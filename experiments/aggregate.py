"""``python experiments/aggregate.py <exp> [--results-dir outputs]``: one table of all finished runs.

Writes <results-dir>/<exp>/summary.csv (and summary.parquet when pyarrow is installed), one
row per finished run with every metric flattened to dotted column names
(``latency.prefill_s``, ``memory.kv_peak_bytes_by_tier.gpu``, ``fidelity.mean_kl``,
``accuracy.<task>.acc``, ...). ``--results-dir`` defaults to ``outputs`` (where ad-hoc runs
go); the committed results are aggregated with ``--results-dir results``.
``--all`` aggregates every experiment directory. A run whose metrics.json is damaged is left
out and named on stderr; a missing or unreadable results directory is one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hybridgen.errors import ConfigError, cli_errors  # noqa: E402
from hybridgen_harness.result_tables import aggregate  # noqa: E402


@cli_errors
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exp", nargs="*", help="experiment name(s) (directories under the results dir)")
    p.add_argument("--results-dir", default="outputs")
    p.add_argument("--all", action="store_true", help="every experiment under the results dir")
    args = p.parse_args(argv)
    root = Path(args.results_dir)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--results-dir {root} is a file, not a directory of results")
    exps = list(args.exp)
    if args.all:
        if not root.is_dir():
            raise ConfigError(f"--results-dir {root} does not exist; run an experiment first or pass "
                              "--results-dir results for the committed ones")
        exps = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                      and d.name != "figures")
    if not exps:
        p.error("name an experiment (e.g. quickstart) or pass --all")
    for exp in exps:
        try:
            paths = aggregate(args.results_dir, exp)
        except ConfigError as err:
            if not args.all:
                raise
            if not (_ROOT / "conf" / "exp" / f"{exp}.yaml").is_file():
                # e.g. results/projected, results/cpu_scan: files written by a script, not runs of `+exp=NAME`
                print(f"{exp}: skipped (no runs: not an experiment of conf/exp/, its files come from its own script)")
            else:
                print(f"{exp}: skipped ({err})")
            continue
        import pandas as pd

        n = len(pd.read_csv(paths["csv"]))
        print(f"{exp}: {n} run(s) -> " + ", ".join(str(v) for v in paths.values()))


if __name__ == "__main__":
    main()
