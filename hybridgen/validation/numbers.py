"""Numbers from user input, parsed once per kind with the field's name in every refusal.

One parser per kind; each refuses booleans, non-finite values (NaN, +-inf), values a later
conversion would overflow, and values outside the kind's range, with a one-line
:class:`~hybridgen.errors.ConfigError` that names the field and what it expects:

=============  ===================================================  ===========================
kind           accepts                                              range
=============  ===================================================  ===========================
``size``       bytes: an integer, a finite number, '24GiB', '1.5 GB'  0 .. ``MAX_BYTES`` (1 EiB);
               None/'unlimited' -> None where ``allow_none``            'auto' where ``allow_auto``
``fraction``   a finite number (or numeric text)                     (0, 1] (``[0, 1]``: lo_open=False)
``seed``       an integer                                           0 .. 2**32 - 1 (numpy's limit)
``count``      an integer (``lo`` .. ``MAX_COUNT``)                   ``lo`` .. 2**31 - 1
``limit``      None or an integer >= 1                              1 .. 2**31 - 1
=============  ===================================================  ===========================

Budgets have their own grammar (:mod:`hybridgen.methods.budget`).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

from hybridgen.errors import ConfigError

MAX_SEED = 2 ** 32 - 1
MAX_COUNT = 2 ** 31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def size(field: str, value: Any, allow_none: bool = True, allow_auto: bool = False) -> Union[None, int, str]:
    """Bytes of ``field`` ('24GiB', 1e9, ...): an int in [0, MAX_BYTES], None (unlimited) or 'auto'."""
    from hybridgen.kv.tiers import parse_bytes

    if allow_auto and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, (bool, list, tuple, dict)) or not (value is None or isinstance(value, (int, float, str))):
        raise ConfigError(f"{field}={value!r} is not a size; write e.g. {field}=24GiB, 512MB or a byte count")
    try:
        n = parse_bytes(value)
    except ConfigError as err:
        raise ConfigError(f"{field}: {err}") from None
    if n is None and not allow_none:
        raise ConfigError(f"{field} needs a size, got {value!r}; write e.g. {field}=24GiB")
    return n


def fraction(field: str, value: Any, lo_open: bool = True) -> float:
    """A finite number in (0, 1] (``lo_open=False``: [0, 1])."""
    x = _finite(field, value, "a fraction")
    if (x <= 0.0 if lo_open else x < 0.0) or x > 1.0:
        raise ConfigError(f"{field} must be in {'(' if lo_open else '['}0, 1], got {value!r}")
    return x


def number(field: str, value: Any, lo: float, hi: float) -> float:
    """A finite number in [lo, hi]."""
    x = _finite(field, value, "a number")
    if not lo <= x <= hi:
        raise ConfigError(f"{field} must be in [{lo:g}, {hi:g}], got {value!r}")
    return x


def seed(field: str, value: Any) -> int:
    """A random seed: an integer in [0, 2**32 - 1] (numpy's and lm-eval's seeds are 32-bit)."""
    if not _is_int(value) or not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{field} must be an integer in [0, {MAX_SEED}], got {value!r}")
    return value


def count(field: str, value: Any, lo: int = 1, hi: int = MAX_COUNT, what: str = "") -> int:
    """An integer in [lo, hi]."""
    if not _is_int(value) or not lo <= value <= hi:
        too_big = _is_int(value) and value > hi
        bound = f"<= {hi}" if too_big else (f">= {lo}" if hi == MAX_COUNT else f">= {lo} and <= {hi}")
        kind = "" if _is_int(value) else " (a whole number)"
        raise ConfigError(f"{field} must be {bound}{kind}{what}, got {value!r}")
    return value


def limit(field: str, value: Any) -> Optional[int]:
    """None (no limit) or an integer >= 1."""
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_COUNT:
        raise ConfigError(f"{field} must be an integer >= 1 or null (no limit), got {value!r}")
    return value


def _finite(field: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{field} must be {what}, got {value!r}")
    try:
        x = float(value)
    except (ValueError, OverflowError):
        raise ConfigError(f"{field} must be {what}, got {value!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"{field} must be a finite number, got {value!r}")
    return x
