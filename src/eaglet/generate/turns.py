"""generate's conversations: which turns to answer, one conversation driven turn by turn (the
same for every backend), failure kinds, and the prompt filter that runs before generation."""

from __future__ import annotations

import zlib

from eaglet.base.conversations import prompt_problem
from eaglet.base.digests import digest_of

RETRY_STATUS = (408, 429)


def transient(kind: str) -> bool:
    """Failures worth another try on a rerun (the server was down or overloaded, not the data)."""
    if kind in ("connection", "timeout"):
        return True
    return kind.startswith("http_") and kind[5:].isdigit() and (int(kind[5:]) in RETRY_STATUS
                                                                or int(kind[5:]) >= 500)


class GenError(Exception):
    def __init__(self, kind: str, reason: str, retries: int = 0):
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason, self.retries = kind, reason, retries


# --------------------------------------------------------------------------- one conversation
def plan_turns(messages: list[dict], turns: str) -> tuple[list[dict], set[int]]:
    """(messages kept from the source, indices among them of the user turns to answer)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        return messages, set()
    if turns == "last":
        return messages[: users[-1] + 1], {users[-1]}
    kept, answer = [], set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        kept.append(m)
        # Answer where the source answered (or at the end); two user messages in a row get one reply.
        if m["role"] == "user" and (i + 1 == len(messages) or messages[i + 1]["role"] != "user"):
            answer.add(len(kept) - 1)
    return kept, answer


class Conversation:
    """One conversation regenerated turn by turn; every backend drives it the same way."""

    def __init__(self, row: dict, cfg: dict):
        self.row, self.cfg = row, cfg
        problem = prompt_problem(row.get("messages"))
        # A malformed row is never sent: it fails at once with its reason (not transient: a rerun
        # does not retry it).
        self.kept, self.answer = ([], set()) if problem else plan_turns(row["messages"], cfg["turns"])
        self.i, self.turn, self.out = 0, 0, []
        self.stats = {"prompt_tokens": 0, "completion_tokens": 0, "finish_reasons": [], "retries": 0,
                      "reasoning_turns": 0}
        self.error: tuple[str, str] | None = (problem, f"input row: {problem}") if problem else (
            None if self.answer else ("no_user_turn", "no user message"))

    def next_prompt(self) -> list[dict] | None:
        """The chat history to answer next (role/content only), or None when done or failed."""
        while self.error is None and self.i < len(self.kept):
            self.out.append(self.kept[self.i])
            self.i += 1
            if self.i - 1 in self.answer:
                return [{"role": m["role"], "content": m["content"]} for m in self.out]
        return None

    def request_seed(self) -> int:
        # Per (id, turn), so a sampled run is reproducible whatever the scheduling order.
        return (self.cfg["seed"] * 1_000_003 + zlib.crc32(str(self.row["id"]).encode()) + self.turn) % 2**31

    def add_reply(self, content: str | None, reasoning: str | None, prompt_tokens: int,
                  completion_tokens: int, finish_reason: str | None, retries: int = 0) -> None:
        content, reasoning = content or "", reasoning or None
        s = self.stats
        s["prompt_tokens"] += prompt_tokens
        s["completion_tokens"] += completion_tokens
        s["finish_reasons"].append(finish_reason or "unknown")
        s["retries"] += retries
        self.turn += 1
        markers = [mk for mk in self.cfg["reject_markers"] if mk in content]
        if markers:
            self.error = ("raw_thinking_markers", f"turn {self.turn}: content holds {markers}")
        elif not content.strip() and not reasoning:
            self.error = ("empty_response", f"turn {self.turn}: empty reply (finish {finish_reason})")
        else:
            s["reasoning_turns"] += reasoning is not None
            self.out.append({"role": "assistant", "content": content, "reasoning_content": reasoning})

    def fail(self, e: GenError) -> None:
        self.stats["retries"] += e.retries
        self.error = (e.kind, e.reason)

    def record(self) -> dict:
        ok = self.error is None
        return {"id": str(self.row["id"]), "source": str(self.row.get("source", "")), "ok": ok,
                "input_digest": input_digest(self.row),
                "messages": [{"role": m["role"], "content": m["content"],
                              "reasoning_content": m.get("reasoning_content")}
                             for m in self.out] if ok else None,
                "error_kind": None if ok else self.error[0], "reason": None if ok else self.error[1],
                "generated_turns": self.turn, **self.stats}


# --------------------------------------------------------------------------- prompt filter
OVER_LIMIT = "prompt_over_limit"


def answer_room(cfg: dict) -> int:
    """Answer tokens a prompt must leave under ``max_length``: ``min_answer_tokens``, or
    ``max_tokens`` when replies cannot be longer than that anyway."""
    return min(cfg["min_answer_tokens"], cfg["max_tokens"])


def over_limit(rows: list[dict], cfg: dict, tok) -> dict[str, str]:
    """Rows whose first prompt leaves no room for an answer under ``cfg["max_length"]``, id ->
    reason; checked before any generation so they are never sent.

    The rule: a conversation is dropped when the chat-templated prompt of its first turn to answer
    (the template's generation prompt included, as the local backend and the server render it)
    takes more than ``max_length - answer_room(cfg)`` tokens. tokenize cuts samples at
    ``tokenize.max_length``: such a reply would be cut away whole (its ``truncated_no_answer``).
    Later turns (``turns: all``) are not checked: tokenize keeps the earlier answers of a sample it
    cuts."""
    limit = cfg["max_length"]
    if not limit:
        return {}
    room = answer_room(cfg)
    if room >= limit:
        raise ValueError(f"generate.min_answer_tokens/max_tokens: an answer of {room} tokens leaves no "
                         f"room for a prompt under the limit of {limit} tokens")
    out: dict[str, str] = {}
    firsts = []
    for row in rows:
        conv = Conversation(row, cfg)
        history = conv.next_prompt()
        if history is not None:  # malformed rows fail on the normal path, with their own reason
            firsts.append((str(row["id"]), history))
    for b in range(0, len(firsts), 256):
        batch = firsts[b:b + 256]
        texts = [tok.apply_chat_template(h, tokenize=False, add_generation_prompt=True,
                                         **cfg["chat_template_kwargs"]) for _, h in batch]
        enc = tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for (rid, _), ids in zip(batch, enc, strict=True):
            if len(ids) + room > limit:
                out[rid] = (f"prompt of {len(ids)} tokens + {room} answer tokens > max_length {limit} "
                            "(min of tokenize.max_length and the server's max_model_len)")
    return out


def input_digest(row: dict) -> str:
    """What a result was generated from: a stored result is reused only for the same input turns."""
    return digest_of(row.get("messages"))


def regenerated_ids(rows: list[dict], mix: float, seed: int) -> set[str]:
    """``data.mix``: the ids of the round(mix * n) conversations whose assistant turns are
    regenerated; the others keep the dataset's own responses (they get the target's forward in
    extraction, no generation). Chosen by a hash of (seed, id), so a row's side does not depend on
    the input order, and a larger mix only adds rows to the regenerated side."""
    ids = [str(r["id"]) for r in rows]
    if mix >= 1:
        return set(ids)
    rank = sorted(ids, key=lambda i: (zlib.crc32(f"{seed}:{i}".encode()), i))
    return set(rank[:round(mix * len(ids))])

