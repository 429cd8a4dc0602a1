"""Hidden-state shard format: round trip, fp8, resume, and refusing broken shards."""

import json
import re
from pathlib import Path

import pytest
import torch

from eaglet.base import digests
from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json
from eaglet.hidden import reader
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.hidden.store import ShardWriter, fp8_encode

H = 16


def make_samples(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = 3 + i
        out.append((f"s{i}", torch.randint(0, 1000, (T,), generator=g), torch.randint(0, 2, (T,), generator=g),
                    torch.randn(T, 3, H, generator=g) * (i + 1), torch.randn(T, H, generator=g),
                    torch.randn(T, generator=g) + 5, torch.randint(0, 1000, (T,), generator=g)))
    return out


def write(out, samples, dtype="float32", chunk_bytes=4000, **kw):
    w = ShardWriter(out, 0, 1, [1, 2, 3], True, dtype, H, "digest", chunk_bytes, final_layer=4, **kw)
    for s in samples:
        if s[0] not in w.done_ids:
            w.add(*s)
    return w.finish()


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("bfloat16", 1 / 128), ("fp8", 1 / 8)])
def test_round_trip(tmp_path, dtype, tol):
    samples = make_samples()
    index = write(tmp_path / "s", samples, dtype)
    assert index["complete"] and len(index["chunks"]) > 1
    ds = HiddenStateDataset([tmp_path / "s" / "index.json"])
    assert ds.ids == [s[0] for s in samples] and ds.num_tokens == [len(s[1]) for s in samples]
    assert ds.meta["layer_ids"] == [1, 2, 3] and ds.meta["final_is_prenorm"] is True
    for i, (sid, ids, mask, aux, final, lse, top1) in enumerate(samples):
        got = ds.sample(i)
        assert got["id"] == sid and got["input_ids"].dtype == torch.long
        # the target's full-vocabulary statistics are kept exactly, whatever the states' dtype
        assert torch.equal(got["target_lse"], lse) and torch.equal(got["target_top1"], top1)
        assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"].long(), mask)
        assert got["aux"].dtype == torch.float32 and got["aux"].shape == aux.shape
        # Relative error per token: bf16 keeps 8 bits, e4m3 3 bits of mantissa.
        rel = (got["aux"] - aux).abs() / aux.abs().amax(-1, keepdim=True)
        assert rel.max() <= tol
        rel = (got["final"] - final).abs() / final.abs().amax(-1, keepdim=True)
        assert rel.max() <= tol


def test_fp8_is_per_token_scaled():
    x = torch.tensor([[1e-3, -2e-3], [300.0, 10.0], [0.0, 0.0]])
    q, scale = fp8_encode(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3,)
    back = q.float() * scale[:, None]
    assert torch.allclose(back, x, rtol=0.07)  # tiny and large tokens both survive
    assert torch.equal(back[2], x[2])


@pytest.mark.faults
def test_resume_keeps_complete_chunks(tmp_path):
    samples = make_samples()
    w = ShardWriter(tmp_path / "s", 0, 1, [1, 2, 3], True, "float32", H, "digest", 4000)
    for s in samples[:7]:
        w.add(*s)
    w.close()  # stands in for a kill: the buffered tail is lost, saved chunks stay
    prog = read_json(tmp_path / "s" / "progress.json")
    saved = {c["file"]: (tmp_path / "s" / c["file"]).stat().st_ino for c in prog["chunks"]}
    assert saved and not (tmp_path / "s" / "index.json").exists()
    w2 = ShardWriter(tmp_path / "s", 0, 1, [1, 2, 3], True, "float32", H, "digest", 4000)
    done = w2.done_ids
    assert done == {s["id"] for s in prog["samples"]} and 0 < len(done) < 7
    for s in samples:
        if s[0] not in done:
            w2.add(*s)
    w2.finish()
    for name, ino in saved.items():  # not rewritten
        assert (tmp_path / "s" / name).stat().st_ino == ino
    ref = write(tmp_path / "ref", samples)
    a, b = HiddenStateDataset([tmp_path / "s"]), HiddenStateDataset([tmp_path / "ref"])
    assert a.ids == b.ids and len(ref["chunks"]) == len(read_json(tmp_path / "s" / "index.json")["chunks"])
    for i in range(len(a)):
        assert torch.equal(a.sample(i)["aux"], b.sample(i)["aux"])


@pytest.mark.faults
def test_other_settings_start_over(tmp_path):
    samples = make_samples(4)
    w = ShardWriter(tmp_path / "s", 0, 1, [1, 2, 3], True, "float32", H, "digest", 100)
    for s in samples:
        w.add(*s)
    w.close()
    w2 = ShardWriter(tmp_path / "s", 0, 1, [1, 2, 3], True, "float32", H, "other-target", 100)
    assert w2.done_ids == set() and not list((tmp_path / "s").glob("chunk_*"))
    w2.close()


def test_work_dir_moves_into_out_dir(tmp_path):
    write(tmp_path / "out", make_samples(5), work_dir=tmp_path / "work")
    assert not (tmp_path / "work").exists()
    assert len(HiddenStateDataset([tmp_path / "out"])) == 5


@pytest.fixture
def shard(tmp_path):
    write(tmp_path / "s", make_samples())
    return tmp_path / "s"


def _rows_by_chunk(shard) -> dict[int, list[int]]:
    """Dataset positions of each chunk's samples (one shard: dataset order is index order)."""
    out: dict[int, list[int]] = {}
    for i, s in enumerate(json.loads((shard / "index.json").read_text())["samples"]):
        out.setdefault(s["chunk"], []).append(i)
    return out


def test_open_hashes_nothing_and_each_chunk_is_hashed_once_when_read(shard, monkeypatch):
    """Issue 14: hashing every chunk at open stalled rank 0 past the NCCL time-out at TB scale."""
    hashed: list[str] = []
    digest = digests.file_digest

    def counting_digest(path, *a, **k):
        hashed.append(Path(path).name)
        return digest(path, *a, **k)

    for module in (digests, reader):  # base's own checks, and the reader, which imports it by name
        monkeypatch.setattr(module, "file_digest", counting_digest)
    ds = HiddenStateDataset([shard / "index.json"], max_open=1)  # max_open=1: every switch reopens
    assert hashed == []
    by_chunk = _rows_by_chunk(shard)
    assert len(by_chunk) >= 3
    for _ in range(2):
        for i in range(len(ds)):
            ds.sample(i)
            ds.input_ids(i)
    assert sorted(hashed) == [f"chunk_{j:05d}.safetensors" for j in sorted(by_chunk)]
    hashed.clear()
    HiddenStateDataset([shard / "index.json"], verify="header").sample(0)
    assert hashed == []


@pytest.mark.faults
def test_flipped_byte_opens_but_its_chunk_is_refused_when_read(shard):
    f = shard / "chunk_00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF  # in the tensor data: the header and size still agree with the index
    f.write_bytes(bytes(data))
    ds = HiddenStateDataset([shard / "index.json"])
    by_chunk = _rows_by_chunk(shard)
    for i in by_chunk[0] + by_chunk[2]:
        assert ds.sample(i)["aux"].shape[0] == ds.num_tokens[i]
    for read in (ds.sample, ds.input_ids):
        for i in by_chunk[1]:  # refused every time, not just the first
            with pytest.raises(ArtifactError, match=f"{re.escape(str(f))}: sha256 differs.*index.json"):
                read(i)


@pytest.mark.faults
def test_truncated_chunk_is_refused_naming_the_chunk(shard):
    f = shard / "chunk_00002.safetensors"
    f.write_bytes(f.read_bytes()[:-40])
    for verify in ("sha", "header"):
        with pytest.raises(ArtifactError, match="chunk_00002.safetensors"):
            HiddenStateDataset([shard / "index.json"], verify=verify)


@pytest.mark.faults
def test_missing_chunk_is_refused(shard):
    (shard / "chunk_00000.safetensors").unlink()
    with pytest.raises(ArtifactError, match="chunk_00000.safetensors.*missing"):
        HiddenStateDataset([shard / "index.json"], verify="header")


@pytest.mark.faults
def test_index_disagreeing_with_files_is_refused(shard):
    idx = json.loads((shard / "index.json").read_text())
    idx["chunks"][0]["num_tokens"] += 1
    idx["samples"][0]["num_tokens"] += 1
    (shard / "index.json").write_text(json.dumps(idx))
    with pytest.raises(ArtifactError, match="chunk_00000.safetensors.*disagree"):
        HiddenStateDataset([shard / "index.json"], verify="header")


@pytest.mark.faults
def test_truncated_or_incomplete_index_is_refused(shard):
    text = (shard / "index.json").read_text()
    (shard / "index.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArtifactError, match="index.json"):
        HiddenStateDataset([shard / "index.json"])
    idx = json.loads(text)
    idx["complete"] = False
    (shard / "index.json").write_text(json.dumps(idx))
    with pytest.raises(ArtifactError, match="index.json: shard is not complete"):
        HiddenStateDataset([shard / "index.json"])


@pytest.mark.faults
def test_shards_of_different_targets_are_refused(tmp_path):
    write(tmp_path / "a", make_samples(3))
    w = ShardWriter(tmp_path / "b", 0, 1, [1, 2, 3], True, "float32", H, "another", 4000)
    w.add(*make_samples(4)[3])
    w.finish()
    with pytest.raises(ArtifactError, match="target_digest"):
        HiddenStateDataset([tmp_path / "a", tmp_path / "b"])


@pytest.mark.faults
def test_a_store_of_the_older_format_is_refused_saying_how_to_rebuild_it(tmp_path):
    """Format 1 stores held no target statistics: the trainer would have to guess them, so every
    reader refuses such a store, naming the rule to rerun."""
    write(tmp_path / "s", make_samples(3))
    idx = read_json(tmp_path / "s" / "index.json")
    assert idx["format"] == reader.FORMAT == 2
    del idx["format"]  # as eaglet wrote it before the statistics
    (tmp_path / "s" / "index.json").write_text(json.dumps(idx))
    with pytest.raises(reader.FormatError, match=r"format 1, this eaglet reads format 2.*extract_hidden_states"):
        HiddenStateDataset([tmp_path / "s"])
    with pytest.raises(ValueError, match="lse"):  # a writer is never given states without them
        ShardWriter(tmp_path / "t", 0, 1, [1, 2, 3], True, "float32", H, "d", 4000).add(*make_samples(1)[0][:5],
                                                                                        torch.zeros(2), torch.zeros(2))
