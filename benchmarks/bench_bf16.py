"""bf16 vs fp32 target forward on the CPU (issue 15): speed, and how often the two agree on the
target's labels (its argmax), on the default data.

    python benchmarks/bench_bf16.py [--identity resources/targets/smollm2-135m-instruct/identity.json]
        [--n 24] [--length 512] [--threads 2] [--repeats 5]

Speed: one sequence of ``--length`` tokens (the first sample of the data, cut or repeated to that
length), the full causal-LM forward, fp32 and bf16 models loaded once, timed paired and
alternating (fp32, bf16, fp32, ...) ``--repeats`` times after one warm-up each; prints the median
tok/s of each with min-max, and the median of the per-pair ratios. Agreement: ``--n`` samples of
the default data (ShareGPT V3 prompts, max_turns 2, tokenized with the target's template, cut at
``--length``; the source answers, not regenerated ones: no generation needed), argmax of the
next-token logits at every assistant (loss) position, bf16 vs fp32, and each against the data's
own next token. Also prints the CPU flags that decide ``extract.target_dtype: auto``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eaglet.base import capability  # noqa: E402
from eaglet.data.prompts import build_prompts  # noqa: E402
from eaglet.data.tokenization import tokenize_rows  # noqa: E402
from eaglet.target.load import load_identity, load_model, load_tokenizer  # noqa: E402


def default_data(tok, n: int, length: int) -> list[tuple[list[int], list[int]]]:
    rows = build_prompts("sharegpt", n=n, heldout=0 + 1, seed=0, max_turns=2)["train"]
    kept, _, _ = tokenize_rows(tok, rows, max_length=length)
    return [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in kept[:n]]


@torch.inference_mode()
def argmax_at_assistant(model, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """(argmax predictions, data's next tokens) at positions whose next token is a loss token."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    pos = [t for t in range(len(ids) - 1) if mask[t + 1]]
    pred = logits[pos].float().argmax(-1).tolist()
    return pred, [ids[t + 1] for t in pos]


@torch.inference_mode()
def timed(model, x) -> float:
    t0 = time.perf_counter()
    model(input_ids=x, use_cache=False)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--identity", default="resources/targets/smollm2-135m-instruct/identity.json")
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--speed-only", action="store_true", help="skip the agreement (one sample of data)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype, why = capability.cpu_target_dtype()
    print(f"CPU: {capability.cpu_model()}; auto would pick {dtype} ({why})")
    ident = load_identity(a.identity)
    tok = load_tokenizer(ident["path"])
    m32 = load_model(ident["path"], dtype="float32", device="cpu")
    m16 = load_model(ident["path"], dtype="bfloat16", device="cpu")
    data = default_data(tok, 1 if a.speed_only else a.n, a.length)

    # --- label agreement
    same = total = hit32 = hit16 = 0
    per_sample = []
    for ids, mask in [] if a.speed_only else data:
        p32, labels = argmax_at_assistant(m32, ids, mask)
        p16, _ = argmax_at_assistant(m16, ids, mask)
        s = sum(x == y for x, y in zip(p32, p16, strict=True))
        same, total = same + s, total + len(p32)
        hit32 += sum(x == y for x, y in zip(p32, labels, strict=True))
        hit16 += sum(x == y for x, y in zip(p16, labels, strict=True))
        per_sample.append(s / max(len(p32), 1))
    if total:
        print(f"label agreement bf16 vs fp32 argmax: {same / total:.4f} over {total} assistant positions of "
              f"{len(data)} samples (per sample: median {statistics.median(per_sample):.4f}, "
              f"min {min(per_sample):.4f})")
        print(f"argmax == data's next token: fp32 {hit32 / total:.4f}, bf16 {hit16 / total:.4f} "
              "(source answers, not the target's own)")

    # --- speed, paired
    ids = (data[0][0] * (a.length // len(data[0][0]) + 1))[:a.length]
    x = torch.tensor([ids])
    timed(m32, x), timed(m16, x)  # warm-up
    t32, t16 = [], []
    for _ in range(a.repeats):
        t32.append(timed(m32, x))
        t16.append(timed(m16, x))
    r32 = [a.length / t for t in t32]
    r16 = [a.length / t for t in t16]
    ratio = [b / f for f, b in zip(r32, r16, strict=True)]
    print(f"forward L={a.length}, {a.threads} threads, {a.repeats} pairs: fp32 median {statistics.median(r32):.0f} "
          f"tok/s [{min(r32):.0f}-{max(r32):.0f}], bf16 median {statistics.median(r16):.0f} tok/s "
          f"[{min(r16):.0f}-{max(r16):.0f}]; bf16/fp32 median {statistics.median(ratio):.2f} "
          f"[{min(ratio):.2f}-{max(ratio):.2f}]")


if __name__ == "__main__":
    main()
