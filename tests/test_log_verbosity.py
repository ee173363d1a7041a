"""hybridgen.log: one verbosity setting for messages (logging) and progress bars (tqdm)."""
import contextlib
import io
import logging

import pytest
import torch

from hybridgen import log
from hybridgen.errors import ConfigError


@pytest.fixture
def restore():
    """Leave the loggers as they were (levels, handlers, propagation)."""
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers), logging.getLogger(n).propagate)
             for n in log.NAMES}
    yield
    for n, (level, handlers, prop) in saved.items():
        lg = logging.getLogger(n)
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate = prop


def test_levels_and_flags():
    assert log.parse_level("QUIET") == logging.ERROR and log.parse_level("debug") == logging.DEBUG
    assert log.level_from_flags(verbose=1) == logging.DEBUG
    assert log.level_from_flags(quiet=1) == logging.WARNING and log.level_from_flags(quiet=2) == logging.ERROR
    assert log.level_from_flags(default="warning") == logging.WARNING
    with pytest.raises(ConfigError) as info:
        log.parse_level("loud")
    assert "\n" not in str(info.value) and "quiet" in str(info.value)


def test_quiet_hides_info_and_bars_info_shows_them(restore, capsys):
    log.setup("info")
    logging.getLogger("hybridgen.data.prepare").info("downloading x")
    assert "downloading x" in capsys.readouterr().err and log.progress_enabled()
    log.setup("quiet")
    logging.getLogger("hybridgen.data.prepare").info("downloading y")
    logging.getLogger("hybridgen.results").warning("left out z")
    assert capsys.readouterr().err == "" and not log.progress_enabled()
    assert log.bar(range(3)).disable
    log.setup("warning")
    with contextlib.redirect_stderr(io.StringIO()) as buf:   # follows sys.stderr as it is now
        logging.getLogger("hybridgen.results").warning("left out z")
    assert "left out z" in buf.getvalue()
    assert len([h for h in logging.getLogger(log.ROOT).handlers if getattr(h, log._HANDLER_FLAG, False)]) == 1


def test_setup_enables_loggers_a_dict_config_switched_off(restore, capsys):
    """Hydra's hydra_logging=disabled runs dictConfig(disable_existing_loggers=True), which turns
    off every logger created before it (our modules' loggers exist from import on)."""
    import logging.config

    child = logging.getLogger("hybridgen.data.prepare")
    logging.config.dictConfig({"version": 1, "root": {"level": "ERROR"}, "disable_existing_loggers": True})
    assert child.disabled
    log.setup("info")
    child.info("after the dict config")
    assert "after the dict config" in capsys.readouterr().err


def test_prefill_bar_on_long_prompts_follows_verbosity(restore, tmp_path, capsys):
    from tests._tiny_llama import tiny_llama

    eng = tiny_llama(tmp_path)
    ids = torch.randint(0, 300, (5, 410))            # 2050 tokens: over the bar's threshold
    log.setup("info")
    eng.prefill(ids, method="full")
    eng.release()
    assert "prefill [full] 5x410 tok" in capsys.readouterr().err
    log.setup("quiet")
    eng.prefill(ids, method="full")
    eng.release()
    assert "prefill" not in capsys.readouterr().err
    log.setup("info")
    eng.prefill(ids[:, :64], method="full")          # short prompt: no bar
    eng.release()
    assert "prefill" not in capsys.readouterr().err


def test_data_cli_quiet_flag(restore, capsys):
    from hybridgen.data.__main__ import main

    main(["-q", "status"])
    assert "data cache:" in capsys.readouterr().out     # the status table is output, not a message
    assert logging.getLogger(log.ROOT).level == logging.WARNING and not log.progress_enabled()


def test_requested_bars_show_until_a_verbosity_hides_them_and_lm_eval_follows(restore):
    root = logging.getLogger(log.ROOT)
    root.handlers[:] = [h for h in root.handlers if not getattr(h, log._HANDLER_FLAG, False)]
    root.setLevel(logging.WARNING)                    # a library user who never set a verbosity
    assert not log.verbosity_was_set()
    assert not log.bar(range(3), explicit=True).disable and log.bar(range(3)).disable
    saved = {n: logging.getLogger(n).level for n in log.THIRD_PARTY}
    try:
        log.set_verbosity("quiet")
        assert log.bar(range(3), explicit=True).disable
        assert logging.getLogger("lm_eval").level == logging.ERROR == logging.getLogger("transformers").level
        log.set_verbosity("debug")
        assert not log.bar(range(3), explicit=True).disable and log.get_verbosity() == logging.DEBUG
        assert logging.getLogger("lm_eval").level == logging.DEBUG
        assert logging.getLogger("transformers").level == logging.WARNING   # not theirs to flood
        assert log.bar(range(3), explicit=True, disable=True).disable
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
        log.set_verbosity("info")
