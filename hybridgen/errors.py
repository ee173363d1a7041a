"""User-facing errors.

Every error a user can cause (bad config, unknown name, impossible budget, missing files) is
raised as a :class:`HybridGenError` whose message is ONE line that names the fix. Entry points
catch it and print ``error: <message>`` instead of a stack trace.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, Iterable, TypeVar

F = TypeVar("F", bound=Callable)


class HybridGenError(Exception):
    """An error caused by the user's input; its message is one line naming the fix."""


class ConfigError(HybridGenError):
    """A malformed or inconsistent configuration value."""


class CapacityError(HybridGenError):
    """A memory tier cannot hold what was asked of it."""


class MissingDataError(HybridGenError):
    """A model, dataset or file that the run needs is not on disk."""


class NumericalError(HybridGenError):
    """Computed numbers that cannot be right (NaN or inf logits): the run stops, nothing is recorded."""


def unknown_name(kind: str, name: str, known: Iterable[str]) -> HybridGenError:
    """Error for an unknown registry key, listing the valid choices."""
    return ConfigError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(known))}")


def cli_errors(fn: F) -> F:
    """Decorator for entry points: a HybridGenError exits with status 2 and one line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HybridGenError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]
