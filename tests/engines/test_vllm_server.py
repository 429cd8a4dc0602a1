"""Tests for eaglet.engines.vllm_server: process-group stop, start-up failure reporting, /metrics scraping."""

import os
import subprocess
import time

import pytest

from conftest import VLLM_ENV, vllm_env_or_skip
from eaglet.engines import vllm_env, vllm_server
from eaglet.engines.vllm_server import Server, ServerError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_missing_env_is_a_clear_error(tmp_path):
    with pytest.raises(ServerError, match="setup.sh"):
        vllm_server.start("model", work_dir=tmp_path, env=tmp_path / "nope")


def test_stop_kills_the_whole_process_group(tmp_path):
    # A parent that leaves a grandchild behind, as vLLM's API server does with its engine workers.
    pidfile = tmp_path / "child.pid"
    proc = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {pidfile}; trap '' TERM; wait"],
                            start_new_session=True)
    while not pidfile.exists() or not pidfile.read_text().strip():
        time.sleep(0.02)
    child = int(pidfile.read_text())
    srv = Server(process=proc, port=0, model="x", log_path=tmp_path / "log")
    t0 = time.monotonic()
    srv.stop(grace_s=1)  # the parent ignores SIGTERM: SIGKILL after the grace period
    assert proc.poll() is not None and not _alive(child)
    assert time.monotonic() - t0 < 10


def test_metrics_parser_sums_engines_and_positions(tmp_path):
    # Real Prometheus text as vLLM writes it, served over HTTP, parsed by the real scraper.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    text = (
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 10.0\n'
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="t"} 5.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 45.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 27.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 12.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 9.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="2"} 6.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.7e+09\n')

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        m = vllm_server.spec_decode_metrics(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
    assert m["num_drafts"] == 15 and m["num_draft_tokens"] == 45 and m["num_accepted_tokens"] == 27
    assert m["num_accepted_tokens_per_pos"] == [12, 9, 6]
    assert m["acceptance_rate"] == pytest.approx(27 / 45)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 27 / 15)


@pytest.mark.vllm
def test_failed_start_raises_with_log_tail_and_cleans_up(tmp_path):
    env = vllm_env_or_skip()
    # A model folder without a config: vLLM exits during start-up.
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(ServerError, match="exited with code") as e:
        with vllm_server.serve(tmp_path / "empty_model", work_dir=tmp_path / "w", env=env,
                               startup_timeout_s=300):
            pytest.fail("a server on an empty folder must not become healthy")
    assert "log " in str(e.value) and str(tmp_path / "w" / "vllm_server.log") in str(e.value)
    assert len(str(e.value).splitlines()) > 3  # the tail of the server log is in the message


@pytest.mark.vllm
def test_real_server_health_models_and_metrics(vllm_tiny_server):
    import json
    import urllib.request

    srv = vllm_tiny_server
    assert srv.alive()
    with urllib.request.urlopen(f"{srv.base_url}/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]
    names = {name for name, _, _ in vllm_server.scrape_metrics(srv.root_url)}
    assert any(n.startswith("vllm:") for n in names)
    m = vllm_server.spec_decode_metrics(srv.root_url)  # no drafter: the counters are absent or zero
    assert m["num_drafts"] == 0 and m["mean_acceptance_length"] is None
    # The session server's environment: caches inside its work dir, no reserved CPU.
    env = open(f"/proc/{srv.process.pid}/environ", "rb").read().split(b"\0")
    assert b"VLLM_CPU_NUM_OF_RESERVED_CPU=0" in env
    assert any(e.startswith(b"VLLM_CACHE_ROOT=") and b"vllm_tiny" in e for e in env)
    # vLLM stored its answer about the target's model class where every later vLLM run reads it
    shared = vllm_env.vllm_python(VLLM_ENV).parent.parent / vllm_env.MODELINFOS
    assert list(shared.glob("*LlamaForCausalLM.json")), sorted(shared.parent.iterdir())


def test_server_dies_with_a_killed_parent(tmp_path):
    # The stage may be SIGKILLed (the kill -9 test, an OOM kill): the server it launched must not
    # outlive it. Same launch options as `start`, on a stand-in child process.
    import signal
    import sys

    code = ("import subprocess, sys; from eaglet.engines.vllm_server import _die_with_parent\n"
            "p = subprocess.Popen(['sleep', '300'], start_new_session=True, preexec_fn=_die_with_parent)\n"
            "print(p.pid, flush=True); p.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
