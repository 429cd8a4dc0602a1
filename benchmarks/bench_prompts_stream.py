"""The prompts stage at scale (issue 45): peak memory and rows/s reading a JSONL and a Parquet file
of generated conversations at two sizes (default 100k and 1M rows), each read in a fresh process.

    python benchmarks/bench_prompts_stream.py [--small 100000] [--large 1000000] [--dir DIR]

Each read is the stage as the rule runs it (``python -m eaglet.data.prompts``'s main: read, pick,
write the two Parquet files). Prints, per format, ``ratio <format>: <peak RSS at large / at
small>`` (goal <= 1.2: memory flat as rows grow; the stage keeps a byte per record and an 8-byte id
hash while it checks them, 9 MB per million rows) and ``note <format>: ...`` with both peaks and
the rows/s at each size (the whole stage's time). The files
hold a malformed line every 1,000 and a repeated id every 5,000 rows, so every pass the stage makes
(check, duplicates, pick) runs. The selection is the stage's default: 1,000 training rows and 40
held out.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = 50_000


def rows(start: int, stop: int) -> list[dict]:
    out = []
    for i in range(start, stop):
        rid = f"r{i - 1}" if i % 5000 == 4999 else f"r{i}"  # a repeated id every 5,000 rows
        out.append({"id": rid, "conversations": [
            {"from": "human", "value": f"Question {i}: what is {i % 97} times {i % 89}? " + "x" * (i % 64)},
            {"from": "gpt", "value": f"It is {(i % 97) * (i % 89)}. " + "y" * (i % 128)}]})
    return out


def write_files(folder: Path, n: int) -> dict[str, Path]:
    """``n`` rows as JSONL and as Parquet (row groups of 50,000)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": folder / f"p{n}.jsonl", "parquet": folder / f"p{n}.parquet"}
    writer = None
    with open(paths["jsonl"], "w") as fh:
        for start in range(0, n, BATCH):
            batch = rows(start, min(n, start + BATCH))
            for j, r in enumerate(batch):
                fh.write("{not json\n" if (start + j) % 1000 == 999 else json.dumps(r) + "\n")
            table = pa.Table.from_pylist(batch)
            if writer is None:
                writer = pq.ParquetWriter(paths["parquet"], table.schema)
            writer.write_table(table, row_group_size=BATCH)
    writer.close()
    return paths


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux carries that
    over exec from the parent, whose generated rows it would report."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no /proc: the best there is


def child(path: str) -> None:
    """One run of the stage as the rule runs it (its CLI: read, pick, write the two Parquet files):
    peak RSS of this process and the time, as JSON."""
    from eaglet.base.files import read_json
    from eaglet.data import prompts

    before = peak_rss_mb()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        prompts.main(["--source", "file", "--path", path, "--n", "1000", "--heldout", "40", "--seed", "0",
                      "--out-dir", out])
        seconds = time.perf_counter() - t0
        s = read_json(Path(out) / "summary.json")
    print(json.dumps({"peak_mb": peak_rss_mb(), "imports_mb": before, "seconds": seconds, "rows": s["records_read"],
                      "valid": s["valid"], "train": s["train"]}))


def measure(path: Path) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", str(path)], cwd=ROOT, capture_output=True, text=True,
                       check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=100_000)
    ap.add_argument("--large", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="where the generated files go (default: a temporary folder)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        files = {n: write_files(Path(tmp), n) for n in (a.small, a.large)}
        for fmt in ("jsonl", "parquet"):
            got = {n: measure(files[n][fmt]) for n in (a.small, a.large)}
            s, big = got[a.small], got[a.large]
            print(f"ratio {fmt}: {big['peak_mb'] / s['peak_mb']:.3f}")
            grow = big["peak_mb"] - s["peak_mb"]
            rates = f"{s['rows'] / s['seconds']:,.0f} and {big['rows'] / big['seconds']:,.0f} rows/s"
            print(f"note {fmt}: peak RSS of the stage {s['peak_mb']:.0f} MB at {a.small:,} rows, "
                  f"{big['peak_mb']:.0f} MB at {a.large:,} ({grow:+.0f} MB; {s['imports_mb']:.0f} MB before it "
                  f"started); {rates}")


if __name__ == "__main__":
    main()
