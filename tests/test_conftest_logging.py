"""The suite's logging isolation (tests/conftest.py): a module-scoped fixture that runs Hydra's
dictConfig in-process (it disables every existing logger) or quiets our loggers must not silence
the tests that run after it in the same worker."""
import logging
import logging.config

import pytest


@pytest.fixture(scope="module")
def hydra_like_logging_setup():
    logging.getLogger("hybridgen.model.some_child")  # exists before the dictConfig: gets disabled
    # what Hydra's `hydra_logging: disabled` / `job_logging: disabled` apply
    logging.config.dictConfig({"version": 1, "root": {"level": "ERROR"}, "disable_existing_loggers": True})
    logging.getLogger("hybridgen").setLevel(logging.ERROR)


def test_a_child_logger_still_reaches_caplog(hydra_like_logging_setup, caplog):
    logging.getLogger("hybridgen.model.some_child").warning("still heard")
    assert "still heard" in caplog.text


def test_our_root_logger_is_back_at_its_session_level(hydra_like_logging_setup, _logging_at_start):
    level, _, _ = _logging_at_start["hybridgen"]
    assert level != logging.ERROR and logging.getLogger("hybridgen").level == level
