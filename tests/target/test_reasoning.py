"""eaglet.target.reasoning on the tiny families' templates: the field each reads reasoning from,
found by rendering (transformers' own copying between the fields notwithstanding), the frame, and
a reply split where the format marks its reasoning."""

import pytest

from eaglet.target import reasoning
from eaglet.target.families import FAMILIES, build_tokenizer

# The field each tiny family's template renders reasoning from (None: it reads none)
FIELD = {"qwen3": "reasoning_content", "qwen3_moe": "reasoning_content", "gpt_oss": "thinking"}


def _detect(family: str, **kwargs) -> reasoning.Format:
    tok = build_tokenizer(family)

    def render(messages, add_generation_prompt=False):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       **kwargs)

    return reasoning.detect(render, tok.get_vocab())


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reads_reasoning_where_its_template_does(family):
    fmt = _detect(family)
    assert fmt.field == FIELD.get(family)
    # markers only where the template reads none; said to be the tokenizer's where it has them
    assert fmt.markers_from == ("tokenizer" if family in ("qwen3", "qwen3_moe", "deepseek_v3") else "default")
    assert fmt.record()["rendered_as"] == (f"field {fmt.field}" if fmt.field else "markers")


def test_gpt_oss_frame_and_split():
    fmt = _detect("gpt_oss")
    assert fmt.frame == ("<|start|>assistant<|channel|>analysis<|message|>",
                         "<|end|><|start|>assistant<|channel|>final<|message|>")
    assert fmt.head == fmt.opener == "<|channel|>analysis<|message|>"
    assert fmt.message({"role": "assistant", "content": "4", "reasoning_content": "2+2"}) == {
        "role": "assistant", "content": "4", "thinking": "2+2"}
    assert fmt.split("<|channel|>analysis<|message|>2+2<|end|><|start|>assistant<|channel|>final<|message|>4") == (
        "2+2", "4")
    assert fmt.split("<|channel|>final<|message|>4") == (None, "4")  # no analysis
    assert fmt.split("<|channel|>analysis<|message|>2+2 is") == ("2+2 is", "")  # cut before the answer
    assert fmt.split("plain text") == (None, "plain text")


def test_qwen3_split_as_served():
    fmt = _detect("qwen3")
    assert fmt.split("<think>\nhm\n</think>\n\nFour.") == ("\nhm\n", "\n\nFour.")
    assert fmt.split("<think>\n\n</think>\n\nFour.") == (None, "\n\nFour.")  # an empty block: no reasoning
    # enable_thinking=false pre-fills the empty block: what the target writes is the answer alone
    off = _detect("qwen3", enable_thinking=False)
    assert off.field == "reasoning_content" and off.head == "" and off.opener == "<think>"
    assert off.split("Four.") == (None, "Four.")


def test_a_template_that_reads_no_field_wraps_and_splits_nothing():
    fmt = _detect("llama3")
    assert fmt.message({"role": "assistant", "content": "4", "reasoning_content": "2+2"})["content"] == (
        "<think>\n2+2\n</think>\n\n4")
    assert fmt.split("<think>\n2+2\n</think>\n\n4") == (None, "<think>\n2+2\n</think>\n\n4")
