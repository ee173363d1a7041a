"""hybridgen.testing.conformance over every registered method and over outside methods, and one
check that, for every method placed on the tiny model under GPU budgets of 1.2x..0.03x of its
full KV, the store ledger's peak per tier is the footprint the placement and the cost use."""
import functools
import sys
import textwrap

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.kv import TieredStore
from hybridgen.methods import available_methods, build_method
from hybridgen.methods import registry
from hybridgen.methods.placement import KVShape, place
from hybridgen.testing import conformance
from tests.test_methods_registry import make_outside_package

# parameters under which a method keeps everything (equal to `full`); None = it has none
LOSSLESS = {"full": {}, "hybrid-exact": {}, "flexgen": {"gpu_budget": 0.5}, "hybridgen": {"gpu_budget": 1.0},
            "h2o": {"budget": 1.0}, "snapkv": {"budget": 1.0}, "streamingllm": {"budget": 1.0}, "quest": {"budget": 1.0},
            "pyramidkv": {"budget": 1.0}, "shadowkv": {"budget": 1.0}, "magicpig": {"window": 1000},
            # InfiniGen fetches the MEAN over rows of the per-row counts: with left padding a full
            # budget still drops tokens of the unpadded rows (its own tests check it at budget 1.0)
            "infinigen": None, "uvm": None, "uvm-h2o": None}
EVICTING = {"h2o", "snapkv", "streamingllm", "quest", "pyramidkv"}


@pytest.mark.parametrize("name", available_methods())
def test_every_registered_method_conforms(name):
    report = conformance(functools.partial(build_method, name), LOSSLESS.get(name))
    assert "bad_params" in report.passed
    if LOSSLESS.get(name) is not None:
        assert "lossless" in report.passed
    if report.footprint is not None:  # stated: the ledger must equal it (conformance asserts it too)
        assert report.ledger == report.footprint and "ledger" in report.passed
    else:  # not stated yet (other methods' footprints come in their own change): reported as such
        assert report.skipped["ledger"] in ("footprint not stated", "projected only"), name
    if name in EVICTING:
        assert {"ledger", "offloaded"} <= set(report.passed), report


def test_conformance_catches_a_wrong_footprint_and_a_lossy_method():
    """The checks can fail: a footprint one byte off, and a lossy 'lossless' claim."""
    from baselines.h2o import H2O

    class OffByOne(H2O):
        def footprint(self, shape):
            fp = super().footprint(shape)
            return type(fp)(fp.gpu_tokens, fp.host_tokens, fp.staging_tokens,
                            {t: n + 1 for t, n in fp.tier_bytes.items()})

    with pytest.raises(AssertionError, match="ledger peak"):
        conformance(OffByOne, None)
    with pytest.raises(AssertionError, match="differs from full"):
        conformance(functools.partial(build_method, "h2o"), {"budget": 0.3})
    with pytest.raises(AssertionError, match="accepted"):
        conformance(functools.partial(build_method, "h2o"), None, bad_params=[{"budget": 0.5}])


KEYNORM = '''
"""An outside evicting method on the scorer base: keep the keys with the largest norm + a recent window."""
from dataclasses import dataclass
from typing import ClassVar, List

from hybridgen.attention import partial_attention
from hybridgen.methods import Fraction
from hybridgen.methods.evicting import EvictingMethod, Part, keep_recent_and_top, recent_count
from hybridgen.methods.tensors import gather_mask, gather_tokens, needs_mask


@dataclass
class KeyNorm(EvictingMethod):
    name: ClassVar[str] = "{name}"
    recent_fraction: Fraction = 0.25

    def parts(self, layer, prompt_len, max_len, num_layers) -> List[Part]:
        return [Part("kv", self.budget.resolve(prompt_len) + max_len - prompt_len)]

    def prefill(self, layer, q, k, v, valid):
        keep = self.budget.resolve(k.shape[2])
        idx = keep_recent_and_top(k.float().norm(dim=-1), valid, keep, recent_count(keep, self.recent_fraction))
        seg = self.kv_segment(layer, "kv", needs_mask(valid))
        self.store(seg, gather_tokens(k, idx), gather_tokens(v, idx), gather_mask(valid, idx))

    def decode(self, layer, q, k, v):
        self.kept.append(layer, "kv", k, v)
        ck, cv, cm = self.kept.view(layer, "kv")
        return partial_attention(q, ck, cv, self.ctx.scale, cm)[0]
'''


@pytest.fixture
def outside_keynorm(tmp_path, monkeypatch):
    name = "key-norm"
    root = make_outside_package(tmp_path, "last-tokens")
    (root / "outside_methods" / "key_norm.py").write_text(textwrap.dedent(KEYNORM.replace("{name}", name)))
    eps = root / "outside_methods-0.1.dist-info" / "entry_points.txt"
    eps.write_text(eps.read_text() + f"{name} = outside_methods.key_norm:KeyNorm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for n in (name, "last-tokens"):
        registry._loaded.pop(n, None)
        registry._declared.pop(n, None)
    for mod in ("outside_methods.key_norm", "outside_methods.last_tokens", "outside_methods"):
        sys.modules.pop(mod, None)


def test_outside_methods_conform(outside_keynorm):
    """A plain KVMethod from another package (no footprint: reported) and an evicting one on the
    scorer base (footprint, placement and the Offloaded wrapper come with the base)."""
    plain = conformance(functools.partial(build_method, "last-tokens"), {})
    assert "lossless" in plain.passed and plain.skipped["ledger"] == "footprint not stated"
    report = conformance(functools.partial(build_method, outside_keynorm), {"budget": 1.0}, params={"budget": 0.3})
    assert {"bad_params", "lossless", "ledger", "offloaded"} <= set(report.passed)
    shape = KVShape(2, 2, 8, 4, 2, 44, 4)
    assert place(outside_keynorm, 10**9, shape) == {"offload": "none"}
    assert place(outside_keynorm, 0, shape) == {"offload": "cpu"}


@pytest.fixture(scope="module")
def tiny():
    from hybridgen.model import load_model

    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def test_ledger_equals_the_footprint_the_placement_and_the_cost_use(tiny):
    """Every method, the tiny model, budgets 1.2x..0.03x of the full KV: placed from its
    footprint, run under a gpu tier of exactly the budget, its ledger peak per tier is that
    footprint; its projected cost's gpu/staging tokens are the footprint's on the cost's shape."""
    from hybridgen.perf import CostContext, Workload, as_model_shape, load_profile

    sp, B, T, N = tiny.spec, 2, 64, 5
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N)
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0  # padding: the masks are allocated, as the footprint counts them
    cost_ctx = CostContext(as_model_shape("smollm2-135m"), Workload(batch=B, context=T + N), load_profile("h200-host"))
    checked, skipped = set(), set()
    for name in available_methods():
        if getattr(build_method(name), "projected_only", None):
            skipped.add(name)
            continue
        for share in (1.2, 0.6, 0.15, 0.03):
            G = int(shape.full_bytes * share)
            try:
                params = place(name, G, shape)
            except ConfigError:  # cannot fit at all: refused (tests/test_placement.py checks the message)
                continue
            method = build_method(name, **params)
            fp = method.footprint(shape)
            assert fp is not None, f"{name} states no footprint"
            store = TieredStore(gpu=G)
            tiny.generate(ids, method, max_new_tokens=N, attention_mask=mask, store=store)
            peak = {t: n for t, n in store.peak_by_tier().items() if n}
            assert peak == {t: n for t, n in fp.tier_bytes.items() if n}, (name, share, params)
            assert fp.gpu_bytes <= G
            cs = cost_ctx.kv_shape()
            cost, fc = method.layer_cost(cost_ctx), method.footprint(cs)
            projected = (cs.layers * cost.gpu_tokens + cost.staging_tokens) * cs.batch * cs.token_bytes
            assert projected == pytest.approx(fc.gpu_bytes, rel=1e-9, abs=1.0), (name, params)
            checked.add(name)
    assert checked == set(available_methods()) - skipped, "every method that runs is checked"
    print(f"ledger == footprint checked: {sorted(checked)}; skipped (projected only, never run): {sorted(skipped)}")
