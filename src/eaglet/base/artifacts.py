"""Artifact errors: :class:`ArtifactError` for an input that cannot be trusted, :class:`DiskFullError`
for a write that ran out of space, and where a refused file came from.

Readers raise :class:`ArtifactError` naming the file when an artifact is truncated or corrupt,
so a consuming stage refuses it instead of training on garbage. A file served from Snakemake's
output cache is named with its cache entry and the command that evicts it (``cache_hint``). The
writers of eaglet.base.files raise :class:`DiskFullError` (``disk_full_error``) when the disk is
full.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import sys
from pathlib import Path


class ArtifactError(RuntimeError):
    """An input artifact is missing, truncated, corrupt or inconsistent.

    The message starts with the file it is about (``f"{path}: ..."``, or ``path=`` names it). When
    that file is served from Snakemake's output cache (a link into $SNAKEMAKE_OUTPUT_CACHE, or a
    file in a folder that is one), the message also names the cache entry and the command that
    evicts it (:func:`cache_hint`): rerunning with ``--forcerun`` would restore the same bad entry.
    """

    def __init__(self, msg: str = "", *args, path: str | os.PathLike | None = None):
        if isinstance(msg, str) and msg:
            hint = cache_hint(path if path is not None else _leading_path(msg))
            if hint and hint not in msg:
                msg = f"{msg}\n{hint}"
        super().__init__(msg, *args)


class DiskFullError(OSError):
    """A write failed for lack of space: the message names the file and the free bytes left."""


# --------------------------------------------------------------------------- the output cache
# Snakemake's local output cache (snakemake/caching/local.py) stores a job's outputs as
# <cache>/<provenance hash><ext>: ext is the output's suffix for a one-output job, "_<name><suffix>"
# per named output otherwise (several files sharing the hash), and links the outputs in results/
# to them (a directory output: the folder itself, or a real folder of links to its files).
CACHE_ENV = "SNAKEMAKE_OUTPUT_CACHE"
CACHE_HASH_LEN = 64  # the provenance hash: a sha256 hex digest
_CACHE_NAME = re.compile(rf"[0-9a-f]{{{CACHE_HASH_LEN}}}")
EVICT_SCRIPT = "scripts/cache_evict.py"


def _leading_path(msg: str) -> str | None:
    """The path an ArtifactError message starts with (``"<path>: why"``), if that names a file."""
    head = msg.split(": ", 1)[0]
    if not head or "\n" in head or len(head) > 4096:
        return None
    try:
        return head if os.path.lexists(head) else None
    except (OSError, ValueError):
        return None


def cache_entry(path: str | os.PathLike) -> Path | None:
    """The output-cache entry ``path`` is served from: the cache's top-level file or folder named
    ``<provenance hash><ext>`` that ``path`` (or a folder above it) links into; None for a file that
    is not in the cache. The cache is $SNAKEMAKE_OUTPUT_CACHE when ``path`` resolves under it, else
    the folder holding the first hash-named component of the resolved path (not a Hugging Face
    ``blobs/`` folder, whose files are named by their sha256 too)."""
    try:
        if not os.path.lexists(path):
            return None
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return None
    env = os.environ.get(CACHE_ENV)
    if env:
        root = Path(os.path.realpath(env))
        if real != root and real.is_relative_to(root):
            top = root / real.relative_to(root).parts[0]
            return top if _CACHE_NAME.match(top.name) else None
    for anc in (real, *real.parents):
        if _CACHE_NAME.match(anc.name) and anc.parent.name != "blobs":
            return anc
    return None


def cache_entry_files(entry: str | os.PathLike) -> list[Path]:
    """Every file (or folder) of the cache entry ``entry``: a job's outputs share its hash prefix."""
    entry = Path(entry)
    prefix = entry.name[:CACHE_HASH_LEN]
    return sorted(p for p in entry.parent.iterdir() if p.name.startswith(prefix)) if entry.parent.is_dir() else []


def evict_command(path: str | os.PathLike) -> str:
    """The shell command that evicts the cache entry ``path`` is served from (scripts/cache_evict.py
    with this interpreter), for the working directory the path is relative to (the workflow's)."""
    script = Path(EVICT_SCRIPT)
    if not script.is_file():  # run from elsewhere than the checkout's root: the checkout's script
        repo_script = Path(__file__).resolve().parents[3] / EVICT_SCRIPT
        script = repo_script if repo_script.is_file() else script
    return shlex.join([sys.executable, str(script), str(path)])


def cache_hint(path: str | os.PathLike | None) -> str:
    """For a file served from the output cache: which entry, and the exact command evicting it
    (to run in the current directory); "" otherwise."""
    if path is None:
        return ""
    entry = cache_entry(path)
    if entry is None:
        return ""
    return (f"{path} is served from the Snakemake output cache entry {entry} (rerunning with "
            f"--forcerun restores the same entry); evict it with `{evict_command(path)}` "
            f"(in {Path.cwd()}), then rerun with --cache to recompute it")


# --------------------------------------------------------------------------- a full disk
# How a full disk shows: ENOSPC / EDQUOT from Python, pyarrow and safetensors (whose errors carry
# the OS message, not the errno), and torch.save's zip writer ("unexpected pos N vs M" when a
# write came up short, or "file write failed").
_DISK_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|StorageFull|QuotaExceeded"
                             r"|unexpected pos \d+ vs \d+|file write failed", re.I)


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return bool(_DISK_FULL_TEXT.search(str(e)))  # safetensors' SafetensorError is none of OSError's kin


def _mount_point(path: Path) -> Path:
    path = Path(os.path.realpath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def disk_full_error(path: str | os.PathLike, e: BaseException, written: int | None = None) -> DiskFullError:
    """The error for a write of ``path`` that ran out of space: the file, the free bytes left."""
    path = Path(path)
    folder = path.parent if path.parent.exists() else Path(".")
    try:
        free = f"{shutil.disk_usage(folder).free} bytes free on {_mount_point(folder)}"
    except OSError:
        free = "free space unknown"
    so_far = f" after {written} bytes" if written else ""
    err = DiskFullError(f"{path}: disk is full: writing it failed{so_far} ({free}; {type(e).__name__}: "
                        f"{str(e).strip()}). Free space there (or point the run at a larger disk) and "
                        "rerun: the file was not written, nothing half-written is left")
    err.errno = errno.ENOSPC
    return err
