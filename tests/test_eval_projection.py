"""hybridgen.eval.projection: a run's method priced from (name, params); never aborts a sweep."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from hybridgen import perf as pm
from hybridgen.eval.projection import project
from hybridgen.methods import KVMethod, build_method

LLAMA8B = pm.ModelShape(name="llama-3.1-8b-shape", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, vocab_size=128256)
RUN = dict(spec=LLAMA8B, batch=8, prompt_len=4096, gen_len=128, dtype="bfloat16", profile="h200-host")
W = pm.Workload(batch=8, context=4096 + 64, dtype="bf16")


def test_projection_prices_the_method_built_from_its_params():
    out = project("flexgen", {"gpu_budget": "0.1", "attention_on": "cpu"}, **RUN)
    want = pm.predict_step(build_method("flexgen", gpu_budget=0.1, attention_on="cpu"), LLAMA8B, W, "h200-host")
    assert out["projected"] is True and out["status"] == "ok"
    assert out["step_s"] == want.total_s and out["perf_cost"] == "cpu-attention-split"
    assert out["workload"] == {"batch": 8, "context": 4160, "dtype": "bf16"}


def test_scheduler_owned_topk_takes_the_traces_last_ratio():
    trace = {"scheduler": [{"knob": "topk_ratio", "new": 0.06}, {"knob": "gpu_window", "new": 99},
                           {"knob": "topk_ratio", "new": 0.2}]}
    out = project("hybridgen", {"topk_ratio": None, "three_way": False}, **RUN, trace=trace)
    want = pm.predict_step(build_method("hybridgen", topk_ratio=0.2, three_way=False), LLAMA8B, W, "h200-host")
    assert out["step_s"] == want.total_s and out["priced"] == {"topk_ratio": 0.2}
    # the default's streamed fraction too, each knob at its last decision
    trace["scheduler"].append({"knob": "stream_ratio", "new": 0.4})
    out = project("hybridgen", {}, **RUN, trace=trace)
    assert out["step_s"] == pm.predict_step(build_method("hybridgen", topk_ratio=0.2, stream_ratio=0.4), LLAMA8B, W,
                                            "h200-host").total_s
    assert out["priced"] == {"topk_ratio": 0.2, "stream_ratio": 0.4}  # the knobs priced, from the trace
    settled = project("hybridgen", {}, **RUN)   # no trace: where the model's scheduler settles
    knobs = settled["priced"]
    assert set(knobs) == {"topk_ratio", "stream_ratio"}
    assert settled["step_s"] == pytest.approx(pm.predict_step(build_method("hybridgen", **knobs), LLAMA8B, W,
                                                              "h200-host").total_s)


@dataclass
class NoCost(KVMethod):
    name: ClassVar[str] = "no-cost"


def test_a_method_without_a_cost_is_reported_not_modelled():
    for method in (NoCost(),):  # (hybridgen's three-way split is modelled now: hybridgen_variant_cost)
        out = project(method, None, **RUN)
        assert out["projected"] is True and out["status"] == "not modelled"
        assert out["step_s"] is None and out["profile"] == "h200-host" and out["method"] == method.name
