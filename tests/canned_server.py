"""A canned OpenAI-compatible chat server for the generate tests and the fault suite, and the
conversations they send it.

    with serve_canned() as base_url:     # http://127.0.0.1:PORT/v1; Canned.calls counts requests
        ...
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from eaglet.base.conversations import read_conversations, write_conversations

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "tea", "bees", "glass", "trains", "maps",
          "snow", "clocks", "salt", "owls", "bridges", "paper"]


def make_conversations(path: Path, n: int, multi_every: int = 3) -> list[dict]:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]} ({i})."},
                {"role": "assistant", "content": "source answer"}]
        if multi_every and i % multi_every == 0:
            msgs = [{"role": "system", "content": "Be brief."}] + msgs + [
                {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "source answer 2"}]
        rows.append({"id": f"c{i:04d}", "source": "test", "messages": msgs})
    write_conversations(path, rows)
    return rows


def assistant_texts(path: Path) -> dict[str, list[str]]:
    return {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"]
            for r in read_conversations(path)}


class Canned(BaseHTTPRequestHandler):
    """Answers chat completions by keyword in the last user message (see `reply`)."""

    calls: dict = {}
    # Every reply's reasoning when set: a reasoning model behind the server's reasoning parser.
    reasoning: str | None = None
    # The kill tests' gate: once ``slow_budget`` SLOW requests have been answered, the next ones
    # wait until ``slow_gate`` is set, so a job is surely mid-flight when it is killed, on any CPU.
    slow_budget: int | None = None
    slow_answered = 0
    slow_gate = threading.Event()

    def log_message(self, *a):
        pass

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "canned", "object": "model", "created": 0,
                                                      "owned_by": "test"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = req["messages"][-1]["content"]
        n = Canned.calls[last] = Canned.calls.get(last, 0) + 1
        msg = {"role": "assistant", "content": f"echo {last}"}
        if "SLOW" in last:
            time.sleep(0.15)
            if Canned.slow_budget is not None and Canned.slow_answered >= Canned.slow_budget:
                Canned.slow_gate.wait(600)
            Canned.slow_answered += 1
        if "FLAKY" in last and n <= 2:
            return self._send(503, {"error": {"message": "overloaded", "type": "x", "code": 503}})
        if "LONG" in last:
            return self._send(400, {"error": {"message": "This model's maximum context length is 8 tokens",
                                              "type": "BadRequestError", "code": 400}})
        if Canned.reasoning:
            msg["reasoning_content"] = Canned.reasoning
        if "REASON" in last:  # older vLLM field name
            msg["reasoning_content"] = "First, think about it."
        if "THINK" in last:  # vLLM >= 0.11 field name
            msg["reasoning"] = "Hmm, let me see."
        if "RAW" in last:  # the parser was off: thinking left inside the content
            msg["content"] = "<think>hmm</think>The answer."
        if "EMPTY" in last:
            msg["content"] = ""
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": req["model"],
                         "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}})


@contextlib.contextmanager
def serve_canned(reasoning: str | None = None):
    """The canned server on a free port, for the block; its base URL. ``reasoning``: given with
    every reply."""
    Canned.calls, Canned.reasoning = {}, reasoning
    Canned.slow_budget, Canned.slow_answered = None, 0
    Canned.slow_gate.clear()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    finally:
        Canned.slow_gate.set()  # a held request answers (to a client long gone) and its thread ends
        srv.shutdown()
