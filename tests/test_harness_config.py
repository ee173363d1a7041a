"""Hydra configuration: every experiment composes, every method has a valid conf file, and bad
input (misspelt key, unknown method/parameter, bad value) fails at start with one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import preflight  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402

EXPS = sorted(p.stem for p in (ROOT / "conf" / "exp").glob("*.yaml"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "NUMBA_THREADING_LAYER": "workqueue"}


def test_the_paper_experiments_exist():
    for name in ("quickstart", "speedup", "batch_sweep", "prompt_sweep", "model_sweep", "accuracy",
                 "scheduler_trace", "mapping_ablation"):
        assert name in EXPS


#: experiments of hundreds of points (Hydra composes each in ~0.3 s): composed point by point under
#: `make test-all` (-m slow); `make test` composes each with a narrowed sweep (below)
LARGE = {"paper_speedup", "paper_regime"}


@pytest.mark.parametrize("exp", [pytest.param(e, marks=pytest.mark.slow) if e in LARGE else e for e in EXPS])
def test_every_experiment_composes_and_validates(exp, prepared_cache):
    points = preflight.resolve_points([f"+exp={exp}"])
    assert points, exp
    names = {cfg.exp.name for _, cfg in points}
    assert names == {exp}
    # each point is a distinct configuration
    blobs = {OmegaConf.to_yaml(cfg) for _, cfg in points}
    assert len(blobs) == len(points)


@pytest.mark.parametrize("exp", sorted(LARGE))
def test_a_large_experiment_composes_with_one_method(exp, prepared_cache):
    """Every part's grid (models, workloads, hardware) with HybridGen alone: each point composes and
    validates, and is distinct."""
    points = preflight.resolve_points([f"+exp={exp}", "method=hybridgen"])
    assert len(points) > 10 and {cfg.method.name for _, cfg in points} == {"hybridgen"}
    assert {cfg.exp.name for _, cfg in points} == {exp}
    assert len({OmegaConf.to_yaml(cfg) for _, cfg in points}) == len(points)


def test_quickstart_runs_full_and_split_methods_with_fidelity():
    points = preflight.resolve_points(["+exp=quickstart"])
    methods = [cfg.method.name for _, cfg in points]
    assert methods[0] == "full" and "hybrid-exact" in methods
    assert all(cfg.exp.fidelity for _, cfg in points)
    assert all(cfg.model.name == "smollm2-135m" and cfg.model.weights == "real" for _, cfg in points)


def test_command_line_sweep_replaces_the_experiment_sweep():
    points = preflight.resolve_points(["+exp=quickstart", "method=full,h2o", "workload.batch=1,2"])
    got = sorted((cfg.method.name, cfg.workload.batch) for _, cfg in points)
    assert got == [("full", 1), ("full", 2), ("h2o", 1), ("h2o", 2)]


def test_method_presets_name_a_method_and_only_override_its_defaults():
    """A conf/method YAML is a preset: its params exist, are valid, and differ from the dataclass
    defaults (the dataclass is the one source of defaults)."""
    from hybridgen.methods import build_method, method_parameters

    confs = {p.stem: OmegaConf.load(p) for p in (ROOT / "conf" / "method").glob("*.yaml")}
    for stem, c in confs.items():
        params = OmegaConf.to_container(c.params) or {}
        assert set(params) <= set(method_parameters(c.name)), (stem, set(params) - set(method_parameters(c.name)))
        defaults = build_method(c.name).config()
        built = build_method(c.name, **params).config()  # values valid too
        restated = [k for k in params if built[k] == defaults[k]]
        assert not restated, f"conf/method/{stem}.yaml restates defaults: {restated}"


def test_a_method_runs_without_a_yaml_file():
    points = preflight.resolve_points(["method.name=quest", "method.params.page_size=8"])
    (_, cfg), = points
    assert cfg.method.name == "quest" and cfg.method.params.page_size == 8


def test_hardware_profiles_have_capacities_and_cxl_node():
    for name in ("h200", "h100", "a100", "rtx5090"):
        hw = OmegaConf.load(ROOT / "conf" / "hardware" / f"{name}.yaml")
        assert hw.gpu_memory and hw.dram_capacity and hw.cxl_capacity and hw.cxl_node == "auto"
    cpu = OmegaConf.load(ROOT / "conf" / "hardware" / "cpu-emulated.yaml")
    assert cpu.gpu_capacity is None


def test_auto_gpu_capacity_subtracts_weights():
    from hybridgen.eval.generation import resolve_capacities

    class E:
        class spec:
            @staticmethod
            def param_count():
                return 10**9

        dtype = __import__("torch").float16

    caps = resolve_capacities({"gpu_capacity": "auto", "gpu_memory": "80GB", "gpu_kv_fraction": 0.9,
                               "dram_capacity": "512GiB", "cxl_capacity": None}, E)
    assert caps["gpu"] == int(80e9 * 0.9) - 2 * 10**9
    assert caps["dram"] == 512 * 2**30 and caps["cxl"] is None
    with pytest.raises(ConfigError, match="gpu_memory"):
        resolve_capacities({"gpu_capacity": "auto"}, E)


@pytest.mark.parametrize("overrides, expect", [
    (["model.nmae=x"], "unknown config key 'model.nmae'"),
    (["seedd=1"], "unknown config key 'seedd'"),
    (["method=h2oo"], "unknown method 'h2oo'"),
    (["+exp=nope"], "unknown exp 'nope'"),
    (["method=h2o", "method.params.budgte=0.1"], "has no parameter 'budgte'"),
    (["method=snapkv", "method.params.budget=-3"], "budget"),
    (["workload.batch=abc"], "workload.batch"),
    (["model.weights=fake"], "choose one of: real, random, dummy"),
    (["workload.source=wiki"], "workload.source"),
    (["exp.kind=project"], "hardware profile"),
    (["workload.prompt_len=8190", "workload.gen_len=8"], "exceeds smollm2-135m's 8192 positions"),
    (["+exp=accuracy", "method=full", "exp.accuracy.tasks=[hg_nosuch]"], "unknown local task 'hg_nosuch'"),
])
def test_bad_input_is_one_config_error(overrides, expect):
    with pytest.raises(ConfigError) as ei:
        preflight.resolve_points(overrides)
    msg = str(ei.value)
    assert expect in msg and "\n" not in msg


def test_cli_prints_one_line_and_exits_2():
    p = subprocess.run([sys.executable, "experiments/run.py", "model.nmae=x"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown config key 'model.nmae'")
    assert p.stdout.strip() == ""


def test_missing_dataset_fails_at_start_with_one_line(tmp_path):
    env = {**ENV, "HYBRIDGEN_CACHE": str(tmp_path)}
    for args in (["workload.source=essays"], ["+exp=accuracy"]):
        p = subprocess.run([sys.executable, "experiments/run.py", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0].startswith("error: dataset") and "make data" in lines[0]


def test_the_end_of_run_table_shows_a_score_per_ruler_length():
    """RULER tasks report one score per context length: the table gets a column per length (it
    showed '-' for the task before), and the other tasks their named metric."""
    from experiments.runner import summary_row

    cfg = OmegaConf.create({"method": {"name": "full", "params": {}}, "exp": {"kind": "accuracy"}})
    from experiments.accuracy import _metrics

    ruler = _metrics({"alias": "niah_single_1", "4096,none": 0.5, "8192,none": 0.25, "16384,none": -1,
                      "4096_stderr,none": "N/A"})
    assert ruler == {"4096": 0.5, "8192": 0.25}  # lm-eval's -1 for a length that was not run is dropped
    metrics = {"accuracy": {"niah_single_1": ruler, "hg_needle": {"exact_match": 0.75},
                            "hg_bigbench_social_iqa": {"acc": 0.4, "acc_norm": 0.45}}}
    row = summary_row(cfg, metrics)
    assert row["niah_single_1@4096"] == 0.5 and row["niah_single_1@8192"] == 0.25 and "niah_single_1" not in row
    assert row["hg_needle"] == 0.75 and row["hg_bigbench_social_iqa"] == 0.45
