"""The GPU check's figures (scripts/gpu-check.sh), in one table, from a finished run and the
extraction benchmark's output; exits 1 when a figure is missing or says the check failed.

    python scripts/gpu_check_table.py results/gpu-check results/gpu-check/bench_extract.txt [--wall-s 512]

Why a table of its own: `python -m eaglet.workflow.summary` says what each stage produced; this says what
the GPU machine is for, measured: extraction tok/s against the bare forward of the same batches,
training tok/s, and vLLM's τ and speedup with the drafter, plus whether the contract passed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def bench_figures(text: str) -> dict[str, float]:
    """bench_extract.py's last three lines: bare forward and extraction tok/s, and their ratio."""
    out = {}
    for key, pat in (("bare", r"^bare forward:\s+([\d.]+)"), ("extract", r"^extraction:\s+([\d.]+)"),
                     ("ratio", r"^ratio:\s+([\d.]+)")):
        m = re.search(pat, text, re.M)
        if m:
            out[key] = float(m.group(1))
    return out


def figures(run_dir: Path, bench_text: str, wall_s: float | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(rows of the table, what failed)."""
    rows: list[tuple[str, str]] = []
    failed: list[str] = []
    b = bench_figures(bench_text)
    if {"bare", "extract", "ratio"} <= set(b):
        rows.append(("extraction tok/s ÷ bare forward", f"{b['extract']:.0f} ÷ {b['bare']:.0f} = {b['ratio']:.3f}"))
    else:
        failed.append("extraction benchmark: no figures in its output")
    t = _load(run_dir / "train/train_summary.json")
    if t.get("tok_s") and t.get("device") == "cuda":
        rows.append(("training tok/s", f"{t['tok_s']:.0f} ({t['world_size']} rank(s) on cuda, {t['steps']} steps)"))
    else:
        failed.append(f"training: no tok/s on cuda (device {t.get('device')})")
    c = _load(run_dir / "drafter/contract.json")
    rows.append(("export contract (real vLLM load)", "passed" if c.get("ok") else f"FAILED {c.get('failed')}"))
    if not c.get("ok"):
        failed.append("export contract")
    h = _load(run_dir / "eval/summary.json").get("headline") or {}
    tau, speed = h.get("tau_vllm") or {}, h.get("speedup_vllm") or {}
    if tau and speed:
        k = h.get("vllm_k")
        rows.append((f"vLLM τ (k={k})", ", ".join(f"{s} {v:.2f}" for s, v in tau.items() if v is not None)))
        rows.append(("vLLM speedup vs plain", ", ".join(f"{s} ×{v:.2f}" for s, v in speed.items() if v is not None)))
    else:
        failed.append("evaluation: no vLLM τ / speedup")
    if h.get("lossless_vllm") is False:
        failed.append("vLLM output differs from plain greedy")
    if wall_s is not None:
        rows.append(("DAG wall time", f"{wall_s / 60:.1f} min"))
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("bench_output", type=Path)
    p.add_argument("--wall-s", type=float, default=None)
    a = p.parse_args(argv)
    bench = a.bench_output.read_text() if a.bench_output.exists() else ""
    rows, failed = figures(a.run_dir, bench, a.wall_s)
    print("| GPU check | measured |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
