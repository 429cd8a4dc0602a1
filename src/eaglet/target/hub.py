"""A target named by its hub id: ``target.path: ORG/NAME`` that is not a local folder is a model on
the Hugging Face Hub, read through huggingface_hub's own cache at ``target.revision`` (a branch, a
tag or a commit; default main).

    snap = resolve("HuggingFaceTB/SmolLM2-135M-Instruct", "main")   # Snapshot: commit, folder, ...
    snap.folder    # the cache's snapshot folder, read in place like a local target.path
    snap.key()     # {"commit": ..., "files": ...}: what keys target_model, never the name

One function for the workflow's parse (eaglet.workflow.resolve, which pins the commit it found
for the job) and the target_model stage (eaglet.data.target_model). The cache folder is the
library's (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub) and
``HF_HUB_OFFLINE=1`` keeps it off the network: a model missing from the cache then stops the parse
with one message naming the repo, the revision, the folder looked in and the command that fills it.
The cache's layout (refs, snapshots, blobs) is huggingface_hub's business: ``snapshot_download``
finds the snapshot; its files link to the blobs they are stored as, whose names are the files'
content hashes (sha256 for LFS files such as weights, the git blob id for the others). Only that
snapshot folder is read (``scan_cache_dir`` read every repo of the cache, at each parse and again in
the job).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from eaglet.base import schema

# ORG/NAME as the hub spells a model id (huggingface_hub's validate_repo_id, less its length rules)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class HubTargetError(ValueError):
    """The hub target cannot be read: the message names the repo, the revision, the cache folder
    and what to do (a ValueError, as every parse-time refusal of the workflow)."""


@dataclass(frozen=True)
class Snapshot:
    """A hub target resolved in the cache: the commit ``revision`` names and its snapshot folder."""

    repo_id: str
    revision: str  # as asked (target.revision): a branch, a tag or a commit
    commit: str  # the commit it resolved to
    folder: Path  # the cache's snapshot folder of that commit (files linked to the cache's blobs)
    cache: Path  # the hub cache folder looked in
    files: tuple[tuple[str, str, int], ...]  # (path in the repo, blob name = content hash, size)

    def key(self) -> dict:
        """What defines the target: the commit and the files' content hashes (the blob names the
        cache stores them under), never the repo's or the ref's name: another ref naming the same
        commit gives the same key, another revision another key."""
        listing = json.dumps([list(f) for f in self.files])
        total = sum(size for _, _, size in self.files)
        return {"commit": self.commit,
                "files": f"{len(self.files)} files, {total} bytes, content hashes "
                         f"{hashlib.sha256(listing.encode()).hexdigest()[:16]}"}

    def record(self) -> dict:
        """What identity.json and the run's resolved record keep of it."""
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
                "folder": str(self.folder), "cache": str(self.cache)}


def hub_id(path: str | None, workdir: str | Path = ".") -> str | None:
    """``target.path``'s hub id, or None: a value of the form ORG/NAME that is not an existing file
    or folder (relative to the workflow folder ``workdir``) names a hub model; anything else is a
    local path (read as such, and refused as such when it is missing)."""
    if not path or not HUB_ID.fullmatch(path) or (Path(workdir) / path).exists():
        return None
    return path


def cache_folder() -> Path:
    """The hub cache folder huggingface_hub uses, read from the environment now (the library reads
    it once, when imported): HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub (~/.cache/huggingface/hub)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    folder = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(folder))).absolute()


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, as huggingface_hub reads it."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ENV_VARS_TRUE_VALUES


def fill_command(repo_id: str, revision: str) -> str:
    """The command that puts ``revision`` of ``repo_id`` in the cache (huggingface_hub's CLI)."""
    return f"HF_HUB_OFFLINE=0 hf download {repo_id} --revision {revision}"


def missing_message(repo_id: str, revision: str, cache: Path, why: str) -> str:
    return (f"target.path {repo_id!r} is not a local folder, so it names a model on the Hugging Face Hub, and "
            f"revision {revision!r} (target.revision) of {repo_id} is not in the hub cache {cache} ({why}). "
            f"Fill the cache first: `{fill_command(repo_id, revision)}` (with this HF_HUB_CACHE / HF_HOME), "
            "or set target.path to a local checkpoint folder")


def resolve(repo_id: str, revision: str) -> Snapshot:
    """``revision`` of the hub model ``repo_id`` in the hub cache (downloaded into it unless
    HF_HUB_OFFLINE is set). Raises HubTargetError, naming the repo, the revision, the cache folder
    and the command that fills it, when the cache lacks it offline or the hub cannot give it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
    )

    cache, off = cache_folder(), offline()
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=off))
    except IncompleteSnapshotError as e:
        raise HubTargetError(missing_message(repo_id, revision, cache, f"a partial download: {e}")) from None
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set: nothing is downloaded" if off else f"the hub could not be reached: {e}"
        raise HubTargetError(missing_message(repo_id, revision, cache, why)) from None
    except HfHubHTTPError as e:  # repository or revision not found, gated, unauthorised
        raise HubTargetError(f"target.path {repo_id!r} (revision {revision!r}, target.revision): the hub refused "
                             f"it: {str(e).splitlines()[0]}") from None
    files = snapshot_files(folder)
    names = {name for name, _, _ in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") and "/" not in n for n in names):
        raise HubTargetError(missing_message(
            repo_id, revision, cache, f"its snapshot {folder} has no config.json and *.safetensors "
            "weights: a partial download, or a repository that is no transformers checkpoint"))
    # the snapshot folder is named by its commit (huggingface_hub's layout: snapshots/<commit>)
    return Snapshot(repo_id, revision, folder.name, folder, cache, files)


def snapshot_files(folder: Path) -> tuple[tuple[str, str, int], ...]:
    """``(path in the repo, blob name, size)`` of each file of a snapshot folder, as huggingface_hub's
    own scan reads them: the blob is where the file's link resolves to, named by the content hash."""
    return tuple(sorted((f.relative_to(folder).as_posix(), Path(os.path.realpath(f)).name, f.stat().st_size)
                        for f in folder.rglob("*") if f.is_file()))


def target_snapshot(target: Mapping, workdir: str | Path = ".") -> Snapshot | None:
    """The hub snapshot a target section names, resolved at ``target.revision``: ``target.path`` a hub
    id (hub_id) and no ``target.tiny``; None for any other target. The one answer for the workflow's
    parse (eaglet.workflow.resolve) and the target_model job (eaglet.data.target_model)."""
    path = target.get("path")
    repo = hub_id(path, workdir) if path and target.get("tiny") is None else None
    return resolve(repo, target.get("revision") or schema.default("target.revision")) if repo else None
