"""Paired accuracy comparison: intervals, significance, the equivalence verdict and the item pairing."""
import json

import numpy as np

from hybridgen.eval import paired


def test_identical_runs_are_equivalent_only_with_enough_items():
    a = {("t", i): float(i % 2) for i in range(300)}
    rows = {r.method: r for r in paired.compare({"full": a, "same": dict(a)}, "full")}
    assert rows["same"].delta == 0 and rows["same"].equivalent == "yes"  # 3/300 = 0.01 <= 0.02
    assert not rows["same"].significant
    few = {k: v for k, v in a.items() if k[1] < 9}
    rows = {r.method: r for r in paired.compare({"full": few, "same": dict(few)}, "full")}
    assert rows["same"].equivalent == "undecided"  # 3/9: nine items cannot show a difference below 0.02


def test_a_clearly_worse_method_is_significant_not_equivalent_and_the_interval_covers_the_truth():
    rng = np.random.default_rng(0)
    ref = rng.random(2000) < 0.5
    worse = ref.copy()
    worse[rng.choice(2000, 200, replace=False)] = False  # loses ~0.05 of accuracy
    runs = {"full": {("t", i): float(x) for i, x in enumerate(ref)},
            "worse": {("t", i): float(x) for i, x in enumerate(worse)}}
    (r,) = [r for r in paired.compare(runs, "full") if r.method == "worse"]
    true = float(worse.mean() - ref.mean())
    assert r.lo <= true <= r.hi and r.hi < -0.02 and r.equivalent == "no" and r.significant
    # pairing matters: the paired interval is much narrower than two independent error bars
    assert (r.hi - r.lo) < 2 * 1.96 * np.hypot(r.stderr, r.stderr) / 2


def test_only_shared_items_are_paired_and_samples_are_read(tmp_path):
    rows = [{"task": "t", "doc_id": i, "acc": 1.0, "acc_norm": float(i < 2)} for i in range(4)]
    rows.append({"task": "ppl", "doc_id": 0, "word_perplexity": 12.0})
    f = tmp_path / "samples.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    scores = paired.item_scores(f)
    assert scores == {("t", 0): 1.0, ("t", 1): 1.0, ("t", 2): 0.0, ("t", 3): 0.0}  # acc_norm wins, ppl skipped
    other = {("t", 0): 0.0, ("t", 1): 1.0}
    (r,) = [r for r in paired.compare({"full": scores, "m": other}, "full") if r.method == "m"]
    assert r.n == 2 and r.delta == -0.5


def test_an_interval_that_excludes_zero_is_significant_even_when_equivalence_is_undecided():
    # 200 items, 14 lost and none gained: the interval excludes zero -> "significant" (the printed
    # "-0.070 [-0.125, -0.015] undecided" of the old wording); equivalence is a separate column
    ref = {("t", i): 1.0 for i in range(200)}
    m = {("t", i): float(i >= 14) for i in range(200)}
    (r,) = [r for r in paired.compare({"full": ref, "m": m}, "full") if r.method == "m"]
    assert r.significant and r.hi < 0 and r.delta == -0.07
    md = paired.markdown([r], "full")
    assert "significant" in md and "equivalent within ±0.02" in md
    assert "-0.070 [" in md and "] significant" in md
    # an interval that covers zero is not significant, whatever its equivalence verdict
    mixed = {("t", i): float(i % 2) for i in range(200)}
    (s,) = [r for r in paired.compare({"full": mixed, "m": {k: 1 - v for k, v in mixed.items()}}, "full")
            if r.method == "m"]
    assert s.lo < 0 < s.hi and not s.significant and s.equivalent == "undecided"
    assert "significant" not in paired.delta_cell(s)


def test_the_bootstrap_is_scipys_paired_percentile_interval_with_a_fixed_seed():
    from scipy import stats

    rng = np.random.default_rng(1)
    a, b = (rng.random(150) < 0.5).astype(float), (rng.random(150) < 0.5).astype(float)
    lo, hi = paired.paired_interval(a, b, n_boot=2000, seed=3)
    ref = stats.bootstrap((a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True, vectorized=True,
                          n_resamples=2000, method="percentile", rng=np.random.default_rng(3))
    assert (lo, hi) == (ref.confidence_interval.low, ref.confidence_interval.high)
    assert (lo, hi) == paired.paired_interval(a, b, n_boot=2000, seed=3)  # seeded: reproducible
