"""prompts: sources, shapes, malformed rows counted by reason, deterministic sampling."""

import json

import pytest

from eaglet.base.conversations import read_conversations, write_conversations
from eaglet.data import prompts


def conv(i, **kw):
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"answer {i}"}], **kw}


def write_jsonl(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")


@pytest.mark.faults
def test_malformed_rows_are_counted_and_valid_rows_kept(tmp_path):
    good = [conv(i) for i in range(6)]
    bad = [
        b"{not json",                                                           # invalid_json
        {"id": "e", "conversations": []},                                       # empty_conversation
        {"id": "n", "conversations": [{"from": "human", "value": "hi"}]},      # no_assistant_turn
        {"id": "s", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 7}]},
        {"id": "r", "conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]},
        conv(0),                                                                # duplicate_id
        b'{"id": "u", "conversations": [{"from": "human", "value": "\xff\xfe"}]}',  # undecodable
        {"id": "z", "conversations": [{"from": "human", "value": "q\ud800"}, {"from": "gpt", "value": "a"}]},
    ]
    path = tmp_path / "data.jsonl"
    write_jsonl(path, good[:3] + bad + good[3:])
    res = prompts.build_prompts("file", str(path), n=100, heldout=2, seed=1)
    s = res["summary"]
    assert s["skipped_by_reason"] == {"invalid_json": 1, "empty_conversation": 1, "no_assistant_turn": 1,
                                      "non_string_content": 1, "unknown_role": 1, "duplicate_id": 1,
                                      "undecodable": 2}
    ids = sorted(r["id"] for r in res["train"] + res["heldout"])
    assert ids == [f"c{i}" for i in range(6)]            # nothing valid lost
    assert len(res["heldout"]) == 2 and len(res["train"]) == 4


def test_openai_shape_with_reasoning_and_parquet_roundtrip(tmp_path):
    rows = [{"id": f"o{i}", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"}]} for i in range(5)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows))
    res = prompts.build_prompts("file", str(path), n=10, heldout=1, seed=0)
    out = tmp_path / "train.parquet"
    write_conversations(out, res["train"])
    back = read_conversations(out)
    assert back[0]["messages"][0]["role"] == "system"
    assert back[0]["messages"][2]["reasoning_content"] == "add them"
    assert "reasoning_content" not in back[0]["messages"][1]
    # Parquet input in the same schema is accepted as a source too.
    again = prompts.build_prompts("file", str(out), n=10, heldout=1, seed=0)
    assert again["summary"]["valid"] == len(back)


def test_sampling_is_deterministic_and_split_disjoint(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [conv(i) for i in range(50)])
    a = prompts.build_prompts("file", str(path), n=20, heldout=5, seed=3)
    b = prompts.build_prompts("file", str(path), n=20, heldout=5, seed=3)
    c = prompts.build_prompts("file", str(path), n=20, heldout=5, seed=4)
    ids = lambda r: [x["id"] for x in r["train"]]
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert not set(ids(a)) & {x["id"] for x in a["heldout"]}


def test_leading_assistant_and_trailing_user_turns_are_trimmed(tmp_path):
    path = tmp_path / "d.jsonl"
    rec = {"id": "x", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a"}, {"from": "human", "value": "bye"}]}
    write_jsonl(path, [rec, conv(1)])
    res = prompts.build_prompts("file", str(path), n=10, heldout=0, seed=0)
    x = next(r for r in res["train"] if r["id"] == "x")
    assert [m["role"] for m in x["messages"]] == ["user", "assistant"]


@pytest.mark.faults
def test_truncated_json_array_loses_only_the_tail(tmp_path):
    path = tmp_path / "d.json"
    text = json.dumps([conv(i) for i in range(4)])
    path.write_text(text[: text.rfind("answer 3")])
    res = prompts.build_prompts("file", str(path), n=10, heldout=0, seed=0)
    assert res["summary"]["valid"] == 3 and res["summary"]["skipped_by_reason"] == {"truncated_tail": 1}


def test_packaged_sharegpt_is_readable():
    res = prompts.build_prompts("sharegpt", n=10, heldout=2, seed=0)
    assert len(res["train"]) == 10 and res["summary"]["valid"] > 10000


@pytest.mark.faults
def test_missing_file_and_too_few_rows_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompts.path"):
        prompts.build_prompts("file", str(tmp_path / "nope.jsonl"))
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [conv(1)])
    with pytest.raises(ValueError, match="prompts.heldout"):
        prompts.build_prompts("file", str(path), heldout=5)
