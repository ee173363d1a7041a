"""KV budgets: a ratio of the context or an absolute token count, with one grammar.

The grammar (the same from Python, ``build_method``, Hydra overrides and lm-eval
``--model_args``; documented once here and in ``docs/methods.md``):

==================  =====================================  ==================================
written             means                                  notes
==================  =====================================  ==================================
``0.2``, ``'0.2'``  ratio 0.2 of the context               a float in [0, 1]
``'20%'``           ratio 0.2                              0% .. 100%
``'512t'``          512 tokens                             also ``'512 tokens'``
``512``, ``'512'``  512 tokens                             a bare integer >= 2 is a count
``1``               refused: ambiguous                     write ``1.0`` / ``'100%'`` or ``'1t'``
``0``, ``0.0``      nothing                                refused where a method needs a token
==================  =====================================  ==================================

A ratio above 1, a negative number, NaN or inf, a boolean or any other text is refused with one
line; so is a mapping ``{ratio: 0.2}`` / ``{tokens: 512}`` whose value is not a number of that kind
(``{ratio: '0.5'}``, ``{tokens: 5.5}``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

from hybridgen.errors import ConfigError

EXAMPLES = "write e.g. 0.2 or '20%' (a ratio of the context) or '512t' (tokens)"


@dataclass(frozen=True)
class Budget:
    """A KV budget: ``ratio`` of the context (0 <= ratio <= 1) or ``tokens`` (>= 0), exactly one."""

    ratio: Optional[float] = None
    tokens: Optional[int] = None

    def __post_init__(self):
        if (self.ratio is None) == (self.tokens is None):
            raise ConfigError(f"a budget is either a ratio or a token count, not both or neither; {EXAMPLES}")
        if self.ratio is not None and (isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))):
            raise ConfigError(f"a budget ratio must be a number in [0, 1], got {self.ratio!r}; {EXAMPLES}")
        if self.tokens is not None and (isinstance(self.tokens, bool) or not isinstance(self.tokens, int)):
            raise ConfigError(f"a budget token count must be a whole number, got {self.tokens!r}; {EXAMPLES}")
        if self.ratio is not None and (not math.isfinite(self.ratio) or not 0.0 <= self.ratio <= 1.0):
            whole = math.isfinite(self.ratio) and self.ratio > 1 and self.ratio == int(self.ratio)
            hint = f"; for a token count write '{int(self.ratio)}t'" if whole else ""
            raise ConfigError(f"a budget ratio must be in [0, 1], got {self.ratio}{hint}")
        if self.tokens is not None and self.tokens < 0:
            raise ConfigError(f"a budget token count must be >= 0, got {self.tokens}")

    @classmethod
    def parse(cls, value: Union["Budget", str, float, int, dict]) -> "Budget":
        """A Budget from user input, by the grammar of the module docstring."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"ratio", "tokens"})
            if unknown:
                raise ConfigError(f"a budget has only 'ratio' or 'tokens', not {', '.join(map(repr, unknown))}")
            return cls(**{str(k): v for k, v in value.items()})
        if isinstance(value, bool) or value is None:
            raise ConfigError(f"cannot read {value!r} as a budget; {EXAMPLES}")
        if isinstance(value, float):
            return cls(ratio=value)
        if isinstance(value, int):
            return cls._count(value, str(value))
        text = str(value).strip().lower()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", text)
        if m:
            return cls(ratio=float(m.group(1)) / 100)
        m = re.fullmatch(r"([0-9]+)\s*(?:t|tokens?)", text)
        if m:
            return cls(tokens=int(m.group(1)))
        if re.fullmatch(r"[0-9]+", text):
            return cls._count(int(text), text)
        if re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.", text):
            return cls(ratio=float(text))
        raise ConfigError(f"cannot read {value!r} as a budget; {EXAMPLES}")

    @classmethod
    def _count(cls, n: int, written: str) -> "Budget":
        if n == 1:
            raise ConfigError(f"budget {written} is ambiguous; write 1.0 or '100%' for the whole context, "
                              f"or '1t' for one token")
        if n < 0:
            raise ConfigError(f"a budget token count must be >= 0, got {n}")
        return cls(tokens=n)

    @property
    def is_empty(self) -> bool:
        """True when the budget keeps nothing (ratio 0 or 0 tokens)."""
        return (self.ratio or 0.0) == 0.0 and (self.tokens or 0) == 0

    def resolve(self, context_len: int) -> int:
        """Tokens allowed for a context of ``context_len`` tokens (at least 0, at most the context)."""
        if self.tokens is not None:
            return min(self.tokens, context_len)
        return min(context_len, int(math.ceil(self.ratio * context_len)))

    def share(self, context_len: int) -> float:
        """The budget as a fraction of ``context_len`` (a token count divided by it, capped at 1)."""
        if self.ratio is not None:
            return float(self.ratio)
        return min(1.0, self.tokens / max(context_len, 1))

    def __str__(self) -> str:
        """Text that parses back to this budget: '0.2', '1.0', '0.0' or '512t'."""
        if self.tokens is not None:
            return f"{self.tokens}t"
        text = repr(float(self.ratio))
        return text if "e" not in text else f"{self.ratio * 100:.10g}%"
