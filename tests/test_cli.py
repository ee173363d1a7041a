"""The ``hybridgen`` command (hybridgen/cli.py) from a checkout; tests/test_install_wheel.py runs it installed."""
import shutil
import tomllib
from pathlib import Path

import pytest

from hybridgen import cli
from hybridgen.methods.catalog import describe, format_catalog

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_one_in_pyproject(capsys):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hybridgen {version}"
    import hybridgen

    assert hybridgen.__version__ == version


def test_usage_lists_the_commands_and_an_unknown_one_is_one_line(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert all(f"  {c} " in out for c in ("run", "methods", "figures"))
    assert cli.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'bogus'" in err and "figures, methods, run" in err


def test_methods_shows_each_parameter_with_type_and_default(capsys):
    assert cli.main(["methods", "h2o", "full"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("h2o: ") and "full: " in out and "(no parameters)" in out
    params = {p.name: p for p in describe("h2o")}
    assert params["recent_fraction"].type == "Fraction (float in [0, 1])" and params["recent_fraction"].default == "0.5"
    assert params["tier"].type == "Tier ('gpu' | 'dram' | 'cxl')" and params["chunk"].default == "256"
    assert format_catalog(["h2o"]) in out


def test_figures_refuses_a_missing_results_dir_and_draws_from_one(tmp_path, capsys):
    assert cli.main(["figures", "--results-dir", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "cpu_scan").mkdir()
    shutil.copy(ROOT / "results" / "cpu_scan" / "sketch_default_quick.json", tmp_path / "cpu_scan")
    assert cli.main(["figures", "--results-dir", str(tmp_path), "--only", "cpu_scan"]) == 0
    assert (tmp_path / "figures" / "cpu_scan.png").stat().st_size > 5000
    assert f"figures from {tmp_path.resolve()}" in capsys.readouterr().out
    assert cli.main(["figures", "--results-dir", str(tmp_path), "--only", "nosuch"]) == 2
    assert "unknown notebook 'nosuch'" in capsys.readouterr().err


def test_run_hands_its_arguments_to_the_experiment_runner(capsys):
    with pytest.raises(SystemExit) as done:        # Hydra's --help exits, as `experiments/run.py --help` does
        cli.main(["run", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "Powered by Hydra" in out and "quickstart" in out   # the experiments of the config directory
