"""Tokenize conversations with the target's own chat template and an assistant-only loss mask.

No template is hard-coded. The mask comes from the template itself: for every assistant turn i
we render ``messages[:i]`` with the generation prompt and ``messages[:i+1]``; the characters
between the two renders are what the assistant produced (its content and end-of-turn marker).
A template that renders an earlier turn differently as history (Qwen3 drops its think block) is
followed in the full rendering instead (``history_span``): every turn is trained on as the
target reads it when the conversation goes on.
The full conversation is encoded once with character offsets, and a token is a loss token when
its characters fall inside such a span. Each masked span is then decoded and checked to contain
the assistant's text, so a template the diffing cannot follow is caught, not trained on.

The template is rendered with the keyword arguments the target is served with
(``generate.chat_template_kwargs``, e.g. Qwen3's ``enable_thinking: false`` or Kimi's ``thinking``):
what the server's generation prompt pre-fills (an empty ``<think></think>``) is then prompt, not a
loss token, and the sequences are the ones the drafter meets when served.

Reasoning (``reasoning_content`` in the rows) is rendered the way the target reads it
(eaglet.target.reasoning): in the message field its template renders (Qwen3, Kimi:
``reasoning_content``; gpt-oss: ``thinking``, on its analysis channel), found by rendering a probe;
only a template that reads none gets it wrapped in think markers before the content
(``tokenize.think_markers``, else the tokenizer's ``<think>``/``</think>``). The latest turn's
reasoning is a loss token; where the template drops an earlier turn's reasoning (Qwen3's and
gpt-oss's do), it is not in the sequence at all. ``metadata.json``'s ``reasoning`` says which way it went and counts
the turns rendered with it.

    python -m eaglet.data.tokenization --conversations results/smollm2/prompts/train.parquet \
        --target resources/targets/smollm2-135m-instruct/identity.json --out-dir results/smollm2/tokenize
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np

from eaglet.base import schema
from eaglet.base.conversations import conversation_problem, read_conversations
from eaglet.base.digests import DIGESTS_KEY, record_digests, verify_beside
from eaglet.base.files import write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.progress import Progress
from eaglet.target import reasoning

log = logging.getLogger("eaglet.data.tokenization")


class Renderer:
    """``apply_chat_template(..., tokenize=False)``, faster: the compiled Jinja template is called
    directly (the wrapper costs more than the rendering). The first renders are compared with
    ``apply_chat_template`` itself; any difference switches back to it for good."""

    CHECKS = 16

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.checks_left = self.CHECKS
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self.compiled = _compile_jinja_template(tokenizer.chat_template)
            self.kwargs = dict(tokenizer.special_tokens_map)
        except Exception:  # another transformers layout: use the public API
            self.compiled = None

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        ref = None
        if self.compiled is None or self.checks_left > 0:
            ref = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **self.template_kwargs)
            if self.compiled is None:
                return ref
        out = self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**self.kwargs, **self.template_kwargs})
        if ref is not None:
            self.checks_left -= 1
            if out != ref:
                self.compiled = None
                return ref
        return out


def render(tokenizer, messages: list[dict], renderer: Renderer | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation text and the character spans the assistant produced.

    A turn is found by the prefix renders (module docstring) where the template renders it the
    same as the latest turn and as history. Where it does not, it is rendered as the conversation
    going on (a generation prompt after it: gpt-oss ends only a finished conversation's last turn
    with ``<|return|>`` and its analysis, earlier ones with ``<|end|>`` and none), else located in
    the full rendering (Qwen3 gives only the latest answer a think block; Kimi gives history an
    empty one): :func:`history_span`."""
    r = renderer or Renderer(tokenizer)
    full = r(messages)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = r(messages[:i], add_generation_prompt=True)
        # The last turn's prefix is the whole conversation: no second render needed.
        upto = full if i == len(messages) - 1 else r(messages[: i + 1])
        if upto.startswith(before) and full.startswith(upto):
            span = (len(before), len(upto))
        else:
            prior = r(messages[:i])
            gen = before[len(prior):]
            going_on = r(messages[: i + 1], add_generation_prompt=True)
            going_on = going_on[:len(going_on) - len(gen)] if gen and going_on.endswith(gen) else ""
            if going_on.startswith(before) and full.startswith(going_on):
                span = (len(before), len(going_on))
            else:
                span = history_span(full, prior, before, upto, m["content"],
                                    [x["content"] for x in messages[i + 1:]])
        if spans and span[0] < spans[-1][1]:
            raise ValueError("template_not_prefix")
        spans.append(span)
    return full, spans


def history_span(full: str, prior: str, before: str, upto: str, content: str, later: list[str]) -> tuple[int, int]:
    """The span of an assistant turn the template renders differently in history than as the
    latest turn (``render``). ``prior``: the messages before the turn, rendered (must be a prefix
    of ``full``); ``before``: the same with the generation prompt; ``upto``: the turn rendered as
    the latest one; ``later``: the contents after it. The span starts where ``full`` leaves the
    generation prompt (after the role header both share) and ends after the turn's content and
    the end-of-turn text that follows it in ``upto`` (e.g. ``<|im_end|>\n``), which ``full`` must
    hold right there. Whatever the template writes between the header and the content in history
    (an empty think block) is in the span: the target reads it there. Raises ValueError
    ("template_not_prefix") when the turn cannot be located so."""
    text = content.strip()
    if not text or not full.startswith(prior) or not upto.startswith(prior):
        raise ValueError("template_not_prefix")
    start = len(prior) + len(os.path.commonprefix([before[len(prior):], full[len(prior):]]))
    q, p = upto.rfind(text), full.find(text, start)
    if q < len(prior) or p < 0:
        raise ValueError("template_not_prefix")
    tail = upto[q + len(text):]
    end = p + len(text) + len(tail)
    # The content must be this turn's: nothing of a later message may sit before it.
    nxt = next((full.find(c.strip(), start) for c in later if c and c.strip()), -1)
    if full[p + len(text):end] != tail or 0 <= nxt < p:
        raise ValueError("template_not_prefix")
    return start, end


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose characters lie inside an assistant span (tokens straddling a span
    boundary count as assistant tokens when they start inside it)."""
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(offsets), dtype=np.int8)
    for a, b in spans:
        mask[np.searchsorted(starts, a, "left"):np.searchsorted(starts, b - 1, "right")] = 1
    return mask


def backend(tokenizer):
    """The Rust tokenizer behind a fast tokenizer, when calling it directly gives what the Python
    wrapper would (no truncation or padding configured on it), else None. The wrapper converts
    every field of every encoding to Python lists, which costs ~10 % of the encode itself."""
    fast = getattr(tokenizer, "_tokenizer", None)
    if fast is None or not hasattr(fast, "encode_batch"):
        return None
    if getattr(fast, "truncation", None) is not None or getattr(fast, "padding", None) is not None:
        return None
    return fast


def _first_start_from(e, n: int, c: int, length: int) -> int | None:
    """Index of the first token of encoding ``e`` (``n`` tokens, of a ``length``-character text)
    that starts at character c or later (``bisect_left`` over the tokens' start characters),
    found from the token holding character c and its neighbours without building the offsets
    list; None when the encoding maps c (or a neighbour) to no token."""
    if c >= length:
        return n
    h = e.char_to_token(c)
    if h is None:
        return None
    try:
        while h > 0 and e.token_to_chars(h - 1)[0] >= c:
            h -= 1
        while h < n and e.token_to_chars(h)[0] < c:
            h += 1
    except TypeError:  # token_to_chars gave None
        return None
    return h


def encode_masked(tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ids as int32 arrays, loss masks as in ``mask_from_offsets``) of each text, special tokens
    not added. The Rust backend's batch encode when it gives the wrapper's ids (``backend``), the
    mask from the span boundaries' tokens; else the wrapper and the full offsets."""
    fast = backend(tokenizer)
    if fast is None:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        return ([np.asarray(x, dtype=np.int32) for x in enc["input_ids"]],
                [mask_from_offsets(o, sp) for o, sp in zip(enc["offset_mapping"], spans, strict=True)])
    ids_all, masks = [], []
    for e, text, sp in zip(fast.encode_batch(texts, add_special_tokens=False), texts, spans, strict=True):
        ids = np.asarray(e.ids, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.int8)
        for a, b in sp:
            lo, hi = _first_start_from(e, len(ids), a, len(text)), _first_start_from(e, len(ids), b, len(text))
            if lo is None or hi is None:
                mask = mask_from_offsets(e.offsets, sp)
                break
            mask[lo:hi] = 1
        ids_all.append(ids)
        masks.append(mask)
    return ids_all, masks


def decode_many(tokenizer, seqs: list[list[int]]) -> list[str]:
    """Decode many id lists at once: the Rust tokenizer's batch decode when there is one (the
    Python wrapper costs more per call than the decoding itself)."""
    fast = getattr(tokenizer, "_tokenizer", None)
    if fast is not None and hasattr(fast, "decode_batch"):
        return fast.decode_batch(seqs, skip_special_tokens=False)
    return [tokenizer.decode(s) for s in seqs]


def mask_matches(masked_text: str, messages: list[dict], shown: list[str] = ()) -> bool:
    """Every assistant text, and each reasoning the template rendered (``shown``), must appear
    inside the decoded masked tokens."""
    return (all(m["content"].strip() in masked_text for m in messages if m["role"] == "assistant")
            and all(r in masked_text for r in shown))


def tokenize_rows(tokenizer, rows: list[dict], max_length: int = schema.default("tokenize.max_length"),
                  overlong: str = schema.default("tokenize.overlong"),
                  batch_size: int = schema.default("tokenize.batch_size"), fmt: reasoning.Format | None = None,
                  renderer: Renderer | None = None,
                  template_kwargs: dict | None = None) -> tuple[list[dict], Counter, Counter]:
    """Return (tokenized rows, skip counts by reason, tokenized count by source). ``renderer``:
    one to reuse across calls (the benchmark's batches), else a new one rendering with
    ``template_kwargs`` (the chat template's keyword arguments as served); ``fmt``: the template's
    reasoning format, else detected with the default markers. A row records its turns with
    reasoning and those whose reasoning is in its sequence (``reasoning_turns``, ``reasoning_shown``)."""
    skipped: Counter = Counter()
    kept: list[dict] = []
    seen: set[str] = set()
    template = tokenizer.chat_template or ""
    if not template:
        raise ValueError("the target tokenizer has no chat template; set target.chat_template (a Jinja file or text)")
    pending: list[tuple[dict, list[dict], str, list, list[str], int]] = []
    renderer = renderer or Renderer(tokenizer, template_kwargs)
    fmt = fmt or reasoning.detect(renderer, tokenizer.get_vocab())

    def flush():
        if not pending:
            return
        ids_all, masks = encode_masked(tokenizer, [p[2] for p in pending], [p[3] for p in pending])
        masked_texts = decode_many(tokenizer, [i[m.astype(bool)].tolist() for i, m in zip(ids_all, masks)])
        for (row, msgs, _, _, shown, n_reasoning), ids, mask, masked in zip(pending, ids_all, masks, masked_texts,
                                                                            strict=True):
            if not mask_matches(masked, msgs, shown):
                skipped["mask_mismatch"] += 1
                continue
            cut = len(ids) > max_length
            if cut:
                if overlong == "skip":
                    skipped["overlong"] += 1
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
            if not mask.any():
                # A cut that removed the whole answer is a truncation, not an empty answer.
                skipped["truncated_no_answer" if cut else "no_assistant_tokens"] += 1
                continue
            kept.append({"id": row["id"], "source": row.get("source", ""), "input_ids": ids,
                         "loss_mask": mask, "num_tokens": len(ids), "num_assistant_tokens": int(mask.sum()),
                         "truncated": cut, "reasoning_turns": n_reasoning, "reasoning_shown": len(shown)})
        pending.clear()

    progress = Progress(log, "tokenize", len(rows), "conversations")
    for row in rows:
        progress.step()
        msgs = row.get("messages")
        reason = conversation_problem(msgs) if isinstance(msgs, list) else "empty_conversation"
        if reason is None and row["id"] in seen:
            reason = "duplicate_id"
        if reason:
            skipped[reason] += 1
            continue
        seen.add(row["id"])
        if next(m["role"] for m in msgs if m["role"] != "system") != "user":
            skipped["assistant_first"] += 1
            continue
        reasonings = [m["reasoning_content"].strip() for m in msgs if m["role"] == "assistant"
                      and m.get("reasoning_content")]
        msgs = [fmt.message(m) for m in msgs]
        if any(fmt.opener in m["content"] for m in row["messages"] if m["role"] == "assistant"
               and "reasoning_content" not in m):
            # Raw thinking markers inside content mean a reasoning parser was not applied.
            skipped["raw_thinking_markers"] += 1
            continue
        try:
            text, spans = render(tokenizer, msgs, renderer)
        except ValueError:
            skipped["template_not_prefix"] += 1
            continue
        except Exception:  # a template that raises on this conversation (e.g. role order rules)
            skipped["template_error"] += 1
            continue
        # The template shows the latest turn's reasoning (a loss token, checked) and may drop the others'.
        shown = [r for r in reasonings if r in text]
        pending.append((row, msgs, text, spans, shown, len(reasonings)))
        if len(pending) >= batch_size:
            flush()
    flush()
    by_source = Counter(r["source"] for r in kept)
    return kept, skipped, by_source


def write_tokens(path: str | Path, kept: list[dict]) -> None:
    import pyarrow as pa

    table = pa.table({
        "id": pa.array([r["id"] for r in kept], pa.string()),
        "source": pa.array([r["source"] for r in kept], pa.string()),
        "input_ids": pa.array([r["input_ids"] for r in kept], pa.list_(pa.int32())),
        "loss_mask": pa.array([r["loss_mask"] for r in kept], pa.list_(pa.int8())),
        "num_tokens": pa.array([r["num_tokens"] for r in kept], pa.int32()),
        "num_assistant_tokens": pa.array([r["num_assistant_tokens"] for r in kept], pa.int32()),
    })
    write_parquet(path, table)


def run(conversations: str | Path, target: str | Path, out_dir: str | Path,
        max_length: int = schema.default("tokenize.max_length"), overlong: str = schema.default("tokenize.overlong"),
        batch_size: int = schema.default("tokenize.batch_size"), chat_template: str | None = None,
        chat_template_kwargs: dict | None = None, think_markers: list[str] | None = None) -> dict:
    """``chat_template``: ``target.chat_template`` (text or file), else the checkpoint's own;
    ``chat_template_kwargs``: the template's keyword arguments as the target is served with them;
    ``think_markers``: ``tokenize.think_markers``, for a template that reads no reasoning field."""
    from eaglet.target.load import load_identity, load_tokenizer

    tok = load_tokenizer(load_identity(target)["path"], chat_template, need_template=True)
    rows = read_conversations(conversations)
    renderer = Renderer(tok, chat_template_kwargs)
    fmt = reasoning.detect(renderer, tok.get_vocab(), think_markers)
    kept, skipped, by_source = tokenize_rows(tok, rows, max_length, overlong, batch_size, fmt, renderer)
    out_dir = Path(out_dir)
    write_tokens(out_dir / "tokens.parquet", kept)
    assistant_ids = np.concatenate([r["input_ids"][r["loss_mask"].astype(bool)] for r in kept]) \
        if kept else np.zeros(0, np.int32)
    meta = {
        "samples_processed": len(kept),
        "samples_skipped": sum(skipped.values()),
        "skipped_by_reason": dict(skipped),
        "samples_in": len(rows),
        "total_tokens": int(sum(r["num_tokens"] for r in kept)),
        "total_assistant_tokens": int(assistant_ids.size),
        "vocab_size": len(tok),
        "unique_assistant_tokens": int(np.unique(assistant_ids).size),
        "samples_by_source": dict(by_source),
        "max_length": max_length,
        "overlong": overlong,
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        # how reasoning was rendered; turns: assistant turns with reasoning, in_sequence: those whose
        # reasoning the template kept (the latest turn's; earlier ones' are dropped by Qwen3, gpt-oss)
        "reasoning": {**fmt.record(), "turns": int(sum(r["reasoning_turns"] for r in kept)),
                      "in_sequence": int(sum(r["reasoning_shown"] for r in kept))},
        # samples cut at max_length: kept with part of their answer, and dropped with none left
        "truncated": int(sum(r["truncated"] for r in kept)) + skipped["truncated_no_answer"],
        "truncated_kept": int(sum(r["truncated"] for r in kept)),
        # checked by the stages that read tokens.parquet (digests.verify_recorded)
        DIGESTS_KEY: record_digests(out_dir, ["tokens.parquet"]),
    }
    write_json(out_dir / "metadata.json", meta)
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", required=True)
    p.add_argument("--target", required=True, help="the target's identity.json (its tokenizer is used)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--max-length", type=int, default=schema.default("tokenize.max_length"))
    p.add_argument("--overlong", choices=schema.allowed("tokenize.overlong"),
                   default=schema.default("tokenize.overlong"))
    p.add_argument("--batch-size", type=int, default=schema.default("tokenize.batch_size"))
    p.add_argument("--chat-template", default="", help="target.chat_template: Jinja text or a file ('' = the target's)")
    p.add_argument("--chat-template-kwargs", default="{}",
                   help="JSON object: the chat template's keyword arguments as served (generate.chat_template_kwargs)")
    p.add_argument("--think-markers", default="null",
                   help="JSON [open, close] (tokenize.think_markers): wraps reasoning for a template that reads none")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    kwargs = json.loads(a.chat_template_kwargs)
    if not isinstance(kwargs, dict):
        p.error(f"--chat-template-kwargs must be a JSON object, got {a.chat_template_kwargs!r}")
    # generate's record, or the prompts stage's (generation off), when a stage made them
    verify_beside(a.conversations, "generate_summary.json", "summary.json")
    m = run(a.conversations, a.target, a.out_dir, a.max_length, a.overlong, a.batch_size, a.chat_template or None,
            kwargs, json.loads(a.think_markers))
    log.info("tokenize: %d samples, %d skipped %s, %d tokens, %d assistant tokens, %d unique; reasoning as %s "
             "(%d turns, %d in the sequences)", m["samples_processed"], m["samples_skipped"], m["skipped_by_reason"],
             m["total_tokens"], m["total_assistant_tokens"], m["unique_assistant_tokens"],
             m["reasoning"]["rendered_as"], m["reasoning"]["turns"], m["reasoning"]["in_sequence"])


if __name__ == "__main__":
    main()
