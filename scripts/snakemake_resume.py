#!/usr/bin/env python3
"""Run Snakemake, first recovering from a crashed run (what `make run` calls).

    python scripts/snakemake_resume.py snakemake --cores 2 --configfile config/config.yaml --cache

A run killed with SIGKILL (kill -9, the OOM killer, a lost node) leaves its lock in
``.snakemake/locks/`` and its unfinished outputs marked in ``.snakemake/incomplete/``; the next
run then stops at "Directory cannot be locked" until someone runs ``snakemake --unlock``, and at
IncompleteFilesException until ``--rerun-incomplete``. Here, before running the given command in
the current directory:

- no lock and no incomplete marker: the command runs as given;
- a live Snakemake process in this directory (its working directory is this one): the lock is
  its own; nothing is touched, exit 1 naming it;
- a job of a dead run still running here (``python -m eaglet.*`` with this working directory):
  rerunning now would write the same outputs twice; nothing is touched, exit 1 naming it;
- otherwise the lock is stale: say so, ``<command> --unlock``, then the command with
  ``--rerun-incomplete`` (only the jobs that did not finish run again; their stages resume
  from their own checkpoints and parts).

Linux only (it reads /proc); elsewhere it says it cannot tell and runs the command as given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def _ancestors() -> set[int]:
    """This process and its parents (make, the shell): never counted as another run."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def is_snakemake(argv: list[str]) -> bool:
    """`snakemake ...`, `python .../bin/snakemake ...` or `python -m snakemake ...`."""
    if not argv:
        return False
    if Path(argv[0]).name == "snakemake":
        return True
    return Path(argv[0]).name.startswith("python") and len(argv) > 1 and (
        Path(argv[1]).name == "snakemake" or argv[1:3] == ["-m", "snakemake"])


def is_eaglet_job(argv: list[str]) -> bool:
    """A stage of this workflow (`python -m eaglet.<stage>`, torchrun ... -m eaglet.<stage>)."""
    return any(a == "-m" and b.startswith("eaglet.") for a, b in zip(argv, argv[1:]))


def live_processes(workdir: Path) -> list[tuple[int, str, list[str]]]:
    """(pid, kind, argv) of Snakemake processes and eaglet jobs whose working directory is
    ``workdir``, other than this process and its parents."""
    mine, found = _ancestors(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in mine:
            continue
        try:
            if Path(os.readlink(d / "cwd")) != workdir:
                continue
        except OSError:
            continue
        argv = _cmdline(int(d.name))
        kind = "snakemake" if is_snakemake(argv) else "job" if is_eaglet_job(argv) else None
        if kind:
            found.append((int(d.name), kind, argv))
    return sorted(found)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    workdir = Path.cwd().resolve()
    state = workdir / ".snakemake"
    locks = sorted(p.name for p in (state / "locks").glob("*")) if (state / "locks").is_dir() else []
    incomplete = (state / "incomplete").is_dir() and any((state / "incomplete").iterdir())
    if not locks and not incomplete:
        return subprocess.call(argv)
    if not Path("/proc/self").exists():
        print("snakemake_resume: cannot tell whether a Snakemake run is live here (no /proc); running the "
              "command as given (after a crash: `snakemake --unlock`, then --rerun-incomplete)", file=sys.stderr)
        return subprocess.call(argv)
    live = live_processes(workdir)
    if live:
        pid, kind, args = live[0]
        what = "a Snakemake run" if kind == "snakemake" else "a job of an earlier run"
        print(f"snakemake_resume: {what} is still running in {workdir} (pid {pid}: {' '.join(args)[:200]}); "
              f"{len(live)} such process(es). Not unlocking: wait for it, or stop it (kill {pid}) and run again.",
              file=sys.stderr)
        return 1
    if locks:
        print(f"snakemake_resume: stale lock in {state / 'locks'} ({', '.join(locks)}): no Snakemake process "
              f"runs in {workdir}, the run that held it died. Unlocking, then resuming with --rerun-incomplete.",
              file=sys.stderr, flush=True)
        rc = subprocess.call([*argv, "--unlock"])
        if rc != 0:
            print(f"snakemake_resume: `{' '.join(argv)} --unlock` failed (exit {rc})", file=sys.stderr)
            return rc
    else:
        print("snakemake_resume: outputs of a killed run are marked incomplete; resuming with --rerun-incomplete",
              file=sys.stderr, flush=True)
    return subprocess.call([*argv, "--rerun-incomplete"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
