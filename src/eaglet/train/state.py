"""The trainer's processes and persistent state (eaglet.train.train): DDP set-up, checkpoints written
atomically and read back only for the same run (same data, layers, vocab, target and settings), RNG
state."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import torch

from eaglet.base.files import atomic_path
from eaglet.base.settings_files import setting_changes

log = logging.getLogger("eaglet.train.train")


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
    with atomic_path(ckpt_dir / f"step_{step:08d}.pt") as tmp:
        torch.save(state, tmp)
    for old in _ckpt_files(ckpt_dir)[:-max(1, keep)]:
        old.unlink()


def load_latest_checkpoint(ckpt_dir: Path, identity: dict) -> dict | None:
    """Newest checkpoint of this very run: its recorded ``identity`` (eaglet.train.setup.run_identity:
    the data, aux layers, draft vocab, target and every train setting that changes the result)
    equals ``identity``. Any other is stale: removed, with a log line naming each difference (before
    -> after); so is one written before checkpoints recorded an identity. An unreadable one is
    skipped (a kill mid-write)."""
    for f in reversed(_ckpt_files(ckpt_dir)):
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)  # never unpickle objects
        except Exception as e:  # noqa: BLE001 - a corrupt file must not stop training
            log.warning("%s: unreadable checkpoint (%s); ignoring it", f, e)
            continue
        old = state.get("identity")
        if old == identity:
            return state
        why = ("it records no identity of its run (written by an older eaglet)" if old is None
               else "; ".join(setting_changes(old, identity)))
        log.warning("%s: checkpoint of another run, discarding it (not resuming): %s", f, why)
        f.unlink(missing_ok=True)  # missing: another rank of this run removed it first
    return None


def rng_state() -> dict:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def restore_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
