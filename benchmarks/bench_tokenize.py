"""Tokenisation throughput vs the tokenizer's raw batch encode of the same texts, one run.

    python benchmarks/bench_tokenize.py [--identity resources/targets/smollm2-135m-instruct/identity.json]
        [--n 1000] [--repeats 8] [--max-spread 0.1]

The stage (eaglet.tokenize.tokenize_rows) renders every conversation with the chat template,
renders the prefixes that locate the assistant spans, encodes with offsets, builds and verifies
the loss mask. The baseline is the tokenizer's own batch encode of the already-rendered texts
(no template, no offsets, no mask): the floor any tokenisation must pay, in the
stage's own batches. Both run over the same ShareGPT conversations in pairs, ``--repeats`` pairs in
ABBA order (raw first, then stage first: drift cancels); each pair gives a ratio. Prints the
median tokens/s of each, the median pair ratio with its range, and says when the range is too wide
to conclude (> ``--max-spread`` of the median). On a quiet 2-core machine single pairs still
spread 15-27 % (2026-11-30), with one encoder thread (RAYON_RS_NUM_CPUS=1) as with two.
"""

from __future__ import annotations

import argparse
import statistics
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
    p.add_argument("--repeats", type=int, default=8, help="pairs of (raw, stage) runs")
    p.add_argument("--max-spread", type=float, default=0.1,
                   help="pair-ratio range, as a fraction of the median, above which no conclusion is drawn")
    a = p.parse_args()
    io.quiet_third_party()
    tok = load_tokenizer(load_identity(a.identity)["path"])
    rows = prompts.build_prompts("sharegpt", n=a.n, heldout=0, seed=0)["train"]
    texts = [tok.apply_chat_template(tokenize.with_reasoning(r["messages"], tok.chat_template), tokenize=False)
             for r in rows]
    batch = 256  # the stage's batch_size (tokenize.tokenize_rows)
    n_tokens = sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])

    def raw() -> float:
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch):
            tok(texts[i:i + batch], add_special_tokens=False)
        return time.perf_counter() - t0

    kept: list = []
    skipped: dict = {}

    def stage() -> float:
        nonlocal kept, skipped
        t0 = time.perf_counter()
        kept, skipped, _ = tokenize.tokenize_rows(tok, rows, max_length=a.max_length, batch_size=batch)
        return time.perf_counter() - t0

    raw(), stage()  # warm: the template compiled, the tokenizer's caches filled
    t_raw, t_stage, ratios = [], [], []
    for r in range(a.repeats):
        order = (raw, stage) if r % 2 == 0 else (stage, raw)
        t = {f.__name__: f() for f in order}
        t_raw.append(t["raw"])
        t_stage.append(t["stage"])
        ratios.append(t["raw"] / t["stage"])  # stage tok/s / raw tok/s over the same tokens
    stage_tokens = sum(r["num_tokens"] for r in kept)
    if stage_tokens != n_tokens:
        print(f"note: the stage kept {stage_tokens} of {n_tokens} tokens (skips: {dict(skipped)})")
    med = statistics.median(ratios)
    spread = (max(ratios) - min(ratios)) / med
    print(f"conversations {len(rows)} ({len(kept)} kept, skipped {dict(skipped)}), {n_tokens} tokens, "
          f"batches of {batch}, {a.repeats} pairs")
    print(f"raw batch encode : {n_tokens / statistics.median(t_raw):10.0f} tok/s (median)")
    print(f"tokenize stage   : {stage_tokens / statistics.median(t_stage):10.0f} tok/s (median)")
    print(f"pair ratios      : {' '.join(f'{x:.3f}' for x in ratios)}")
    if spread > a.max_spread:
        print(f"note: pair ratios range {min(ratios):.3f}-{max(ratios):.3f} ({spread:.0%} of the median): "
              "too wide to conclude; rerun on a quiet machine")
    else:
        print(f"note: median of {a.repeats} pairs, range {min(ratios):.3f}-{max(ratios):.3f} ({spread:.0%})")
    print(f"ratio stage/raw  : {med:10.3f}  (goal >= 0.8)")


if __name__ == "__main__":
    main()
