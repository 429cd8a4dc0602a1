"""What the paired benchmarks print about their ratios' spread (tokenize, extract)."""

from __future__ import annotations

import statistics


def spread_note(ratios: list[float], max_spread: float, what: str = "pair ratios") -> str:
    """``note: ...`` on the range of ``ratios`` as a fraction of their median: "too wide to
    conclude" past ``max_spread``, else the range alone."""
    med = statistics.median(ratios)
    lo, hi = min(ratios), max(ratios)
    spread = (hi - lo) / med
    if spread > max_spread:
        return (f"note: {what} range {lo:.3f}-{hi:.3f} ({spread:.0%} of the median): too wide to conclude; "
                "rerun on a quiet machine")
    return f"note: median of {len(ratios)} {what}, range {lo:.3f}-{hi:.3f} ({spread:.0%})"
