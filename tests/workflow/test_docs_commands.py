"""README.md and docs/ held to their conventions (docs/architecture.md, "Commands in these documents").

- README.md is for the people who use eaglet: at most 260 lines, none over 200 characters, no
  internal issue numbers, the suite-time sentence marked for updating, a link to every docs/ file.
- Every relative link in README.md and docs/*.md points to a file of this repository (and, with an
  anchor into a Markdown file, to one of its headings); every ``eagle3.md §N`` / ``snakemake.md``
  citation in the code, the Makefile and the docs points to docs/eagle3.md's section N or to
  docs/snakemake.md; every ``eaglet.<package>.<module>`` the docs name exists under src/.
- The commands marked runnable run. The convention: in a fenced ```bash block of README.md or
  docs/*.md, a command whose last line ends with the comment ``# runs here`` is cheap (well under
  30 s) and needs nothing but the workflow's venv (``make venv``); a line ending in a backslash
  continues the command on the next line. Each marked command runs with bash, exactly as written,
  in a fresh copy of the repository (``clone()`` of tests/conftest.py plus tests/, scripts/,
  benchmarks/ and docs/), with this interpreter's bin folder first on PATH (so ``python`` and
  ``snakemake`` are the venv's), a private output cache and TMPDIR, and must exit 0. A command
  without the mark is documentation: the text beside it says what it needs first.

The link and citation checks are cheap (``make test-fast`` runs them); running the commands starts
Snakemake, so those tests are marked ``dag``.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clone

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [README, *DOCS]
RUNS_HERE = "# runs here"
SUITE_TIME = "<!-- suite-time -->"
# Internal tracker references ("issue 15", "#27", "stop 33") belong in docs/ history, not the README.
INTERNAL_REF = re.compile(r"\bissues? \d+|#\d+\b|\bstops? \d+\b", re.I)
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# "eagle3.md §6", "[eagle3.md](eagle3.md) §5, §6", "snakemake.md"
EAGLE3_CITE = re.compile(r"eagle3\.md\)?\s*(§\s*\d+(?:\s*(?:,|and|or)\s*§?\s*\d+)*)")
SNAKEMAKE_CITE = re.compile(r"snakemake\.md\)?\s*(§\s*\d+(?:\s*(?:,|and|or)\s*§?\s*\d+)*)?")
MODULE = re.compile(r"\beaglet(?:\.[A-Za-z_]\w*)+")


# --------------------------------------------------------------------------- reading Markdown
def lines_with_blocks(text: str):
    """Yield ``(line number, line, block)`` for every line outside the fence lines themselves:
    ``block`` is None in prose, else ``(block index, language)`` of the fenced block it is in."""
    fence, lang, index = None, "", -1
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, lang, index = m.group(1), m.group(2).lower(), index + 1
                continue
            yield n, line, None
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2):
            fence = None
        else:
            yield n, line, (index, lang)


def bash_commands(path: Path) -> list[tuple[int, str]]:
    """``(first line number, command)`` of every command in the file's ```bash blocks; a line
    ending in a backslash continues the command on the next line."""
    out, cmd, first, current = [], [], 0, None
    for n, line, block in lines_with_blocks(path.read_text()):
        if block != current and cmd:  # a block ended inside a continued command
            out.append((first, "\n".join(cmd)))
            cmd = []
        current = block
        if block is None or block[1] != "bash":
            continue
        if not cmd:
            if not line.strip():
                continue
            first = n
        cmd.append(line)
        if not line.rstrip().endswith("\\"):
            out.append((first, "\n".join(cmd)))
            cmd = []
    if cmd:
        out.append((first, "\n".join(cmd)))
    return out


def runnable() -> list:
    return [pytest.param(cmd, id=f"{p.relative_to(REPO)}:{n}")
            for p in MARKDOWN for n, cmd in bash_commands(p) if cmd.rstrip().endswith(RUNS_HERE)]


RUNNABLE = runnable()


def prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, inline code spans removed (links there are examples)."""
    return [(n, re.sub(r"`[^`]*`", "", line)) for n, line, block in lines_with_blocks(path.read_text())
            if block is None]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line, block in lines_with_blocks(path.read_text()):
        m = HEADING.match(line) if block is None else None
        if not m:
            continue
        s = slug(m.group(2))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def sections(path: Path) -> set[int]:
    """The numbered sections of a reference file: headings ``## N. Title``."""
    return {int(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(\d+)\.\s", path.read_text(), re.M)}


# --------------------------------------------------------------------------- the README
def test_readme_is_short_and_for_users():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move detail into docs/"
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters (line, length): {long}"
    refs = [(n, m.group(0)) for n, line in enumerate(lines, 1) for m in INTERNAL_REF.finditer(line)]
    assert not refs, f"README.md names internal issue numbers (line, text): {refs}"
    assert text.count(SUITE_TIME) == 1, f"README.md must mark its suite-time sentence with {SUITE_TIME} once"


def test_readme_links_every_doc():
    text = README.read_text()
    missing = [d.name for d in DOCS if f"](docs/{d.name})" not in text]
    assert not missing, f"README.md does not link {missing}"


# --------------------------------------------------------------------------- links and citations
def test_relative_links_resolve():
    root = REPO.resolve()
    bad = []
    for md in MARKDOWN:
        for n, line in prose(md):
            for target in LINK.findall(line):
                where = f"{md.relative_to(REPO)}:{n}: {target}"
                if SCHEME.match(target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (md.parent / path).resolve() if path else md.resolve()
                if dest != root and root not in dest.parents:
                    bad.append(f"{where} (outside the repository)")
                elif not dest.exists():
                    bad.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{where} (no heading '{anchor}' in {dest.relative_to(root)})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def cited_files() -> list[Path]:
    here = Path(__file__).resolve()
    files = [*(REPO / "src").rglob("*.py"), *(REPO / "workflow").rglob("*"), *(REPO / "tests").rglob("*.py"),
             *(REPO / "benchmarks").rglob("*.py"), *(REPO / "scripts").rglob("*"), *(REPO / "config").rglob("*"),
             REPO / "Makefile", REPO / "Snakefile", *MARKDOWN]
    return sorted({f for f in files if f.is_file() and f.resolve() != here and "__pycache__" not in f.parts
                   and not any(p.endswith(".egg-info") for p in f.parts)})


def test_eagle3_and_snakemake_citations_resolve():
    eagle3, snakemake = REPO / "docs" / "eagle3.md", REPO / "docs" / "snakemake.md"
    have = {eagle3: sections(eagle3) if eagle3.is_file() else set(),
            snakemake: sections(snakemake) if snakemake.is_file() else set()}
    bad, cited = [], set()
    for f in cited_files():
        text = f.read_text(errors="ignore")
        for doc, pattern, name in ((eagle3, EAGLE3_CITE, "eagle3.md"), (snakemake, SNAKEMAKE_CITE, "snakemake.md")):
            if name not in text:
                continue
            if not doc.is_file():
                bad.append(f"{f.relative_to(REPO)} cites {name}, which is not in docs/")
                continue
            for m in pattern.finditer(text):
                for num in map(int, re.findall(r"\d+", m.group(1) or "")):
                    if doc == eagle3:
                        cited.add(num)
                    if num not in have[doc]:
                        line = text[:m.start()].count("\n") + 1
                        bad.append(f"{f.relative_to(REPO)}:{line} cites {name} §{num}: no section {num}.")
    assert not bad, "\n".join(bad)
    assert cited, "no eagle3.md §N citation found at all: the pattern no longer matches the code"


def test_docs_cite_nothing_outside_the_repository():
    bad = [f"{md.relative_to(REPO)}:{n}" for md in MARKDOWN for n, line in enumerate(md.read_text().splitlines(), 1)
           if "shared/docs" in line or "../shared" in line]
    assert not bad, f"docs point outside the repository: {bad}"


def module_exists(name: str) -> bool:
    """``eaglet.a.b.attr``: every package on the way exists; the first module file ends the path
    (what follows it is an attribute); a capitalised name may be an attribute of a package."""
    path = REPO / "src" / "eaglet"
    for part in name.split(".")[1:]:
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            return True
        else:
            return part[:1].isupper() and path != REPO / "src" / "eaglet"
    return True


def test_module_names_in_the_docs_exist():
    bad = sorted({f"{md.relative_to(REPO)}:{n}: {m.group(0)}" for md in MARKDOWN
                  for n, line in enumerate(md.read_text().splitlines(), 1)
                  for m in MODULE.finditer(line) if not module_exists(m.group(0))})
    assert not bad, "the docs name modules that do not exist:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- runnable commands
def test_runnable_commands_are_found():
    found = "\n".join(p.values[0] for p in RUNNABLE)
    for needle in ("python -m eaglet.workflow.summary --help", "python -m eaglet.planner.plan",
                   "--configfile config/smoke.yaml -n", "scripts/gpu-check.sh --dry-run"):
        assert needle in found, f"no command marked '{RUNS_HERE}' contains {needle!r}"


@pytest.fixture(scope="module")
def docs_copy(tmp_path_factory):
    """A fresh copy of the repository: the workflow (conftest's clone) plus what the documented
    commands use besides it."""
    root = clone(tmp_path_factory.mktemp("docs") / "repo")
    for name in ("tests", "scripts", "benchmarks", "docs", "README.md", "Makefile"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", ".venv"))
        else:
            shutil.copy2(src, root / name)
    return root


@pytest.mark.dag
@pytest.mark.parametrize("command", RUNNABLE)
def test_marked_command_runs_in_a_fresh_copy(command, docs_copy, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SNAKEMAKE_OUTPUT_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(["bash", "-c", command], cwd=docs_copy, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}: {command}\n{(p.stdout + p.stderr)[-4000:]}"
