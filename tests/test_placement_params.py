"""A method's ``placement_params`` move bytes but never change what it attends to: every other value of
each gives the same tokens and logits (up to float summation order), so ``output_config`` may
drop them (an accuracy measured for one placement holds for the others)."""
import dataclasses
import typing

import pytest
import torch

from hybridgen.methods import available_methods, build_method, method_class
from hybridgen.model import load_model
from hybridgen.model.shared_prefill import record_prefill

BASE = {"hybridgen": {"topk_ratio": 0.2, "stream_ratio": 0.3}}  # the scheduler's knobs follow measured times
OTHER_VALUES = {"gpu_budget": ["0.5", "0.0"], "branch_pieces": [2]}


@pytest.fixture(scope="module")
def tiny():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def _alternatives(cls, name: str, current):
    if name in OTHER_VALUES:
        return [v for v in OTHER_VALUES[name] if str(v) != str(current)]
    hint = typing.get_type_hints(cls, include_extras=True)[name]
    if hint is bool:
        return [not current]
    args = typing.get_args(hint)
    while args and typing.get_origin(hint) is not typing.Literal:  # Annotated / aliases around a Literal
        hint, args = args[0], typing.get_args(args[0])
    if typing.get_origin(hint) is typing.Literal:
        return [v for v in args if v != current]
    raise AssertionError(f"give the test other values of {cls.__name__}.{name}")


def _run(engine, method, ids, mask, shared):
    return engine.generate(ids, method, max_new_tokens=6, attention_mask=mask, return_logits=True,
                           shared_prefill=shared)


def test_every_placement_param_leaves_the_outputs_unchanged(tiny):
    B, T = 2, 80
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :7] = 0
    shared = record_prefill(tiny, ids, mask, max_new_tokens=6)
    varied = []
    for name in available_methods():
        cls = method_class(name)
        base = dict(BASE.get(name, {}))
        if name == "flexgen":  # the split is placement only when both parts are stored alike
            base.update(compress_kv=True, compress_gpu_kv=True)
        ref_method = build_method(name, **base)
        if getattr(ref_method, "projected_only", None):
            continue
        ref = _run(tiny, ref_method, ids, mask, shared)
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        for param in sorted(set(cls.placement_params) | ({"gpu_budget"} if name == "flexgen" else set())):
            assert param in fields, f"{name}.placement_params names {param!r}, not a parameter"
            for value in _alternatives(cls, param, ref_method.config()[param]):
                method = build_method(name, **{**base, param: value})
                assert method.output_config() == ref_method.output_config(), (name, param)
                out = _run(tiny, method, ids, mask, shared)
                assert torch.equal(out.tokens, ref.tokens), (name, param, value)
                scale = float(ref.logits.abs().max())
                assert float((out.logits - ref.logits).abs().max()) <= 1e-4 * scale, (name, param, value)
                varied.append((name, param))
    assert {("h2o", "offload"), ("quest", "offload"), ("flexgen", "attention_on"), ("flexgen", "gpu_budget"),
            ("hybrid-exact", "gpu_budget"), ("hybridgen", "mapping")} <= set(varied)


def test_output_config_keeps_what_changes_the_outputs():
    assert "gpu_budget" in build_method("hybridgen").output_config()
    assert "budget" in build_method("h2o", offload="stream").output_config()
    assert "offload" not in build_method("h2o", offload="stream").output_config()
    # FlexGen with INT4 on the host only: which tokens are compressed depends on the split
    assert "gpu_budget" in build_method("flexgen", compress_kv=True).output_config()
    assert "gpu_budget" not in build_method("flexgen").output_config()
