"""What the drafter's head at the counted positions only buys a training step: forward + backward of
eaglet's TTT objective on a real store's first micro-batches as the trainer plans them (padded),
with the head, log-softmax and loss at every position against at the counted positions only
(``TTTObjective(..., counted_only=True)``, what eaglet.train.loop.train_step runs).

    python benchmarks/profile_step.py [--run results/smollm2] [--tokens 2048] [--batches 4] [--repeats 7]
        [--loss lk_alpha] [--ttt-steps 3] [--autocast auto]

The labels (eaglet.train.setup.DraftLabels from the store's statistics) are computed once, outside
the timing; the drafter is freshly initialised (the cost does not depend on its weights). The two
settings alternate in pairs, the first pair dropped as warm-up; prints each median, the median of the
paired ratios with its interval (paired.median_interval), the counted share of the slots, and the
largest difference of the two losses (the same loss, or the timing compares different work).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_anchor import find_store  # noqa: E402
from paired import alternate, print_paired  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=str(ROOT / "results/smollm2"), help="a run with extract/ and vocab_map/")
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--tokens", type=int, default=2048, help="the trainer's token_budget (config.yaml's)")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches timed in each call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loss", default="lk_alpha")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--autocast", default="auto", help="train.autocast: auto | on | off")
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
    from eaglet.drafter.ttt import TTTObjective, valid_positions
    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.target.load import load_identity, load_target_embedding
    from eaglet.train.data import collate, plan_batches
    from eaglet.train.loop import autocast_on
    from eaglet.train.setup import DraftLabels

    run = Path(a.run)
    found = find_store(run.parent, run.name)
    if found is None:
        raise SystemExit(f"{run}: no extract/shard_*/index.json or vocab_map/vocab.safetensors "
                         "(run the workflow first)")
    _, index, vocab, _ = found
    torch.set_num_threads(a.threads)
    t2d = load_file(str(vocab))["t2d"].bool()
    ident = load_identity(a.identity)
    ds = HiddenStateDataset([str(i) for i in index], verify="header")
    labels = DraftLabels(ident, t2d, True, False, "cpu")
    micro = plan_batches(list(range(len(ds.ids))), ds.num_tokens, a.tokens, 0, 0)[:a.batches]
    batches = []
    for mb in micro:
        b = collate([ds.sample(i) for i in mb], "cpu")
        p, inv, mass = labels(b["final"], b["target_lse"], b["target_top1"], mass=True)
        batches.append((b, p, valid_positions(b, t2d, inv), mass))
    torch.manual_seed(0)
    cfg = DrafterConfig.from_identity(ident, int(t2d.sum()), ds.meta["layer_ids"], ttt_steps=a.ttt_steps)
    model = Eagle3Drafter(cfg, load_target_embedding(ident["path"]))
    obj = TTTObjective(model, a.ttt_steps, 0.8, a.loss)
    bf16 = autocast_on(a.autocast, torch.device("cpu"))

    def step(counted_only: bool) -> float:
        total = 0.0
        for b, p, valid, mass in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _, _, _ = obj(b["x"], b["aux"], p, valid, None, None, mass, counted_only)
            loss.backward()
            total += float(loss)
        model.zero_grad(set_to_none=True)
        return total

    gap = abs(step(False) - step(True))
    times = alternate({"every position (before)": lambda: step(False), "counted positions (now)": lambda: step(True)},
                      a.repeats)
    slots = sum(b["x"].numel() for b, *_ in batches)
    counted = sum(int(v.sum()) for _, _, v, _ in batches)
    print(f"{len(batches)} micro-batches: {slots} slots, {sum(b['tokens'] for b, *_ in batches)} tokens, {counted} "
          f"counted ({counted / slots:.0%}); loss {a.loss}, k = {a.ttt_steps}, draft vocab {int(t2d.sum())}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}, {a.threads} threads; largest loss difference {gap:.2e}")
    print_paired(times, "every position (before)", "counted positions (now)")


if __name__ == "__main__":
    main()
