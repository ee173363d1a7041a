"""Next-token selection: greedy, or temperature + nucleus (top-p) sampling with a seeded generator."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hybridgen.errors import ConfigError


def check_sampling(greedy: bool, temperature: float, top_p: float) -> None:
    """One-line errors for impossible sampling settings."""
    if greedy:
        return
    if not (temperature > 0):
        raise ConfigError(f"temperature must be > 0 for sampling, got {temperature}; use greedy=True for argmax")
    if not (0 < top_p <= 1):
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")


def select_next(logits: Tensor, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> Tensor:
    """logits [B, V] -> token ids [B] (LongTensor on logits' device).

    top_p keeps the smallest set of most likely tokens whose probability reaches top_p (the
    most likely token is always kept), as transformers' TopPLogitsWarper does.
    """
    if greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
