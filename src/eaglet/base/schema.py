"""The one source of every setting: workflow/schemas/config.schema.yaml.

Every default and every allowed value of a setting is written once, in the schema; a module that
needs them reads them from here (``defaults("train")``, ``allowed("train.loss")``) instead of
keeping a copy, and tests/base/test_schema.py fails on a module that holds a default of its own.
What the workflow passes a stage is the config the schema validated (defaults filled); a stage
called directly (tests, benchmarks, ``python -m``) fills the same defaults from here.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "workflow" / "schemas" / "config.schema.yaml"


@lru_cache(maxsize=1)
def _schema() -> dict:
    import yaml

    return yaml.safe_load(SCHEMA_PATH.read_text())


def schema() -> dict:
    """The whole config schema (a copy: callers may not change the source)."""
    return copy.deepcopy(_schema())


def node(path: str) -> dict:
    """The schema of one setting or section, by its dotted path (``"train.loss"``,
    ``"evaluate.vllm"``); a KeyError names the first part the schema does not have."""
    n = _schema()
    done = []
    for part in path.split(".") if path else []:
        props = n.get("properties") or {}
        if part not in props:
            where = ".".join(done) or "the config"
            raise KeyError(f"{path}: {where} has no setting {part!r} in {SCHEMA_PATH.name} (known: {sorted(props)})")
        n = props[part]
        done.append(part)
    return n


def _filled(n: dict) -> Any:
    """The value validate(set_default=True) gives a setting left out: its default, with an object
    default ({}) filled with its own properties' defaults."""
    value = copy.deepcopy(n["default"])
    if isinstance(value, dict) and n.get("properties"):
        for key, sub in n["properties"].items():
            if key not in value and "default" in sub:
                value[key] = _filled(sub)
    return value


def defaults(path: str) -> dict:
    """The defaults of a section (``"train"``, ``"evaluate.vllm"``): every setting of it that has a
    default, nested sections filled, as validating a config without the section would give."""
    n = node(path)
    if "properties" not in n:
        raise KeyError(f"{path}: not a section of {SCHEMA_PATH.name} (a setting: use default())")
    return {key: _filled(sub) for key, sub in n["properties"].items() if "default" in sub}


def default(path: str) -> Any:
    """One setting's default (a KeyError when the schema gives it none)."""
    n = node(path)
    if "default" not in n:
        raise KeyError(f"{path}: {SCHEMA_PATH.name} gives it no default")
    return _filled(n)


def allowed(path: str) -> tuple:
    """The values a setting may take (its schema's enum), in the schema's order."""
    n = node(path)
    if "enum" not in n:
        raise KeyError(f"{path}: {SCHEMA_PATH.name} lists no allowed values for it")
    return tuple(n["enum"])


def settings(path: str, given: dict | None, name: str | None = None, extra: tuple[str, ...] = (),
             leave_out: tuple[str, ...] = ()) -> dict:
    """``given`` over the section's defaults, refusing a key the section does not have (``extra``:
    keys a stage takes beside the section's, from another section or the workflow; ``leave_out``:
    keys of the section the stage does not take, neither filled nor accepted); the message names
    the stage (``name``) and the keys it knows."""
    base = {k: v for k, v in defaults(path).items() if k not in leave_out}
    given = dict(given or {})
    known = (set(node(path)["properties"]) - set(leave_out)) | set(extra)
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"{name or path} settings: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    return base | given


def settings_at(stage: str, paths: tuple[str, ...], given: dict | None, extra: dict | None = None) -> dict:
    """A stage's settings drawn from several sections: ``given`` (a None value counts as not given)
    over the defaults of the settings at ``paths``, each taken under its name
    (``evaluate.vllm.k_values`` -> ``k_values``); ``extra``: keys the stage takes beside them, each
    with the value a direct call gets. A key neither names is refused, naming ``stage`` and the keys
    it takes."""
    base = {p.rsplit(".", 1)[-1]: default(p) for p in paths} | dict(extra or {})
    given = {k: v for k, v in (given or {}).items() if v is not None}
    unknown = set(given) - set(base)
    if unknown:
        raise ValueError(f"{stage}: unknown options {sorted(unknown)} (known: {', '.join(base)})")
    return base | given


# --------------------------------------------------------------------------- parse-time validation
def dotted(parts) -> str:
    """A config key's whole path as a message names it: ``extract.layer_ids[0]``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the config"


def _types(n: dict) -> list[str]:
    t = n.get("type", [])
    return [t] if isinstance(t, str) else list(t)


def _walk(value: Any, n: dict, path: tuple) -> list[str]:
    """What JSON Schema lets through and the workflow must refuse, under the schema node ``n``:
    a float where only an integer is meant (JSON Schema counts 2.0 as an integer, and the stage
    then fails on it, naming no key), a non-finite number (NaN or infinity passes every minimum
    and maximum) and an unknown key of a section that takes none (``additionalProperties: false``;
    also refused by the schema, named here by its whole path). One message per value."""
    import math

    types = _types(n)
    if isinstance(value, float) and "integer" in types and "number" not in types:
        return [f"{dotted(path)}: {value!r} is a float; expected {' or '.join(types)}"
                + (f" (write {int(value)})" if value.is_integer() else "")]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{dotted(path)}: {value!r} is not a finite number; expected a finite {' or '.join(types) or 'value'}"]
    out = []
    if isinstance(value, dict):
        props = n.get("properties") or {}
        extra = n.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                out += _walk(sub, props[key], (*path, key))
            elif extra is False:
                out.append(f"{dotted((*path, key))}: unknown key (value {sub!r}); "
                           f"expected one of {dotted(path)}'s keys: {', '.join(props)}")
            elif isinstance(extra, dict):
                out += _walk(sub, extra, (*path, key))
    elif isinstance(value, list) and isinstance(n.get("items"), dict):
        for i, item in enumerate(value):
            out += _walk(item, n["items"], (*path, i))
    return out


def refusals(config: dict) -> list[str]:
    """Every refusal of ``config`` (as written, before defaults) against the schema, each naming the
    key's whole dotted path, the value and what is expected: :func:`_walk`'s, then the schema's own
    (JSON Schema's errors, with the path written out). Empty for a valid config."""
    import jsonschema

    out = _walk(config, _schema(), ())
    named = {m.split(":", 1)[0] for m in out}
    cls = jsonschema.validators.validator_for(_schema())
    for e in sorted(cls(_schema()).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path]):
        path = dotted(e.absolute_path)
        # an unknown key is named above, with its whole path; so is a float refused above
        if not (e.validator == "additionalProperties" and e.validator_value is False) and path not in named:
            out.append(f"{path}: {e.message}")
    return out


def validate(config: dict) -> dict:
    """The workflow's validation at parse time (workflow/rules/common.smk), in place: refuse the
    config with every :func:`refusals` message (a ValueError), then fill the schema's defaults as
    ``snakemake.utils.validate(..., set_default=True)`` does (the config the stages receive)."""
    bad = refusals(config)
    if bad:
        raise ValueError(f"config refused by {SCHEMA_PATH.name} ({len(bad)}):\n  " + "\n  ".join(bad))
    from snakemake.utils import validate as snakemake_validate

    snakemake_validate(config, str(SCHEMA_PATH), set_default=True)
    return config
