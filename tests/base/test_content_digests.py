"""The content digest of a user's file or folder, hashed once per stat change
(eaglet.base.content_digests): a rewrite with its old mtime put back is hashed again (the ctime moved),
an unchanged file is not, a corrupt cache file is an empty one, and a job refuses a file that no
longer has the digest its params recorded."""

import hashlib
import json
import os
import time

import pytest

from eaglet.base import content_digests
from eaglet.base.artifacts import ArtifactError
from eaglet.base.content_digests import DigestCache, content_digest, verify_content


@pytest.fixture(autouse=True)
def no_racy_window(monkeypatch):
    """Files written by a test are seconds old at most: cache them at once (the racy window has its own test)."""
    monkeypatch.setattr(content_digests, "RACY_NS", -1)


def _rewrite_keeping_mtime(path, text):
    st = path.stat()
    time.sleep(0.02)  # past the clock tick of the file's ctime
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p, rsync -a or touch -d put it back


def test_a_rewrite_with_its_old_mtime_is_hashed_again(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"a": 1}\n')
    store = tmp_path / "cache.json"
    cache = DigestCache(store)
    first = content_digest(f, cache)
    assert first == "sha256:" + hashlib.sha256(b'{"a": 1}\n').hexdigest()
    cache.save()
    _rewrite_keeping_mtime(f, '{"a": 2}\n')  # same size, same mtime, new bytes
    again = DigestCache(store)
    assert content_digest(f, again) == "sha256:" + hashlib.sha256(b'{"a": 2}\n').hexdigest()
    assert again.hashed == [str(f)]


def test_an_unchanged_file_is_not_hashed_again(tmp_path):
    f = tmp_path / "set.parquet"
    f.write_bytes(b"x" * 1000)
    store = tmp_path / "cache.json"
    cache = DigestCache(store)
    want = content_digest(f, cache)
    cache.save()
    # the cached sha256 is what is served: a cache holding another one for this stat answers it
    data = json.loads(store.read_text())
    data["files"][str(f)][4] = "0" * 64
    store.write_text(json.dumps(data))
    again = DigestCache(store)
    assert content_digest(f, again) == "sha256:" + "0" * 64 and again.hashed == []
    # a new mtime with the same bytes is hashed again and gives the same digest
    os.utime(f, ns=(1, 1))
    third = DigestCache(store)
    assert content_digest(f, third) == want and third.hashed == [str(f)]


def test_a_corrupt_or_unreadable_cache_is_recomputed(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    want = "sha256:" + hashlib.sha256(b"hello").hexdigest()
    store = tmp_path / "cache.json"
    for bad in ("{not json", '{"version": 1, "files": [1, 2]}', '{"version": 1, "files": {"x": 3}}', "[]"):
        store.write_text(bad)
        cache = DigestCache(store)
        assert content_digest(f, cache) == want and cache.hashed == [str(f)]
        cache.save()
        assert json.loads(store.read_text())["files"][str(f)][4] == want.split(":")[1]
    store.unlink()
    store.mkdir()  # unreadable as a file, and not writable as one: hashed, the save ignored
    cache = DigestCache(store)
    assert content_digest(f, cache) == want
    cache.save()
    assert store.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "cache.json"]


def test_a_folder_is_its_visible_files_by_name_and_content(tmp_path):
    d = tmp_path / "model"
    (d / ".cache").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    cache = DigestCache(None)
    first = content_digest(d, cache)
    (d / ".cache" / "x").write_text("download state")  # dot-names are not the content
    assert content_digest(d, cache) == first
    (d / "config.json").rename(d / "other.json")  # a name is part of it
    assert content_digest(d, cache) != first
    with pytest.raises(FileNotFoundError):
        content_digest(tmp_path / "nope", cache)


def test_a_file_changed_since_the_parse_is_refused_naming_it(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "w.bin").write_text("weights")
    store = tmp_path / "cache.json"
    want = content_digest(d, DigestCache(store))
    verify_content(d, want, "target.path", DigestCache(store))  # unchanged: passes
    _rewrite_keeping_mtime(d / "config.json", '{"a": 2}')
    with pytest.raises(ArtifactError, match=r"target\.path: .*model changed after the workflow was parsed "
                                            r"\(changed since it was last hashed: .*config\.json\)"):
        verify_content(d, want, "target.path", DigestCache(store))


def test_a_file_just_written_is_hashed_at_every_ask_until_its_ctime_is_old(tmp_path, monkeypatch):
    monkeypatch.setattr(content_digests, "RACY_NS", 60_000_000_000)
    f = tmp_path / "a.txt"
    f.write_text("new")
    cache = DigestCache(tmp_path / "cache.json")
    content_digest(f, cache)
    assert cache.entries == {}  # a second write within the ctime's tick would look unchanged
    monkeypatch.setattr(content_digests, "RACY_NS", -1)
    content_digest(f, cache)
    assert list(cache.entries) == [str(f)]


def test_an_evaluation_set_changed_since_the_parse_is_refused(tmp_path, monkeypatch):
    """eaglet.base.datasets reads a user's .parquet set only with the content the parse recorded
    (the stages' set_digests), whichever evaluation stage reads it."""
    from eaglet.base import datasets
    from eaglet.base.conversations import write_conversations

    monkeypatch.chdir(tmp_path)  # the jobs' cache lives in the workflow folder's .snakemake/
    rows = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
    write_conversations(tmp_path / "set.parquet", rows)
    want = content_digest(tmp_path / "set.parquet", DigestCache())
    assert len(datasets.load_set("set.parquet", 2, want)) == 2
    write_conversations(tmp_path / "set.parquet", rows[:2])
    with pytest.raises(ArtifactError, match=r"evaluate\.sets: set\.parquet changed after the workflow was parsed"):
        datasets.load_set("set.parquet", 2, want)
    assert len(datasets.load_set("set.parquet", 2)) == 2  # no digest (outside the workflow): read as given
