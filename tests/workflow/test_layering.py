"""The layering rule, read from the code itself (the rule is written in ``eaglet/__init__.py``; each
package's ``MAY_IMPORT`` names what it may import):

- imports point only downward: a package imports only what its ``MAY_IMPORT`` names, and the
  package graph has no circle (nor has the module graph);
- no stage package imports another (stages meet through artifacts on disk), and no shared package
  imports a stage package;
- a sub-package (``export/contract/``) declares its own ``MAY_IMPORT``: what outside itself it may
  import, packages its parent may import and modules of its parent by name; nothing else;
- a rule runs ``python -m eaglet.<its rule file's package>.<module>``, and lists as inputs exactly
  the code that module runs (eaglet.workflow.code_inputs), so editing a module reruns exactly the
  stages whose code imports it;
- no re-export shim, and no private name imported across modules.

Imports are read with ``ast`` from every module, function-level imports included (they run too),
except those under ``if __name__ == "__main__":``. A vLLM runner script a module copies and runs
(``Path(...).with_name("vllm_*_runner.py")``) is code that module runs.
"""

import ast
import re
from pathlib import Path

from eaglet.workflow import code_inputs

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "eaglet"
RULES = sorted((REPO / "workflow" / "rules").glob("*.smk"))
LAUNCHER = code_inputs.LAUNCHER
SHARED = {"base", "target", "hidden", "drafter", "engines", "planner"}
STAGE_PACKAGES = {"data", "generate", "features", "train", "export", "eval", "learning_curve", "report"}


def _may_import(init: Path) -> tuple[str, ...]:
    """The MAY_IMPORT tuple an ``__init__.py`` declares, read without importing it."""
    tree = ast.parse(init.read_text())
    may = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
           and any(getattr(t, "id", None) == "MAY_IMPORT" for t in n.targets)]
    assert len(may) == 1, f"{init}: one MAY_IMPORT = (...) tuple"
    return tuple(may[0])


def packages() -> dict[str, tuple[str, ...]]:
    """{package: its MAY_IMPORT}, read from each ``__init__.py`` without importing it."""
    return {init.parent.name: _may_import(init) for init in sorted(SRC.glob("*/__init__.py"))}


def sub_packages() -> dict[str, tuple[str, ...]]:
    """{sub-package (``export.contract``): its MAY_IMPORT}, read as :func:`packages` reads a package's."""
    return {".".join(init.parent.relative_to(SRC).parts): _may_import(init)
            for init in sorted(SRC.glob("*/*/__init__.py"))}


def package_of(module: str) -> str:
    return module.split(".", 1)[0]


# Rules whose shell line has one branch per drafter.kind (workflow/rules/train.smk, export.smk): the
# DFlash module first, then the P-EAGLE one, the EAGLE-3 one (the rule's stage) last; code=stage_code
# picks the same way.
KIND_BRANCHES = {"train": ("train.dflash_train", "train.p_eagle_train"),
                 "export": ("export.dflash_export", "export.p_eagle_export")}


def rules() -> dict[str, dict]:
    """{rule: {"file": its rule file's stem, "stage": the module it runs or None, "code": its code
    inputs (the EAGLE-3 branch's), "launcher": bool, "kinds": the other kinds' branch modules}}."""
    out = {}
    for smk in RULES:
        parts = re.split(r"^rule (\w+):", smk.read_text(), flags=re.M)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            ran = re.findall(r"-m eaglet\.([\w.]+)", body)  # python -m, or torchrun -m
            stages = [m for m in ran if m != LAUNCHER]
            kinds = ()
            if name in KIND_BRANCHES and len(stages) == 1 + len(KIND_BRANCHES[name]):
                kinds, stages = tuple(stages[:-1]), stages[-1:]
                assert kinds == KIND_BRANCHES[name], (smk.name, name, kinds)
            assert len(stages) <= 1, (smk.name, name, stages)
            code = re.search(r"code=stage_code\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)", body, re.S)  # 2 levels
            code = code and " ".join(code.group(1).split())
            if code and kinds:  # each kind's module picked by its flag, the EAGLE-3 one last
                assert all(f'"{k}" if' in code for k in kinds), (name, code)
                code = re.findall(r'"[\w.]+"', code)[-1] + (", launcher=True" if "launcher=True" in code else "")
            out[name] = {"file": smk.stem, "stage": stages[0] if stages else None, "launcher": LAUNCHER in ran,
                         "code": code or None, "kinds": kinds}
    return out


STAGES = {r["stage"] for r in rules().values() if r["stage"]} | {k for r in rules().values() for k in r["kinds"]}


def test_the_packages_are_the_rule_files_and_the_shared_ones():
    assert set(packages()) == SHARED | STAGE_PACKAGES | {"workflow"}
    # every module lives in a package: nothing flat beside eaglet/__init__.py
    assert [p.name for p in SRC.glob("*.py")] == ["__init__.py"]
    stems = {p.stem for p in (REPO / "workflow" / "rules").glob("*.smk")} - {"common"}
    assert stems == STAGE_PACKAGES, stems


def test_a_rule_runs_a_module_of_its_rule_files_package():
    """A reader finds a rule's code from its rule file's name in one hop."""
    for name, r in rules().items():
        for stage in filter(None, (r["stage"], *r["kinds"])):
            assert package_of(stage) == r["file"], f"rule {name} ({r['file']}.smk) runs eaglet.{stage}"
    assert {"data.target_model", "data.prompts", "data.tokenization", "data.freq", "data.vocab", "features.extract",
            "train.train", "export.export", "eval.evaluate_offline", "eval.evaluate_speculative", "eval.evaluate_modes",
            "eval.evaluate_vllm", "eval.regenerated", "eval.eval_summary",
            "generate.generate", "report.plots", "report.provenance"} <= STAGES, STAGES
    assert STAGES <= set(code_inputs.modules())


def test_imports_point_only_downward():
    """Each package imports only what its MAY_IMPORT names; no stage package names another, no
    shared package names a stage package, and the package graph has no circle."""
    may = packages()
    bad = {}
    for m in code_inputs.modules():
        pkg = package_of(m)
        above = {package_of(i) for i in code_inputs.imports(m)} - {pkg} - set(may[pkg])
        if above:
            bad[m] = sorted(above)
    assert not bad, f"imports a package its MAY_IMPORT does not name: {bad}"
    for pkg, allowed in may.items():
        if pkg in STAGE_PACKAGES:
            assert not set(allowed) & STAGE_PACKAGES, (pkg, allowed)
        if pkg in SHARED:
            assert set(allowed) <= SHARED, (pkg, allowed)
    # no circle: a topological order exists
    order, left = [], dict(may)
    while left:
        ready = [p for p, a in left.items() if set(a) <= set(order)]
        assert ready, f"a circle among {sorted(left)}"
        order += sorted(ready)
        for p in ready:
            del left[p]


def test_a_sub_package_imports_only_what_its_may_import_names():
    """A sub-package's MAY_IMPORT names what outside itself it may import: packages its parent's
    MAY_IMPORT names, or modules of its parent by dotted name. The export contract imports no stage
    module (export.export runs it) and, of the export, only the writer its known answer writes with."""
    subs, may = sub_packages(), packages()
    assert "export.contract" in subs, subs
    bad = {}
    for sub, allowed in subs.items():
        parent = sub.rsplit(".", 1)[0]
        for a in allowed:
            if "." in a:
                assert package_of(a) == parent and a in code_inputs.modules(), f"{sub}: MAY_IMPORT {a!r}"
            else:
                assert a in may[parent], f"{sub}: MAY_IMPORT {a!r}, which {parent} may not import"
        for m in code_inputs.modules():
            if not m.startswith(sub + "."):
                continue
            outside = {i for i in code_inputs.imports(m) if not i.startswith(sub + ".")}
            above = {i for i in outside if i not in allowed and package_of(i) not in allowed}
            if above:
                bad[m] = sorted(above)
    assert not bad, f"imports what its sub-package's MAY_IMPORT does not name: {bad}"
    assert "export.export" not in subs["export.contract"]


def test_no_circle_among_modules():
    graph = {m: set(code_inputs.imports(m)) for m in code_inputs.modules()}
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError(f"import circle: {' -> '.join(path + [m])}")
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = 2

    for m in graph:
        visit(m, [])


def test_no_reexport_shim_and_no_private_name_across_modules():
    for p in sorted(SRC.rglob("*.py")):
        text = p.read_text()
        assert "noqa: F401" not in text, f"{p}: a re-export (an import only there to be imported again)"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eaglet"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{p}: imports private {private} from {node.module}"


def test_the_workflow_reads_no_stage_at_parse_time():
    used = set()
    for f in [*RULES, REPO / "Snakefile"]:
        for mod, _names in re.findall(r"^\s*from eaglet\.(\w+)(?:\.\w+)? import ([\w, ]+)", f.read_text(), re.M):
            used.add(mod)
    assert used and not used & STAGE_PACKAGES, used


def test_every_rule_lists_the_code_its_stage_runs():
    """Code inputs are what reruns a stage when its code changes (the cache key never sees code
    imported by `python -m`): every rule that runs a stage derives them from that stage's whole
    import closure (eaglet.workflow.code_inputs), with the launcher's when the rule runs one."""
    for name, r in rules().items():
        if r["stage"] is None:
            continue
        want = f'"{r["stage"]}"' + (", launcher=True" if r["launcher"] else "")
        assert r["code"] == want, f"rule {name} runs eaglet.{r['stage']}: code=stage_code({want}), not {r['code']}"
    # what only the parse reads is no stage's code: editing the tiny families' specs (which
    # eaglet.target.shape reads to resolve the layer ids) reruns target_model, nothing else
    assert not [s for s in STAGES if "target.shape" in code_inputs.closure(s)]
    assert [s for s in STAGES if "target.families" in code_inputs.closure(s)] == ["data.target_model"]
    files = code_inputs.files("train.train", launcher=True)
    assert {"src/eaglet/train/train.py", "src/eaglet/planner/gpu_slots.py", "src/eaglet/base/artifacts.py",
            "src/eaglet/train/__init__.py", "src/eaglet/__init__.py"} <= set(files)
    assert "src/eaglet/export/export.py" not in files and files == sorted(set(files))
    assert all((REPO / f).is_file() for f in files)


def test_the_contract_is_code_of_the_export_and_what_follows_only():
    """Editing the export's contract (its check names included) is a code change of export and of
    nothing before it: not target_model (which hashes the target's weights), prompts, tokenize,
    extraction or training."""
    users = {s for s in STAGES if "export.contract.record" in code_inputs.closure(s)}
    assert "export.export" in users
    assert not users & {"data.target_model", "data.prompts", "data.tokenization", "data.freq", "data.vocab",
                        "generate.generate", "features.extract", "train.train"}, users


def test_imports_are_read_as_written():
    """The reader itself: a function-level import counts, a `__main__` guard's does not, a copied
    runner does, and a runner's bare import is its folder's module."""
    assert "engines.hf_loop" in code_inputs.imports("export.contract.reference")  # function-level
    assert {"engines.vllm_check_runner", "engines.vllm_env"} <= code_inputs.closure("export.contract.vllm_checks")
    # a sub-package's module: its own and its parent's __init__.py are code that runs
    assert {"src/eaglet/export/__init__.py", "src/eaglet/export/contract/__init__.py",
            "src/eaglet/export/contract/record.py"} <= set(code_inputs.files("export.contract.record"))
    assert "engines.vllm_env" in code_inputs.imports("engines.vllm_eval_runner")


# --------------------------------------------------------------------------- names that hide nothing


def _is_eaglet_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "eaglet":
        return False
    path = SRC.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_aliases(text: str) -> list[tuple[int, str]]:
    """Each import that gives one of eaglet's modules another name (``from eaglet.x import y as z``,
    ``import eaglet.x.y as z``, z != y), with its line."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if a.asname and a.asname != a.name and _is_eaglet_module(f"{node.module}.{a.name}"):
                    out.append((node.lineno, f"{node.module}.{a.name} as {a.asname}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.asname != a.name.rsplit(".", 1)[-1] and _is_eaglet_module(a.name):
                    out.append((node.lineno, f"{a.name} as {a.asname}"))
    return out


def test_no_import_renames_a_module():
    """A module is read under its own name everywhere (code, tests, benchmarks, scripts, rule files):
    an alias (``model as em``, ``load as target``) hides where the code lives (issue 42)."""
    found = []
    files = [*SRC.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"),
             *(REPO / "scripts").rglob("*.py")]
    for f in files:
        found += [f"{f.relative_to(REPO)}:{line}: {what}" for line, what in module_aliases(f.read_text())]
    for f in RULES:  # rule files: their Python import statements
        text = f.read_text()
        statements = r"^[ \t]*((?:from eaglet\S* import (?:\([^)]*\)|[^\n]+))|import eaglet[^\n]*)$"
        for m in re.finditer(statements, text, re.M):
            line = text.count("\n", 0, m.start()) + 1
            found += [f"{f.relative_to(REPO)}:{line}: {what}" for _, what in module_aliases(m.group(1))]
    assert not found, "imports that rename a module:\n" + "\n".join(found)


def test_the_alias_check_finds_what_it_is_for():
    """The check above finds a renamed module and leaves names and third-party aliases alone."""
    text = ("from eaglet.drafter import eagle3 as em\nimport eaglet.base.files as f\n"
            "from eaglet.base.files import read_json as rj\nimport numpy as np\nfrom eaglet.base import files\n")
    assert [what for _, what in module_aliases(text)] == ["eaglet.drafter.eagle3 as em", "eaglet.base.files as f"]


def test_no_module_shadows_the_standard_library():
    """No module of eaglet is named like a standard-library module or a builtin (``io``, ``format``,
    ``tokenize``): inside its package, or run as a script, it would hide the real one."""
    import builtins
    import sys

    clash = sorted(str(p.relative_to(REPO)) for p in SRC.rglob("*.py")
                   if p.stem in sys.stdlib_module_names or p.stem in vars(builtins))
    assert not clash, f"modules named like the standard library or a builtin: {clash}"


def test_the_workflow_parses_without_torch():
    """Every `snakemake` start (each dry run, each SLURM job) imports what the rule files import: none
    of it brings torch (1.2 s of CPU a start on a 2-core machine, ~40 % of a parse). A module the
    parse reads a name from imports torch inside the function that needs it (sglang_check's
    engine_error, vllm_format's RoPE fields)."""
    import subprocess
    import sys

    statements = r"^[ \t]*((?:from eaglet\S* import (?:\([^)]*\)|[^\n]+))|import eaglet[^\n]*)$"
    found = [m.group(1) for f in [REPO / "Snakefile", *RULES] for m in re.finditer(statements, f.read_text(), re.M)]
    assert any("eaglet.workflow.resolve" in s for s in found) and len(found) > 8, found
    code = "import sys\n" + "\n".join(found) + "\nprint('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "False", "the rule files' imports bring torch:\n" + "\n".join(found)
