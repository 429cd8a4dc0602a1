"""Stage train for ``drafter.kind: p_eagle``: an EAGLE-3 drafter trained for parallel drafting
(eaglet.drafter.p_eagle, docs/block-drafters.md §8) on the run's stored hidden states (the same store
as EAGLE-3's) and the run's draft vocabulary (vocab_map, as EAGLE-3's).

    python -m eaglet.train.p_eagle_train --hidden results/r/extract/shard_0 [...] \
        --vocab results/r/vocab_map/vocab.safetensors \
        --target-identity resources/targets/t/identity.json --out-dir results/r/train \
        --params '{"lr": 1e-3, "epochs": 1, ...}' --drafter '{"parallel_k": 3, "mask_token_id": null}'

What it reads: the store's aux states (the run's extract.layer_ids, vLLM convention: fc's input) and
the target's stored greedy top-1 (``target_top1`` at s: the label of depth d at index t is the top-1 at
t + 1 + d, what vLLM accepts at T = 0 along the real prefix); a position counts where its label's
token is an assistant token (the loss mask of s + 1) in the draft vocabulary. The embedding is the
target's, frozen; lm_head starts as the target's rows of the draft vocabulary (train.lm_head_init:
target, EAGLE-3's default; frozen with train.freeze_lm_head), mask_hidden small random. The
architecture variants are EAGLE-3's keys (train.norm_before_fc, norm_before_residual, norm_output),
exported under vLLM's names as EAGLE-3's.

One step: eaglet.drafter.p_eagle.PEagleObjective (depth 0 every counted position, depth d a seeded
random subset of ratio max(0.7^d, 0.2)), AdamW (train.lr, weight_decay, grad_clip, warmup + cosine),
the EAGLE-3 trainer's data plan (eaglet.train.data: held-out split, micro-batches under
train.token_budget, grad_accum, epochs, max_steps). Validation every train.val_every steps and at the
end: ``parallel_tau`` = 1 + mean accepted drafts per round over every start of the held-out samples
whose K labels all count (a draft is accepted iff it and every earlier slot of the round equal the
labels: the exact T = 0 acceptance of one parallel round); drafter.safetensors holds the best pass.

Not yet: checkpoints and resume, DDP (train.gpus x train.nodes > 1 is refused at parse), online
states, train.init_from, the TTT recipe's losses (train.loss and its weights: the depths are trained
with cross-entropy on the greedy labels).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, digest_of, record_digests
from eaglet.base.files import write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.progress import Progress
from eaglet.base.settings_files import parse_json_arg
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter, PEagleObjective, save_p_eagle
from eaglet.drafter.ttt import check_recipe, drafter_options, freeze_head
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.planner.plan import bf16_autocast
from eaglet.train.data import plan_batches, plan_micro_batches
from eaglet.train.dflash_train import mask_token_rule
from eaglet.train.setup import check_vocab, lr_lambda_for

log = logging.getLogger("eaglet.train.p_eagle_train")
LAUNCH_KEYS = ("nodes", "rdzv_port")


def resolve_settings(params: dict | None, drafter: dict | None) -> tuple[dict, dict]:
    """(train.*, drafter.p_eagle.*) over the schema's defaults; what this trainer cannot do refused."""
    p = schema.settings("train", params, "train", leave_out=LAUNCH_KEYS)
    d = schema.settings("drafter.p_eagle", drafter, "drafter.p_eagle")
    if p["hidden_states"] != "offline":
        raise ValueError("train.hidden_states: online: the P-EAGLE trainer reads stored states; use offline")
    if p["init_from"]:
        raise ValueError("train.init_from: continuing a published drafter is EAGLE-3 only; leave it null")
    if int(p["gpus"] or 0) > 1:
        raise ValueError("train.gpus: the P-EAGLE trainer runs one process (no DDP yet); use 0 or 1")
    check_recipe(p)  # the architecture variants and the frozen head are EAGLE-3's, read the same way
    return p, d


def collate(samples: list[dict], device) -> dict:
    """x [B,T], aux [B,T,3,H], labels [B,T] (labels[s] = the target's greedy top-1 after s), valid
    [B,T] (valid[s]: position s + 1 is an assistant token), padding excluded."""
    B, T = len(samples), max(len(s["input_ids"]) for s in samples)
    a = samples[0]["aux"]
    out = {
        "x": torch.zeros(B, T, dtype=torch.long),
        "aux": torch.zeros(B, T, *a.shape[1:]),
        "labels": torch.zeros(B, T, dtype=torch.long),
        "valid": torch.zeros(B, T, dtype=torch.bool),
    }
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        out["x"][b, :n] = s["input_ids"]
        out["aux"][b, :n] = s["aux"]
        out["labels"][b, :n] = s["target_top1"][:n]
        out["valid"][b, : n - 1] = s["loss_mask"][1:n].bool()
    return {k: v.to(device) for k, v in out.items()} | {"tokens": sum(len(s["input_ids"]) for s in samples)}


@torch.no_grad()
def parallel_acceptance(model: PEagleDrafter, batch: dict, d2t: torch.Tensor) -> tuple[int, int]:
    """(accepted drafts, rounds) over every index t whose K labels (t + 1 .. t + K) all count: the round
    from t drafts K tokens in one forward; accepted = the agreeing prefix with the labels."""
    model.eval()
    K = int(model.cfg.parallel_k)
    x, labels, valid = batch["x"], batch["labels"], batch["valid"]
    B, T = x.shape
    n = T - K
    if n <= 0:
        return 0, 0
    g = model.project(batch["aux"])
    alive = torch.ones(B, n, dtype=torch.bool, device=x.device)
    for d in range(K):
        alive &= valid[:, 1 + d : 1 + d + n]
    rounds = int(alive.sum())
    acc = 0
    for d, logits, _ in model.parallel_unroll(x, g, K):
        i = logits[:, :n].argmax(-1)
        alive &= (i + d2t.to(i.device)[i]) == labels[:, 1 + d : 1 + d + n]
        acc += int(alive.sum())
    return acc, rounds


def train(
    hidden: list[str],
    vocab: str,
    identity: dict,
    out_dir: str | Path,
    params: dict | None = None,
    drafter: dict | None = None,
) -> dict:
    """Train a P-EAGLE drafter on the stores ``hidden``; write drafter.safetensors, metrics.parquet and
    train_summary.json under ``out_dir``; return the summary."""
    import pandas as pd

    from eaglet.target.head import TargetHead
    from eaglet.target.load import load_target_embedding, load_tokenizer

    p, d = resolve_settings(params, drafter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if int(p["gpus"] or 0) > 0 and torch.cuda.is_available() else "cpu")
    bf16 = bf16_autocast(p["autocast"], device.type == "cuda")
    ds = HiddenStateDataset(hidden, verify="sha")
    if ds.meta["target_digest"] != identity["digest"]:
        raise ArtifactError(
            f"{hidden[0]}: extracted from target {ds.meta['target_digest'][:12]}, "
            f"identity says {identity['digest'][:12]}"
        )
    d2t, t2d = check_vocab(vocab, identity)
    layer_ids = [int(i) for i in ds.meta["layer_ids"]]
    mask_id, mask_why = d["mask_token_id"], "drafter.p_eagle.mask_token_id"
    if mask_id is None:
        data_ids = {int(t) for i in range(len(ds)) for t in ds.input_ids(i).tolist()}
        try:
            mask_id, mask_why = mask_token_rule(load_tokenizer(identity["path"]), data_ids, int(identity["vocab_size"]))
        except ValueError as e:
            raise ValueError(str(e).replace("drafter.dflash.", "drafter.p_eagle.")) from None
    torch.manual_seed(p["seed"])
    cfg = PEagleConfig.from_identity(
        identity,
        draft_vocab_size=len(d2t),
        layer_ids=layer_ids,
        mask_token_id=int(mask_id),
        parallel_k=int(d["parallel_k"]),
        **drafter_options(p),  # train.norm_before_fc, norm_before_residual, norm_output: as EAGLE-3's
    )
    model = PEagleDrafter(cfg, load_target_embedding(identity["path"]))
    if p["lm_head_init"] == "target":
        rows = t2d.nonzero().flatten()
        w = TargetHead(
            identity["path"], rows=rows, trust_remote_code=bool(identity.get("trust_remote_code"))
        ).row_linear.weight.detach()
        with torch.no_grad():
            model.lm_head.weight.copy_(w.float())
    freeze_head(model, p)  # train.freeze_lm_head: out of the optimizer below
    model.to(device)
    objective = PEagleObjective(model)
    lengths = list(ds.num_tokens)
    micro, train_idx, val_idx = plan_micro_batches(ds.ids, lengths, p)
    A = int(p["grad_accum"])
    total = len(micro) // A if p["max_steps"] is None else min(len(micro) // A, int(p["max_steps"]))
    if total < 1:
        raise ValueError(
            f"train: {len(micro)} micro-batches are fewer than one step of {A}; lower train.token_budget or add data"
        )
    val_batches = plan_batches(val_idx, lengths, p["token_budget"], p["seed"], 0, shuffle=False)
    if p["val_max_batches"] is not None:
        val_batches = val_batches[: int(p["val_max_batches"])]
    params_ = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params_, lr=p["lr"], weight_decay=p["weight_decay"], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(total, math.ceil(p["warmup_ratio"] * total)))
    gen = torch.Generator().manual_seed(int(p["seed"]))
    rows, best = [], None

    def validate(step: int) -> None:
        nonlocal best
        if not val_batches:
            return
        acc = n = 0
        for idx in val_batches:
            a, r = parallel_acceptance(model, collate([ds.sample(i) for i in idx], device), d2t)
            acc, n = acc + a, n + r
        tau = 1 + acc / max(n, 1)
        rows.append(
            {
                "split": "val",
                "step": step,
                "loss": float("nan"),
                "parallel_tau": tau,
                "rounds": n,
                "tokens": 0,
                "lr": float("nan"),
                "seconds": 0.0,
            }
        )
        log.info("step %d: validation parallel tau %.3f over %d rounds", step, tau, n)
        if best is None or tau >= best["parallel_tau"]:
            best = {
                "step": step,
                "parallel_tau": tau,
                "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            }

    t0, tokens_seen = time.time(), 0
    progress = Progress(log, "train (p_eagle)", total, "steps")
    K = cfg.parallel_k
    for step in range(total):
        model.train()
        opt.zero_grad(set_to_none=True)
        st_sum, tok, losses = torch.zeros(3, K), 0, []
        for j in range(step * A, (step + 1) * A):
            b = collate([ds.sample(i) for i in micro[j]], device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, st = objective(b["x"], b["aux"], b["labels"], b["valid"], t2d, generator=gen)
            (loss / A).backward()
            st_sum += st.cpu()
            losses.append(float(loss))
            tok += b["tokens"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params_, p["grad_clip"])) if p["grad_clip"] else float("nan")
        opt.step()
        sched.step()
        tokens_seen += tok
        rows.append(
            {
                "split": "train",
                "step": step + 1,
                "loss": sum(losses) / len(losses),
                "parallel_tau": float("nan"),
                "rounds": 0,
                "tokens": tok,
                "lr": float(sched.get_last_lr()[0]),
                "seconds": time.time() - t0,
                "grad_norm": grad_norm,
                "tf_acc_k": (st_sum[1] / st_sum[2].clamp(min=1)).tolist(),
            }
        )
        progress.step(note=f"loss {rows[-1]['loss']:.4f}")
        if (step + 1) % int(p["val_every"]) == 0 or step + 1 == total:
            validate(step + 1)
    if best is not None:
        model.load_state_dict(best["model"])
        selected = {
            "step": best["step"],
            "val_parallel_tau": best["parallel_tau"],
            "rule": "best validation parallel_tau (the last pass on a tie)",
        }
    else:
        selected = {"step": total, "val_parallel_tau": None, "rule": "last weights: no validation set"}
    save_p_eagle(out / "drafter.safetensors", model, cfg, d2t, t2d)
    write_parquet(out / "metrics.parquet", pd.DataFrame(rows))
    val_rows = [r for r in rows if r["split"] == "val"]
    summary = {
        "kind": "p_eagle",
        "steps": total,
        "resumed_from": 0,
        "world_size": 1,
        "device": device.type,
        "micro_batches_per_step": A,
        "bf16_autocast": bf16,
        "train_samples": len(train_idx),
        "val_samples": len(val_idx),
        "train_tokens": int(sum(ds.num_tokens[i] for i in train_idx)),
        "tokens_this_run": tokens_seen,
        "seconds_this_run": time.time() - t0,
        "labels": "the target's stored greedy top-1 (target_top1): depth d at index t learns the top-1 at t + 1 + d",
        "layer_ids": layer_ids,
        "mask_token_id": int(mask_id),
        "mask_token_why": mask_why,
        "parallel_k": K,
        "num_speculative_tokens": K,
        "draft_vocab_size": len(d2t),
        "final_train": [r for r in rows if r["split"] == "train"][-1],
        "final_val": val_rows[-1] if val_rows else None,
        "selected": selected,
        "target_digest": identity["digest"],
        "params": p,
        "drafter": d,
        "config": json.loads(cfg.to_json()),
        "run_digest": digest_of({"params": p, "drafter": d}),
        DIGESTS_KEY: record_digests(out, ["drafter.safetensors", "metrics.parquet"]),
    }
    write_json(out / "train_summary.json", summary)
    log.info(
        "trained a P-EAGLE drafter %d steps (K %d): loss %.4f; validation parallel tau %s; kept step %d",
        total,
        K,
        summary["final_train"]["loss"],
        selected["val_parallel_tau"],
        selected["step"],
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--hidden", nargs="*", default=[], help="extract/shard_* folders or their index.json")
    ap.add_argument("--online", default=None, help="refused: the P-EAGLE trainer reads stored states")
    ap.add_argument("--vocab", required=True, help="vocab_map/vocab.safetensors (d2t, t2d)")
    ap.add_argument("--target-identity", required=True, help="the target's identity.json")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--params", default="{}", help="the train section of the config: JSON, or @FILE")
    ap.add_argument("--drafter", default="{}", help="drafter.p_eagle: JSON, or @FILE")
    ap.add_argument("--note", default=None, help="the workflow's storage statement (logged)")
    ap.add_argument("--log", default=None)
    a = ap.parse_args(argv)
    setup_logging(a.log)
    from eaglet.planner.storage import job_lines
    from eaglet.target.load import load_identity

    if a.online:
        raise SystemExit("train.hidden_states: online: the P-EAGLE trainer reads stored states; use offline")
    identity = load_identity(a.target_identity)
    for line in job_lines(parse_json_arg(a.note, None), identity["path"]):
        log.info("%s", line)
    train(a.hidden, a.vocab, identity, a.out_dir, parse_json_arg(a.params, {}), parse_json_arg(a.drafter, {}))


if __name__ == "__main__":
    main()
