"""What the paired benchmarks (tokenize, extract) print about their ratios: the median with a
distribution-free interval, and whether that interval lets the goal be judged."""

from __future__ import annotations

import math
import statistics


def median_interval(xs: list[float], confidence: float = 0.9) -> tuple[float, float, float]:
    """(lo, hi, coverage): the order statistics x_(k), x_(n-k+1) around the median, with the
    largest k whose coverage 1 - 2 P(Binomial(n, 1/2) <= k - 1) is still >= ``confidence`` (the
    whole range when no narrower pair reaches it). No assumption on the timings' distribution."""
    s, n = sorted(xs), len(xs)
    k, cover = 1, 1 - 2 * 0.5 ** n
    for j in range(2, n // 2 + 1):
        c = 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n
        if c < confidence:
            break
        k, cover = j, c
    return s[k - 1], s[n - k], cover


def spread_note(ratios: list[float], goal: float, what: str = "pair ratios") -> str:
    """``note: ...``: the median, its interval, and "cannot conclude" when the interval holds the goal."""
    med = statistics.median(ratios)
    lo, hi, cover = median_interval(ratios)
    head = (f"note: median of {len(ratios)} {what} {med:.3f}, {cover:.0%} interval {lo:.3f}-{hi:.3f} "
            f"(all {min(ratios):.3f}-{max(ratios):.3f})")
    if cover < 0.5:
        return head + ": too few pairs for an interval, cannot conclude; repeat more"
    if lo < goal <= hi:
        return head + f": the interval holds the goal {goal}, cannot conclude; rerun on a quiet machine"
    return head + (": above the goal" if lo >= goal else ": below the goal")
