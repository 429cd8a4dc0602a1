"""prompts at scale (issue 45): JSONL and Parquet streamed in chunks pick the rows that reading the
whole file into a list and shuffling it picked (the same rows whatever the chunk size or the
format); bad input names the file and the line; a `datasets` data set saved to disk is read and
keyed by the fingerprint `datasets` gives it, not by its name."""

import json
import os
import random
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglet.base import prompt_sources
from eaglet.base.artifacts import ArtifactError
from eaglet.base.content_digests import DigestCache
from eaglet.data import prompts


def conv(i, **kw):
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"answer {i}"}], **kw}


def records(count=300):
    """Valid rows with a few the stage skips: repeated ids, no assistant turn, no id (a default one)."""
    out = [conv(i) for i in range(count)]
    out[17] = conv(5)  # a duplicate of an earlier id
    out[40] = {"id": "n", "conversations": [{"from": "human", "value": "hi"}]}
    out[41] = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    out[count - 10] = conv(5)
    return out


def whole_file_pick(recs, name, n, heldout, seed):
    """The pick as the stage made it before it streamed: every valid row in a list, shuffled."""
    valid, seen = [], set()
    for i, rec in enumerate(recs):
        row, _ = prompts.checked(rec, name, i, None)
        if row is not None and row["id"] not in seen:
            seen.add(row["id"])
            valid.append(row)
    order = list(range(len(valid)))
    random.Random(seed).shuffle(order)
    return [valid[i]["id"] for i in order[:heldout]], [valid[i]["id"] for i in order[heldout:heldout + n]]


def ids(res):
    return [r["id"] for r in res["heldout"]], [r["id"] for r in res["train"]]


def write_jsonl(path, recs, extra=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in recs) + extra)


def test_streamed_pick_is_the_whole_file_pick_in_any_chunk_size_and_format(tmp_path):
    recs = records()
    write_jsonl(tmp_path / "d.jsonl", recs)
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet", row_group_size=50)
    want = whole_file_pick(recs, "d", n=40, heldout=7, seed=3)
    for path in ("d.jsonl", "d.parquet"):
        for chunk in (1, 7, 64, 4096):
            res = prompts.build_prompts("file", str(tmp_path / path), n=40, heldout=7, seed=3, chunk_rows=chunk)
            assert ids(res) == want, (path, chunk)
            assert res["summary"]["skipped_by_reason"] == {"duplicate_id": 2, "no_assistant_turn": 1}
            assert res["summary"]["valid"] == len(recs) - 3
    # the second duplicate's place is named: the first line of each kind skipped
    assert res["summary"]["first_skipped"]["duplicate_id"] == f"{tmp_path / 'd.parquet'}, row 18"


def test_a_hash_collision_drops_no_row(tmp_path, monkeypatch):
    """A hash collision drops no row: duplicates are found by 8-byte hashes of the ids, then the
    candidates' ids themselves are compared."""
    recs = records(60)
    write_jsonl(tmp_path / "d.jsonl", recs)
    want = whole_file_pick(recs, "d", n=20, heldout=3, seed=1)
    monkeypatch.setattr(prompts, "id_hash", lambda rid: 7)  # every id collides
    res = prompts.build_prompts("file", str(tmp_path / "d.jsonl"), n=20, heldout=3, seed=1)
    assert ids(res) == want and res["summary"]["skipped_by_reason"]["duplicate_id"] == 2


@pytest.mark.faults
def test_bad_input_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [conv(i) for i in range(3)], extra=b"{not json\n")
    s = prompts.build_prompts("file", str(path), n=10, heldout=1)["summary"]
    assert s["first_skipped"] == {"invalid_json": f"{path}, line 4"}
    # nothing valid: the refusal names the first bad line
    path.write_bytes(b"\n{not json\n[1]\n")
    with pytest.raises(ValueError, match=r"only 0 valid conversations .*first skipped: .*d\.jsonl, line 2: "
                                         r"invalid_json; .*d\.jsonl, line 3: not_an_object"):
        prompts.build_prompts("file", str(path), n=10, heldout=1)
    path.write_bytes(b"")
    with pytest.raises(ArtifactError, match=r"prompts\.path: .*d\.jsonl is empty: no records"):
        prompts.build_prompts("file", str(path), n=10, heldout=1)
    pq.write_table(pa.Table.from_pylist([{"id": "a", "text": "hello"}]), tmp_path / "t.parquet")
    with pytest.raises(ArtifactError, match=r"t\.parquet: no 'conversations' .* or 'messages' .* column; "
                                            r"its columns: id, text"):
        prompts.build_prompts("file", str(tmp_path / "t.parquet"), n=10, heldout=1)
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ArtifactError, match=r"x\.parquet: not a readable Parquet file"):
        prompts.build_prompts("file", str(tmp_path / "x.parquet"), n=10, heldout=1)


def test_a_folder_reads_its_split_files_in_name_order(tmp_path):
    folder = tmp_path / "set"
    (folder / "data").mkdir(parents=True)
    recs = records(80)
    write_jsonl(folder / "data/train-0.jsonl", recs[:50])
    pq.write_table(pa.Table.from_pylist(recs[50:]), folder / "data/train-1.parquet")
    write_jsonl(folder / "data/test-0.jsonl", [conv(i) for i in range(900, 910)])
    res = prompts.build_prompts("datasets", str(folder), n=30, heldout=4, seed=2, split="train")
    assert ids(res) == whole_file_pick(recs, str(folder), n=30, heldout=4, seed=2)
    test = prompts.build_prompts("datasets", str(folder), n=30, heldout=4, seed=2, split="test")
    assert test["summary"]["valid"] == 10


def test_a_saved_data_set_is_read_and_keyed_by_its_fingerprint(tmp_path):
    datasets = pytest.importorskip("datasets")
    recs = [conv(i) for i in range(120)]
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "mine"))
    key = prompt_sources.source_key("datasets", "mine", "train", DigestCache(None), base=tmp_path)
    assert key.startswith("datasets:") and len(key) > len("datasets:")
    res = prompts.build_prompts("datasets", str(tmp_path / "mine"), n=30, heldout=5, seed=4, chunk_rows=16,
                                path_digest=key)
    assert ids(res) == whole_file_pick(recs, str(tmp_path / "mine"), n=30, heldout=5, seed=4)
    # a renamed copy keys the same; the same name with new rows keys anew, and the job refuses it
    shutil.copytree(tmp_path / "mine", tmp_path / "renamed")
    assert prompt_sources.source_key("datasets", str(tmp_path / "renamed"), "train") == key
    shutil.rmtree(tmp_path / "mine")
    datasets.Dataset.from_list(recs[:100]).save_to_disk(str(tmp_path / "mine"))
    new = prompt_sources.source_key("datasets", str(tmp_path / "mine"), "train")
    assert new.startswith("datasets:") and new != key
    with pytest.raises(ArtifactError, match=r"prompts\.path: .*mine \(split 'train'\) changed after the "
                                            r"workflow was parsed"):
        prompts.build_prompts("datasets", str(tmp_path / "mine"), n=30, heldout=5, path_digest=key)
    # a DatasetDict: the split's own fingerprint; a split it lacks is refused, naming those it has
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs[:60]),
                          "test": datasets.Dataset.from_list(recs[60:])}).save_to_disk(str(tmp_path / "dd"))
    keys = {s: prompt_sources.source_key("datasets", str(tmp_path / "dd"), s) for s in ("train", "test")}
    assert keys["train"] != keys["test"]
    test = prompts.build_prompts("datasets", str(tmp_path / "dd"), n=10, heldout=2, split="test",
                                 path_digest=keys["test"])
    assert {r["id"] for r in test["train"]} <= {f"c{i}" for i in range(60, 120)}
    with pytest.raises(ValueError, match=r"prompts\.split: 'dev' is not a split of .*dd \(it has train, test\)"):
        prompt_sources.source_key("datasets", str(tmp_path / "dd"), "dev")


def test_a_local_file_is_keyed_by_its_content_not_its_name(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", records(60))
    shutil.copyfile(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    key = prompt_sources.source_key("file", str(tmp_path / "a.jsonl"), "train", DigestCache(None))
    assert key.startswith("sha256:")
    assert prompt_sources.source_key("datasets", str(tmp_path / "b.jsonl"), "train", DigestCache(None)) == key
    write_jsonl(tmp_path / "a.jsonl", records(61))
    assert prompt_sources.source_key("file", str(tmp_path / "a.jsonl"), "train", DigestCache(None)) != key


@pytest.mark.faults
def test_a_data_set_name_missing_from_the_cache_offline_is_one_clear_error(tmp_path):
    """A data set name missing from the cache offline stops the parse naming prompts.path, the name
    and the split: a name (no local path) is loaded by `datasets` from its cache (in a fresh process
    here: the libraries read HF_HUB_OFFLINE and HF_HOME when imported)."""
    code = ("from eaglet.base import prompt_sources\n"
            "try:\n    prompt_sources.source_key('datasets', 'org/not-cached', 'train')\n"
            "except ValueError as e:\n    print(e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_DATASETS_CACHE", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "prompts.path: the data set 'org/not-cached' (split 'train') cannot be loaded" in p.stdout, p.stdout
