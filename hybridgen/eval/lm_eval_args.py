"""The lm-eval adapter's ``--model_args``, checked without loading a model or importing lm-eval.

:func:`check_model_args` parses the adapter's own arguments and builds the method once (so a bad
method parameter fails in one line before any weights load); :data:`LOADER_ARGS` are the
arguments the model loader (or lm-eval's own plumbing) takes, never method parameters.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from hybridgen.errors import ConfigError

_TRUE, _FALSE = ("true", "1", "yes", "y", "on"), ("false", "0", "no", "n", "off")
def as_bool(value: Any, name: str, allow_none: bool = False) -> Optional[bool]:
    """``value`` (bool, 0/1, or a string such as 'false') as a bool; None passes when ``allow_none``."""
    if value is None or (allow_none and isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        if allow_none:
            return None
        raise ConfigError(f"{name} must be true or false, got None")
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    extra = " (or unset)" if allow_none else ""
    raise ConfigError(f"{name} must be true or false{extra}, got {value!r}")


def check_model_args(method: str = "full", score_mode: str = "decode", rolling_prefill: Any = 0.5,
                     fidelity: Any = False, add_bos: Any = None, progress: Any = True, max_gen_toks: Any = 32,
                     max_length: Any = None, **kwargs: Any) -> Dict[str, Any]:
    """Check the adapter's arguments without loading a model; returns the parsed values.

    Raises a one-line ConfigError for an unknown method or parameter, a bad score_mode,
    rolling_prefill, boolean or integer. kwargs: the method's parameters (model-loading
    arguments such as ``model`` or ``dtype`` are left to the loader and ignored here).
    """
    from hybridgen.methods import build_method

    params = {k: v for k, v in kwargs.items() if k not in LOADER_ARGS}
    build_method(str(method), **dict(params))  # fail now, in one line
    if score_mode not in ("decode", "prefill"):
        raise ConfigError(f"score_mode must be 'decode' or 'prefill', got {score_mode!r}")
    try:
        share = float(rolling_prefill)
    except (TypeError, ValueError):
        raise ConfigError(f"rolling_prefill must be a number in (0, 1), got {rolling_prefill!r}") from None
    if not 0.0 < share < 1.0:
        raise ConfigError(f"rolling_prefill must lie in (0, 1), got {rolling_prefill}")
    ints = {}
    for name, val in (("max_gen_toks", max_gen_toks), ("max_length", max_length)):
        if val is None:
            ints[name] = None
            continue
        try:
            ints[name] = int(val)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a whole number, got {val!r}") from None
        if ints[name] < 1:
            raise ConfigError(f"{name} must be >= 1, got {val!r}")
    return {"method": str(method), "method_params": params, "score_mode": score_mode, "rolling_prefill": share,
            "fidelity": as_bool(fidelity, "fidelity"), "add_bos": as_bool(add_bos, "add_bos", allow_none=True),
            "progress": as_bool(progress, "progress"), **ints}


#: arguments of the model loader (and of lm-eval's own model plumbing), not method parameters
LOADER_ARGS = ("model", "weights", "dtype", "num_layers", "seed", "batch_size", "engine", "pretrained",
                "max_batch_size", "device", "trust_remote_code", "tokenizer", "engine_device")
