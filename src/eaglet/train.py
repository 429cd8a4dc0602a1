"""Stage train: EAGLE-3 training-time-test (TTT) training of the drafter (eagle3.md §3).

    python -m eaglet.train --hidden results/r/extract/shard_0/index.json [...] \
        --vocab results/r/vocab_map/vocab.safetensors \
        --target-identity resources/targets/t/identity.json \
        --out-dir results/r/train --params '{"ttt_steps": 7, "lr": 1e-4, ...}' [--log FILE]
    torchrun --nproc_per_node N -m eaglet.train ...   # DDP (nccl on GPU, gloo on CPU)

Writes ``drafter.safetensors`` (eaglet.model.save_drafter), ``metrics.parquet`` (one row per
optimizer step, ``split`` = train, plus a ``split`` = val row at every validation pass),
``train_summary.json`` and ``checkpoints/step_*.pt``. A killed run restarts from its latest
checkpoint and reproduces the same loss trace (fixed seed, same device and world size).

Alignment (see Eagle3Drafter.ttt_unroll): index t of step k drafts x_{t+2+k}; its target is
softmax(target_logits(final_{t+1+k})[t2d]) (the target's next-token distribution after reading
x_{t+1+k}); it counts iff x_{t+2+k} is an assistant token (loss_mask) and the target's greedy
token there lies in the draft vocab. (SpecForge masks with the unshifted loss_mask[t]; only the
boundary tokens of assistant turns differ.) Loss = sum_k gamma^k L_k, L_k = soft cross-entropy
summed over counted positions / their number. Target logits are computed on the fly from the
stored final hidden state and only the draft-vocab rows of the target lm_head.

Shape legend: B batch, T padded tokens, H hidden, V_d draft vocab, K TTT steps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eaglet import io, labels
from eaglet.hidden_store import HiddenStateDataset
from eaglet.model import DrafterConfig, Eagle3Drafter, load_target_embedding, save_drafter

log = logging.getLogger("eaglet.train")

DEFAULTS = dict(
    ttt_steps=7,            # EAGLE/SpecForge unroll; speculators/ModelOpt use 3
    gamma=0.8,              # step weight gamma^k (EAGLE/SpecForge)
    epochs=1.0,
    lr=1e-4,
    warmup_ratio=0.015,
    weight_decay=0.0,
    grad_clip=0.5,
    token_budget=8192,      # padded tokens (B x T_max) per micro-batch
    grad_accum=1,           # micro-batches per optimizer step and rank
    lm_head_init="target",  # "target": the target's head rows (speculators); "random" (SpecForge)
    noise_std=0.0,          # Gaussian noise added to the aux states (training only)
    oov_rule="greedy",      # "greedy": drop positions whose target argmax is outside the draft
                            # vocab (reads the other head rows too, no_grad); "label": use the
                            # next token instead (same on target-generated data; draft rows only)
    checkpoint_every=200,
    keep_checkpoints=1,
    val_fraction=0.05,
    val_every=100,
    val_max_batches=None,
    max_steps=None,         # cap on optimizer steps (smoke runs, tests)
    seed=0,
    gpus=0,
    label_min_agreement=labels.MIN_AGREEMENT,  # top-1 agreement of the labels with the real model
    accept_unchecked_labels=False,  # train even when the label check could not run (no references)
    sleep_per_step=0.0,     # test aid: slow a run down so a test can kill it mid-way
)


def resolve_params(params: dict | None) -> dict:
    p = dict(DEFAULTS)
    unknown = set(params or {}) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"train params: unknown keys {sorted(unknown)} (known: {sorted(DEFAULTS)})")
    p.update(params or {})
    if p["lm_head_init"] not in ("target", "random"):
        raise ValueError(f"train.lm_head_init: {p['lm_head_init']!r} not 'target' or 'random'")
    if p["oov_rule"] not in ("greedy", "label"):
        raise ValueError(f"train.oov_rule: {p['oov_rule']!r} not 'greedy' or 'label'")
    return p


# --------------------------------------------------------------------------- target logits
class TargetHead:
    """The target's next-token distribution over the draft vocab, from stored pre-norm final
    states, computed by the target's own modules (eaglet.labels)."""

    def __init__(self, identity: dict, t2d: torch.Tensor, final_is_prenorm: bool, greedy_rows: bool,
                 device):
        if not final_is_prenorm:
            raise io.ArtifactError("hidden states store the final state after the norm; eaglet.extract "
                                   "stores it before (re-extract)")
        self.head = labels.TargetHead(identity["path"], rows=t2d.nonzero().squeeze(1), device=device,
                                      trust_remote_code=bool(identity.get("trust_remote_code", False)))
        self.w_VdH = self.head.row_linear.weight.detach()
        self.rest = []
        if greedy_rows and not bool(t2d.all()):
            dt = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
            self.rest = self.head.row_chunks((~t2d).nonzero().squeeze(1), dt)

    @torch.no_grad()
    def __call__(self, final_BTH: torch.Tensor):
        """-> (p_BTVd float32, greedy_in_draft_vocab_BT bool or None)."""
        x = self.head.normed(final_BTH)
        logits = self.head.logits(x, normed=True)
        inv = None
        if self.rest:
            inv = logits.amax(-1) >= self.head.max_over(x, self.rest, normed=True)
        return torch.softmax(logits, -1), inv


def prove_labels(head: TargetHead, ds: HiddenStateDataset, p: dict) -> dict:
    """The reconstructed labels against the real model's top-1 tokens recorded by extraction;
    raises LabelMismatch on disagreement, and when the check cannot run unless
    ``accept_unchecked_labels`` (a check that did not run is not a pass)."""
    where = {s: i for i, s in enumerate(ds.ids)}
    rec = labels.check_against_reference(head.head, ds.label_references, lambda sid: ds.sample(where[sid])["final"],
                                         ds.meta["dtype"], float(p["label_min_agreement"]))
    if rec["ok"] is None and not p["accept_unchecked_labels"]:
        raise labels.LabelMismatch(f"the label check did not run ({rec['reason']}): the hidden states hold no "
                                   "real-model references (re-extract with this eaglet), or set "
                                   "train.accept_unchecked_labels: true to train unchecked")
    return rec


# --------------------------------------------------------------------------- data
def is_val(sample_id: str, fraction: float) -> bool:
    """Deterministic held-out split by id hash (stable across runs, shards and world sizes)."""
    h = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16)
    return h < fraction * 2**32


def plan_batches(indices: list[int], lengths: list[int], budget: int, seed: int, epoch: int,
                 shuffle: bool = True, window: int = 256) -> list[list[int]]:
    """Micro-batches of sample indices with B x T_max <= budget. Shuffled, then sorted by length
    inside windows of ``window`` samples to cut padding; batch order shuffled again."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = [indices[i] for i in torch.randperm(len(indices), generator=g)] if shuffle else list(indices)
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        cur: list[int] = []
        for i in sorted(order[w:w + window], key=lambda i: lengths[i]):
            if cur and (len(cur) + 1) * lengths[i] > budget:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    if shuffle:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=g)]
    return batches


def collate(samples: list[dict], device) -> dict:
    B, T = len(samples), max(len(s["input_ids"]) for s in samples)
    H = samples[0]["final"].shape[-1]
    out = {"x": torch.zeros(B, T, dtype=torch.long), "mask": torch.zeros(B, T, dtype=torch.bool),
           "aux": torch.zeros(B, T, 3, samples[0]["aux"].shape[-1]), "final": torch.zeros(B, T, H)}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        out["x"][b, :n] = s["input_ids"]
        out["mask"][b, :n] = s["loss_mask"].bool()
        out["aux"][b, :n] = s["aux"]
        out["final"][b, :n] = s["final"]
    out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    out["tokens"] = sum(len(s["input_ids"]) for s in samples)
    return out


def plan_micro_batches(ids: list[str], lengths: list[int], p: dict):
    """All micro-batches of the run in order (epochs concatenated, a fractional last epoch cut),
    and the train/val sample indices. Step s of a run with M micro-batches per step uses
    micro[s*M:(s+1)*M], whatever the world size: the step number is the data position."""
    train_idx = [i for i, s in enumerate(ids) if not is_val(s, p["val_fraction"])]
    val_idx = [i for i, s in enumerate(ids) if is_val(s, p["val_fraction"])]
    micro: list[list[int]] = []
    for e in range(math.ceil(p["epochs"])):
        eb = plan_batches(train_idx, lengths, p["token_budget"], p["seed"], e)
        micro += eb[:int(len(eb) * min(1.0, p["epochs"] - e))]
    return micro, train_idx, val_idx


# --------------------------------------------------------------------------- the objective
class TTTObjective(nn.Module):
    """Drafter + TTT loss in one module, so DDP sees one forward per micro-batch."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, gamma: float):
        super().__init__()
        self.drafter, self.steps, self.gamma = drafter, steps, gamma

    def forward(self, x_BT, aux_BT3H, p_BTVd, valid_BT, noise=None):
        """valid_BT[s] = target position s counts (its next token x_{s+1} is an assistant token
        whose greedy target prediction is in the draft vocab). -> (loss, stats [3, K])."""
        if noise is not None:
            aux_BT3H = aux_BT3H + noise
        g = self.drafter.project(aux_BT3H)
        T = x_BT.shape[1]
        loss = g.new_zeros((), dtype=torch.float32)
        stats = torch.zeros(3, self.steps, device=x_BT.device)  # L_k, correct_k, count_k
        for k, logits, _ in self.drafter.ttt_unroll(x_BT, g, self.steps):
            n = T - 2 - k  # indices t whose drafted token x_{t+2+k} exists
            if n <= 0:
                loss = loss + 0.0 * logits.sum()  # keep every parameter in the graph (DDP)
                continue
            lp = F.log_softmax(logits[:, :n].float(), -1)
            tgt = p_BTVd[:, 1 + k:1 + k + n]
            valid = valid_BT[:, 1 + k:1 + k + n]
            cnt = valid.sum()
            ce = -(tgt * lp).sum(-1)
            L = (ce * valid).sum() / cnt.clamp(min=1)
            loss = loss + self.gamma ** k * L
            with torch.no_grad():
                stats[0, k] = L.detach()
                stats[1, k] = ((lp.argmax(-1) == tgt.argmax(-1)) & valid).sum()
                stats[2, k] = cnt
        return loss, stats


def valid_positions(batch: dict, t2d: torch.Tensor, inv_BT) -> torch.Tensor:
    """valid[s]: x_{s+1} is an assistant token and the target's greedy pick at s is draftable."""
    x, m = batch["x"], batch["mask"]
    v = torch.zeros_like(m)
    v[:, :-1] = m[:, 1:]
    if inv_BT is not None:
        v &= inv_BT
    else:  # oov_rule "label": the next token itself must be draftable
        nxt = torch.zeros_like(x)
        nxt[:, :-1] = x[:, 1:]
        v &= t2d[nxt]
    return v


def tau_of(acc: list[float]) -> float:
    """Simulated acceptance length 1 + sum_k prod_{i<=k} acc_i."""
    t, p = 1.0, 1.0
    for a in acc:
        p *= a
        t += p
    return t


# --------------------------------------------------------------------------- distributed
def dist_setup(gpus: int):
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if gpus > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"train.gpus = {gpus} but no CUDA device is visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if ws > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, ws, device


def all_sum(t: torch.Tensor, ws: int) -> torch.Tensor:
    if ws > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


# --------------------------------------------------------------------------- checkpoints
def _ckpt_files(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("step_*.pt"))


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, keep: int) -> None:
    with io.atomic_path(ckpt_dir / f"step_{step:08d}.pt") as tmp:
        torch.save(state, tmp)
    for old in _ckpt_files(ckpt_dir)[:-max(1, keep)]:
        old.unlink()


def load_latest_checkpoint(ckpt_dir: Path, digest: str) -> dict | None:
    """Newest checkpoint of this very configuration; others are stale and removed."""
    for f in reversed(_ckpt_files(ckpt_dir)):
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)  # never unpickle objects
        except Exception as e:  # noqa: BLE001 - a corrupt file must not stop training
            log.warning("%s: unreadable checkpoint (%s); ignoring it", f, e)
            continue
        if state.get("digest") == digest:
            return state
        log.warning("%s: written by a different configuration; removing it", f)
        f.unlink()
    return None


def _rng_state() -> dict:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# --------------------------------------------------------------------------- the loop
def lr_lambda_for(total: int, warmup: int):
    def f(step: int) -> float:  # linear warmup, then cosine to zero
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f


def train(hidden: list[str], vocab: str, identity: dict, out_dir: str | Path, params: dict | None = None,
          dataset: HiddenStateDataset | None = None) -> dict:
    """Train a drafter; write the stage's outputs under ``out_dir``; return the summary."""
    from tqdm import tqdm

    p = resolve_params(params)
    out_dir = Path(out_dir)
    rank, ws, device = dist_setup(int(p["gpus"]))
    main = rank == 0
    torch.manual_seed(p["seed"])
    random.seed(p["seed"])

    # Every chunk is hashed against its index once (rank 0); other ranks check headers only.
    ds = dataset if dataset is not None else HiddenStateDataset(hidden, verify="sha" if main else "header")
    meta = ds.meta
    if meta["target_digest"] != identity["digest"]:
        raise io.ArtifactError(f"{hidden[0] if hidden else 'hidden states'}: extracted from target "
                               f"{meta['target_digest'][:12]}, identity says {identity['digest'][:12]}")
    vt = io.load_tensors(vocab, ["d2t", "t2d"])
    d2t, t2d = vt["d2t"].long(), vt["t2d"].bool()
    if len(t2d) != identity["vocab_size"] or int(t2d.sum()) != len(d2t):
        raise io.ArtifactError(f"{vocab}: t2d has {len(t2d)} entries ({int(t2d.sum())} set), target vocab "
                               f"{identity['vocab_size']}, d2t {len(d2t)}")
    if not torch.equal(t2d.nonzero().squeeze(1), torch.arange(len(d2t)) + d2t):
        raise io.ArtifactError(f"{vocab}: nonzero(t2d) != arange(V_d) + d2t")

    cfg = DrafterConfig.from_identity(identity, len(d2t), meta["layer_ids"], ttt_steps=int(p["ttt_steps"]))
    head = TargetHead(identity, t2d, bool(meta["final_is_prenorm"]), p["oov_rule"] == "greedy", device)
    label_check = prove_labels(head, ds, p)
    if main:
        log.info("labels: top-1 agreement with the real model %s on %d of %d recorded positions (norm %s)",
                 f"{label_check['agreement']:.4f}" if label_check["ok"] is not None else "NOT RUN",
                 label_check["judged"], label_check["positions"], label_check["norm_class"])
    drafter = Eagle3Drafter(cfg, load_target_embedding(identity["path"]))
    if p["lm_head_init"] == "target":
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head.w_VdH.cpu())
    drafter.to(device)
    objective = TTTObjective(drafter, cfg.ttt_steps, float(p["gamma"]))
    model = objective
    if ws > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None,
                    broadcast_buffers=False)
    t2d_dev = t2d.to(device)

    # ---- data plan: a pure function of (data, params), so the step number is the data position
    lengths = list(ds.num_tokens)
    micro, train_idx, val_idx = plan_micro_batches(ds.ids, lengths, p)
    A, M = int(p["grad_accum"]), int(p["grad_accum"]) * ws
    if not train_idx:
        raise io.ArtifactError(f"{hidden}: no training samples left after the validation split")
    total = len(micro) // M
    if p["max_steps"] is not None:
        total = min(total, int(p["max_steps"]))
    if total < 1:
        raise ValueError(f"train: {len(micro)} micro-batches are fewer than one step of {M}; "
                         "lower train.token_budget or add data")
    val_batches = plan_batches(val_idx, lengths, p["token_budget"], p["seed"], 0, shuffle=False)
    if p["val_max_batches"] is not None:
        val_batches = val_batches[:int(p["val_max_batches"])]

    opt = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=p["lr"],
                            weight_decay=p["weight_decay"], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(total, math.ceil(p["warmup_ratio"] * total)))

    # ---- resume
    ckpt_dir = out_dir / "checkpoints"
    digest = io.digest_of({"params": {k: v for k, v in p.items() if k != "sleep_per_step"},
                           "target": identity["digest"], "vocab": io.file_digest(vocab),
                           "data": [ds.ids, lengths], "world": ws, "device": device.type})
    start, rows = 0, []
    state = load_latest_checkpoint(ckpt_dir, digest) if ckpt_dir.exists() else None
    if state is not None:
        drafter.load_state_dict({**state["model"], "embed_tokens.weight": drafter.embed_tokens.weight})
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        start, rows = int(state["step"]), list(state["metrics"])
        if main:
            log.info("resuming from %s/step_%08d.pt", ckpt_dir, start)

    # Reading + collating runs one micro-batch ahead in a thread (the only thread touching ds).
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-data")
    pending: dict[tuple, Future] = {}

    def fetch(batch_idx: list[int]) -> Future:
        return pool.submit(lambda: collate([ds.sample(i) for i in batch_idx], "cpu"))

    def prepare(batch_idx: list[int], gen_seed: int | None, ahead: list[int] | None = None):
        fut = pending.pop(tuple(batch_idx), None) or fetch(batch_idx)
        if ahead is not None:
            pending[tuple(ahead)] = fetch(ahead)
        b = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in fut.result().items()}
        p_BTVd, inv = head(b["final"])
        noise = None
        if gen_seed is not None and p["noise_std"] > 0:
            gen = torch.Generator(device=device).manual_seed(gen_seed)
            noise = torch.randn(b["aux"].shape, generator=gen, device=device) * p["noise_std"]
        return b, p_BTVd, valid_positions(b, t2d_dev, inv), noise

    def run(m, b, p_BTVd, valid, noise):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return m(b["x"], b["aux"], p_BTVd, valid, noise)

    def validate(step: int) -> dict:
        objective.eval()
        acc = torch.zeros(3, cfg.ttt_steps, device=device)
        with torch.no_grad():
            for bi in range(rank, len(val_batches), ws):
                b, p_BTVd, valid, _ = prepare(val_batches[bi], None)
                _, st = run(objective, b, p_BTVd, valid, None)
                acc[0] += st[0] * st[2]  # token-weighted over the whole held-out set
                acc[1:] += st[1:]
        acc = all_sum(acc, ws)
        objective.train()
        cnt = acc[2].clamp(min=1)
        lk, ak = (acc[0] / cnt).tolist(), (acc[1] / cnt).tolist()
        row = {"split": "val", "step": step, "loss": sum(p["gamma"] ** k * v for k, v in enumerate(lk)),
               "tau": tau_of(ak), "positions": int(acc[2, 0])}
        row.update({f"loss_{k}": v for k, v in enumerate(lk)})
        row.update({f"acc_{k}": v for k, v in enumerate(ak)})
        return row

    objective.train()
    bar = tqdm(total=total, initial=start, disable=not main, desc="train", mininterval=5)
    t_start = time.time()
    tokens_seen = 0
    for step in range(start, total):
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        stats = torch.zeros(3, cfg.ttt_steps, device=device)
        loss_sum = torch.zeros((), device=device)
        tokens = torch.zeros((), device=device)
        for a in range(A):
            j = step * M + rank * A + a  # global micro-batch index: same union for any (ws, A)
            nxt = j + 1 if a < A - 1 else (step + 1) * M + rank * A
            b, p_BTVd, valid, noise = prepare(micro[j], p["seed"] * 1_000_003 + j,
                                              micro[nxt] if step + 1 < total or a < A - 1 else None)
            ctx = model.no_sync() if ws > 1 and a < A - 1 else contextlib.nullcontext()
            with ctx:
                loss, st = run(model, b, p_BTVd, valid, noise)
                (loss / A).backward()
            stats[0] += st[0]
            stats[1:] += st[1:]
            loss_sum += loss.detach()
            tokens += b["tokens"]
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), p["grad_clip"]) \
            if p["grad_clip"] > 0 else torch.zeros(())
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        agg = all_sum(torch.cat([stats.flatten(), loss_sum[None], tokens[None]]), ws)
        K = cfg.ttt_steps
        lk = (agg[:K] / M).tolist()
        ak = (agg[K:2 * K] / agg[2 * K:3 * K].clamp(min=1)).tolist()
        if p["sleep_per_step"]:
            time.sleep(p["sleep_per_step"])
        dt = time.time() - t0
        tokens_seen += int(agg[-1])
        row = {"split": "train", "step": step + 1, "epoch": (step + 1) * M / max(1, len(micro)) * p["epochs"],
               "loss": float(agg[3 * K] / M), "tau": tau_of(ak), "lr": lr, "grad_norm": float(gnorm),
               "tokens": int(agg[-1]), "tok_s": float(agg[-1]) / max(dt, 1e-9),
               "positions": int(agg[2 * K])}
        row.update({f"loss_{k}": v for k, v in enumerate(lk)})
        row.update({f"acc_{k}": v for k, v in enumerate(ak)})
        rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau']:.2f}", refresh=False)
        done = step + 1
        if val_batches and (done % p["val_every"] == 0 or done == total):
            rows.append(validate(done))
        if main and (done % p["checkpoint_every"] == 0) and done < total:
            save_checkpoint(ckpt_dir, done, {
                "digest": digest, "step": done,
                "model": {k: v.detach().cpu() for k, v in drafter.trainable_state_dict().items()},
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": _rng_state(),
                "data_position": {"step": done, "micro_batch": done * M}, "metrics": rows,
            }, int(p["keep_checkpoints"]))
    bar.close()
    pool.shutdown(wait=True)
    elapsed = time.time() - t_start

    summary = {}
    if main:
        import pandas as pd

        save_drafter(out_dir / "drafter.safetensors", drafter, cfg, d2t, t2d)
        io.write_parquet(out_dir / "metrics.parquet", pd.DataFrame(rows))
        last_train = [r for r in rows if r["split"] == "train"][-1]
        last_val = ([r for r in rows if r["split"] == "val"] or [None])[-1]
        summary = {"steps": total, "resumed_from": start, "world_size": ws, "device": device.type,
                   "micro_batches_per_step": M, "train_samples": len(train_idx), "val_samples": len(val_idx),
                   "tokens_this_run": tokens_seen, "seconds_this_run": elapsed,
                   "tok_s": tokens_seen / max(elapsed, 1e-9),
                   "final_train": last_train, "final_val": last_val,
                   "draft_vocab_size": len(d2t), "layer_ids": cfg.layer_ids, "label_check": label_check,
                   "target_digest": identity["digest"], "params": p, "config": json.loads(cfg.to_json()),
                   # checked by export and evaluate (io.verify_recorded)
                   io.DIGESTS_KEY: io.record_digests(out_dir, ["drafter.safetensors"])}
        io.write_json(out_dir / "train_summary.json", summary)
        log.info("trained %d steps: loss %.4f, tau %.3f (val %s)", total, last_train["loss"],
                 last_train["tau"], f"{last_val['tau']:.3f}" if last_val else "n/a")
    if ws > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--hidden", nargs="+", required=True, help="extract/shard_*/index.json files")
    ap.add_argument("--vocab", required=True, help="vocab_map/vocab.safetensors (d2t, t2d)")
    ap.add_argument("--target-identity", required=True, help="the target's identity.json")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--params", default="{}", help="the train section of the config, as JSON")
    ap.add_argument("--log", default=None)
    a = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    io.setup_logging(a.log if rank == 0 else None)
    from eaglet.target import load_identity

    io.verify_recorded(a.vocab, Path(a.vocab).with_name("vocab.json"))  # vocab_map's record
    train(a.hidden, a.vocab, load_identity(a.target_identity), a.out_dir, io.parse_json_arg(a.params, {}))


if __name__ == "__main__":
    main()
