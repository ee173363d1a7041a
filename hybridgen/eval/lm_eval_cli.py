"""`hybridgen-lm-eval <lm-eval arguments>` (or `python -m hybridgen.eval.lm_eval_cli`): lm-eval
with the `hybridgen` model.

lm-eval 0.4.13 finds models only in its own registry (no entry-point discovery), so this
wrapper registers ours first and adds hybridgen's local task directory to ``--include_path``;
everything else is lm-eval's own command line, e.g.

    hybridgen-lm-eval --model hybridgen \\
        --model_args model=smollm2-135m,method=h2o,budget=0.2 \\
        --tasks hg_bigbench_social_iqa,hg_needle --limit 50

A missing dataset (or any other user error) prints one line naming the fix and exits 2.
"""
from __future__ import annotations

import os
import sys

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("NUMBA_THREADING_LAYER", "workqueue"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_k, _v)


def with_include_path(argv: list, path: str) -> list:
    """argv with ``path`` added to --include_path (appended to a given one with ':')."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--include_path" and i + 1 < len(out):
            out[i + 1] = out[i + 1] + os.pathsep + path
            return out
        if a.startswith("--include_path="):
            out[i] = a + os.pathsep + path
            return out
    return out + ["--include_path", path]


def main(argv=None) -> int:
    import torch  # noqa: F401  (before numba; docs/design.md)

    import hybridgen.eval.lm_eval_model  # noqa: F401  (registers the `hybridgen` model)
    from hybridgen.errors import HybridGenError
    from hybridgen.eval.tasks_data import tasks_dir

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("run",):
        args = args[1:]
    if not any(a in ("-h", "--help") for a in args) and args[:1] not in (["ls"], ["validate"]):
        args = ["run"] + with_include_path(args, str(tasks_dir()))
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval"] + args
    try:
        cli_evaluate()
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # lm-eval wraps task-loading errors; unwrap ours
        cause = err
        while cause is not None and not isinstance(cause, HybridGenError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            print(f"error: {cause}", file=sys.stderr)
            return 2
        raise
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
