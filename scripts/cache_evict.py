#!/usr/bin/env python3
"""Evict bad entries from Snakemake's between-workflow output cache ($SNAKEMAKE_OUTPUT_CACHE).

    .venv/bin/python scripts/cache_evict.py results/smoke/token_freq/freq.safetensors [PATH ...]

A cached output in results/ (or resources/) is a link into the cache. When a stage refuses such a
file (its sha256 differs from the one its producer recorded), rerunning with --forcerun restores
the same bad entry from the cache. This script resolves each PATH to its cache entry, deletes every
file of that entry (a job with several outputs stores them as several files sharing one hash:
<cache>/<hash>_<output name><suffix>; see snakemake/caching/local.py) and the links in this
workflow's results/ and resources/ that pointed at them (a directory output restored from the
cache is a real folder of links: it goes too), and says what it removed. The next
`snakemake ... --cache` run then finds the outputs missing, recomputes the job and stores a fresh
entry. A PATH that is not in the cache is refused, and nothing is deleted.

Run it in the workflow folder the paths are relative to (the checkout's root for `make run`).
Other workflow folders that restored the same entry keep links to it, now dangling: Snakemake
sees those outputs as missing there and recomputes the job too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglet.base.artifacts import CACHE_ENV, cache_entry, cache_entry_files  # noqa: E402


class NotCached(Exception):
    pass


def entry_of(path: Path) -> Path:
    """The cache entry ``path`` is served from; a real folder restored from the cache (a folder of
    links into one entry) counts as its entry's. Raises NotCached otherwise."""
    if not os.path.lexists(path):
        raise NotCached(f"{path}: no such file or link: nothing deleted")
    entry = cache_entry(path)
    if entry is None and path.is_dir() and not path.is_symlink():
        entries = {cache_entry(c) for c in path.iterdir() if c.is_symlink()}
        entries.discard(None)
        if len(entries) == 1:
            entry = entries.pop()
    if entry is None:
        real = os.path.realpath(path)
        where = "a real file or folder, not a link" if real == os.path.abspath(path) else f"it resolves to {real}"
        env = os.environ.get(CACHE_ENV)
        raise NotCached(f"{path}: not in the Snakemake output cache ({where}"
                        f"{f'; {CACHE_ENV}={env}' if env else ''}): nothing deleted")
    return entry


def workflow_root(path: Path) -> Path:
    """The workflow folder ``path`` belongs to: the nearest folder above it with a Snakefile or a
    .snakemake/ (not following links), else the current directory."""
    for d in Path(os.path.abspath(path)).parents:
        if (d / "Snakefile").is_file() or (d / ".snakemake").is_dir():
            return d
    return Path.cwd()


def links_into(roots: list[Path], files: list[Path]) -> list[tuple[Path, bool]]:
    """Links under ``roots`` (not followed) that resolve to one of ``files`` or into one of them:
    (link, whether it points inside an entry folder, i.e. sits in a folder restored from the cache)."""
    tops = [Path(os.path.realpath(f)) for f in files]
    found, seen = [], set()
    for root in roots:
        for d, dirs, names in os.walk(root):
            for name in [*dirs, *names]:
                p = Path(d) / name
                if not p.is_symlink() or p in seen:
                    continue
                real = Path(os.path.realpath(p))
                for top in tops:
                    if real == top or real.is_relative_to(top):
                        found.append((p, real != top))
                        seen.add(p)
                        break
    return found


def evict(paths: list[Path], dry_run: bool = False) -> dict:
    entries = {}
    for p in paths:  # every path resolved before anything is deleted
        e = entry_of(p)
        entries.setdefault(e, []).append(p)
    removed_entries, removed_links, removed_dirs = [], [], []
    for entry, given in entries.items():
        files = cache_entry_files(entry)
        roots = {workflow_root(p) for p in given}
        scan = sorted({r / sub for r in roots for sub in ("results", "resources") if (r / sub).is_dir()}
                      | {Path(os.path.abspath(p)).parent for p in given})
        links = links_into(scan, files or [entry])
        found = {Path(os.path.abspath(lk)) for lk, _ in links}
        links += [(p, False) for p in given if p.is_symlink() and Path(os.path.abspath(p)) not in found]
        if dry_run:
            removed_entries += files
            removed_links += [lk for lk, _ in links]
            continue
        for f in files:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f)
            else:
                f.unlink()
            removed_entries.append(f)
        folders = set()
        for lk, inside in links:
            if os.path.lexists(lk):
                lk.unlink()
                removed_links.append(lk)
            if inside:
                folders.add(lk.parent)
        for p in given:  # a folder restored from the cache that was named itself
            if p.is_dir() and not p.is_symlink():
                folders.add(p)
        for d in sorted(folders, key=lambda d: -len(d.parts)):
            # a directory output restored from the cache: a folder of links (now gone) and
            # Snakemake's .snakemake_timestamp; left as is if anything else is in it
            if d.is_dir() and all(c.name.startswith(".") and not c.is_dir() for c in d.iterdir()):
                shutil.rmtree(d)
                removed_dirs.append(d)
    return {"entries": removed_entries, "links": removed_links, "folders": removed_dirs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("paths", nargs="+", type=Path, help="outputs in results/ (or resources/) served from the cache")
    p.add_argument("-n", "--dry-run", action="store_true", help="say what would be removed, remove nothing")
    a = p.parse_args(argv)
    try:
        r = evict(a.paths, a.dry_run)
    except NotCached as e:
        print(f"cache_evict: {e}", file=sys.stderr)
        return 2
    verb = "would remove" if a.dry_run else "removed"
    for f in r["entries"]:
        print(f"{verb} cache entry file {f}")
    for lk in r["links"]:
        print(f"{verb} link {lk}")
    for d in r["folders"]:
        print(f"{verb} folder {d}")
    if not a.dry_run:
        print("The next `snakemake ... --cache` run (make run) recomputes the job that made "
              f"{', '.join(str(x) for x in a.paths)} and stores a fresh cache entry.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
