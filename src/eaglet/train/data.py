"""The trainer's data plan (eaglet.train.train): the held-out split, micro-batches under a token budget,
and collation. A pure function of (sample ids, lengths, params): the step number is the data
position, whatever the world size, the storage (shards or online) or a resume."""

from __future__ import annotations

import hashlib
import math

import torch


def is_val(sample_id: str, fraction: float) -> bool:
    """Deterministic held-out split by id hash (stable across runs, shards and world sizes)."""
    h = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16)
    return h < fraction * 2**32


def in_fraction(sample_id: str, fraction: float) -> bool:
    """The nested training subsets of the learning curve: a sample is in every fraction at or
    above its own hash (another hash than ``is_val``'s, so the subsets do not follow the split)."""
    if fraction >= 1.0:
        return True
    h = int(hashlib.sha256(b"fraction:" + sample_id.encode()).hexdigest()[:8], 16)
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
           "aux": torch.zeros(B, T, 3, samples[0]["aux"].shape[-1]), "final": torch.zeros(B, T, H),
           "target_lse": torch.zeros(B, T), "target_top1": torch.zeros(B, T, dtype=torch.long)}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        out["x"][b, :n] = s["input_ids"]
        out["mask"][b, :n] = s["loss_mask"].bool()
        out["aux"][b, :n] = s["aux"]
        out["final"][b, :n] = s["final"]
        out["target_lse"][b, :n] = s["target_lse"]
        out["target_top1"][b, :n] = s["target_top1"]
    out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    out["tokens"] = sum(len(s["input_ids"]) for s in samples)
    return out


def plan_micro_batches(ids: list[str], lengths: list[int], p: dict, val_ids: set[str] | None = None):
    """All micro-batches of the run in order (epochs concatenated, a fractional last epoch cut),
    and the train/val sample indices. Step s of a run with M micro-batches per step uses
    micro[s*M:(s+1)*M], whatever the world size: the step number is the data position. The plan
    reads the samples in id order, so it depends on the data, not on where it is stored (shards,
    their order, or the tokens file when the states are computed online). ``val_ids``: the
    validation samples by id (stores given for validation only); ``val_fraction`` then splits
    nothing off the training samples."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if val_ids is None:
        held = [is_val(i, p["val_fraction"]) for i in ids]
    else:
        held = [i in val_ids for i in ids]
    train_idx = [i for i in order if not held[i] and in_fraction(ids[i], p["data_fraction"])]
    val_idx = [i for i in order if held[i]]
    micro: list[list[int]] = []
    for e in range(math.ceil(p["epochs"])):
        eb = plan_batches(train_idx, lengths, p["token_budget"], p["seed"], e)
        micro += eb[:int(len(eb) * min(1.0, p["epochs"] - e))]
    return micro, train_idx, val_idx
