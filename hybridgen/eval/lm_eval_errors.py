"""One-line errors for lm-eval failures a user causes: an unknown task, or a task whose data
only the Hugging Face hub has while the hub is off (offline variables, no network).

lm-eval reports these as a ``ValueError("Tasks not found: ...")`` or as the ``datasets``
library's ``ConnectionError`` deep inside task construction; :func:`explain` turns them (or a
:class:`~hybridgen.errors.HybridGenError` anywhere in the exception's cause chain) into one
:class:`~hybridgen.errors.HybridGenError` that names the fix, and returns None for anything
else (a bug: the caller re-raises it with its trace).
"""
from __future__ import annotations

import os
import re
from typing import Iterator, Optional

from hybridgen.errors import ConfigError, HybridGenError, MissingDataError

_OFFLINE_TYPES = ("OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError", "ConnectionError",
                  "HFValidationError")


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _offline_switches() -> str:
    on = [k for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(k, "").strip() not in ("", "0")]
    return f" ({' and '.join(k + '=1' for k in on)} {'are' if len(on) > 1 else 'is'} set)" if on else ""


def explain(err: BaseException) -> Optional[HybridGenError]:
    """The one-line user error behind ``err``, or None when it is not one."""
    for e in _chain(err):
        if isinstance(e, HybridGenError):
            return e
    for e in _chain(err):
        text = str(e)
        m = (re.search(r"Tasks not found: (.+)", text)
             or re.search(r"Spec '([^']+)' is not a registered task", text))
        if isinstance(e, (ValueError, KeyError)) and m:
            names = m.group(1).strip().splitlines()[0]
            return ConfigError(f"unknown lm-eval task(s): {names}; list the known ones with `hybridgen-lm-eval ls "
                               "tasks` (hybridgen's own start with hg_; add a directory of task YAMLs with "
                               "--include_path DIR)")
        offline = type(e).__name__ in _OFFLINE_TYPES or "OfflineModeIsEnabled" in text or "Couldn't reach" in text
        if offline:
            m = re.search(r"reach '([^']+)'", text) or re.search(r"dataset '?([\w./-]+)'? (?:doesn't|does not)", text)
            what = f"dataset {m.group(1)!r}" if m else "its dataset"
            return MissingDataError(f"this lm-eval task needs {what} from the Hugging Face hub, which is not reachable"
                                    f"{_offline_switches()}; run with a network and those variables unset, or use "
                                    "a local task (hg_*, see hybridgen/eval/tasks)")
    return None
