"""``python experiments/aggregate.py <exp> [--results-dir results]``: one table of all finished runs.

Writes results/<exp>/summary.csv (and summary.parquet when pyarrow is installed), one row per
finished run with every metric flattened to dotted column names (``latency.prefill_s``,
``memory.kv_peak_bytes_by_tier.gpu``, ``fidelity.mean_kl``, ``accuracy.<task>.acc``, ...).
``--all`` aggregates every experiment directory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hybridgen.errors import cli_errors  # noqa: E402
from hybridgen.results import aggregate  # noqa: E402


@cli_errors
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exp", nargs="*", help="experiment name(s) (directories under the results dir)")
    p.add_argument("--results-dir", default="results")
    p.add_argument("--all", action="store_true", help="every experiment under the results dir")
    args = p.parse_args(argv)
    exps = list(args.exp)
    if args.all:
        root = Path(args.results_dir)
        exps = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                      and d.name != "figures") if root.is_dir() else []
    if not exps:
        p.error("name an experiment (e.g. quickstart) or pass --all")
    from hybridgen.errors import ConfigError

    for exp in exps:
        try:
            paths = aggregate(args.results_dir, exp)
        except ConfigError as err:
            if not args.all:
                raise
            print(f"{exp}: skipped ({err})")
            continue
        import pandas as pd

        n = len(pd.read_csv(paths["csv"]))
        print(f"{exp}: {n} run(s) -> " + ", ".join(str(v) for v in paths.values()))


if __name__ == "__main__":
    main()
