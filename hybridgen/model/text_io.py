"""Text in and out of an engine: tokenize and left-pad, detokenize (shared by the lean engine and
the transformers backend; a class using it has ``tokenizer``, ``name`` and ``device``)."""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

from torch import Tensor

from hybridgen.errors import ConfigError


class TextIO:
    """Mixin: :meth:`encode` / :meth:`decode_text` through the engine's tokenizer."""

    def encode(self, texts: Union[str, Sequence[str]], chat: bool = False,
               add_special_tokens: bool = True) -> Tuple[Tensor, Tensor]:
        """Tokenize and left-pad: returns (input_ids [B, T], attention_mask [B, T]) on the engine's device.

        chat: wrap each text as one user turn with the tokenizer's chat template.
        """
        tok = self._need_tokenizer()
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise ConfigError("encode needs at least one text; got an empty list")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise ConfigError(f"encode takes strings; text {bad[0]} is a {type(texts[bad[0]]).__name__}")
        if chat:
            texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                             add_generation_prompt=True) for t in texts]
            add_special_tokens = False
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left",
                  add_special_tokens=add_special_tokens)
        empty = [i for i, n in enumerate(enc["attention_mask"].sum(-1).tolist()) if n == 0]
        if empty:
            raise ConfigError(f"text {empty[0]} of the batch is empty (it has no tokens); drop it or give it "
                              "some text")
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def decode_text(self, tokens: Tensor, skip_special_tokens: bool = True) -> List[str]:
        """Token ids [B, n] -> list of strings."""
        tok = self._need_tokenizer()
        return tok.batch_decode(tokens.tolist(), skip_special_tokens=skip_special_tokens)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError(f"model {self.name!r} has no tokenizer (dummy/random weights or none in the "
                              "checkpoint); pass token ids instead of text")
        return self.tokenizer
