"""The method registry: methods are found through the ``hybridgen.methods`` entry-point group.

A package (this project included) declares its methods in its packaging metadata::

    [project.entry-points."hybridgen.methods"]
    pyramidkv = "my_package.pyramidkv:PyramidKV"

and from then on ``build_method("pyramidkv", ...)`` works everywhere a built-in does: the
Hydra experiments (``method.name=pyramidkv``), ``hybridgen-lm-eval --model_args
method=pyramidkv``, the benchmarks and the projections. Entry points are loaded lazily, on the
first use of their name. :func:`register` adds a class in-process (notebooks, tests) without
packaging.

When this project runs from a source checkout (installed editable, or never installed, as
the GPU script on a bare machine), the ``hybridgen.methods`` table of the checkout's
``pyproject.toml`` is read as well, so a method declared there is found without
reinstalling and the declaration stays in one place.
"""
from __future__ import annotations

import dataclasses
import importlib
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple, Type

from hybridgen.errors import ConfigError, unknown_name
from hybridgen.methods.protocol import KVMethod

GROUP = "hybridgen.methods"
_loaded: Dict[str, Type[KVMethod]] = {}      # name -> class, loaded or registered in-process
_declared: Dict[str, str] = {}               # name -> "module:attr", from entry points


def _scan() -> None:
    """Refresh ``_declared`` from the installed entry points (and the checkout's pyproject)."""
    _declared.clear()
    for ep in metadata.entry_points(group=GROUP):
        _declared.setdefault(ep.name, ep.value)
    # a source checkout (installed editable, or not at all) declares what its pyproject says
    # NOW, and that wins over the installed metadata, which may be stale (a method moved or
    # added since the install is found without reinstalling)
    _declared.update(pyproject_entry_points(GROUP))


def pyproject_entry_points(group: str) -> Dict[str, str]:
    """The ``[project.entry-points.<group>]`` table of this source checkout's pyproject ({} when installed)."""
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10: an installed package has its entry points anyway
        return {}
    if not path.exists():
        return {}
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    return dict(data.get("project", {}).get("entry-points", {}).get(group, {}))


def _load(name: str, target: str) -> Type[KVMethod]:
    module, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"method {name!r} is declared as {target!r} but cannot be loaded "
                          f"({type(err).__name__}: {err}); reinstall the package that declares it") from None
    if not (isinstance(obj, type) and issubclass(obj, KVMethod) and dataclasses.is_dataclass(obj)):
        raise ConfigError(f"method {name!r} ({target}) is not a KVMethod dataclass")
    if obj.__dict__.get("name", name) != name:
        raise ConfigError(f"method {name!r} ({target}) calls itself {obj.name!r}; make the entry-point "
                          f"name and the class's `name` agree")
    obj.name = name
    return obj


def register(name: str) -> Callable[[Type[KVMethod]], Type[KVMethod]]:
    """Class decorator: make a method constructible by name in this process (no packaging)."""

    def deco(cls: Type[KVMethod]) -> Type[KVMethod]:
        if name in _loaded and _loaded[name] is not cls:
            raise ConfigError(f"method {name!r} registered twice")
        cls.name = name
        _loaded[name] = cls
        return cls

    return deco


def available_methods() -> List[str]:
    """Names of every registered method (entry points and in-process registrations), sorted."""
    _scan()
    return sorted(set(_declared) | set(_loaded))


def method_class(name: str) -> Type[KVMethod]:
    """The class registered as ``name``; an unknown name fails in one line listing the known ones."""
    if not isinstance(name, str):
        raise ConfigError(f"a method name is text, got {name!r}")
    if name in _loaded:
        return _loaded[name]
    if name not in _declared:
        _scan()
    if name not in _declared:
        if "," in name:
            raise ConfigError(f"unknown method {name!r}: to run several methods, sweep with -m "
                              f"(`-m method={name}`)")
        raise unknown_name("method", name, available_methods())
    cls = _load(name, _declared[name])
    _loaded[name] = cls
    return cls


def method_parameters(name: str) -> List[str]:
    """The parameter names of method ``name``."""
    return [f.name for f in dataclasses.fields(method_class(name)) if f.init]


def build_method(name: str, **params: Any) -> KVMethod:
    """A fresh method instance by registry name, composed as its parameters say (an evicting
    method's ``offload`` wraps it in Offloaded); unknown names or bad parameters fail in one line."""
    cls = method_class(name)
    known = method_parameters(name)
    bad = sorted(set(params) - set(known))
    if bad:
        raise ConfigError(f"method {name!r} has no parameter {', '.join(map(repr, bad))}; "
                          f"its parameters are: {', '.join(sorted(known)) or 'none'}")
    return cls(**params).composed()


def parse_method_spec(spec: str) -> Tuple[str, Dict[str, str]]:
    """``NAME[:key=value...]`` (e.g. ``hybridgen:gpu_budget=0.07``, the command-line form of a method
    with parameters) -> (NAME, {key: value}); the values stay strings for :func:`build_method` to check."""
    name, *pairs = str(spec).split(":")
    extra: Dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"method parameter {pair!r} is not key=value; write e.g. hybridgen:gpu_budget=0.07")
        extra[key] = value
    return name, extra
