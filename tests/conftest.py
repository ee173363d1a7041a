"""Fixtures shared by several test files."""
import pytest


@pytest.fixture()
def prepared_cache(tmp_path, monkeypatch):
    """A data cache holding (tiny) files for every local dataset, so validation passes anywhere."""
    data = tmp_path / "data"
    (data / "jsonl").mkdir(parents=True)
    for key in ("social_iqa", "winowhy", "step_inference", "strategyqa", "cause_and_effect", "physical_intuition"):
        (data / "jsonl" / f"bigbench_{key}.jsonl").write_text("{}\n")
    (data / "jsonl" / "ppl_pg-text.jsonl").write_text("{}\n")
    for d in ("essays", "pg-text"):
        (data / d).mkdir()
        (data / d / "a.txt").write_text("text")
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))


@pytest.fixture(autouse=True)
def _logging_left_as_found():
    """Every test leaves our loggers (and the ones we drive) as it found them: a command line run
    in-process with -q sets them to error and would hide the next test's bars and info lines."""
    import logging
    import os

    from hybridgen import log

    names = (*log.NAMES, *log.THIRD_PARTY)
    saved = {n: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
             for n, lg in ((n, logging.getLogger(n)) for n in names)}
    ours = lambda n: any(n == r or n.startswith(r + ".") for r in names)  # noqa: E731
    # Hydra's dictConfig (run.py in-process) disables every logger that exists, children included
    was_disabled = {n for n, lg in logging.root.manager.loggerDict.items()
                    if isinstance(lg, logging.Logger) and ours(n) and lg.disabled}
    tqdm_env = os.environ.get("TQDM_DISABLE")
    yield
    for n, (level, handlers, prop, disabled) in saved.items():
        lg = logging.getLogger(n)
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = prop, disabled
    for n, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and ours(n) and n not in saved:
            lg.disabled = n in was_disabled
    if tqdm_env is None:
        os.environ.pop("TQDM_DISABLE", None)
    else:
        os.environ["TQDM_DISABLE"] = tqdm_env
