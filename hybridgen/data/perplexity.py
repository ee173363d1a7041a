"""Documents for rolling perplexity (lm-eval ``loglikelihood_rolling``) from long texts.

Choices: a source's documents are cut at paragraph boundaries into pieces of about
``doc_chars`` characters (default 2400, about 500-600 tokens of English), pieces shorter
than half of that are dropped, and the pieces are taken in source order (no shuffling: they
are contiguous text). Output docs: ``{"id", "source", "title", "text"}``.
"""
from __future__ import annotations

from typing import Iterable, List, Tuple


def chunk_documents(docs: Iterable[Tuple[str, str]], source: str, doc_chars: int = 2400,
                    max_docs: int = 0) -> List[dict]:
    """Split (title, text) documents into perplexity docs of about ``doc_chars`` characters."""
    out: List[Tuple[str, str]] = []
    for title, text in docs:
        paras = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
        buf: List[str] = []
        size = 0
        for p in paras:
            buf.append(p)
            size += len(p) + 2
            if size >= doc_chars:
                out.append((title, "\n\n".join(buf)))
                buf, size = [], 0
        if buf and size >= doc_chars // 2:
            out.append((title, "\n\n".join(buf)))
        if max_docs and len(out) >= max_docs:
            break
    out = out[:max_docs] if max_docs else out
    return [{"id": f"{source}-{i}", "source": source, "title": title, "text": t} for i, (title, t) in enumerate(out)]
