"""What the target's labels cost a training step: the trainer's labels on a real store's first
micro-batches as the trainer plans them (padded), as it computes them now (the head's draft rows,
the draft vocabulary's probability mass and the greedy flag from the full-vocabulary statistics
extraction stored: eaglet.train.setup.DraftLabels) against the way it computed them before the
statistics were stored (the draft rows plus the head's other rows' max and logsumexp, at every slot,
eaglet.target.head.TargetHead.max_lse_over).

    python benchmarks/profile_head.py [--run results/smollm2] [--tokens 2048] [--batches 4] [--repeats 7]

Both in fp32 on a CPU, as the trainer builds them, alternated in pairs, the first pair dropped as
warm-up; the store is found by bench_anchor's rule (find_store). Prints each median and the median of
the paired ratios with its interval (paired.median_interval), and the largest difference between the
two masses (the same figures, or the timing compares different work).
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
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.target.load import load_identity
    from eaglet.train.data import collate, plan_batches
    from eaglet.train.setup import DraftLabels

    run = Path(a.run)
    found = find_store(run.parent, run.name)
    if found is None:
        raise SystemExit(f"{run}: no extract/shard_*/index.json or vocab_map/vocab.safetensors "
                         "(run the workflow first)")
    _, index, vocab, _ = found
    torch.set_num_threads(a.threads)
    t2d = load_file(str(vocab))["t2d"].bool()
    ds = HiddenStateDataset([str(i) for i in index], verify="header")
    labels = DraftLabels(load_identity(a.identity), t2d, True, True, "cpu")
    head = labels.head
    rest = head.row_chunks((~t2d).nonzero().squeeze(1))
    # the trainer's micro-batches (eaglet.train.data.plan_batches: B x T_max <= the budget, padded)
    micro = plan_batches(list(range(len(ds.ids))), ds.num_tokens, a.tokens, 0, 0)[:a.batches]
    batches = [collate([ds.sample(i) for i in mb], "cpu") for mb in micro]

    def before(b):
        x = head.normed(b["final"])
        lg = head.logits(x, normed=True)
        top, lse = head.max_lse_over(x, rest, normed=True)
        lse_d = torch.logsumexp(lg, -1)
        return torch.softmax(lg, -1), lg.amax(-1) >= top, torch.exp(lse_d - torch.logaddexp(lse_d, lse))

    calls = {"stored statistics (now)": lambda b: labels(b["final"], b["target_lse"], b["target_top1"], mass=True),
             "other rows (before)": before}
    gap = max(float((calls["stored statistics (now)"](b)[2] - before(b)[2])[b["mask"]].abs().max()) for b in batches)
    times = alternate({key: (lambda call=call: [call(b) for b in batches]) for key, call in calls.items()},
                      a.repeats)
    slots = sum(b["final"].shape[0] * b["final"].shape[1] for b in batches)
    print(f"{len(batches)} micro-batches: {slots} slots, {sum(b['tokens'] for b in batches)} tokens; draft vocab "
          f"{int(t2d.sum())}, other rows {int((~t2d).sum())}, {a.threads} threads; largest mass difference "
          f"{gap:.2e}")
    print_paired(times, "other rows (before)", "stored statistics (now)")


if __name__ == "__main__":
    main()
