"""Lean decoder engine for OPT, Llama (GQA, Llama-3 RoPE) and Qwen2 with pluggable KV methods.

    from hybridgen.model import load_model
    engine = load_model("smollm2-135m")                    # real weights (prepared on first use)
    engine = load_model("opt-13b", weights="dummy", num_layers=4)
    ids, mask = engine.encode(["Hello"])
    result = engine.generate(ids, "full", max_new_tokens=16, attention_mask=mask)
"""
from hybridgen.model.engine import AttnWeights, Engine
from hybridgen.model.generation import GenerationResult
from hybridgen.model.loading import load_model, model_spec, parse_dtype
from hybridgen.model.spec import ModelSpec, list_models

__all__ = ["AttnWeights", "Engine", "GenerationResult", "ModelSpec", "list_models", "load_model", "model_spec", "parse_dtype"]
