"""The trainer's loop (eaglet.train.train): micro-batches read one ahead with their targets, one optimizer
step, the validation pass with its exact greedy-chain τ, and what is due after a step (validation,
best-weights bookkeeping, the checkpoint). It reads the ``TrainRun`` that eaglet.train.setup builds.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from eaglet.drafter.ttt import (
    LK,
    chain_counts,
    chain_positions,
    expected_counts_BT,
    is_better,
    tf_tau,
    valid_positions,
)
from eaglet.planner.plan import bf16_autocast
from eaglet.train.data import collate
from eaglet.train.setup import TrainRun
from eaglet.train.state import all_sum, rng_state, save_checkpoint


class Batches:
    """Micro-batches on the device with their targets. Reading + collating runs one micro-batch
    ahead in a thread (the only thread touching the dataset)."""

    def __init__(self, r: TrainRun):
        self.r = r
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-data")
        self.pending: dict[tuple, Future] = {}
        self.t2d = r.t2d.to(r.device)

    def targets(self, b: dict, mass: bool):
        """r.head's (p_BTVd, inv_BT or None, mass_BT or None) for the micro-batch ``b``: the draft
        rows multiplied here, the rest read from the batch's full-vocabulary statistics."""
        return self.r.head(b["final"], b.get("target_lse"), b.get("target_top1"), mass)

    def _fetch(self, batch_idx: list[int]) -> Future:
        ds = self.r.ds
        if hasattr(ds, "collate"):  # online: one target forward per micro-batch (eaglet.train.online)
            return self.pool.submit(ds.collate, batch_idx)
        return self.pool.submit(lambda: collate([ds.sample(i) for i in batch_idx], "cpu"))

    def prepare(self, batch_idx: list[int], gen_seed: int | None, ahead: list[int] | None = None,
                mass: bool = False):
        """-> (batch, p_BTVd, valid_BT, noise or None, mass_BT or None); starts reading ``ahead``.
        ``mass``: also the target's probability of the draft vocab (the acceptance figures)."""
        r = self.r
        fut = self.pending.pop(tuple(batch_idx), None) or self._fetch(batch_idx)
        if ahead is not None:
            self.pending[tuple(ahead)] = self._fetch(ahead)
        b = {k: v.to(r.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in fut.result().items()}
        p_BTVd, inv, mass_BT = self.targets(b, mass)
        noise = None
        if gen_seed is not None and r.p["noise_std"] > 0:
            gen = torch.Generator(device=r.device).manual_seed(gen_seed)
            noise = torch.randn(b["aux"].shape, generator=gen, device=r.device) * r.p["noise_std"]
        return b, p_BTVd, valid_positions(b, self.t2d, inv), noise, mass_BT

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def autocast_on(setting: str, device: torch.device) -> bool:
    """train.autocast resolved for a device (eaglet.planner.plan.bf16_autocast: "auto" = on CUDA and on a
    CPU with bf16 units)."""
    return bf16_autocast(setting, device.type == "cuda")


def _forward(r: TrainRun, m, b, p_BTVd, valid, noise, chain_BT=None, mass_BT=None, counted_only=False):
    with torch.autocast(r.device.type, dtype=torch.bfloat16, enabled=autocast_on(r.p["autocast"], r.device)):
        return m(b["x"], b["aux"], p_BTVd, valid, noise, chain_BT, mass_BT, counted_only)


# The validation τ that selects the kept weights, by train.select_temperature
SELECT_KEY = {0.0: "chain_tau", 1.0: "exp_tau"}


def validate(r: TrainRun, batches: Batches, step: int) -> dict:
    """One pass over the held-out micro-batches (split over the ranks): the validation row."""
    K = r.cfg.ttt_steps
    r.objective.eval()
    acc = torch.zeros(3, K, device=r.device)
    ch = torch.zeros(K, 2, dtype=torch.float64)  # chain: accepted, rounds per k
    first = [0]  # each validation batch's first row among all validation sequences
    for vb in r.val_batches:
        first.append(first[-1] + len(vb))
    seq = torch.zeros(first[-1], 2, dtype=torch.float64)
    ex = torch.zeros(K, 2, dtype=torch.float64, device=r.device)  # T = 1: Σ expected accepted, starts per k
    al = torch.zeros(K, 2, dtype=torch.float64, device=r.device)  # Σ α, positions per draft step
    d2t_dev = r.d2t.to(r.device)
    with torch.no_grad():
        for bi in range(r.rank, len(r.val_batches), r.ws):
            b, p_BTVd, valid, _, mass = batches.prepare(r.val_batches[bi], None, mass=True)
            _, st, hits, alpha = _forward(r, r.objective, b, p_BTVd, valid, None,
                                          chain_positions(b, valid, p_BTVd, d2t_dev), mass)
            acc[0] += st[0] * st[2]  # token-weighted over the whole held-out set
            acc[1:] += st[1:]
            per: list = []
            ch += chain_counts(hits.cpu(), b["mask"].cpu(), per)
            seq[first[bi]:first[bi + 1]] = torch.tensor(per, dtype=torch.float64)
            ex += expected_counts_BT(alpha, b["mask"])
            for k in range(K):  # α of draft step k+1 where its drafted token is an assistant token
                m = b["mask"][:, 2 + k:].bool()
                al[k, 0] += alpha[:, :m.shape[1], k][m].double().sum()
                al[k, 1] += m.sum()
    acc = all_sum(acc, r.ws)
    ch = all_sum(ch.to(r.device), r.ws).cpu()
    ex, al = all_sum(ex, r.ws).cpu(), all_sum(al, r.ws).cpu()
    r.val_seq[step] = all_sum(seq.to(r.device), r.ws).cpu().tolist()
    r.objective.train()
    cnt = acc[2].clamp(min=1)
    lk, ak = (acc[0] / cnt).tolist(), (acc[1] / cnt).tolist()
    ctau = [1 + float(a / n) if n > 0 else None for a, n in ch.tolist()]
    etau = [1 + float(a / n) if n > 0 else None for a, n in ex.tolist()]
    row = {"split": "val", "step": step, "loss": sum(r.p["gamma"] ** k * v for k, v in enumerate(lk)),
           "chain_tau": ctau[-1], "exp_tau": etau[-1], "tf_tau": tf_tau(ak), "positions": int(acc[2, 0]),
           "chain_rounds": int(ch[-1, 1])}
    row.update({f"chain_tau_{k + 1}": v for k, v in enumerate(ctau)})
    row.update({f"exp_tau_{k + 1}": v for k, v in enumerate(etau)})
    row.update({f"alpha_{k}": float(a / n) if n > 0 else None for k, (a, n) in enumerate(al.tolist())})
    row.update({f"loss_{k}": v for k, v in enumerate(lk)})
    row.update({f"tf_acc_{k}": v for k, v in enumerate(ak)})
    return row


def train_step(r: TrainRun, batches: Batches, step: int) -> dict:
    """One optimizer step over this rank's A micro-batches of global step ``step``: its train row."""
    p, A, M, K = r.p, r.A, r.M, r.cfg.ttt_steps
    t0 = time.time()
    r.opt.zero_grad(set_to_none=True)
    stats = torch.zeros(3, K, device=r.device)
    loss_sum = torch.zeros((), device=r.device)
    tokens = torch.zeros((), device=r.device)
    for a in range(A):
        j = step * M + r.rank * A + a  # global micro-batch index: same union for any (ws, A)
        nxt = j + 1 if a < A - 1 else (step + 1) * M + r.rank * A
        b, p_BTVd, valid, noise, mass = batches.prepare(
            r.micro[j], p["seed"] * 1_000_003 + j, r.micro[nxt] if step + 1 < r.total or a < A - 1 else None,
            mass=p["loss"] in LK)
        ctx = r.model.no_sync() if r.ws > 1 and a < A - 1 else contextlib.nullcontext()
        with ctx:
            # the drafter's head and softmax at the counted positions only (TTTObjective.counted_only)
            loss, st, _, _ = _forward(r, r.model, b, p_BTVd, valid, noise, mass_BT=mass, counted_only=True)
            (loss / A).backward()
        stats[0] += st[0]
        stats[1:] += st[1:]
        loss_sum += loss.detach()
        tokens += b["tokens"]
    gnorm = torch.nn.utils.clip_grad_norm_(r.drafter.parameters(), p["grad_clip"]) \
        if p["grad_clip"] > 0 else torch.zeros(())
    lr = r.sched.get_last_lr()[0]
    r.opt.step()
    r.sched.step()
    agg = all_sum(torch.cat([stats.flatten(), loss_sum[None], tokens[None]]), r.ws)
    lk = (agg[:K] / M).tolist()
    ak = (agg[K:2 * K] / agg[2 * K:3 * K].clamp(min=1)).tolist()
    dt = time.time() - t0
    row = {"split": "train", "step": step + 1, "epoch": (step + 1) * M / max(1, len(r.micro)) * p["epochs"],
           "loss": float(agg[3 * K] / M), "tf_tau": tf_tau(ak), "lr": lr, "grad_norm": float(gnorm),
           "tokens": int(agg[-1]), "tok_s": float(agg[-1]) / max(dt, 1e-9),
           "positions": int(agg[2 * K])}
    row.update({f"loss_{k}": v for k, v in enumerate(lk)})
    row.update({f"tf_acc_{k}": v for k, v in enumerate(ak)})
    return row


def validate_and_keep(r: TrainRun, batches: Batches, done: int) -> None:
    """A validation pass after step ``done`` (0: before any step, the weights of train.init_from),
    its row appended, and its weights kept when they are the best so far."""
    r.rows.append(validate(r, batches, done))
    key = SELECT_KEY[float(r.p["select_temperature"])]
    if is_better(r.rows[-1], r.best, key):
        r.best = {"step": done, "by": key, "tau": r.rows[-1][key], "chain_tau": r.rows[-1]["chain_tau"],
                  "chain_by_sequence": r.val_seq[done],
                  "model": {k: v.detach().cpu().clone() for k, v in r.drafter.trainable_state_dict().items()}}


def after_step(r: TrainRun, batches: Batches, done: int) -> None:
    """Validation (and best-weights bookkeeping) and the checkpoint due after step ``done``."""
    p = r.p
    if r.val_batches and (done % p["val_every"] == 0 or done == r.total):
        validate_and_keep(r, batches, done)
    if r.main and (done % p["checkpoint_every"] == 0) and done < r.total:
        save_checkpoint(r.ckpt_dir, done, {
            "digest": r.digest, "identity": r.identity, "step": done,
            "model": {k: v.detach().cpu() for k, v in r.drafter.trainable_state_dict().items()},
            "optimizer": r.opt.state_dict(), "scheduler": r.sched.state_dict(), "rng": rng_state(),
            "data_position": {"step": done, "micro_batch": done * r.M}, "metrics": r.rows, "best": r.best,
        }, int(p["keep_checkpoints"]))
