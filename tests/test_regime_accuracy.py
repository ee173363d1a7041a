"""Accuracy next to speed in the paper's regime: a cell's configuration joined to the measured one."""
import csv
import json
import sys
from pathlib import Path

import pytest

from hybridgen.errors import ConfigError
from hybridgen.methods import build_method
from hybridgen_harness import regime_accuracy as ra

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments import paper_regime as pr  # noqa: E402

COMMITTED = ROOT / "results" / "paper_regime"
CTX = 131072


def _measured(tmp_path, rows):
    """A bench_baselines-shaped CSV of (label, registry, params, top1, kl)."""
    path = tmp_path / "m.csv"
    with open(path, "w", newline="") as fh:
        fh.write("# command: test\n")
        w = csv.DictWriter(fh, ["model", "context", "method", "params", "top1_agreement", "mean_kl"])
        w.writeheader()
        for label, reg, params, t1, kl in rows:
            w.writerow({"model": "smollm2-135m", "context": 8000, "method": label,
                        "params": json.dumps(build_method(reg, **params).config()), "top1_agreement": t1,
                        "mean_kl": kl})
    return ra.load_fidelity(path)


def test_registry_of_names_the_registered_method():
    assert ra.registry_of("h2o") == "h2o"
    assert ra.registry_of("h2o-offload") == "h2o"
    assert ra.registry_of("flexgen-int4") == "flexgen"
    assert ra.registry_of("hybridgen:gpu_budget=0.07") == "hybridgen"
    assert ra.registry_of("hybrid-exact") == "hybrid-exact"
    with pytest.raises(ConfigError, match="no registered method"):
        ra.registry_of("nosuch-method")


def test_a_cell_matches_the_measurement_of_its_output_configuration(tmp_path):
    measured = _measured(tmp_path, [
        ("h2o", "h2o", {}, 0.97, 0.004),
        ("h2o:budget=0.1", "h2o", {"budget": "0.1"}, 0.90, 0.05),
        ("flexgen-int4", "flexgen", {"compress_kv": True, "compress_gpu_kv": True, "gpu_budget": "0.5"}, 0.92, 0.09),
        ("hybridgen:a", "hybridgen", {"gpu_budget": "0.01", "topk_ratio": 0.01, "stream_ratio": 0.3}, 0.98, 0.003),
        ("hybridgen:b", "hybridgen", {"gpu_budget": "0.07", "topk_ratio": 0.01, "stream_ratio": 0.3}, 0.99, 0.002),
        ("hybridgen:c", "hybridgen", {"gpu_budget": "0.07", "topk_ratio": 0.01, "stream_ratio": 0.5}, 0.995, 0.0015),
        ("hybridgen:d", "hybridgen", {"gpu_budget": "0.16", "topk_ratio": 0.01, "stream_ratio": 0.3}, 1.0, 0.001),
        # the scheduler moved its knobs with this machine's timings: not what any cell was priced at
        ("hybridgen:gpu_budget=0.5", "hybridgen", {"gpu_budget": "0.5"}, 0.5, 0.5),
    ])
    # offloaded H2O is H2O: placement parameters are not part of the match
    assert ra.match("h2o", {"budget": "0.2", "offload": "stream"}, CTX, measured).top1 == 0.97
    assert ra.match("h2o", {"budget": "0.1"}, CTX, measured).top1 == 0.90
    assert ra.match("h2o", {"budget": "0.3"}, CTX, measured) is None  # never measured: not guessed
    # FlexGen + INT4 on both parts: the split changes nothing, any split matches
    assert ra.match("flexgen", {"compress_kv": True, "compress_gpu_kv": True, "gpu_budget": "26068t"}, CTX,
                    measured).top1 == 0.92
    # ... but INT4 on the host only depends on the split: not matched to the both-parts measurement
    assert ra.match("flexgen", {"compress_kv": True, "gpu_budget": "26068t"}, CTX, measured) is None
    # HybridGen: its GPU share, streamed fraction and top-k at the values its speed was priced at, each
    # matched to the largest measured value at or below the cell's (9222 / 131072 = 0.0704)
    priced = {"topk_ratio": 0.01, "stream_ratio": 0.42}
    assert ra.match("hybridgen", {"gpu_budget": "9222t"}, CTX, measured, priced).label == "hybridgen:b"
    assert ra.match("hybridgen", {"gpu_budget": "9222t"}, CTX, measured,
                    {**priced, "stream_ratio": 0.6}).label == "hybridgen:c"
    assert ra.match("hybridgen", {"gpu_budget": "0.5"}, CTX, measured, priced).label == "hybridgen:d"
    assert ra.match("hybridgen", {"gpu_budget": "0.0"}, CTX, measured, priced) is None
    assert ra.match("hybridgen", {"gpu_budget": "9222t"}, CTX, measured, {**priced, "stream_ratio": 0.2}) is None
    assert ra.match("hybridgen", {"gpu_budget": "9222t"}, CTX, measured, {**priced, "topk_ratio": 0.005}) is None
    # without the priced knobs the scheduler owns them: nothing measured matches
    assert ra.match("hybridgen", {"gpu_budget": "0.5"}, CTX, measured) is None
    # any other HybridGen parameter must agree exactly (nothing streamed is another configuration)
    assert ra.match("hybridgen", {"gpu_budget": "0.5", "three_way": False}, CTX, measured, priced) is None


def test_the_accuracy_table_covers_every_in_regime_group_and_says_what_is_not_measured(tmp_path):
    rows = pr.read_table(COMMITTED / "table.csv")
    measured = _measured(tmp_path, [("snapkv", "snapkv", {}, 0.99, 0.0014)])
    acc = ra.accuracy_rows(rows, measured, pr.PLACEMENTS, [g for g, _ in pr.GPUS], pr.VERDICT_BASELINES)
    assert len(acc) == len(pr.PLACEMENTS) * len(pr.GPUS) * len(pr.VERDICT_BASELINES)
    snap = [a for a in acc if a.baseline == "snapkv" and a.cells]
    assert snap and all(f is not None and f.top1 == 0.99 for a in snap for f in a.baseline_fid)
    text = ra.accuracy_markdown(acc, {}, dict(pr.GPUS), "test")
    assert "0.990 / 0.0014" in text and "not measured" in text


@pytest.mark.skipif(not (COMMITTED / "accuracy").is_dir(), reason="no committed results/paper_regime/accuracy/")
def test_the_readme_accuracy_block_is_what_the_generator_prints_from_the_committed_files():
    block = pr.accuracy_markdown(pr.read_table(COMMITTED / "table.csv"), COMMITTED / "accuracy")
    readme = (ROOT / "README.md").read_text()
    assert readme.count(pr.ACC_BEGIN) == 1 and readme.count(pr.ACC_END) == 1
    assert readme.split(pr.ACC_BEGIN, 1)[1].split(pr.ACC_END, 1)[0] == "\n" + block
    assert block in (COMMITTED / "README.md").read_text()


def test_hybridgen_is_priced_at_the_knobs_priced_knobs_names():
    """The accuracy joined to a projected speed is measured at the configuration that speed priced."""
    from hybridgen.perf import Workload, predict_step

    default = build_method("hybridgen")
    w = Workload(batch=4, context=131072)
    a = predict_step(default, "llama-3.1-8b", w, "h200-host")
    knobs = default.priced_knobs(a.breakdown)
    assert set(knobs) == {"topk_ratio", "stream_ratio"}  # both scheduler-owned by default
    pinned = build_method("hybridgen", **{**default.config(), **knobs})
    b = predict_step(pinned, "llama-3.1-8b", w, "h200-host")
    assert a.total_s == pytest.approx(b.total_s, rel=1e-12)
    # the same times; the default holds its stream slots at the scheduler's largest fraction, the pinned one at f
    same = {k: v for k, v in a.breakdown.items() if k != "gpu_resident_bytes"}
    assert same == pytest.approx({k: b.breakdown[k] for k in same}, rel=1e-12)
    assert a.breakdown["gpu_resident_bytes"] > b.breakdown["gpu_resident_bytes"]
    assert pinned.priced_knobs(b.breakdown) == {}
    assert build_method("hybridgen", three_way=False).priced_knobs(a.breakdown) == {"topk_ratio": knobs["topk_ratio"]}
    assert build_method("h2o").priced_knobs(a.breakdown) == {}
