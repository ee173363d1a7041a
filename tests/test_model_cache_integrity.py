"""The converted model cache with integrity (issue 25, item 4): checksums recorded at conversion,
sizes always and hashes once per process verified, killed conversions cleaned, one line per fault."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _reliability_models as rm  # noqa: E402
from hybridgen.errors import HybridGenError, MissingDataError  # noqa: E402
from hybridgen.model import cache_integrity, gguf_prepare, smollm2  # noqa: E402
from hybridgen.model.loading import check_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A prepared (tiny) smollm2 cache under a temp HYBRIDGEN_CACHE, with its manifest."""
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path / "cache"))
    path = rm.fake_smollm2_cache(tmp_path / "cache")
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}) + " " * 200)
    cache_integrity.write_manifest(path)
    cache_integrity._VERIFIED.clear()
    return path


def _zero_the_embedding(path: Path) -> None:
    """Zeros over the data of the first tensor (the embedding, in the tiny model all of it; in the
    real one 4 MiB), keeping the size and the header: only a checksum can see it."""
    f = path / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__" and "embed" in k)
    lo, hi = header[name]["data_offsets"]
    start = 8 + n + lo
    raw[start:8 + n + min(hi, lo + 4 * 2 ** 20)] = bytes(min(hi - lo, 4 * 2 ** 20))
    f.write_bytes(bytes(raw))


def test_a_sound_cache_passes_and_zeros_in_the_embedding_are_caught(cache):
    check_checkpoint("smollm2-135m")
    _zero_the_embedding(cache)
    cache_integrity._VERIFIED.clear()  # a new process: hashes are checked on its first check
    with pytest.raises(MissingDataError) as err:
        check_checkpoint("smollm2-135m")
    msg = str(err.value)
    assert "model.safetensors does not match the checksum recorded at conversion" in msg
    assert f"delete {cache} (rm -r {cache}) and rerun" in msg and "re-download" not in msg


def test_sizes_are_checked_on_every_check_and_name_the_file(cache):
    check_checkpoint("smollm2-135m")  # hashed once in this process
    tok = cache / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:20])  # a truncated tokenizer.json
    with pytest.raises(MissingDataError, match=r"tokenizer.json is 20 bytes, \d+ when converted .*delete"):
        check_checkpoint("smollm2-135m")


def test_a_truncated_tokenizer_without_a_manifest_is_one_line(tmp_path):
    from hybridgen.model.loading import _load_tokenizer

    p = rm.write_checkpoint(tmp_path / "ckpt")
    (p / "tokenizer.json").write_text('{"version": "1.0", "mod')
    with pytest.raises(MissingDataError, match=r"the tokenizer in .*ckpt cannot be read .*re-download"):
        _load_tokenizer(p)


def test_an_old_cache_without_a_manifest_is_adopted_once(cache, caplog):
    (cache / cache_integrity.MANIFEST).unlink()
    check_checkpoint("smollm2-135m")
    assert (cache / cache_integrity.MANIFEST).is_file() and "recorded checksums" in caplog.text
    assert cache_integrity.problem(cache, hashes=True) is None


@pytest.mark.parametrize("kind", ["dangling", "file", "parent-file"])
def test_a_cache_path_that_is_a_dangling_link_or_a_file_is_one_line(kind, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(root))
    (root / "models").mkdir(parents=True)
    target = root / "models" / "smollm2-135m"
    if kind == "dangling":
        target.symlink_to(tmp_path / "gone")
        text = "is a symbolic link to nothing"
    elif kind == "file":
        target.write_text("x")
        text = "is a file, not a directory"
    else:
        (root / "models").rmdir()
        (root / "models").write_text("x")
        text = "models is a file, not a directory"
    for call in (lambda: check_checkpoint("smollm2-135m"), smollm2.ensure_smollm2):
        with pytest.raises(MissingDataError, match=text):
            call()


def test_a_read_only_cache_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path / "ro"))

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_prepare.tempfile, "mkdtemp", refuse)
    with pytest.raises(MissingDataError, match=r"model cache .*ro/models is not writable \(Permission denied\)"):
        smollm2.ensure_smollm2(verbose=False)


def test_the_temp_dir_of_a_dead_conversion_is_removed_on_the_next_start(cache):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache.parent / f".smollm2-135m-{dead.pid}-abc123"
    mine = cache.parent / f".smollm2-135m-{os.getpid()}-live"
    stale.mkdir(), mine.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    assert smollm2.ensure_smollm2(verbose=False) == cache
    assert not stale.exists() and mine.exists()


def test_the_verify_command(cache, capsys):
    assert cache_integrity.main([str(cache)]) == 0 and "matches" in capsys.readouterr().out
    _zero_the_embedding(cache)
    assert cache_integrity.main([str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model cache") and "delete" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_sigkill_during_first_use_conversion_then_a_rerun_finishes_with_no_temp_dir(tmp_path):
    """The real GGUF conversion (~20 s) killed mid-way, then run again: a sound, checksummed cache."""
    env = {**os.environ, "HYBRIDGEN_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    code = "from hybridgen.model.smollm2 import ensure_smollm2; ensure_smollm2()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT)
    models = tmp_path / "cache" / "models"
    deadline = time.time() + 240
    while time.time() < deadline and not any(d.is_dir() and any(d.iterdir()) for d in models.glob(".smollm2-135m-*")):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert list(models.glob(".smollm2-135m-*")), "the kill came before the conversion wrote anything"
    assert not (models / "smollm2-135m").exists()
    rerun = subprocess.run([sys.executable, "-c", code + "; from hybridgen.model.loading import check_checkpoint; "
                            "check_checkpoint('smollm2-135m'); print('ok')"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and rerun.stdout.strip().endswith("ok"), rerun.stderr[-2000:]
    assert not list(models.glob(".smollm2-135m-*"))
    assert cache_integrity.problem(models / "smollm2-135m", hashes=True) is None
