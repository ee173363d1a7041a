"""KV methods: the protocol, budgets, typed parameters and the registry.

    from hybridgen.methods import build_method, available_methods
    method = build_method("h2o", budget="20%")

The protocol (:class:`KVMethod`, :class:`MethodContext`) is in ``protocol.py``, the budget
grammar in ``budget.py``, parameter conversion in ``params.py``, the entry-point registry in
``registry.py`` and the reference method ``full`` in ``full.py``. Baselines and HybridGen are
found through the ``hybridgen.methods`` entry-point group like any other package's methods.
"""
from hybridgen.methods.budget import Budget
from hybridgen.methods.params import (Fraction, HostTier, KeptBudget, NonEmpty, NonNegInt, ParamError, PositiveInt,
                                     Range, Tier)
from hybridgen.methods.protocol import KVMethod, MethodContext
from hybridgen.methods.registry import (available_methods, build_method, method_class, method_parameters,
                                       parse_method_spec, register)

__all__ = ["Budget", "Fraction", "HostTier", "KVMethod", "KeptBudget", "MethodContext", "NonEmpty", "NonNegInt", "ParamError",
           "PositiveInt", "Range", "Tier", "available_methods", "build_method", "method_class", "method_parameters",
           "parse_method_spec", "register"]
