"""tokenize: the template's own rendering, an assistant-only mask that decodes to assistant text,
reasoning in the target's own format (the field its template reads, else think markers),
over-long handling, malformed rows counted."""

import copy

import numpy as np
import pytest

from eaglet.base.conversations import read_conversations, write_conversations
from eaglet.base.files import read_json, read_parquet
from eaglet.data import tokenization
from eaglet.target import reasoning
from eaglet.target.load import load_identity, load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_target):
    return load_tokenizer(tiny_target["path"])


def row(i, msgs):
    return {"id": f"r{i}", "source": "test", "messages": msgs}


U = lambda c: {"role": "user", "content": c}
A = lambda c, **kw: {"role": "assistant", "content": c, **kw}


def test_mask_covers_exactly_the_assistant_turns(tok):
    msgs = [U("What is the capital of France?"), A("Paris is the capital."), U("And of Italy?"),
            A("Rome.")]
    kept, skipped, _ = tokenization.tokenize_rows(tok, [row(0, msgs)])
    assert not skipped
    r = kept[0]
    ids, mask = r["input_ids"], r["loss_mask"].astype(bool)
    # Same ids as the template's own tokenisation of the whole conversation.
    assert ids.tolist() == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    # Contiguous masked spans decode to each assistant reply plus its end-of-turn marker.
    edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(int), 0]))
    spans = [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert [s.split("<|im_end|>")[0] for s in spans] == ["Paris is the capital.", "Rome."]
    assert all("<|im_end|>" in s for s in spans)
    # Nothing of the prompts or the role headers is a loss token.
    assert "France" not in tok.decode(ids[mask].tolist())
    assert r["num_assistant_tokens"] == mask.sum()


def test_reasoning_is_wrapped_in_thinking_tokens_where_the_template_reads_none(tok):
    msgs = [U("2+2?"), A("4", reasoning_content="two plus two is four")]
    kept, _, _ = tokenization.tokenize_rows(tok, [row(0, msgs)])
    masked = tok.decode(kept[0]["input_ids"][kept[0]["loss_mask"].astype(bool)].tolist())
    assert masked.startswith("<think>\ntwo plus two is four\n</think>\n\n4")
    assert kept[0]["reasoning_turns"] == kept[0]["reasoning_shown"] == 1
    # tokenization.think_markers: the configured pair instead, recorded as such
    fmt = reasoning.detect(tokenization.Renderer(tok), tok.get_vocab(), ["<reasoning>", "</reasoning>"])
    assert fmt.record() | {"frame": None} == {"rendered_as": "markers", "field": None, "frame": None,
                                               "markers": ["<reasoning>", "</reasoning>"], "markers_from": "config"}
    kept, _, _ = tokenization.tokenize_rows(tok, [row(0, msgs)], fmt=fmt)
    masked = tok.decode(kept[0]["input_ids"][kept[0]["loss_mask"].astype(bool)].tolist())
    assert masked.startswith("<reasoning>\ntwo plus two is four\n</reasoning>\n\n4") and "think" not in masked


# The field each family's template reads reasoning from, and its latest turn as the target writes
# it after the generation prompt, with reasoning and without (written out here, not derived: the
# format under test).
FIELD = {"qwen3": "reasoning_content", "gpt_oss": "thinking"}
WRITTEN = {"qwen3": ("<think>\n{r}\n</think>\n\n{c}<|im_end|>\n", "<think>\n\n</think>\n\n{c}<|im_end|>\n"),
           "gpt_oss": ("<|channel|>analysis<|message|>{r}<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>{c}<|return|>",
                       "<|channel|>final<|message|>{c}<|return|>")}


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_server_reasoning_is_rendered_in_the_targets_own_format(family, tiny_family, canned, tmp_path):
    """Reasoning from a server's reasoning parser (the canned server's ``reasoning_content`` and
    ``reasoning`` fields) is rendered by the target's own template from the field it reads: the
    sequence is exactly the template's rendering, the reasoning and its frame are loss tokens, and
    no ``<think>`` text appears where the target writes none (gpt-oss)."""
    from eaglet.generate.generate import generate

    ident = tiny_family(family)
    qs = ["REASON 2+2?", "THINK name a colour", "plain question"]
    write_conversations(tmp_path / "in.parquet", [row(i, [U(q)]) for i, q in enumerate(qs)])
    generate(tmp_path / "in.parquet", ident, tmp_path / "gen", {"backend": "openai", "base_urls": [canned]})
    meta = tokenization.run(tmp_path / "gen" / "conversations.parquet", ident, tmp_path / "tok")
    assert meta["samples_processed"] == 3 and meta["reasoning"]["field"] == FIELD[family]
    assert meta["reasoning"]["rendered_as"] == f"field {FIELD[family]}"
    assert meta["reasoning"]["turns"] == meta["reasoning"]["in_sequence"] == 2
    tok = load_tokenizer(load_identity(ident)["path"])
    convs = read_conversations(tmp_path / "gen" / "conversations.parquet")
    rows = read_parquet(tmp_path / "tok" / "tokens.parquet").to_pylist()
    for conv, r in zip(convs, rows, strict=True):
        *prompt, last = conv["messages"]
        reasoning = last.get("reasoning_content")
        as_read = {"role": "assistant", "content": last["content"], **({FIELD[family]: reasoning} if reasoning else {})}
        expected = tok.apply_chat_template([*prompt, as_read], tokenize=False)
        assert r["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
        ids, mask = np.asarray(r["input_ids"]), np.asarray(r["loss_mask"], bool)
        masked, text = tok.decode(ids[mask].tolist()), tok.decode(ids.tolist())
        assert masked == WRITTEN[family][not reasoning].format(r=reasoning, c=last["content"])
        if family == "gpt_oss":
            assert "think>" not in text


@pytest.mark.faults
def test_raw_thinking_markers_and_malformed_rows_are_skipped_by_reason(tok):
    rows = [row(0, [U("q"), A("<think>leaked</think> a")]),
            row(1, []),
            row(2, [U("q")]),
            row(3, [U("q"), {"role": "assistant", "content": None}]),
            row(4, [{"role": "wizard", "content": "q"}, A("a")]),
            row(5, [U("q"), A("fine")]),
            row(5, [U("q"), A("dup")]),
            row(6, [A("first"), U("q"), A("a")])]
    kept, skipped, _ = tokenization.tokenize_rows(tok, rows)
    assert [r["id"] for r in kept] == ["r5"]
    assert skipped == {"raw_thinking_markers": 1, "empty_conversation": 1, "no_assistant_turn": 1,
                       "non_string_content": 1, "unknown_role": 1, "duplicate_id": 1, "assistant_first": 1}


def test_overlong_skip_or_truncate(tok):
    long = [U("hello"), A(" ".join(["word"] * 300))]
    kept, skipped, _ = tokenization.tokenize_rows(tok, [row(0, long)], max_length=64, overlong="skip")
    assert not kept and skipped == {"overlong": 1}
    kept, skipped, _ = tokenization.tokenize_rows(tok, [row(0, long)], max_length=64, overlong="truncate")
    assert kept[0]["num_tokens"] == 64 and kept[0]["loss_mask"][-1] == 1
    assert kept[0]["truncated"] is True
    # Truncation that cuts every assistant token leaves nothing to learn: skipped, and said to be a
    # truncation (not an empty answer)
    late = [U(" ".join(["word"] * 300)), A("a")]
    kept, skipped, _ = tokenization.tokenize_rows(tok, [row(0, late)], max_length=64)
    assert not kept and skipped == {"truncated_no_answer": 1}


def test_metadata_counts_every_truncation(tiny_target, tmp_path):
    """`truncated` counts samples cut at max_length, those kept with part of their answer and those
    dropped because the cut removed all of it (3.8 % of the default run's answers were dropped so
    while metadata said "truncated": 0)."""
    convs = tmp_path / "c.parquet"
    write_conversations(convs, [row(0, [U("hello"), A(" ".join(["word"] * 300))]),
                                row(1, [U(" ".join(["word"] * 300)), A("a")]),
                                row(2, [U("hi"), A("short")])])
    meta = tokenization.run(convs, tiny_target_identity_path(tiny_target), tmp_path / "out", max_length=64)
    assert meta["samples_processed"] == 2 and meta["skipped_by_reason"] == {"truncated_no_answer": 1}
    assert meta["truncated"] == 2 and meta["truncated_kept"] == 1


def test_run_writes_tokens_and_seed_metadata(tiny_target, tmp_path):
    convs = tmp_path / "c.parquet"
    write_conversations(convs, [row(i, [U(f"q{i}"), A(f"answer number {i}")]) for i in range(5)]
                        + [row(9, [U("q")])])
    meta = tokenization.run(convs, tiny_target_identity_path(tiny_target), tmp_path / "out")
    for key in ("samples_processed", "samples_skipped", "total_tokens", "total_assistant_tokens",
                "vocab_size", "unique_assistant_tokens"):
        assert key in meta
    assert meta["samples_processed"] == 5 and meta["samples_skipped"] == 1
    table = read_parquet(tmp_path / "out" / "tokens.parquet")
    assert {"id", "input_ids", "loss_mask", "num_tokens"} <= set(table.column_names)
    assert table.num_rows == 5 and sum(table.column("num_tokens").to_pylist()) == meta["total_tokens"]
    assert read_json(tmp_path / "out" / "metadata.json") == meta


def tiny_target_identity_path(identity):
    from pathlib import Path

    return Path(identity["path"]).parent / "identity.json"


def test_backend_encode_gives_the_wrappers_ids_and_masks(tok):
    """The stage calls the Rust tokenizer directly and finds mask bounds from the span edges'
    tokens; the wrapper's ids and the full-offsets mask must come out, non-ASCII text included
    (several tokens per character, spans starting inside a multi-byte run)."""
    import copy

    texts, spans = [], []
    for content in ["Paris.", "naïve café — 東京タワー 🚀🚀 ok", "x" * 40 + " 😀", "  spaced  ", "\n\n"]:
        msgs = [U("q 🙂 ü"), A(content), U("again"), A(content[::-1] or "r")]
        text, sp = tokenization.render(tok, msgs)
        texts.append(text)
        spans.append(sp + [(sp[0][0] + 1, sp[0][1])])  # a span starting mid-token too
    assert tokenization.backend(tok) is not None
    ids, masks = tokenization.encode_masked(tok, texts, spans)
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    for i in range(len(texts)):
        assert ids[i].tolist() == enc["input_ids"][i]
        want = tokenization.mask_from_offsets(enc["offset_mapping"][i], spans[i])
        assert np.array_equal(masks[i], want), texts[i]
        assert masks[i].any()
    slow = copy.deepcopy(tok)
    slow._tokenizer.enable_truncation(max_length=10_000)  # a configured backend: the wrapper path
    assert tokenization.backend(slow) is None
    ids2, masks2 = tokenization.encode_masked(slow, texts, spans)
    assert all(np.array_equal(a, b) for a, b in zip(ids + masks, ids2 + masks2))


def test_template_kwargs_render_what_the_server_prefills(tok):
    """Qwen3 served with enable_thinking: false pre-fills an empty think block in the generation
    prompt: rendered with the served kwargs it is prompt (no loss token) and the evaluation prompt
    ends with it; rendered without them it would be trained on as if the target had produced it."""
    from eaglet.base import datasets
    from eaglet.target.family_templates import QWEN3_TEMPLATE

    q = copy.deepcopy(tok)
    q.chat_template = QWEN3_TEMPLATE
    msgs = [U("2+2?"), A("4")]
    served = {"enable_thinking": False}

    def masked(kwargs):
        kept, skipped, _ = tokenization.tokenize_rows(q, [row(0, msgs)], template_kwargs=kwargs)
        assert not skipped
        return q.decode(kept[0]["input_ids"][kept[0]["loss_mask"].astype(bool)].tolist()), kept[0]["input_ids"]

    text, ids = masked(served)
    assert text.startswith("4<|im_end|>") and "think" not in text
    assert "<think>" in q.decode(ids.tolist())  # the block is in the sequence, as prompt
    assert masked({})[0].startswith("<think>")  # the old rendering trained on the pre-fill
    prompt = q.decode(datasets.encode(q, [U("2+2?")], served))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not q.decode(datasets.encode(q, [U("2+2?")])).endswith("</think>\n\n")


def _runs(tok, kept):
    """The decoded text of each run of loss tokens."""
    ids, mask = kept["input_ids"].tolist(), kept["loss_mask"].tolist()
    runs, cur = [], []
    for t, m in zip(ids + [0], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


@pytest.mark.parametrize("served", [{}, {"enable_thinking": False}])
def test_qwen3_history_turns_are_found_in_the_full_rendering(tok, served):
    """Qwen3's template gives only the latest answer a think block (and drops an earlier turn's
    reasoning): the prefix renders disagree for every earlier turn, and such conversations were
    all skipped (template_not_prefix). Each turn is now located in the full rendering: the sequence
    is the conversation as the target reads it at the last turn, every answer and its end marker
    is a loss token, and nothing of the users' text or the role headers is."""
    from eaglet.target.family_templates import QWEN3_TEMPLATE

    q = copy.deepcopy(tok)
    q.chat_template = QWEN3_TEMPLATE
    msgs = [U("Name a colour."), A("Blue.", reasoning_content="Pick one."), U("Another?"), A("Green."),
            U("And a third?"), A("Red, of course.")]
    kept, skipped, _ = tokenization.tokenize_rows(q, [row(0, msgs)], template_kwargs=served)
    assert not skipped, skipped
    full = q.apply_chat_template(msgs, tokenize=False, **served)
    assert q.decode(kept[0]["input_ids"].tolist()) == full
    assert "Pick one." not in full  # history drops the reasoning: not in the sequence at all
    runs = _runs(q, kept[0])
    last = "Red, of course.<|im_end|>\n" if served else "<think>\n\n</think>\n\nRed, of course.<|im_end|>\n"
    assert runs == ["Blue.<|im_end|>\n", "Green.<|im_end|>\n", last], runs


def test_gpt_oss_earlier_turns_are_trained_as_the_conversation_goes_on():
    """gpt-oss ends a finished conversation's last answer with <|return|> after its analysis, and
    every earlier one with <|end|> and no analysis: those conversations were all skipped
    (template_not_prefix). An earlier turn is now its rendering with the conversation going on:
    its final channel and <|end|> are loss tokens, its reasoning is not in the sequence, the last
    turn's reasoning is."""
    from eaglet.target.families import build_tokenizer

    g = build_tokenizer("gpt_oss")
    msgs = [U("Name a colour."), A("Blue.", reasoning_content="Pick one."), U("Another?"),
            A("Green.", reasoning_content="A different one.")]
    kept, skipped, _ = tokenization.tokenize_rows(g, [row(0, msgs)])
    assert not skipped, skipped
    assert "Pick one." not in g.decode(kept[0]["input_ids"].tolist())
    assert kept[0]["reasoning_turns"] == 2 and kept[0]["reasoning_shown"] == 1
    assert _runs(g, kept[0]) == ["<|channel|>final<|message|>Blue.<|end|>",
                                 "<|channel|>analysis<|message|>A different one.<|end|><|start|>assistant"
                                 "<|channel|>final<|message|>Green.<|return|>"]


def test_history_span_refuses_a_turn_it_cannot_place(tok):
    """A template that rewrites an earlier answer in history (here: upper-cased) leaves nothing to
    locate: refused by name, not trained on a guessed span."""
    from eaglet.target.family_templates import QWEN3_TEMPLATE

    q = copy.deepcopy(tok)
    q.chat_template = QWEN3_TEMPLATE.replace(
        "{%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}",
        "{%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content|upper }}\n        {%- endif %}")
    assert q.chat_template != QWEN3_TEMPLATE
    msgs = [U("Name a colour."), A("Blue."), U("Another?"), A("Green.")]
    kept, skipped, _ = tokenization.tokenize_rows(q, [row(0, msgs)])
    assert not kept and skipped == {"template_not_prefix": 1}
