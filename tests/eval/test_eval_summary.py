"""The evaluation summary's recommendation by hand (eaglet.eval.eval_summary) and the statistics behind
it, on synthetic numbers (eaglet.eval.stats)."""

import pytest


# --------------------------------------------------------------------------- summary
def test_recommendation_follows_the_cost_model_by_hand():
    from eaglet.eval.eval_summary import recommend, verify_cost

    offline = {"K": 3, "overall": {"tau": {"1": 1.8, "2": 2.3, "3": 2.5},
                                   "accept_rate_per_pos": [0.8, 0.5, 0.2]}}
    spec = {"step_costs": {"target_forward_s": {"1": 0.010, "2": 0.011, "3": 0.012, "4": 0.016},
                           "draft_step_s": 0.001},
            "overall": {"k": {"2": {"speedup": 1.7, "tau": 2.3}}}}
    rec = recommend(offline, spec)
    pred = {r["k"]: r["predicted_speedup"] for r in rec["table"]}
    assert pred[1] == pytest.approx(1.8 * 0.010 / (0.011 + 0.001))
    assert pred[2] == pytest.approx(2.3 * 0.010 / (0.012 + 0.002))
    assert pred[3] == pytest.approx(2.5 * 0.010 / (0.016 + 0.003))
    assert rec["recommended_k"] == 2 and rec["speculation_pays"]
    assert rec["table"][1]["measured_speedup"] == 1.7 and rec["table"][0]["measured_speedup"] is None
    # an unmeasured length comes from the line through the measured ones
    assert verify_cost({1: 1.0, 2: 2.0, 3: 3.0}, 5) == pytest.approx(5.0)
    assert rec["break_even_tau"][3] == pytest.approx((0.016 + 3 * 0.001) / 0.010)


def _measured(speedups: dict, costs=None) -> tuple[dict, dict]:
    """offline.json / speculative.json stand-ins with measured speedups {k: (median, lo, hi)}."""
    offline = {"K": 3, "overall": {"tau": {"1": 1.6, "2": 1.9, "3": 2.0}, "tau_chain": {"1": 1.5, "2": 1.8, "3": 1.9},
                                   "accept_rate_per_pos": [0.6, 0.3, 0.1]}}
    spec = {"step_costs": costs or {"target_forward_s": {"1": 0.010, "2": 0.014, "3": 0.018, "4": 0.022},
                                    "draft_step_s": 0.004},
            "overall": {"k": {str(k): {"speedup": m, "tau": offline["overall"]["tau_chain"][str(k)],
                                       "speedup_ci": {"estimate": m, "lo": lo, "hi": hi,
                                                      "conclusive": not lo <= 1 <= hi}}
                              for k, (m, lo, hi) in speedups.items()}}}
    return offline, spec


def test_no_k_that_pays_means_do_not_speculate_with_break_even_tau():
    """The old rule recommended k = 1 beside a 0.66x speedup: argmax of a prediction, whatever it was."""
    from eaglet.eval.eval_summary import recommend

    rec = recommend(*_measured({1: (0.66, 0.6, 0.7), 2: (0.55, 0.5, 0.6), 3: (0.48, 0.4, 0.52)}))
    assert rec["recommended_k"] is None and not rec["speculation_pays"]
    assert rec["verdict"] == "do not speculate on this hardware"
    # break-even τ_k = (t_verify(k) + k t_draft) / t_step, by hand
    assert rec["break_even_tau"] == pytest.approx({1: (0.014 + 0.004) / 0.010, 2: (0.018 + 0.008) / 0.010,
                                                   3: (0.022 + 0.012) / 0.010})
    assert "Do not speculate" in rec["sentence"] and "needs τ 1.80, has 1.50" in rec["sentence"]
    assert rec["conclusive"] is True  # every interval is below 1
    # a median below 1 does not pay even when its interval reaches above 1 ...
    rec = recommend(*_measured({1: (0.95, 0.7, 1.2), 2: (0.9, 0.6, 1.1), 3: (0.8, 0.6, 1.0)}))
    assert rec["recommended_k"] is None and rec["conclusive"] is False
    # ... and a median above 1 whose interval spans 1 is recommended, flagged not conclusive
    rec = recommend(*_measured({1: (1.2, 0.9, 1.5), 2: (0.9, 0.6, 1.1), 3: (0.8, 0.6, 1.0)}))
    assert rec["recommended_k"] == 1 and rec["conclusive"] is False and "Not conclusive" in rec["sentence"]
    rec = recommend(*_measured({1: (1.3, 1.2, 1.4), 2: (0.9, 0.6, 1.1), 3: (0.8, 0.6, 1.0)}))
    assert rec["recommended_k"] == 1 and rec["conclusive"] is True and rec["verdict"] == "speculate with k=1"


# --------------------------------------------------------------------------- statistics (synthetic numbers)
def test_bootstrap_intervals_and_verdicts_on_synthetic_numbers():
    from eaglet.eval import stats

    # the contended run's per-prompt speedups: no conclusion is possible
    wild = stats.speedup_interval([13.85, 15.72, 0.32, 0.9, 1.1, 0.5])
    assert wild["lo"] < 1 < wild["hi"] and wild["conclusive"] is False and "spans 1" in wild["note"]
    assert wild["estimate"] == pytest.approx(1.0)  # the median of the prompts, not a mean of outliers
    # tight and above 1: conclusive; seeded, so the same numbers give the same interval
    tight = stats.speedup_interval([1.50, 1.52, 1.48, 1.51, 1.49, 1.50, 1.53])
    assert tight["conclusive"] is True and 1.48 <= tight["lo"] <= 1.50 <= tight["hi"] <= 1.53
    assert stats.speedup_interval([1.50, 1.52, 1.48, 1.51, 1.49, 1.50, 1.53]) == tight
    # tight and below 1: conclusive too (it is slower)
    assert stats.speedup_interval([0.6, 0.62, 0.61, 0.63])["conclusive"] is True
    # above 1 but wider than max_relative_width x the estimate: too noisy
    noisy = stats.speedup_interval([1.2, 3.0, 1.5, 2.8, 1.1, 3.3], max_rel_width=0.5)
    assert noisy["lo"] > 1 and noisy["conclusive"] is False and "too noisy" in noisy["note"]
    # one prompt: no interval at all
    one = stats.speedup_interval([2.0])
    assert one["lo"] is None and one["conclusive"] is False
    # τ pools prompts: 1 + Σ accepted / Σ rounds, by hand; the interval resamples prompts
    assert stats.pooled_tau([(3, 4), (1, 4)]) == pytest.approx(1 + 4 / 8)
    t = stats.tau_interval([(3, 4), (1, 4), (2, 4), (0, 4)])
    assert t["estimate"] == pytest.approx(1.375) and 1.0 <= t["lo"] < t["estimate"] < t["hi"] <= 1.75
    # every resample of identical prompts gives the same τ: a zero-width, conclusive interval
    same = stats.tau_interval([(2, 4)] * 5)
    assert same["lo"] == same["hi"] == pytest.approx(1.5) and same["conclusive"] is True


def test_two_proportion_z_by_hand():
    from eaglet.eval import stats

    # 30/100 vs 50/100: pooled p 0.4, se sqrt(0.4 * 0.6 * 0.02)
    assert stats.two_proportion_z(30, 100, 50, 100) == pytest.approx(-0.2 / (0.4 * 0.6 * 0.02) ** 0.5)
    assert stats.two_proportion_z(0, 50, 0, 60) == 0.0 and stats.two_proportion_z(3, 0, 1, 5) is None
    assert stats.z_critical(0.05, 1) == pytest.approx(1.959964, abs=1e-5)
    assert stats.z_critical(0.05, 10) == pytest.approx(2.807034, abs=1e-5)  # Bonferroni: 0.005 per side


def test_timings_on_a_busy_machine_are_not_conclusive():
    """Other processes' CPU use is measured while the timings run (eaglet.eval.stats.OtherLoad): two
    busy processes beside it read as a busy machine, this process's own work does not count; on a
    busy machine no speedup verdict and no recommendation is conclusive, whatever the intervals."""
    import subprocess
    import sys
    import time

    from eaglet.eval import stats
    from eaglet.eval.eval_summary import recommend
    from eaglet.eval.stats import BUSY_SHARE, OtherLoad, busy_verdict

    # This process's own CPU is taken out, in the same window as everything else the CPUs did (under
    # `make test` the other worker's load comes and goes: two windows one after another differ by it).
    cpus = stats._cpus()
    busy0, own0, t0 = stats._cpu_busy_s(cpus), stats._own_cpu_s(), time.monotonic()
    own = OtherLoad().start()
    while time.monotonic() - t0 < 1.0:  # this process's own CPU: not another process's
        pass
    own = own.stop()
    wall = time.monotonic() - t0
    raw = (stats._cpu_busy_s(cpus) - busy0) / (wall * len(cpus))
    mine = (stats._own_cpu_s() - own0) / (wall * len(cpus))
    assert mine > 0.1, mine  # the loop really ran here
    assert own["other_cpu_share"] <= raw - 0.8 * mine + 0.02, (own, raw, mine)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(own["cpus"])]
    try:
        time.sleep(0.5)
        busy = OtherLoad().start()
        time.sleep(1.5)
        busy = busy.stop()
    finally:
        for h in hogs:
            h.kill()
    assert busy["busy"] is True and busy["other_cpu_share"] > BUSY_SHARE and "too busy" in busy["note"]
    ci = {"estimate": 0.6, "lo": 0.55, "hi": 0.65, "conclusive": True, "note": "speedup 0.6 (...)"}
    assert busy_verdict(ci, {"busy": False}) == ci
    flagged = busy_verdict(ci, busy)
    assert flagged["conclusive"] is False and flagged["note"].endswith(busy["note"])
    offline, spec = _measured({1: (0.66, 0.6, 0.7), 2: (0.55, 0.5, 0.6), 3: (0.48, 0.4, 0.52)})
    assert recommend(offline, spec)["conclusive"] is True
    spec["timing"] = {"load": busy}
    rec = recommend(offline, spec)
    assert rec["conclusive"] is False and rec["sentence"].endswith(f"Not conclusive: {busy['note']}.")


def test_results_matrix_concatenates_every_stage_and_prints_one_table():
    from eaglet.eval import stats
    from eaglet.eval.eval_summary import results_matrix

    iv = {"estimate": 1.5, "lo": 1.3, "hi": 1.7}
    offline = {"matrix": stats.matrix_rows(
        "chain", 0.0, [1, 3], {"prompts": 3, "tau": {"1": iv, "3": iv}}, {"mtbench": {"prompts": 3, "tau": {1: iv}}},
        {"mtbench/writing": {"set": "mtbench", "prompts": 1, "tau": {3: {"estimate": 1.2, "lo": None, "hi": None}}}})}
    spec = {"matrix": [stats.matrix_row("hf_loop", 1.0, 3, "all", "all", iv, 3, "probabilistic")]}
    vllm = {"matrix": [{"engine": "vllm", "temperature": 1.0, "k": 3, "set": "all", "domain": "all", "tau": 1.45,
                        "ci": [1.2, 1.6], "prompts": 3, "rule": "greedy"}]}
    with pytest.raises(ValueError, match="names its rule"):  # at T > 0 a row says how it drafted
        stats.matrix_row("hf_loop", 1.0, 3, "all", "all", iv, 3)
    rows = results_matrix(offline, spec, vllm)
    assert [r["engine"] for r in rows] == ["chain"] * 6 + ["hf_loop", "vllm"]
    # a set without k = 3, a domain with one prompt: null tau / null interval, never a made-up one
    assert {(r["set"], r["domain"], r["k"]): (r["tau"], r["ci"]) for r in rows if r["engine"] == "chain"} == {
        ("all", "all", 1): (1.5, [1.3, 1.7]), ("all", "all", 3): (1.5, [1.3, 1.7]),
        ("mtbench", "all", 1): (1.5, [1.3, 1.7]), ("mtbench", "all", 3): (None, None),
        ("mtbench", "mtbench/writing", 1): (None, None), ("mtbench", "mtbench/writing", 3): (1.2, None)}
    assert results_matrix(offline, None) == offline["matrix"] and results_matrix({"status": "not run"}) == []
    table = stats.matrix_table(rows).splitlines()
    assert table[0].split()[:7] == ["set", "domain", "k", "T", "engine", "rule", "tau"] and len(table) == 1 + len(rows)
    assert {r["rule"] for r in rows if r["engine"] == "chain"} == {"greedy"}  # T = 0: the greedy chain
    # domain x k x T x engine: the whole-run rows last, their k = 3 block ordered by T, then engine
    assert [line.split()[4:6] for line in table[-3:]] == [["chain", "greedy"], ["hf_loop", "probabilistic"],
                                                           ["vllm", "greedy"]]
    assert "1.20-1.60" in table[-1] and "1.450" in table[-1]
