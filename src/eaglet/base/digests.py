"""Digests and the digests a stage recorded: the sha256 of a file (``file_digest``) or of a JSON-able
value (``digest_of``), the ``{name: sha256}`` a producing stage records in its summary JSON and its
consumer checks (``record_digests``, ``verify_recorded``, ``verify_beside``), and the manifest of a
folder (``folder_manifest``, ``verify_manifest``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from eaglet.base.artifacts import ArtifactError, cache_entry
from eaglet.base.files import json_default, read_json


def file_digest(path: str | os.PathLike, algo: str = "sha256", chunk: int = 1 << 20) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def digest_of(obj: Any) -> str:
    """Stable short digest of a JSON-able value."""
    blob = json.dumps(obj, sort_keys=True, default=json_default).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Recorded digests. Cached outputs live in the between-workflow cache, which Snakemake makes
# world-writable (0666 files): a producing stage records the sha256 of what it wrote in its own
# summary JSON (key "sha256"), and the consuming stage checks it on read, so an artifact altered
# inside the cache is refused, naming the file, instead of trusted.
DIGESTS_KEY = "sha256"
# Files up to this size are re-hashed on every read of a folder manifest (config, tokenizer,
# chat template, small weight shards); bigger ones are checked by size (a 547 GB target cannot be
# re-hashed by every stage that reads it; its weight digest is computed once, by target_model).
FULL_HASH_MAX_BYTES = 64 << 20


def record_digests(folder: str | os.PathLike, names: list[str]) -> dict[str, str]:
    """``{name: sha256}`` of files a stage wrote into ``folder``, for its summary JSON."""
    return {n: file_digest(Path(folder) / n) for n in names}


def verify_recorded(path: str | os.PathLike, record: str | os.PathLike) -> None:
    """Refuse ``path`` unless its sha256 equals the one its producing stage recorded for it in the
    JSON file ``record`` (key "sha256", by file name)."""
    path = Path(path)
    want = (read_json(record).get(DIGESTS_KEY) or {}).get(path.name)
    if want is None:
        raise ArtifactError(f"{path}: no sha256 recorded for it in {record} (written by an older "
                            "eaglet, or altered): rerun the stage that made it")
    if not path.exists():
        raise ArtifactError(f"{path}: missing")
    if file_digest(path) != want:
        raise ArtifactError(f"{path}: sha256 differs from the one recorded in {record} "
                            "(altered or corrupt after its stage wrote it)")


def verify_beside(path: str | os.PathLike, *records: str) -> Path | None:
    """verify_recorded against the first of ``records`` (file names beside ``path``) that exists:
    for an input that is a stage's output in the workflow (which always writes its record) but may
    be a user's own file on the command line. With no record beside it, a file served from the
    output cache is refused (its producer recorded it), any other is read as given (None)."""
    path = Path(path)
    for name in records:
        record = path.with_name(name)
        if record.exists():
            verify_recorded(path, record)
            return record
    if cache_entry(path) is not None:
        raise ArtifactError(f"{path}: no record ({' or '.join(records)}) beside it, yet it is served "
                            "from the output cache: its stage always writes one (altered cache)")
    return None


def visible_files(folder: Path) -> list[Path]:
    """Files under ``folder`` (recursively, links followed), skipping dot-names: Snakemake's
    .snakemake_timestamp and huggingface_hub's .cache/ change without the model changing."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(root) / f for f in sorted(files) if not f.startswith(".")]
    return out


def folder_manifest(folder: str | os.PathLike, hash_file=file_digest) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"?}}`` for every file of a folder: sha256 for files up to
    FULL_HASH_MAX_BYTES, size only for bigger ones (see verify_manifest). ``hash_file``: how a
    file's sha256 is had (eaglet.base.content_digests.DigestCache.file reuses the parse's)."""
    folder = Path(folder)
    out = {}
    for f in visible_files(folder):
        size = f.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= FULL_HASH_MAX_BYTES:
            entry["sha256"] = hash_file(f)
        out[f.relative_to(folder).as_posix()] = entry
    return out


def verify_manifest(folder: str | os.PathLike, manifest: dict[str, dict], record: str | os.PathLike) -> None:
    """Refuse ``folder`` unless it holds exactly the files of ``manifest`` (recorded in ``record``)
    with the recorded sizes, and the recorded sha256 of every file that has one."""
    folder = Path(folder)
    have = {f.relative_to(folder).as_posix(): f for f in visible_files(folder)}
    extra = sorted(set(have) - set(manifest))
    if extra:
        raise ArtifactError(f"{folder / extra[0]}: not in the manifest recorded in {record} (added after "
                            f"the target was identified; {len(extra)} such file(s))")
    for name, want in sorted(manifest.items()):
        f = folder / name
        if name not in have:
            raise ArtifactError(f"{f}: missing (recorded in {record})")
        size = f.stat().st_size
        if size != want["size"]:
            raise ArtifactError(f"{f}: {size} bytes, {record} recorded {want['size']} (altered or truncated)")
        if "sha256" in want and file_digest(f) != want["sha256"]:
            raise ArtifactError(f"{f}: sha256 differs from the one recorded in {record} (altered or corrupt)")
