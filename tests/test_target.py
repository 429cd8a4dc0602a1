"""target: materialisation and identity."""

import shutil
from pathlib import Path

import pytest

from eaglet import io
from eaglet.target import default_layer_ids, load_identity, load_tokenizer, materialise, validate_layer_ids


def user_checkpoint(tiny_target, dest: Path) -> Path:
    """A copy of the tiny target's checkpoint standing in for a user's own local folder, its files
    owner-only (0600) as a user's downloaded weights may be."""
    shutil.copytree(tiny_target["path"], dest)
    for f in dest.iterdir():
        f.chmod(0o600)
    return dest


def test_local_checkpoint_is_read_in_place_never_linked(tiny_target, tmp_path):
    """target.path: a local safetensors checkpoint is neither re-saved (a 1T target cannot be) nor
    linked (the cache would re-permission the user's files through the links): identity.json
    records the folder's absolute path; the digest equals that of the same weights materialised."""
    user = user_checkpoint(tiny_target, tmp_path / "user")
    modes = {f.name: f.stat().st_mode for f in user.iterdir()}
    ident = materialise({"name": "local", "path": str(user)}, tmp_path / "t")
    assert not [p for p in (tmp_path / "t").rglob("*") if p.is_symlink()]
    assert ident["digest"] == tiny_target["digest"] and ident["num_layers"] == tiny_target["num_layers"]
    loaded = load_identity(tmp_path / "t" / "identity.json")
    assert loaded["path"] == str(user)
    assert load_tokenizer(loaded["path"]).chat_template
    assert {f.name: f.stat().st_mode for f in user.iterdir()} == modes


def test_identity_records_a_manifest_that_every_read_checks(tiny_target, tmp_path):
    """load_identity refuses, naming the file, a target folder changed since target_model identified
    it: a small file edited, a file added (a legacy chat template file), a big file resized."""
    user = user_checkpoint(tiny_target, tmp_path / "user")
    materialise({"name": "local", "path": str(user)}, tmp_path / "t")
    ident_path = tmp_path / "t" / "identity.json"
    files = load_identity(ident_path)["files"]
    assert files["config.json"]["sha256"] and files["model.safetensors"]["size"] > 0

    conf = user / "config.json"
    original = conf.read_bytes()
    conf.write_bytes(original.replace(b'"hidden_act": "silu"', b'"hidden_act": "gelu"'))
    assert conf.stat().st_size == len(original)  # same size: only the digest can tell
    with pytest.raises(io.ArtifactError, match=r"config\.json: sha256 differs"):
        load_identity(ident_path)
    conf.write_bytes(original)
    load_identity(ident_path)

    (user / "chat_template.json").write_text('{"chat_template": "{{ messages }}"}')
    with pytest.raises(io.ArtifactError, match=r"chat_template\.json: not in the manifest"):
        load_identity(ident_path)
    (user / "chat_template.json").unlink()

    with open(user / "model.safetensors", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(io.ArtifactError, match=r"model\.safetensors: \d+ bytes"):
        load_identity(ident_path)


def test_big_files_are_checked_by_size_small_ones_by_digest(tmp_path, monkeypatch):
    """The stated cost choice: files above io.FULL_HASH_MAX_BYTES carry a size only."""
    (tmp_path / "big.bin").write_bytes(b"x" * 100)
    (tmp_path / "small.json").write_text("{}")
    monkeypatch.setattr(io, "FULL_HASH_MAX_BYTES", 50)
    m = io.folder_manifest(tmp_path)
    assert m["big.bin"] == {"size": 100} and set(m["small.json"]) == {"size", "sha256"}


def test_layer_ids_default_and_validation():
    assert default_layer_ids(30) == [2, 15, 27]      # SmolLM2-135M (eagle3.md §5)
    assert default_layer_ids(61) == [2, 30, 58]      # Kimi-K2
    with pytest.raises(ValueError, match="outside"):
        validate_layer_ids([2, 15, 31], 30)
    # id N is the final state: vLLM records aux states only entering layers 0..N-1, never serves it
    with pytest.raises(ValueError, match=r"extract.layer_ids: \[2, 15, 30\] outside \[1, 29\]"):
        validate_layer_ids([2, 15, 30], 30)
    assert validate_layer_ids([2, 15, 29], 30) == [2, 15, 29]
    with pytest.raises(ValueError, match="ascending"):
        validate_layer_ids([15, 2, 27], 30)
