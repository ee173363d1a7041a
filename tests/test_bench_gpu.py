"""benchmarks/gpu (the GPU script's sections): it imports no harness package, builds the methods
through the public registry with one gpu_budget, orders its grid target-first and keeps a
time reserve. The whole CPU smoke run is tests/test_perf_benchmarks.py (slow)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.config import BenchConfig, Clock, make_method  # noqa: E402
from benchmarks.gpu.layer import grid  # noqa: E402
from hybridgen.methods import Budget  # noqa: E402

HARNESS = ("hydra", "omegaconf", "lm_eval", "datasets", "transformers", "tokenizers", "experiments")


def test_imports_no_harness_package():
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from hybridgen import runtime
        runtime.apply()
        from benchmarks.gpu import main, e2e, kernels, layer, projection, report, scan  # noqa: F401
        from benchmarks.gpu.config import METHODS, make_method
        from hybridgen.model import load_model  # noqa: F401  (what the e2e section loads)
        for name in METHODS:
            make_method(name, 0.9, 0.05)
        print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HARNESS!r})))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name,reg", [("hybrid-exact", "hybrid-exact"), ("hybridgen", "hybridgen"),
                                      ("flexgen-stream", "flexgen"), ("flexgen-cpu", "flexgen"),
                                      ("hybridgen-no-sketch", "hybridgen"), ("hybridgen-plain", "hybridgen")])
def test_methods_get_gpu_budget_one_minus_host_share(name, reg):
    m = make_method(name, 0.9, 0.05)
    assert m.name == reg and m.gpu_budget == Budget(ratio=0.1)
    if reg == "flexgen":
        assert m.attention_on == ("gpu" if name == "flexgen-stream" else "cpu")
    if reg == "hybridgen":
        assert m.topk_ratio == 0.05 and m.key_sketch == ("none" if name == "hybridgen-no-sketch" else "int4")
        assert m.three_way == (name != "hybridgen-plain") and m.stream_ratio is None  # the scheduler balances it
    assert make_method("hybridgen", 0.9, None, {"min_stand_in_cos": -1.0}).min_stand_in_cos == -1.0


def test_the_record_of_what_ran_reprices_a_run_as_it_ran():
    """environment.json's bench_methods: every method's parameters; re-pricing a row with it
    builds that method, and a CSV without the record is priced as the benchmark ran before it
    (hybridgen without the sketch), not as the defaults are now."""
    from benchmarks.gpu.config import METHODS, method_record
    from benchmarks.gpu.projection import projection_rows
    from benchmarks.gpu.validation_rows import RAN_BEFORE_THE_RECORD

    rec = method_record()
    assert set(rec) == set(METHODS) and rec["hybridgen"]["params"]["key_sketch"] == "int4"
    assert rec["hybridgen-no-sketch"]["params"]["key_sketch"] == "none" and rec["full"] == {"method": "full",
                                                                                          "params": {}}
    row = [{"method": "hybridgen", "context": 32768, "host_share": 0.9, "ms": 5.0, "status": "ok"}]
    ms = lambda name, ran: projection_rows(BenchConfig(), [{**row[0], "method": name}], ran)[0][0]["projected_ms"]  # noqa: E731
    assert ms("hybridgen", rec) == ms("hybridgen", None) != ms("hybridgen", RAN_BEFORE_THE_RECORD)
    assert ms("hybridgen", RAN_BEFORE_THE_RECORD) == ms("hybridgen-no-sketch", None)
    # a name the benchmark no longer has is priced as it ran
    assert ms("hybridgen-sketch", RAN_BEFORE_THE_RECORD) not in (ms("hybridgen", RAN_BEFORE_THE_RECORD),
                                                                 ms("hybridgen", rec))


def test_grid_runs_the_target_first_and_full_once_per_context():
    cfg = BenchConfig.smoke()
    order = grid(cfg)
    assert order[:7] == [(512, 0.9, m) for m in ("full", "hybrid-exact", "hybridgen", "hybridgen-no-sketch",
                                                  "hybridgen-plain", "flexgen-stream", "flexgen-cpu")]
    assert sorted(c for c, _, m in order if m == "full") == [256, 512]
    assert len(order) == len(set(order)) == 2 + 2 * 2 * 6 + 2 * 2  # + hybridgen, hybrid-exact at share 0
    fits = [p for p in order if p[1] == 0.0]
    assert fits == [(c, 0.0, m) for c in (256, 512) for m in ("hybridgen", "hybrid-exact")]
    assert order.index(fits[-1]) < min(i for i, p in enumerate(order) if p[1] == 0.5 and p[2] != "full")


def test_clock_keeps_margin_and_reserve():
    clock = Clock(budget_s=100.0, margin_s=30.0)
    assert 69.0 < clock.left() <= 70.0
    assert not clock.expired() and not clock.expired(reserve_s=60.0) and clock.expired(reserve_s=71.0)


def test_runs_are_priced_on_the_threads_they_ran_with(tmp_path):
    """A run's CPU branch had the environment's scan_threads (the benchmark leaves a core to the
    main thread): the model's whole rows per thread are priced on those, so 64 rows on 15
    threads (5 rounds) cost more than on the profile's 16 cores (4), and the record is read
    from the environment.json beside the CSV."""
    import json

    from benchmarks.gpu.projection import projection_rows
    from benchmarks.gpu.validation_rows import what_ran

    row = [{"method": "hybridgen-plain", "context": 32768, "host_share": 0.9, "ms": 5.0, "status": "ok"}]
    ms = lambda threads: projection_rows(BenchConfig(), row, None, threads)[0][0]["projected_ms"]  # noqa: E731
    assert ms(15) > 1.1 * ms(16) and ms(16) == ms(None)
    (tmp_path / "environment.json").write_text(json.dumps({"runtime": {"scan_threads": 15}}))
    assert what_ran(tmp_path / "bench_gpu.csv")[1] == 15
    (tmp_path / "environment.json").unlink()
    assert what_ran(tmp_path / "bench_gpu.csv")[1] is None
