"""Method parameters converted and checked from their declared types, whatever the entry point.

A method is a dataclass of its hyper-parameters. When it is constructed (directly in Python,
through :func:`hybridgen.methods.build_method`, from Hydra's ``method.params`` or lm-eval's
``--model_args``), every field is converted from its annotation by :func:`coerce_fields`:

- ``bool``: True/False; 'true'/'false', 'yes'/'no', 'on'/'off', '1'/'0' (any case) and the
  integers 1/0 with their plain meaning; anything else is refused;
- ``int``: an int or integer text ('256') with |x| < 2**63; floats, booleans and other text are refused;
- ``float``: an int, a float or numeric text; NaN, +-inf, booleans and other text are refused;
- ``str``: text only; ``Literal[...]``: one of the listed choices;
- ``Budget``: parsed by its grammar (:mod:`hybridgen.methods.budget`) because of its type;
- ``Optional[X]``: None, or 'null'/'none' text, or an X;
- ``Annotated[X, Range(...)]`` / ``Annotated[Budget, NonEmpty()]``: the value is also checked.

Each refusal is a :class:`hybridgen.errors.ConfigError` of one line naming the method, the
parameter, what it expects and what it got. Aliases for the common constrained types:
``NonNegInt``, ``PositiveInt``, ``Fraction`` (a float in [0, 1]), ``KeptBudget``, and the tier
names ``Tier`` ('gpu' | 'dram' | 'cxl') and ``HostTier`` ('dram' | 'cxl').
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Dict, Literal, Optional, Tuple, Union

from hybridgen.errors import ConfigError
from hybridgen.methods.budget import Budget

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NONE_WORDS = ("null", "none")
INT_LIMIT = 2 ** 63


@dataclass(frozen=True)
class Range:
    """A numeric constraint: lo <= x <= hi (``lo_open`` / ``hi_open`` make a bound strict);
    ``inf_ok``: +inf is a meaningful value (e.g. a margin with no limit), else refused."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    inf_ok: bool = False

    def check(self, x: float) -> Optional[str]:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return self.describe()
        if self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi):
            return self.describe()
        return None

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"


@dataclass(frozen=True)
class NonEmpty:
    """A budget constraint: it must keep at least one token (not 0, '0%' or '0t')."""

    def check(self, b: Budget) -> Optional[str]:
        return "at least one token (a ratio > 0 or '1t' and more)" if b.is_empty else None


NonNegInt = Annotated[int, Range(lo=0)]
PositiveInt = Annotated[int, Range(lo=1)]
Fraction = Annotated[float, Range(0.0, 1.0)]
KeptBudget = Annotated[Budget, NonEmpty()]
Tier = Literal["gpu", "dram", "cxl"]
HostTier = Literal["dram", "cxl"]


class ParamError(ConfigError):
    """A method parameter of the wrong type or out of range."""


def _fail(method: str, name: str, expected: str, value: Any) -> ParamError:
    return ParamError(f"method {method!r}: parameter {name!r} expects {expected}, got {value!r}")


def _strip(tp: Any) -> Tuple[Any, Tuple[Any, ...]]:
    """(base type, constraints) of a possibly Annotated type."""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(meta)
    return tp, ()


def _describe(tp: Any) -> str:
    base, meta = _strip(tp)
    if typing.get_origin(base) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(base))
    words = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "text",
             Budget: "a budget (e.g. 0.2, '20%' or '512t')"}
    text = words.get(base, getattr(base, "__name__", str(base)))
    limits = [m.describe() for m in meta if isinstance(m, Range)]
    return text + (" " + " ".join(limits) if limits else "")


def convert(method: str, name: str, tp: Any, value: Any) -> Any:
    """``value`` converted to the declared type ``tp`` of parameter ``name`` (see module doc)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if type(None) in args:
            if value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS):
                return None
            rest = [a for a in args if a is not type(None)]
            inner = rest[0] if len(rest) == 1 else Union[tuple(rest)]
            try:
                return convert(method, name, inner, value)
            except ParamError:
                raise _fail(method, name, _describe(inner) + " or null", value) from None
        raise TypeError(f"method {method!r}: parameter {name!r} has an unsupported Union type {tp}")
    base, meta = _strip(tp)
    inf_ok = base is float and any(isinstance(m, Range) and m.inf_ok for m in meta)
    out = _convert_base(method, name, base, value, inf_ok)
    for m in meta:
        problem = m.check(out)
        if problem:
            raise _fail(method, name, f"{_describe(base)} {problem}" if isinstance(m, Range) else problem, value)
    return out


def _convert_base(method: str, name: str, base: Any, value: Any, inf_ok: bool = False) -> Any:
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value in choices and not isinstance(value, bool):
            return value
        raise _fail(method, name, _describe(base), value)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS
        raise _fail(method, name, _describe(bool) + " (also yes/no, on/off, 1/0)", value)
    if base is int:
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):  # ASCII digits ('²' is a digit too)
            value = int(value.strip())
        if isinstance(value, int) and not isinstance(value, bool):
            if not -INT_LIMIT <= value < INT_LIMIT:  # torch and numpy would overflow on it later
                raise _fail(method, name, "an integer of at most 63 bits (|x| < 2**63)", value)
            return value
        raise _fail(method, name, "an integer", value)
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            x = float(value)
        elif isinstance(value, str):
            try:
                x = float(value.strip())
            except ValueError:
                raise _fail(method, name, "a number", value) from None
        else:
            raise _fail(method, name, "a number", value)
        if not math.isfinite(x) and not (inf_ok and x == math.inf):
            what = "a number (inf allowed, not NaN or -inf)" if inf_ok else "a finite number (not NaN or inf)"
            raise _fail(method, name, what, value)
        return x
    if base is str:
        if isinstance(value, str):
            return value
        raise _fail(method, name, "text", value)
    if base is Budget:
        try:
            return Budget.parse(value)
        except ConfigError as err:
            raise ParamError(f"method {method!r}: parameter {name!r}: {err}") from None
    return value  # other declared types (e.g. a user's own dataclass) pass through unchecked


def field_types(cls: type) -> Dict[str, Any]:
    """{field name: declared type (with Annotated extras)} of the init fields of a method class."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def coerce_fields(obj: Any, method: str) -> None:
    """Convert and check every init field of the dataclass instance ``obj`` in place."""
    for name, tp in field_types(type(obj)).items():
        if tp is Any:
            continue
        setattr(obj, name, convert(method, name, tp, getattr(obj, name)))
