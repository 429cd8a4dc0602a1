"""Every bad value refused at parse time (issue 46), by a fuzz of the whole schema: every setting of
workflow/schemas/config.schema.yaml, found by walking it (no list of keys here), gets values of the
wrong kind over config/smoke.yaml (as Snakemake reads it: over config/config.yaml), and each must be
refused by what workflow/rules/common.smk runs at parse time (eaglet.base.schema.validate, then
eaglet.workflow.resolve.resolve), in-process, with a message naming the key's whole dotted path and
the value.

The kinds: a float where an integer is meant (an integral one too: JSON Schema counts 2.0 as an
integer), a string where a number, a boolean or a list is meant, a boolean where a number is meant,
a negative where the schema's minimum is >= 0, and an unknown key at every mapping level (target.tiny
against its family's transformers config class).
"""

from __future__ import annotations

import copy

import pytest
import yaml
from snakemake.utils import update_config

from conftest import REPO, clone
from eaglet.base import schema
from eaglet.workflow.resolve import resolve
from workflow_common import smk

SMOKE = yaml.safe_load((REPO / "config" / "config.yaml").read_text())  # the Snakefile's own configfile
update_config(SMOKE, yaml.safe_load((REPO / "config" / "smoke.yaml").read_text()))  # --configfile, merged
UNKNOWN = "no_such_key_46"
# Mappings whose keys the user names (no key there is unknown): generate.chat_template_kwargs, the
# chat template's own keyword arguments; evaluate.modes, a mode name -> its keyword arguments; and the
# num_prompts mappings, a set name -> its count, where a count for a set not evaluated is normal
# (Snakemake merges config/config.yaml's counts into a --configfile's mapping, key by key).
FREE_MAPPINGS = {("generate", "chat_template_kwargs"), ("evaluate", "modes"), ("evaluate", "num_prompts"),
                 ("evaluate", "regenerate", "num_prompts")}


def _types(n: dict) -> set[str]:
    t = n.get("type", [])
    return {t} if isinstance(t, str) else set(t)


def _nodes(n: dict, path: tuple = ()):
    """Every (path, schema node) of the schema, sections and settings, depth first."""
    for key, sub in (n.get("properties") or {}).items():
        yield (*path, key), sub
        yield from _nodes(sub, (*path, key))


NODES = dict(_nodes(schema.schema()))
SETTINGS = {p: n for p, n in NODES.items() if not n.get("properties")}
MAPPINGS = [(), *(p for p, n in NODES.items() if "object" in _types(n))]


def _at(conf: dict, path: tuple):
    for part in path:
        conf = conf[part]
    return conf


def _set(conf: dict, path: tuple, value) -> dict:
    node = conf
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if node is None:  # a section written as null in the base (none in the base)
            raise AssertionError(f"{schema.dotted(path)}: the base config holds null above it")
    node[path[-1]] = value
    return conf


def _wrong(path: tuple, n: dict):
    """(where the bad value lands, its path in the message, the value, the kind) for one setting,
    from what the schema says of it; an array's items get the same, in the list's first place."""
    types = _types(n)
    low = n.get("minimum", n.get("exclusiveMinimum"))
    cases = []
    if "integer" in types and "number" not in types:
        cases += [(3.0, "integral float"), (2.5, "float")]
    if types & {"integer", "number"}:
        cases.append((True, "bool for a number"))
        if low is not None and low >= 0:
            cases.append((-1 if "integer" in types else -0.5, "negative"))
    if types & {"integer", "number", "boolean", "array"} and "string" not in types:
        cases.append(("3", "string"))
    if "boolean" in types and not types & {"integer", "number", "string"}:
        cases.append((1, "int for a bool"))
    out = [(path, path, v, kind) for v, kind in cases]
    item = n.get("items")
    if "array" in types and isinstance(item, dict):
        fill = n.get("default") or [1] * max(n.get("minItems", 1), 1)
        for where, _, v, kind in _wrong((*path, 0), item):
            out.append((path, where, [v, *copy.deepcopy(fill)[1:]], f"item: {kind}"))
    extra = n.get("additionalProperties")
    if isinstance(extra, dict):  # a mapping's values (free keys, typed values): under a key of the base's
        held = _at(SMOKE, path) if _has(SMOKE, path) else None
        for key in list(held)[:1] if isinstance(held, dict) else []:
            for _, _, v, kind in _wrong((*path, key), extra):
                out.append(((*path, key), (*path, key), v, f"mapping value: {kind}"))
    return out


def _has(conf: dict, path: tuple) -> bool:
    try:
        _at(conf, path)
        return True
    except (KeyError, TypeError):
        return False


def _cases(kinds: tuple[str, ...]) -> list[tuple]:
    out = []
    for path, n in SETTINGS.items():
        for where, named, value, kind in _wrong(path, n):
            if kind.split(": ")[-1] in kinds:
                out.append((where, named, value, kind))
    return out


def parse(conf: dict):
    """What the workflow runs at parse time (workflow/rules/common.smk), in the repository."""
    schema.validate(conf)
    return resolve(conf, REPO)


def _refused(where: tuple, value, named: tuple) -> str | None:
    """None when the config with ``value`` at ``where`` is refused at parse time by a ValueError
    whose message has a line naming ``named`` and the value; else what happened instead."""
    conf = _set(copy.deepcopy(SMOKE), where, value)
    shown = value[0] if isinstance(value, list) else value
    try:
        parse(conf)
    except ValueError as e:
        lines = [ln.strip() for ln in str(e).splitlines()]
        if any(ln.startswith(f"{schema.dotted(named)}: ") and repr(shown) in ln for ln in lines):
            return None
        return f"refused, but no line names {schema.dotted(named)} and {shown!r}: {e}"
    except Exception as e:  # noqa: BLE001 - a crash naming no key is what the issue is about
        return f"not refused but crashed: {type(e).__name__}: {e}"
    return "accepted"


def test_the_base_config_passes_and_the_walk_reaches_every_setting():
    """config/smoke.yaml passes the parse-time validation and resolution (so each refusal below is
    the bad value's), and the walk finds every kind of setting the fuzz feeds."""
    assert parse(copy.deepcopy(SMOKE)).layer_ids
    assert len(SETTINGS) > 120, len(SETTINGS)  # every leaf, not a hand list
    for path in [("extract", "layer_ids"), ("target", "tiny", "seed"), ("train", "lr"), ("evaluate", "hf_loop"),
                 ("target", "vllm", "tensor_parallel_size"), ("evaluate", "regenerate", "max_tokens")]:
        assert path in SETTINGS, path
    kinds = {kind for path, n in SETTINGS.items() for *_, kind in _wrong(path, n)}
    for kind in ("integral float", "float", "bool for a number", "negative", "string", "int for a bool",
                 "item: integral float", "mapping value: integral float"):
        assert kind in kinds, kinds


@pytest.mark.parametrize("kinds", [
    ("integral float", "float"),
    ("string",),
    ("bool for a number", "int for a bool"),
    ("negative",),
], ids=["float for an integer", "string for a number, bool or list", "bool for a number, int for a bool",
        "negative under a minimum >= 0"])
def test_every_setting_refuses_a_value_of_the_wrong_kind(kinds):
    """Each setting given a value of the wrong kind, over config/smoke.yaml, is refused at parse time
    by a message naming the key's whole path (``extract.layer_ids[0]``) and the value."""
    cases = _cases(kinds)
    assert len(cases) >= 20, cases
    failed = [f"{schema.dotted(named)} = {value!r} ({kind}): {why}" for where, named, value, kind in cases
              if (why := _refused(where, value, named))]
    assert not failed, "\n".join(failed)


def test_an_unknown_key_is_refused_at_every_mapping_level():
    """An unknown key at every mapping level of the schema (the top, each section, target.tiny for
    its family) is refused at parse time naming its path."""
    cases = []
    for path in MAPPINGS:
        if path in FREE_MAPPINGS:
            continue
        held = _at(SMOKE, path) if _has(SMOKE, path) else {}
        cases.append((path, {**copy.deepcopy(held), UNKNOWN: 1}))
    assert {("target", "tiny"), ("evaluate", "vllm"), ("evaluate", "regenerate"), ()} <= {p for p, _ in cases}
    failed = []
    for path, value in cases:
        conf = copy.deepcopy(SMOKE)
        if path:
            _set(conf, path, value)
        else:
            conf = value
        try:
            parse(conf)
            failed.append(f"{schema.dotted((*path, UNKNOWN))}: accepted")
        except ValueError as e:
            if not any(ln.strip().startswith(f"{schema.dotted((*path, UNKNOWN))}: ") for ln in str(e).splitlines()):
                failed.append(f"{schema.dotted((*path, UNKNOWN))}: not named in {e}")
    assert not failed, "\n".join(failed)


def test_free_mappings_are_only_those_whose_keys_the_user_names():
    """The schema's mappings without ``additionalProperties: false`` are the four whose keys the user
    names (FREE_MAPPINGS) and target.tiny, whose keys parse time checks against the family's config
    class (refused above): a new one has to be added here, and said so."""
    open_keys = {p for p, n in NODES.items() if "object" in _types(n) and n.get("additionalProperties") is not False}
    assert open_keys == FREE_MAPPINGS | {("target", "tiny")}, open_keys


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
def test_a_misspelt_tiny_override_is_refused_for_its_family(family):
    """A misspelt key in target.tiny (num_hiden_layers) is refused at parse time, naming the key,
    its value and the family's config class; a real field of that class, and a family alias
    (gpt_oss's num_experts), pass."""
    from eaglet.target.families import config_class

    conf = _set(copy.deepcopy(SMOKE), ("target", "tiny"), {"family": family, "num_hiden_layers": 4})
    with pytest.raises(ValueError, match=rf"target\.tiny\.num_hiden_layers: unknown key \(value 4\) for family "
                                         rf"{family}.*{config_class(family).__name__}.*did you mean num_hidden_layers"):
        parse(conf)
    good = {"family": family, "num_hidden_layers": 12, "attention_dropout": 0.0}
    if family == "gpt_oss":
        good["num_experts"] = 4
    parse(_set(copy.deepcopy(SMOKE), ("target", "tiny"), good))


def test_integral_float_layer_ids_are_refused_in_the_message_snakemake_prints(tmp_path):
    """``extract.layer_ids: [2.0, 4, 5]`` stops ``snakemake -n`` before any DAG, naming
    ``extract.layer_ids[0]`` and the value (before: jobs ran, and extraction died on a TypeError)."""
    a = clone(tmp_path / "a")
    (tmp_path / "cache").mkdir()
    conf = _set(copy.deepcopy(SMOKE), ("extract", "layer_ids"), [2.0, 4, 5])
    (a / "config/bad.yaml").write_text(yaml.safe_dump(conf))
    code, out = smk(a, tmp_path / "cache", "-n", check=False, configfile="config/bad.yaml")
    assert code != 0 and "Building DAG" not in out, out[-3000:]
    assert "extract.layer_ids[0]: 2.0 is a float; expected integer (write 2)" in out, out[-3000:]

