"""Helpers shared by the fault-injection suite (tests/faults/test_faults_*.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq


def identity_path(tiny_target) -> Path:
    return Path(tiny_target["path"]).parent / "identity.json"


def generate_run(conversations, ident, out, cfg) -> dict:
    from eaglet.generate.generate import generate

    return generate(conversations, ident, out, cfg)


def corrupt_parquet(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "last_byte_cut":
        data = data[:-1]
    elif how == "footer_garbage":
        data[-12:-4] = b"\xff" * 8  # the footer length and the end of the footer
    elif how == "data_page_byte":
        # One flipped byte in the compressed values of the largest column chunk (its last page
        # ends the chunk). Without page CRCs such a flip can decode to other values silently.
        md = pq.ParquetFile(path).metadata
        cols = [md.row_group(0).column(i) for i in range(md.num_columns)]
        c = max(cols, key=lambda c: c.total_compressed_size)
        start = min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset)
        data[start + c.total_compressed_size - 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _smk(cwd: Path, *args, configfile: str, timeout: float = 600, log: Path | None = None):
    """Run Snakemake in ``cwd`` -> (exit code, output); with ``log``, start it in its own process
    group with its output going to that file, and return the Popen."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SNAKEMAKE_OUTPUT_CACHE", None)
    # --configfile takes several values: it comes last, after the targets and flags.
    cmd = [sys.executable, "-m", "snakemake", *args, "--cores", "2", "--configfile", configfile]
    if log is not None:
        with open(log, "w") as fh:
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr
