"""The fork server (eaglet/engines/forkserver.py) that the suite starts vLLM's runners from: a script it
runs sees what a fresh interpreter would (argv, folder, environment, sys.path, output files, exit
code), a kill past the time limit takes the script's whole session, and settings that act only when
an interpreter starts send the script to a fresh one. Run here with this venv's interpreter and a
cheap preload, the same code as with vLLM's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet.engines import vllm_env

SCRIPT = """import json, os, sys
import helper_mod
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("EAGLET_X"),
                  "path": sys.path[:2], "helper": helper_mod.VALUE, "ppid": os.getppid()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "thread":  # the interpreter's exit waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
    sys.exit(0)
if sys.argv[1] == "crash":
    raise ValueError("the script's own error")
if sys.argv[1] == "signal":
    os.kill(os.getpid(), 15)
sys.exit(int(sys.argv[1]))
"""


def _gone(pid: int, seconds: float = 5) -> bool:
    """Whether ``pid`` ends (or is a zombie, reaped by init once killed) within ``seconds``."""
    for _ in range(int(seconds * 10)):
        try:
            if "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def servers(tmp_path, monkeypatch):
    where = tmp_path / "fs"
    monkeypatch.setenv(vllm_env.FORKSERVER_VAR, str(where))
    yield where
    for pid in where.glob("*.pid"):
        try:
            os.killpg(int(pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(tmp_path, arg, env=None, timeout=60, script="s.py"):
    work = tmp_path / "work"
    (work / "lib").mkdir(parents=True, exist_ok=True)
    (work / "lib" / "helper_mod.py").write_text("VALUE = 'from PYTHONPATH'\n")
    (tmp_path / script).write_text(SCRIPT)
    # as eaglet.engines.vllm_env.process_env hands it: the caller's PYTHON* settings left out
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env = {**base, "EAGLET_X": "42", "PYTHONPATH": str(work / "lib"), **(env or {})}
    log = tmp_path / f"{arg}.log"
    with open(log, "w") as fh:
        rc = vllm_env.run([sys.executable, tmp_path / script, arg, "two words"], log=fh, env=env, cwd=work,
                          timeout=timeout, preload=("json",))
    lines = log.read_text().splitlines()
    return rc, json.loads(lines[0]), lines[1:]


def test_a_forked_script_sees_what_a_fresh_interpreter_gives_it(tmp_path, servers, monkeypatch):
    forked = _run(tmp_path, "3")
    (pid_file,) = servers.glob("*.pid")
    assert forked[1]["ppid"] == int(pid_file.read_text())  # the server's child, not this process's
    monkeypatch.delenv(vllm_env.FORKSERVER_VAR)
    fresh = _run(tmp_path, "3")
    assert fresh[1]["ppid"] == os.getpid()
    for got in (forked, fresh):
        rc, seen, rest = got
        assert rc == 3 and rest == ["to stderr"]
        assert seen["argv"] == ["3", "two words"] and seen["cwd"] == str(tmp_path / "work") and seen["x"] == "42"
        assert seen["path"] == [str(tmp_path), str(tmp_path / "work" / "lib")] and seen["helper"] == "from PYTHONPATH"


def test_a_crash_or_a_signal_is_the_exit_code_a_fresh_interpreter_gives(tmp_path, servers):
    rc, _, rest = _run(tmp_path, "crash")
    assert rc == 1 and rest[0] == "to stderr" and rest[-1] == "ValueError: the script's own error"
    assert _run(tmp_path, "signal")[0] == -signal.SIGTERM
    assert _run(tmp_path, "0")[0] == 0


def test_past_the_time_limit_the_scripts_whole_session_is_killed(tmp_path, servers):
    (tmp_path / "hang.py").write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'])\n"
        "open(sys.argv[1], 'w').write(str(p.pid))\n"
        "time.sleep(300)\n")
    child = tmp_path / "grandchild.pid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with open(tmp_path / "hang.log", "w") as fh, pytest.raises(subprocess.TimeoutExpired):
        vllm_env.run([sys.executable, tmp_path / "hang.py", child], log=fh, env=env, cwd=tmp_path, timeout=3,
                     preload=("json",))
    assert any(servers.glob("*.sock"))  # it was the server's child
    pid = int(child.read_text())
    assert _gone(pid), f"the script's own child {pid} outlived the kill"


def test_settings_read_at_an_interpreters_start_get_a_fresh_one_or_their_own_server(tmp_path, servers):
    # LD_PRELOAD (the timed evaluation's Intel OpenMP) acts only when an interpreter starts: a fresh one
    assert _run(tmp_path, "0", env={"LD_PRELOAD": ""})[1]["ppid"] == os.getpid()
    assert _run(tmp_path, "0", env={"PYTHONHASHSEED": "1"})[1]["ppid"] == os.getpid()
    assert not any(servers.glob("*.pid"))
    # OpenMP's settings are read when torch loads it, in the server: one server for each set
    one = _run(tmp_path, "0", env={"OMP_WAIT_POLICY": "PASSIVE"})[1]["ppid"]
    two = _run(tmp_path, "0", env={"OMP_WAIT_POLICY": "ACTIVE"})[1]["ppid"]
    assert one != two and one != os.getpid() and two != os.getpid()
    assert _run(tmp_path, "0", env={"OMP_WAIT_POLICY": "PASSIVE"})[1]["ppid"] == one
    assert len(list(servers.glob("*.pid"))) == 2


# ----------------------------------------------------------------- `python` for a test's Snakemake jobs
JOB = """import json, os, sys, threading, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "x": os.environ.get("EAGLET_X"), "ppid": os.getppid(),
                  "torch": "torch" in sys.modules}), flush=True)
if sys.argv[1] == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
if sys.argv[1] == "thread":  # the interpreter's exit waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
    sys.exit(0)
if sys.argv[1] == "crash":  # the stages' log set-up puts an uncaught error in their log files this way
    sys.excepthook = lambda kind, e, tb: print("hook:", e, file=sys.stderr)
    raise ValueError("the job's own error")
sys.exit(int(sys.argv[1]))
"""


def _job(shim_dir: Path, work: Path, *args, env=None, python="python") -> tuple[int, dict, str]:
    """``python -m job_mod ARGS`` in ``work`` as a Snakemake job's shell runs it: ``python`` from PATH."""
    full = {**os.environ, "PATH": f"{shim_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin",
            "EAGLET_X": "7", **(env or {})}
    p = subprocess.run(["bash", "-c", f'{python} -m job_mod "$@"', "job", *args], cwd=work, env=full,
                       capture_output=True, text=True, timeout=120)
    first, *rest = p.stdout.splitlines()
    return p.returncode, json.loads(first), "\n".join([*rest, p.stderr])


@pytest.fixture
def shim(tmp_path, servers):
    """A job's folder, and a shim (a cheap preload) whose servers stop after ``idle`` seconds."""
    from eaglet.engines import forkserver

    work = tmp_path / "job"
    work.mkdir()
    (work / "job_mod.py").write_text(JOB)
    return lambda idle=60: (forkserver.write_shim(servers, sys.executable, preload=("json",), idle=idle), work)


def test_the_shim_runs_a_job_as_python_m_would_from_a_server(shim, servers):
    shim_dir, work = shim()
    rc, forked, _ = _job(shim_dir, work, "3", "two words")
    (pid_file,) = servers.glob("*.pid")
    assert rc == 3 and forked["ppid"] == int(pid_file.read_text())
    rc, fresh, _ = _job(shim_dir, work, "3", "two words", python=sys.executable)
    assert rc == 3 and fresh["ppid"] != forked["ppid"]
    for python in ("python", sys.executable):
        rc, _, out = _job(shim_dir, work, "crash", python=python)  # the job's own hook reports it, exit 1
        assert rc == 1 and out.strip() == "hook: the job's own error", out
        rc, _, out = _job(shim_dir, work, "thread", python=python)  # its threads are waited for
        assert rc == 0 and out.strip() == "thread done", out
    for seen in (forked, fresh):
        assert seen["argv"] == ["3", "two words"] and seen["cwd"] == str(work) and seen["path0"] == str(work)
        assert seen["name"] == "__main__" and seen["x"] == "7"
    # the variables that differ between jobs share a server; OpenMP's thread count (set per job) gets its own
    assert _job(shim_dir, work, "0", env={"PYTEST_CURRENT_TEST": "other", "EAGLET_X": "8"})[1]["ppid"] == forked["ppid"]
    other = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    assert _job(shim_dir, work, "0", env={"OMP_NUM_THREADS": other})[1]["ppid"] not in (forked["ppid"], fresh["ppid"])
    # an option for the interpreter itself: the interpreter runs it
    p = subprocess.run([shim_dir / "python", "-c", "import os, sys; print(os.getppid(), sys.flags.isolated)"],
                       capture_output=True, text=True, env={**os.environ}, timeout=60)
    assert p.stdout.split() == [str(os.getpid()), "0"], p


def test_the_shim_hands_a_signal_to_the_job_and_dies_of_it(shim, tmp_path):
    shim_dir, work = shim()
    ready = tmp_path / "job.pid"
    env = {**os.environ, "PATH": f"{shim_dir}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.Popen([shim_dir / "python", "-m", "job_mod", "sleep", ready], cwd=work, env=env,
                         stdout=subprocess.DEVNULL)
    for _ in range(300):
        if ready.exists() and ready.read_text():
            break
        time.sleep(0.1)
    job = int(ready.read_text())
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert _gone(job), f"the job {job} outlived its shim's SIGTERM"


def test_an_idle_server_stops_and_the_next_job_starts_another(shim, servers):
    shim_dir, work = shim(idle=1)
    first = _job(shim_dir, work, "0")[1]["ppid"]
    for _ in range(100):
        if not any(servers.glob("*.sock")):
            break
        time.sleep(0.1)
    assert not any(servers.glob("*.sock")) and not any(servers.glob("*.pid"))
    assert _job(shim_dir, work, "0")[1]["ppid"] not in (first, os.getpid())


def test_the_jobs_server_imports_what_the_stages_import(tmp_path, servers):
    """The suite's own shim (conftest.py), with its real preload: torch is there before the job runs."""
    from eaglet.engines import forkserver

    work = tmp_path / "job"
    work.mkdir()
    (work / "job_mod.py").write_text(JOB)
    shim_dir = forkserver.write_shim(tmp_path / "stage", sys.executable)
    rc, seen, _ = _job(shim_dir, work, "0", env={"EAGLET_FORKSERVER_DIR": str(servers)})
    (pid_file,) = servers.glob("*.pid")
    assert rc == 0 and seen["torch"] and seen["ppid"] == int(pid_file.read_text())


def test_snakemake_forked_from_its_server_runs_in_its_own_folder(tmp_path, servers):
    """The tests' `python -m snakemake` (conftest.snakemake_cmd) from a server that imported Snakemake in
    another folder: the run folder Snakemake took as it loaded is the child's, and the job runs."""
    from eaglet.engines import forkserver

    shim_dir = forkserver.write_shim(servers, sys.executable, preload=forkserver.SNAKEMAKE_PRELOAD, folder="smk")
    outs = []
    for python in (shim_dir / "python", sys.executable):
        wf = tmp_path / f"wf-{len(outs)}"
        wf.mkdir()
        (wf / "Snakefile").write_text('rule a:\n    output: "done.txt"\n    shell: "echo ok > {output}"\n')
        p = subprocess.run([python, "-m", "snakemake", "--cores", "1"], cwd=wf, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0 and (wf / "done.txt").read_text() == "ok\n", p.stderr[-2000:]
        outs.append(p.stdout + p.stderr)
        assert f"Run directory: {wf}\n" in outs[-1], outs[-1]
    assert len(list(servers.glob("*.pid"))) == 1  # the first was the server's child
