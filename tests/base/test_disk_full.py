"""A write that runs out of space says so: the file being written, "disk is full", the free bytes on
that filesystem; and it leaves nothing behind. On a real full filesystem: a 1 MiB tmpfs mounted for
the test (root; CI runs as root: there a failed mount fails the test instead of skipping it)."""

import os
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch

from eaglet.base.artifacts import DiskFullError
from eaglet.base.files import atomic_path, read_json, write_json, write_parquet, write_text
from eaglet.base.tensors import save_tensors

SIZE = 1 << 20


@pytest.fixture()
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny_fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode:
        why = f"cannot mount a {SIZE}-byte tmpfs (needs root): {p.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


BIG = np.random.default_rng(0).random(1 << 19)  # 4 MiB that do not compress: four times the filesystem


def _save_checkpoint(path):
    from eaglet.train.state import save_checkpoint  # the trainer's checkpoint writer (torch.save)

    save_checkpoint(path.parent, 7, {"weights": torch.from_numpy(BIG)}, keep=2)


WRITERS = {
    "step_00000007.pt": _save_checkpoint,  # torch.save's short write: "unexpected pos N vs M"
    "chunk.safetensors": lambda p: save_tensors(p, {"aux": BIG}),
    "tokens.parquet": lambda p: write_parquet(p, pd.DataFrame({"x": BIG})),
    "summary.json": lambda p: write_json(p, {"x": BIG}),
    "top.tsv": lambda p: write_text(p, "x" * (4 * SIZE)),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_full_disk_is_named_with_the_file_and_the_free_bytes(name, tiny_fs):
    path = tiny_fs / "stage" / name
    with pytest.raises(DiskFullError) as e:
        WRITERS[name](path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: disk is full"), msg
    assert f"bytes free on {tiny_fs}" in msg, msg
    assert e.value.errno == 28 and isinstance(e.value, OSError)
    assert not os.path.lexists(path) and not list(path.parent.iterdir())  # no temporary file left
    # The space is back: the same write of a small artifact succeeds there.
    write_json(path.with_name("small.json"), {"ok": True})
    assert read_json(path.with_name("small.json")) == {"ok": True}


def test_other_write_errors_are_not_called_a_full_disk(tmp_path):
    with pytest.raises(RuntimeError, match="boom") as e, atomic_path(tmp_path / "x.bin") as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert not isinstance(e.value, DiskFullError)
    assert not list(tmp_path.iterdir())
