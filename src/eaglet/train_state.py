"""The trainer's processes and persistent state (eaglet.train): DDP set-up, checkpoints written
atomically and read back only for the same configuration, RNG state."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import torch

from eaglet import io

log = logging.getLogger("eaglet.train")


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
