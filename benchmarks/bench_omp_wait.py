"""What OpenMP's wait policy costs when two test workers share the machine's two cores.

`make test` runs two pytest-xdist workers (tests/suite_schedule.py), each given one OpenMP thread;
but Snakemake sets OMP_NUM_THREADS to a job's threads (2 with --cores 2) for the jobs of the DAG
tests, so two 2-thread processes often run on two cores. libgomp's default (active) policy spins a
waiting thread before it sleeps, and every small op of a tiny model is a parallel region: the two
processes' spinning threads take the cores from each other. tests/conftest.py sets
``OMP_WAIT_POLICY=PASSIVE`` in each worker (inherited by every process its tests start). This times
the case: two processes at once, each decoding with a tiny random Llama (the suite's shape) on two
threads, under each policy, alternated in pairs (the first pair dropped as warm-up); and one
process alone under each policy, the cost of passive when the cores are free:

    python benchmarks/bench_omp_wait.py [--repeats 4] [--tokens 100]

Prints each median and the median of the paired ratios (active / passive) with its interval.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired import alternate, print_paired  # noqa: E402

# One process's work: a tiny random Llama (8 layers, hidden 128, SmolLM2's vocabulary), greedy decoding
DECODE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152)
m = LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    out = m(torch.randint(0, 49152, (1, 64)), use_cache=True)
    for _ in range(int(sys.argv[1])):
        out = m(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
"""


def run(policy: str, processes: int, tokens: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": policy, "TRANSFORMERS_VERBOSITY": "error"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", DECODE, str(tokens)], env=env)
             for _ in range(processes)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a decoding process failed ({policy})")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=100)
    a = ap.parse_args()
    for n, what in ((2, "two processes at once (the suite's case)"), (1, "one process alone")):
        print(f"== {what}: {n} x (2 threads, {a.tokens} tokens)")
        times = alternate({"active": lambda n=n: run("ACTIVE", n, a.tokens),
                           "passive": lambda n=n: run("PASSIVE", n, a.tokens)}, a.repeats)
        print_paired(times, "active", "passive")


if __name__ == "__main__":
    main()
