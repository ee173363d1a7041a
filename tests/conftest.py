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


def _our_logger_names():
    from hybridgen import log

    return (*log.NAMES, *log.THIRD_PARTY)


def _is_ours(name, roots):
    return any(name == r or name.startswith(r + ".") for r in roots)


@pytest.fixture(scope="session", autouse=True)
def _logging_at_start():
    """Our loggers (and the ones we drive) as the session found them, before any fixture ran."""
    import logging

    saved = {n: (lg.level, list(lg.handlers), lg.propagate)
             for n, lg in ((n, logging.getLogger(n)) for n in _our_logger_names())}
    saved[""] = (logging.root.level, None, None)  # the root's level only: pytest attaches its own handlers there
    return saved


def _restore_logging(start):
    """Back to the session's start: levels, handlers, propagation, the root logger's level; every
    logger of ours enabled (Hydra's 'disabled' logging, run in-process, sets the root to error and
    disables every logger that exists, children included)."""
    import logging

    roots = tuple(n for n in start if n)
    for n, (level, handlers, prop) in start.items():
        lg = logging.getLogger(n) if n else logging.root
        lg.setLevel(level)
        if n:
            lg.handlers[:] = handlers
            lg.propagate = prop
    for n, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and _is_ours(n, roots):
            lg.disabled = False


@pytest.fixture(autouse=True)
def _logging_left_as_found(_logging_at_start):
    """Every test starts and ends with our loggers as the session found them: a command line run
    in-process with -q (in a test or in a module-scoped fixture, which runs before this one) sets
    them to error and would hide the next test's bars and info lines."""
    import os

    tqdm_env = os.environ.get("TQDM_DISABLE")
    _restore_logging(_logging_at_start)
    yield
    _restore_logging(_logging_at_start)
    if tqdm_env is None:
        os.environ.pop("TQDM_DISABLE", None)
    else:
        os.environ["TQDM_DISABLE"] = tqdm_env
