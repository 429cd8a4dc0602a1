"""Two runs sharing one Snakemake output cache at the same moment (issue 46).

Snakemake's local cache (snakemake.caching.local.OutputFileCache, 9.27) stores a job's outputs
without asking whether another run stored the same entry meanwhile. Two clones that both missed an
entry both compute it, and the second store then
- moves a folder output *into* the folder the first stored (``shutil.move`` onto an existing
  folder): the entry holds a second copy of the stage's work in a subfolder, and every reader of it
  (the target's manifest, an extraction shard) refuses it or reads a folder that is not what its
  producer recorded;
- replaces a multi-file entry file by file, interleaved with the first run's store, so an entry can
  hold one run's tokens beside the other run's record of them.

Installed by workflow/rules/common.smk, this wraps the cache's ``store`` and ``fetch``: a store holds
an exclusive lock on the cache (``flock`` on its file ``.eaglet-store.lock``: stores move or rename
into the cache, so it is held briefly), a fetch a shared one, so a fetch never sees half an entry. A
store that finds its entry complete gives way: its own outputs are removed and linked to the stored
entry, as a cache hit is, so each entry is stored once and both runs read the same bytes. An
incomplete entry (a store that died half-way, or half an eviction) is removed before the store writes
it whole. The work itself may still run in both clones when both start before either stored it;
nothing is lost or stored twice. A file system without ``flock`` (Lustre mounted without it) gets a
warning and Snakemake's own unlocked store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from pathlib import Path

from snakemake.caching.local import OutputFileCache
from snakemake.logging import logger

# What is wrapped, as Snakemake's local cache names it
WRAPPED = ("store", "fetch")
# The lock's file in the cache folder: a dot-name beside the entries, no output links to it
LOCK_FILE = ".eaglet-store.lock"


@contextlib.contextmanager
def locked(folder: str | os.PathLike, how: int):
    """``flock`` (``fcntl.LOCK_EX`` or ``LOCK_SH``) on the cache folder's LOCK_FILE, made 0666 like
    Snakemake's cache files (the folder's own mode decides who shares it): a file, not the folder,
    as NFS takes an exclusive ``flock`` only on a file open for writing."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's lock file, not writable: a shared lock needs no more
        fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(PermissionError):  # made by another user: theirs to set
            if os.fstat(fd).st_mode & 0o666 != 0o666:
                os.fchmod(fd, 0o666)
        try:
            fcntl.flock(fd, how)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                raise
            _warn_unlocked(folder, e)
        yield
    finally:
        os.close(fd)  # releases the lock


_warned: set[str] = set()


def _warn_unlocked(folder, error: OSError) -> None:
    if str(folder) not in _warned:
        _warned.add(str(folder))
        logger.warning(f"{folder}: no flock on this file system ({error}): runs sharing this output cache at "
                       "the same moment may store an entry twice (eaglet.workflow.shared_cache)")


def remove(path: Path) -> None:
    """A file, a link or a folder, gone (nothing when absent)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def install(cls: type = OutputFileCache) -> None:
    """Wrap ``cls.store`` and ``cls.fetch`` (once per process; the Snakefile is parsed again by each
    job's own Snakemake process, which stores nothing)."""
    if getattr(cls, "_eaglet_shared", False):
        return
    missing = [name for name in (*WRAPPED, "get_outputfiles_and_cachefiles") if not hasattr(cls, name)]
    if missing:
        raise RuntimeError(f"{cls.__module__}.{cls.__name__} has no {missing}: Snakemake's output cache changed "
                           "(pyproject.toml pins the version eaglet.workflow.shared_cache was written for)")
    store, fetch = cls.store, cls.fetch

    async def locked_store(self, job):
        if not os.access(self.path, os.W_OK):  # Snakemake's own error, naming the cache
            return await store(self, job)
        pairs = await self.get_outputfiles_and_cachefiles(job)
        with locked(self.path, fcntl.LOCK_EX):
            if all(entry.exists() for _, entry in pairs):
                logger.info(f"{job.rule.name}: its cache entry was stored meanwhile by another run sharing the "
                            "cache; this run's outputs are replaced by links to it (stored once)")
                for output, _ in pairs:
                    remove(output)
                await fetch(self, job)
                return
            for _, entry in pairs:  # part of an entry, never served (a fetch needs all of it): written anew
                remove(entry)
            await store(self, job)

    async def locked_fetch(self, job):
        with locked(self.path, fcntl.LOCK_SH):
            await fetch(self, job)

    cls.store, cls.fetch = locked_store, locked_fetch
    cls._eaglet_shared = True
