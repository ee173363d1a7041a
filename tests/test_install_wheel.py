"""An installed, non-editable copy works away from the checkout (issue 26, install story).

The wheel is built from a copy of the packaged sources (``pip wheel --no-deps``), installed with
``--target`` into a temporary directory, and run from /tmp with only that directory on
PYTHONPATH (the shared environment's python provides the dependencies): ``python -m hybridgen
methods`` lists every registered method, and ``hybridgen run +exp=quickstart`` runs an
experiment from the configs inside the wheel.
"""
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "hybridgen", "baselines", "experiments", "conf",
           "notebooks", "hydra_plugins")
TINY = ["method=full", "model.weights=random", "model.num_layers=1", "workload.source=random",
        "workload.prompt_len=12", "workload.gen_len=3", "exp.warmup=false"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(target dir, wheel path): the wheel of this checkout, installed with --target."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy(p, src / name)
    run = dict(capture_output=True, text=True, timeout=300)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(base / "dist"), str(src)], **run)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((base / "dist").glob("hybridgen-*.whl"))
    target = base / "target"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(wheel)], **run)
    assert inst.returncode == 0, inst.stderr[-3000:]
    return target, wheel


def _env(target):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "NUMBA_THREADING_LAYER": "workqueue"}


def test_wheel_carries_configs_notebooks_license_and_the_command(installed):
    target, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    confs = sorted(p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml"))
    assert confs and all(f"experiments/conf/{c}" in names for c in confs)
    assert all(f"experiments/notebooks/{p.name}" in names for p in (ROOT / "notebooks").glob("*.py"))
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name.startswith(f"hybridgen-{version}-")
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "hybridgen = hybridgen.cli:main" in text and "run = experiments.cli:run" in text
    assert (target / "bin" / "hybridgen").is_file()


def test_installed_methods_lists_every_registered_method_with_parameters(installed):
    target, _ = installed
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["hybridgen.methods"]
    p = subprocess.run([sys.executable, "-c", "import hybridgen, experiments; print(hybridgen.__file__); "
                        "print(experiments.__file__); print(hybridgen.__version__)"], cwd="/tmp", env=_env(target),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    files = p.stdout.split()
    assert all(f.startswith(str(target)) for f in files[:2]), files  # the installed copy, not the checkout
    p = subprocess.run([sys.executable, "-m", "hybridgen", "methods"], cwd="/tmp", env=_env(target),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    heads = [ln.split(":")[0] for ln in p.stdout.splitlines() if ln and not ln.startswith(" ")]
    assert sorted(heads) == sorted(declared)
    assert "gpu_budget" in p.stdout and "default Budget(ratio=0.1" in p.stdout  # hybridgen's own default
    assert "recent_fraction  Fraction (float in [0, 1])" in p.stdout          # h2o's, with its type


def test_installed_command_runs_an_experiment_from_the_packaged_configs(installed, tmp_path):
    target, _ = installed
    out = tmp_path / "x"
    p = subprocess.run([str(target / "bin" / "hybridgen"), "run", "+exp=quickstart", f"results_dir={out}", *TINY],
                       cwd="/tmp", env=_env(target), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done" in p.stdout and "full" in p.stdout
    runs = [d for d in (out / "quickstart").iterdir() if (d / "DONE").exists()]
    assert len(runs) == 1 and (runs[0] / "metrics.json").is_file()
    p = subprocess.run([str(target / "bin" / "hybridgen"), "run", "+exp=no_such_exp", f"results_dir={out}"],
                       cwd="/tmp", env=_env(target), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "quickstart" in p.stderr   # the packaged experiments are the ones offered
