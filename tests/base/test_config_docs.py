"""config/README.md's key table states the schema's defaults (issue 42, one source for each setting):
every row of a ``| key | default | meaning |`` table in config/README.md or docs/configuration.md
names settings workflow/schemas/config.schema.yaml has, with the default the schema gives them, and
every setting of the schema has a row.

How a row is read:
  - the key cell names one or more settings in backticks (`` `a.b`, `c` ``); a key without a dot
    after the first is in the section of the key before it (`` `train.lr`, `warmup_ratio` ``);
  - the default cell holds as many comma-separated values (commas inside brackets, braces or
    parentheses do not split); each value is read as YAML (``[]``, ``{}``, ``null``, ``true``,
    ``1e-4``), backticks dropped, and may carry an annotation in parentheses after it
    (``null (SmolLM2's in config.yaml)``, ``1.0 (config.yaml: 0.0)``); an annotation
    ``config.yaml: V`` must be config/config.yaml's value of the key, any other is not compared;
  - ``—`` says the schema gives the setting no default (a required key);
  - numbers compare by value (1 == 1.0), a boolean only equals a boolean.
A row for a section (``target.tiny``) covers the settings under it. Text and schema only (no
workflow run), so the check takes well under a second.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from eaglet.base import schema

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "config" / "README.md", REPO / "docs" / "configuration.md")
CONFIG_YAML = REPO / "config" / "config.yaml"
NO_DEFAULT = "—"
HEADER = re.compile(r"^\|\s*key\s*\|\s*default\s*\|")
NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
ANNOTATION = re.compile(r"^(?P<value>.*?)\s+\((?P<note>.*)\)$")
IN_CONFIG_YAML = re.compile(r"^config\.yaml:\s*(?P<value>.+)$")


@dataclass
class Row:
    where: str          # file:line
    keys: list[str]     # dotted setting paths
    values: list[str]   # the default cell's values, annotations dropped (NO_DEFAULT for none)
    notes: list[str | None]  # each value's annotation, if any


# --------------------------------------------------------------------------- reading the tables
def split_top(cell: str) -> list[str]:
    """``cell`` split at the commas outside brackets, braces and parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in cell:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def value_of(piece: str) -> tuple[str, str | None]:
    """One default value and its annotation: ``null (SmolLM2's in config.yaml)`` -> ``null``,
    ``SmolLM2's in config.yaml``."""
    m = ANNOTATION.match(piece)
    return (m.group("value").strip(), m.group("note").strip()) if m else (piece.strip(), None)


def keys_of(cell: str) -> list[str]:
    """The dotted settings a key cell names: a key without a dot after the first takes the section of
    the key before it."""
    keys: list[str] = []
    for name in re.findall(r"`([^`]+)`", cell):
        if keys and "." not in name:
            section = keys[-1].rpartition(".")[0]
            name = f"{section}.{name}" if section else name
        keys.append(name)
    return keys


def read_tables(text: str, name: str) -> tuple[list[Row], list[str]]:
    """The rows of every key/default table in ``text`` (a file called ``name``), and the problems of
    reading them (a key cell without a backticked key, a key count that the values do not match)."""
    rows: list[Row] = []
    problems: list[str] = []
    in_table = False
    for n, line in enumerate(text.splitlines(), 1):
        if HEADER.match(line):
            in_table = True
            continue
        if not in_table:
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= set("-: "):
            continue  # the |---|---| line
        where = f"{name}:{n}"
        keys = keys_of(cells[0])
        if not keys:
            problems.append(f"{where}: {cells[0]!r}: no `key` in the key cell")
            continue
        default = cells[1].replace("`", "")
        if default == NO_DEFAULT:
            values, notes = [NO_DEFAULT] * len(keys), [None] * len(keys)
        else:
            values, notes = map(list, zip(*(value_of(p) for p in split_top(default))))
        if len(values) != len(keys):
            problems.append(f"{where}: {', '.join(keys)}: {len(keys)} keys but {len(values)} default values "
                            f"({cells[1]!r})")
            continue
        rows.append(Row(where, keys, values, notes))
    return rows, problems


# --------------------------------------------------------------------------- against the schema
def parse_value(text: str):
    value = yaml.safe_load(text)
    if isinstance(value, str) and NUMBER.match(value):
        return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
    return value


def shown(value) -> str:
    """A value as the table writes it (YAML flow style: null, true, [1, 2], {})."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()


def same(a, b) -> bool:
    """Equal as settings: numbers by value (1 == 1.0), a boolean only equal to a boolean."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def mismatches(rows: list[Row]) -> list[str]:
    """Every row value that is not the schema's default, and every key the schema does not have."""
    out = []
    for row in rows:
        for key, stated in zip(row.keys, row.values):
            try:
                n = schema.node(key)
            except KeyError:
                out.append(f"{row.where}: {key}: README documents it, the schema has no such setting")
                continue
            if stated == NO_DEFAULT:
                if "default" in n:
                    out.append(f"{row.where}: {key}: README says no default ({NO_DEFAULT}), "
                               f"the schema {shown(n['default'])}")
                continue
            if "default" not in n:
                out.append(f"{row.where}: {key}: README says {stated}, the schema gives no default")
                continue
            try:
                value = parse_value(stated)
            except yaml.YAMLError as e:
                out.append(f"{row.where}: {key}: README says {stated}, not a YAML value ({e.problem}); "
                           f"the schema {shown(n['default'])}")
                continue
            if not same(value, n["default"]):
                out.append(f"{row.where}: {key}: README says {stated}, the schema {shown(n['default'])}")
    return out


def config_yaml_mismatches(rows: list[Row], config: dict | None = None) -> list[str]:
    """Every ``(config.yaml: V)`` annotation whose V is not config/config.yaml's value of the key."""
    config = config if config is not None else yaml.safe_load(CONFIG_YAML.read_text())
    out = []
    for row in rows:
        for key, note in zip(row.keys, row.notes):
            m = IN_CONFIG_YAML.match(note or "")
            if not m:
                continue
            node = config
            for part in key.split("."):
                node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
            stated = m.group("value")
            if node is KeyError:
                out.append(f"{row.where}: {key}: README says config.yaml sets {stated}, config.yaml does not set it")
            elif not same(parse_value(stated), node):
                out.append(f"{row.where}: {key}: README says config.yaml sets {stated}, config.yaml {shown(node)}")
    return out


def leaves(n: dict, path: str = "") -> list[str]:
    """Every setting of the schema (a node with no properties of its own), and every section (a node
    with properties below the top) as its path with a trailing dot."""
    out = []
    for key, sub in (n.get("properties") or {}).items():
        p = f"{path}.{key}" if path else key
        if sub.get("properties"):
            out.append(p + ".")
            out += leaves(sub, p)
        else:
            out.append(p)
    return out


def uncovered(rows: list[Row], tree: dict | None = None) -> list[str]:
    """The schema's settings no row names, neither itself nor a section above it."""
    documented = {k for row in rows for k in row.keys}
    missing = []
    for p in leaves(tree if tree is not None else schema.schema()):
        if p.endswith("."):
            continue
        parts = p.split(".")
        if not any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)):
            missing.append(p)
    return missing


def read_docs() -> tuple[list[Row], list[str]]:
    rows, problems = [], []
    for f in DOCS:
        if f.is_file():
            r, p = read_tables(f.read_text(), str(f.relative_to(REPO)))
            rows += r
            problems += p
    return rows, problems


# --------------------------------------------------------------------------- the checks
def test_the_config_readme_has_a_key_table():
    """config/README.md has a key/default table the parser reads without a problem, of at least 50 rows."""
    rows, problems = read_tables((REPO / "config" / "README.md").read_text(), "config/README.md")
    assert not problems, "config/README.md: rows the check cannot read:\n" + "\n".join(problems)
    assert len(rows) >= 50, f"config/README.md: only {len(rows)} key rows found (the table's header moved?)"


def test_every_documented_default_is_the_schemas():
    """Every default config/README.md (or docs/configuration.md) states is the schema's, and every key
    it documents is a setting of the schema: the listing names file, line, key and both values."""
    rows, problems = read_docs()
    bad = problems + mismatches(rows)
    assert not bad, "documented defaults that are not the schema's:\n" + "\n".join(bad)


def test_every_config_yaml_value_the_table_states_is_config_yamls():
    """Where the table annotates a default with config.yaml's value, that value is config/config.yaml's own
    value of the key. The annotation reads ``(config.yaml: V)``."""
    rows, _ = read_docs()
    assert any(IN_CONFIG_YAML.match(n or "") for r in rows for n in r.notes), "no (config.yaml: V) annotation read"
    bad = config_yaml_mismatches(rows)
    assert not bad, "config.yaml values the table misstates:\n" + "\n".join(bad)


def test_every_setting_of_the_schema_has_a_row():
    """Every setting of workflow/schemas/config.schema.yaml has a row in config/README.md's key table
    (a row for a section covers the settings under it)."""
    rows, _ = read_docs()
    missing = uncovered(rows)
    assert not missing, "settings of the schema with no row in config/README.md: " + ", ".join(missing)


def test_the_check_reports_a_stale_row_a_wrong_default_and_a_missing_setting():
    """A made-up table's stale key, wrong default, short default cell, misstated config.yaml value and
    undocumented setting are each reported, and its annotations are read apart from the values."""
    text = "\n".join([
        "Some text.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
        "| `train.no_such_key` | 3 | gone |",
        "| `train.lr`, `warmup_ratio` | 0.5, 0.015 | wrong lr |",
        "| `train.gamma` | 0.8 (config.yaml: 0.9) | annotated, right |",
        "| `train.seed`, `ttt_steps` | 0 (the default run's too), 7 (`config.yaml`: 4) | annotated |",
        "| `train.epochs`, `max_steps` | 1 | too few values |",
        "| `run` | — | required |",
        "| `target.name` | x | the schema has none |",
        "| `target.tiny` | null | a section |",
        "",
        "| `train.seed` | 99 | after the table: not read |",
    ])
    rows, problems = read_tables(text, "made-up.md")
    assert [r.keys for r in rows] == [["train.no_such_key"], ["train.lr", "train.warmup_ratio"],
                                      ["train.gamma"], ["train.seed", "train.ttt_steps"], ["run"],
                                      ["target.name"], ["target.tiny"]]
    assert (rows[2].values, rows[2].notes) == (["0.8"], ["config.yaml: 0.9"])
    assert (rows[3].values, rows[3].notes) == (["0", "7"], ["the default run's too", "config.yaml: 4"])
    assert problems == ["made-up.md:9: train.epochs, train.max_steps: 2 keys but 1 default values ('1')"]
    assert mismatches(rows) == [
        "made-up.md:5: train.no_such_key: README documents it, the schema has no such setting",
        "made-up.md:6: train.lr: README says 0.5, the schema 0.0001",
        "made-up.md:11: target.name: README says x, the schema gives no default",
    ]
    assert config_yaml_mismatches(rows, {"train": {"gamma": 0.9}}) == [
        "made-up.md:8: train.ttt_steps: README says config.yaml sets 4, config.yaml does not set it"]
    assert config_yaml_mismatches(rows, {"train": {"gamma": 0.5, "ttt_steps": 4}}) == [
        "made-up.md:7: train.gamma: README says config.yaml sets 0.9, config.yaml 0.5"]
    tree = {"properties": {"train": {"properties": {"lr": {}, "gamma": {}, "nodes": {}}},
                           "target": {"properties": {"tiny": {"properties": {"family": {}}}}}}}
    assert uncovered(rows, tree) == ["train.nodes"]


def test_values_compare_as_settings():
    """1 == 1.0 and 1e-4 == 0.0001, but true is not 1, [] is not {}, and "auto" is not null."""
    assert same(parse_value("1"), 1.0) and same(parse_value("1e-4"), 1.0e-4)
    assert same(parse_value("[mtbench, heldout]"), ["mtbench", "heldout"])
    assert same(parse_value("[<think>, </think>]"), ["<think>", "</think>"])
    assert not same(parse_value("true"), 1) and not same(parse_value("1"), True)
    assert not same(parse_value("[]"), {}) and not same(parse_value("auto"), None)
    assert split_top("true, [3], true (false in the default run)") == ["true", "[3]", "true (false in the default run)"]
    assert value_of("null (config.yaml: a, b)") == ("null", "config.yaml: a, b")
    assert shown(None) == "null" and shown([1, 2]) == "[1, 2]" and shown({}) == "{}"
