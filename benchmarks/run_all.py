"""`make bench`: every stage's benchmark on the default target, one table of ratios.

    python -m benchmarks.run_all [--only tokenize,extract] [--out results/bench.json]

Each benchmark measures its two figures side by side in one process and prints a line starting
``ratio``; this runner collects those lines (and the figures above them) into a table and a JSON
file. Benchmarks need the default target materialised (``make run`` does it; or
``snakemake --cores 2 resources/targets/smollm2-135m-instruct/identity.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = {
    "tokenize": (["benchmarks/bench_tokenize.py", "--n", "500"], "tokenisation / raw batch encode", 0.8),
    "generate": (["benchmarks/bench_generate.py", "--n", "16", "--max-tokens", "48"],
                 "generation stage / bare openai loop", 0.9),
    "extract": (["benchmarks/bench_extract.py", "--n", "24"], "extraction / bare forward", 0.95),
    "train": (["benchmarks/bench_train.py", "--synthetic", "--steps", "3"], "training FLOP/s / matmul peak", 0.5),
}


def run_one(name: str, timeout: int) -> dict:
    cmd, what, goal = BENCHES[name]
    t0 = time.time()
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = p.stdout
    m = re.findall(r"^ratio[^:]*:\s*([0-9.]+)", out, flags=re.M)
    return {"benchmark": name, "measures": what, "goal": goal,
            "ratio": float(m[-1]) if m else None, "ok": p.returncode == 0,
            "seconds": round(time.time() - t0, 1),
            "output": out.strip().splitlines()[-6:] if out else p.stderr.strip().splitlines()[-6:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--out", default=str(ROOT / "results/bench.json"))
    ap.add_argument("--timeout", type=int, default=1800)
    a = ap.parse_args()
    rows = []
    for name in a.only.split(","):
        print(f"== {name}", flush=True)
        r = run_one(name, a.timeout)
        print("\n".join(r["output"]), flush=True)
        rows.append(r)
    print(f"\n{'benchmark':10} {'measures':40} {'ratio':>7} {'goal':>6}  status")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "n/a"
        status = "failed" if not r["ok"] else ("meets goal" if r["ratio"] and r["ratio"] >= r["goal"] else "below goal")
        print(f"{r['benchmark']:10} {r['measures']:40} {ratio:>7} {r['goal']:>6}  {status}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
