"""``python -m hybridgen <command>``: the ``hybridgen`` command (hybridgen/cli.py)."""
import sys

from hybridgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
