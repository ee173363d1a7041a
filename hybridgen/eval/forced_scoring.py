"""Teacher-forced scoring of a batch through a KV method, each distinct prompt prefilled once.

lm-eval's multiple-choice requests come as (context, continuation) pairs that share their
context: N choices are N rows with the same context. :func:`forced_scores` records the dense
prefill of each DISTINCT context of a batch once (:mod:`hybridgen.model.shared_prefill`), hands
every row the record of its own context, and scores the rows' continuations by decode steps
through the method: a 3-choice item costs one dense prefill of its context instead of three.
Tokens and logits equal those of per-row prefills (tests/test_eval_lm_adapter.py). What it saves
grows with the context: on 40 social_iqa items (120 requests, contexts of 22-36 tokens, SmolLM2,
2 cores) the prefill is a third of the time and the median of 4 alternating rounds went from
21.3 s per row to 19.2 s shared (1.11x; rounds spread 16-26 s); on long contexts (the needle
task, documents) the prefill is most of it. The fidelity reference stays one dense pass over
context + continuation per row (``full`` teacher-forced from the same record measured slower).

Shapes: pre [B, T] (left-padded, pre_mask [B, T] or None), tokens [B, n]; logits [B, n, V].
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


def shared_prefill_of(engine: Any, pre: Tensor, pre_mask: Optional[Tensor], max_new_tokens: int) -> Any:
    """The dense prefill of the distinct rows of ``pre`` (with their masks), recorded once and
    expanded to every row; None on the transformers backend (its record, which holds
    transformers' cache, is not split by rows: each row runs its own prefill there)."""
    from hybridgen.model import Engine
    from hybridgen.model.shared_prefill import record_prefill

    if not isinstance(engine, Engine):
        return None
    T = pre.shape[1]
    keyed = pre if pre_mask is None else torch.cat([pre, pre_mask.to(pre.dtype)], 1)  # a prompt is ids + mask
    distinct, index = torch.unique(keyed, dim=0, return_inverse=True)
    mask = None if pre_mask is None else distinct[:, T:].to(pre_mask.dtype)
    return record_prefill(engine, distinct[:, :T], mask, max_new_tokens).rows(index)


def forced_scores(engine: Any, method: Any, pre: Tensor, pre_mask: Optional[Tensor], tokens: Tensor,
                  share: bool = True) -> Tensor:
    """Logits [B, n, V] of ``method`` when ``tokens`` [B, n] are fed after the prompt ``pre``;
    ``share``: one dense prefill per distinct prompt (module docstring)."""
    from hybridgen.eval.generation import teacher_forced_logits

    shared = shared_prefill_of(engine, pre, pre_mask, int(tokens.shape[1])) if share else None
    return teacher_forced_logits(engine, method, pre, pre_mask, tokens, shared_prefill=shared)
