"""The code a stage runs, read from the source: the workflow lists it as the rule's inputs, so that
editing a module reruns exactly the stages whose code imports it (Snakemake's cache key and code
trigger never see modules imported by ``python -m``).

Modules are named by their dotted path under ``eaglet`` (``train.train``, ``base.files``). Imports are
read with ``ast`` from every module, function-level imports included (they run too), except those
under ``if __name__ == "__main__":`` (an entry point, not a dependency of importers). A vLLM runner
script a module copies and runs (``Path(...).with_name("vllm_*_runner.py")``) is code that module
runs. The ``__init__.py`` of every package on the way is code that runs too, and is listed.

    code_inputs.files("train.train", launcher=True)  # src/eaglet/__init__.py ... src/eaglet/train/train.py
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1]
# The launcher a rule puts in front of a stage's command (python -m eaglet.planner.gpu_slots -- ...).
LAUNCHER = "planner.gpu_slots"


def path(module: str) -> Path:
    return SRC.joinpath(*module.split(".")).with_suffix(".py")


@cache
def modules() -> tuple[str, ...]:
    """Every module of the package by dotted name (package ``__init__`` files left out)."""
    return tuple(sorted(".".join(p.relative_to(SRC).with_suffix("").parts)
                        for p in SRC.rglob("*.py") if p.name != "__init__.py"))


def _by_stem() -> dict[str, str]:
    stems: dict[str, str] = {}
    for m in modules():
        stem = m.rsplit(".", 1)[-1]
        stems[stem] = m if stem not in stems else ""  # "" = ambiguous: not resolvable by stem
    return stems


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


@cache
def imports(module: str) -> frozenset[str]:
    """The eaglet modules ``module`` imports or runs (see the module docstring)."""
    text = path(module).read_text()
    tree = ast.parse(text)
    skip = {id(n) for top in tree.body if _is_main_guard(top) for n in ast.walk(top)}
    known, here = set(modules()), module.rsplit(".", 1)[0] if "." in module else ""
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "eaglet" and len(parts) > 1:
                found.add(".".join(parts[1:]))
            elif len(parts) == 1 and name != "eaglet":
                # a runner's `from vllm_env import ...` (copied beside it)
                found.add(f"{here}.{name}" if here else name)
    stems = _by_stem()
    found |= {stems.get(stem, "") for stem in re.findall(r'with_name\("(\w+)\.py"\)', text)}
    return frozenset(m for m in found if m in known and m != module)


def closure(module: str) -> set[str]:
    """``module`` and every eaglet module it imports or runs, transitively."""
    seen, todo = {module}, [module]
    while todo:
        for m in imports(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def files(stage: str, launcher: bool = False, root: str = "src/eaglet") -> list[str]:
    """The files of ``stage``'s closure (and the launcher's) with their packages' ``__init__.py``,
    as the rule's code inputs."""
    mods = closure(stage) | (closure(LAUNCHER) if launcher else set())
    # every package on the way, a sub-package's parent too (export.contract.record: export, export.contract)
    inits = {"__init__"} | {".".join(m.split(".")[:i]) + ".__init__" for m in mods for i in range(1, m.count(".") + 1)}
    return [f"{root}/{m.replace('.', '/')}.py" for m in sorted(mods | inits)]
