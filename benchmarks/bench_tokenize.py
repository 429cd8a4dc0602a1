"""Tokenisation throughput vs the tokenizer's raw batch encode of the same texts, one run.

    python benchmarks/bench_tokenize.py [--identity resources/targets/smollm2-135m-instruct/identity.json]
        [--n 1000] [--repeats 8]

The stage (eaglet.data.tokenization.tokenize_rows) renders every conversation with the chat template,
renders the prefixes that locate the assistant spans, encodes, builds the loss mask from the span
edges and verifies it by decoding the masked tokens. The baseline is the tokenizer's own batch
encode of the already-rendered texts (``tokenizer(texts)``: no template, no mask): the floor a
user pays to tokenise, in the stage's own batches. The stage calls the Rust tokenizer behind it
directly; the bare Rust encode is timed too and printed as a stricter reference.

Timing: the machine's speed drifts by tens of percent over seconds (measured on a quiet 2-core
VM: whole-run pairs spread 15-46 %). So each batch is timed raw and through the stage back to
back, in alternating order, and a repeat's ratio is the sum over its batches: drift slower than a
batch (~1 s) cancels. ``--repeats`` repeats; prints the median tokens/s of each, the median ratio
with a distribution-free interval (benchmarks/paired.py), and says "cannot conclude" when that
interval holds the goal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.paired import spread_note  # noqa: E402
from eaglet.base.logs import quiet_third_party  # noqa: E402
from eaglet.data import prompts, tokenization  # noqa: E402
from eaglet.target import reasoning  # noqa: E402
from eaglet.target.load import load_identity, load_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=8, help="repeats over all batches")
    a = p.parse_args()
    quiet_third_party()
    tok = load_tokenizer(load_identity(a.identity)["path"])
    rows = prompts.build_prompts("sharegpt", n=a.n, heldout=0, seed=0)["train"]
    fmt = reasoning.detect(tokenization.Renderer(tok), tok.get_vocab())
    texts = [tok.apply_chat_template([fmt.message(m) for m in r["messages"]], tokenize=False) for r in rows]
    batch = 256  # the stage's batch_size (tokenization.tokenize_rows)
    chunks = [(rows[i:i + batch], texts[i:i + batch]) for i in range(0, len(rows), batch)]
    n_tokens = sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
    fast = tokenization.backend(tok)
    renderer = tokenization.Renderer(tok)
    kept: list = []
    skipped: Counter = Counter()

    def raw(rs, ts) -> None:
        tok(ts, add_special_tokens=False)

    def rust(rs, ts) -> None:
        fast.encode_batch(ts, add_special_tokens=False)

    def stage(rs, ts) -> None:
        k, sk, _ = tokenization.tokenize_rows(tok, rs, max_length=a.max_length, batch_size=batch, renderer=renderer)
        kept.extend(k)
        skipped.update(sk)

    kinds = [raw, stage] + ([rust] if fast is not None else [])
    for f in kinds:  # warm: the template compiled and checked, the tokenizer's caches filled
        f(*chunks[0])
    times = {f.__name__: [] for f in kinds}
    for r in range(a.repeats):
        kept.clear()
        skipped.clear()
        total = dict.fromkeys(times, 0.0)
        for j, chunk in enumerate(chunks):
            for f in (kinds if (r + j) % 2 == 0 else kinds[::-1]):
                t0 = time.perf_counter()
                f(*chunk)
                total[f.__name__] += time.perf_counter() - t0
        for k, v in total.items():
            times[k].append(v)
    ratios = [x / y for x, y in zip(times["raw"], times["stage"])]
    stage_tokens = sum(r["num_tokens"] for r in kept)
    if stage_tokens != n_tokens:
        print(f"note: the stage kept {stage_tokens} of {n_tokens} tokens (skips: {dict(skipped)})")
    med = statistics.median(ratios)
    print(f"conversations {len(rows)} ({len(kept)} kept, skipped {dict(skipped)}), {n_tokens} tokens, "
          f"batches of {batch}, {a.repeats} repeats, each batch timed raw and staged back to back")
    print(f"raw batch encode : {n_tokens / statistics.median(times['raw']):10.0f} tok/s (median)")
    print(f"tokenize stage   : {stage_tokens / statistics.median(times['stage']):10.0f} tok/s (median)")
    if fast is not None:
        rr = [x / y for x, y in zip(times["rust"], times["stage"])]
        print(f"bare Rust encode : {n_tokens / statistics.median(times['rust']):10.0f} tok/s (median); "
              f"stage/Rust {statistics.median(rr):.3f} (range {min(rr):.3f}-{max(rr):.3f}; no wrapper at all)")
    print(f"repeat ratios    : {' '.join(f'{x:.3f}' for x in ratios)}")
    print(spread_note(ratios, 0.8, "repeat ratios"))
    print(f"ratio stage/raw  : {med:10.3f}  (goal >= 0.8)")


if __name__ == "__main__":
    main()
