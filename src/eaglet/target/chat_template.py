"""The target's chat template: ``target.chat_template`` read as template text, and whether a
checkpoint ships one. Files only (no transformers), so the workflow's parse and the target's
loader (eaglet.target.load) both read it."""

from __future__ import annotations

import json
import re
from pathlib import Path

# A value holding Jinja syntax is the template itself; anything else is a path to one.
_JINJA = re.compile(r"\{[{%#]")
TEMPLATE_KEY = "target.chat_template"


def chat_template_text(value: str | None, base_dir: str | Path = ".") -> str | None:
    """The template text for ``target.chat_template``: inline Jinja as is, else the file it names
    (relative paths from ``base_dir``, the workflow folder). The text, not the path, goes into
    the cache key, so editing the file reruns what depends on it."""
    if not value:
        return None
    if _JINJA.search(value):
        return value
    p = Path(value).expanduser()
    p = p if p.is_absolute() else Path(base_dir) / p
    if not p.is_file():
        raise ValueError(f"{TEMPLATE_KEY}: {value!r} is neither a Jinja template (no {{{{ or {{%) "
                         f"nor an existing file ({p})")
    text = p.read_text()
    if p.suffix == ".json":  # chat_template.json: {"chat_template": "..."}
        text = json.loads(text).get("chat_template", "")
    if not text.strip():
        raise ValueError(f"{TEMPLATE_KEY}: {p} is empty")
    return text


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the checkpoint's tokenizer files carry a chat template (the places transformers
    reads: chat_template.jinja, chat_template.json, tokenizer_config.json's ``chat_template``)."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file() or any((d / "additional_chat_templates").glob("*.jinja")):
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = d / name
        if f.is_file():
            try:
                if json.loads(f.read_text()).get("chat_template"):
                    return True
            except (json.JSONDecodeError, AttributeError):
                continue
    return False


def no_template_message(where: str) -> str:
    return (f"{where}: the target has no chat template (none in its tokenizer files); set "
            f"{TEMPLATE_KEY} to a Jinja file or an inline template (a base model needs one)")
