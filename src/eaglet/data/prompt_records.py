"""The raw records of a prompts source, read as a stream in bounded chunks: a JSONL file line by
line, a Parquet file a batch of ``chunk_rows`` rows at a time (pyarrow's ``iter_batches``, only the
columns that are read), a saved or named ``datasets`` data set a batch at a time from its
memory-mapped Arrow files. A JSON array (the packaged ShareGPT file) is read whole. A folder is its
data files in name order (those whose path names ``prompts.split``, if any do).

Each pass yields ``(file, place, record)``: ``place`` is the line (JSONL) or row number, 1-based,
and ``record`` the parsed object or a ``Skip`` with the reason a line could not be parsed. A source
can be read any number of times (the prompts stage reads it twice: once to count and check, once
to take the rows it picked), each pass in the same order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import visible_files
from eaglet.base.prompt_sources import load_named, saved_split

# Rows per chunk of a Parquet file or a data set: a few MB of conversations at a time
CHUNK_ROWS = 4096
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# the columns a record is read from (eaglet.data.prompts.normalise): others are never loaded
COLUMNS = ("id", "conversations", "messages")


@dataclass(frozen=True)
class Skip:
    """A line that is no record: ``reason`` as summary.json counts it."""

    reason: str


@dataclass(frozen=True)
class Source:
    """A prompts source: ``name`` (the rows' ``source`` and default ids), ``where`` (what messages
    name); ``passes()`` starts a pass."""

    name: str
    where: str
    passes: Callable[[], Iterator[tuple[str, int, object]]]


def jsonl(path: Path) -> Iterator[tuple[str, int, object]]:
    """A JSONL file line by line (blank lines skipped; a bad line is a Skip)."""
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield str(path), n, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                yield str(path), n, Skip("undecodable")
            except json.JSONDecodeError:
                yield str(path), n, Skip("invalid_json")


def json_array(path: Path) -> Callable[[], Iterator[tuple[str, int, object]]]:
    """The passes over a JSON array's elements: the file is read and parsed once, whole; a
    truncated tail costs its last record."""
    records, bad = read_json_array(path, path.read_bytes())

    def passes():
        for n, rec in enumerate(records, 1):
            yield str(path), n, rec
        for reason in bad:
            yield str(path), len(records) + 1, Skip(reason)

    return passes


def read_json_array(path: Path, raw: bytes) -> tuple[list, list[str]]:
    """Elements of a JSON array, decoded one by one so that a truncated tail (the packaged
    ShareGPT file ends mid-record) costs only the last record, reported as ``truncated_tail``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 ({e})") from None
    dec = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise ArtifactError(f"{path}: expected a JSON array of conversations")
    pos += 1
    records: list = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            return records, ["truncated_tail"] if records else []
        if text[pos] == "]":
            return records, []
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records, ["truncated_tail" if records else "invalid_json"]
        records.append(rec)


def return_freed_arrow_memory() -> None:
    """Arrow's buffers from jemalloc, handing freed memory back at once (the prompts job calls it
    before reading). Under pyarrow's default mimalloc the pages one batch freed stayed with the
    process, and the peak grew with the number of batches read: 112 MB reading 100k Parquet rows,
    124 MB reading 1M; 94 and 96 MB with this (benchmarks/bench_prompts_stream.py measures the
    stage). A build without jemalloc keeps its pool."""
    import pyarrow as pa

    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:
        return
    pa.set_memory_pool(pool)
    pa.jemalloc_set_decay_ms(0)


def _columns(names: list[str], where: str) -> list[str]:
    if "conversations" not in names and "messages" not in names:
        raise ArtifactError(f"{where}: no 'conversations' (ShareGPT shape) or 'messages' (OpenAI shape) column; "
                            f"its columns: {', '.join(names) or 'none'}")
    return [c for c in COLUMNS if c in names]


def parquet(path: Path, chunk_rows: int) -> Iterator[tuple[str, int, object]]:
    """A Parquet file ``chunk_rows`` rows at a time, its conversation columns only. Neither read
    ahead (pre_buffer) nor decoded by Arrow's thread pool: with either, the peak grew with the
    file (under jemalloc, 93 MB reading 100k rows and 108-125 MB reading 1M; 94 and 95 MB without
    both)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True, pre_buffer=False)
        cols = _columns(pf.schema_arrow.names, str(path))
        n = 0
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=cols, use_threads=False):
            for rec in batch.to_pylist():
                n += 1
                yield str(path), n, rec
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({e})") from None


def arrow_dataset(ds, where: str, chunk_rows: int) -> Iterator[tuple[str, int, object]]:
    """A ``datasets.Dataset`` a batch of ``chunk_rows`` at a time (its Arrow files are memory-mapped)."""
    cols = _columns(list(ds.column_names), where)
    n = 0
    for table in ds.select_columns(cols).with_format("arrow").iter(batch_size=chunk_rows):
        for rec in table.to_pylist():
            n += 1
            yield where, n, rec


def data_files(folder: Path, split: str) -> list[Path]:
    """A folder's data files in name order: those whose path names ``split`` (``train.jsonl``,
    ``data/train-00000-of-00001.parquet``) when some do, else all."""
    files = [f for f in visible_files(folder) if f.suffix in DATA_SUFFIXES]
    named = [f for f in files if re.search(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)",
                                           f.relative_to(folder).as_posix())]
    if not files:
        raise ArtifactError(f"prompts.path: {folder} holds no {', '.join(DATA_SUFFIXES)} file")
    return named or files


def file_passes(path: Path, chunk_rows: int) -> Callable[[], Iterator[tuple[str, int, object]]]:
    """The passes over one data file: Parquet and JSONL streamed, a JSON array parsed once."""
    if path.suffix == ".parquet":
        return lambda: parquet(path, chunk_rows)
    if path.suffix == ".json":
        return json_array(path)
    return lambda: jsonl(path)


def open_source(source: str, path: str | Path, name: str, split: str, chunk_rows: int = CHUNK_ROWS) -> Source:
    """The source ``prompts.source``/``prompts.path`` name: a local file, a local folder of data
    files, a saved data set (``datasets``' save_to_disk) or a ``datasets`` name."""
    local = Path(path)
    if source == "datasets" and not local.exists():
        ds = load_named(str(path), split)
        return Source(name, f"{path} ({split})", lambda: arrow_dataset(ds, str(path), chunk_rows))
    if not local.exists():
        raise FileNotFoundError(f"prompts.path: {local} does not exist")
    if local.is_file():
        return Source(name, str(local), file_passes(local, chunk_rows))
    saved = saved_split(local, split) if source == "datasets" else None
    if saved is not None:
        import datasets

        ds = datasets.load_from_disk(str(saved))
        return Source(name, f"{local} ({split})", lambda: arrow_dataset(ds, str(saved), chunk_rows))
    files = [file_passes(f, chunk_rows) for f in data_files(local, split)]

    def passes():
        for one in files:
            yield from one()

    return Source(name, str(local), passes)


def place(file: str, n: int) -> str:
    """Where a record is, for a person: ``data.jsonl, line 4`` or ``data.parquet, row 4``."""
    unit = "row" if Path(file).suffix in (".parquet", ".json") or Path(file).is_dir() or not Path(file).exists() \
        else "line"
    return f"{file}, {unit} {n}"
