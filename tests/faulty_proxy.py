"""A faulty HTTP proxy for the fault-injection suite (tests/faults/test_faults_network.py).

It sits between an OpenAI client and a real OpenAI-compatible server and, for each POST, asks a
``plan(messages, attempt) -> action`` what to do with it:

    "pass"      forward to the server and relay its answer
    "drop"      read the request, then close the connection without an answer
    "delay"     forward, but hold the answer ``delay_s`` seconds (past the client's timeout)
    "http_500"  answer 500 Internal Server Error (the server is never asked)
    "http_429"  answer 429 Too Many Requests (the server is never asked)

``attempt`` counts the times the same request body (its ``messages``) was seen before, so a plan
that is a pure function of (messages, attempt) makes a run deterministic whatever the client's
scheduling. GETs (``/v1/models``) always pass. Every request is answered with
``Connection: close``, so the client opens one connection per request and a fault never leaks
into the next request.

    with FaultyProxy("http://127.0.0.1:8000/v1", plan, delay_s=5) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, ...)
    proxy.attempts   # {messages key: number of POSTs seen}
    proxy.events     # [(messages key, attempt, action)] in arrival order
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable

ACTIONS = ("pass", "drop", "delay", "http_500", "http_429")
REASONS = {500: "Internal Server Error", 429: "Too Many Requests"}


def messages_key(messages: list[dict]) -> str:
    """A canonical text of a request's messages (the proxy's identity of a request)."""
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)


class FaultyProxy:
    def __init__(self, upstream_base_url: str, plan: Callable[[list[dict], int], str], delay_s: float):
        u = urllib.parse.urlsplit(upstream_base_url)
        self.up_host, self.up_port, self.prefix = u.hostname, u.port, u.path.rstrip("/")
        self.plan, self.delay_s = plan, delay_s
        self.attempts: Counter = Counter()
        self.events: list[tuple[str, int, str]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="faulty-proxy", daemon=True)
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.prefix}"

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        start = asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            self.server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    # ------------------------------------------------------------------ one connection
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:] if ":" in line]
            length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
            body = await reader.readexactly(length) if length else b""
            action = "pass"
            if method == "POST":
                key = messages_key(json.loads(body)["messages"])
                attempt = self.attempts[key]
                self.attempts[key] += 1
                action = self.plan(json.loads(body)["messages"], attempt)
                assert action in ACTIONS, action
                self.events.append((key, attempt, action))
            if action == "drop":
                return  # the finally closes the socket: no status line ever reaches the client
            if action.startswith("http_"):
                code = int(action[5:])
                writer.write(_response(code, {"error": {"message": f"injected {code}", "type": "injected",
                                                        "code": code}}))
                await writer.drain()
                return
            answer = await self._forward(method, path, headers, body)
            if action == "delay":
                await asyncio.sleep(self.delay_s)  # the client has given up by now
            writer.write(answer)
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        """The server's whole answer to the request, sent with Connection: close (read to EOF)."""
        r, w = await asyncio.open_connection(self.up_host, self.up_port)
        keep = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive", "host")]
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.up_host}:{self.up_port}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in keep]
        w.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await w.drain()
        data = await r.read()
        w.close()
        return data


def _response(code: int, obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    head = (f"HTTP/1.1 {code} {REASONS.get(code, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body
