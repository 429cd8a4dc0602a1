"""R4: truncated, byte-flipped or garbage artifacts are refused naming the file; nothing is written.

Part of the fault-injection suite (marker `faults`; docs/guarantees.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_random_drafter
from eaglet.base.artifacts import ArtifactError
from eaglet.base.conversations import write_conversations
from eaglet.base.files import read_json, read_parquet
from eaglet.base.tensors import save_tensors
from faults_common import corrupt_parquet, generate_run, identity_path
from train_common import target_stats

pytestmark = pytest.mark.faults


# =========================================================================== R4: corrupt artifacts


def _conversations(path: Path, n: int = 12) -> None:
    write_conversations(path, [{"id": f"c{i}", "source": "t", "messages": [
        {"role": "user", "content": f"Tell me about item {i} " * 3},
        {"role": "assistant", "content": f"Item {i} is a thing among things " * 4}]} for i in range(n)])


def _tokens(path: Path, n: int = 12) -> None:
    from eaglet.data.tokenization import write_tokens

    rng = np.random.default_rng(0)
    write_tokens(path, [{"id": f"s{i}", "source": "t", "input_ids": rng.integers(0, 49152, 20 + i).astype(np.int32),
                         "loss_mask": (rng.random(20 + i) < 0.5).astype(np.int8), "num_tokens": 20 + i,
                         "num_assistant_tokens": 0} for i in range(n)])


def _run_tokenize(art, ident, out):
    from eaglet.data import tokenization

    tokenization.run(art, ident, out)


def _run_freq(art, ident, out):
    from eaglet.data import freq

    freq.run(art, ident, out)


def _run_extract(art, ident, out):
    from eaglet.features import extract

    extract.extract(art, ident, out / "shard_0", progress=False)


def _run_prompts(art, ident, out):
    from eaglet.data import prompts

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
    read_parquet(art)  # intact, it reads
    corrupt_parquet(art, how)
    out = tmp_path / "out"
    with pytest.raises(ArtifactError, match=re.escape(str(art))):
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
    with pytest.raises(ArtifactError, match=re.escape(str(part))):
        generate_run(tmp_path / "in.parquet", identity_path(tiny_target), out, cfg)
    assert not (out / "conversations.parquet").exists()


# ---------------------------------------------------------------- hidden states, vocab, drafter
LAYERS, VD = [2, 4, 5], 64


@pytest.fixture()
def train_inputs(tiny_target, tmp_path):
    """A complete 3-chunk hidden-state shard of the tiny target and a valid vocab map."""
    from eaglet.hidden.store import ShardWriter

    H = tiny_target["hidden_size"]
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(tmp_path / "shard_0", 0, 1, LAYERS, True, "float32", H, tiny_target["digest"],
                    chunk_bytes=40 * 4 * H * 4, final_layer=tiny_target["num_layers"])
    for i in range(12):
        T = 12 + i
        final = torch.randn(T, H, generator=g)
        w.add(f"s{i}", torch.randint(0, VD, (T,), generator=g), torch.ones(T, dtype=torch.int8),
              torch.randn(T, 3, H, generator=g), final, *target_stats(tiny_target, final))
    index = w.finish()
    assert len(index["chunks"]) >= 3
    t2d = torch.zeros(tiny_target["vocab_size"], dtype=torch.bool)
    t2d[:VD] = True
    save_tensors(tmp_path / "vocab.safetensors", {"d2t": torch.zeros(VD, dtype=torch.long), "t2d": t2d})
    return {"index": tmp_path / "shard_0" / "index.json", "vocab": tmp_path / "vocab.safetensors",
            "out": tmp_path / "train"}


TRAIN_OUTPUTS = ["drafter.safetensors", "metrics.parquet", "train_summary.json", "checkpoints"]


def _train(inp, tiny_target):
    """One whole epoch, so every chunk is read: a chunk's sha256 is checked when it is first read
    (issue 14), and the label check is waived as this store holds no references: a fault must
    stop the run by itself, not behind another refusal."""
    from eaglet.train.train import train

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
    from eaglet.hidden.reader import HiddenStateDataset

    HiddenStateDataset([train_inputs["index"]])  # intact, it opens
    chunk = train_inputs["index"].parent / "chunk_00001.safetensors"
    CHUNK_FAULTS[how](chunk)
    with pytest.raises(ArtifactError, match=re.escape(str(chunk))):
        _train(train_inputs, tiny_target)
    assert not [o for o in TRAIN_OUTPUTS if (train_inputs["out"] / o).exists()]
    # verify="header" never hashes: a truncated chunk is refused there too, at open.
    if how in ("truncated", "header_garbage", "emptied"):
        with pytest.raises(ArtifactError, match=re.escape(str(chunk))):
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
    with pytest.raises(ArtifactError, match=re.escape(str(index.parent))):
        _train(train_inputs, tiny_target)
    assert not [o for o in TRAIN_OUTPUTS if (train_inputs["out"] / o).exists()]


@pytest.mark.parametrize("how", ["truncated", "header_garbage", "emptied"])
def test_corrupt_vocab_map_stops_training(how, train_inputs, tiny_target):
    CHUNK_FAULTS[how](train_inputs["vocab"])
    with pytest.raises(ArtifactError, match=re.escape(str(train_inputs["vocab"]))):
        _train(train_inputs, tiny_target)
    assert not [o for o in TRAIN_OUTPUTS if (train_inputs["out"] / o).exists()]


@pytest.mark.parametrize("how", ["truncated", "header_garbage", "emptied"])
def test_corrupt_token_counts_stop_vocab_map(how, tiny_target, tmp_path):
    from eaglet.data import vocab

    counts = tmp_path / "freq.safetensors"
    save_tensors(counts, {"counts": torch.arange(tiny_target["vocab_size"], dtype=torch.int64)})
    CHUNK_FAULTS[how](counts)
    with pytest.raises(ArtifactError, match=re.escape(str(counts))):
        vocab.run(counts, identity_path(tiny_target), tmp_path / "out", draft_vocab_size=64)
    assert not (tmp_path / "out" / "vocab.safetensors").exists() and not (tmp_path / "out" / "vocab.json").exists()


@pytest.mark.parametrize("how", ["truncated", "header_garbage", "emptied"])
def test_corrupt_drafter_stops_export(how, tiny_target, tmp_path):
    from eaglet.export.export import export

    drafter = make_random_drafter(tiny_target, tmp_path / "drafter.safetensors")
    CHUNK_FAULTS[how](drafter)
    with pytest.raises(ArtifactError, match=re.escape(str(drafter))):
        export(drafter, tmp_path / "out", identity_path(tiny_target), vllm_check=False)
    assert not [p for p in ("config.json", "model.safetensors", "contract.json")
                if (tmp_path / "out" / p).exists()]


def test_corrupt_chunk_in_a_killed_extraction_is_recomputed(tmp_path, caplog):
    """The resume state of extraction: a chunk altered after its progress entry was written is
    refused (its name logged) and recomputed with everything after it; the shard equals a clean one."""
    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.hidden.store import ShardWriter

    H = 16
    g = torch.Generator().manual_seed(1)
    samples = [(f"s{i}", torch.randint(0, 99, (6 + i,), generator=g), torch.ones(6 + i, dtype=torch.int8),
                torch.randn(6 + i, 3, H, generator=g), torch.randn(6 + i, H, generator=g),
                torch.randn(6 + i, generator=g), torch.randint(0, 99, (6 + i,), generator=g)) for i in range(10)]
    args = (0, 1, [1, 2, 3], True, "float32", H, "digest", 1500)
    w = ShardWriter(tmp_path / "s", *args)
    for s in samples[:8]:
        w.add(*s)
    w.close()  # as a kill would leave it
    prog = read_json(tmp_path / "s" / "progress.json")
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
