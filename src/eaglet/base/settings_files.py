"""Settings as files and arguments: a job's settings file (``write_settings``, and where a preview
writes them, ``settings_preview_dir``), a stage's JSON settings argument (``parse_json_arg``), and
what differs between two records of the settings that define a resumable result
(``setting_changes``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from eaglet.base.files import atomic_path


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
