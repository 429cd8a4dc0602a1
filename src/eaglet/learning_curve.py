"""Stage learning_curve: how the drafter's τ grows with data, and what more data would cost here.

    python -m eaglet.learning_curve --full results/r/train/train_summary.json \
        --fractions results/r/learning_curve/f0.25/train_summary.json results/r/learning_curve/f0.5/... \
        [--generate results/r/generate/metadata.json] [--hidden results/r/extract/shard_0/index.json ...] \
        --run-dir results/r --out results/r/learning_curve/learning_curve.json [--config JSON|@FILE]

With ``plan.learning_curve: true`` the workflow trains the drafter again on nested fractions of the
training samples (``train.data_fraction``: a sample in the ¼ subset is in the ½ one; the validation
sequences are the same for every fraction). Each training keeps, for its selected weights, the exact
greedy-chain counts (accepted drafts, rounds) at k = K of every validation sequence. This stage fits

    τ(N) = a + b · ln N        (N = training tokens)

to the pooled chain τ of every point, and resamples the validation sequences (the same draw for
every point: a paired bootstrap) to give each figure an interval. It states τ now, the predicted τ at
``multipliers`` × the data with intervals, and what each would cost on this hardware from this run's
own measured wall times (generation, extraction, training: Snakemake's job records) and hidden-state
disk (the shards' chunk bytes): every one scales with the number of samples at fixed settings.

The check: the line fitted on the fractions alone must predict the full-data τ within its own
interval. It fails when it does not, and is "not run" (with the reason) when it cannot be made.
The intervals cover the evaluation's sampling noise (which validation sequences), not the
training's seed-to-seed spread: a statement about this data, not about every possible run.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
from pathlib import Path

from eaglet import io

log = logging.getLogger("eaglet.learning_curve")

DEFAULTS = {"multipliers": [2, 10, 100], "confidence": 0.95, "bootstrap": 2000, "seed": 0, "require_check": True}
# the jobs whose wall time scales with the number of samples, by rule
COST_RULES = {"generate": "generate", "extract": "extract_hidden_states", "train": "train"}


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


def point_of(summary_path: str | Path) -> dict:
    s = io.read_json(summary_path)
    groups = s.get("best_val_chain_by_sequence")
    if not groups:
        raise io.ArtifactError(f"{summary_path}: no per-sequence validation chain (a training without a "
                               "validation set, or written by an older eaglet): the learning curve needs it")
    if not s.get("train_tokens"):
        raise io.ArtifactError(f"{summary_path}: no train_tokens recorded")
    return {"tokens": int(s["train_tokens"]), "fraction": float(s.get("data_fraction", 1.0)),
            "groups": [(float(a), float(r)) for a, r in groups], "samples": s.get("train_samples")}


def measured_costs(run_dir: str | Path, generate: str | Path | None, hidden: list[str],
                   times: list[dict] | None = None) -> dict:
    """This run's cost of its data: wall seconds per stage (Snakemake's job records; a stage whose
    record is missing, e.g. restored from the cache, is "not measured"), hidden-state bytes."""
    if times is None:
        from eaglet.provenance import stage_times

        times = stage_times(Path(run_dir))
    out: dict = {}
    for name, rule in COST_RULES.items():
        secs = [t["seconds"] for t in times if t["rule"] == rule]
        out[f"{name}_s"] = sum(secs) if secs else None
    if generate is None:
        out["generate_s"] = 0.0  # no generation in this run (the dataset's own responses)
    out["hidden_bytes"] = sum(sum(int(c.get("bytes", 0)) for c in io.read_json(h)["chunks"]) for h in hidden) \
        if hidden else 0
    return out


def projected_costs(costs: dict, multiplier: float) -> dict:
    """A run with ``multiplier`` × the samples at the same settings: every figure scales with it."""
    hours = {k[:-2] + "_hours": (None if v is None else v * multiplier / 3600)
             for k, v in costs.items() if k.endswith("_s")}
    return {**hours, "hidden_gb": costs["hidden_bytes"] * multiplier / 1e9,
            "not_measured": sorted(k[:-6] for k, v in hours.items() if v is None)}


def run(full: str | Path, fractions: list[str], out: str | Path, run_dir: str | Path,
        generate: str | Path | None = None, hidden: list[str] | None = None, opts: dict | None = None,
        times: list[dict] | None = None) -> dict:
    o = {**DEFAULTS, **(opts or {})}
    full_pt = point_of(full)
    points = sorted([point_of(f) for f in fractions], key=lambda p: p["tokens"]) + [full_pt]
    base = full_pt["tokens"]
    mults = [float(m) for m in o["multipliers"]]
    k = int(io.read_json(full)["params"]["ttt_steps"])
    c = curve(points, [base * m for m in mults], o["confidence"], int(o["bootstrap"]), int(o["seed"]), k)
    costs = measured_costs(run_dir, generate, hidden or [], times)
    for pred, m in zip(c["predictions"], mults, strict=True):
        pred["multiplier"] = m
        pred["cost"] = projected_costs(costs, m)
    result = {"tau_now": pooled_tau(full_pt["groups"]), "tokens_now": base,
              "k": k, **c,
              "measured_costs": costs, "check": check(points, full_pt, o["confidence"], int(o["bootstrap"]),
                                                       int(o["seed"]), k),
              "validation_sequences": len(full_pt["groups"]), "require_check": bool(o["require_check"]),
              "noise": "intervals resample the validation sequences; the training's seed-to-seed spread "
                       "is not in them"}
    io.write_json(out, result)
    return result


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--full", required=True, help="the full-data train_summary.json")
    p.add_argument("--fractions", nargs="+", required=True, help="the fractions' train_summary.json files")
    p.add_argument("--generate", default=None, help="generate/metadata.json (absent: no generation)")
    p.add_argument("--hidden", nargs="*", default=[], help="extract/shard_*/index.json (disk per token)")
    p.add_argument("--run-dir", required=True, help="results/<run>: whose Snakemake job records give the times")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="{}", help="JSON or @FILE: " + ", ".join(DEFAULTS))
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    io.setup_logging(a.log)
    r = run(a.full, a.fractions, a.out, a.run_dir, a.generate, a.hidden, io.parse_json_arg(a.config, {}))
    log.info("learning curve: %s", describe(r))
    status = r["check"]["status"]
    if status != "pass":
        why = ("the line through the fractions misses the full-data τ: its predictions do not hold on this data"
               if status == "fail" else f"the check did not run ({r['check'].get('reason')})")
        if r.get("require_check", True):
            raise SystemExit(f"learning curve: {why}; the figures are in the log above "
                             "(plan.require_check: false keeps them as the stage's output)")
        log.warning("learning curve: %s (kept: plan.require_check is false)", why)


if __name__ == "__main__":
    main()
