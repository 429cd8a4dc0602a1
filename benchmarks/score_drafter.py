"""Score trained drafters on one validation store: the exact chain τ(k = ttt_steps) of each run's
``train/drafter.safetensors`` (the weights the workflow kept) on stored states of the target's own
answers that no run trained on — by default the 80 MT-Bench first turns (``results/mix-mtval``, made as
bench_mix.py describes). The trainer's own validation pass, nothing retrained: runs of different
sizes (the default, config/long.yaml) compared on the same ~8,000 chain rounds, a larger yardstick
than evaluate's few MT-Bench prompts.

    python benchmarks/score_drafter.py --run results/smollm2 --run results/smollm2-long \
        [--val results/mix-mtval] [--out FILE]

Each run needs ``train/drafter.safetensors``, ``vocab_map/vocab.safetensors``, its
``extract/shard_*/index.json`` (opened, not read: the trainer's data plan wants a training store)
and ``train/train_summary.json`` (the train params it ran with, ``params``); the draft vocabulary
is the drafter file's own. Scored in fp32 (as the drafter is served here), whatever it trained
under. Prints per run: τ at every k, teacher-forced τ, the chain rounds and positions scored.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_mix import stores, val_stores  # noqa: E402


def score(run: Path, val: list[str], identity: dict, params: dict) -> dict:
    """The trainer's validation row for the run's kept weights on the ``val`` stores."""
    from eaglet.base.tensors import load_tensors, save_tensors
    from eaglet.drafter.eagle3 import load_drafter
    from eaglet.train.loop import Batches, validate
    from eaglet.train.setup import plan_run, setup
    from eaglet.train.train import resolve_params

    # fp32, as the served drafter runs here, whatever the run trained under
    p = resolve_params({**params, "max_steps": 1, "val_max_batches": None, "autocast": "float32"})
    hidden, drafter = stores(run), run / "train/drafter.safetensors"
    with tempfile.TemporaryDirectory() as tmp:
        # the drafter's own draft vocabulary (the run's vocab map may have been remade since)
        vocab = Path(tmp) / "vocab.safetensors"
        save_tensors(vocab, load_tensors(drafter, ["d2t", "t2d"]))
        r = setup(hidden, str(vocab), identity, Path(tmp), p, None, None, val)
        plan_run(r, hidden)
        kept, cfg, _, _ = load_drafter(drafter, identity, embed_weight=r.drafter.embed_tokens.weight)
        if cfg.to_json() != r.cfg.to_json():
            raise SystemExit(f"{run}: the drafter's config differs from the one its train params build")
        r.drafter.load_state_dict(kept.state_dict())
        batches = Batches(r)
        try:
            return validate(r, batches, 0)
        finally:
            batches.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--run", action="append", required=True, help="a run folder (results/<run>)")
    ap.add_argument("--val", default="results/mix-mtval",
                    help="a run folder with extract/, or index.json files (comma-separated)")
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from eaglet.target.load import load_identity

    identity = load_identity(a.identity)
    val = val_stores(a.val)
    print(f"validation store: {val}")
    out = {}
    for spec in a.run:
        run = Path(spec) if Path(spec).is_absolute() else ROOT / spec
        params = json.loads((run / "train/train_summary.json").read_text())["params"]
        row = score(run, val, identity, params)
        ks = sorted(int(k.rsplit("_", 1)[1]) for k in row if k.startswith("chain_tau_"))
        taus = "  ".join(f"k={k} {row[f'chain_tau_{k}']:.4f}" for k in ks)
        print(f"{run.name}: chain tau {taus}; teacher-forced {row['tf_tau']:.4f}; "
              f"{row['chain_rounds']} chain rounds, {row['positions']} positions")
        out[run.name] = row
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
