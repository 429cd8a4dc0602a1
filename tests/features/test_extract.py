"""Hidden-state extraction on the tiny target: correctness, sharding, resume after kill -9."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, folder_manifest, record_digests
from eaglet.base.files import read_json, write_json
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.features.extract import assign_shards, extract, make_batches
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.target.load import load_model
from train_common import write_tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are too small for two threads; on a busy 2-core machine the
    second thread's spin-waits make them ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tgt(tiny_target):
    return tiny_target, Path(tiny_target["path"]).parent / "identity.json"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokens.parquet"
    return path, write_tokens(path, 24)


@pytest.fixture(scope="module")
def one_shard(tgt, tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("x") / "shard_0"
    # Small budget and chunks: several padded multi-sample batches and several chunk files.
    extract(tokens[0], tgt[1], out, 0, 1, dtype="float32", token_budget=96, chunk_mb=0.05, progress=False)
    return out


def test_captured_states_equal_output_hidden_states(tgt, tokens, one_shard):
    ident, _ = tgt
    N = ident["num_layers"]
    ds = HiddenStateDataset([one_shard])
    assert ds.meta["layer_ids"] == [2, N // 2, N - 3] and ds.meta["final_is_prenorm"] is True
    assert ds.meta["final_layer"] == N and ds.meta["hidden_size"] == ident["hidden_size"]
    assert len(read_json(one_shard / "index.json")["chunks"]) > 2
    rows = {r["id"]: r for r in tokens[1]}
    assert sorted(ds.ids) == sorted(rows)
    model = load_model(ident["path"])
    for i in range(len(ds)):
        s = ds.sample(i)
        r = rows[s["id"]]
        assert s["input_ids"].tolist() == r["input_ids"] and s["loss_mask"].tolist() == r["loss_mask"]
        with torch.no_grad():  # unpadded, one sample: the reference
            hs = model(torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states
        for k, j in enumerate(ds.meta["layer_ids"]):
            torch.testing.assert_close(s["aux"][:, k], hs[j][0], atol=2e-5, rtol=1e-5)
        # HF's last hidden state is after the final norm; ours is before it.
        with torch.no_grad():
            torch.testing.assert_close(model.model.norm(s["final"]), hs[N][0], atol=2e-5, rtol=1e-5)
        assert not torch.allclose(s["final"], hs[N][0], atol=1e-3)


def test_stored_target_statistics_are_the_targets_own_and_the_trainers_figures(tgt, tokens, one_shard, tmp_path):
    """Every stored token carries the target's log-sum-exp and argmax over its whole vocabulary: on
    float32 states the real model's own (its full forward, unpadded), and on bf16 states what the
    trainer computed before from the head's other rows of the stored (rounded) state, so the draft
    vocab's mass and the greedy flag it reads are unchanged (eaglet.train.setup.DraftLabels)."""
    from eaglet.target.head import TargetHead

    ident, ident_path = tgt
    ds = HiddenStateDataset([one_shard])
    model = load_model(ident["path"])
    rows = {r["id"]: r for r in tokens[1]}
    for i in range(len(ds)):
        s = ds.sample(i)
        with torch.no_grad():
            lg = model(torch.tensor([rows[s["id"]]["input_ids"]])).logits[0].float()
        torch.testing.assert_close(s["target_lse"], torch.logsumexp(lg, -1), atol=2e-5, rtol=1e-5)
        top2 = lg.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # a tie may go either way under other batching
        assert torch.equal(s["target_top1"][clear], lg.argmax(-1)[clear]) and bool(clear.float().mean() > 0.9)
    out = tmp_path / "bf16"
    extract(tokens[0], ident_path, out, 0, 1, dtype="bfloat16", token_budget=96, chunk_mb=0.05, progress=False)
    ds = HiddenStateDataset([out])
    V = ident["vocab_size"]
    draft = torch.arange(V) % 3 == 0
    head = TargetHead(ident["path"], rows=draft.nonzero().squeeze(1))
    rest = head.row_chunks((~draft).nonzero().squeeze(1))
    for i in range(0, len(ds), 5):
        s = ds.sample(i)
        x = head.normed(s["final"][None])
        lse_d = torch.logsumexp(head.logits(x, normed=True), -1)[0]
        top_rest, lse_rest = head.max_lse_over(x, rest, normed=True)
        before = torch.exp(lse_d - torch.logaddexp(lse_d, lse_rest[0]))
        torch.testing.assert_close(torch.exp(lse_d - s["target_lse"]).clamp(max=1), before, atol=1e-5, rtol=1e-5)
        assert torch.equal(draft[s["target_top1"]], head.logits(x, normed=True)[0].amax(-1) >= top_rest[0])


def test_index_records_the_real_models_top1(tgt, tokens, one_shard):
    """label_reference rows are the real model's own top-1 token (and margin) at their position."""
    ident, _ = tgt
    refs = read_json(one_shard / "index.json")["label_reference"]
    rows = {r["id"]: r for r in tokens[1]}
    assert len(refs) >= len(rows)  # a few per batch, every batch row
    model = load_model(ident["path"])
    for sid, pos, top1, margin in refs[:12]:
        with torch.no_grad():
            lg = model(torch.tensor([rows[sid]["input_ids"]])).logits[0, pos]
        v, i = lg.topk(2)
        assert int(i[0]) == top1 and abs(float(v[0] - v[1]) - margin) < 1e-3


def test_layer_id_n_is_refused(tgt, tokens, tmp_path):
    # vLLM captures aux states only entering layers 0..N-1: a drafter trained on id N is never served.
    N = tgt[0]["num_layers"]
    with pytest.raises(ValueError, match="extract.layer_ids"):
        extract(tokens[0], tgt[1], tmp_path / "s", layer_ids=[1, 3, N], dtype="float32", progress=False)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_shards_balance_tokens_and_partition_samples():
    lengths = [100, 90, 50, 40, 30, 30, 10, 5, 5, 1]
    ids = [f"s{i}" for i in range(len(lengths))]
    shard = assign_shards(ids, lengths, 3)
    load = [sum(n for n, s in zip(lengths, shard) if s == k) for k in range(3)]
    assert max(load) - min(load) <= max(lengths) and sorted(set(shard)) == [0, 1, 2]
    assert load == [sum(n for n, s in zip(lengths, assign_shards(ids, lengths, 3)) if s == k) for k in range(3)]
    for batch in make_batches(lengths, 120):
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 120


def test_one_shard_equals_three_shards(tgt, tokens, one_shard, tmp_path):
    outs = []
    for k in range(3):
        out = tmp_path / f"shard_{k}"
        idx = extract(tokens[0], tgt[1], out, k, 3, dtype="float32", token_budget=96, chunk_mb=0.05,
                      progress=False)
        assert idx["shard"] == k and idx["num_shards"] == 3
        outs.append(out)
    three = HiddenStateDataset(outs)
    one = HiddenStateDataset([one_shard])
    assert sorted(three.ids) == sorted(one.ids) and len(set(three.ids)) == len(three.ids)
    loads = [sum(s["num_tokens"] for s in read_json(o / "index.json")["samples"]) for o in outs]
    assert max(loads) - min(loads) <= 48  # balanced by tokens: within one sample's length
    pos = {sid: i for i, sid in enumerate(one.ids)}
    for i, sid in enumerate(three.ids):
        a, b = three.sample(i), one.sample(pos[sid])
        assert torch.equal(a["input_ids"], b["input_ids"])
        # Other batch mates (other padding) may move the last float bit, nothing more.
        torch.testing.assert_close(a["aux"], b["aux"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a["final"], b["final"], atol=1e-5, rtol=1e-5)


@pytest.mark.faults
def test_kill_mid_shard_then_resume(tgt, tmp_path, caplog):
    tok = tmp_path / "tokens.parquet"
    write_tokens(tok, 60, seed=1, lo=8, hi=24)
    # tokenize's record of its file, which `python -m eaglet.features.extract` checks before reading it
    write_json(tmp_path / "metadata.json", {DIGESTS_KEY: record_digests(tmp_path, [tok.name])})
    out, work = tmp_path / "shard_0", tmp_path / "shard_0.partial"
    cmd = [sys.executable, "-m", "eaglet.features.extract", "--tokens", str(tok), "--identity", str(tgt[1]),
           "--out", str(out), "--work", str(work), "--dtype", "bfloat16", "--token-budget", "24",
           "--chunk-mb", "0.001", "--no-progress"]  # ~1 sample per batch and per chunk
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    done = []
    while time.time() < deadline and p.poll() is None:
        try:
            done = read_json(work / "progress.json")["chunks"]
        except (ArtifactError, OSError):  # not written yet
            done = []
        if len(done) >= 5:
            break
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL, "extraction finished before it could be killed"
    assert not (out / "index.json").exists()
    done = read_json(work / "progress.json")["chunks"]
    assert 5 <= len(done) < 60
    before = {c["file"]: os.stat(work / c["file"]) for c in done}

    with caplog.at_level(logging.INFO, logger="eaglet"):
        idx = extract(tok, tgt[1], out, work_dir=work, dtype="bfloat16", token_budget=24, chunk_mb=0.001,
                      progress=False)
    assert f"resuming after {len(done)} complete chunks" in caplog.text
    assert not work.exists()
    for name, st in before.items():  # same file, untouched: not recomputed
        now = os.stat(out / name)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert len(idx["samples"]) == 60

    ref = tmp_path / "ref"
    extract(tok, tgt[1], ref, dtype="bfloat16", token_budget=24, chunk_mb=0.001, progress=False)
    a, b = HiddenStateDataset([out]), HiddenStateDataset([ref])
    assert a.ids == b.ids
    for i in range(len(a)):
        x, y = a.sample(i), b.sample(i)
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["aux"], y["aux"]) and torch.equal(x["final"], y["final"])


@pytest.mark.faults
def test_changed_tokens_restart_the_shard(tgt, tmp_path):
    tok = tmp_path / "tokens.parquet"
    write_tokens(tok, 6, seed=2)
    work = tmp_path / "w"
    extract(tok, tgt[1], tmp_path / "a", work_dir=work, chunk_mb=0.001, progress=False)
    rows = write_tokens(tok, 6, seed=3)  # same ids, other tokens
    extract(tok, tgt[1], tmp_path / "b", work_dir=work, chunk_mb=0.001, progress=False)
    ds = HiddenStateDataset([tmp_path / "b"])
    want = {r["id"]: r["input_ids"] for r in rows}
    assert all(ds.input_ids(i).tolist() == want[sid] for i, sid in enumerate(ds.ids))


@pytest.mark.faults
def test_nan_in_target_is_refused(tgt, tokens, tmp_path):
    import shutil

    src = Path(tgt[0]["path"])
    bad = tmp_path / "model"
    shutil.copytree(src, bad)
    w = load_tensors(bad / "model.safetensors")
    name = next(k for k in w if k.endswith("layers.1.mlp.down_proj.weight"))
    w[name][:, :] = float("nan")
    save_tensors(bad / "model.safetensors", w, metadata={"format": "pt"})
    write_json(tmp_path / "identity.json", {**tgt[0], "path": str(bad), "digest": "bad",
                                            "files": folder_manifest(bad)})
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        extract(tokens[0], tmp_path / "identity.json", tmp_path / "s", progress=False)
