"""This machine's speed at what the suite spends its time on, in one line, so that two suite runs (another
day, another machine of the same kind) can be told apart from a change in the suite: `.ci/run` prints it
before and after the tests (docs/measurements.md, "The suite's time by machine").

    python scripts/cpu_speed.py [--seconds 2]

Two figures, each the median of repeated timings on one core:
  matmul   fp32 matrix products (torch, 512 x 512, one thread), GFLOP/s: the trainers' and engines' work
  start    a fresh interpreter importing torch, seconds: what every Snakemake job and runner pays
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def matmul_gflops(seconds: float) -> float:
    import torch

    torch.set_num_threads(1)
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 3:
        t0 = time.perf_counter()
        for _ in range(8):
            a @ b
        rates.append(8 * 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def start_seconds(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, env={"OMP_NUM_THREADS": "1"})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="how long to time the matrix products")
    ap.add_argument("--repeats", type=int, default=3, help="interpreter starts timed")
    a = ap.parse_args(argv)
    g, s = matmul_gflops(a.seconds), start_seconds(a.repeats)
    print(f"cpu_speed: matmul {g:.1f} GFLOP/s (fp32, one thread), start {s:.2f} s (python + import torch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
