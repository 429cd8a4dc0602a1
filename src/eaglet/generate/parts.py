"""generate's resume state: finished conversations as atomic Parquet parts under OUT/parts,
discarded when the settings that define the data change."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json, read_parquet, write_json, write_parquet
from eaglet.base.settings_files import setting_changes

log = logging.getLogger("eaglet.generate.generate")

def _part_schema():
    import pyarrow as pa

    msg = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
    return pa.schema([("id", pa.string()), ("source", pa.string()), ("ok", pa.bool_()),
                      ("input_digest", pa.string()), ("messages", pa.list_(msg)),
                      ("error_kind", pa.string()), ("reason", pa.string()),
                      ("generated_turns", pa.int32()), ("prompt_tokens", pa.int64()),
                      ("completion_tokens", pa.int64()), ("finish_reasons", pa.list_(pa.string())),
                      ("retries", pa.int32()), ("reasoning_turns", pa.int32())])


class PartSink:
    """Buffers finished records; writes them as an atomic Parquet part every chunk_size or flush_s."""

    def __init__(self, parts_dir: Path, chunk_size: int, flush_s: float, on_record=None):
        self.dir, self.chunk_size, self.flush_s, self.on_record = parts_dir, chunk_size, flush_s, on_record
        self.buf: list[dict] = []
        self.last_flush = time.monotonic()
        self.next_index = 1 + max((int(p.stem.split("_")[1]) for p in parts_dir.glob("part_*.parquet")),
                                  default=-1)
        self.written = Counter()
        self.t_gen0: float | None = None  # when requests began (after server start / model load)

    def start_clock(self) -> None:
        self.t_gen0 = self.t_gen0 or time.monotonic()

    def add(self, rec: dict) -> None:
        self.buf.append(rec)
        self.written["ok" if rec["ok"] else "error"] += 1
        if self.on_record:
            self.on_record(rec)
        if len(self.buf) >= self.chunk_size or time.monotonic() - self.last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.buf:
            return
        import pyarrow as pa

        write_parquet(self.dir / f"part_{self.next_index:06d}.parquet",
                      pa.Table.from_pylist(self.buf, schema=_part_schema()))
        self.next_index += 1
        self.buf = []


def load_parts(parts_dir: Path, inputs: dict[str, str] | None = None) -> dict[str, dict]:
    """Latest record per id over all parts (a later part supersedes an earlier transient failure).
    ``inputs`` (id -> input_digest): keep only records made from exactly these input rows, so a
    changed prompt set (more prompts, another seed) reuses every response whose prompt it still has."""
    done: dict[str, dict] = {}
    for p in sorted(parts_dir.glob("part_*.parquet")):
        for rec in read_parquet(p).to_pylist():
            if inputs is None or inputs.get(rec["id"]) == rec["input_digest"]:
                done[rec["id"]] = rec
    return done


def prepare_parts(out_dir: Path, key: dict) -> Path:
    """The parts folder for this key (eaglet.generate.generate.parts_key); parts made under another key, or
    with no record of theirs (manifest.json), are discarded, the log line naming each difference."""
    parts = out_dir / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for tmp in parts.glob(".*.tmp"):  # leftovers of a write interrupted by a kill
        tmp.unlink()
    key = json.loads(json.dumps(key))  # as manifest.json gives it back
    manifest = parts / "manifest.json"
    old_parts = sorted(parts.glob("part_*.parquet"))
    why = None
    if manifest.exists():
        try:
            changed = setting_changes(read_json(manifest), key)
        except ArtifactError as e:
            changed = [f"unreadable ({e})"]
        why = "; ".join(changed) or None
    elif old_parts:
        why = "no manifest.json records the settings they were made with"
    if why and old_parts:
        log.warning("%s: parts made with other settings (%s); discarding %d part files, not resuming them",
                    parts, why, len(old_parts))
        for p in old_parts:
            p.unlink()
    write_json(manifest, key)
    return parts
