"""The test suite's time ledger: each test folder's measured time beside its budget (tests/budget.toml).

    python scripts/suite_ledger.py [--durations logs/test-durations.txt] [--wall-s S] [--installs-s S]
        prints one line per folder (measured minutes, budget, over or not) and the suite's wall time
        beside the total budget; names every folder over its budget. It warns, it does not fail:
        a busy or slower machine is noise, not a broken change (exit 0 unless the input is missing).
    python scripts/suite_ledger.py --record
        writes tests/timings.json from the durations: each module's seconds, which the test scheduler
        (tests/suite_schedule.py) reads to hand out the longest work first.

A folder's time is the sum of its tests' times (setup, call and teardown), so with two workers the
folders add up to more than the wall time. A folder with no budget line is reported as such: every
new test folder comes with its line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
BUDGET = REPO / "tests" / "budget.toml"
DURATIONS = REPO / "logs" / "test-durations.txt"
TIMINGS = REPO / "tests" / "timings.json"
ROW = re.compile(r"^\s*([\d.]+) s  (\S.*)$")


def read_durations(path: Path) -> dict[str, float]:
    """Test id -> seconds, from the list tests/conftest.py writes."""
    out = {}
    for line in path.read_text().splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(2)] = float(m.group(1))
    return out


def folder_of(nodeid: str) -> str:
    """``tests/x/test_y.py::t`` -> ``tests/x``; a module at the top of tests/ is in ``tests``."""
    return str(Path(nodeid.split("::", 1)[0]).parent)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def read_budget(path: Path = BUDGET) -> dict:
    data = tomllib.loads(path.read_text())
    folders = data.get("folders", {})
    bad = [k for k, v in folders.items() if not isinstance(v, (int, float)) or v <= 0]
    if bad:
        raise ValueError(f"{path}: [folders] budgets must be positive minutes: {bad}")
    return data


def ledger(durations: dict[str, float], budget: dict, wall_s: float | None = None,
           installs_s: float | None = None) -> tuple[list[str], list[str]]:
    """The printed lines, and the names of what went over its budget."""
    by_folder: dict[str, float] = defaultdict(float)
    for node, s in durations.items():
        by_folder[folder_of(node)] += s
    folders = budget.get("folders", {})
    lines, over = [], []
    lines.append(f"{'folder':<24} {'measured':>9} {'budget':>7}")
    for name in sorted(set(by_folder) | set(folders), key=lambda f: -by_folder.get(f, 0.0)):
        m = by_folder.get(name, 0.0) / 60
        b = folders.get(name)
        if b is None:
            note = "NO BUDGET LINE"
            over.append(name)
        elif m > b:
            note = f"OVER by {m - b:.1f} min"
            over.append(name)
        else:
            note = ""
        lines.append(f"{name:<24} {m:8.1f}m {(f'{b:g}m' if b is not None else '-'):>7}  {note}".rstrip())
    lines.append(f"{'sum of test times':<24} {sum(by_folder.values()) / 60:8.1f}m "
                 f"{sum(folders.values()):6g}m")
    total = budget.get("total", {})
    if wall_s is not None and "make_test_minutes" in total:
        m, b = wall_s / 60, total["make_test_minutes"]
        lines.append(f"{'make test (wall)':<24} {m:8.1f}m {b:6g}m  {'OVER' if m > b else ''}".rstrip())
        if m > b:
            over.append("make test")
    if wall_s is not None and installs_s is not None and "ci_minutes" in total:
        m, b = (wall_s + installs_s) / 60, total["ci_minutes"]
        lines.append(f"{'.ci/run in all':<24} {m:8.1f}m {b:6g}m  {'OVER' if m > b else ''}".rstrip())
        if m > b:
            over.append(".ci/run in all")
    return lines, over


def record(durations: dict[str, float], path: Path = TIMINGS) -> dict[str, float]:
    by_module: dict[str, float] = defaultdict(float)
    for node, s in durations.items():
        by_module[module_of(node)] += s
    modules = {m: round(s, 1) for m, s in sorted(by_module.items())}
    path.write_text(json.dumps({"about": "seconds per test module from logs/test-durations.txt "
                                         "(scripts/suite_ledger.py --record); tests/suite_schedule.py "
                                         "hands out the longest first", "modules": modules}, indent=1) + "\n")
    return modules


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--durations", type=Path, default=DURATIONS)
    ap.add_argument("--budget", type=Path, default=BUDGET)
    ap.add_argument("--wall-s", type=float, help="make test's wall time in seconds")
    ap.add_argument("--installs-s", type=float, help="the installs' wall time in seconds")
    ap.add_argument("--record", action="store_true", help="write tests/timings.json from the durations")
    a = ap.parse_args(argv)
    if not a.durations.exists():
        print(f"suite_ledger: no durations at {a.durations} (tests/conftest.py writes it at the end of a run)",
              file=sys.stderr)
        return 2
    durations = read_durations(a.durations)
    if a.record:
        mods = record(durations)
        print(f"suite_ledger: {len(mods)} modules, {sum(mods.values()) / 60:.1f} min, into {TIMINGS}")
        return 0
    lines, over = ledger(durations, read_budget(a.budget), a.wall_s, a.installs_s)
    print("\n".join(f"ledger: {line}" for line in lines))
    if over:
        print(f"ledger: WARNING over budget: {', '.join(over)} (a warning: timings on a busy machine are noise; "
              "a lasting overrun needs a cut or a new budget line with its reason)")
    else:
        print("ledger: every folder within its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
