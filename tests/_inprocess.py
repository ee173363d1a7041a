"""experiments/run.py in the test process (the launcher keeps its model between jobs, as a user's sweep does)."""
import contextlib
import io
import sys


def run_main(argv):
    """experiments/run.py in this process: (exit status, stdout, stderr)."""
    from experiments import run

    out, err, saved = io.StringIO(), io.StringIO(), list(sys.argv)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = run.main(list(argv))
    finally:
        sys.argv[:] = saved
    return rc, out.getvalue(), err.getvalue()


def resolved_job(exp: str) -> dict:
    """``experiments/run.py +exp=<exp> --cfg job`` in a fresh offline process: the resolved config
    (asserts the command succeeds)."""
    import os
    import subprocess
    from pathlib import Path

    import yaml

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "NUMBA_THREADING_LAYER": "workqueue"}
    p = subprocess.run([sys.executable, "experiments/run.py", f"+exp={exp}", "--cfg", "job"],
                       cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return yaml.safe_load(p.stdout)
