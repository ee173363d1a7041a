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
