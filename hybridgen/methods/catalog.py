"""What ``hybridgen methods`` prints: every registered method with its parameters.

Read from the methods' dataclasses (the registry's classes), never restated: a parameter's
name, its type as declared (with a constraint or the choices spelled out) and its default.

    from hybridgen.methods.catalog import describe, format_catalog
    describe("h2o")[0]  # Param(name='budget', type='KeptBudget (Budget, ...)', default='Budget(...)')
    print(format_catalog())
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import List, Optional, Sequence

from hybridgen.methods.registry import available_methods, method_class


@dataclass(frozen=True)
class Param:
    """One parameter of a method: its name, type text and default text."""

    name: str
    type: str
    default: str


def _type_text(hint: object, declared: str) -> str:
    """The declared annotation, with an alias's meaning: ``Fraction`` -> ``Fraction (float in [0, 1])``."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        base, *marks = typing.get_args(hint)
        said = [m.describe() if hasattr(m, "describe") else type(m).__name__ for m in marks]
        inner = " ".join([getattr(base, "__name__", str(base))] + said)
        plain = declared == getattr(base, "__name__", None) or declared.startswith("Annotated")
        return inner if plain else f"{declared} ({inner})"
    if origin is typing.Literal:
        choices = " | ".join(repr(c) for c in typing.get_args(hint))
        return choices if declared.startswith("Literal") else f"{declared} ({choices})"
    return declared


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(field.default_factory())  # type: ignore[misc]
    return "(required)"


def describe(name: str) -> List[Param]:
    """The parameters of method ``name``, in declaration order."""
    cls = method_class(name)
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - an outside method's annotation we cannot resolve: show it as written
        hints = {}
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        declared = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(Param(f.name, _type_text(hints.get(f.name, f.type), declared), _default_text(f)))
    return out


def summary(name: str) -> str:
    """The first line of the method's docstring ('' when it has none)."""
    doc = (method_class(name).__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def format_catalog(names: Optional[Sequence[str]] = None) -> str:
    """Every registered method (or ``names``): a heading line, then one line per parameter."""
    blocks = []
    for name in (list(names) if names is not None else available_methods()):
        params = describe(name)
        head = f"{name}: {summary(name)}".rstrip(": ")
        if not params:
            blocks.append(f"{head}\n    (no parameters)")
            continue
        width = max(len(p.name) for p in params)
        twidth = max(len(p.type) for p in params)
        lines = [f"    {p.name:<{width}}  {p.type:<{twidth}}  default {p.default}" for p in params]
        blocks.append("\n".join([head, *lines]))
    return "\n".join(blocks)
