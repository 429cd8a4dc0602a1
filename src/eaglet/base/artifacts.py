"""Shared I/O: atomic writes, Parquet / safetensors / JSON helpers, artifact checks.

Every stage writes through these helpers so that a killed job never leaves a file that looks
complete: data goes to a temporary file in the same folder, is flushed and fsynced, and is then
renamed over the final path (rename is atomic on POSIX).

Readers raise :class:`ArtifactError` naming the file when an artifact is truncated or corrupt,
so a consuming stage refuses it instead of training on garbage.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("eaglet")


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


# --------------------------------------------------------------------------- atomic writes
_UMASK = os.umask(0)
os.umask(_UMASK)


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
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
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


# --------------------------------------------------------------------------- safetensors
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


# --------------------------------------------------------------------------- digests
def file_digest(path: str | os.PathLike, algo: str = "sha256", chunk: int = 1 << 20) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def digest_of(obj: Any) -> str:
    """Stable short digest of a JSON-able value."""
    blob = json.dumps(obj, sort_keys=True, default=_json_default).encode()
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


def _visible_files(folder: Path) -> list[Path]:
    """Files under ``folder`` (recursively, links followed), skipping dot-names: Snakemake's
    .snakemake_timestamp and huggingface_hub's .cache/ change without the model changing."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(root) / f for f in sorted(files) if not f.startswith(".")]
    return out


def folder_manifest(folder: str | os.PathLike) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"?}}`` for every file of a folder: sha256 for files up to
    FULL_HASH_MAX_BYTES, size only for bigger ones (see verify_manifest)."""
    folder = Path(folder)
    out = {}
    for f in _visible_files(folder):
        size = f.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= FULL_HASH_MAX_BYTES:
            entry["sha256"] = file_digest(f)
        out[f.relative_to(folder).as_posix()] = entry
    return out


def verify_manifest(folder: str | os.PathLike, manifest: dict[str, dict], record: str | os.PathLike) -> None:
    """Refuse ``folder`` unless it holds exactly the files of ``manifest`` (recorded in ``record``)
    with the recorded sizes, and the recorded sha256 of every file that has one."""
    folder = Path(folder)
    have = {f.relative_to(folder).as_posix(): f for f in _visible_files(folder)}
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


# --------------------------------------------------------------------------- resume identities
_ABSENT = object()


def _shown(v) -> str:
    if v is _ABSENT:
        return "(absent)"
    s = re.sub(r"\b[0-9a-f]{32,}\b", lambda m: m.group(0)[:12], json.dumps(v, sort_keys=True, default=str))
    return s if len(s) <= 160 else s[:157] + "..."


def setting_changes(old, new: dict, prefix: str = "") -> list[str]:
    """What differs between two records of what defines a resumable result (the shard writer's
    progress, the trainer's checkpoints): one ``key: before -> after`` per changed value, nested
    records by dotted key, ``(absent)`` for a key one record lacks, long digests cut to 12 digits."""
    if not isinstance(old, dict):
        return [f"{prefix.rstrip('.') or 'record'}: {_shown(old)} -> {_shown(new)}"]
    out = []
    for k in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(k, _ABSENT), new.get(k, _ABSENT)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += setting_changes(a, b, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}: {_shown(a)} -> {_shown(b)}")
    return out


# --------------------------------------------------------------------------- logging / CLI
def setup_logging(log_file: str | os.PathLike | None = None, level: int = logging.INFO) -> None:
    """Log to stderr, and to ``log_file`` too when given. Silences chatty third-party loggers.
    With a log file, an exception that ends the stage goes into it too (the refused file, the
    cache entry and its evict command are in the stage's log, not only in Snakemake's output)."""
    global _previous_excepthook
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
        if sys.excepthook is not _log_uncaught:
            _previous_excepthook = sys.excepthook
            sys.excepthook = _log_uncaught
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    quiet_third_party()


_previous_excepthook = sys.excepthook


def _log_uncaught(exc_type, exc, tb) -> None:
    """sys.excepthook: the exception into the log files (stderr gets the usual traceback)."""
    if not issubclass(exc_type, KeyboardInterrupt):
        rec = logging.LogRecord("eaglet", logging.ERROR, __file__, 0, "%s: %s", (exc_type.__name__, exc),
                                (exc_type, exc, tb))
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.FileHandler):
                h.handle(rec)
    _previous_excepthook(exc_type, exc, tb)


def quiet_third_party() -> None:
    """The tokenizer floods the log with warnings (the seed run's lesson): keep them out."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in ("transformers", "transformers.tokenization_utils_base", "gguf", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # transformers not installed in this environment
        pass


def write_settings(path: str | os.PathLike, text: str) -> None:
    """A job's settings file (workflow/rules/common.smk, settings_file): written atomically, and
    left alone (its mtime too) when its content is already ``text``."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def settings_preview_dir() -> Path | None:
    """``EAGLET_PREVIEW_SETTINGS``: where a preview also writes the settings files, to inspect them
    (a run writes them when it starts; a preview writes nothing a run reads)."""
    d = os.environ.get("EAGLET_PREVIEW_SETTINGS")
    return Path(d) if d else None


def parse_json_arg(s: str | None, default: Any = None) -> Any:
    """CLI helper: JSON text, or ``@FILE`` for the JSON in a file (the workflow hands a stage its
    settings inline, or a cached stage as logs/.../*.json; see workflow/rules/common.smk)."""
    if s is None or s == "":
        return default
    if s.startswith("@"):
        return json.loads(Path(s[1:]).read_text())
    return json.loads(s)


# --------------------------------------------------------------------------- conversations
ROLES = ("system", "user", "assistant")


def _conversation_schema():
    import pyarrow as pa

    msg = pa.struct([("role", pa.string()), ("content", pa.string()),
                     ("reasoning_content", pa.string())])
    return pa.schema([("id", pa.string()), ("source", pa.string()), ("messages", pa.list_(msg))])


def write_conversations(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write conversations (``id``, ``source``, ``messages``) in the one Parquet schema."""
    import pyarrow as pa

    norm = [{"id": str(r["id"]), "source": str(r.get("source", "")),
             "messages": [{"role": m["role"], "content": m["content"],
                           "reasoning_content": m.get("reasoning_content")} for m in r["messages"]]}
            for r in rows]
    write_parquet(path, pa.Table.from_pylist(norm, schema=_conversation_schema()))


def read_conversations(path: str | os.PathLike) -> list[dict]:
    table = read_parquet(path)
    missing = {"id", "messages"} - set(table.column_names)
    if missing:
        raise ArtifactError(f"{path}: not a conversation file (missing columns {sorted(missing)})")
    rows = table.to_pylist()
    for r in rows:
        r.setdefault("source", "")
        # A null list or a null turn is left as it is: each stage's row check counts it by reason
        # (conversation_problem, prompt_problem), instead of one bad row crashing the stage here.
        for m in r["messages"] or []:
            if isinstance(m, dict) and m.get("reasoning_content") is None:
                m.pop("reasoning_content", None)
    return rows


def _turn_problem(m) -> str | None:
    """The checks every turn of any row passes: a dict with a known role and string content."""
    if not isinstance(m, dict):
        return "malformed_turn"
    if m.get("role") not in ROLES:
        return "unknown_role"
    if not isinstance(m.get("content"), str):
        return "non_string_content"
    return None


def prompt_problem(messages) -> str | None:
    """Why a row cannot be used as a prompt to answer (a reason key for the skip counters), or None.
    Unlike conversation_problem, a prompt needs a user turn, not an assistant turn (generate,
    evaluation sets)."""
    if not isinstance(messages, list) or not messages:
        return "empty_conversation"
    for m in messages:
        if problem := _turn_problem(m):
            return problem
    if not any(m["role"] == "user" for m in messages):
        return "no_user_turn"
    return None


def conversation_problem(messages: list[dict]) -> str | None:
    """Why a conversation is unusable (a reason key for the skip counters), or None if it is fine.

    Shared by every stage that reads conversations, so a malformed row is refused the same way
    whether it comes from the source data or from regeneration."""
    if not messages:
        return "empty_conversation"
    for m in messages:
        if problem := _turn_problem(m):
            return problem
        for key in ("content", "reasoning_content"):
            v = m.get(key)
            if v is not None and not isinstance(v, str):
                return "non_string_content"
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes
                    return "undecodable"
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant_turn"
    if all(not m["content"].strip() for m in messages if m["role"] == "assistant"):
        return "empty_assistant_turn"
    return None
