"""The content digest of a user's own file or folder (``prompts.path``, a local ``target.path``, an
evaluation set's ``.parquet``), cheap to ask again: the workflow puts it in the params of the rule
that reads the file at every parse (so a changed content reruns that stage, whatever its mtime),
and the stage's job checks the file against it before reading.

Each file is hashed once per change: ``DigestCache`` keeps ``path -> (size, mtime_ns, inode,
ctime_ns, sha256)`` in a small JSON file (``.snakemake/eaglet-digests.json`` of the workflow
folder), and hashes again only a file whose stat differs. The ctime is in the key because a user
cannot set it back: a rewrite that keeps or restores an older mtime (``cp -p``, ``touch -d``,
``rsync -a``, an unpacked archive) still changes it. A corrupt or unreadable cache is an empty one;
of two processes saving at once (the parse and a job) the last one's file stays whole, and an entry
it lacks is only hashed again.

    cache = DigestCache()                      # .snakemake/eaglet-digests.json under the cwd
    content_digest("data/prompts.jsonl", cache)  # 'sha256:9f86d0...'
    cache.save()
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import file_digest, visible_files

# Under the workflow folder's .snakemake/ (Snakemake's own state): per working folder, never in a
# results folder or the shared output cache.
CACHE_FILE = Path(".snakemake") / "eaglet-digests.json"
_VERSION = 1
# A file whose ctime is this recent is hashed but not cached: the clock's tick can be coarser than a
# nanosecond, and a second rewrite within the same tick (same size, mtime set back) would keep the
# stat of the first (git's "racy" index entries, the same answer).
RACY_NS = 2_000_000_000


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


class DigestCache:
    """sha256 of files by their stat (size, mtime_ns, inode, ctime_ns); ``path=None`` keeps nothing
    on disk (every file is hashed)."""

    def __init__(self, path: str | os.PathLike | None = CACHE_FILE) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, list] = {}
        self.dirty = False
        self.hashed: list[str] = []  # files hashed by this object (new, or their stat changed)
        self.changed: list[str] = []  # of those, the ones whose sha256 differs from the cached one
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                if data.get("version") == _VERSION and isinstance(data.get("files"), dict):
                    self.entries = {k: v for k, v in data["files"].items()
                                    if isinstance(v, list) and len(v) == 5}
            except (OSError, ValueError, AttributeError):
                self.entries = {}  # missing, unreadable or corrupt: recomputed

    def file(self, path: str | os.PathLike) -> str:
        """The sha256 (hex) of one file, from the cache while its stat is unchanged."""
        key = os.path.abspath(path)
        st = os.stat(key)  # follows links: a link pointed elsewhere has another inode
        entry = self.entries.get(key)
        if entry is not None and entry[:4] == _stat_key(st):
            return entry[4]
        sha = file_digest(key)
        # stat again after reading: a file written while it was read is not cached under its new stat
        if _stat_key(os.stat(key)) == _stat_key(st) and time.time_ns() - st.st_ctime_ns > RACY_NS:
            self.entries[key] = [*_stat_key(st), sha]
            self.dirty = True
        self.hashed.append(key)
        if entry is not None and entry[4] != sha:
            self.changed.append(key)
        return sha

    def save(self) -> None:
        """Write the cache atomically (a temporary file renamed over it); a failed write is ignored:
        the next parse hashes again."""
        if self.path is None or not self.dirty:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            with os.fdopen(fd, "w") as fh:
                json.dump({"version": _VERSION, "files": self.entries}, fh)
            os.replace(tmp, self.path)
            tmp, self.dirty = None, False
        except OSError:
            pass
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def content_digest(path: str | os.PathLike, cache: DigestCache) -> str:
    """``sha256:<hex>`` of a file's bytes, or of a folder: its visible files (dot-names skipped,
    links followed, as eaglet.base.digests.visible_files), each by relative name and sha256."""
    p = Path(path)
    if p.is_file():
        return f"sha256:{cache.file(p)}"
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or folder")
    h = hashlib.sha256()
    for f in visible_files(p):
        h.update(f"{f.relative_to(p).as_posix()}\0{cache.file(f)}\n".encode())
    return f"sha256:{h.hexdigest()}"


def verify_content(path: str | os.PathLike, want: str, key: str, cache: DigestCache | None = None) -> None:
    """Refuse ``path`` (the config's ``key``) unless its content digest is ``want``, the one the
    workflow's parse put in the job's params: a file changed between the parse and the job would
    otherwise be read under the old content's cache key."""
    cache = cache if cache is not None else DigestCache()
    before = len(cache.changed)
    have = content_digest(path, cache)
    cache.save()
    if have != want:
        changed = cache.changed[before:]
        which = (f" (changed since it was last hashed: {', '.join(changed[:5])}"
                 f"{' ...' if len(changed) > 5 else ''})" if Path(path).is_dir() and changed else "")
        raise ArtifactError(f"{key}: {path} changed after the workflow was parsed{which}: its content is "
                            f"{have[:23]}..., the parse recorded {want[:23]}... Run snakemake again: the "
                            "stages that read it then rerun on what it holds now")
