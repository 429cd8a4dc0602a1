"""eaglet.drafter.chain: the greedy chain counted from per-draft hits, against a step-by-step replay of
the real loop written out here; the expected acceptance of speculative sampling (T > 0) by hand."""

import random

import pytest
import torch

from eaglet.drafter import chain


def replay_by_hand(hits: list[list[bool]], mask: list[bool], k: int) -> tuple[int, int]:
    """The real loop on each assistant span x[s..e]: the prefill emits x[s]; a round after g
    emitted tokens drafts from index t = s + g - 2, at most min(k, N - g - 1) drafts, accepts
    while draft j hits, then emits the accepted drafts and one bonus token. -> (accepted, rounds)."""
    acc = rounds = 0
    i, T = 0, len(mask)
    while i < T:
        if not mask[i]:
            i += 1
            continue
        s = i
        while i < T and mask[i]:
            i += 1
        n = i - s
        g = 1
        while g < n:
            k_eff = min(k, n - g - 1)
            a = 0
            while a < k_eff and hits[s + g - 2][a]:
                a += 1
            if k_eff > 0:
                acc, rounds = acc + a, rounds + 1
            g += a + 1
    return acc, rounds


def test_accepted_runs_stop_at_the_first_miss():
    hits = torch.tensor([[[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]]], dtype=torch.bool)
    assert chain.accepted_runs(hits).tolist() == [[2, 0, 4]]


def test_spans():
    assert chain.spans([0, 1, 1, 0, 0, 1, 0, 1, 1, 1]) == [(1, 2), (5, 5), (7, 9)]
    assert chain.spans([]) == [] and chain.spans([1, 1]) == [(0, 1)]


def test_sequence_rounds_match_the_loop_replayed_by_hand():
    rng = random.Random(0)
    for trial in range(300):
        T, K = rng.randint(3, 30), rng.randint(1, 5)
        mask = [False] * rng.randint(1, 3) + [rng.random() < 0.8 for _ in range(T)]
        hits = [[rng.random() < 0.7 for _ in range(K)] for _ in mask]
        acc_T = chain.accepted_runs(torch.tensor(hits)[None])[0].tolist()
        for k in range(1, K + 1):
            rounds = chain.sequence_rounds(acc_T, mask, k)
            drafted = [r for r in rounds if r[1] > 0]
            assert (sum(r[2] for r in drafted), len(drafted)) == replay_by_hand(hits, mask, k), (trial, k)


def test_rounds_tau():
    assert chain.rounds_tau([(1, 3, 3), (5, 3, 0), (6, 0, 0)]) == 1 + 3 / 2
    assert chain.rounds_tau([(1, 0, 0)]) is None


# --------------------------------------------------------------------------- sampling (T > 0)
def test_overlap_is_the_acceptance_probability_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.0, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert chain.overlap(p, q).tolist() == pytest.approx([0.1 + 0.3, 1.0])


def test_expected_acceptance_by_hand():
    alphas, valid = [[0.5, 0.4, 1.0], [0.9, 0.0], [0.2]], [3, 2, 1]
    assert chain.expected_accepted([0.5, 0.4, 1.0], 3) == pytest.approx(0.5 + 0.2 + 0.2)
    assert chain.expected_accepted([0.5, 0.4, 1.0], 1) == pytest.approx(0.5)
    # k = 1: every start; k = 2: the two with 2 positions left; k = 3: the first only
    assert chain.expected_tau(alphas, valid, 1) == pytest.approx(1 + (0.5 + 0.9 + 0.2) / 3)
    assert chain.expected_counts(alphas, valid, 2) == (pytest.approx(0.7 + 0.9), 2)
    assert chain.expected_tau(alphas, valid, 2) == pytest.approx(1.8)
    assert chain.expected_tau(alphas, valid, 3) == pytest.approx(1.9)
    assert chain.expected_tau(alphas, valid, 4) is None
    r = chain.expected_position_rates(alphas, valid, 3)
    assert r["starts_per_pos"] == [3, 2, 1]
    assert r["alpha_per_pos"] == pytest.approx([1.6 / 3, 0.2, 1.0])
    assert r["accept_rate_per_pos"] == pytest.approx([1.6 / 3, 0.1, 0.2])
    assert r["conditional_accept_per_pos"] == pytest.approx([1.6 / 3, 0.1 / (1.6 / 3), 2.0])


def test_expected_acceptance_of_certain_drafts_is_the_greedy_count():
    """α ∈ {0, 1} is the greedy case: the expected count equals the exact accepted prefix."""
    accepted, valid, K = [2, 0, 3, 1], [4, 4, 3, 1], 3
    alphas = [[1.0 if j < a else 0.0 for j in range(K)] for a in accepted]
    for k in (1, 2, 3):
        assert chain.expected_tau(alphas, valid, k) == pytest.approx(chain.tau_all_positions(accepted, valid, k))
    assert chain.expected_position_rates(alphas, valid, K)["accept_rate_per_pos"] == \
        pytest.approx(chain.position_rates(accepted, valid, K)["accept_rate_per_pos"])


def test_greedy_acceptance_is_the_targets_probability_of_the_drafters_argmax():
    """vLLM's default at T > 0 (draft_sample_method greedy): the draft is argmax q, accepted with
    probability p(draft); it can be above or below Σ min(p, q) (issue 43)."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.1, 0.6, 0.0, 0.3], [0.1, 0.1, 0.7, 0.1], [0.4, 0.3, 0.2, 0.1]])
    assert chain.greedy_accept(p, q).tolist() == pytest.approx([0.3, 0.25, 0.7])
    assert chain.overlap(p, q).tolist() == pytest.approx([0.4, 0.55, 0.7])
    assert chain.ACCEPT["greedy"] is chain.greedy_accept and chain.ACCEPT["probabilistic"] is chain.overlap


def test_round_moments_match_the_distribution_of_the_accepted_count():
    """E[a] and E[a²] of a round from P(a > j) = Π α: against the distribution written out."""
    alpha, k = [0.6, 0.5, 0.8], 3
    # P(a = 0) = 0.4, P(a = 1) = 0.6 * 0.5, P(a = 2) = 0.3 * 0.2, P(a = 3) = 0.24
    dist = {0: 0.4, 1: 0.3, 2: 0.06, 3: 0.24}
    m1, m2 = chain.expected_moments(alpha, k)
    assert m1 == pytest.approx(sum(a * w for a, w in dist.items())) == pytest.approx(chain.expected_accepted(alpha, k))
    assert m2 == pytest.approx(sum(a * a * w for a, w in dist.items()))
    st = chain.expected_round_stats([alpha, [1.0, 1.0, 1.0], [0.0]], [3, 3, 1], 3)
    assert st["starts"] == 2 and st["mean"] == pytest.approx((m1 + 3) / 2)
    assert st["second"] == pytest.approx((m2 + 9) / 2)
    assert st["spread"] == pytest.approx(((m1 - 3) / 2) ** 2)
    assert chain.expected_round_stats([[0.5]], [1], 2) == {"starts": 0, "mean": None, "second": None, "spread": None}
