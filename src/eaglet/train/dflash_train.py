"""Stage train for ``drafter.kind: dflash``: a DFlash drafter (eaglet.drafter.dflash, docs/block-drafters.md)
trained on the stored hidden states of the run (the same store as EAGLE-3's: both kinds train on
one extraction).

    python -m eaglet.train.dflash_train --hidden results/r/extract/shard_0 [...] \
        --target-identity resources/targets/t/identity.json --out-dir results/r/train \
        --params '{"lr": 1e-3, "epochs": 1, ...}' --drafter '{"block_size": 4, "num_layers": 1, ...}'

What it reads and why:
  taps     the store's aux states (the run's extract.layer_ids, vLLM convention), concatenated in
           that order: the drafter's target_layer_ids. The DFlash paper's default spreads one tap per
           draft layer over the target (eaglet.drafter.dflash.dflash_default_layer_ids); eaglet reuses
           the EAGLE-3 store instead, so one extraction serves both kinds (its three taps feed fc).
  labels   the target's stored greedy top-1 (``target_top1``, the argmax after reading x_0..t, so
           the label of position t + 1): what vLLM accepts at T = 0 along the real prefix. The
           data's tokens are not used as labels (they equal it only on the target's own answers).
  embed, head  the target's own, frozen (vLLM shares them with the drafter).

One step: anchors drawn per sequence by a seeded generator (eaglet.drafter.dflash.sample_anchors),
the weighted block CE, AdamW (train.lr, weight_decay, grad_clip, warmup + cosine over the run's
steps). The data plan is the EAGLE-3 trainer's (eaglet.train.data: same held-out split, micro-batches
under train.token_budget, train.grad_accum micro-batches per step, train.epochs, max_steps).

Validation (``split`` = val rows of metrics.parquet, every train.val_every steps and at the end):
``block_tau`` = 1 + the mean accepted drafts per block over every anchor of the held-out samples,
a draft accepted iff it and every earlier draft of its block equal the labels (the exact T = 0
acceptance of one block along the target's greedy choices). drafter.safetensors holds the weights of
the best pass (the last on a tie; the last weights without a validation set).

Checkpoints (train/checkpoints/step_*.pt, train.checkpoint_every) hold the weights, the optimizer,
the schedule, the anchor generator and the rows: a resumed run equals an uninterrupted one (same
world size). Online states and train.init_from are refused.

DDP (``torchrun --nproc_per_node N -m eaglet.train.dflash_train ...``, as the workflow launches it for
train.gpus > 1 or train.nodes > 1 through eaglet.planner.gpu_slots; nccl on GPUs, gloo on the CPU): a
step reads ``N x train.grad_accum`` micro-batches, rank r the r-th run of ``grad_accum`` of them, the
gradients averaged by DDP, so N ranks train as one process with ``grad_accum`` N times larger. Every
rank draws the anchors of every micro-batch of the step, in order, from the one seeded generator (the
other ranks' from their loss masks alone, no hidden states read), so the draws, and with them the
run, are the one process's; one process draws exactly as before DDP. Validation, checkpoints and the
outputs are rank 0's.
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
from eaglet.base.digests import DIGESTS_KEY, digest_of, file_digest, record_digests
from eaglet.base.files import write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.progress import Progress
from eaglet.base.settings_files import parse_json_arg
from eaglet.drafter.dflash import (
    DFlashConfig,
    DFlashDrafter,
    dflash_loss_from_hidden,
    sample_anchors,
    save_dflash,
)
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.planner.plan import bf16_autocast
from eaglet.train.data import plan_batches, plan_micro_batches
from eaglet.train.setup import lr_lambda_for
from eaglet.train.state import dist_setup, load_latest_checkpoint, save_checkpoint

log = logging.getLogger("eaglet.train.dflash_train")
LAUNCH_KEYS = ("nodes", "rdzv_port")


# --------------------------------------------------------------------------- settings and refusals
def resolve_settings(params: dict | None, drafter: dict | None) -> tuple[dict, dict]:
    """(train.*, drafter.dflash.*) over the schema's defaults; what this trainer cannot do refused."""
    p = schema.settings("train", params, "train", leave_out=LAUNCH_KEYS)
    d = schema.settings("drafter.dflash", drafter, "drafter.dflash")
    if p["hidden_states"] != "offline":
        raise ValueError("train.hidden_states: online: the DFlash trainer reads stored states; use offline")
    if p["init_from"]:
        raise ValueError("train.init_from: continuing a published drafter is EAGLE-3 only; leave it null")
    return p, d


def mask_token_rule(tokenizer, data_ids: set[int], vocab_size: int) -> tuple[int, str]:
    """drafter.dflash.mask_token_id null: the highest-id special token of the tokenizer that is not
    its bos/eos/pad/unk token, not named in its chat template and not in the training tokens."""
    taken = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    special = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    special |= {int(i): tokenizer.convert_ids_to_tokens(int(i)) for i in tokenizer.all_special_ids}
    ok = sorted(i for i, text in special.items()
                if i not in taken and i < vocab_size and i not in data_ids and (not text or text not in template))
    if not ok:
        raise ValueError("drafter.dflash.mask_token_id: the tokenizer has no unused special token (not bos, eos, "
                         "pad or unk, not in the chat template, not in the training tokens); set the key")
    return ok[-1], f"the rule: special token {special[ok[-1]]!r}, unused by the template and the data"


# --------------------------------------------------------------------------- data
def collate(samples: list[dict], device) -> dict:
    """taps [B,T,N] (the aux states concatenated), input_ids, labels (the target's greedy top-1 of
    the position before), loss_mask (False on padding)."""
    B, T = len(samples), max(len(s["input_ids"]) for s in samples)
    N = samples[0]["aux"].shape[-2] * samples[0]["aux"].shape[-1]
    out = {"taps": torch.zeros(B, T, N), "input_ids": torch.zeros(B, T, dtype=torch.long),
           "labels": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.bool)}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        out["taps"][b, :n] = s["aux"].reshape(n, N)
        out["input_ids"][b, :n] = s["input_ids"]
        out["labels"][b, :n] = s["input_ids"]
        out["labels"][b, 1:n] = s["target_top1"][:n - 1]
        out["loss_mask"][b, :n] = s["loss_mask"].bool()
    return {k: v.to(device) for k, v in out.items()} | {"tokens": sum(len(s["input_ids"]) for s in samples)}


@torch.no_grad()
def block_acceptance(model: DFlashDrafter, batch: dict, embed_VH, head_VH, chunk: int = 256) -> tuple[int, int]:
    """(accepted drafts, blocks) over every anchor of the batch with a whole block of supervised
    labels after it: a draft is accepted iff it and every earlier one of its block equal the labels.
    Each sequence's context K/V are computed once, then its blocks run ``chunk`` at a time (what
    :meth:`DFlashDrafter.block_hidden` computes, without redoing the context per chunk)."""
    model.eval()
    K = model.cfg.block_size
    acc = blocks = 0
    for b in range(batch["input_ids"].shape[0]):
        m = batch["loss_mask"][b]
        S = int(m.shape[0])
        ok = [a for a in range(S - K + 1) if bool(m[a + 1:a + K].all())]
        if not ok:
            continue
        ids = batch["input_ids"][b:b + 1]
        ctx_kv = model.context_kv(model.context(batch["taps"][b:b + 1]), torch.arange(S, device=m.device)[None])
        for i in range(0, len(ok), chunk):
            anchors = torch.tensor([ok[i:i + chunk]], device=m.device)
            q_ids, q_pos, mask = model.block_inputs(ids, anchors)
            x = torch.nn.functional.embedding(q_ids, embed_VH).to(model.fc.weight.dtype)
            h = model.run_block(x, q_pos, ctx_kv, mask).view(1, anchors.shape[1], K, -1)
            # the head only where the block is still accepted: draft k + 1 counts only after k hits
            # (the full-vocabulary head is most of the cost; the count is eaglet.drafter.chain.accepted_prefix's)
            labels = batch["labels"][b][anchors[0, :, None] + torch.arange(1, K, device=m.device)]  # A, K-1
            alive = torch.ones(anchors.shape[1], dtype=torch.bool, device=m.device)
            for k in range(K - 1):
                rows = alive.nonzero().flatten()
                if not len(rows):
                    break
                hit = (h[0, rows, k + 1] @ head_VH.T).argmax(-1) == labels[rows, k]
                acc += int(hit.sum())
                alive[rows[~hit]] = False
            blocks += len(anchors[0])
    return acc, blocks


def loss_masks(ds: HiddenStateDataset, idx: list[int]) -> torch.Tensor:
    """The padded [B,T] loss mask :func:`collate` makes of samples ``idx``, from the masks alone:
    what another rank's micro-batch needs for its anchor draws."""
    lengths = [int(ds.num_tokens[i]) for i in idx]
    out = torch.zeros(len(idx), max(lengths), dtype=torch.bool)
    for b, (i, n) in enumerate(zip(idx, lengths, strict=True)):
        out[b, :n] = ds.loss_mask(i).bool()
    return out


class _Blocks(torch.nn.Module):
    """The drafter's block forward as ``forward``, so DDP (which syncs what its forward ran) wraps it."""

    def __init__(self, model: DFlashDrafter):
        super().__init__()
        self.model = model

    def forward(self, taps, ids, anchors, embed):
        return self.model.block_hidden(taps, ids, anchors, embed)


# --------------------------------------------------------------------------- the run
def train(hidden: list[str], identity: dict, out_dir: str | Path, params: dict | None = None,
          drafter: dict | None = None) -> dict:
    """Train a DFlash drafter on the stores ``hidden``; write drafter.safetensors, metrics.parquet
    and train_summary.json under ``out_dir``; return the summary."""
    import contextlib

    import pandas as pd

    from eaglet.target.head import TargetHead
    from eaglet.target.load import load_target_embedding, load_tokenizer

    p, d = resolve_settings(params, drafter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank, ws, device = dist_setup(int(p["gpus"]))
    # train.autocast as EAGLE-3's trainer reads it (decided at parse time by the CPU's bf16 units):
    # the training forward under bf16 autocast, fp32 weights and CE; validation in fp32
    bf16 = bf16_autocast(p["autocast"], device.type == "cuda")
    ds = HiddenStateDataset(hidden, verify="sha")
    if ds.meta["target_digest"] != identity["digest"]:
        raise ArtifactError(f"{hidden[0]}: extracted from target {ds.meta['target_digest'][:12]}, "
                            f"identity says {identity['digest'][:12]}")
    layer_ids = [int(i) for i in ds.meta["layer_ids"]]
    mask_id, mask_why = d["mask_token_id"], "drafter.dflash.mask_token_id"
    if mask_id is None:
        data_ids = {int(t) for i in range(len(ds)) for t in ds.input_ids(i).tolist()}
        mask_id, mask_why = mask_token_rule(load_tokenizer(identity["path"]), data_ids, int(identity["vocab_size"]))
    torch.manual_seed(p["seed"])
    cfg = DFlashConfig.from_identity(identity, num_layers=d["num_layers"], block_size=d["block_size"],
                                     mask_token_id=mask_id, target_layer_ids=layer_ids)
    model = DFlashDrafter(cfg).to(device)
    blocks = _Blocks(model)
    if ws > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        blocks = DDP(blocks, device_ids=[device.index] if device.type == "cuda" else None)
    embed = load_target_embedding(identity["path"]).float().to(device)
    head = TargetHead(identity["path"], rows=torch.arange(cfg.vocab_size),
                      trust_remote_code=bool(identity.get("trust_remote_code"))).row_linear.weight.detach()
    head = head.float().to(device)
    lengths = list(ds.num_tokens)
    micro, train_idx, val_idx = plan_micro_batches(ds.ids, lengths, p)
    A = int(p["grad_accum"])
    M = A * ws  # micro-batches a step reads, over every rank
    total = len(micro) // M if p["max_steps"] is None else min(len(micro) // M, int(p["max_steps"]))
    if total < 1:
        raise ValueError(f"train: {len(micro)} micro-batches are fewer than one step of {M}; lower "
                         "train.token_budget or add data")
    val_batches = plan_batches(val_idx, lengths, p["token_budget"], p["seed"], 0, shuffle=False)
    if p["val_max_batches"] is not None:
        val_batches = val_batches[:int(p["val_max_batches"])]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(total, math.ceil(p["warmup_ratio"] * total)))
    gen = torch.Generator().manual_seed(int(p["seed"]))
    # what defines the checkpoints: resumed only by this very run
    identity_ck = json.loads(json.dumps({
        "kind": "dflash", "target": identity["digest"], "stores": [file_digest(Path(h) / "index.json"
                                                                              if Path(h).is_dir() else h)
                                                                  for h in hidden],
        "params": {k: v for k, v in p.items() if k not in ("checkpoint_every", "keep_checkpoints")},
        "drafter": d, "mask_token_id": mask_id, "device": device.type, "world": ws}, default=str))
    ckpt_dir = out / "checkpoints"
    start, rows, best = 0, [], None
    state = load_latest_checkpoint(ckpt_dir, identity_ck) if ckpt_dir.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        start, rows, best = int(state["step"]), list(state["metrics"]), state.get("best")
        if rank == 0:
            log.info("resuming from %s/step_%08d.pt", ckpt_dir, start)
    gamma = d["loss_decay_gamma"]

    def validate(step: int) -> None:
        nonlocal best
        if not val_batches or rank != 0:
            return
        acc = blocks = 0
        for idx in val_batches:
            a, n = block_acceptance(model, collate([ds.sample(i) for i in idx], device), embed, head)
            acc, blocks = acc + a, blocks + n
        tau = 1 + acc / max(blocks, 1)
        rows.append({"split": "val", "step": step, "loss": float("nan"), "block_tau": tau, "blocks": blocks,
                     "tokens": 0, "lr": float("nan"), "seconds": 0.0})
        log.info("step %d: validation block tau %.3f over %d blocks", step, tau, blocks)
        if best is None or tau >= best["block_tau"]:
            best = {"step": step, "block_tau": tau,
                    "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}

    t0, tokens_seen = time.time(), 0
    quiet = logging.getLogger(f"{log.name}.rank")  # the other ranks' progress: not logged
    quiet.setLevel(logging.WARNING)
    progress = Progress(log if rank == 0 else quiet, "train (dflash)", total - start, "steps")  # every 30 s at most
    for step in range(start, total):
        model.train()
        opt.zero_grad(set_to_none=True)
        stats, tok = [], 0
        for j in range(step * M, (step + 1) * M):
            idx = micro[j]
            a = j - step * M - rank * A  # this rank's a-th micro-batch of the step, if 0 <= a < A
            if not 0 <= a < A:  # another rank's: only its draws, so the generator stays the one process's
                sample_anchors(loss_masks(ds, idx), cfg.block_size, int(d["num_anchors"]), gen)
                continue
            batch = collate([ds.sample(i) for i in idx], device)
            anchors = sample_anchors(batch["loss_mask"], cfg.block_size, int(d["num_anchors"]), gen)
            sync = blocks.no_sync() if ws > 1 and a < A - 1 else contextlib.nullcontext()
            with sync:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    h = blocks(batch["taps"], batch["input_ids"], anchors, embed)
                    loss, st = dflash_loss_from_hidden(h, head, batch["labels"], batch["loss_mask"], anchors, gamma)
                (loss / A).backward()
            stats.append(st)
            tok += batch["tokens"]
        if ws > 1:  # every rank's stats, in micro-batch order, for rank 0's row
            import torch.distributed as dist

            parts = [None] * ws
            dist.all_gather_object(parts, (stats, tok))
            stats, tok = [st for part, _ in parts for st in part], sum(t for _, t in parts)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), p["grad_clip"])) if p["grad_clip"] \
            else float("nan")
        opt.step()
        sched.step()
        tokens_seen += tok
        n_k = [sum(s["n_k"][k] for s in stats) for k in range(cfg.block_size - 1)]
        acc_k = [sum(s["acc_k"][k] * s["n_k"][k] for s in stats) / max(n_k[k], 1) for k in range(len(n_k))]
        rows.append({"split": "train", "step": step + 1, "loss": sum(s["loss"] for s in stats) / len(stats),
                     "block_tau": float("nan"), "blocks": sum(s["n_blocks"] for s in stats), "tokens": tok,
                     "lr": float(sched.get_last_lr()[0]), "seconds": time.time() - t0, "grad_norm": grad_norm,
                     "tf_acc_k": acc_k})
        progress.step(note=f"loss {rows[-1]['loss']:.4f}")
        if (step + 1) % int(p["val_every"]) == 0 or step + 1 == total:
            validate(step + 1)
        if (step + 1) % int(p["checkpoint_every"]) == 0 and step + 1 < total and rank == 0:
            save_checkpoint(ckpt_dir, step + 1, {
                "identity": identity_ck, "step": step + 1, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "generator": gen.get_state(),
                "metrics": rows, "best": best}, int(p["keep_checkpoints"]))
    if ws > 1:
        import torch.distributed as dist

        dist.barrier()
        if rank != 0:
            dist.destroy_process_group()
            return {}
    if best is not None:
        model.load_state_dict(best["model"])
        selected = {"step": best["step"], "val_block_tau": best["block_tau"],
                    "rule": "best validation block_tau (the last pass on a tie)"}
    else:
        selected = {"step": total, "val_block_tau": None, "rule": "last weights: no validation set"}
    save_dflash(out / "drafter.safetensors", model, cfg)
    write_parquet(out / "metrics.parquet", pd.DataFrame(rows))
    val_rows = [r for r in rows if r["split"] == "val"]
    summary = {"kind": "dflash", "steps": total, "resumed_from": start, "world_size": ws, "device": device.type,
               "micro_batches_per_step": M,
               "bf16_autocast": bf16, "train_samples": len(train_idx), "val_samples": len(val_idx),
               "train_tokens": int(sum(ds.num_tokens[i] for i in train_idx)),
               "tokens_this_run": tokens_seen, "seconds_this_run": time.time() - t0,
               "labels": "the target's stored greedy top-1 (target_top1) of the position before",
               "taps": f"the store's aux layers {layer_ids} (extract.layer_ids, vLLM convention)",
               "mask_token_id": mask_id, "mask_token_why": mask_why,
               "final_train": [r for r in rows if r["split"] == "train"][-1],
               "final_val": val_rows[-1] if val_rows else None, "selected": selected,
               "block_size": cfg.block_size, "num_speculative_tokens": cfg.block_size - 1,
               "layer_ids": layer_ids, "target_digest": identity["digest"], "params": p, "drafter": d,
               "config": json.loads(cfg.to_json()), "run_digest": digest_of(identity_ck),
               DIGESTS_KEY: record_digests(out, ["drafter.safetensors", "metrics.parquet"])}
    write_json(out / "train_summary.json", summary)
    log.info("trained a DFlash drafter %d steps: loss %.4f; validation block tau %s; kept step %d", total,
             summary["final_train"]["loss"], selected["val_block_tau"], selected["step"])
    if ws > 1:
        dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--hidden", nargs="*", default=[], help="extract/shard_* folders or their index.json")
    ap.add_argument("--online", default=None, help="refused: the DFlash trainer reads stored states")
    ap.add_argument("--vocab", default=None, help="unused (the DFlash drafter drafts over the target's vocabulary)")
    ap.add_argument("--target-identity", required=True, help="the target's identity.json")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--params", default="{}", help="the train section of the config: JSON, or @FILE")
    ap.add_argument("--drafter", default="{}", help="drafter.dflash: JSON, or @FILE")
    ap.add_argument("--note", default=None, help="the workflow's storage statement (logged)")
    ap.add_argument("--log", default=None)
    a = ap.parse_args(argv)
    import os

    rank = int(os.environ.get("RANK", "0"))
    setup_logging(a.log if rank == 0 else None)
    from eaglet.planner.storage import job_lines
    from eaglet.target.load import load_identity

    if a.online:
        raise SystemExit("train.hidden_states: online: the DFlash trainer reads stored states; use offline")
    identity = load_identity(a.target_identity)
    for line in job_lines(parse_json_arg(a.note, None), identity["path"]) if rank == 0 else []:
        log.info("%s", line)
    train(a.hidden, identity, a.out_dir, parse_json_arg(a.params, {}), parse_json_arg(a.drafter, {}))


if __name__ == "__main__":
    main()
