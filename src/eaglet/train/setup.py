"""The trainer's set-up (eaglet.train.train): the target's head over the draft vocab (with the stored
full-vocabulary statistics) and the proof of the labels against the real model, the vocab check,
processes, data, drafter, the data plan with its optimizer and schedule, and the resume from a
checkpoint of this very run (run_identity). What set-up builds, the loop (eaglet.train.loop) reads:
one ``TrainRun``.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import digest_of, file_digest
from eaglet.base.tensors import load_tensors
from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
from eaglet.drafter.ttt import TTTObjective, drafter_options, freeze_head
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.planner.plan import TRAIN_NOT_DEFINING, bf16_autocast
from eaglet.target.head import TargetHead
from eaglet.target.load import load_target_embedding
from eaglet.train import init_from, labels
from eaglet.train.data import plan_batches, plan_micro_batches
from eaglet.train.state import dist_setup, load_latest_checkpoint, restore_rng_state

log = logging.getLogger("eaglet.train.train")


# --------------------------------------------------------------------------- target logits
class DraftLabels:
    """The target's next-token distribution over the draft vocab, from stored pre-norm final
    states, computed by the target's own modules (eaglet.target.head), and what follows from the
    target's whole vocabulary, read from the statistics extraction stored beside the states
    (``target_lse``, ``target_top1``; online training computes them in its own forward): whether
    the target's greedy token is in the draft vocab (``greedy_rows``: oov_rule greedy) and the
    target's probability mass on the draft vocab (the acceptance figures: vLLM's rejection sampler
    sees the unrenormalised target probabilities). Only the draft rows of the head are multiplied:
    no call reads the head's other rows."""

    def __init__(self, identity: dict, t2d: torch.Tensor, final_is_prenorm: bool, greedy_rows: bool, device):
        if not final_is_prenorm:
            raise ArtifactError("hidden states store the final state after the norm; eaglet.features.extract "
                                "stores it before (re-extract)")
        self.head = TargetHead(identity["path"], rows=t2d.nonzero().squeeze(1), device=device,
                               trust_remote_code=bool(identity.get("trust_remote_code", False)))
        self.w_VdH = self.head.row_linear.weight.detach()
        self.greedy_rows, self.full = greedy_rows, bool(t2d.all())
        self.t2d = t2d.to(self.head.device)

    @torch.no_grad()
    def __call__(self, final_BTH: torch.Tensor, lse_BT: torch.Tensor | None = None,
                 top1_BT: torch.Tensor | None = None, mass: bool = False):
        """-> (p_BTVd float32, greedy_in_draft_vocab_BT bool or None, mass_BT float32 or None).
        ``lse_BT``/``top1_BT``: the target's log-sum-exp and argmax over its whole vocabulary at
        each position (the batch's ``target_lse``/``target_top1``), needed for the mass (``mass``)
        and the greedy flag (greedy_rows) unless the draft vocab is the whole vocab. mass_BT: the
        target's probability of the draft vocab, exp(lse_draft - lse), at most 1."""
        logits = self.head.logits(self.head.normed(final_BTH), normed=True)
        inv = mass_BT = None
        if (mass or self.greedy_rows) and not self.full and (lse_BT is None or top1_BT is None):
            raise ValueError("DraftLabels: the draft vocab's mass and the greedy flag need the target's "
                             "full-vocabulary statistics (target_lse, target_top1)")
        if self.greedy_rows:
            inv = torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device) if self.full \
                else self.t2d[top1_BT.to(logits.device)]
        if mass:
            mass_BT = torch.ones(logits.shape[:-1], device=logits.device) if self.full else \
                torch.exp(torch.logsumexp(logits, -1) - lse_BT.to(logits.device)).clamp(max=1.0)
        return torch.softmax(logits, -1), inv, mass_BT


def prove_labels(head: DraftLabels, ds: HiddenStateDataset, p: dict) -> dict:
    """The reconstructed labels against the real model's top-1 tokens recorded by extraction;
    raises LabelMismatch on disagreement, and when the check cannot run unless
    ``accept_unchecked_labels`` (a check that did not run is not a pass)."""
    where = {s: i for i, s in enumerate(ds.ids)}
    final_of = getattr(ds, "reference_final", None) or (lambda sid: ds.sample(where[sid])["final"])
    rec = labels.check_against_reference(head.head, ds.label_references, final_of,
                                         ds.meta["dtype"], float(p["label_min_agreement"]))
    if rec["ok"] is None and not p["accept_unchecked_labels"]:
        raise labels.LabelMismatch(f"the label check did not run ({rec['reason']}): the hidden states hold no "
                                   "real-model references (re-extract with this eaglet), or set "
                                   "train.accept_unchecked_labels: true to train unchecked")
    return rec


# --------------------------------------------------------------------------- the run's set-up
def lr_lambda_for(total: int, warmup: int):
    def f(step: int) -> float:  # linear warmup, then cosine to zero
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f


@dataclass
class TrainRun:
    """What set-up builds and the loop reads: settings, data, model, optimizer, resume state."""
    p: dict
    out_dir: Path
    rank: int
    ws: int
    device: torch.device
    ds: HiddenStateDataset
    d2t: torch.Tensor
    t2d: torch.Tensor
    cfg: DrafterConfig
    head: DraftLabels
    label_check: dict
    drafter: Eagle3Drafter
    objective: TTTObjective
    model: nn.Module
    micro: list = field(default_factory=list)
    train_idx: list = field(default_factory=list)
    val_idx: list = field(default_factory=list)
    val_ids: set | None = None  # validation samples by id when stores are given for validation only
    val_batches: list = field(default_factory=list)
    A: int = 1
    M: int = 1
    total: int = 0
    opt: torch.optim.Optimizer | None = None
    sched: torch.optim.lr_scheduler.LRScheduler | None = None
    ckpt_dir: Path | None = None
    data_identity: dict = field(default_factory=dict)  # what the samples are (data_identity)
    identity: dict = field(default_factory=dict)  # what defines this run's checkpoints (run_identity)
    digest: str = ""
    start: int = 0
    rows: list = field(default_factory=list)
    best: dict | None = None  # the validation pass with the best chain τ: {"step", "chain_tau", "model"}
    # step -> [[accepted, rounds] at k = K] per validation sequence, in val_batches order
    val_seq: dict = field(default_factory=dict)
    # train.init_from: the published drafter it started from and what its check found (eaglet.train.init_from)
    init: dict | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0


def check_vocab(vocab: str, identity: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the vocab map, checked against the target."""
    vt = load_tensors(vocab, ["d2t", "t2d"])
    d2t, t2d = vt["d2t"].long(), vt["t2d"].bool()
    if len(t2d) != identity["vocab_size"] or int(t2d.sum()) != len(d2t):
        raise ArtifactError(f"{vocab}: t2d has {len(t2d)} entries ({int(t2d.sum())} set), target vocab "
                            f"{identity['vocab_size']}, d2t {len(d2t)}")
    if not torch.equal(t2d.nonzero().squeeze(1), torch.arange(len(d2t)) + d2t):
        raise ArtifactError(f"{vocab}: nonzero(t2d) != arange(V_d) + d2t")
    return d2t, t2d


def open_validation(hidden: list[str], val_hidden: list[str]) -> tuple[HiddenStateDataset, set[str]]:
    """The training stores and the validation-only stores as one dataset, and the validation ids.
    An id in both (trained on and scored) or twice among the validation stores is refused."""
    ds = HiddenStateDataset(list(hidden) + list(val_hidden), verify="sha")
    val = HiddenStateDataset(list(val_hidden), verify="header").ids  # the last len(val) ids of ds
    val_ids = set(val)
    bad = sorted(set(ds.ids[:len(ds.ids) - len(val)]) & val_ids)
    if len(val_ids) != len(val):
        bad += sorted(i for i, n in Counter(val).items() if n > 1)
    if bad:
        raise ArtifactError(f"validation stores {val_hidden}: sample ids also in the training stores or "
                            f"repeated, e.g. {bad[:5]}")
    return ds, val_ids


def setup(hidden: list[str], vocab: str, identity: dict, out_dir: Path, p: dict,
          dataset: HiddenStateDataset | None, online: dict | None = None,
          val_hidden: list[str] | None = None) -> TrainRun:
    """Processes, data (stored, or the target itself when online), labels, drafter (DDP-wrapped on
    several ranks). ``val_hidden``: stores used only for validation (stored states only)."""
    rank, ws, device = dist_setup(int(p["gpus"]))
    val_ids = None
    if val_hidden and (dataset is not None or online):
        raise ValueError("train: validation stores (val_hidden) need stored training states")
    if dataset is not None:
        ds = dataset
    elif online:
        from eaglet.train.online import open_source

        ds = open_source(online, identity, device, int(p["token_budget"]))
    elif val_hidden:
        ds, val_ids = open_validation(hidden, val_hidden)
    else:
        # Opening checks headers and sizes only; each rank hashes a chunk against its index when it
        # first reads it, so no rank stalls the others' DDP init hashing terabytes (issue 14).
        ds = HiddenStateDataset(hidden, verify="sha")
    torch.manual_seed(p["seed"])  # after loading a target (online): the run's draws start here either way
    random.seed(p["seed"])
    meta = ds.meta
    if meta["target_digest"] != identity["digest"]:
        raise ArtifactError(f"{hidden[0] if hidden else 'hidden states'}: extracted from target "
                            f"{meta['target_digest'][:12]}, identity says {identity['digest'][:12]}")
    d2t, t2d = check_vocab(vocab, identity)
    cfg = DrafterConfig.from_identity(identity, len(d2t), meta["layer_ids"], ttt_steps=int(p["ttt_steps"]),
                                      **drafter_options(p))
    start = init_from.open_checked(p["init_from"], cfg, identity) if p["init_from"] else None  # before any step
    if start is not None:
        cfg = start.cfg
    head = DraftLabels(identity, t2d, bool(meta["final_is_prenorm"]), p["oov_rule"] == "greedy", device)
    label_check = prove_labels(head, ds, p)
    if rank == 0:
        log.info("labels: top-1 agreement with the real model %s on %d of %d recorded positions (norm %s)",
                 f"{label_check['agreement']:.4f}" if label_check["ok"] is not None else "NOT RUN",
                 label_check["judged"], label_check["positions"], label_check["norm_class"])
    drafter = Eagle3Drafter(cfg, load_target_embedding(identity["path"]))
    if p["lm_head_init"] == "target":
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head.w_VdH.cpu())
    init = init_from.load_into(drafter, start, d2t, float(p["init_min_overlap"])) if start is not None else None
    freeze_head(drafter, p)
    drafter.to(device)
    # the memory plan's choice (train.ttt_attention resolved at parse time; auto here, when called
    # directly, is the recompute the plan takes without a memory figure)
    recompute = p["ttt_attention"] != "saved"
    if rank == 0:
        log.info("TTT attention: %s", "recompute (each query chunk in backward)" if recompute else
                 "saved (every query chunk's softmax weights kept for backward)")
    objective = TTTObjective(drafter, cfg.ttt_steps, float(p["gamma"]), p["loss"], float(p["kl_scale"]),
                             float(p["kl_decay"]), recompute=recompute)
    model = objective
    if ws > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None,
                    broadcast_buffers=False)
    return TrainRun(p=p, out_dir=out_dir, rank=rank, ws=ws, device=device, ds=ds, d2t=d2t, t2d=t2d, cfg=cfg,
                head=head, label_check=label_check, drafter=drafter, objective=objective, model=model,
                val_ids=val_ids, data_identity=data_identity(ds, hidden, val_hidden, online), init=init)


def plan_run(r: TrainRun, hidden: list[str]) -> None:
    """The data plan (a pure function of (data, params), so the step number is the data position),
    the optimizer and its schedule."""
    p = r.p
    lengths = list(r.ds.num_tokens)
    r.micro, r.train_idx, r.val_idx = plan_micro_batches(r.ds.ids, lengths, p, r.val_ids)
    r.A = int(p["grad_accum"])
    r.M = r.A * r.ws
    if not r.train_idx:
        raise ArtifactError(f"{hidden}: no training samples left after the validation split")
    r.total = len(r.micro) // r.M
    if p["max_steps"] is not None:
        r.total = min(r.total, int(p["max_steps"]))
    if r.total < 1:
        raise ValueError(f"train: {len(r.micro)} micro-batches are fewer than one step of {r.M}; "
                         "lower train.token_budget or add data")
    r.val_batches = plan_batches(r.val_idx, lengths, p["token_budget"], p["seed"], 0, shuffle=False)
    if p["val_max_batches"] is not None:
        r.val_batches = r.val_batches[:int(p["val_max_batches"])]
    r.opt = torch.optim.AdamW([q for q in r.drafter.parameters() if q.requires_grad], lr=p["lr"],
                              weight_decay=p["weight_decay"], betas=(0.9, 0.95))
    r.sched = torch.optim.lr_scheduler.LambdaLR(r.opt, lr_lambda_for(r.total, math.ceil(p["warmup_ratio"] * r.total)))


# What a train param not in a checkpoint's identity leaves alone: plan.TRAIN_NOT_DEFINING, and gpus
# (the world size and device it gives are in the identity themselves). Every other key is in,
# max_steps and epochs too: the plan (which micro-batches each step reads) follows epochs, and the
# warmup + cosine schedule (lr_lambda_for) is a function of the total steps, so a run whose epochs or
# max_steps are raised is another run (each step at another learning rate), not a continuation.
NOT_DEFINING = (*TRAIN_NOT_DEFINING, "gpus")


def _index_file(path) -> Path:
    path = Path(path)
    return path / "index.json" if path.is_dir() else path


def data_identity(ds, hidden: list[str], val_hidden: list[str] | None, online: dict | None) -> dict:
    """What the trainer's samples are, exactly and cheaply: the aux layer ids and storage dtype of
    the states, the samples (ids, lengths) in the order read; offline the sha256 of each store's
    index.json (header, samples and every chunk's sha256: the exact bytes, with no chunk read),
    validation-only stores apart; online the tokens file's sha256 and how the target computes the
    states in this job (dtype, device, trust_remote_code; eaglet.train.online)."""
    out = {"layer_ids": [int(i) for i in ds.meta["layer_ids"]], "storage_dtype": str(ds.meta["dtype"]),
           "samples": digest_of([list(ds.ids), [int(n) for n in ds.num_tokens]])}
    if online:
        out["online"] = {"tokens": file_digest(online["tokens"]),
                         "target_load": dict(getattr(ds, "target_load", None) or {})}
    else:
        out["stores"] = [file_digest(_index_file(h)) for h in hidden]
        out["val_stores"] = [file_digest(_index_file(h)) for h in val_hidden or []]
    return out


def run_identity(r: TrainRun, vocab: str, identity: dict) -> dict:
    """Everything that defines a run's checkpoints: a checkpoint is resumed only when its recorded
    identity equals this (eaglet.train.state.load_latest_checkpoint). train.init_from by the drafter's
    content digest, not its path (and absent without it: older checkpoints stay this run's)."""
    ident = {"format": 2, "target": identity["digest"], "vocab": file_digest(vocab),
             "layer_ids": r.data_identity["layer_ids"],
             "hidden_states": {k: v for k, v in r.data_identity.items() if k != "layer_ids"},
             "params": {k: v for k, v in r.p.items() if k not in NOT_DEFINING and k != "init_from"},
             "world": r.ws, "device": r.device.type,
             "bf16_autocast": bf16_autocast(r.p["autocast"], r.device.type == "cuda")}
    if r.init is not None:
        ident["init_from"] = r.init["digest"]
    return json.loads(json.dumps(ident, default=str))  # plain values, as a checkpoint gives them back


def resume(r: TrainRun, vocab: str, identity: dict) -> None:
    """Restart from the newest checkpoint of this very run (run_identity), if any; stale ones are
    discarded, each with a log line naming what differs."""
    r.ckpt_dir = r.out_dir / "checkpoints"
    r.identity = run_identity(r, vocab, identity)
    r.digest = digest_of(r.identity)
    state = load_latest_checkpoint(r.ckpt_dir, r.identity) if r.ckpt_dir.exists() else None
    if state is None:
        return
    # the checkpoint's weights over train.init_from's: the same start (its digest is in the identity)
    r.drafter.load_state_dict({**state["model"], "embed_tokens.weight": r.drafter.embed_tokens.weight})
    r.opt.load_state_dict(state["optimizer"])
    r.sched.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"])
    r.start, r.rows, r.best = int(state["step"]), list(state["metrics"]), state.get("best")
    if r.main:
        log.info("resuming from %s/step_%08d.pt%s", r.ckpt_dir, r.start,
                 " (its weights replace train.init_from's: the run started from that drafter)" if r.init else "")
