"""Conversation files: the one Parquet schema (``id``, ``source``, ``messages``), read and written,
and the row checks every stage that reads conversations or prompts applies
(``conversation_problem``, ``prompt_problem``)."""

from __future__ import annotations

import os

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_parquet, write_parquet

ROLES = ("system", "user", "assistant")


def conversation_schema():
    """The one Parquet schema of a conversation file."""
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
    write_parquet(path, pa.Table.from_pylist(norm, schema=conversation_schema()))


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
