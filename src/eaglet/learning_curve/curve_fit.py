"""The learning curve's statistics (library; the stage is eaglet.learning_curve.learning_curve): τ against training
tokens fitted as τ = a + b ln N, a paired bootstrap over validation sequences for intervals,
predictions held to [1, k + 1], the check that the fractions predict the full data, projected
costs, and the one-line description the stage logs and ``eaglet.workflow.summary`` prints."""

from __future__ import annotations

import math
import random


def pooled_tau(groups: list[tuple[float, float]], idx: list[int] | None = None) -> float | None:
    """1 + accepted / rounds over the sequences ``idx`` (all by default); None without rounds."""
    sel = groups if idx is None else [groups[i] for i in idx]
    rounds = sum(r for _, r in sel)
    return 1.0 + sum(a for a, _ in sel) / rounds if rounds > 0 else None


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("learning curve: the points share one token count; nothing to fit")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def _percentiles(values: list[float], level: float) -> list[float]:
    v = sorted(values)
    lo = v[max(0, math.floor((1 - level) / 2 * len(v)))]
    hi = v[min(len(v) - 1, math.ceil((1 + level) / 2 * len(v)) - 1)]
    return [lo, hi]


def curve(points: list[dict], at_tokens: list[float], level: float = 0.95, n_boot: int = 2000,
          seed: int = 0, k: int | None = None) -> dict:
    """Fit τ = a + b ln N over ``points`` ({"tokens", "groups": [(accepted, rounds)] per validation
    sequence, the same sequences in the same order for every point}) and predict τ at each of
    ``at_tokens``; intervals from a paired bootstrap over the sequences. With ``k`` (drafts per
    round) predictions are held to τ's range [1, k + 1]: a line does not know that τ saturates."""
    def clip(t: float) -> float:
        return t if k is None else min(max(t, 1.0), 1.0 + k)

    if len(points) < 2:
        raise ValueError(f"learning curve: {len(points)} point(s); a line needs two token counts")
    n_seq = {len(p["groups"]) for p in points}
    if len(n_seq) != 1 or not n_seq.pop():
        raise ValueError("learning curve: every point needs the chain counts of the same validation sequences")
    xs = [math.log(p["tokens"]) for p in points]
    ys = [pooled_tau(p["groups"]) for p in points]
    if any(y is None for y in ys):
        raise ValueError("learning curve: a point has no drafted rounds on the validation sequences")
    a, b = fit_line(xs, ys)
    rng = random.Random(seed)
    S = len(points[0]["groups"])
    slopes, preds = [], [[] for _ in at_tokens]
    for _ in range(n_boot):
        idx = [rng.randrange(S) for _ in range(S)]
        yb = [pooled_tau(p["groups"], idx) for p in points]
        if any(y is None for y in yb):
            continue
        ab, bb = fit_line(xs, yb)
        slopes.append(bb)
        for j, n in enumerate(at_tokens):
            preds[j].append(clip(ab + bb * math.log(n)))
    if len(slopes) < n_boot // 2:
        raise ValueError("learning curve: too few validation rounds to resample")
    return {"a": a, "b_per_ln_tokens": b, "tau_gain_per_doubling": b * math.log(2),
            "tau_gain_per_doubling_interval": [x * math.log(2) for x in _percentiles(slopes, level)],
            "points": [{"tokens": p["tokens"], "fraction": p.get("fraction"), "tau": y}
                       for p, y in zip(points, ys, strict=True)],
            "predictions": [{"tokens": n, "tau": clip(a + b * math.log(n)), "interval": _percentiles(pr, level),
                             "at_ceiling": k is not None and a + b * math.log(n) >= 1.0 + k}
                            for n, pr in zip(at_tokens, preds, strict=True)],
            "confidence": level, "bootstrap_samples": len(slopes)}


def check(points: list[dict], full: dict, level: float, n_boot: int, seed: int, k: int | None = None) -> dict:
    """Does the line through the fractions alone predict the full-data τ within its interval?"""
    fractions = [p for p in points if p is not full]
    if len({p["tokens"] for p in fractions}) < 2:
        return {"status": "not run", "reason": "needs two fractions with different token counts"}
    try:
        c = curve(fractions, [full["tokens"]], level, n_boot, seed, k)
    except ValueError as e:
        return {"status": "not run", "reason": str(e)}
    pred = c["predictions"][0]
    measured = pooled_tau(full["groups"])
    lo, hi = pred["interval"]
    ok = lo <= measured <= hi
    return {"status": "pass" if ok else "fail", "predicted": pred["tau"], "interval": pred["interval"],
            "measured": measured, "fitted_on": [p["fraction"] for p in fractions],
            "what": f"τ at the full data ({full['tokens']} tokens) predicted from the fractions alone, "
                    f"{level:.0%} interval over the validation sequences"}


def projected_costs(costs: dict, multiplier: float) -> dict:
    """A run with ``multiplier`` × the samples at the same settings: every figure scales with it."""
    hours = {k[:-2] + "_hours": (None if v is None else v * multiplier / 3600)
             for k, v in costs.items() if k.endswith("_s")}
    return {**hours, "hidden_gb": costs["hidden_bytes"] * multiplier / 1e9,
            "not_measured": sorted(k[:-6] for k, v in hours.items() if v is None)}


def _cost(c: dict) -> str:
    parts = [f"{k[:-6]} {'not measured' if v is None else f'{v:.2f} h'}"
             for k, v in c.items() if k.endswith("_hours")]
    return ", ".join(parts + [f"{c['hidden_gb']:.2f} GB hidden states"])


def describe(r: dict) -> str:
    """One line for logs and the summary table."""
    pr = ", ".join(f"{p['multiplier']:g}x {p['tau']:.3f} [{p['interval'][0]:.3f}, {p['interval'][1]:.3f}]"
                   f" ({_cost(p['cost'])})" for p in r["predictions"])
    ch = r["check"]
    chk = (f"check {ch['status']}: predicted {ch['predicted']:.3f} [{ch['interval'][0]:.3f}, "
           f"{ch['interval'][1]:.3f}] vs measured {ch['measured']:.3f}" if ch["status"] in ("pass", "fail")
           else f"check not run ({ch['reason']})")
    return (f"validation chain τ now {r['tau_now']:.3f} at {r['tokens_now']:,} tokens; "
            f"+{r['tau_gain_per_doubling']:.3f} per doubling; predicted {pr}; {chk}")
