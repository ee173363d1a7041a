"""Teacher-forced scoring of a batch through a KV method, each distinct prompt prefilled once.

lm-eval's multiple-choice requests come as (context, continuation) pairs that share their
context: N choices are N rows with the same context. :func:`forced_scores` records the dense
prefill of each DISTINCT context of a batch once (:mod:`hybridgen.model.shared_prefill`), hands
every row the record of its own context, and scores the rows' continuations by decode steps
through the method; the fidelity reference (``full``) starts from the same record. So a
3-choice item costs one dense prefill of its context, for the method and the reference
together, where it cost three for the method and three more for the reference. Tokens and
logits equal those of per-row prefills (tests/test_eval_lm_adapter.py).

Shapes: pre [B, T] (left-padded, pre_mask [B, T] or None), tokens [B, n]; logits [B, n, V].
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor


def shared_prefill_of(engine: Any, pre: Tensor, pre_mask: Optional[Tensor], max_new_tokens: int) -> Any:
    """The dense prefill of the distinct rows of ``pre`` (with their masks), recorded once and
    expanded to every row; None on an engine that cannot record one (the transformers backend)."""
    from hybridgen.model import Engine
    from hybridgen.model.shared_prefill import record_prefill

    if not isinstance(engine, Engine):
        return None
    keyed = pre if pre_mask is None else torch.cat([pre, pre_mask.to(pre.dtype)], 1)
    distinct, index = torch.unique(keyed, dim=0, return_inverse=True)
    first = torch.full((len(distinct),), -1, dtype=torch.long)
    for row, d in enumerate(index.tolist()):  # a row holding each distinct prompt
        if first[d] < 0:
            first[d] = row
    mask = None if pre_mask is None else pre_mask.index_select(0, first)
    record = record_prefill(engine, pre.index_select(0, first), mask, max_new_tokens)
    return record.rows(index)


def forced_scores(engine: Any, method: Any, pre: Tensor, pre_mask: Optional[Tensor], tokens: Tensor,
                  reference: bool = False, share: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """(logits of ``method``, logits of ``full`` or None) [B, n, V] when ``tokens`` [B, n] are fed after
    the prompt ``pre``; ``share``: one dense prefill per distinct prompt for both (module docstring)."""
    from hybridgen.eval.generation import teacher_forced_logits
    from hybridgen.methods import build_method

    n = int(tokens.shape[1])
    shared = shared_prefill_of(engine, pre, pre_mask, n) if share else None
    logits = teacher_forced_logits(engine, method, pre, pre_mask, tokens, shared_prefill=shared)
    ref = (teacher_forced_logits(engine, build_method("full"), pre, pre_mask, tokens, shared_prefill=shared)
           if reference else None)
    return logits, ref
