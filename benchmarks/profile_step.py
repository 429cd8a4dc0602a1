"""What a training step's variants cost: forward + backward of eaglet's TTT objective on a real
store's first micro-batches as the trainer plans them (padded), two settings timed in pairs.

    python benchmarks/profile_step.py [--run results/smollm2] [--tokens 2048] [--batches 4] [--repeats 7]
        [--loss lk_alpha] [--ttt-steps 3] [--autocast auto] [--compare head|attention] [--synthetic BxT]

``--compare head``: the drafter's head, log-softmax and loss at every position against at the counted
positions only (``TTTObjective(..., counted_only=True)``, what eaglet.train.loop.train_step runs).
``--compare attention`` (issue 43): the TTT attention's query chunks recomputed in backward against
their softmax weights kept from the forward (``TTTObjective(..., recompute=False)``,
``train.ttt_attention: saved``), both at the counted positions only, as the trainer steps.
``--synthetic BxT``: no store; ``--batches`` random micro-batches of B sequences of T tokens at the
target's shapes (``--identity``), 69 % of the positions counted (the SmolLM2 store's share): the
attention's cost depends on the shapes, not on the values.

The labels (eaglet.train.setup.DraftLabels from the store's statistics) are computed once, outside
the timing; the drafter is freshly initialised (the cost does not depend on its weights). The two
settings alternate in pairs (every other pair in the reverse order), the first pair dropped as
warm-up; prints each median, the median of the paired ratios with its interval
(paired.median_interval), the counted share of the slots, and the largest difference of the two
losses (the same loss, or the timing compares different work).
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
    ap.add_argument("--compare", choices=["head", "attention"], default="head",
                    help="the head at every position against the counted ones, or the TTT attention "
                         "recomputed against saved")
    ap.add_argument("--synthetic", default=None, metavar="BxT",
                    help="random micro-batches of B sequences of T tokens instead of a store")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="--synthetic's draft vocab (config.yaml's)")
    a = ap.parse_args()

    import torch

    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
    from eaglet.drafter.ttt import TTTObjective
    from eaglet.target.load import load_identity, load_target_embedding
    from eaglet.train.loop import autocast_on

    torch.set_num_threads(a.threads)
    ident = load_identity(a.identity)
    if a.synthetic:
        batches, Vd, layer_ids = synthetic_batches(a.synthetic, a.batches, ident, a.draft_vocab)
    else:
        batches, Vd, layer_ids = store_batches(Path(a.run), ident, a.tokens, a.batches)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_identity(ident, Vd, layer_ids, ttt_steps=a.ttt_steps)
    model = Eagle3Drafter(cfg, load_target_embedding(ident["path"]))
    objectives = {True: TTTObjective(model, a.ttt_steps, 0.8, a.loss),
                  False: TTTObjective(model, a.ttt_steps, 0.8, a.loss, recompute=False)}
    bf16 = autocast_on(a.autocast, torch.device("cpu"))

    def step(counted_only: bool, recompute: bool = True) -> float:
        total = 0.0
        for b, p, valid, mass in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _, _, _ = objectives[recompute](b["x"], b["aux"], p, valid, None, None, mass, counted_only)
            loss.backward()
            total += float(loss.detach())
        model.zero_grad(set_to_none=True)
        return total

    if a.compare == "head":
        keys = ("every position (before)", "counted positions (now)")
        calls = {keys[0]: lambda: step(False), keys[1]: lambda: step(True)}
    else:
        keys = ("recompute (before)", "saved (now)")
        calls = {keys[0]: lambda: step(True, recompute=True), keys[1]: lambda: step(True, recompute=False)}
    gap = abs(calls[keys[0]]() - calls[keys[1]]())
    times = alternate(calls, a.repeats, swap=True)
    slots = sum(b["x"].numel() for b, *_ in batches)
    counted = sum(int(v.sum()) for _, _, v, _ in batches)
    shape = "x".join(str(n) for n in batches[0][0]["x"].shape)
    print(f"{len(batches)} micro-batches: {slots} slots, {sum(b['tokens'] for b, *_ in batches)} tokens, {counted} "
          f"counted ({counted / slots:.0%}); first {shape}{' (synthetic)' if a.synthetic else ''}; loss {a.loss}, "
          f"k = {a.ttt_steps}, draft vocab {Vd}, {'bf16 autocast' if bf16 else 'fp32'}, {a.threads} threads; "
          f"largest loss difference {gap:.2e}")
    print_paired(times, *keys)


def store_batches(run: Path, ident: dict, tokens: int, n: int):
    """The first ``n`` micro-batches of a run's store as the trainer plans them, with their labels:
    ([(batch, p_BTVd, valid_BT, mass_BT)], draft vocab size, aux layer ids)."""
    from safetensors.torch import load_file

    from eaglet.drafter.ttt import valid_positions
    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.train.data import collate, plan_batches
    from eaglet.train.setup import DraftLabels

    found = find_store(run.parent, run.name)
    if found is None:
        raise SystemExit(f"{run}: no extract/shard_*/index.json or vocab_map/vocab.safetensors "
                         "(run the workflow first, or --synthetic BxT)")
    _, index, vocab, _ = found
    t2d = load_file(str(vocab))["t2d"].bool()
    ds = HiddenStateDataset([str(i) for i in index], verify="header")
    labels = DraftLabels(ident, t2d, True, False, "cpu")
    batches = []
    for mb in plan_batches(list(range(len(ds.ids))), ds.num_tokens, tokens, 0, 0)[:n]:
        b = collate([ds.sample(i) for i in mb], "cpu")
        p, inv, mass = labels(b["final"], b["target_lse"], b["target_top1"], mass=True)
        batches.append((b, p, valid_positions(b, t2d, inv), mass))
    return batches, int(t2d.sum()), ds.meta["layer_ids"]


def synthetic_batches(shape: str, n: int, ident: dict, Vd: int, counted: float = 0.69):
    """``n`` random micro-batches of ``shape`` ("BxT") at the target's shapes, as store_batches gives."""
    import torch

    B, T = (int(x) for x in shape.lower().split("x"))
    H, V = int(ident["hidden_size"]), int(ident["vocab_size"])
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        b = {"x": torch.randint(0, V, (B, T), generator=g), "aux": torch.randn(B, T, 3, H, generator=g),
             "tokens": B * T}
        p = torch.softmax(torch.randn(B, T, Vd, generator=g), -1)
        valid = torch.rand(B, T, generator=g) < counted
        mass = 0.5 + 0.5 * torch.rand(B, T, generator=g)
        batches.append((b, p, valid, mass))
    n_layers = int(ident["num_layers"])
    return batches, Vd, [2, n_layers // 2, n_layers - 3]


if __name__ == "__main__":
    main()
