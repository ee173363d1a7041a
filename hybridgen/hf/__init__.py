"""The transformers backend: every KV method on any ``AutoModelForCausalLM``.

    from hybridgen.hf import HFEngine
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(path), tokenizer)
    result = engine.generate(ids, "hybridgen", max_new_tokens=16)

or ``hybridgen.model.load_model(path_or_name, backend="transformers")``. See
:mod:`hybridgen.hf.engine` (the flow), :mod:`hybridgen.hf.attention` (transformers' extension
points used) and :mod:`hybridgen.hf.model_view` (what is read from the model).
"""
from hybridgen.hf.attention import ATTN_IMPLEMENTATION
from hybridgen.hf.engine import HFEngine, HFModelSpec

__all__ = ["ATTN_IMPLEMENTATION", "HFEngine", "HFModelSpec"]
