"""How the target's chat template reads an assistant turn's reasoning, found by rendering a probe
through the template itself rather than by reading its source: the message field it renders
(Qwen3 and Kimi: ``reasoning_content``; gpt-oss: ``thinking``, in its analysis channel), or none,
and then the reasoning is wrapped in think markers before the content.

The text the template writes around the reasoning of the latest turn (its frame: ``<think>`` …
``</think>``, or gpt-oss's ``<|channel|>analysis<|message|>`` …
``<|end|><|start|>assistant<|channel|>final<|message|>``) is what tokenize trains on, what the
draft vocabulary pins, and where the local backend splits a reply the target generated into
reasoning and content, as a server's reasoning parser does.

    fmt = detect(render, tokenizer.get_vocab())      # render(messages, add_generation_prompt=False)
    fmt.message({"role": "assistant", "content": "4", "reasoning_content": "2+2"})
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container
from dataclasses import dataclass

# The fields templates read reasoning from, tried in this order; the rows keep it in the first.
FIELDS = ("reasoning_content", "thinking")
THINK = ("<think>", "</think>")
_QUESTION, _REASONING, _ANSWER = "Probe question.", "Probe reasoning.", "Probe answer."


@dataclass(frozen=True)
class Format:
    """``field``: the message field the template renders reasoning from, None when it reads none
    (then ``markers`` wrap it, from ``markers_from``: config, tokenizer or default). ``frame``: the
    latest turn's text before the reasoning (from where the earlier messages end) and between the
    reasoning and the content. ``head`` / ``answer_head``: what the target writes after the
    generation prompt before its reasoning / before an answer without reasoning."""

    field: str | None
    markers: tuple[str, str]
    markers_from: str
    frame: tuple[str, str]
    head: str
    answer_head: str

    def message(self, m: dict) -> dict:
        """``m`` (reasoning in ``reasoning_content``, as the rows keep it) as the template reads it."""
        m = {k: v for k, v in m.items() if v is not None}
        r = m.pop(FIELDS[0], None)
        if r is None:
            return m
        if self.field:
            return {**m, self.field: r}
        return {**m, "content": f"{self.markers[0]}\n{r}\n{self.markers[1]}\n\n{m['content']}"}

    @property
    def opener(self) -> str:
        """The text opening reasoning: inside a reply's content it means no parser split it off."""
        return self.head.strip() or self.markers[0]

    def split(self, reply: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a reply generated after the generation prompt, cut
        where the template's frame marks them (whitespace around the markers kept, as a server's
        reasoning parser keeps it; the template normalises it when rendering). Only for a
        template that reads a reasoning field: one that reads none marks no reasoning."""
        head, mid, answer = self.head.strip(), self.frame[1].strip(), self.answer_head.strip()
        text = reply.lstrip()
        if self.field and head and text.startswith(head):
            reasoning, sep, content = text[len(head):].partition(mid)
            # no separator: cut before the answer; an empty think block is no reasoning
            return reasoning if reasoning.strip() else None, content if sep else ""
        if self.field and answer and text.startswith(answer):
            return None, text[len(answer):]
        return None, reply

    def record(self) -> dict:
        """For the stage summaries: which way reasoning is rendered and the frame's text."""
        return {"rendered_as": f"field {self.field}" if self.field else "markers", "field": self.field,
                "markers": None if self.field else list(self.markers),
                "markers_from": None if self.field else self.markers_from, "frame": list(self.frame)}


def markers_for(vocab: Container[str], markers: list[str] | tuple[str, str] | None = None
                ) -> tuple[tuple[str, str], str]:
    """(the think markers, where from): the configured pair, else ``<think>``/``</think>``, said to
    come from the tokenizer when both are tokens of its vocabulary."""
    if markers:
        if len(markers) != 2:
            raise ValueError(f"tokenize.think_markers: an opening and a closing marker, got {markers!r}")
        return (str(markers[0]), str(markers[1])), "config"
    return THINK, "tokenizer" if all(t in vocab for t in THINK) else "default"


def detect(render: Callable[..., str], vocab: Container[str],
           markers: list[str] | tuple[str, str] | None = None) -> Format:
    """The reasoning format of the template behind ``render(messages, add_generation_prompt=False)``
    (rendered with the keyword arguments the target is served with): the first field of FIELDS
    whose probe text shows up in a one-turn conversation, else the think markers."""
    pair, source = markers_for(vocab, markers)
    user = [{"role": "user", "content": _QUESTION}]
    # Every field at once, each with its own text: transformers' apply_chat_template copies one
    # field's reasoning into the others it knows, but never over a value that is there.
    try:
        both = render(user + [{"role": "assistant", "content": _ANSWER, **{f: f"{_REASONING} {f}" for f in FIELDS}}])
    except Exception:  # noqa: BLE001 - a template that refuses the probe reads no such field
        both = ""
    field = next((f for f in FIELDS if f"{_REASONING} {f}" in both), None)
    probe = {"role": "assistant", "content": _ANSWER, FIELDS[0]: _REASONING}
    fmt = Format(field, pair, source, (f"{pair[0]}\n", f"\n{pair[1]}\n\n"), f"{pair[0]}\n", "")
    try:
        prior = render(user)
        gen = render(user, add_generation_prompt=True)[len(prior):]
        turn = render(user + [fmt.message(probe)])[len(prior):]
        bare = render(user + [{"role": "assistant", "content": _ANSWER}])[len(prior):]
    except Exception:  # noqa: BLE001 - the markers' own text is the frame then
        return fmt
    r, c = turn.find(_REASONING), turn.find(_ANSWER)
    if not 0 <= r < c:
        return fmt
    # What the target writes itself starts where the generation prompt ends (Qwen3's
    # enable_thinking=false pre-fills part of the frame: that part is prompt).
    start = len(os.path.commonprefix([gen, turn[:r]]))
    bare_start = len(os.path.commonprefix([gen, bare]))
    return Format(field, pair, source, (turn[:r], turn[r + len(_REASONING):c]), turn[start:r],
                  bare[bare_start:max(bare.find(_ANSWER), bare_start)])
