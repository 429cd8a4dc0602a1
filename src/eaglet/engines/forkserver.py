"""A fork server for one of eaglet's separate environments (vLLM's, SGLang's): an interpreter of that
venv that imports the engine once and then runs each script it is sent in a forked child, as if
``python SCRIPT ARGS`` had been started with the given environment, working folder and output files.

What it saves is the engine's import: ``from vllm import LLM`` takes ~7.5 s of CPU here, and a run of
the test suite starts ~35 vLLM runners (21 contract runs, 10 timed evaluations, 4 parity probes,
counted 2026-12-07; docs/measurements.md). It is
used only where ``$EAGLET_FORKSERVER_DIR`` names a folder for the servers' sockets (tests/conftest.py
sets it for a test run, and stops the servers at its end); a run without it, ``make run`` included,
starts a fresh interpreter for every script (eaglet.engines.vllm_env.start). The end-to-end test of
the default model runs without it, so that path stays proven too.

The child is what a fresh interpreter would be, less the import: its own session (a kill reaches
the engine's processes), the sender's environment (``os.environ`` replaced before the script runs;
nothing here touches torch, so its thread pools start in the child, from that environment), working
folder, argv, ``sys.path`` (the script's folder first, then ``$PYTHONPATH``'s) and standard streams
(the sender's file descriptors, passed over the socket). What takes effect only when an interpreter
or its libraries load is the server's: the client starts one server per set of such settings
(OpenMP's, the allocator's) and a fresh interpreter where the request sets others (LD_PRELOAD,
PYTHON* but PYTHONPATH). Its exit code is the script's, or -N for signal N. Nothing is
forked while a thread runs: the server checks that the import started none.

Standard library only (it runs in the engine's venv, where eaglet is not installed):

    python forkserver.py --socket DIR/NAME.sock --preload vllm   # serves until killed
"""

from __future__ import annotations

import argparse
import array
import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback

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
    """In the forked child: become the script's process and run it; never returns."""
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
        script = os.path.abspath(req["argv"][0])
        sys.argv = [script, *req["argv"][1:]]
        sys.path[0] = os.path.dirname(script)
        # $PYTHONPATH's folders next, as a fresh interpreter puts them (a vLLM plugin's dist-info among
        # them is found when vLLM loads its plugins, at the engine's start)
        sys.path[1:1] = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 -- a script's crash is its exit code 1, as in a fresh interpreter
            traceback.print_exc()
            code = 1
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


def serve(path: str, preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise SystemExit(f"forkserver: importing {preload} started {threading.active_count() - 1} thread(s): "
                         "forking would copy their locks mid-use")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(16)
    os.replace(tmp, path)  # clients see the socket only once it listens
    print(f"forkserver: {sys.executable} serving {path} (preloaded {preload})", flush=True)
    running: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while True:
        conns = list(running.values())
        ready, _, _ = select.select([listener, *conns], [], [], 0.05)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="the Unix socket to serve on")
    p.add_argument("--preload", action="append", default=[], help="a module to import before serving")
    a = p.parse_args(argv)
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder's modules must not shadow the engine's (eaglet.engines.vllm_env)
    serve(a.socket, a.preload)


if __name__ == "__main__":
    main()
