"""The code a stage runs, read from the source: the workflow lists it as the rule's inputs, so that
editing a module reruns exactly the stages whose code imports it (Snakemake's cache key and code
trigger never see modules imported by ``python -m``).

Imports are read with ``ast`` from every module, function-level imports included (they run too),
except those under ``if __name__ == "__main__":`` (an entry point, not a dependency of importers:
``python -m eaglet.target`` still runs the target_model stage). A vLLM runner script a module copies
and runs (``Path(__file__).with_name("vllm_*_runner.py")``) is code that module runs.

    code_inputs.files("train", launcher=True)  # src/eaglet/train.py ... src/eaglet/gpu_slots.py
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parent
# The launcher a rule puts in front of a stage's command (python -m eaglet.gpu_slots -- ...).
LAUNCHER = "gpu_slots"


def modules() -> list[str]:
    return sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


@cache
def imports(module: str) -> frozenset[str]:
    """The eaglet modules ``module`` imports or runs (see the module docstring)."""
    text = (SRC / f"{module}.py").read_text()
    tree = ast.parse(text)
    skip = {id(n) for top in tree.body if _is_main_guard(top) for n in ast.walk(top)}
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
                found.add(parts[1])
            elif len(parts) == 1 and name != "eaglet":
                found.add(name)  # a runner's `from vllm_env import ...` (copied beside it)
    found |= set(re.findall(r'with_name\("(\w+)\.py"\)', text))
    return frozenset(m for m in found if (SRC / f"{m}.py").is_file() and m != module)


def closure(module: str) -> set[str]:
    """``module`` and every eaglet module it imports or runs, transitively."""
    seen, todo = {module}, [module]
    while todo:
        for m in imports(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def files(stage: str, launcher: bool = False, root: str = "src/eaglet") -> list[str]:
    """The module files of ``stage``'s closure (and the launcher's), as the rule's code inputs."""
    mods = closure(stage) | (closure(LAUNCHER) if launcher else set())
    return [f"{root}/{m}.py" for m in sorted(mods)]
