"""Safetensors files: torch tensors or numpy arrays written atomically, read back refusing a
truncated or corrupt file (:class:`~eaglet.base.artifacts.ArtifactError` naming it)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import atomic_path


def save_tensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Save torch tensors or numpy arrays (made contiguous first) as safetensors, atomically.

    ``safetensors.numpy.save_file`` writes Fortran-ordered arrays wrongly (pandas 3 returns such
    arrays), so every numpy array is made C-contiguous before saving.
    """
    import torch
    from safetensors.torch import save_file

    out = {}
    for k, v in tensors.items():
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        out[k] = v.detach().contiguous().cpu()
    with atomic_path(path) as tmp:
        save_file(out, str(tmp), metadata=metadata)


def load_tensors(path: str | os.PathLike, names: list[str] | None = None, device: str = "cpu") -> dict:
    """Load safetensors as torch tensors; a truncated or corrupt file raises ArtifactError."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            keys = list(f.keys()) if names is None else names
            missing = [k for k in keys if k not in f.keys()]
            if missing:
                raise ArtifactError(f"{path}: missing tensors {missing}")
            return {k: f.get_tensor(k) for k in keys}
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None


def tensor_metadata(path: str | os.PathLike) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None
