"""The keys of a checkpoint's ``config.json`` checked before any arithmetic uses them.

A config with 0 heads, a head count written as text or a rope theta of "big" would otherwise end
in ZeroDivisionError / TypeError / ValueError deep in the model build; :func:`check_hf_config`
makes each one line naming the file and the key. Checked when present (the architecture readers
in :mod:`hybridgen.model.spec` say which keys are required):

- positive integers: ``POSITIVE_INTS`` (sizes, heads, layers, vocab, positions);
- positive finite numbers: ``rope_theta``, ``rms_norm_eps``, ``layer_norm_eps``; every number of
  ``rope_scaling`` / ``rope_parameters`` finite and >= 0 (``factor`` and ``rope_theta`` > 0);
- token ids (``bos_token_id``, ``pad_token_id``, ``eos_token_id`` or a list of them): integers >= 0;
- ``num_attention_heads`` a multiple of ``num_key_value_heads``; without ``head_dim``,
  ``hidden_size`` a multiple of ``num_attention_heads``.
"""
from __future__ import annotations

import math
from typing import Any, Dict

from hybridgen.errors import ConfigError

POSITIVE_INTS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_hidden_layers", "intermediate_size", "ffn_dim", "max_position_embeddings",
                 "word_embed_proj_dim")
POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_eps")
TOKEN_IDS = ("bos_token_id", "pad_token_id", "eos_token_id")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_hf_config(cfg: Any, where: str) -> Dict[str, Any]:
    """``cfg`` (the contents of the file ``where``) when its keys are usable; ConfigError otherwise."""
    fix = "fix the file or re-download the checkpoint"
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where} holds a {type(cfg).__name__}, not a JSON object of model settings; {fix}")

    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{where}: key {key!r} must be {what}, got {cfg_get(key)!r}; {fix}")

    def cfg_get(key: str) -> Any:
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    for key in POSITIVE_INTS:
        if cfg.get(key) is not None and not (_int(cfg[key]) and cfg[key] > 0):
            raise bad(key, "a positive integer")
    for key in POSITIVE_FLOATS:
        v = cfg.get(key)
        if v is not None and not (_number(v) and v > 0):
            raise bad(key, "a positive finite number")
    for section in ("rope_scaling", "rope_parameters"):
        node = cfg.get(section)
        if node is not None and not isinstance(node, dict):
            raise bad(section, "an object (or null)")
        for k, v in (node or {}).items():
            if k in ("type", "rope_type") or v is None or isinstance(v, (list, dict)):
                continue
            if not (_number(v) and v >= 0) or (k in ("factor", "rope_theta") and v == 0):
                raise bad(f"{section}.{k}", "a positive finite number")
    for key in TOKEN_IDS:
        v = cfg.get(key)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_int(i) and i >= 0 for i in ids):
            raise bad(key, "a token id (an integer >= 0), a list of them, or null")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: key 'num_attention_heads' ({heads}) must be a multiple of "
                          f"'num_key_value_heads' ({kv}); {fix}")
    hidden = cfg.get("hidden_size")
    if heads and hidden and cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: key 'hidden_size' ({hidden}) must be a multiple of 'num_attention_heads' "
                          f"({heads}) when 'head_dim' is not given; {fix}")
    return cfg
