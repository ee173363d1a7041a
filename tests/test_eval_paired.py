"""Paired accuracy comparison: intervals, verdicts and the item pairing."""
import json

import numpy as np

from hybridgen.eval import paired


def test_identical_runs_are_within_only_with_enough_items():
    a = {("t", i): float(i % 2) for i in range(300)}
    rows = {r.method: r for r in paired.compare({"full": a, "same": dict(a)}, "full")}
    assert rows["same"].delta == 0 and rows["same"].verdict == "within"  # 3/300 = 0.01 <= 0.02
    few = {k: v for k, v in a.items() if k[1] < 9}
    rows = {r.method: r for r in paired.compare({"full": few, "same": dict(few)}, "full")}
    assert rows["same"].verdict == "undecided"  # 3/9: nine items cannot show a difference below 0.02


def test_a_clearly_worse_method_is_outside_and_the_interval_covers_the_truth():
    rng = np.random.default_rng(0)
    ref = rng.random(2000) < 0.5
    worse = ref.copy()
    worse[rng.choice(2000, 200, replace=False)] = False  # loses ~0.05 of accuracy
    runs = {"full": {("t", i): float(x) for i, x in enumerate(ref)},
            "worse": {("t", i): float(x) for i, x in enumerate(worse)}}
    (r,) = [r for r in paired.compare(runs, "full") if r.method == "worse"]
    true = float(worse.mean() - ref.mean())
    assert r.lo <= true <= r.hi and r.hi < -0.02 and r.verdict == "outside"
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
