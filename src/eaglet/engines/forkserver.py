"""A fork server: an interpreter of one of eaglet's venvs that imports what its scripts need once and
then runs each script (or ``-m`` module) it is sent in a forked child, as if ``python SCRIPT ARGS`` had
been started with the given environment, working folder and standard streams.

What it saves is the import. Two users, both only where ``$EAGLET_FORKSERVER_DIR`` names a folder for
the servers' sockets (tests/conftest.py sets it for a test run, and stops the servers at its end):
- vLLM's runners (eaglet.engines.vllm_env.start): ``from vllm import LLM`` is ~7.5 s of CPU, and a run
  of the test suite starts ~35 of them (21 contract runs, 10 timed evaluations, 4 parity probes);
  SGLang's loader runner the same way (its preload, the runner's own ``preload()``, ~7 s; ~30 runs);
- the stages' jobs of the tests' Snakemake runs, through :func:`shim`, a ``python`` put first on their
  PATH: torch, transformers and pandas are ~3.3 s of CPU in every job, ~200 jobs a run; and the tests'
  own ``python -m snakemake`` (~1.2 s of Snakemake's import in each of ~140 starts).
A run without it, ``make run`` included, starts a fresh interpreter for every script and job; the suite's
end-to-end test of the default model, its SLURM cluster and its fault injection do too, so that path
stays proven (counted 2026-12-07; docs/measurements.md).

The child is what a fresh interpreter would be, less the import: its own session (a kill reaches
the engine's processes), the sender's environment (``os.environ`` replaced before the script runs;
nothing here touches torch, so its thread pools start in the child, from that environment), working
folder, argv, ``sys.path`` (the script's folder, or for ``-m`` the working folder, first, then
``$PYTHONPATH``'s) and standard streams (the sender's file descriptors, passed over the socket). What
takes effect only when an interpreter or its libraries load is the server's, so the server is keyed by
it: vLLM's by OpenMP's and the allocator's settings, a fresh interpreter where a request sets others
(LD_PRELOAD, PYTHON* but PYTHONPATH); the jobs' by their whole environment but the variables that
differ from job to job and that nothing reads as it loads (:data:`PER_JOB`). Its exit code is the
script's, or -N for signal N. Nothing is forked while a Python thread runs: the server checks that the
import started none (the native threads torch and Arrow's allocator start as they load stay behind in
the server; the child starts its own thread pools). A server with ``--idle`` stops after that many
seconds with nothing to run.

Standard library only (it runs in the engine's venv, where eaglet is not installed, and as the jobs'
``python -IS``):

    python forkserver.py --socket DIR/NAME.sock --preload vllm   # serves until killed
"""
from __future__ import annotations

import argparse
import array
import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

MAX_REQUEST = 1 << 22  # the request's JSON (argv, environment, folder), bytes
KILL = b"k"


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a 4-byte length, then the JSON, with the three stream descriptors attached."""
    fds = array.array("i")
    head, anc, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if not head:
        raise EOFError
    if len(head) != 4:
        raise ValueError("short request")
    (n,) = struct.unpack("!I", head)
    if n > MAX_REQUEST:
        raise ValueError(f"request of {n} bytes")
    body = b""
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    return json.loads(body), list(fds)


def _child(req: dict, fds: list[int], listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: become the script's (or module's) process and run it; never returns."""
    code = 1
    try:
        listener.close()
        for c in conns:
            c.close()
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _renew_import_time_state()
        module = req.get("module")
        if module:  # ``python -m MODULE ARGS``: the working folder first on sys.path
            sys.argv = ["-m", *req["argv"]]  # run_module puts the module's file in argv[0]
            sys.path.insert(0, os.getcwd())
        else:
            script = os.path.abspath(req["argv"][0])  # run_path puts it in argv[0], as __file__ would be
            sys.argv = [script, *req["argv"][1:]]
            sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
        # $PYTHONPATH's folders next, as a fresh interpreter puts them (a vLLM plugin's dist-info among
        # them is found when vLLM loads its plugins, at the engine's start)
        sys.path[1:1] = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 -- a crash is exit code 1, as in a fresh interpreter,
            sys.excepthook(type(e), e, e.__traceback__)  # reported by the script's own hook (its log files)
            code = 1
        # as an interpreter's exit: its threads joined (an executor's pending work among them), then atexit
        with contextlib.suppress(Exception):
            threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


_KEPT: list[dict] = []  # the preloaded files' globals: what they made lives as long as the server


def _renew_import_time_state() -> None:
    """What a preloaded module took from the server's process as it loaded, taken again from the child's:
    tempfile's folder (gettempdir asks the environment again) and the run folder Snakemake's Workflow
    reads when snakemake.workflow loads (it prints it and records it with each run)."""
    tempfile.tempdir = None
    workflow = sys.modules.get("snakemake.workflow")
    if workflow is not None and hasattr(workflow, "Workflow"):
        workflow.Workflow._rundir = str(Path.cwd().absolute())


def _preload(names: list[str]) -> None:
    """Import each ``module`` or ``module:attr,attr`` (an attribute that a lazy package, as transformers,
    imports only when it is asked for); or run ``FILE.py:function`` (the file's folder stays off sys.path,
    so nothing beside it shadows the venv's modules), as SGLang's runner prepares its imports."""
    for name in names:
        module, _, attrs = name.partition(":")
        if module.endswith(".py"):
            _KEPT.append(runpy.run_path(module, run_name="__forkserver_preload__"))
            _KEPT[-1][attrs]()
            continue
        m = importlib.import_module(module)
        for a in filter(None, attrs.split(",")):
            getattr(m, a)


def serve(path: str, preload: list[str], idle: float | None = None) -> None:
    _preload(preload)
    if threading.active_count() != 1:
        raise SystemExit(f"forkserver: importing {preload} started {threading.active_count() - 1} thread(s): "
                         "forking would copy their locks mid-use")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(16)
    os.replace(tmp, path)  # clients see the socket only once it listens
    ino = os.stat(path).st_ino  # a later server's socket at the same path is not this one's to remove
    print(f"forkserver: {sys.executable} serving {path} (preloaded {preload})", flush=True)
    running: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    last = time.monotonic()
    while True:
        conns = list(running.values())
        ready, _, _ = select.select([listener, *conns], [], [], 0.05)
        if running or ready:
            last = time.monotonic()
        elif idle is not None and time.monotonic() - last > idle:
            # idle: gone from the folder first (a client that finds no socket starts a new server), then
            # whatever connected in between is refused, and its client starts a fresh interpreter
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == ino:
                    os.unlink(path)
            pid_file = os.path.splitext(path)[0] + ".pid"  # where the client that started it wrote its pid
            with contextlib.suppress(OSError, ValueError):
                if int(open(pid_file).read()) == os.getpid():
                    os.unlink(pid_file)
            print(f"forkserver: idle for {idle:.0f} s, stopping", flush=True)
            return
        for c in ready:
            if c is listener:
                conn, _ = listener.accept()
                try:
                    req, fds = _recv_request(conn)
                except EOFError:  # a client seeing whether the server answers
                    conn.close()
                    continue
                except (OSError, ValueError) as e:
                    print(f"forkserver: bad request: {e}", flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, listener, [*conns, conn])
                for fd in set(fds):
                    os.close(fd)
                running[pid] = conn
                conn.sendall(struct.pack("!i", pid))
            else:  # the sender hung up or asked for a kill: the child's whole session goes
                pid = next(p for p, k in running.items() if k is c)
                for kill in (os.killpg, os.kill):  # its session; itself, should it not have one yet
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                rc = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(struct.pack("!i", rc))
                except OSError:
                    pass
                conn.close()



# --------------------------------------------------------------------------- the client's side
# A request with one of these in its environment gets a fresh interpreter: they act only when one starts
# (a preloaded library, the interpreter's own settings; PYTHONPATH the child puts on sys.path itself).
def needs_fresh(env: dict) -> bool:
    return "LD_PRELOAD" in env or any(k.startswith("PYTHON") and k != "PYTHONPATH" for k in env)


def connects(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def server_socket(where: Path, python: Path, env: dict, preload: tuple[str, ...] | list[str],
                  key: list, idle: float | None = None) -> Path:
    """The socket of the server for ``python``'s venv with ``preload`` imported and ``key`` (the settings
    it was started with that a child cannot change: those read when a library loads), started if none
    answers (one start at a time: a lock file beside it). The server runs the venv's interpreter by its
    resolved folder (a clone's venv may be a link that goes with the clone), with ``env``, and stops
    after ``idle`` seconds with nothing to run (None: when it is killed)."""
    import fcntl
    import hashlib
    import subprocess

    venv = python.absolute().parent.parent.resolve()
    digest = hashlib.sha256(json.dumps([str(venv), list(preload), key]).encode()).hexdigest()[:16]
    sock = where / f"{digest}.sock"
    if connects(sock):
        return sock
    where.mkdir(parents=True, exist_ok=True)
    with open(where / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if connects(sock):
            return sock
        logf = where / f"{digest}.log"
        cmd = [str(venv / "bin" / python.name), str(Path(__file__).absolute()), "--socket", str(sock)]
        for m in preload:
            cmd += ["--preload", m]
        if idle is not None:
            cmd += ["--idle", str(idle)]
        with open(logf, "ab") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=where,
                                    start_new_session=True)
        (where / f"{digest}.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + 300
        while not connects(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = logf.read_text(errors="replace").strip().splitlines()[-6:]
                raise RuntimeError(f"the fork server for {venv} did not start (log {logf}):\n" + "\n".join(tail))
            time.sleep(0.1)
    return sock


class Forked:
    """A script (or ``module``) run by a fork server, with the part of ``subprocess.Popen`` eaglet uses:
    ``pid`` (the child's), ``returncode`` (-N for signal N), ``poll()``, ``wait(timeout)`` and ``kill()``
    (the child's whole session). ``fds``: the child's standard input, output and error."""

    def __init__(self, sock: Path, argv: list[str], fds: tuple[int, int, int], env: dict,
                 cwd: str | os.PathLike, module: str | None = None):
        self.args, self.returncode = argv, None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(sock))
        req = {"argv": argv, "env": env, "cwd": os.path.abspath(cwd)}
        if module:
            req["module"] = module
        body = json.dumps(req).encode()
        socket.send_fds(self._sock, [struct.pack("!I", len(body))], list(fds))
        self._sock.sendall(body)
        self.pid = self._read_int()

    def _read_int(self) -> int:
        data = b""
        while len(data) < 4:
            chunk = self._sock.recv(4 - len(data))
            if not chunk:
                raise RuntimeError(f"the fork server hung up running {self.args[:1]}")
            data += chunk
        return struct.unpack("!i", data)[0]

    def poll(self) -> int | None:
        import subprocess

        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._read_int()
            self._sock.close()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                self._sock.sendall(KILL)
            except OSError:
                pass

    def send_signal(self, sig: int) -> None:
        """``sig`` to the child's session (to the child, should it not have one yet)."""
        if self.returncode is None:
            for send in (os.killpg, os.kill):
                try:
                    send(self.pid, sig)
                    return
                except (ProcessLookupError, PermissionError):
                    continue


# --------------------------------------------------------------------------- `python` for a test's jobs
# What the stages' jobs import (torch, transformers and its model and tokenizer classes, the Parquet
# and safetensors readers): ~3.3 s of CPU that a fresh interpreter pays in every job.
STAGE_PRELOAD = ("torch", "numpy", "pandas", "pyarrow.parquet", "safetensors.torch", "yaml",
                 "transformers:AutoConfig,AutoModelForCausalLM,AutoTokenizer,PreTrainedTokenizerFast")
# What the tests' own `python -m snakemake` imports (its command line, API, scheduler and executors: ~1.2 s
# of CPU in each of ~140 starts a run), for the shim of conftest.snakemake_cmd
SNAKEMAKE_PRELOAD = ("snakemake.cli", "snakemake.api", "snakemake_interface_executor_plugins.registry")
# The settings that differ between a test's jobs and that neither the interpreter nor anything preloaded
# reads as it starts: every other one keys its own server, started with it (OpenMP's thread count, which
# Snakemake sets per job, LD_PRELOAD and the interpreter's PYTHON* among them), so no setting needs a
# fresh interpreter here
PER_JOB = ("PWD", "OLDPWD", "SHLVL", "_", "PATH", "PYTEST_", "SNAKEMAKE_", "EAGLET_")
STAGE_IDLE_S = 300.0
SHIM = """#!{python} -IS
# `python` for the jobs of a test's Snakemake runs: eaglet/engines/forkserver.py's shim()
import sys
sys.path.insert(0, {here!r})
import forkserver
forkserver.shim(preload={preload!r}, idle={idle!r})
"""


def stage_key(env: dict) -> list:
    return sorted((k, v) for k, v in env.items() if not (k in PER_JOB or k.startswith(PER_JOB)))


def write_shim(where: Path, python: str | os.PathLike, preload: tuple[str, ...] = STAGE_PRELOAD,
               idle: float | None = STAGE_IDLE_S, folder: str = "bin") -> Path:
    """A folder holding ``python``, to put first on a job's PATH: it runs ``python -m MODULE ARGS`` and
    ``python SCRIPT ARGS`` as forked children of a server of ``python``'s venv that has imported
    ``preload`` and stops after ``idle`` seconds with nothing to run (any other command line execs
    ``python`` itself). The folder (``where/folder``) is returned."""
    bin_dir = where / folder
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "python"
    tmp = bin_dir / f".python.{os.getpid()}"
    tmp.write_text(SHIM.format(python=Path(python).absolute(), here=str(Path(__file__).absolute().parent),
                               preload=tuple(preload), idle=idle))
    tmp.chmod(0o755)
    os.replace(tmp, shim)
    return bin_dir


def shim(argv: list[str] | None = None, preload: tuple[str, ...] = STAGE_PRELOAD,
         idle: float | None = STAGE_IDLE_S) -> None:
    """The shim's body (run by ``python -IS``, so the standard library only): the job's command line to
    the server named by ``$EAGLET_FORKSERVER_DIR``, its signals to the child's session, the child's exit
    (a signal's death re-raised) as its own. Unset, another command line, or a server that will not
    take it: ``sys.executable`` (the venv's interpreter) runs it instead."""
    argv = sys.argv[1:] if argv is None else argv
    real = sys.executable
    env = dict(os.environ)
    where = env.get("EAGLET_FORKSERVER_DIR")
    if len(argv) >= 2 and argv[0] == "-m" and not argv[1].startswith("-"):
        module, rest = argv[1], argv[2:]
    elif argv and not argv[0].startswith("-"):
        module, rest = None, argv
    else:  # an option for the interpreter itself (-c, -u, -X ...), or none
        where = None
    if not where:
        os.execv(real, [real, *argv])
    try:
        sock = server_socket(Path(where), Path(real), env, preload, stage_key(env), idle=idle)
        proc = Forked(sock, rest, (0, 1, 2), env, os.getcwd(), module=module)
    except (OSError, RuntimeError) as e:  # the server would not take it: a fresh interpreter does
        print(f"forkserver: {e}; a fresh interpreter runs it", file=sys.stderr, flush=True)
        os.execv(real, [real, *argv])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda n, _frame: proc.send_signal(n))
    rc = proc.wait()
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="the Unix socket to serve on")
    p.add_argument("--preload", action="append", default=[],
                   help="a module to import before serving (module:attr,attr also asks for attributes)")
    p.add_argument("--idle", type=float, default=None, help="stop after this many seconds with nothing to run")
    a = p.parse_args(argv)
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder's modules must not shadow the engine's (eaglet.engines.vllm_env)
    serve(a.socket, a.preload, a.idle)


if __name__ == "__main__":
    main()
