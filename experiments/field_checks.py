"""The numeric fields of a run config, each through its kind's parser (hybridgen.validation.numbers).

:func:`check_fields` is called by :func:`experiments.validate.validate` before anything else needs
the numbers, so an edge value (NaN, inf, an overflowing size, a 21-digit seed, a negative limit)
is one line naming the field instead of a traceback deep in the run. Fields and their kinds:

- sizes: ``hardware.gpu_memory``, ``hardware.{gpu,dram,cxl}_capacity`` (null = unlimited;
  gpu_capacity also 'auto'), ``memory.gpu_kv`` (null or 'auto' or a size);
- fraction in (0, 1]: ``hardware.gpu_kv_fraction``; in (0, 1): ``exp.accuracy.rolling_prefill``;
- seed in [0, 2**32 - 1]: ``seed``;
- counts >= 1: ``workload.{batch,prompt_len,gen_len}``, ``exp.repeats``, ``exp.accuracy.{max_length,
  max_gen_toks,needle_samples}``, every ``needle_lengths`` / ``ruler_lengths`` entry; >= 0:
  ``exp.accuracy.num_fewshot``; limits (null or >= 1): ``exp.accuracy.limit``, ``ppl_max_docs``;
- ``exp.accuracy.needle_depths``: each a percent in [0, 100].
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from hybridgen.errors import ConfigError
from hybridgen.validation import numbers

SIZES = ("hardware.gpu_memory", "hardware.dram_capacity", "hardware.cxl_capacity")
COUNTS = ("workload.batch", "workload.prompt_len", "workload.gen_len", "exp.repeats",
          "exp.accuracy.max_length", "exp.accuracy.max_gen_toks", "exp.accuracy.needle_samples")
LIMITS = ("exp.accuracy.limit", "exp.accuracy.ppl_max_docs")
COUNT_LISTS = ("exp.accuracy.needle_lengths", "exp.accuracy.ruler_lengths")


def check_fields(cfg: DictConfig) -> None:
    """Every numeric field of ``cfg`` parsed by its kind; ConfigError (one line, naming it) on the first bad one."""
    get = lambda path: OmegaConf.select(cfg, path, default=None)  # noqa: E731
    numbers.seed("seed", get("seed"))
    for path in SIZES:
        numbers.size(path, get(path))
    numbers.size("hardware.gpu_capacity", get("hardware.gpu_capacity"), allow_auto=True)
    numbers.size("memory.gpu_kv", get("memory.gpu_kv"), allow_auto=True)
    numbers.fraction("hardware.gpu_kv_fraction", get("hardware.gpu_kv_fraction"))
    rolling = numbers.fraction("exp.accuracy.rolling_prefill", get("exp.accuracy.rolling_prefill"))
    if rolling >= 1.0:
        raise ConfigError(f"exp.accuracy.rolling_prefill must be in (0, 1), got {rolling}")
    for path in COUNTS:
        numbers.count(path, get(path))
    numbers.count("exp.accuracy.num_fewshot", get("exp.accuracy.num_fewshot"), lo=0)
    for path in LIMITS:
        numbers.limit(path, get(path))
    for path in COUNT_LISTS:
        for i, v in enumerate(get(path) or []):
            numbers.count(f"{path}[{i}]", v)
    for i, v in enumerate(get("exp.accuracy.needle_depths") or []):
        numbers.number(f"exp.accuracy.needle_depths[{i}]", v, 0.0, 100.0)
    threads = get("hardware.threads")
    if threads is not None:
        numbers.count("hardware.threads", threads, hi=4096, what=" (torch CPU threads) or null")
    layers = get("model.num_layers")
    if layers is not None:
        numbers.count("model.num_layers", layers, what=" or null")
