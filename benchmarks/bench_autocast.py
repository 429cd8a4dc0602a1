"""Training speed with the drafter's forward under bf16 autocast vs fp32 (``train.autocast``, issue
15), on this machine's CPU (or GPU), paired.

    python benchmarks/bench_autocast.py [--run smollm2] [--steps 6] [--repeats 5] [--synthetic]
        [--params '{"token_budget": 2048}'] [--identity resources/targets/smollm2-135m-instruct/identity.json]

Data: the run's stored hidden states and vocab map (results/<run>/extract, vocab_map), else (or
with ``--synthetic``) random states of the target's shape (bench_train's): speed does not depend on
the values. The trainer itself (eaglet.train.train.train, config/config.yaml's train section) runs
``--steps`` optimizer steps, validation and checkpoints off, once with ``autocast: float32`` and
once with ``autocast: bfloat16`` per repeat, in alternating order (fp32 first on even repeats,
bf16 first on odd ones), so slow drifts of a shared machine hit both. Both see the same batches
(same seed). A run's time is the trainer's own per-step time (tokens / tok_s in metrics.parquet)
summed over steps 1.. (step 0 is warm-up). Prints each mode's median tok/s, the per-repeat ratios
(fp32 time / bf16 time), their median with a distribution-free interval (benchmarks/paired.py) and
whether the interval lets "bf16 is faster" be concluded; ``ratio:`` = the median (goal > 1: worth
turning on). The CPU's bf16 capability (eaglet.base.capability) is printed: without bf16 units the
ratio is expected below 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from bench_train import config_params, data_args, store  # noqa: E402
from paired import spread_note  # noqa: E402

from eaglet.base import capability  # noqa: E402
from eaglet.base.logs import setup_logging  # noqa: E402
from eaglet.train.train import resolve_params, train  # noqa: E402

MODES = ("float32", "bfloat16")


def timed(hidden: list[str], vocab: str, ident: dict, out: Path, params: dict) -> tuple[float, float]:
    """(seconds, tokens) of the trainer's steps 1.. (step 0 is warm-up)."""
    train(hidden, vocab, ident, out, params)
    rows = pd.read_parquet(out / "metrics.parquet")
    rows = rows[rows.split == "train"].reset_index(drop=True).iloc[1:]
    return float((rows.tokens / rows.tok_s).sum()), float(rows.tokens.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data_args(ap)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    setup_logging()

    conf, ident, params = config_params(a, a.steps)
    resolve_params(params)
    flags = capability.cpu_flags()
    print(f"CPU: {capability.cpu_model()}; bf16 units: "
          f"{', '.join(sorted(f for f in flags if 'bf16' in f or f.startswith('amx'))) or 'none'}; "
          f"threads {torch.get_num_threads()}")

    secs: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        hidden, vocab_path, source = store(a, conf, ident, params, Path(tmp))
        print(f"data: {source}; {a.steps} steps per run (step 0 warm-up), {a.repeats} repeats, "
              f"token_budget {params.get('token_budget')}, ttt_steps {params.get('ttt_steps')}")
        tokens = None
        for i in range(a.repeats):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                s, n = timed(hidden, vocab_path, ident, Path(tmp) / f"{mode}_{i}", dict(params, autocast=mode))
                if tokens is not None and n != tokens:
                    raise SystemExit(f"the runs trained on different tokens ({n} vs {tokens}): not comparable")
                tokens = n
                secs[mode].append(s)
                print(f"  repeat {i} {mode:8s} {n / s:8.0f} tok/s ({s:.2f} s)", flush=True)
    for m in MODES:
        print(f"{m}: median {tokens / statistics.median(secs[m]):.0f} tok/s "
              f"(range {tokens / max(secs[m]):.0f}-{tokens / min(secs[m]):.0f})")
    ratios = [f / b for f, b in zip(secs["float32"], secs["bfloat16"], strict=True)]
    print("pair ratios (fp32 time / bf16 time): " + ", ".join(f"{r:.3f}" for r in ratios))
    print(spread_note(ratios, 1.0))
    print(f"ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
