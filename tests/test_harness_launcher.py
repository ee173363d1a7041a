"""Scale-out: the same sweep through Hydra's submitit launcher (its local executor stands in for
SLURM) writes the same run directories as an in-process run, one job per point."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridgen_harness import results  # noqa: E402
from tests.test_harness_results import ENV, TINY  # noqa: E402


def test_submitit_local_multirun_runs_each_point_as_a_job(tmp_path):
    args = ["-m", "+exp=quickstart", "hydra/launcher=local", "method=full,h2o", f"results_dir={tmp_path}", *TINY]
    p = subprocess.run([sys.executable, "experiments/run.py", *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    store = results.ResultsStore(tmp_path, "quickstart")
    runs = store.finished_runs()
    assert sorted(r.name.split("__")[1] for r in runs) == ["full", "h2o-budget=0.2"]
    sweep_dirs = list((store.exp_dir / ".multirun").iterdir())
    assert len(sweep_dirs) == 1
    submitit_logs = list(sweep_dirs[0].glob(".submitit/*/*_log.out"))
    assert len(submitit_logs) == 2                      # two submitit jobs ran
    assert p.stdout.count("done") == 2                  # the table read back after the sweep


def test_slurm_launcher_config_asks_one_gpu_per_job():
    from hydra import compose, initialize_config_dir

    from experiments.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.nodes == 1
