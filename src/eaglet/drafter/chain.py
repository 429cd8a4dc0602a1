"""The greedy draft chain, counted: pure functions shared by the trainer's validation
(eaglet.train.train) and the offline evaluation (eaglet.eval.evaluate_offline), so both report the same τ.

At temperature 0 a round drafts k tokens, the target verifies them in one forward, the longest
matching prefix is accepted plus one bonus token from the target. On the target's own greedy
continuation the whole chain is fixed by one number per round start: how many of the K drafts
from there match the continuation (``accepted[g]``). :func:`chain_replay` walks the rounds the
real loop runs from those numbers; :func:`rounds_tau` is vLLM's τ over them (tokens per target
forward = 1 + accepted / rounds with drafts).

The trainer gets ``accepted`` from the training-time-test unroll (eaglet.drafter.eagle3.Eagle3Drafter
.ttt_unroll): on the target's greedy continuation, draft k at index t is accepted iff drafts
0..k at t all hit (:func:`accepted_runs`), and every assistant span of a sequence is one
continuation (:func:`sequence_rounds`).

The evaluation's counts over the same numbers: acceptance per draft position from every start
(:func:`position_rates`, :func:`tau_all_positions`) and vLLM's per-position counters of a chain
(:func:`chain_counts`, :func:`prompt_chain`).

At temperature T > 0 nothing is fixed by the text, and what a draft's acceptance probability α is
depends on the rule the engine serves (vLLM's ``draft_sample_method``, :data:`ACCEPT`): drafts
sampled from q and accepted with probability min(1, p/q) give α = Σ_x min(p(x), q(x))
("probabilistic", :func:`overlap`; docs/eagle3.md §13); greedy drafts (argmax q, vLLM's default),
accepted with probability p(draft), give α = p(argmax q) ("greedy", :func:`greedy_accept`). Along
a continuation, a round of k drafts from a start whose drafts have α_0, α_1, ... accepts
Σ_{j<k} Π_{i≤j} α_i drafts in expectation (:func:`expected_accepted`), with second moment
Σ_{j<k} (2j + 1) Π_{i≤j} α_i (:func:`expected_moments`, for the variance of a round);
:func:`expected_tau` and :func:`expected_position_rates` are the T > 0 counterparts of
:func:`tau_all_positions` and :func:`position_rates`.
"""

from __future__ import annotations

import torch


def accepted_prefix(drafts: list[int], truth: list[int]) -> int:
    """Drafts that match the known continuation, from the first; past its end nothing matches."""
    a = 0
    while a < len(drafts) and a < len(truth) and drafts[a] == truth[a]:
        a += 1
    return a


def chain_replay(accepted: list[int], n_tokens: int, max_new: int, k: int) -> list[tuple[int, int, int]]:
    """The rounds the real loop runs, from the offline counts alone. ``accepted[g]`` = accepted
    prefix of K >= k drafts from the round start after g emitted tokens (g >= 1; index 0 unused);
    ``n_tokens`` = length of the greedy continuation. Returns (g, k_eff, accepted) per round."""
    rounds, g = [], 1
    while g < n_tokens:
        k_eff = min(k, max_new - g - 1)
        a = min(accepted[g], k_eff) if k_eff > 0 else 0
        rounds.append((g, k_eff, a))
        g = min(g + a + 1, n_tokens)  # the continuation ends at EOS or at max_new
    return rounds


def rounds_tau(rounds) -> float | None:
    """Tokens per target forward over rounds with drafts: 1 + accepted / drafts (vLLM's τ)."""
    drafted = [r for r in rounds if r[1] > 0]
    return 1 + sum(r[2] for r in drafted) / len(drafted) if drafted else None


def accepted_runs(hits_BTK: torch.Tensor) -> torch.Tensor:
    """hits[b, t, j]: draft j of the chain from index t is right. -> [B, T] accepted prefix length
    (drafts 0..j all right), the ``accepted`` count of the round that starts there."""
    return hits_BTK.to(torch.long).cumprod(-1).sum(-1)


def spans(mask: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of True as (first, last) indices: the assistant turns of one sequence."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i - 1))
            start = None
    return out


def sequence_rounds(accepted_T: list[int], mask_T: list[bool], k: int) -> list[tuple[int, int, int]]:
    """The chain's rounds over every assistant span of one sequence, at k drafts per round.

    A span x[s..e] is a greedy continuation of N = e - s + 1 tokens whose first token the prefill
    emits; the round after g emitted tokens drafts x[s+g], x[s+g+1], ... from index t = s + g - 2
    (the unroll's index t drafts x[t+2+j] at step j), so ``accepted[g] = accepted_T[s + g - 2]``.
    The continuation ends with the span (no draft reaches past it)."""
    rounds = []
    for s, e in spans(mask_T):
        n = e - s + 1
        acc = [0] + [accepted_T[s + g - 2] if s + g - 2 >= 0 else 0 for g in range(1, n)]
        rounds += chain_replay(acc, n, n, k)
    return rounds


# --------------------------------------------------------------------------- the evaluation's counts
def position_rates(accepted: list[int], valid: list[int], K: int) -> dict:
    """From every start: P(accepted >= j) and P(accepted >= j | >= j-1), j = 1..K, counting a
    start for position j only when the continuation extends that far (``valid``: positions left)."""
    reach, acc = [0] * K, [0] * K
    for a, v in zip(accepted, valid, strict=True):
        for j in range(min(K, v)):
            reach[j] += 1
            acc[j] += a > j
    rate = [acc[j] / reach[j] if reach[j] else None for j in range(K)]
    cond = [None if rate[j] is None or (j and not rate[j - 1]) else rate[j] / (rate[j - 1] if j else 1.0)
            for j in range(K)]
    return {"accept_rate_per_pos": rate, "conditional_accept_per_pos": cond, "starts_per_pos": reach}


def tau_all_positions(accepted: list[int], valid: list[int], k: int) -> float | None:
    """1 + mean accepted (capped at k) over starts with k positions of continuation left."""
    xs = [min(a, k) for a, v in zip(accepted, valid, strict=True) if v >= k]
    return 1 + sum(xs) / len(xs) if xs else None


def chain_counts(rounds) -> dict:
    """Per draft position j: rounds that drafted it and rounds that accepted it (vLLM's counters)."""
    k = max((r[1] for r in rounds), default=0)
    return {"drafts": sum(r[1] > 0 for r in rounds),
            "drafted_per_pos": [sum(r[1] > j for r in rounds) for j in range(k)],
            "accepted_per_pos": [sum(r[1] > j and r[2] > j for r in rounds) for j in range(k)]}


def prompt_chain(rounds) -> tuple[int, int]:
    """(accepted drafts, rounds with drafts) of one prompt: what τ over prompts is pooled from."""
    return sum(r[2] for r in rounds if r[1] > 0), sum(r[1] > 0 for r in rounds)


def served_rounds(accepted_at: dict[int, int], max_tokens: int) -> list[int]:
    """The rounds vLLM runs over one prompt, from the accepted count at every start g (tokens
    emitted so far; the prefill emits the first): a round at g accepts ``accepted_at[g]`` and emits
    that + 1, until ``max_tokens`` are out. Returns the starts visited, in order."""
    g, starts = 1, []
    while g < max_tokens:
        starts.append(g)
        g += accepted_at[g] + 1
    return starts


def chain_along(target, proposer, prompt: list[int], continuation: list[int], k: int, max_tokens: int,
                tie: float = 1e-3) -> dict:
    """eaglet's drafting along a fixed continuation (teacher-forced: one target forward over prompt +
    continuation gives every aux state), k drafts from every start, counted by ``served_rounds``.
    ``continuation`` must hold max_tokens + k - 1 tokens (the last round's drafts are judged in full).
    Per visited round: start g, the draft ids, accepted, and whether a near tie decided it (the
    deciding drafts' or verified positions' top-2 logits within ``tie``). ``target``/``proposer``:
    eaglet.engines.hf_loop's Target and EagleProposer."""
    need = max_tokens + k - 1
    if len(continuation) < need:
        raise ValueError(f"continuation of {len(continuation)} tokens: the chain at k={k} over "
                         f"{max_tokens} tokens needs {need}")
    x, P = list(prompt) + list(continuation[:need]), len(prompt)
    logits_TV, aux_T3H = target.forward(x[:-1], target.new_cache())
    top2 = logits_TV.topk(2, dim=-1).values
    target_gap = (top2[:, 0] - top2[:, 1]).tolist()  # row i predicts x[i + 1]
    proposer.reset()
    proposer.extend(aux_T3H[:P], x[1:P + 1])
    at, drafts, tied = {}, {}, {}
    for g in range(1, max_tokens):  # the drafter knows x_0 .. x_{P+g-1}; it drafts x_{P+g} ...
        if g > 1:
            proposer.extend(aux_T3H[P + g - 2:P + g - 1], x[P + g - 1:P + g])
        m0 = len(proposer.margins)
        d = proposer.draft(k)
        a = accepted_prefix(d, x[P + g:P + g + k])
        deciding = min(a + 1, k)
        gaps = proposer.margins[m0:m0 + deciding] + target_gap[P + g - 1:P + g - 1 + deciding]
        at[g], drafts[g], tied[g] = a, d, bool(min(gaps) < tie)
    starts = served_rounds(at, max_tokens)
    return {"rounds": [{"g": g, "drafts": drafts[g], "accepted": at[g], "tie": tied[g]} for g in starts]}


# --------------------------------------------------------------------------- sampling (T > 0)
def overlap(p_JV: torch.Tensor, q_JV: torch.Tensor) -> torch.Tensor:
    """α_j = Σ_x min(p_j(x), q_j(x)): the probability that speculative sampling accepts a draft
    drawn from q_j when the target's distribution is p_j (Leviathan et al., 2023). Both over the
    same support; a q that lives on the draft vocabulary only is compared on those ids (the
    target's mass outside them is never accepted, so it adds nothing to the sum)."""
    return torch.minimum(p_JV, q_JV).sum(-1)


def greedy_accept(p_JV: torch.Tensor, q_JV: torch.Tensor) -> torch.Tensor:
    """α_j = p_j(argmax_x q_j(x)): the probability that a rejection sampler accepts the greedy draft
    (vLLM's ``draft_sample_method: greedy``: the draft's probability taken as 1, so draft x is
    accepted when p(x) >= u). Both over the same support, as :func:`overlap`."""
    return p_JV.gather(-1, q_JV.argmax(-1, keepdim=True)).squeeze(-1)


# The acceptance probability of one draft under each rule vLLM serves at T > 0, by the name of
# vLLM's SpeculativeConfig.draft_sample_method (vllm/config/speculative.py): (p_JV, q_JV) -> α_J
ACCEPT = {"greedy": greedy_accept, "probabilistic": overlap}


def expected_accepted(alpha: list[float], k: int) -> float:
    """Expected accepted drafts of a round of k drafts whose acceptance probabilities along the
    text are α_0, α_1, ...: Σ_{j<k} Π_{i≤j} α_i (draft j counts only when 0..j are all accepted)."""
    out, run = 0.0, 1.0
    for a in alpha[:k]:
        run *= a
        out += run
    return out


def expected_moments(alpha: list[float], k: int) -> tuple[float, float]:
    """(E[a], E[a²]) of the accepted count a of a round of k drafts with acceptance probabilities
    α_0, α_1, ...: a = Σ_j 1[a > j] and a² = Σ_j (2j + 1) 1[a > j], with P(a > j) = Π_{i≤j} α_i."""
    m1, m2, run = 0.0, 0.0, 1.0
    for j, a in enumerate(alpha[:k]):
        run *= a
        m1 += run
        m2 += (2 * j + 1) * run
    return m1, m2


def expected_round_stats(alphas: list[list[float]], valid: list[int], k: int) -> dict:
    """What the served rounds at k are predicted to average, over the starts with k positions left:
    ``starts``, ``mean`` (expected accepted per round), ``second`` (mean E[a²]: the per-round
    variance is second - mean²) and ``spread`` (the variance of the starts' expectations, for the
    prediction's own sampling error)."""
    ms = [expected_moments(a, k) for a, v in zip(alphas, valid, strict=True) if v >= k]
    n = len(ms)
    if not n:
        return {"starts": 0, "mean": None, "second": None, "spread": None}
    mean = sum(m for m, _ in ms) / n
    return {"starts": n, "mean": mean, "second": sum(s for _, s in ms) / n,
            "spread": sum((m - mean) ** 2 for m, _ in ms) / n}


def expected_counts(alphas: list[list[float]], valid: list[int], k: int) -> tuple[float, int]:
    """(Σ expected accepted at k, starts counted) over the starts with k positions of text left:
    the pair τ over prompts is pooled from (eaglet.eval.stats.pooled_tau)."""
    xs = [expected_accepted(a, k) for a, v in zip(alphas, valid, strict=True) if v >= k]
    return sum(xs), len(xs)


def expected_tau(alphas: list[list[float]], valid: list[int], k: int) -> float | None:
    """Expected τ at k: 1 + mean expected accepted over the starts with k positions left."""
    s, n = expected_counts(alphas, valid, k)
    return 1 + s / n if n else None


def expected_position_rates(alphas: list[list[float]], valid: list[int], K: int) -> dict:
    """Per draft position j = 1..K over the starts that reach it: the mean α (acceptance of draft
    j given the text so far), the mean probability that drafts 1..j are all accepted, and that
    probability's ratio to the one before (as :func:`position_rates` counts it at T = 0)."""
    reach, alpha, run = [0] * K, [0.0] * K, [0.0] * K
    for al, v in zip(alphas, valid, strict=True):
        prod = 1.0
        for j in range(min(K, v, len(al))):
            prod *= al[j]
            reach[j] += 1
            alpha[j] += al[j]
            run[j] += prod
    rate = [run[j] / reach[j] if reach[j] else None for j in range(K)]
    cond = [None if rate[j] is None or (j and not rate[j - 1]) else rate[j] / (rate[j - 1] if j else 1.0)
            for j in range(K)]
    return {"alpha_per_pos": [alpha[j] / reach[j] if reach[j] else None for j in range(K)],
            "accept_rate_per_pos": rate, "conditional_accept_per_pos": cond, "starts_per_pos": reach}
