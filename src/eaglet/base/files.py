"""Atomic writes and the JSON / text / Parquet helpers.

Every stage writes through these helpers so that a killed job never leaves a file that looks
complete: data goes to a temporary file in the same folder, is flushed and fsynced, and is then
renamed over the final path (rename is atomic on POSIX).

Readers raise :class:`~eaglet.base.artifacts.ArtifactError` naming the file when an artifact is
truncated or corrupt, so a consuming stage refuses it instead of training on garbage.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eaglet.base.artifacts import ArtifactError, disk_full_error, is_disk_full

# --------------------------------------------------------------------------- atomic writes
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success only.

    A write that fails for lack of space (the body's, the fsync, the rename) raises DiskFullError
    naming ``path`` and the free bytes, and leaves no temporary file behind."""
    path = Path(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give them the usual mode
        os.replace(tmp, path)
    except Exception as e:
        if not is_disk_full(e):
            raise
        # The failed writer's frames (of this error and the ones it arose from) let go of what they
        # hold: torch.save's zip writer keeps its file open, and its blocks allocated even once
        # unlinked, until it is collected.
        seen: set[int] = set()
        err: BaseException | None = e
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            traceback.clear_frames(err.__traceback__)
            err = err.__cause__ or err.__context__
        written = None
        if tmp is not None and tmp.exists():
            written = tmp.stat().st_size
            tmp.unlink()  # before counting the free bytes: what the rerun will have
        raise disk_full_error(path, e, written) from e
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")


def json_default(o: Any) -> Any:
    """What JSON writes for numpy scalars and arrays and paths (write_json, eaglet.base.digests.digest_of)."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: corrupt JSON ({e})") from None


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


# --------------------------------------------------------------------------- parquet
def write_parquet(path: str | os.PathLike, table_or_df: Any) -> None:
    """Write a pyarrow Table or pandas DataFrame atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = table_or_df
    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table_or_df, preserve_index=False)
    with atomic_path(path) as tmp:
        # Page CRCs: without them a flipped byte inside a data page can decode to other values
        # silently (the fault suite found ~8% of single-byte flips read back as different data).
        pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)


def read_parquet(path: str | os.PathLike, columns: list[str] | None = None):
    """Read a Parquet file as a pyarrow Table, refusing truncated or corrupt files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: missing")
    try:
        return pq.read_table(path, columns=columns, page_checksum_verification=True)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({e})") from None
