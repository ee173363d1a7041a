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
  all from ``seed``;
- variants (RULER's niah kinds, numeric): ``single`` (one needle), ``multikey`` (the needle
  plus 3 needles of other cities at random depths; the question names one city) and
  ``multivalue`` (2 numbers for the same city, the first at ``depth``, the other at a random
  depth; the answer is both, in any order). Sample s of a cell uses ``variants[s % len(variants)]``.
"""
from __future__ import annotations

import random
from typing import Callable, List, Optional, Sequence

CITIES = ["Chicago", "Yangon", "Antananarivo", "Colombo", "Almaty", "Sydney", "Mexico City", "Seattle",
          "Lagos", "Amsterdam", "Belgrade", "Cairo", "Baghdad", "Damascus", "Kigali", "Dakar", "Sofia",
          "Victoria", "Tashkent", "Mumbai", "Barcelona", "Almaty", "Amman", "Toronto", "Bratislava",
          "Johannesburg", "Thimphu", "Bangkok", "Santiago", "Cape Town", "Rabat", "Lima", "Hanoi"]
NEEDLE = "The special magic number for {city} is: {number}."
QUESTION = ("\n\nWhat is the special magic number for {city} mentioned in the text above? "
            "The special magic number for {city} mentioned in the text above is:")
QUESTION_ALL = ("\n\nWhat are all the special magic numbers for {city} mentioned in the text above? "
                "The special magic numbers for {city} mentioned in the text above are:")
VARIANTS = ("single", "multikey", "multivalue")
DISTRACTORS = 3   # other cities' needles in a multikey doc
VALUES = 2        # numbers for the asked city in a multivalue doc
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


def _needles(rng: random.Random, variant: str, depth: float):
    """(city, [(needle sentence, depth)], answer) of one doc: the asked needle first."""
    city = CITIES[rng.randrange(len(CITIES))]
    numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(VALUES if variant == "multivalue" else 1)]
    needles = [(NEEDLE.format(city=city, number=n), depth if i == 0 else rng.uniform(0, 100))
               for i, n in enumerate(numbers)]
    if variant == "multikey":
        others = rng.sample([c for c in dict.fromkeys(CITIES) if c != city], DISTRACTORS)
        needles += [(NEEDLE.format(city=c, number=str(rng.randrange(1_000_000, 10_000_000))), rng.uniform(0, 100))
                    for c in others]
    return city, needles, " ".join(numbers)


def build_docs(corpus: str, lengths: Sequence[int], depths: Sequence[float], samples: int = 1,
               tokenizer=None, seed: int = 0, variants: Sequence[str] = ("single",),
               max_tokens: Optional[int] = None) -> List[dict]:
    """Needle docs: {"id", "length", "depth", "sample", "variant", "prompt", "answer", "city", "tokens"}.

    corpus: the haystack text (e.g. all essays). lengths: prompt lengths in tokens.
    depths: needle positions in percent (0 = start, 100 = end of the haystack). variants: see the
    module docstring; answer: the number, or the numbers separated by spaces (multivalue).
    max_tokens: at most this many prompt tokens (e.g. the model's positions less the answer's
    and the special tokens, so a 32K cell fits a 32K model): a longer length is built to
    ``max_tokens`` (checked on the whole prompt), its id and ``length`` keep the nominal length
    and ``tokens`` what it holds. The needles and the haystack's start drawn do not depend on it.
    """
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"needle variants must be among {', '.join(VARIANTS)}, got {list(variants)}")
    count = _counter(tokenizer)
    rng = random.Random(seed)
    docs = []
    for length in lengths:
        for depth in depths:
            for s in range(samples):
                variant = variants[s % len(variants)]
                city, needles, answer = _needles(rng, variant, depth)
                question = (QUESTION_ALL if variant == "multivalue" else QUESTION).format(city=city)
                overhead = count(PREFIX + " ".join(n for n, _ in needles) + " " + question)
                target = length if max_tokens is None else min(length, max_tokens)
                budget = max(target - overhead, 16)
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
                prompt = _with_needles(text[:lo], needles, question)
                while target < length and count(prompt) > target and lo > 0:  # a cap binds: at most target tokens
                    lo = max(0, lo - 64)
                    prompt = _with_needles(text[:lo], needles, question)
                tag = "" if variant == "single" else f"-{variant}"
                docs.append({"id": f"needle-{length}-{depth:g}-{s}{tag}", "length": int(length), "depth": float(depth),
                             "sample": s, "variant": variant, "prompt": prompt, "answer": answer, "city": city,
                             "tokens": count(prompt), "tokenizer": getattr(tokenizer, "name_or_path", None)})
    return docs


def _with_needles(hay: str, needles, question: str) -> str:
    """The prompt: the haystack with every needle at its depth (the asked one placed last, so
    it sits exactly at its depth), then the question."""
    for needle, at in reversed(needles):
        hay = _insert_at_depth(hay, needle, at)
    return PREFIX + hay + question


def score(generation: str, answer: str) -> float:
    """1.0 when the first 7-digit number in ``generation`` equals ``answer``; for several answers
    (space-separated, a multivalue doc), when every one of them is among its 7-digit numbers."""
    import re

    wanted = answer.split()
    if len(wanted) > 1:
        return float(set(wanted) <= set(re.findall(r"\d{7}", generation)))
    m = re.search(r"\d{7}", generation)
    return float(bool(m) and m.group(0) == answer)
