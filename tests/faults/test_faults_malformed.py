"""R3: malformed rows are skipped by reason; inputs whose rows disagree are refused whole.

Part of the fault-injection suite (marker `faults`; docs/guarantees.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import json
import logging
import re

import pyarrow as pa
import pytest

from canned_server import Canned
from eaglet.base.artifacts import ArtifactError
from eaglet.base.conversations import conversation_schema, read_conversations
from eaglet.base.files import read_json, read_parquet, write_parquet
from faults_common import generate_run, identity_path

pytestmark = pytest.mark.faults


# =========================================================================== R3: malformed rows
def _conversation_table(rows: list[dict]) -> pa.Table:
    """Rows as the conversation schema allows them to be written (nulls included), bypassing the
    normalising writer, as a foreign tool or a hand edit could produce them."""
    return pa.Table.from_pylist(rows, schema=conversation_schema())


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
    write_parquet(tmp_path / "in.parquet", _conversation_table(good[:4] + bad + good[4:]))
    cfg = {"backend": "openai", "base_urls": [canned], "max_error_fraction": 1.0, "backoff_s": 0.01}
    s = generate_run(tmp_path / "in.parquet", identity_path(tiny_target), tmp_path / "out", cfg)
    reasons = {name: kind for name, (_, kind) in MALFORMED_GENERATE_INPUT.items()}
    errors = {e["id"]: e for e in read_parquet(tmp_path / "out" / "errors.parquet").to_pylist()}
    assert {i: e["error_kind"] for i, e in errors.items()} == reasons
    assert all(e["reason"] for e in errors.values())
    from collections import Counter

    assert s["errors_by_kind"] == dict(Counter(reasons.values()))
    assert s["samples"] == len(good) and s["this_run"]["success"] + s["this_run"]["error"] == len(good) + len(bad)
    assert sorted(Canned.calls) == sorted(f"good {i}" for i in range(8))  # only valid rows were sent
    again = generate_run(tmp_path / "in.parquet", identity_path(tiny_target), tmp_path / "out", cfg)
    assert again["this_run"]["skipped"] == len(good) + len(bad)
    # Duplicate ids make the ids (the unit of resume) meaningless: the whole file is refused.
    write_parquet(tmp_path / "dup.parquet", _conversation_table(good + good[:1]))
    with pytest.raises(ArtifactError, match=re.escape(str(tmp_path / "dup.parquet"))):
        generate_run(tmp_path / "dup.parquet", identity_path(tiny_target), tmp_path / "dup", cfg)
    assert not (tmp_path / "dup" / "conversations.parquet").exists()


def test_tokenize_stage_counts_null_rows_written_by_other_tools(tiny_target, tmp_path):
    """tokenize, reading the file (not a list in memory): null message lists and null turns are
    counted by reason, the rest is tokenized."""
    from eaglet.data import tokenization

    good = [{"id": f"g{i}", "source": "t", "messages": [_msg("user", f"q{i}"), _msg("assistant", f"a{i}")]}
            for i in range(3)]
    bad = [{"id": "n1", "source": "t", "messages": None},
           {"id": "n2", "source": "t", "messages": [_msg("user", "q"), None]},
           {"id": "n3", "source": "t", "messages": [_msg("user", "q"), _msg("assistant", None)]},
           {"id": "n4", "source": "t", "messages": [_msg("user", "q"), _msg("assistant", "   ")]}]
    write_parquet(tmp_path / "c.parquet", _conversation_table(good + bad))
    meta = tokenization.run(tmp_path / "c.parquet", identity_path(tiny_target), tmp_path / "out")
    assert meta["samples_processed"] == 3 and meta["samples_in"] == 7
    assert meta["skipped_by_reason"] == {"empty_conversation": 1, "malformed_turn": 1, "non_string_content": 1,
                                         "empty_assistant_turn": 1}


def test_prompts_stage_cli_writes_skip_counts(tmp_path):
    """prompts, as the rule runs it (the CLI): every malformed kind lands in summary.json by
    reason, and the valid rows are all written."""
    from eaglet.data import prompts

    lines = [json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"},
                                                           {"from": "gpt", "value": f"a{i}"}]}) for i in range(5)]
    lines += ["{not json", json.dumps([1, 2]), json.dumps({"id": "t", "conversations": ["a turn as a string"]}),
              json.dumps({"id": "w", "messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": ""}]})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    prompts.main(["--source", "file", "--path", str(tmp_path / "d.jsonl"), "--n", "10", "--heldout", "1",
                  "--out-dir", str(tmp_path / "out")])
    s = read_json(tmp_path / "out" / "summary.json")
    assert s["skipped_by_reason"] == {"invalid_json": 1, "not_an_object": 1, "malformed_turn": 1,
                                      "empty_assistant_turn": 1}
    assert s["valid"] == 5 and s["skipped"] == 4 and s["records_read"] == 9
    kept = read_conversations(tmp_path / "out" / "train.parquet") + \
        read_conversations(tmp_path / "out" / "heldout.parquet")
    assert sorted(r["id"] for r in kept) == [f"c{i}" for i in range(5)]


def test_evaluation_set_skips_malformed_rows_by_reason(tmp_path, caplog):
    """A conversation Parquet used as an evaluation set (evaluate.sets): malformed rows are skipped
    and their count by reason logged; the valid prompts are kept, cut at the last user turn."""
    from eaglet.base import datasets

    good = [{"id": f"g{i}", "source": "t", "messages": [_msg("user", f"q{i}"), _msg("assistant", f"a{i}")]}
            for i in range(3)]
    bad = [{"id": name, "source": "t", "messages": msgs} for name, (msgs, _) in MALFORMED_GENERATE_INPUT.items()]
    write_parquet(tmp_path / "set.parquet", _conversation_table(good + bad))
    with caplog.at_level(logging.WARNING, logger="eaglet"):
        rows = datasets.conversations(tmp_path / "set.parquet")
    assert [r["id"] for r in rows] == ["g0", "g1", "g2"] and rows[0]["messages"] == [{"role": "user", "content": "q0"}]
    from collections import Counter

    want = dict(Counter(kind for _, kind in MALFORMED_GENERATE_INPUT.values()))
    assert f"{len(bad)} rows skipped {want}" in caplog.text


def test_token_rows_that_disagree_are_refused_naming_the_file(tiny_target, tmp_path):
    """tokens.parquet is an internal artifact: a row whose mask and ids disagree means the file is
    wrong, so its consumers refuse the file (naming it) instead of skipping rows."""
    from eaglet.data import freq
    from eaglet.features import extract

    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32())])
    rows = [{"id": "a", "source": "t", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_tokens": 3},
            {"id": "b", "source": "t", "input_ids": [4, 5, 6], "loss_mask": [1, 1], "num_tokens": 3}]
    tokens = tmp_path / "tokens.parquet"
    write_parquet(tokens, pa.Table.from_pylist(rows, schema=schema))
    with pytest.raises(ArtifactError, match=re.escape(str(tokens))):
        freq.run(tokens, identity_path(tiny_target), tmp_path / "freq")
    with pytest.raises(ArtifactError, match=re.escape(str(tokens))):
        extract.extract(tokens, identity_path(tiny_target), tmp_path / "shard_0", progress=False)
    assert not (tmp_path / "freq").exists() and not (tmp_path / "shard_0" / "index.json").exists()
