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


def alternate(calls: dict, repeats: int, swap: bool = False) -> dict[str, list[float]]:
    """Seconds of each zero-argument call in ``calls``, run in turn ``repeats`` times (paired by
    round); the first round, warm-up, is dropped. ``swap``: every other round runs the calls in the
    reverse order, so neither always goes first (a machine whose load drifts within a round)."""
    import time

    times: dict[str, list[float]] = {key: [] for key in calls}
    for r in range(repeats):
        for key, call in (reversed(calls.items()) if swap and r % 2 else calls.items()):
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
    return {key: v[1:] for key, v in times.items()}


def print_paired(times: dict[str, list[float]], num: str, den: str) -> None:
    """Each call's median and range, then ``num / den``: the median of the paired ratios with its
    interval (median_interval)."""
    for key, v in times.items():
        print(f"{key}: median {statistics.median(v):.3f} s (range {min(v):.3f}-{max(v):.3f}) over {len(v)} repeats")
    ratios = [n / d for n, d in zip(times[num], times[den], strict=True)]
    lo, hi, cover = median_interval(ratios)
    print(f"{num} / {den}: {statistics.median(ratios):.2f}x ({cover:.0%} interval {lo:.2f}-{hi:.2f}, "
          f"{len(ratios)} pairs)")
