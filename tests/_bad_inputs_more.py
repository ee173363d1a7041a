"""The hand cases of issue 25's "Why" (numbers at the edges, model configs, caches, paths, sweeps,
outputs), added to ``CASES`` of tests/test_reliability_bad_inputs.py and to docs/bad_inputs.md."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import _reliability_models as rm


def _ckpt_config(**changes):
    def setup(tmp: Path) -> None:
        p = rm.write_checkpoint(tmp / "ckpt")
        cfg = json.loads((p / "config.json").read_text())
        cfg.update(changes)
        (p / "config.json").write_text(json.dumps(cfg))
    return setup


def _cache_with_manifest(damage=None):
    def setup(tmp: Path) -> None:
        from hybridgen.model import cache_integrity

        p = rm.fake_smollm2_cache(tmp / "cache")
        (p / "tokenizer.json").write_text(json.dumps({"version": "1.0"}) + " " * 100)
        cache_integrity.write_manifest(p)
        cache_integrity._VERIFIED.clear()
        if damage is not None:
            damage(p)
    return setup


def _zeros_in_embedding(p: Path) -> None:
    f = p / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n:8 + n + min(4 * 2 ** 20, len(raw) - 8 - n)] = bytes(min(4 * 2 ** 20, len(raw) - 8 - n))
    f.write_bytes(bytes(raw))


def _truncate_tokenizer(p: Path) -> None:
    (p / "tokenizer.json").write_text('{"vers')


def _dangling_cache(tmp: Path) -> None:
    (tmp / "cache" / "models").mkdir(parents=True)
    (tmp / "cache" / "models" / "smollm2-135m").symlink_to(tmp / "gone")


def _dangling(tmp: Path) -> None:
    (tmp / "dangling").symlink_to(tmp / "gone")


def _empty_metrics(tmp: Path) -> None:
    d = tmp / "agg" / "quickstart" / "run1"
    d.mkdir(parents=True)
    (d / "DONE").write_text("x\n")
    (d / "metrics.json").write_text("{}")


def _touch(name):
    return lambda tmp: (tmp / name).write_text("x")


def _validate_json_exists(tmp: Path) -> None:
    from hybridgen_harness.perf import validate

    (tmp / "v.json").write_text("keep")
    validate.main.__wrapped__(["--json", str(tmp / "v.json"), "--quick", "--no-local"])


def _validate_zero_steps(tmp: Path) -> None:
    from hybridgen_harness.perf import validate

    validate.main.__wrapped__(["--json", str(tmp / "v.json"), "--quick", "--steps", "0"])


def _negative_probe(tmp: Path) -> None:
    from hybridgen_harness.perf.probe_rows import Row

    Row("host read (torch.sum)", "gpu_probe.json", 0.01, -0.02)


def more_cases(Case, REAL) -> List:
    cache_env = {"HYBRIDGEN_CACHE": "{tmp}/cache"}
    return [
        # ---------------------------------------------------------------- numbers at the edges
        Case("gpu-kv-overflow", "run", ["memory.gpu_kv=1e309GiB"], "memory.gpu_kv: a size must be at most 1 EiB"),
        Case("budget-inf", "run", ["method=h2o", "method.params.budget=inf"], "parameter 'budget'"),
        Case("gpu-kv-fraction-nan", "run", ["hardware.gpu_kv_fraction=nan"], "hardware.gpu_kv_fraction must be a finite"),
        Case("seed-huge", "run", ["seed=99999999999999999999"], "seed must be an integer in [0, 4294967295]"),
        Case("limit-negative", "run", ["exp.accuracy.limit=-3"], "exp.accuracy.limit must be an integer >= 1"),
        Case("budget-mapping-ratio-text", "run", ["method=snapkv", "method.params.budget={ratio:'0.5'}"],
             "a budget ratio must be a number"),
        Case("budget-mapping-tokens-float", "run", ["method=quest", "method.params.budget={tokens:5.5}"],
             "a budget token count must be a whole number"),
        Case("gpu-capacity-banana", "run", ["hardware.gpu_capacity=banana"], "hardware.gpu_capacity: cannot read"),
        Case("batch-huge", "run", ["workload.batch=99999999999999999999"], "workload.batch must be <= 2147483647"),
        # ---------------------------------------------------------------- sweeps, paths, cross-field
        Case("sweep-glob-no-point", "run", ["method=glob(zz*)"], "expands to no point"),
        Case("sweep-range-no-point", "run", ["workload.batch=range(5,1)"], "expands to no point"),
        Case("results-dir-empty", "run", ["results_dir=''"], "results_dir is empty"),
        Case("results-dir-dangling-link", "run", ["results_dir={tmp}/dangling/r"], "symbolic link to nothing",
             setup=_dangling, shown="results_dir=<a dangling link>/r"),
        Case("quest-dense-layers-past-model", "run", ["method=quest", "method.params.dense_layers=5",
                                                      "model.num_layers=2"], "covers all 2 layer(s)"),
        Case("num-layers-past-model", "run", ["model.num_layers=31"], "exceeds smollm2-135m's 30 layers"),
        # ---------------------------------------------------------------- model configs
        Case("config-zero-heads", "run", ["model.name={tmp}/ckpt"], "key 'num_attention_heads' must be a positive",
             base=REAL, setup=_ckpt_config(num_attention_heads=0), shown="model.name=<config.json with 0 heads>"),
        Case("config-string-heads", "run", ["model.name={tmp}/ckpt"], "key 'num_attention_heads'", base=REAL,
             setup=_ckpt_config(num_attention_heads="4"), shown="model.name=<config.json with heads '4'>"),
        Case("config-string-rope-theta", "run", ["model.name={tmp}/ckpt"], "key 'rope_theta'", base=REAL,
             setup=_ckpt_config(rope_theta="10000"), shown="model.name=<config.json with rope_theta '10000'>"),
        # ---------------------------------------------------------------- caches
        Case("cache-zeros-in-embedding", "run", [], "does not match the checksum recorded at conversion",
             env=cache_env, base=REAL, setup=_cache_with_manifest(_zeros_in_embedding),
             shown="model cache with zeros written over the embedding (sizes and headers intact)"),
        Case("cache-truncated-tokenizer", "run", [], "tokenizer.json is 6 bytes", env=cache_env, base=REAL,
             setup=_cache_with_manifest(_truncate_tokenizer), shown="model cache with a truncated tokenizer.json"),
        Case("cache-dangling-link", "run", [], "is a symbolic link to nothing", env=cache_env, base=REAL,
             setup=_dangling_cache, shown="model cache path that is a dangling symlink"),
        Case("cache-path-is-a-file", "run", [], "is a file, not a directory", env={"HYBRIDGEN_CACHE": "{tmp}/afile"},
             base=REAL, setup=_touch("afile"), shown="HYBRIDGEN_CACHE=<a file>"),
        # ---------------------------------------------------------------- outputs
        Case("aggregate-empty-metrics", "aggregate", ["quickstart", "--results-dir", "{tmp}/agg"],
             "lacks what a finished run writes", setup=_empty_metrics, shown="a finished run whose metrics.json is {}"),
        Case("lm-eval-output-path-file", "lm-eval", ["--model_args", "model={tmp}/ckpt", "--tasks", "hg_ppl_pydoc",
                                                     "--output_path", "{tmp}/afile"], "is a file, not a directory",
             setup=lambda tmp: (rm.write_checkpoint(tmp / "ckpt"), (tmp / "afile").write_text("x")),
             shown="hybridgen-lm-eval ... --output_path <an existing file>"),
        Case("lm-eval-device", "lm-eval", ["--model_args", "model={tmp}/ckpt", "--tasks", "hg_ppl_pydoc",
                                           "--device", "cuda:3"], "cuda", setup=lambda tmp: rm.write_checkpoint(tmp / "ckpt"),
             shown="hybridgen-lm-eval ... --device cuda:3 (no such device)"),
        Case("validate-json-exists", "library", call=_validate_json_exists, expect="already exists; pass --force",
             shown="python -m hybridgen_harness.perf.validate --json <an existing file>"),
        Case("validate-zero-steps", "library", call=_validate_zero_steps, expect="--steps 0 must be at least 1",
             shown="python -m hybridgen_harness.perf.validate --steps 0"),
        Case("probe-time-negative", "library", call=_negative_probe, expect="a time must be a positive finite number",
             shown="a probe file with a negative time"),
    ]
