"""The stage tables of README.md and docs/architecture.md are the rule files' (eaglet.workflow.stages):
what the files carry between the markers is what the generator writes from workflow/rules/*.smk now,
every rule is in them, and what the generator reads of a rule (its name, rule file, module and
output paths) is what Snakemake itself parses from the same files.
"""

import re
import shutil
from pathlib import Path

import pytest

from conftest import REPO, clone
from eaglet.workflow import stages

# Counted apart from the generator: every line that starts a rule, however the generator reads blocks.
RULE_LINE = re.compile(r"^\s*(?:rule|checkpoint)\s+(\w+)\s*:|^\s*use\s+rule\s+\S+\s+(?:from\s+\w+\s+)?as\s+(\w+)",
                       re.M)


def counted_rules() -> dict[str, str]:
    """``{rule: rule file}`` of every rule line of workflow/rules/*.smk, counted by a regex."""
    out = {}
    for f in sorted((REPO / stages.RULES_DIR).glob("*.smk")):
        for m in RULE_LINE.finditer(f.read_text()):
            name = m.group(1) or m.group(2)
            assert name not in out, f"rule {name} is defined twice ({out[name]}, {f.relative_to(REPO)})"
            out[name] = str(f.relative_to(REPO))
    return out


@pytest.fixture(scope="module")
def rules():
    return stages.read_rules(REPO)


@pytest.mark.parametrize("target", stages.TARGETS)
def test_marked_table_is_the_rule_files(target, rules):
    """The file's stage table is, to the byte, what eaglet.workflow.stages writes from the rule files now."""
    text = (REPO / target).read_text()
    have = stages.marked(text)
    assert have is not None, f"{target} has no {stages.BEGIN!r} ... {stages.END!r} block"
    assert text.count(stages.BEGIN) == 1, f"{target} has more than one stage table"
    want = stages.block(rules)
    assert have == want, (f"{target}'s stage table differs from the rule files: run python -m "
                          f"eaglet.workflow.stages --write\n--- in the file\n{have}\n--- generated\n{want}")


def test_every_rule_is_read_and_in_the_tables(rules):
    """Every rule line of the rule files (counted by a regex of its own) is a rule the generator read, with
    a module and resolved outputs, and a row of each table."""
    counted = counted_rules()
    assert len(counted) >= 20, f"only {len(counted)} rule lines found in {stages.RULES_DIR}/*.smk: {sorted(counted)}"
    read = {r.name: r.file for r in rules}
    assert read == counted, (f"the generator read {len(read)} rules, the rule files have {len(counted)} rule lines; "
                             f"missed: {sorted(set(counted) - set(read))}, extra: {sorted(set(read) - set(counted))}")
    for target in stages.TARGETS:
        table = stages.marked((REPO / target).read_text()) or ""
        rows = re.findall(r"^\| `(\w+)`", table, re.M)
        assert sorted(rows) == sorted(counted), f"{target}'s table rows {rows} are not the rules {sorted(counted)}"
    for r in rules:
        assert r.module, f"{r.file}:{r.line}: rule {r.name}: no module, script or run block read"
        assert r.outputs, f"{r.file}:{r.line}: rule {r.name}: no output read"
        assert not r.unresolved, (
            f"{r.file}:{r.line}: rule {r.name}: its output paths use {sorted(r.unresolved)}, which no top-level "
            "NAME = \"...\" / f\"...\" assignment of the rule files gives (eaglet.workflow.stages.assignments)")


def test_replace_rewrites_only_the_marked_block():
    """--write replaces what is between the markers and nothing else, and refuses a file without them."""
    new = f"{stages.BEGIN}\nnew\n{stages.END}"
    assert stages.replace(f"before\n{stages.BEGIN}\nold\n{stages.END}\nafter\n", new) == f"before\n{new}\nafter\n"
    with pytest.raises(ValueError, match="exactly one"):
        stages.replace("no markers", "x", "README.md")


def snakemake_rules(root: Path) -> dict:
    """``{rule: Snakemake's Rule}`` of the workflow in ``root`` parsed on config/smoke.yaml."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
        StorageSettings,
        WorkflowSettings,
    )

    with SnakemakeApi(OutputSettings(quiet={Quietness.PROGRESS})) as api:
        wf = api.workflow(resource_settings=ResourceSettings(cores=2),
                          config_settings=ConfigSettings(configfiles=[root / "config" / "smoke.yaml"]),
                          storage_settings=StorageSettings(), workflow_settings=WorkflowSettings(),
                          workdir=root, snakefile=root / "Snakefile")
        return {r.name: r for r in wf._workflow.rules}


def as_pattern(path: str) -> re.Pattern:
    """A generated path (``results/<run>/extract/shard_<shard>/``) as a regex over Snakemake's
    paths with their wildcards written ``<name>``: a placeholder stands for one path component part."""
    parts = re.split(r"(<[^<>/]+>)", path.rstrip("/"))
    return re.compile("".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts) + "$")


def test_the_generator_reads_what_snakemake_parses(rules, tmp_path):
    """Against Snakemake's own parse of the same files (config/smoke.yaml): the same rules from the
    same rule files, the module its shell runs, and every output path, folders as folders
    (an optional output may be absent under this config)."""
    root = clone(tmp_path / "repo")
    shutil.rmtree(root / "results", ignore_errors=True)
    parsed = snakemake_rules(root)
    own = {n: r for n, r in parsed.items()
           if Path(r.snakefile).resolve().parent == (root / stages.RULES_DIR).resolve()}
    assert sorted(own) == sorted(r.name for r in rules), "the generator's rules are not Snakemake's"
    for r in rules:
        smk = own[r.name]
        where = f"{r.file}:{r.line}: rule {r.name}"
        assert Path(smk.snakefile).name == Path(r.file).name, where
        shell = smk.shellcmd or ""
        found = list(stages.MODULE.finditer(shell))
        if found:
            mod, sub = found[-1].groups()
            assert r.module == (f"{mod} {sub}" if sub else mod), f"{where}: module {r.module!r}, shell {shell!r}"
        theirs = [(re.sub(r"\{(\w+)(?:,[^{}]*)?\}", r"<\1>", str(o)), bool(o.is_directory)) for o in smk.output]
        patterns = [(as_pattern(p), folder, optional, p) for p, folder, optional in r.outputs]
        for path, folder in theirs:
            hit = [x for x in patterns if x[0].match(path)]
            assert hit, f"{where}: Snakemake's output {path} is not in the generator's {[x[3] for x in patterns]}"
            assert hit[0][1] == folder, f"{where}: {path}: folder {folder} in Snakemake, {hit[0][1]} in the table"
        for pattern, _, optional, p in patterns:
            assert optional or any(pattern.match(path) for path, _ in theirs), (
                f"{where}: the generator's output {p} is not among Snakemake's {theirs}")
