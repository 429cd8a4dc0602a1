"""What the documentation cites exists: every path of this repository and every ``eaglet.*`` name
that README.md, config/README.md, docs/*.md and the packages' ``__init__.py`` (docstrings and
comments) name, read as text, so that a moved file, test or function fails here naming the file,
the line and the stale citation.

- A repository path is a word that starts with one of the repository's folders (``tests/``,
  ``src/``, ``scripts/``, ``benchmarks/``, ``workflow/``, ``docs/``, ``config/``, ``envs/``,
  ``.ci/``) at the start of a word: it must exist. ``*`` and a placeholder ``<name>`` match any
  name, ``{a,b}`` stands for both; a glob must match at least one file. A path git ignores (a
  venv of envs/) is a build output: not checked.
- A bare test file name (``test_generate.py``) must name one file under tests/.
- A ``::name`` after a file (``tests/x/test_y.py::test_z``, ``test_y.py::test_z[param]``) must be a
  function or class defined in that file (``*`` a glob over its names); a ``::name`` standing alone
  continues the last file the line names.
- An ``eaglet.<package>[.<module>[.<attribute>...]]`` must be a package or module under src/, and
  what follows the module a name it defines at its top level (then, for a class, a name its body
  defines).

Text only (no import), so the whole check takes well under a second.
"""

import ast
import fnmatch
import re
import subprocess
from functools import cache
from pathlib import Path

from conftest import REPO

ROOTS = ("tests", "src", "scripts", "benchmarks", "workflow", "docs", "config", "envs", ".ci")
PATH = re.compile(r"(?<![\w./<>{}-])((?:" + "|".join(map(re.escape, ROOTS)) + r")/[\w.*<>{},/-]*)")
# a repository path, a bare test file name, or a ``::name`` (with a pytest parameter id after it)
CITE = re.compile(PATH.pattern.replace("((?:", "(?P<path>(?:", 1)
                  + r"|(?<![\w./<>{}-])(?P<bare>test_\w+\.py)\b"
                  + r"|::(?P<test>[\w*]+(?:::[\w*]+)*)(?:\[[^\]\s]*\])?")
MODULE = re.compile(r"(?<![\w./-])eaglet(?:\.[A-Za-z_]\w*)+")
PLACEHOLDER = re.compile(r"<[^<>/]*>")


def cited_in() -> list[Path]:
    files = [REPO / "README.md", REPO / "config" / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "src").rglob("__init__.py"))]
    return [f for f in files if f.is_file()]


def where(f: Path, n: int) -> str:
    return f"{f.relative_to(REPO) if f.is_relative_to(REPO) else f.name}:{n}"


# --------------------------------------------------------------------------- paths
def expand(path: str) -> list[str]:
    """``{a,b}`` alternatives, first group first."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand(path[:m.start()] + alt.strip() + path[m.end():])]


def clean(path: str) -> str:
    """The path without the punctuation of the sentence it ends."""
    while path and path[-1] in ".,:;" :
        path = path[:-1]
    while path.count("{") < path.count("}") and path.endswith("}"):
        path = path[:-1]
    return path


def matches(path: str) -> list[Path]:
    """The files of the repository a cited path (glob, placeholder) stands for."""
    pattern = PLACEHOLDER.sub("*", path).rstrip("/")
    if not any(c in pattern for c in "*?["):
        return [REPO / pattern] if (REPO / pattern).exists() else []
    return [p for p in REPO.glob(pattern) if "__pycache__" not in p.parts]


@cache
def ignored(path: str) -> bool:
    """A path git ignores (a venv, results/): a build output, there or not in this checkout."""
    try:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", PLACEHOLDER.sub("x", path)],
                              cwd=REPO, capture_output=True).returncode == 0
    except OSError:
        return False


@cache
def files_named(name: str) -> tuple[Path, ...]:
    return tuple(p for p in (REPO / "tests").rglob(name) if "__pycache__" not in p.parts)


@cache
def defined(path: Path) -> frozenset[str]:
    """The functions and classes a Python file defines, at any depth."""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return frozenset()
    return frozenset(n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def stale_test_name(files: list[Path], cited: str) -> str | None:
    """Why ``::cited`` names nothing in ``files`` (None when it names something)."""
    py = [f for f in files if f.suffix == ".py" and f.is_file()]
    if not py:
        return f"::{cited} after a path that is not a Python file"
    for part in cited.split("::"):
        if not any(fnmatch.filter(defined(f), part) for f in py):
            return f"no function or class {part!r} in {', '.join(str(f.relative_to(REPO)) for f in py)}"
    return None


def stale_paths(f: Path) -> list[str]:
    bad = []
    for n, line in enumerate(f.read_text().splitlines(), 1):
        last: list[Path] | None = None  # the files the line's last path stands for
        for m in CITE.finditer(line):
            if m.group("test"):
                name = m.group("test")
                if last is None:
                    bad.append(f"{where(f, n)}: ::{name}: names no file before it")
                elif last and (why := stale_test_name(last, name)):
                    bad.append(f"{where(f, n)}: ::{name}: {why}")
                continue
            path = clean(m.group("path")) if m.group("path") else m.group("bare")
            last = []
            for alt in expand(path):
                hit = matches(alt) if m.group("path") else list(files_named(alt))
                if not hit and not (m.group("path") and ignored(alt)):
                    bad.append(f"{where(f, n)}: {path}: "
                               + ("no such path" if m.group("path") else "no such file under tests/")
                               + (f" ({alt})" if alt != path else ""))
                last += hit  # empty when the path is stale (said once, above)
    return bad


# --------------------------------------------------------------------------- eaglet.* names
@cache
def top_level(path: Path) -> dict[str, ast.AST | None]:
    """The names a module defines at its top level: ``{name: its class node or None}``."""
    out: dict[str, ast.AST | None] = {}
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out[name.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try)):  # names defined under a guard
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.setdefault(sub.name, sub if isinstance(sub, ast.ClassDef) else None)
    return out


def class_members(node: ast.ClassDef) -> set[str]:
    names = set()
    for sub in node.body:
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(sub.name)
        elif isinstance(sub, ast.Assign):
            names |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
            names.add(sub.target.id)
    return names


def stale_module(name: str) -> str | None:
    """Why ``eaglet.a.b.c`` names nothing under src/ (None when it names something)."""
    parts = name.split(".")
    path = REPO / "src" / "eaglet"
    i = 1
    while i < len(parts) and (path / parts[i]).is_dir() and (path / parts[i] / "__init__.py").is_file():
        path, i = path / parts[i], i + 1
    if i < len(parts) and (path / f"{parts[i]}.py").is_file():
        module, i = path / f"{parts[i]}.py", i + 1
    else:
        module = path / "__init__.py"
    if i == len(parts):
        return None
    names = top_level(module)
    shown = module.relative_to(REPO)
    if parts[i] not in names:
        if module.name == "__init__.py":
            return f"no module or package {parts[i]!r} in {shown.parent}, and {shown} defines no {parts[i]!r}"
        return f"{shown} defines no {parts[i]!r}"
    node = names[parts[i]]
    if i + 1 < len(parts) and isinstance(node, ast.ClassDef) and parts[i + 1] not in class_members(node):
        return f"class {parts[i]} in {shown} defines no {parts[i + 1]!r}"
    return None


def stale_modules(f: Path) -> list[str]:
    bad = []
    for n, line in enumerate(f.read_text().splitlines(), 1):
        for m in MODULE.finditer(line):
            if why := stale_module(m.group(0)):
                bad.append(f"{where(f, n)}: {m.group(0)}: {why}")
    return bad


# --------------------------------------------------------------------------- the tests
def test_cited_repository_paths_and_tests_exist():
    """Every repository path, test file and ``::test`` the docs and the packages' __init__ cite exists."""
    bad = [b for f in cited_in() for b in stale_paths(f)]
    assert not bad, "stale citations (file:line: cited: why):\n" + "\n".join(bad)


def test_cited_eaglet_modules_and_names_exist():
    """Every ``eaglet.*`` module, function and class the docs and the packages' __init__ name exists."""
    bad = [b for f in cited_in() for b in stale_modules(f)]
    assert not bad, "stale eaglet names (file:line: cited: why):\n" + "\n".join(bad)


def test_the_checks_see_citations_and_refuse_stale_ones(tmp_path):
    """The scanners find what the files cite (a pattern that stopped matching would pass
    everything) and name a stale path, test function and module in a made-up file."""
    found = [m.group(1) for f in cited_in() for m in PATH.finditer(f.read_text())]
    assert any(p.startswith("tests/") for p in found) and any(p.startswith("src/") for p in found), found[:20]
    assert any(MODULE.search(f.read_text()) for f in cited_in())
    assert "::" in (REPO / "docs" / "guarantees.md").read_text()
    doc = tmp_path / "_stale_citation_probe.md"
    doc.write_text("see `tests/workflow/test_doc_citations.py::test_no_such_test`, `tests/nowhere/test_x.py`,\n"
                   "`test_no_such_file.py`, `tests/workflow/test_doc_citations.py::test_cited_repository_paths_and"
                   "_tests_exist`, `::test_not_here`\nand eaglet.workflow.stages.no_such_name, eaglet.nowhere\n")
    paths, modules = stale_paths(doc), stale_modules(doc)
    text = "\n".join(paths + modules)
    assert "_stale_citation_probe.md:1: ::test_no_such_test: no function or class 'test_no_such_test'" in text, text
    assert "tests/nowhere/test_x.py: no such path" in text, text
    assert "test_no_such_file.py: no such file under tests/" in text, text
    assert "_stale_citation_probe.md:2: ::test_not_here" in text, text
    assert "test_cited_repository_paths_and" not in text.replace("::test_not_here", ""), text
    assert "eaglet.workflow.stages.no_such_name" in text and "eaglet.nowhere" in text, text
    assert len(paths) == 4 and len(modules) == 2, text
