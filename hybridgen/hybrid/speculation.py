"""Cross-layer speculation: layer l+1's stand-in query computed from layer l's input.

At a decode step the engine calls ``on_layer_input(l, hidden_l)`` before layer l runs.
A speculating method (HybridGen's pipelining, InfiniGen's prefetch) computes from it the
*stand-in query* of layer l+1 (layer l's input through layer l+1's attention norm, q
projection and rotary: ``engine.stand_in_query``), so layer l+1's KV selection can start
while layer l computes. The rotary needs the positions of the token being decoded; they are
passed explicitly (:class:`DecodePositions` keeps them from the prompt's padding mask and the
number of steps), not read from the engine's mutable state.

Shapes: hidden [B, 1, hidden_size]; positions [B, 1] int64; stand-in and true queries
[B, Hq, 1, D].
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from hybridgen.methods import MethodContext


class DecodePositions:
    """The position of the token the next decode step feeds, per batch row.

    After a prompt of T tokens, left-padded as ``valid`` [B, T] says (None: no padding),
    row b decodes at position ``valid[b].sum()`` (T unpadded: the engine numbers the real
    tokens from 0), one more after each step.
    """

    def __init__(self) -> None:
        self._next: Optional[Tensor] = None  # [B] int64

    def start(self, valid: Optional[Tensor], batch: int, prompt_len: int, device: torch.device) -> None:
        """Set the positions after a prompt (call once per generation, e.g. at layer 0's prefill)."""
        if valid is None:
            self._next = torch.full((batch,), prompt_len, dtype=torch.long, device=device)
        else:
            self._next = valid.long().sum(-1)

    def current(self) -> Optional[Tensor]:
        """Positions [B, 1] int64 of the token being decoded now (None before :meth:`start`)."""
        return None if self._next is None else self._next[:, None]

    def advance(self) -> None:
        """One decode step done (call at ``end_step``)."""
        if self._next is not None:
            self._next = self._next + 1


def next_layer(ctx: MethodContext, layer: int) -> Optional[int]:
    """The layer whose stand-in query can be computed from ``layer``'s input: layer + 1 when an
    engine is bound (method-level use has none) and ``layer`` is not the last; else None."""
    nxt = layer + 1
    if ctx.engine is None or nxt >= ctx.num_layers:
        return None
    return nxt


def stand_in_query(ctx: MethodContext, layer: int, hidden: Tensor, positions: Tensor) -> Tensor:
    """``layer``'s stand-in query [B, Hq, 1, D] from the previous layer's input ``hidden``
    [B, 1, hidden_size] at ``positions`` [B, 1]."""
    return ctx.engine.stand_in_query(layer, hidden, positions)


class StandInQuality:
    """Cosine similarity of stand-in and true queries per layer, and whether to trust a stand-in.

    trace: the dict the cosines go to (layer as a string -> one mean cosine per step, e.g. a
    method's ``stats['trace']['cosine']``). min_cos: a layer whose mean cosine so far is below
    it is not speculated (0 or less: always speculate). Cosines are computed on the device and
    read back at :meth:`flush` (once per step: no mid-layer sync).
    """

    def __init__(self, trace: Dict[str, List[float]], min_cos: float):
        self.trace = trace
        self.min_cos = min_cos
        self._pending: List[Tuple[int, Tensor]] = []

    def trusted(self, layer: int) -> bool:
        """Speculate ``layer`` unless its stand-in query has proven a poor proxy (mean cosine so far)."""
        seen = self.trace.get(str(layer))
        return not seen or sum(seen) / len(seen) >= self.min_cos

    def record(self, layer: int, stand_in: Tensor, q: Tensor) -> None:
        """Mean over (batch, head) of cos(stand-in, true query) of ``layer`` at this step."""
        cos = F.cosine_similarity(stand_in.float().flatten(2), q.float().flatten(2), dim=-1).mean()
        self._pending.append((layer, cos))

    def flush(self) -> None:
        """Move this step's cosines into ``trace`` (reads them back from the device)."""
        for layer, cos in self._pending:
            self.trace.setdefault(str(layer), []).append(float(cos))
        self._pending = []

    def mean(self) -> Optional[float]:
        """Mean of every recorded cosine (None when none)."""
        cos = [c for v in self.trace.values() for c in v]
        return sum(cos) / len(cos) if cos else None

    def by_layer(self) -> Dict[int, float]:
        """Mean cosine per speculated layer."""
        return {int(l): sum(v) / len(v) for l, v in self.trace.items() if v}
