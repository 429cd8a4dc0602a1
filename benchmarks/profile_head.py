"""What the acceptance losses add to a training step: the trainer's target head on a real store's
first micro-batches as the trainer plans them (padded), the draft rows alone against the draft rows
plus the other rows' logsumexp (the draft vocabulary's probability mass, which ``lk_alpha`` needs
and a first epoch computes at every step), the latter at every slot and only where the trainer
reads it (an assistant token next: eaglet.drafter.ttt.rest_positions, which the trainer passes).

    python benchmarks/profile_head.py [--run results/smollm2] [--tokens 2048] [--batches 4] [--repeats 7]

Times eaglet.train.setup.TargetHead as the trainer builds it (fp32 on a CPU), the three calls
alternated in triples, the first dropped as warm-up; the store is found by bench_anchor's rule
(find_store). Prints each median and the median of the paired ratios with its interval
(paired.median_interval).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_anchor import find_store  # noqa: E402
from paired import median_interval  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=str(ROOT / "results/smollm2"), help="a run with extract/ and vocab_map/")
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--tokens", type=int, default=2048, help="the trainer's token_budget (config.yaml's)")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches timed in each call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from eaglet.drafter.ttt import rest_positions
    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.target.load import load_identity
    from eaglet.train.data import collate, plan_batches
    from eaglet.train.setup import TargetHead

    run = Path(a.run)
    found = find_store(run.parent, run.name)
    if found is None:
        raise SystemExit(f"{run}: no extract/shard_*/index.json or vocab_map/vocab.safetensors "
                         "(run the workflow first)")
    _, index, vocab, _ = found
    torch.set_num_threads(a.threads)
    t2d = load_file(str(vocab))["t2d"].bool()
    ds = HiddenStateDataset([str(i) for i in index], verify="header")
    head = TargetHead(load_identity(a.identity), t2d, True, False, "cpu", mass_rows=True)
    # the trainer's micro-batches (eaglet.train.data.plan_batches: B x T_max <= the budget, padded)
    micro = plan_batches(list(range(len(ds.ids))), ds.num_tokens, a.tokens, 0, 0)[:a.batches]
    batches = [collate([ds.sample(i) for i in mb], "cpu") for mb in micro]
    need = [rest_positions(b) for b in batches]
    calls = {"draft rows": lambda b, nd: head(b["final"], rest=False),
             "draft + other rows": lambda b, nd: head(b["final"], mass=True),
             "draft + other rows where read": lambda b, nd: head(b["final"], mass=True, need_BT=nd)}
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(a.repeats):
        for key, call in calls.items():
            t = time.perf_counter()
            for b, nd in zip(batches, need):
                call(b, nd)
            times[key].append(time.perf_counter() - t)
    for key, v in times.items():
        v = v[1:]
        print(f"{key}: median {statistics.median(v):.3f} s (range {min(v):.3f}-{max(v):.3f}) over {len(v)} repeats")
    slots = sum(b["final"].shape[0] * b["final"].shape[1] for b in batches)
    print(f"{len(batches)} micro-batches: {slots} slots, {sum(b['tokens'] for b in batches)} tokens, "
          f"{sum(int(n.sum()) for n in need)} read; draft vocab {int(t2d.sum())}, other rows "
          f"{int((~t2d).sum())}, {a.threads} threads")
    for num, den in (("draft + other rows", "draft rows"), ("draft + other rows where read", "draft rows"),
                     ("draft + other rows", "draft + other rows where read")):
        ratios = [r / d for d, r in zip(times[den][1:], times[num][1:])]
        lo, hi, cover = median_interval(ratios)
        print(f"{num} / {den}: {statistics.median(ratios):.2f}x ({cover:.0%} interval {lo:.2f}-{hi:.2f}, "
              f"{len(ratios)} triples)")


if __name__ == "__main__":
    main()
