"""`make bench`: every stage's benchmark on the default target, one table of ratios.

    python -m benchmarks.run_all [--only tokenize,extract] [--out results/bench.json]
        [--args 'fp8=--n 16 --epochs 1'] [--timeout 1800]

Each benchmark measures its figures side by side in one process and prints a line starting
``ratio`` (``ratio <key>: <value>`` when it fills several rows); this runner collects those lines
into a table and a JSON file, one row per ratio, each with its own goal and direction (``>=``:
higher is better; ``<=``: lower is better, e.g. bytes or a cost ratio). A line ``note: ...``
(``note <key>: ...``) goes into the row's note column; ``ratio <key>: skipped`` marks a row not
measured in this run. ``--args NAME=ARGS`` appends ARGS to benchmark NAME's command (argparse
keeps the last value of a repeated option, so this overrides the defaults below). Benchmarks need
the default target materialised (``make run`` does it; or ``snakemake --cores 2
resources/targets/smollm2-135m-instruct/identity.json``); fp8 and scale also read
results/smollm2/tokenize/tokens.parquet and vocab_map/ when present (never written); anchor reads
a run's stored hidden states (results/*/extract) and needs the optional envs/anchor/.venv (``make
anchor-env``), else its rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    name: str                 # the table's benchmark column
    measures: str
    goal: float
    op: str = ">="            # ">=": meets the goal at or above it; "<=": at or below it
    key: str | None = None    # the benchmark's ``ratio <key>:`` line; None: its last ratio line
    miss: str | None = None   # status when the goal is missed (default: below / above goal)


SCALE = "cost at 2x tokens / at 1x"
# name: (command, rows)
BENCHES = {
    "tokenize": (["benchmarks/bench_tokenize.py", "--n", "1000"],
                 [Row("tokenize", "tokenisation / raw batch encode", 0.8)]),
    "generate": (["benchmarks/bench_generate.py", "--n", "16", "--max-tokens", "48"],
                 [Row("generate", "generation stage / bare openai loop", 0.9)]),
    "extract": (["benchmarks/bench_extract.py", "--n", "8"], [Row("extract", "extraction / bare forward", 0.95)]),
    "train": (["benchmarks/bench_train.py", "--synthetic", "--steps", "3"],
              [Row("train", "training FLOP/s / matmul peak", 0.5)]),
    "autocast": (["benchmarks/bench_autocast.py", "--steps", "6", "--repeats", "5"],
                 [Row("autocast", "train tok/s bf16 autocast / fp32, paired (train.autocast)", 1.0)]),
    "online": (["benchmarks/bench_online.py", "--n", "24", "--repeats", "3"],
               [Row("online", "online train tok/s / (extract + offline train), 1 epoch", 0.8)]),
    "fp8": (["benchmarks/bench_fp8.py"],
            [Row("fp8", "hidden bytes/token fp8 / bf16 (note: τ)", 0.55, "<=")]),
    "ablation": (["benchmarks/bench_ablation.py"],
                 [Row("ablation", "best recipe option's chain τ / baseline's (2 seeds; note: beyond noise?)", 1.0)]),
    # needs the runs of benchmarks/mix/*.yaml (results/mix-*); without them the row prints "skipped"
    "mix": (["benchmarks/bench_mix.py"],
            [Row("mix", "best data.mix arm's MT-Bench chain τ / all regenerated, equal CPU time (note: which)", 1.0)]),
    "scale": (["benchmarks/bench_scale.py"],
              [Row(f"scale_{s}", f"{s} {SCALE}", 2.3, "<=", key=s, miss="superlinear")
               for s in ("tokenize", "extract", "train", "generate")]),
    # generated rows only (no target): 100k and 1M rows of JSONL and Parquet, ~1 GB of temporary files
    "prompts": (["benchmarks/bench_prompts_stream.py"],
                [Row(f"prompts_{f}", f"prompts stage peak RSS at 1M {f} rows / at 100k (note: rows/s)", 1.2, "<=",
                     key=f, miss="memory grows") for f in ("jsonl", "parquet")]),
    # needs envs/anchor/.venv (`make anchor-env`); without it both rows print "skipped"
    "anchor": (["benchmarks/bench_anchor.py"],
               [Row("anchor_tau", "expected τ(k=3) at T = 1 eaglet / speculators Eagle3, same batches, 3 seeds",
                    1.05, key="tau"),
                Row("anchor_tau_t0", "chain τ(k=3) at T = 0 eaglet / speculators Eagle3, same batches, 3 seeds",
                    1.0, key="tau_t0"),
                Row("anchor_speed", "train tok/s eaglet / speculators Eagle3, same batches", 2.0, key="speed")]),
}
NUM = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|skipped)"


def parse_row(row: Row, out: str) -> tuple[float | str | None, str]:
    """(ratio, or "skipped", or None when the line is missing; the row's note) from a benchmark's stdout."""
    if row.key is None:
        m = re.findall(r"^ratio[^:]*:\s*" + NUM, out, flags=re.M)
        notes = re.findall(r"^note:\s*(.*)$", out, flags=re.M)
    else:
        k = re.escape(row.key)
        m = re.findall(rf"^ratio\s+{k}\s*:\s*" + NUM, out, flags=re.M)
        notes = re.findall(rf"^note\s+{k}\s*:\s*(.*)$", out, flags=re.M)
    ratio = None if not m else ("skipped" if m[-1] == "skipped" else float(m[-1]))
    return ratio, notes[-1].strip() if notes else ""


def status(row: Row, ratio, ok: bool) -> str:
    if not ok:
        return "failed"
    if ratio == "skipped":
        return "skipped"
    if ratio is None:
        return "no ratio"
    if (ratio >= row.goal) if row.op == ">=" else (ratio <= row.goal):
        return "meets goal"
    return row.miss or ("below goal" if row.op == ">=" else "above goal")


def run_one(name: str, timeout: int, extra: list[str]) -> tuple[dict, list[dict]]:
    cmd, rows = BENCHES[name]
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, *cmd, *extra], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
        out, err, ok = p.stdout, p.stderr, p.returncode == 0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, ok = f"timed out after {timeout} s", False
    n_lines = 10 + 3 * len(rows)
    bench = {"benchmark": name, "command": [*cmd, *extra], "ok": ok, "seconds": round(time.time() - t0, 1),
             "output": out.strip().splitlines()[-n_lines:] if out else [],
             "stderr": err.strip().splitlines()[-6:] if not ok and err else []}
    results = []
    for row in rows:
        ratio, note = parse_row(row, out)
        results.append({"benchmark": row.name, "measures": row.measures, "goal": row.goal, "op": row.op,
                        "ratio": ratio, "status": status(row, ratio, ok), "note": note, "ok": ok,
                        "run": name, "seconds": bench["seconds"], "output": bench["output"]})
    return bench, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated, of: {', '.join(BENCHES)}")
    ap.add_argument("--out", default=str(ROOT / "results/bench.json"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per benchmark")
    ap.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                    help="extra arguments for benchmark NAME (repeatable)")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n]
    extra: dict[str, list[str]] = {}
    for spec in a.args:
        name, _, args = spec.partition("=")
        extra.setdefault(name, []).extend(shlex.split(args))
    unknown = sorted((set(names) | set(extra)) - set(BENCHES))
    if unknown:
        ap.error(f"unknown benchmarks {unknown} (known: {', '.join(BENCHES)})")
    rows = []
    for name in names:
        print(f"== {name}", flush=True)
        bench, r = run_one(name, a.timeout, extra.get(name, []))
        print("\n".join(bench["output"] + bench["stderr"]), flush=True)
        rows += r
    w = max(len(r["measures"]) for r in rows) if rows else 40
    print(f"\n{'benchmark':15} {'measures':{w}} {'ratio':>7} {'goal':>7}  {'status':12} note")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if isinstance(r["ratio"], float) else (r["ratio"] or "n/a")
        goal = f"{r['op']}{r['goal']}"
        print(f"{r['benchmark']:15} {r['measures']:{w}} {ratio:>7} {goal:>7}  {r['status']:12} {r['note']}".rstrip())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n")
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
