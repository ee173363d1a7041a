"""`hybridgen-lm-eval <lm-eval arguments>` (or `python -m hybridgen.eval.lm_eval_cli`): lm-eval
with the `hybridgen` model.

lm-eval 0.4.13 finds models only in its own registry (no entry-point discovery), so this
wrapper registers ours first and adds hybridgen's local task directory to the task search
path (after the user's ``--include_path`` directories, see :func:`include_paths`); everything
else is lm-eval's own command line, e.g.

    hybridgen-lm-eval --model hybridgen \\
        --model_args model=smollm2-135m,method=h2o,budget=0.2 \\
        --tasks hg_bigbench_social_iqa,hg_needle --limit 50

A missing dataset, an unknown task, a hub-only task while the hub is off, a bad
``--model_args`` value (checked before the model loads) or any other user error prints one
line naming the fix and exits 2.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Union

#: lm-eval subcommands that take --include_path
_WITH_TASKS = ("run", "ls", "validate")


def include_paths(given: Union[None, str, Sequence[str]], ours: str) -> List[str]:
    """The task directories lm-eval should search: the user's, then hybridgen's own.

    lm-eval 0.4.13 takes ``--include_path`` as ONE string and its TaskManager reads a string
    as one path (``"a:b"`` is looked up as a directory literally named ``a:b``; its ``ls``
    help shows that form anyway), but a list of paths works. So the user's value is split on
    ``os.pathsep`` (several directories in one flag, as that help suggests), each part must be
    a directory, and ours is appended; the list replaces the string after lm-eval's parser.
    """
    from hybridgen.errors import ConfigError

    parts: List[str] = []
    for item in ([given] if isinstance(given, str) else list(given or [])):
        parts += [p for p in str(item).split(os.pathsep) if p]
    for p in parts:
        if not Path(p).expanduser().is_dir():
            raise ConfigError(f"--include_path {p} is not a directory; point it at a directory of lm-eval "
                              "task YAMLs (several: join them with ':')")
    return [str(Path(p).expanduser()) for p in parts] + [ours]


def _check_hybridgen_args(ns) -> None:
    """With ``--model hybridgen``, check --model_args before lm-eval builds its task index or the model."""
    if getattr(ns, "model", None) != "hybridgen":
        return
    from lm_eval.utils import simple_parse_args_string

    from hybridgen.eval.lm_eval_model import check_model_args

    raw = getattr(ns, "model_args", None)
    args = simple_parse_args_string(raw) if isinstance(raw, str) else dict(raw or {})
    check_model_args(**args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from hybridgen import runtime

    runtime.apply_or_exit()  # thread/env settings, then torch (before numba; docs/design.md)
    import hybridgen.eval.lm_eval_model  # noqa: F401  (registers the `hybridgen` model)
    from hybridgen.errors import HybridGenError
    from hybridgen.eval.lm_eval_errors import explain
    from hybridgen.eval.tasks_data import tasks_dir

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] not in [[c] for c in _WITH_TASKS] and not any(a in ("-h", "--help") for a in args):
        args = ["run"] + args
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    saved = sys.argv
    sys.argv = ["lm-eval"] + args
    try:
        setup_logging()
        parser = HarnessCLI()
        ns = parser.parse_args()
        if getattr(ns, "command", None) in _WITH_TASKS and hasattr(ns, "include_path"):
            ns.include_path = include_paths(ns.include_path, str(tasks_dir()))
        if getattr(ns, "command", None) == "run":
            _check_hybridgen_args(ns)
        parser.execute(ns)
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # lm-eval wraps task-loading errors: unwrap ours, explain its user errors
        known = explain(err)
        if known is None:
            raise
        print(f"error: {known}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
