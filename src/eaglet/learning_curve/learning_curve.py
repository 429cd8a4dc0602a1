"""Stage learning_curve: how the drafter's τ grows with data, and what more data would cost here.

    python -m eaglet.learning_curve.learning_curve --full results/r/train/train_summary.json \
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
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json, write_json
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.learning_curve.curve_fit import (
    check,
    curve,
    describe,
    pooled_tau,
    projected_costs,
)

log = logging.getLogger("eaglet.learning_curve.learning_curve")

# The stage's settings: plan.multipliers, confidence, require_check (their defaults: the config schema,
# eaglet.base.schema); plan.learning_curve and plan.fractions choose what the workflow trains.
NOT_THIS_STAGE = ("learning_curve", "fractions")
# The paired bootstrap: resamples of the validation sequences, and the seed of their draw (not settings).
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# the jobs whose wall time scales with the number of samples, by rule
COST_RULES = {"generate": "generate", "extract": "extract_hidden_states", "train": "train"}


def point_of(summary_path: str | Path) -> dict:
    s = read_json(summary_path)
    groups = s.get("best_val_chain_by_sequence")
    if not groups:
        raise ArtifactError(f"{summary_path}: no per-sequence validation chain (a training without a "
                            "validation set, or written by an older eaglet): the learning curve needs it")
    if not s.get("train_tokens"):
        raise ArtifactError(f"{summary_path}: no train_tokens recorded")
    return {"tokens": int(s["train_tokens"]), "fraction": float(s.get("data_fraction", 1.0)),
            "groups": [(float(a), float(r)) for a, r in groups], "samples": s.get("train_samples")}


def measured_costs(run_dir: str | Path, generate: str | Path | None, hidden: list[str],
                   times: list[dict] | None = None) -> dict:
    """This run's cost of its data: wall seconds per stage (Snakemake's job records; a stage whose
    record is missing, e.g. restored from the cache, is "not measured"), hidden-state bytes."""
    if times is None:
        from eaglet.base.job_records import stage_times

        times = stage_times(Path(run_dir))
    out: dict = {}
    for name, rule in COST_RULES.items():
        secs = [t["seconds"] for t in times if t["rule"] == rule]
        out[f"{name}_s"] = sum(secs) if secs else None
    if generate is None:
        out["generate_s"] = 0.0  # no generation in this run (the dataset's own responses)
    out["hidden_bytes"] = sum(sum(int(c.get("bytes", 0)) for c in read_json(h)["chunks"]) for h in hidden) \
        if hidden else 0
    return out


def run(full: str | Path, fractions: list[str], out: str | Path, run_dir: str | Path,
        generate: str | Path | None = None, hidden: list[str] | None = None, opts: dict | None = None,
        times: list[dict] | None = None) -> dict:
    o = schema.settings("plan", opts, "learning_curve", leave_out=NOT_THIS_STAGE)
    full_pt = point_of(full)
    points = sorted([point_of(f) for f in fractions], key=lambda p: p["tokens"]) + [full_pt]
    base = full_pt["tokens"]
    mults = [float(m) for m in o["multipliers"]]
    k = int(read_json(full)["params"]["ttt_steps"])
    c = curve(points, [base * m for m in mults], o["confidence"], BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, k)
    costs = measured_costs(run_dir, generate, hidden or [], times)
    for pred, m in zip(c["predictions"], mults, strict=True):
        pred["multiplier"] = m
        pred["cost"] = projected_costs(costs, m)
    result = {"tau_now": pooled_tau(full_pt["groups"]), "tokens_now": base,
              "k": k, **c,
              "measured_costs": costs, "check": check(points, full_pt, o["confidence"], BOOTSTRAP_RESAMPLES,
                                                       BOOTSTRAP_SEED, k),
              "validation_sequences": len(full_pt["groups"]), "require_check": bool(o["require_check"]),
              "noise": "intervals resample the validation sequences; the training's seed-to-seed spread "
                       "is not in them"}
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--full", required=True, help="the full-data train_summary.json")
    p.add_argument("--fractions", nargs="+", required=True, help="the fractions' train_summary.json files")
    p.add_argument("--generate", default=None, help="generate/metadata.json (absent: no generation)")
    p.add_argument("--hidden", nargs="*", default=[], help="extract/shard_*/index.json (disk per token)")
    p.add_argument("--run-dir", required=True, help="results/<run>: whose Snakemake job records give the times")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="{}", help="JSON or @FILE: plan.multipliers, confidence, require_check")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    r = run(a.full, a.fractions, a.out, a.run_dir, a.generate, a.hidden, parse_json_arg(a.config, {}))
    log.info("learning curve: %s", describe(r))
    status = r["check"]["status"]
    if status != "pass":
        why = ("the line through the fractions misses the full-data τ: its predictions do not hold on this data"
               if status == "fail" else f"the check did not run ({r['check'].get('reason')})")
        if r["require_check"]:
            raise SystemExit(f"learning curve: {why}; the figures are in the log above "
                             "(plan.require_check: false keeps them as the stage's output)")
        log.warning("learning curve: %s (kept: plan.require_check is false)", why)


if __name__ == "__main__":
    main()
