"""Draft vocabulary: the top ``draft_vocab_size`` assistant tokens by frequency, plus pinned
tokens that are always in it, mapped to ``d2t`` / ``t2d`` exactly as docs/eagle3.md §4.

Pinned tokens (no public trainer has them; hand-built Kimi drafters do): the tokenizer's special
tokens, the chat template's own scaffolding (role and turn markers, found by rendering a
conversation with empty messages), the frame the template writes around reasoning (Qwen3's
``<think>``/``</think>``, gpt-oss's ``<|channel|>analysis<|message|>`` …
``<|end|><|start|>assistant<|channel|>final<|message|>``: eaglet.target.reasoning, rendered as
served), and configured extras. A pinned token that would have missed the cut on frequency alone
is reported with its rank, because a drafter that cannot propose ``<|im_end|>`` or ``</think>``
loses a token at every turn boundary.

    d2t[i] = used[i] - i        (int64 offset: target_id = i + d2t[i])
    t2d[j] = j in used          (bool [V]);  check: nonzero(t2d) == arange(V_d) + d2t

    python -m eaglet.data.vocab --counts results/smollm2/token_freq/freq.safetensors \
        --target resources/targets/smollm2-135m-instruct/identity.json --draft-vocab-size 8192 \
        --out-dir results/smollm2/vocab_map
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests, verify_recorded
from eaglet.base.files import write_json
from eaglet.base.logs import setup_logging
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.target import reasoning

log = logging.getLogger("eaglet.data.vocab")


def template_token_ids(tokenizer) -> set[int]:
    """Token ids the chat template itself emits: render empty messages of every role."""
    ids: set[int] = set()
    if not tokenizer.chat_template:
        return ids
    convs = [[{"role": "system", "content": ""}, {"role": "user", "content": ""},
              {"role": "assistant", "content": ""}],
             [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]]
    # An explicit empty system message first: templates inject a default system prompt
    # otherwise, and its words are content, not scaffolding.
    for conv in convs:
        try:
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
        except Exception:  # templates that insist on other role orders
            continue
        return set(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def reasoning_format(tokenizer, template_kwargs: dict | None = None,
                     think_markers: list[str] | None = None) -> reasoning.Format:
    """The template's reasoning format, rendered with the keyword arguments as served."""
    def render(messages, add_generation_prompt=False):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))

    return reasoning.detect(render, tokenizer.get_vocab(), think_markers)


def pinned_ids(tokenizer, pin_special: bool, extra: list[str], fmt: reasoning.Format | None = None) -> dict[int, str]:
    """{token id: why pinned}. Strings that are not one token pin each of their tokens. ``fmt``:
    the reasoning format (else detected with no template kwargs); its frame is pinned when it is
    the template's own or its markers are tokens or configured (default markers spelled in
    plain text pieces are not the target's)."""
    pins: dict[int, str] = {}
    if pin_special:
        for i in tokenizer.all_special_ids:
            pins.setdefault(int(i), "special")
        for i in sorted(template_token_ids(tokenizer)):
            pins.setdefault(int(i), "template")
        fmt = fmt or reasoning_format(tokenizer)
        if fmt.field or fmt.markers_from != "default":
            for piece in fmt.frame:
                for i in tokenizer(piece, add_special_tokens=False)["input_ids"]:
                    pins.setdefault(int(i), "reasoning")
    for s in extra:
        for i in tokenizer(s, add_special_tokens=False)["input_ids"]:
            pins.setdefault(int(i), f"config:{s}")
    return pins


def build_mapping(counts: np.ndarray, draft_vocab_size: int, pins: dict[int, str]) -> np.ndarray:
    """Sorted target ids of the draft vocabulary (``used``)."""
    V = counts.shape[0]
    if draft_vocab_size > V:
        raise ValueError(f"vocab.draft_vocab_size={draft_vocab_size} exceeds the target vocab ({V})")
    pinned = sorted(i for i in pins if 0 <= i < V)
    if len(pinned) > draft_vocab_size:
        raise ValueError(f"vocab.draft_vocab_size={draft_vocab_size} is smaller than the "
                         f"{len(pinned)} pinned tokens")
    chosen = np.zeros(V, dtype=bool)
    chosen[pinned] = True
    # Stable sort: among equal counts, lower ids first — deterministic across runs.
    order = np.argsort(-counts, kind="stable")
    room = draft_vocab_size - len(pinned)
    freq_pick = [i for i in order[: room + len(pinned)] if counts[i] > 0 and not chosen[i]][:room]
    chosen[freq_pick] = True
    # Fewer distinct ids than V_d: pad with unused low ids (docs/eagle3.md §4).
    missing = draft_vocab_size - int(chosen.sum())
    if missing:
        chosen[np.flatnonzero(~chosen)[:missing]] = True
    used = np.flatnonzero(chosen)
    assert used.size == draft_vocab_size
    return used


def mapping_tensors(used: np.ndarray, V: int) -> tuple[np.ndarray, np.ndarray]:
    d2t = (used - np.arange(used.size)).astype(np.int64)
    t2d = np.zeros(V, dtype=bool)
    t2d[used] = True
    if not np.array_equal(np.flatnonzero(t2d), np.arange(used.size) + d2t):
        raise AssertionError("d2t/t2d disagree: nonzero(t2d) != arange(V_d) + d2t")
    return d2t, t2d


def coverage_curve(counts: np.ndarray, points: int) -> list[dict]:
    """Coverage of the top-n frequency vocab for n on a log grid (no pinning), for the report."""
    total = max(int(counts.sum()), 1)
    cum = np.cumsum(np.sort(counts)[::-1])
    sizes = np.unique(np.geomspace(16, counts.size, points).astype(int))
    return [{"draft_vocab_size": int(n), "coverage": float(cum[n - 1] / total)} for n in sizes]


def run(counts_path: str | Path, target: str | Path, out_dir: str | Path, draft_vocab_size: int,
        pin_special: bool = schema.default("vocab.pin_special_tokens"), pinned: list[str] | None = None,
        curve_points: int = schema.default("vocab.curve_points"),
        chat_template: str | None = None, chat_template_kwargs: dict | None = None,
        think_markers: list[str] | None = None) -> dict:
    """``chat_template``: ``target.chat_template``, whose marker tokens are pinned like the checkpoint's;
    ``chat_template_kwargs`` and ``think_markers``: as tokenize renders reasoning (its frame is pinned)."""
    from eaglet.target.load import load_identity, load_tokenizer

    tok = load_tokenizer(load_identity(target)["path"], chat_template)
    tensors = load_tensors(counts_path)
    if "counts" not in tensors:
        raise ArtifactError(f"{counts_path}: no 'counts' tensor")
    counts = tensors["counts"].numpy().astype(np.int64)
    fmt = reasoning_format(tok, chat_template_kwargs, think_markers)
    pins = pinned_ids(tok, pin_special, pinned or [], fmt)
    used = build_mapping(counts, draft_vocab_size, pins)
    d2t, t2d = mapping_tensors(used, counts.size)

    total = max(int(counts.sum()), 1)
    freq_rank = np.empty(counts.size, dtype=np.int64)
    freq_rank[np.argsort(-counts, kind="stable")] = np.arange(1, counts.size + 1)
    by_source = {k.split("/", 1)[1]: float(v.numpy()[used].sum() / max(int(v.sum()), 1))
                 for k, v in tensors.items() if k.startswith("counts/")}
    summary = {
        "vocab_size": int(counts.size),
        "draft_vocab_size": int(draft_vocab_size),
        "assistant_tokens": int(counts.sum()),
        "distinct_assistant_tokens": int((counts > 0).sum()),
        "coverage": float(counts[used].sum() / total),
        "coverage_by_source": by_source,
        "coverage_without_pins": float(np.sort(counts)[::-1][:draft_vocab_size].sum() / total),
        # Ids in the draft vocab only because there were fewer distinct ids than V_d.
        "padded_ids": int(sum(1 for i in used if counts[i] == 0 and int(i) not in pins)),
        "pinned": [{"id": i, "token": tok.convert_ids_to_tokens(i), "why": why,
                    "count": int(counts[i]), "frequency_rank": int(freq_rank[i]),
                    "would_be_in_without_pin": bool(freq_rank[i] <= draft_vocab_size and counts[i] > 0)}
                   for i, why in sorted(pins.items())],
        "coverage_curve": coverage_curve(counts, curve_points),
        "reasoning": fmt.record(),  # the frame pinned (why "reasoning"), as tokenize renders it
    }
    out_dir = Path(out_dir)
    save_tensors(out_dir / "vocab.safetensors", {"d2t": d2t, "t2d": t2d},
                 metadata={"eaglet": json.dumps({"draft_vocab_size": draft_vocab_size,
                                                 "vocab_size": int(counts.size)})})
    summary[DIGESTS_KEY] = record_digests(out_dir, ["vocab.safetensors"])  # checked by train
    write_json(out_dir / "vocab.json", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", required=True)
    p.add_argument("--target", required=True, help="the target's identity.json (its tokenizer is used)")
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--pin-special", type=lambda s: s.lower() in ("1", "true", "yes"),
                   default=schema.default("vocab.pin_special_tokens"))
    p.add_argument("--pinned", default="[]", help="JSON list of extra strings to pin")
    p.add_argument("--curve-points", type=int, default=schema.default("vocab.curve_points"))
    p.add_argument("--chat-template", default="", help="target.chat_template: Jinja text or a file ('' = the target's)")
    p.add_argument("--chat-template-kwargs", default="{}",
                   help="JSON object: the chat template's keyword arguments as served (generate.chat_template_kwargs)")
    p.add_argument("--think-markers", default="null", help="JSON [open, close] (tokenize.think_markers)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    verify_recorded(a.counts, Path(a.counts).with_name("summary.json"))  # token_freq's record
    s = run(a.counts, a.target, a.out_dir, a.draft_vocab_size, a.pin_special, json.loads(a.pinned),
            a.curve_points, a.chat_template or None, json.loads(a.chat_template_kwargs), json.loads(a.think_markers))
    missed = [p["token"] for p in s["pinned"] if not p["would_be_in_without_pin"]]
    msg = (f"vocab_map: draft vocab {s['draft_vocab_size']} of {s['vocab_size']}: coverage "
           f"{100 * s['coverage']:.2f}% of {s['assistant_tokens']} assistant tokens; "
           f"{len(s['pinned'])} pinned ({len(missed)} only by pinning: {missed[:8]})")
    log.info(msg)
    print(msg)


if __name__ == "__main__":
    main()
