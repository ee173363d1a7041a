"""Needle-in-a-haystack documents over the Paul Graham essays, at given lengths and depths.

A doc is a haystack of essay text with one needle sentence inserted at ``depth`` percent of
the haystack, followed by a question; the answer is a 7-digit number, scored by exact match
of the first 7-digit number in the generation (no judge model needed).

Choices where the original test (gkamradt's needle-in-a-haystack) differs or is silent:
- numeric needle ("The special magic number for <city> is <7 digits>.", RULER's form) instead
  of the San Francisco sentence, so scoring is exact;
- the needle goes at the sentence boundary nearest to the depth (never mid-sentence);
- ``length`` counts the whole prompt (haystack + needle + question) in tokens of the given
  tokenizer; without a tokenizer, 4 characters count as one token (an estimate, recorded);
- several samples per (length, depth) use different cities, numbers and haystack offsets,
  all from ``seed``.
"""
from __future__ import annotations

import random
from typing import Callable, List, Sequence

CITIES = ["Chicago", "Yangon", "Antananarivo", "Colombo", "Almaty", "Sydney", "Mexico City", "Seattle",
          "Lagos", "Amsterdam", "Belgrade", "Cairo", "Baghdad", "Damascus", "Kigali", "Dakar", "Sofia",
          "Victoria", "Tashkent", "Mumbai", "Barcelona", "Almaty", "Amman", "Toronto", "Bratislava",
          "Johannesburg", "Thimphu", "Bangkok", "Santiago", "Cape Town", "Rabat", "Lima", "Hanoi"]
NEEDLE = "The special magic number for {city} is: {number}."
QUESTION = ("\n\nWhat is the special magic number for {city} mentioned in the text above? "
            "The special magic number for {city} mentioned in the text above is:")
PREFIX = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n\n"
CHARS_PER_TOKEN = 4.0


def _counter(tokenizer) -> Callable[[str], int]:
    if tokenizer is None:
        return lambda s: int(len(s) / CHARS_PER_TOKEN + 0.999)
    return lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])


def _insert_at_depth(haystack: str, needle: str, depth: float) -> str:
    pos = int(len(haystack) * depth / 100.0)
    if 0 < pos < len(haystack):
        # back up to the end of the previous sentence
        cut = max(haystack.rfind(". ", 0, pos), haystack.rfind("\n", 0, pos))
        pos = cut + 1 if cut >= 0 else 0
    return (haystack[:pos].rstrip() + " " + needle + " " + haystack[pos:].lstrip()).strip()


def build_docs(corpus: str, lengths: Sequence[int], depths: Sequence[float], samples: int = 1,
               tokenizer=None, seed: int = 0) -> List[dict]:
    """Needle docs: {"id", "length", "depth", "sample", "prompt", "answer", "city"}.

    corpus: the haystack text (e.g. all essays). lengths: prompt lengths in tokens.
    depths: needle positions in percent (0 = start, 100 = end of the haystack).
    """
    count = _counter(tokenizer)
    rng = random.Random(seed)
    docs = []
    for length in lengths:
        for depth in depths:
            for s in range(samples):
                city = CITIES[rng.randrange(len(CITIES))]
                number = str(rng.randrange(1_000_000, 10_000_000))
                needle = NEEDLE.format(city=city, number=number)
                question = QUESTION.format(city=city)
                overhead = count(PREFIX + needle + " " + question)
                budget = max(length - overhead, 16)
                start = rng.randrange(0, max(len(corpus) // 2, 1))
                text = (corpus[start:] + "\n\n" + corpus)
                # grow/shrink the haystack to the token budget (a few bisection steps)
                lo, hi = 0, min(len(text), int(budget * CHARS_PER_TOKEN * 2) + 64)
                while hi - lo > 32:
                    mid = (lo + hi) // 2
                    if count(text[:mid]) <= budget:
                        lo = mid
                    else:
                        hi = mid
                hay = text[:lo]
                prompt = PREFIX + _insert_at_depth(hay, needle, depth) + question
                docs.append({"id": f"needle-{length}-{depth:g}-{s}", "length": int(length), "depth": float(depth),
                             "sample": s, "prompt": prompt, "answer": number, "city": city,
                             "tokens": count(prompt), "tokenizer": getattr(tokenizer, "name_or_path", None)})
    return docs


def score(generation: str, answer: str) -> float:
    """1.0 when the first 7-digit number in ``generation`` equals ``answer``."""
    import re

    m = re.search(r"\d{7}", generation)
    return float(bool(m) and m.group(0) == answer)
