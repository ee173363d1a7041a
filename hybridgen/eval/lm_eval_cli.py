"""`hybridgen-lm-eval <lm-eval arguments>` (or `python -m hybridgen.eval.lm_eval_cli`): lm-eval
with the `hybridgen` model.

lm-eval 0.4.13 finds models only in its own registry (no entry-point discovery), so this
wrapper registers ours first and adds hybridgen's local task directory to the task search
path (after the user's ``--include_path`` directories, see :func:`include_paths`); everything
else is lm-eval's own command line, e.g.

    hybridgen-lm-eval --model hybridgen \\
        --model_args model=smollm2-135m,method=h2o,budget=0.2 \\
        --tasks hg_bigbench_social_iqa,hg_needle --limit 50

With ``--model hybridgen`` the wrapper also:

- passes the model's tokenizer directory to the tasks (``--metadata tokenizer=DIR``, unless
  ``tokenizer`` is given), so RULER (``niah_single_1`` ...) runs without naming it by hand;
- names the output directory after model and method: ``--output_path out`` writes
  ``out/<model>__<method>[-param=value...]/results_<date>.json`` (and the samples beside it)
  instead of lm-eval's ``out/<model>/``; a path ending in ``.json`` is left as given; the path is
  checked before the task index or the model (a file where a directory goes, an unwritable or
  empty path: one line) and a run whose results were not saved exits 2 (lm-eval never
  overwrites: its file names carry the date);
- passes an explicit ``--device`` (e.g. ``cuda:1``) to the engine as ``engine_device``, checked
  before the model loads (without it the engine picks cuda when available, else the cpu);
- follows lm-eval's ``--verbosity`` for its own messages and progress bars
  (``--verbosity WARNING`` hides both; see :mod:`hybridgen.log`);
- prints the fidelity summary (top-1 agreement and KL against ``full``) after the table when
  ``fidelity=true`` is in ``--model_args``.

Standard lm-eval tasks (piqa, arc_easy, wikitext...) run unchanged; they need the hub, so
unset ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` (the ``make`` targets set them). A missing
dataset, an unknown task, a hub-only task while the hub is off, a bad ``--model_args`` value
(checked before the model loads) or any other user error prints one line naming the fix and
exits 2.
"""
from __future__ import annotations

import logging
import os
import sys
import time
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

    from hybridgen.eval.lm_eval_args import check_model_args

    raw = getattr(ns, "model_args", None)
    args = simple_parse_args_string(raw) if isinstance(raw, str) else dict(raw or {})
    check_model_args(**args)
    device = _explicit_device(ns) or args.get("engine_device")
    if device is not None:  # --device cuda:3 reaches the engine; a device it cannot use: one line, now
        from hybridgen.model.loading import parse_device

        parse_device(str(device))
        if "engine_device" not in args:
            args["engine_device"] = str(device)
            ns.model_args = ",".join(f"{k}={v}" for k, v in args.items()) if isinstance(raw, str) or raw is None \
                else {**dict(raw), "engine_device": str(device)}
    out = getattr(ns, "output_path", None)
    if out is not None:
        check_output_path(str(out))


def _explicit_device(ns) -> Optional[str]:
    """--device when it is on the command line (lm-eval fills in "cuda:0" otherwise)."""
    given = any(a == "--device" or a.startswith("--device=") for a in sys.argv[1:])
    return getattr(ns, "device", None) if given else None


def check_output_path(out: str) -> None:
    """--output_path must be a place lm-eval can write (it would log one INFO line and exit 0)."""
    from hybridgen.validation.paths import require_path

    path = require_path("--output_path", out)
    target = path.parent if path.suffix == ".json" else path
    if path.suffix == ".json" and path.is_dir():
        from hybridgen.errors import ConfigError

        raise ConfigError(f"--output_path {out} is a directory; give a directory without .json or a new file name")
    from hybridgen.validation.paths import check_writable

    check_writable(target, name="--output_path", fix="choose another --output_path")


def saved_results(out: str, since: float) -> bool:
    """True when lm-eval wrote a results file under ``out`` (lm-eval names it results_<date>.json) after ``since``."""
    path = Path(out).expanduser()
    where = path.parent if path.suffix == ".json" else path
    pattern = f"{path.stem}_*.json" if path.suffix == ".json" else "results_*.json"
    return where.is_dir() and any(p.stat().st_mtime >= since - 1 for p in where.glob(pattern))


def _as_dict(raw) -> dict:
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(raw) if isinstance(raw, str) else dict(raw or {})


def run_dir_name(model_args: dict) -> str:
    """``<model>__<method>[-param=value...]`` for ``--model hybridgen`` model_args (loader args left out)."""
    from hybridgen.eval.lm_eval_args import LOADER_ARGS
    from hybridgen.model.hub import display_name, is_hub_id
    from hybridgen.naming import method_part, slug

    model = str(model_args.get("pretrained") or model_args.get("model") or "smollm2-135m")
    part = display_name(model) if is_hub_id(model) else Path(model).name if os.sep in model else model
    if str(model_args.get("weights", "real")) != "real":
        part += f"-{model_args['weights']}"
    skip = set(LOADER_ARGS) | {"method", "score_mode", "fidelity", "progress", "add_bos", "max_gen_toks",
                                "max_length", "rolling_prefill"}
    params = {k: v for k, v in model_args.items() if k not in skip}
    return f"{slug(part, 40)}__{method_part(str(model_args.get('method', 'full')), params)}"


def _prepare_hybridgen_run(ns) -> None:
    """``--model hybridgen``: tokenizer for the tasks, output directory named after model and method."""
    from hybridgen.model.loading import tokenizer_dir

    args = _as_dict(getattr(ns, "model_args", None))
    meta = _as_dict(getattr(ns, "metadata", None))
    if not (args.get("tokenizer") or meta.get("tokenizer")):
        tok = tokenizer_dir(str(args.get("pretrained") or args.get("model") or "smollm2-135m"),
                            str(args.get("weights", "real")))
        if tok is not None:
            meta["tokenizer"] = str(tok)
            ns.metadata = meta
    out = getattr(ns, "output_path", None)
    if out and not str(out).endswith(".json"):
        ns.output_path = str(Path(out) / run_dir_name(args) / "results.json")


def format_report(rec: dict) -> str:
    """One line of a finished ``--model hybridgen`` evaluation's fidelity against ``full``."""
    fid = rec.get("fidelity") or {}
    params = ",".join(f"{k}={v}" for k, v in sorted((rec.get("method_params") or {}).items()))
    head = f"fidelity of {rec['model']} / {rec['method']}{f' ({params})' if params else ''} against full"
    if not fid.get("tokens"):
        return (f"{head}: no tokens compared (fidelity is measured on teacher-forced loglikelihood and perplexity "
                "requests in score_mode=decode; generation tasks such as RULER have none)")
    return (f"{head}: top-1 agreement {fid['top1_agreement']:.4f}, mean KL {fid['mean_kl']:.4g}, "
            f"max KL {fid['max_kl']:.4g} over {fid['tokens']} tokens")


def _flag_value(args: Sequence[str], *names: str) -> Optional[str]:
    """The value of the last ``--name X`` / ``--name=X`` in ``args`` (before argparse runs)."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    return found


def verbosity(flag: Optional[str]) -> int:
    """The level of lm-eval's ``--verbosity`` flag, else ``$HYBRIDGEN_LOG_LEVEL``, else
    ``$LMEVAL_LOG_LEVEL``, else info (``quiet`` is accepted wherever a level is)."""
    from hybridgen import log

    for value in (flag, os.environ.get(log.ENV), os.environ.get("LMEVAL_LOG_LEVEL")):
        if value:
            return log.parse_level(value)
    return log.parse_level("info")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from hybridgen import log, runtime

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        log.hide_foreign_bars(verbosity(_flag_value(args, "--verbosity", "-v")))
    except Exception:  # noqa: BLE001 - a bad level is reported by the parse below, in one line
        pass
    runtime.apply_or_exit()  # thread/env settings, then torch (before numba; docs/design.md)
    import hybridgen.eval.lm_eval_model  # noqa: F401  (registers the `hybridgen` model)
    from hybridgen.errors import ConfigError, HybridGenError
    from hybridgen.eval.lm_eval_errors import explain
    from hybridgen.eval.tasks_data import tasks_dir

    if args[:1] not in [[c] for c in _WITH_TASKS] and not any(a in ("-h", "--help") for a in args):
        args = ["run"] + args
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    saved = sys.argv
    sys.argv = ["lm-eval"] + args
    try:
        parser = HarnessCLI()
        ns = parser.parse_args()
        level = verbosity(getattr(ns, "verbosity", None))
        setup_logging(level)      # lm-eval's logger and handler, at our level
        log.set_verbosity(level)  # ours, the bars, and transformers'
        if getattr(ns, "verbosity", None) or level != log.parse_level("info"):
            ns.verbosity = logging.getLevelName(level)  # lm-eval re-applies it ('QUIET' is not a level to it)
        if getattr(ns, "command", None) in _WITH_TASKS and hasattr(ns, "include_path"):
            ns.include_path = include_paths(ns.include_path, str(tasks_dir()))
        hybridgen_run = getattr(ns, "command", None) == "run" and getattr(ns, "model", None) == "hybridgen"
        if getattr(ns, "command", None) == "run":
            _check_hybridgen_args(ns)
        if hybridgen_run:
            _prepare_hybridgen_run(ns)
        from hybridgen.eval.lm_eval_model import REPORTS

        done = len(REPORTS)
        started = time.time()
        parser.execute(ns)
        out = getattr(ns, "output_path", None) if hybridgen_run else None
        if out and not saved_results(str(out), started):
            raise ConfigError(f"lm-eval did not save its results under --output_path {out} (a full or read-only "
                              "file system?); free space or choose another --output_path and re-run")
        for rec in REPORTS[done:]:
            if rec.get("fidelity") is not None:
                print(format_report(rec))
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
