"""Tokenisation throughput vs the tokenizer's raw batch encode of the same texts, one run.

    python benchmarks/bench_tokenize.py [--identity resources/targets/smollm2-135m-instruct/identity.json]
        [--n 1000] [--repeats 3]

The stage (eaglet.tokenize.tokenize_rows) renders every conversation with the chat template,
renders the prefixes that locate the assistant spans, encodes with offsets, builds and verifies
the loss mask. The baseline is the tokenizer's own batch encode of the already-rendered texts
(no template, no offsets, no mask): the floor any tokenisation must pay. Both run over the same
ShareGPT conversations, alternating, best of ``--repeats``. Prints both tokens/s and the ratio
(goal >= 0.8).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eaglet import io, prompts, tokenize  # noqa: E402
from eaglet.target import load_identity, load_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    io.quiet_third_party()
    tok = load_tokenizer(load_identity(a.identity)["path"])
    rows = prompts.build_prompts("sharegpt", n=a.n, heldout=0, seed=0)["train"]
    texts = [tok.apply_chat_template(tokenize.with_reasoning(r["messages"], tok.chat_template), tokenize=False)
             for r in rows]
    best_raw = best_stage = float("inf")
    n_tokens = 0
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        enc = tok(texts, add_special_tokens=False)
        best_raw = min(best_raw, time.perf_counter() - t0)
        n_tokens = sum(len(x) for x in enc["input_ids"])
        t0 = time.perf_counter()
        kept, skipped, _ = tokenize.tokenize_rows(tok, rows, max_length=a.max_length)
        best_stage = min(best_stage, time.perf_counter() - t0)
    stage_tokens = sum(r["num_tokens"] for r in kept)
    raw_tps, stage_tps = n_tokens / best_raw, stage_tokens / best_stage
    print(f"conversations {len(rows)} ({len(kept)} kept, skipped {dict(skipped)}), {n_tokens} tokens")
    print(f"raw batch encode : {raw_tps:10.0f} tok/s")
    print(f"tokenize stage   : {stage_tps:10.0f} tok/s")
    print(f"ratio stage/raw  : {stage_tps / raw_tps:10.3f}  (goal >= 0.8)")


if __name__ == "__main__":
    main()
