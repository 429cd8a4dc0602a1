"""The data-budget planner's statistics (eaglet.learning_curve.learning_curve) on data whose truth is known, and the
nested fractions the trainer draws for it."""

import math
import random

import pytest

from eaglet.learning_curve import curve_fit, learning_curve
from eaglet.train.data import in_fraction, is_val, plan_micro_batches
from eaglet.train.train import resolve_params


def synthetic_points(true_tau, tokens: list[int], n_seq: int, rounds: int, seed: int) -> list[dict]:
    """Validation sequences whose per-round acceptance is drawn around the τ a true curve gives
    at each token count (a sequence effect shared across points, as the same sequences are reused)."""
    rng = random.Random(seed)
    ease = [rng.gauss(0, 0.05) for _ in range(n_seq)]  # some sequences are easier for every drafter
    points = []
    for n in tokens:
        rate = true_tau(n) - 1  # accepted per round
        groups = []
        for s in range(n_seq):
            p = min(max(rate / 3 + ease[s], 0.0), 1.0)  # 3 drafts per round
            acc = sum(1 for _ in range(3 * rounds) if rng.random() < p)
            groups.append((acc, rounds))
        points.append({"tokens": n, "fraction": n / tokens[-1], "groups": groups})
    return points


def true_tau(n):
    return 1.1 + 0.05 * math.log(n / 1000)


def test_line_fit_is_exact_on_a_line():
    a, b = curve_fit.fit_line([0.0, 1.0, 2.0, 3.0], [1.0, 1.5, 2.0, 2.5])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one token count"):
        curve_fit.fit_line([1.0, 1.0], [1.0, 2.0])


def test_pooled_tau_counts_rounds_not_sequences():
    assert learning_curve.pooled_tau([(3, 1), (0, 3)]) == pytest.approx(1 + 3 / 4)
    assert learning_curve.pooled_tau([(0, 0)]) is None


def test_curve_recovers_the_slope_and_its_intervals_cover_the_truth():
    """Over 30 independent synthetic data sets the 90 % interval of τ at 10× the data holds the true
    τ most of the time (a bootstrap that ignored the pairing or the spread would not), and the
    slope per doubling is recovered on average."""
    tokens = [2500, 5000, 10000]
    hits, slopes = 0, []
    for rep in range(30):
        pts = synthetic_points(true_tau, tokens, n_seq=40, rounds=30, seed=rep)
        c = learning_curve.curve(pts, [100000], level=0.9, n_boot=400, seed=rep)
        lo, hi = c["predictions"][0]["interval"]
        hits += lo <= true_tau(100000) <= hi
        slopes.append(c["tau_gain_per_doubling"])
        assert lo <= c["predictions"][0]["tau"] <= hi
    assert hits >= 22, hits  # nominal 27 of 30
    assert sum(slopes) / len(slopes) == pytest.approx(0.05 * math.log(2), rel=0.25)


def test_check_passes_on_the_curve_and_fails_off_it():
    tokens = [2500, 5000, 10000]
    pts = synthetic_points(true_tau, tokens, n_seq=60, rounds=40, seed=1)
    ok = learning_curve.check(pts, pts[-1], 0.95, 500, 0)
    assert ok["status"] == "pass" and ok["interval"][0] <= ok["measured"] <= ok["interval"][1]
    # the full-data drafter far better than the fractions' trend: the line must miss it
    better = synthetic_points(lambda n: true_tau(n) + (0.3 if n == 10000 else 0), tokens, 60, 40, seed=1)
    miss = learning_curve.check(better, better[-1], 0.95, 500, 0)
    assert miss["status"] == "fail" and miss["measured"] > miss["interval"][1]
    one = learning_curve.check(pts[1:], pts[-1], 0.95, 500, 0)
    assert one["status"] == "not run" and "two fractions" in one["reason"]


def test_curve_refuses_points_on_other_sequences():
    pts = synthetic_points(true_tau, [1000, 2000], n_seq=5, rounds=4, seed=0)
    pts[1]["groups"] = pts[1]["groups"][:4]
    with pytest.raises(ValueError, match="same validation sequences"):
        learning_curve.curve(pts, [4000])


def test_costs_scale_with_the_data_and_say_what_was_not_measured(tmp_path):
    from eaglet.base.files import write_json

    idx = tmp_path / "index.json"
    write_json(idx, {"chunks": [{"bytes": 1000}, {"bytes": 500}]})
    times = [{"rule": "generate", "seconds": 60.0}, {"rule": "train", "seconds": 30.0},
             {"rule": "train", "seconds": 10.0}]
    costs = learning_curve.measured_costs(tmp_path, "generate_summary.json", [str(idx)], times)
    assert costs["generate_s"] == 60.0 and costs["train_s"] == 40.0 and costs["hidden_bytes"] == 1500
    assert costs["extract_s"] is None  # e.g. restored from the cache: no job record
    p = learning_curve.projected_costs(costs, 10)
    assert p["generate_hours"] == pytest.approx(600 / 3600) and p["hidden_gb"] == pytest.approx(15000 / 1e9)
    assert p["not_measured"] == ["extract"] and p["extract_hours"] is None


def test_fractions_are_nested_and_leave_validation_alone():
    ids = [f"sample-{i}" for i in range(2000)]
    quarter = {s for s in ids if in_fraction(s, 0.25)}
    half = {s for s in ids if in_fraction(s, 0.5)}
    assert quarter < half and abs(len(quarter) - 500) < 80 and abs(len(half) - 1000) < 100
    p = resolve_params({"data_fraction": 0.5, "epochs": 1, "token_budget": 64})
    _micro, train_idx, val_idx = plan_micro_batches(ids, [8] * len(ids), p)
    _m, full_train, full_val = plan_micro_batches(ids, [8] * len(ids), dict(p, data_fraction=1.0))
    assert val_idx == full_val and set(train_idx) < set(full_train)
    assert all(not is_val(ids[i], p["val_fraction"]) and ids[i] in half for i in train_idx)
