"""Tests for eaglet.generate.generate.

Fast tests run the `local` backend on the tiny target and the `openai` backend against a small
canned OpenAI-compatible HTTP server (for what no local model can produce: reasoning fields, raw
thinking markers, 5xx/400 answers). Tests marked `vllm` run against a real vLLM CPU server.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canned_server import Canned, assistant_texts, make_conversations
from conftest import snakemake_cmd, vllm_env_or_skip
from eaglet.base.conversations import read_conversations, write_conversations
from eaglet.base.files import read_parquet
from eaglet.engines.vllm_server import free_port
from eaglet.generate.generate import generate, plan_turns, transient

ROOT = Path(__file__).resolve().parents[2]
# --------------------------------------------------------------------------- pure parts
def test_plan_turns_last_and_all():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
            {"role": "user", "content": "u2b"}, {"role": "assistant", "content": "a2"}]
    kept, answer = plan_turns(msgs, "last")
    assert [m["content"] for m in kept] == ["s", "u1", "a1", "u2", "u2b"] and answer == {4}
    kept, answer = plan_turns(msgs, "all")
    assert [m["content"] for m in kept] == ["s", "u1", "u2", "u2b"] and answer == {1, 3}
    assert plan_turns([{"role": "system", "content": "s"}], "all")[1] == set()


def test_transient_kinds():
    assert transient("connection") and transient("timeout")
    assert transient("http_503") and transient("http_429")
    assert not transient("http_400") and not transient("raw_thinking_markers") and not transient("http_x")


# --------------------------------------------------------------------------- local backend
def test_local_backend_all_turns_and_resume(tiny_target, tmp_path):
    rows = make_conversations(tmp_path / "in.parquet", 5)
    cfg = {"backend": "local", "max_tokens": 6, "turns": "all", "chunk_size": 2, "concurrency": 4}
    s = generate(tmp_path / "in.parquet", Path(tiny_target["path"]).parent / "identity.json",
                 tmp_path / "out", cfg)
    assert s["samples"] == 5 and s["errors"] == 0 and s["this_run"]["skipped"] == 0
    assert s["generated_turns"] == 5 + 2  # rows 0 and 3 have two user turns
    assert s["completion_tokens"] > 0 and sum(s["finish_reasons"].values()) == 7
    out = read_conversations(tmp_path / "out" / "conversations.parquet")
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    roles = [m["role"] for m in out[0]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert all("source answer" not in m["content"] for r in out for m in r["messages"])
    assert read_parquet(tmp_path / "out" / "errors.parquet").num_rows == 0
    # A rerun does nothing and keeps the accounting.
    s2 = generate(tmp_path / "in.parquet", Path(tiny_target["path"]).parent / "identity.json",
                  tmp_path / "out", cfg)
    assert s2["this_run"] == {**s2["this_run"], "success": 0, "error": 0, "skipped": 5}
    assert assistant_texts(tmp_path / "out" / "conversations.parquet") == {
        r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in out}
    # Other sampling settings: the old parts are discarded, everything is redone.
    s3 = generate(tmp_path / "in.parquet", Path(tiny_target["path"]).parent / "identity.json",
                  tmp_path / "out", {**cfg, "max_tokens": 3})
    assert s3["this_run"]["success"] == 5 and s3["completion_tokens"] <= 3 * 7


# A reasoning reply as each family's target writes it after the generation prompt (its stop
# token last), and the parts a reasoning parser splits it into.
SCRIPTED = {"qwen3": ("<think>\nTwo and two.\n</think>\n\nFour.<|im_end|>", "\nTwo and two.\n", "\n\nFour."),
            "gpt_oss": ("<|channel|>analysis<|message|>Two and two.<|end|>"
                        "<|start|>assistant<|channel|>final<|message|>Four.<|return|>", "Two and two.", "Four.")}


@pytest.mark.parametrize("family", sorted(SCRIPTED))
def test_local_backend_puts_the_targets_reasoning_in_the_reasoning_field(family, tiny_family, tmp_path,
                                                                          monkeypatch):
    """A local target's reasoning goes to ``reasoning_content``, split where its format marks it
    (as vLLM's reasoning parser would), not left as raw markers in the content; tokenize renders it
    back in the family's format. A tiny random model never writes the frame: its ``generate`` is
    scripted to reply as a reasoning model of the family does."""
    import torch

    from eaglet.data import tokenization
    from eaglet.target import load

    reply, thought, content = SCRIPTED[family]
    ident = tiny_family(family)
    tok = load.load_tokenizer(load.load_identity(ident)["path"])
    script = tok(reply, add_special_tokens=False)["input_ids"]
    real = load.load_model

    def scripted(*a, **kw):
        model = real(*a, **kw)
        model.generate = lambda input_ids, **_: torch.cat(
            [input_ids, torch.tensor([script] * len(input_ids), dtype=input_ids.dtype)], 1)
        return model

    monkeypatch.setattr(load, "load_model", scripted)
    make_conversations(tmp_path / "in.parquet", 3, multi_every=0)
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", {"backend": "local", "max_tokens": 64})
    assert s["samples"] == 3 and s["reasoning_capture_rate"] == 1.0
    for r in read_conversations(tmp_path / "out" / "conversations.parquet"):
        assert r["messages"][-1] == {"role": "assistant", "content": content, "reasoning_content": thought}
    m = tokenization.run(tmp_path / "out" / "conversations.parquet", ident, tmp_path / "tok")
    assert m["samples_processed"] == 3 and m["reasoning"]["in_sequence"] == 3
    row = read_parquet(tmp_path / "tok" / "tokens.parquet").to_pylist()[0]
    masked = tok.decode([i for i, k in zip(row["input_ids"], row["loss_mask"], strict=True) if k])
    assert masked == reply + "\n" * (family == "qwen3")  # what the target wrote, rendered back


def test_changed_prompt_set_reuses_unchanged_prompts(tiny_target, tmp_path):
    """More prompts, or one prompt edited: only new or changed input rows are generated; stale
    results (an id whose turns changed, an id no longer in the input) never reach the output."""
    ident = Path(tiny_target["path"]).parent / "identity.json"
    cfg = {"backend": "local", "max_tokens": 4, "turns": "last", "chunk_size": 2}
    make_conversations(tmp_path / "a.parquet", 4, multi_every=0)
    generate(tmp_path / "a.parquet", ident, tmp_path / "out", cfg)
    before = assistant_texts(tmp_path / "out" / "conversations.parquet")
    rows = make_conversations(tmp_path / "b.parquet", 6, multi_every=0)
    rows[1]["messages"][0]["content"] = "Tell me one fact about cheese."
    rows = [r for r in rows if r["id"] != "c0000"]
    write_conversations(tmp_path / "b.parquet", rows)
    s = generate(tmp_path / "b.parquet", ident, tmp_path / "out", cfg)
    # c0002, c0003 kept; c0001 (edited), c0004, c0005 (new) generated; c0000 (dropped) not output
    assert s["this_run"] == {**s["this_run"], "skipped": 2, "success": 3, "error": 0}
    after = assistant_texts(tmp_path / "out" / "conversations.parquet")
    assert list(after) == ["c0001", "c0002", "c0003", "c0004", "c0005"]
    assert after["c0002"] == before["c0002"] and after["c0003"] == before["c0003"]


# --------------------------------------------------------------------------- prompt filter (issue 15)
LONG_PROMPT = "Summarise this: " + " ".join(f"word{i}" for i in range(150))


def _short_and_long(path: Path) -> list[dict]:
    rows = make_conversations(path, 3, multi_every=0)
    rows.insert(1, {"id": "long", "source": "test", "messages": [
        {"role": "user", "content": LONG_PROMPT}, {"role": "assistant", "content": "source answer"}]})
    write_conversations(path, rows)
    return rows


def test_over_limit_rule_is_exact_at_the_boundary(tiny_target):
    """Dropped iff prompt tokens + min(min_answer_tokens, max_tokens) > max_length."""
    from eaglet.generate.generate import over_limit, resolve_config
    from eaglet.target.load import load_tokenizer

    tok = load_tokenizer(tiny_target["path"])
    row = {"id": "x", "messages": [{"role": "user", "content": "Hello there."},
                                   {"role": "assistant", "content": "a"}]}
    n = len(tok.apply_chat_template(row["messages"][:1], tokenize=True, add_generation_prompt=True,
                                    return_dict=True)["input_ids"])
    cfg = resolve_config({"min_answer_tokens": 10, "max_tokens": 20})
    assert over_limit([row], {**cfg, "max_length": n + 10}, tok) == {}
    assert set(over_limit([row], {**cfg, "max_length": n + 9}, tok)) == {"x"}
    # max_tokens below min_answer_tokens: the reply cannot be longer, so that is the room needed
    cfg = resolve_config({"min_answer_tokens": 10, "max_tokens": 4})
    assert over_limit([row], {**cfg, "max_length": n + 4}, tok) == {}
    assert "x" in over_limit([row], {**cfg, "max_length": n + 3}, tok)
    assert over_limit([row], {**cfg, "max_length": None}, tok) == {}
    with pytest.raises(ValueError, match="no room for a prompt"):
        over_limit([row], {**cfg, "max_length": 4}, tok)


def test_prompt_over_the_limit_is_not_generated_and_tokenize_cuts_no_answer(tiny_target, tmp_path):
    """Issue 15: prompts under generation's limit but over tokenization.max_length lost their whole
    answer at tokenization. Filtered before generating, such a row is never generated, is counted with
    its reason, and tokenize reports no truncated_no_answer; without the filter it does."""
    from eaglet.data import tokenization

    ident = Path(tiny_target["path"]).parent / "identity.json"
    _short_and_long(tmp_path / "in.parquet")
    limit = 96
    cfg = {"backend": "local", "max_tokens": 8, "min_answer_tokens": 8, "turns": "last"}
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "on", {**cfg, "max_length": limit})
    assert s["filtered"] == 1 and s["filtered_by_reason"] == {"prompt_over_limit": 1}
    assert s["samples"] == 3 and s["errors"] == 0 and s["input"] == 4 and s["generated_turns"] == 3
    assert "long" not in assistant_texts(tmp_path / "on" / "conversations.parquet")
    err = read_parquet(tmp_path / "on" / "errors.parquet").to_pylist()
    assert [(e["id"], e["error_kind"]) for e in err] == [("long", "prompt_over_limit")]
    assert f"max_length {limit}" in err[0]["reason"]
    m = tokenization.run(tmp_path / "on" / "conversations.parquet", ident, tmp_path / "tok_on", max_length=limit)
    assert m["samples_processed"] == 3 and "truncated_no_answer" not in m["skipped_by_reason"]
    # The same data without the filter: the long prompt is generated, then cut away whole.
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "off", cfg)
    assert s["filtered"] == 0 and s["samples"] == 4
    m = tokenization.run(tmp_path / "off" / "conversations.parquet", ident, tmp_path / "tok_off", max_length=limit)
    assert m["skipped_by_reason"].get("truncated_no_answer") == 1
    # A rerun under a higher limit sends the row it filtered (the others are kept from before).
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "on", {**cfg, "max_length": 1024})
    assert s["filtered"] == 0 and s["this_run"] == {**s["this_run"], "success": 1, "skipped": 3}


# --------------------------------------------------------------------------- data.mix (issue 15)
def test_an_original_response_over_the_limit_is_not_passed_on(tiny_target, tmp_path):
    """data.mix 0: no row is regenerated, and a row whose prompt leaves no room for its own answer
    under the limit is dropped at generate with its reason, as a regenerated one would be; tokenize
    then cuts no answer away whole."""
    from eaglet.data import tokenization

    ident = Path(tiny_target["path"]).parent / "identity.json"
    _short_and_long(tmp_path / "in.parquet")
    limit = 96
    cfg = {"backend": "local", "max_tokens": 8, "min_answer_tokens": 8, "turns": "last", "mix": 0.0}
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "o", {**cfg, "max_length": limit})
    assert (s["regenerated"], s["original"], s["filtered"], s["filtered_original"]) == (0, 3, 1, 1)
    assert s["samples"] + s["errors"] + s["filtered"] == s["input"] == 4 and s["this_run"]["requests"] == 0
    assert "long" not in assistant_texts(tmp_path / "o" / "conversations.parquet")
    err = read_parquet(tmp_path / "o" / "errors.parquet").to_pylist()
    assert [(e["id"], e["error_kind"]) for e in err] == [("long", "prompt_over_limit")]
    m = tokenization.run(tmp_path / "o" / "conversations.parquet", ident, tmp_path / "tok", max_length=limit)
    assert m["samples_processed"] == 3 and "truncated_no_answer" not in m["skipped_by_reason"]
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "o", cfg)  # no limit: all four passed on
    assert (s["original"], s["filtered"]) == (4, 0)


def test_mix_regenerates_a_share_and_passes_the_rest_through(tiny_target, tmp_path):
    """data.mix 0.5: half the conversations regenerated, the others output with the dataset's own
    responses, in input order; mix 0 generates nothing (no model is loaded: nothing to send)."""
    from eaglet.generate.turns import regenerated_ids

    ident = Path(tiny_target["path"]).parent / "identity.json"
    rows = make_conversations(tmp_path / "in.parquet", 6, multi_every=0)
    cfg = {"backend": "local", "max_tokens": 4, "turns": "last", "mix": 0.5}
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "half", cfg)
    assert (s["regenerated"], s["original"], s["samples"], s["input"]) == (3, 3, 6, 6)
    assert s["generated_turns"] == 3 and s["this_run"]["success"] == 3
    out = read_conversations(tmp_path / "half" / "conversations.parquet")
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    regen = regenerated_ids(rows, 0.5, 0)
    for r, src in zip(out, rows, strict=True):
        if r["id"] in regen:
            assert r["messages"][-1]["content"] != "source answer"
        else:
            assert [m["content"] for m in r["messages"]] == [m["content"] for m in src["messages"]]
    # a larger share only adds rows, and the choice does not depend on the input order
    assert regen <= regenerated_ids(rows, 0.75, 0) and regen == regenerated_ids(rows[::-1], 0.5, 0)
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "none", {**cfg, "mix": 0.0})
    assert (s["regenerated"], s["original"], s["this_run"]["requests"]) == (0, 6, 0)
    assert assistant_texts(tmp_path / "none" / "conversations.parquet") == {r["id"]: ["source answer"] for r in rows}
    with pytest.raises(ValueError, match="data.mix"):
        generate(tmp_path / "in.parquet", ident, tmp_path / "bad", {**cfg, "mix": 1.5})


def test_mix_without_generation_is_refused_at_parse_time(tmp_path):
    import yaml

    from conftest import clone

    a = clone(tmp_path / "wf")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["generate"]["enabled"] = False
    conf["data"] = {"mix": 0.5}
    (a / "config/t.yaml").write_text(yaml.safe_dump(conf))
    p = subprocess.run([*snakemake_cmd(), "-n", "--cores", "1", "--configfile", "config/t.yaml"],
                       cwd=a, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "data.mix: 0.5" in p.stdout + p.stderr and "generate.enabled" in p.stdout + p.stderr



def _rows(path: Path, questions: list[str]) -> None:
    write_conversations(path, [{"id": f"r{i}", "source": "t", "messages": [{"role": "user", "content": q}]}
                               for i, q in enumerate(questions)])


@pytest.mark.faults
def test_openai_reasoning_markers_and_errors(canned, tiny_target, tmp_path):
    qs = ["plain", "REASON a", "THINK b", "RAW c", "EMPTY d", "LONG e", "FLAKY f", "plain 2"]
    _rows(tmp_path / "in.parquet", qs)
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connection errors, retried elsewhere
    cfg = {"backend": "openai", "base_urls": [canned, dead], "concurrency": 3, "backoff_s": 0.01,
           "max_retries": 8, "chunk_size": 2}
    ident = Path(tiny_target["path"]).parent / "identity.json"
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg)
    assert s["samples"] == 5 and s["errors"] == 3, s["errors_by_kind"]
    assert s["errors_by_kind"] == {"raw_thinking_markers": 1, "empty_response": 1, "prompt_too_long": 1}
    assert s["rejected_thinking_markers"] == 1 and s["retries"] >= 2  # FLAKY's two 503s at least
    assert s["reasoning_capture_rate"] == pytest.approx(2 / 5)
    convs = read_conversations(tmp_path / "out" / "conversations.parquet")
    out = {r["id"]: r["messages"][-1] for r in convs}
    assert out["r1"] == {"role": "assistant", "content": "echo REASON a",
                         "reasoning_content": "First, think about it."}
    assert out["r2"]["reasoning_content"] == "Hmm, let me see." and "reasoning_content" not in out["r0"]
    assert out["r6"]["content"] == "echo FLAKY f"
    err = {e["id"]: e for e in read_parquet(tmp_path / "out" / "errors.parquet").to_pylist()}
    assert err["r3"]["error_kind"] == "raw_thinking_markers" and "<think>" in err["r3"]["reason"]
    assert set(err) == {"r3", "r4", "r5"}
    # Final (non-transient) failures are not retried by a rerun; --retry-errors retries them.
    s2 = generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg)
    assert s2["this_run"]["skipped"] == 8 and s2["errors"] == 3
    s3 = generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg, retry_errors=True)
    assert s3["this_run"]["skipped"] == 5 and s3["this_run"]["error"] == 3 and s3["samples"] == 5


def test_server_backend_never_sends_a_prompt_over_the_limit(canned, tiny_target, tmp_path):
    rows = _short_and_long(tmp_path / "in.parquet")
    cfg = {"backend": "openai", "base_urls": [canned], "max_tokens": 8, "max_length": 96}
    s = generate(tmp_path / "in.parquet", Path(tiny_target["path"]).parent / "identity.json",
                 tmp_path / "out", cfg)
    assert s["filtered"] == 1 and s["samples"] == 3 and s["this_run"]["success"] == 3
    sent = set(Canned.calls)
    assert LONG_PROMPT not in sent and len(sent) == 3
    assert {r["id"] for r in read_conversations(tmp_path / "out" / "conversations.parquet")} == {
        r["id"] for r in rows} - {"long"}


@pytest.mark.faults
def test_openai_all_servers_down_fails_then_resumes(canned, tiny_target, tmp_path):
    _rows(tmp_path / "in.parquet", ["a", "b", "c"])
    ident = Path(tiny_target["path"]).parent / "identity.json"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cfg = {"backend": "openai", "base_urls": [dead], "model": "canned", "backoff_s": 0.01, "max_retries": 1}
    with pytest.raises(RuntimeError, match="3 of 3 conversations failed"):
        generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg)
    # The server is back: connection failures are transient, so a rerun redoes exactly them.
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", {**cfg, "base_urls": [canned]})
    assert s["samples"] == 3 and s["errors"] == 0 and s["this_run"]["success"] == 3


def _kill_and_resume(base_url: str, ident: Path, tmp_path: Path, rows: list[dict], cfg: dict) -> dict:
    """Run the stage as a real process, SIGKILL it once parts exist, rerun; check nothing is lost.
    Returns the rerun's summary, with ``done_before``: the ids finished in parts before the kill."""
    n = len(rows)
    write_conversations(tmp_path / "in.parquet", rows)
    cfg = {"backend": "openai", "base_urls": [base_url], "chunk_size": 2, "flush_s": 3600, **cfg}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eaglet.generate.generate", "--conversations", str(tmp_path / "in.parquet"),
           "--target", str(ident), "--out-dir", str(out), "--config", json.dumps(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    parts = out / "parts"
    deadline = time.monotonic() + 300
    while len(list(parts.glob("part_*.parquet"))) < 2:
        assert proc.poll() is None, "the stage ended before it could be killed"
        assert time.monotonic() < deadline, "no parts written"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p.name: p.read_bytes() for p in parts.glob("part_*.parquet")}
    done_before = {r["id"]: r for p in sorted(parts.glob("part_*.parquet"))
                   for r in read_parquet(p).to_pylist()}
    assert 0 < len(done_before) < n, f"kill came too late: {len(done_before)} of {n} done"
    s = generate(tmp_path / "in.parquet", ident, out, cfg)
    # Parts written before the kill are untouched; no id is generated twice.
    assert {name: (parts / name).read_bytes() for name in before} == before
    new_ids = [r["id"] for p in sorted(parts.glob("part_*.parquet")) if p.name not in before
               for r in read_parquet(p).to_pylist()]
    assert len(new_ids) == len(set(new_ids)) and not set(new_ids) & set(done_before)
    assert s["this_run"]["skipped"] == len(done_before)
    assert s["this_run"]["success"] + s["this_run"]["error"] + s["this_run"]["skipped"] == n
    final = read_conversations(out / "conversations.parquet")
    assert [r["id"] for r in final] == [r["id"] for r in rows] and s["samples"] + s["errors"] == n
    by_id = {r["id"]: r for r in final}
    for i, r in done_before.items():
        assert by_id[i]["messages"][-1]["content"] == r["messages"][-1]["content"]
    return {**s, "done_before": set(done_before)}


@pytest.mark.faults
def test_kill_and_resume_canned(canned, tiny_target, tmp_path):
    # Each SLOW request takes 0.15 s, so the kill lands mid-run.
    rows = [{"id": f"c{i:04d}", "source": "t", "messages": [{"role": "user", "content": f"SLOW {i}"}]}
            for i in range(40)]
    ident = Path(tiny_target["path"]).parent / "identity.json"
    chunk, conc = 2, 2  # _kill_and_resume's chunk_size; concurrency
    s = _kill_and_resume(canned, ident, tmp_path, rows, {"concurrency": conc})
    assert s["errors"] == 0 and s["samples"] == 40
    # At most one chunk is redone: the server saw a prompt twice only for rows that were finished
    # but not yet in a part (fewer than chunk_size) or in flight (at most concurrency) at the kill.
    sent = Canned.calls
    redone = sorted(q for q, n in sent.items() if n > 1)
    assert sorted(sent) == sorted(r["messages"][0]["content"] for r in rows) and max(sent.values()) <= 2
    assert len(redone) <= (chunk - 1) + conc, redone
    assert not {f"SLOW {int(i[1:])}" for i in s["done_before"]} & set(redone)  # nothing in a part redone


# --------------------------------------------------------------------------- real vLLM (CPU build)
@pytest.mark.vllm
def test_vllm_backend_end_to_end(tiny_target, tmp_path):
    env = vllm_env_or_skip()
    make_conversations(tmp_path / "in.parquet", 6)
    ident = Path(tiny_target["path"]).parent / "identity.json"
    cfg = {"backend": "vllm", "max_tokens": 16, "turns": "all", "concurrency": 4,
           "vllm": {"env": str(env), "max_model_len": 1024, "kv_cache_gb": 1}}
    t0 = time.monotonic()
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg, server_log=tmp_path / "server.log")
    print(f"\n[vllm backend] {s['samples']} samples in {time.monotonic() - t0:.0f} s (server start included)")
    assert s["samples"] == 6 and s["errors"] == 0 and s["generated_turns"] == 8 and s["backend"] == "vllm"
    assert s["completion_tokens"] > 0 and s["prompt_tokens"] > 0
    assert set(s["finish_reasons"]) <= {"stop", "length"}
    json.loads((tmp_path / "out" / "generate_summary.json").read_text())
    assert "vllm" in (tmp_path / "server.log").read_text()
    # The server was stopped: nothing listens on its port any more.
    port = int((tmp_path / "server.log").read_text().split("--port ")[1].split()[0])
    with pytest.raises(OSError):
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.vllm
def test_openai_two_base_urls_and_greedy_matches_local(vllm_tiny_server, tiny_target, tmp_path):
    n = 16
    make_conversations(tmp_path / "in.parquet", n)
    ident = Path(tiny_target["path"]).parent / "identity.json"
    common = {"max_tokens": 20, "turns": "last", "temperature": 0.0, "concurrency": 8}
    url = vllm_tiny_server.base_url
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "srv",
                 {**common, "backend": "openai", "base_urls": [url, url + "/"]})
    assert s["samples"] == n and s["errors"] == 0
    local = generate(tmp_path / "in.parquet", ident, tmp_path / "local", {**common, "backend": "local"})
    assert local["samples"] == n
    a, b = assistant_texts(tmp_path / "srv" / "conversations.parquet"), \
        assistant_texts(tmp_path / "local" / "conversations.parquet")
    exact = sum(a[k] == b[k] for k in a) / n
    from eaglet.target.load import load_tokenizer

    tok = load_tokenizer(tiny_target["path"])
    agree = []
    for k in a:
        x, y = tok(a[k][-1])["input_ids"], tok(b[k][-1])["input_ids"]
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        agree.append(same / max(len(x), len(y), 1))
    prefix = sum(agree) / n
    print(f"\n[greedy vLLM vs local] exact match {exact:.1%}, "
          f"mean common-prefix {prefix:.1%} over {n} prompts")
    assert exact >= 0.75 and prefix >= 0.85
    assert s["prompt_tokens"] == local["prompt_tokens"]  # same chat template, same tokens


@pytest.mark.vllm
@pytest.mark.faults
def test_kill_and_resume_vllm(vllm_tiny_server, tiny_target, tmp_path):
    ident = Path(tiny_target["path"]).parent / "identity.json"
    rows = make_conversations(tmp_path / "rows.parquet", 20, multi_every=0)
    s = _kill_and_resume(vllm_tiny_server.base_url, ident, tmp_path, rows,
                         {"max_tokens": 16, "concurrency": 2})
    assert s["errors"] == 0 and s["samples"] == 20
