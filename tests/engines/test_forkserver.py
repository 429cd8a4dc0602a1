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
if sys.argv[1] == "crash":
    raise ValueError("the script's own error")
if sys.argv[1] == "signal":
    os.kill(os.getpid(), 15)
sys.exit(int(sys.argv[1]))
"""


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
    for _ in range(50):  # reaped by init once killed
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the script's own child {pid} outlived the kill")


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
