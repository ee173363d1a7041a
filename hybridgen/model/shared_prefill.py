"""One dense prefill of a prompt, recorded once, from which every KV method starts (``SharedPrefill``).

The engine's prefill is the same dense causal pass whatever the method: the method only takes
each layer's q/k/v afterwards (``method.prefill(layer, q, k, v, valid)``). So a table of ten
methods on one prompt needs ONE dense prefill, not ten:

    from hybridgen.model.shared_prefill import record_prefill
    shared = record_prefill(engine, ids, mask, max_new_tokens=64)     # the dense pass, once
    for name in ("full", "h2o", "hybridgen"):
        engine.generate(ids, name, max_new_tokens=64, attention_mask=mask, shared_prefill=shared)

Each method then gets exactly the tensors its own prefill would have computed (the same
code on the same inputs), and the same last-position logits: tokens and logits equal those of a
run without sharing, bit for bit (``tests/test_shared_prefill.py`` checks every registered
method, and that no method writes into the record).

Both engines record and replay. On the transformers backend (:class:`hybridgen.hf.HFEngine`) the
record holds the globally attending layers' q/k/v (the layers a method acts on) and, in
``model_cache``, transformers' cache after the dense pass (the sliding-window layers' KV), which
each replay starts from a copy of.

Memory: the record holds every method layer's q, k and v, L x B x T x (Hq + 2 Hkv) x D values in
the engine's dtype (SmolLM2-135M, 8K tokens, float32: 0.9 GiB; Gemma-3-270m's 3 global layers,
32K tokens: 0.6 GiB).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.model import ops

if TYPE_CHECKING:
    from hybridgen.model.engine import Engine


@dataclass(frozen=True)
class SharedPrefill:
    """The dense prefill of one (padded) prompt on one engine.

    ids [B, T] token ids; valid [B, T] bool (False = left padding) or None when unpadded;
    positions [B, T]; layers[i] = (q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]) of
    method layer i with rotary applied; logits [B, V] float32 of the last position; max_new_tokens:
    the decode steps it was checked for (positions); engine_id: id() of the recording engine;
    model_cache: the transformers backend's cache after the dense pass (None on the lean engine),
    never decoded into (each replay copies it).
    """

    ids: Tensor
    valid: Optional[Tensor]
    positions: Tensor
    layers: List[Tuple[Tensor, Tensor, Tensor]]
    logits: Tensor
    max_new_tokens: int
    engine_id: int
    model_cache: Any = None

    def check_matches(self, engine: "Engine", ids: Tensor, valid: Optional[Tensor], max_new_tokens: int) -> None:
        """One-line ConfigError unless this record is of ``engine`` on these ``ids``/``valid`` [B, T]."""
        if engine is None or id(engine) != self.engine_id:
            raise ConfigError("shared_prefill was recorded by another engine; record it with this engine "
                              "(record_prefill(engine, ids, mask))")
        if ids.shape != self.ids.shape or not torch.equal(ids, self.ids):
            raise ConfigError(f"shared_prefill was recorded for other input_ids (shape {tuple(self.ids.shape)}); "
                              "record it for the prompt you generate from")
        same_mask = (valid is None and self.valid is None) or (
            valid is not None and self.valid is not None and torch.equal(valid, self.valid))
        if not same_mask:
            raise ConfigError("shared_prefill was recorded with another attention_mask; pass the same mask")
        if max_new_tokens > self.max_new_tokens:
            raise ConfigError(f"shared_prefill was recorded for up to {self.max_new_tokens} new tokens, not "
                              f"{max_new_tokens}; record it with max_new_tokens >= {max_new_tokens}")

    def rows(self, index: Tensor) -> "SharedPrefill":
        """The record of rows ``index`` [B'] (a LongTensor into this record's batch; repeats allowed):
        the same prompts prefilled once, handed to a batch that holds some of them several times."""
        if self.model_cache is not None:
            raise ConfigError("rows() of a transformers-backend record is not supported; record the batch you generate")
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        valid = None if self.valid is None else pick(self.valid)
        return SharedPrefill(ids=pick(self.ids), valid=None if valid is None or bool(valid.all()) else valid,
                             positions=pick(self.positions), layers=[tuple(map(pick, t)) for t in self.layers],
                             logits=pick(self.logits), max_new_tokens=self.max_new_tokens, engine_id=self.engine_id)

    @property
    def nbytes(self) -> int:
        """Bytes the recorded q/k/v hold."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


@torch.no_grad()
def record_prefill(engine: "Engine", input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                   max_new_tokens: int = 1) -> SharedPrefill:
    """The dense prefill of ``input_ids`` [B, T] (left-padded, ``attention_mask`` [B, T]) on
    ``engine`` (the lean engine or the transformers backend), every method layer's q/k/v kept:
    pass it as ``shared_prefill=`` to ``engine.generate`` or ``engine.prefill`` for each method
    that should start from it."""
    from hybridgen.model.engine import Engine

    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(engine, Engine):
        record = getattr(engine, "record_dense_prefill", None)
        if record is None:
            raise ConfigError(f"record_prefill needs a hybridgen engine (hybridgen.model.Engine or "
                              f"hybridgen.hf.HFEngine), got {type(engine).__name__}")
        return record(input_ids, attention_mask, max_new_tokens)
    ids, valid, positions = engine._prepare(input_ids, attention_mask, max_new_tokens)
    s = engine.spec
    layers: List[Tuple[Tensor, Tensor, Tensor]] = []

    def attend(i, q, k, v):
        layers.append((q, k, v))
        return ops.causal_attention(q, k, v, s.scale, valid, engine.attn_chunk)

    logits = engine._checked(engine._logits(engine._dense(ids, positions, attend)[:, -1]))
    return SharedPrefill(ids=ids, valid=valid, positions=positions, layers=layers, logits=logits,
                         max_new_tokens=max_new_tokens, engine_id=id(engine))
