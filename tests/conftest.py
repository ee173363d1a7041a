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
