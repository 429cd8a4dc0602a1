"""Token frequencies over loss-masked (assistant) tokens only: the draft vocabulary is chosen
from what the drafter will have to predict, not from prompts or template scaffolding.

Writes ``freq.safetensors`` (``counts`` [V] int64 and ``counts/<source>`` per source), a
human-readable ``top.tsv`` (rank, id, token, count, share, cumulative share), and ``summary.json``:
the totals and the sha256 of both files, which vocab_map checks before trusting the counts.

    python -m eaglet.data.freq --tokens results/smollm2/tokenize/tokens.parquet \
        --target resources/targets/smollm2-135m-instruct/identity.json --out-dir results/smollm2/token_freq
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests, verify_recorded
from eaglet.base.files import read_parquet, write_json, write_text
from eaglet.base.logs import setup_logging
from eaglet.base.tensors import save_tensors

log = logging.getLogger("eaglet.data.freq")


def count_tokens(table, vocab_size: int, where: str | Path = "tokens") -> dict[str, np.ndarray]:
    """{"counts": [V] int64, "counts/<source>": [V] int64 ...} over loss-masked tokens.
    ``where`` (the tokens file) names the artifact in errors."""
    ids = table.column("input_ids").combine_chunks()
    mask = table.column("loss_mask").combine_chunks()
    flat_ids = ids.values.to_numpy(zero_copy_only=False)
    flat_mask = mask.values.to_numpy(zero_copy_only=False).astype(bool)
    if flat_ids.size != flat_mask.size:
        raise ArtifactError(f"{where}: input_ids and loss_mask lengths differ")
    if flat_ids.size and (flat_ids.min() < 0 or flat_ids.max() >= vocab_size):
        raise ArtifactError(f"{where}: token id outside [0, {vocab_size})")
    out = {"counts": np.bincount(flat_ids[flat_mask], minlength=vocab_size).astype(np.int64)}
    if "source" in table.column_names:
        lengths = np.diff(ids.offsets.to_numpy())
        sources = np.repeat(np.asarray(table.column("source").to_pylist(), dtype=object), lengths)
        for s in sorted(set(table.column("source").to_pylist())):
            sel = flat_mask & (sources == s)
            out[f"counts/{s}"] = np.bincount(flat_ids[sel], minlength=vocab_size).astype(np.int64)
    return out


def top_table(counts: np.ndarray, tokenizer, n: int = 200) -> str:
    order = np.argsort(-counts, kind="stable")[:n]
    total = max(int(counts.sum()), 1)
    lines = ["rank\tid\ttoken\tcount\tshare\tcumulative"]
    cum = 0
    for rank, i in enumerate(order, 1):
        c = int(counts[i])
        if c == 0:
            break
        cum += c
        tok = tokenizer.convert_ids_to_tokens(int(i)) if tokenizer is not None else ""
        lines.append(f"{rank}\t{i}\t{tok!r}\t{c}\t{c / total:.5f}\t{cum / total:.5f}")
    return "\n".join(lines) + "\n"


def run(tokens: str | Path, target: str | Path, out_dir: str | Path, top_n: int = 200) -> dict:
    from eaglet.target.load import load_identity, load_tokenizer

    ident = load_identity(target)
    tok = load_tokenizer(ident["path"])
    # Counts over the model's vocabulary (its logits), which checkpoints often pad past the
    # tokenizer's length (Qwen, Gemma, DeepSeek: a multiple of 64 or 128): d2t/t2d index logits.
    V = int(ident["vocab_size"])
    if len(tok) > V:
        raise ArtifactError(f"{target}: the tokenizer has {len(tok)} tokens, more than the model's "
                            f"vocab_size {V}")
    table = read_parquet(tokens, columns=None)
    missing = {"input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise ArtifactError(f"{tokens}: not a tokens file (missing columns {sorted(missing)})")
    counts = count_tokens(table, V, tokens)
    out_dir = Path(out_dir)
    save_tensors(out_dir / "freq.safetensors", counts)
    write_text(out_dir / "top.tsv", top_table(counts["counts"], tok, top_n))
    c = counts["counts"]
    summary = {"tokens": int(c.sum()), "distinct": int((c > 0).sum()), "vocab_size": len(c),
               "tokens_by_source": {k.split("/", 1)[1]: int(v.sum()) for k, v in counts.items() if "/" in k},
               # checked by vocab_map (digests.verify_recorded) before it trusts the counts
               DIGESTS_KEY: record_digests(out_dir, ["freq.safetensors", "top.tsv"])}
    write_json(out_dir / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", required=True)
    p.add_argument("--target", required=True, help="the target's identity.json (its tokenizer is used)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--top", type=int, default=200)
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    verify_recorded(a.tokens, Path(a.tokens).with_name("metadata.json"))  # tokenize's record
    s = run(a.tokens, a.target, a.out_dir, a.top)
    log.info("token_freq: %d assistant tokens, %d distinct ids of %d", s["tokens"], s["distinct"],
             s["vocab_size"])


if __name__ == "__main__":
    main()
