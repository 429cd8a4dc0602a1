"""Regenerate the assistant turns of conversations with the target itself (EAGLE-3 training data).

    python -m eaglet.generate.generate --conversations results/run/prompts/train.parquet \
        --target resources/targets/NAME/identity.json --out-dir results/run/generate \
        --config '{"backend": "vllm", "max_tokens": 256, "concurrency": 8}' [--log FILE] [--retry-errors]

Backends (``config.backend``):
  openai  any OpenAI-compatible server(s) at ``base_urls``; requests spread round-robin over them
  vllm    starts a vLLM server for the target (eaglet.engines.vllm_server), runs ``openai``, always stops it
  local   in-process transformers batched generation (left padding), for machines without a server

Turns: ``last`` regenerates only the last assistant turn; ``all`` regenerates every assistant turn,
each against the model's own earlier turns. Reasoning from the server's reasoning parser is kept
in ``reasoning_content``, apart from ``content`` (the local backend splits it off where the
template's format marks it: eaglet.target.reasoning); a reply whose content still holds raw
thinking markers (``<think>``) is rejected and counted.

Resumable: finished conversations (and failures) go to ``OUT/parts/part_NNNNNN.parquet`` in chunks,
each written atomically. A rerun skips ids already done (transient failures such as connection
errors are tried again; ``--retry-errors`` retries every failure). Outputs: ``conversations.parquet``
(input order), ``errors.parquet`` (id, error_kind, reason), ``generate_summary.json``.

Modules: this one is the stage (settings, the run, the summary, the CLI); ``generate_turns`` the
conversation driven turn by turn and the prompt filter; ``generate_parts`` the resume state;
``generate_backends`` the openai, vllm and local backends.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.conversations import read_conversations, write_conversations
from eaglet.base.digests import DIGESTS_KEY, digest_of, file_digest, record_digests, verify_beside
from eaglet.base.files import write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.generate.backends import dispatch
from eaglet.generate.parts import PartSink, load_parts, prepare_parts
from eaglet.generate.turns import (
    OVER_LIMIT,
    answer_room,
    input_digest,
    over_limit,
    plan_turns,
    regenerated_ids,
    transient,
)
from eaglet.target.engine_key import engine_key
from eaglet.target.load import load_identity, serving, target_load

# plan_turns and transient: the stage's names from before the split (callers import them from here)
__all__ = ["generate", "main", "over_limit", "plan_turns", "resolve_config", "transient"]

log = logging.getLogger("eaglet.generate.generate")

# What the workflow adds to the generate section (its settings and their defaults: the config schema,
# eaglet.base.schema), and what a direct call without them gets:
#   target_load  the target section's dtype, device, trust_remote_code (local backend); the target's defaults
#   max_length   the token limit a sample will meet downstream: min(tokenize.max_length, the server's
#                max_model_len for the vllm backend); None = no prompt filter
#   mix          data.mix: the share of conversations regenerated; the rest keep the dataset's responses
# and in generate.vllm, how every vLLM engine serves the target (target.vllm, target.trust_remote_code:
# eaglet.target.load.serving, one source for every vLLM engine of a run).
WORKFLOW_KEYS = ("target_load", "max_length", "mix")


def resolve_config(cfg: dict | None) -> dict:
    """The generate section over the schema's defaults, with what the workflow adds (WORKFLOW_KEYS,
    generate.vllm's serving keys), refusing unknown keys."""
    given = dict(cfg or {})
    cfg = schema.settings("generate", given, "generate", extra=WORKFLOW_KEYS)
    cfg["target_load"] = target_load(given.get("target_load"))
    cfg["max_length"] = given.get("max_length")
    cfg["mix"] = given.get("mix", schema.default("data.mix"))
    cfg["vllm"] = schema.defaults("generate.vllm") | serving({}) | (given.get("vllm") or {})
    if not 0 <= cfg["mix"] <= 1:
        raise ValueError(f"data.mix: a fraction in [0, 1], got {cfg['mix']!r}")
    if cfg["turns"] not in schema.allowed("generate.turns"):
        raise ValueError(f"generate.turns: one of {schema.allowed('generate.turns')}, got {cfg['turns']!r}")
    return cfg


# --------------------------------------------------------------------------- the resume key
# Non-weight files of the target folder that shape what it generates: the tokenizer and its chat
# template, config.json / generation_config.json (defaults a server samples with), remote code. The
# target digest covers the weights only.
SERVED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")


def served_files_digest(model_dir: str | Path) -> str:
    """Digest of the target folder's files besides its weights (SERVED_SUFFIXES, top level)."""
    files = sorted(f for f in Path(model_dir).iterdir() if f.is_file() and f.suffix in SERVED_SUFFIXES)
    return digest_of([[f.name, file_digest(f)] for f in files])


def parts_key(cfg: dict, ident: dict, chat_template: str | None) -> dict:
    """What defines a finished row: earlier parts are resumed only when their recorded key equals
    this (eaglet.generate.parts.prepare_parts); the input turns are checked per row (input_digest),
    so a changed prompt set keeps every result whose prompt it still has. The target (weights
    digest, and its other files: tokenizer, chat template, generation defaults), the sampling and
    generation settings, the chat template given in the config and the template's kwargs, and the
    engine: the settings that define the text, one definition with the workflow's cache key
    (eaglet.target.engine_key). Not in it: data.mix and the prompt limit (max_length,
    min_answer_tokens), which choose the rows and are applied anew on every run. part_format 4:
    the engine as eaglet.target.engine_key defines it (rows of format 3, under the older list, are
    made anew once)."""
    import hashlib

    return {"part_format": 4, "target_digest": ident.get("digest"),
            "target_files": served_files_digest(ident["path"]),
            **{k: cfg[k] for k in ("temperature", "top_p", "max_tokens", "seed", "turns",
                                   "chat_template_kwargs", "reject_markers")},
            "chat_template": hashlib.sha256(chat_template.encode()).hexdigest() if chat_template else None,
            "engine": engine_key(cfg)}


# --------------------------------------------------------------------------- the stage
def generate(conversations: str | Path, target: str | Path, out_dir: str | Path, config: dict | None = None,
             retry_errors: bool = False, server_log: str | Path | None = None,
             chat_template: str | None = None) -> dict:
    """Regenerate ``conversations`` with the target given by its identity JSON; return the summary.
    ``chat_template``: ``target.chat_template`` (text or file), else the checkpoint's own."""
    from eaglet.target.chat_template import chat_template_text

    cfg = resolve_config(config)
    chat_template = chat_template_text(chat_template)
    out_dir = Path(out_dir)
    for name in ("httpx", "httpx2", "openai"):  # one INFO line per request would flood the log
        logging.getLogger(name).setLevel(logging.WARNING)
    ident = load_identity(target)  # `path` made absolute
    rows = read_conversations(conversations)
    ids = [str(r["id"]) for r in rows]
    if len(set(ids)) != len(ids):
        dup = [k for k, n in Counter(ids).items() if n > 1][:5]
        raise ArtifactError(f"{conversations}: duplicate ids {dup}")
    regen = regenerated_ids(rows, cfg["mix"], cfg["seed"])
    everything, rows = rows, [r for r in rows if str(r["id"]) in regen]  # the others pass through
    parts = prepare_parts(out_dir, parts_key(cfg, ident, chat_template))
    inputs = {str(r["id"]): input_digest(r) for r in rows}
    done = load_parts(parts, inputs)
    redo = {i for i, r in done.items() if not r["ok"] and (retry_errors or transient(r["error_kind"]))}
    # Checked on every run, done rows too (cheap, no generation): a changed limit applies at once,
    # and a result kept from a run under a higher limit is not output.
    # The dataset's own responses (data.mix < 1) too: such a row would reach tokenize with no room
    # left for its answer either way.
    filtered = (over_limit(everything, cfg, _prompt_tokenizer(cfg, ident, chat_template))
                if cfg["max_length"] else {})
    pending = [r for r in rows if str(r["id"]) not in filtered
               and (str(r["id"]) not in done or str(r["id"]) in redo)]
    n_over = sum(str(r["id"]) in filtered for r in rows)  # of the rows to regenerate
    skipped = len(rows) - len(pending) - n_over
    log.info("generate: %d conversations, %d keep their responses (data.mix %s), %d over the prompt limit "
             "(not sent), %d done before, %d to do (%d failures retried), backend %s", len(everything),
             len(everything) - len(rows), cfg["mix"], len(filtered), skipped, len(pending), len(redo),
             cfg["backend"])

    from tqdm import tqdm

    tty = sys.stderr.isatty()
    bar = tqdm(total=len(rows), initial=skipped + n_over, unit="conv", desc="generate", file=sys.stderr,
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
            dispatch(pending, cfg, ident, out_dir, sink, server_log, chat_template)
    finally:
        sink.flush()  # whatever finished is kept, also when the run fails
        bar.close()
    t_end = time.monotonic()
    timing = {"wall_s": t_end - t0, "generation_s": t_end - (sink.t_gen0 or t_end)}
    summary = _finish(rows, inputs, parts, out_dir, cfg, ident, skipped, sink.written, run, timing, filtered,
                      everything)
    if summary["errors"] > cfg["max_error_fraction"] * (len(rows) - n_over):
        raise RuntimeError(f"generate: {summary['errors']} of {len(rows) - n_over} conversations failed "
                           f"({summary['errors_by_kind']}); see {out_dir / 'errors.parquet'}")
    return summary


def _prompt_tokenizer(cfg: dict, ident: dict, chat_template: str | None):
    """The target's tokenizer with the chat template generation renders with."""
    from eaglet.target.load import load_tokenizer

    trust = bool(cfg["target_load"].get("trust_remote_code")) or bool(cfg["vllm"]["trust_remote_code"])
    return load_tokenizer(ident["path"], chat_template, need_template=True, trust_remote_code=trust)



def _finish(rows, inputs, parts, out_dir, cfg, ident, skipped, written, run, timing, filtered,
            everything) -> dict:
    """Merge the parts in input order, check the accounting, write the three outputs. Rows over
    the prompt limit (``filtered``: never sent, or with data.mix not passed on) are listed in
    errors.parquet with their reason and counted apart from the generation errors. ``everything``:
    all input rows; those not in ``rows`` (data.mix) are output with their own responses."""
    import pyarrow as pa

    done = load_parts(parts, inputs)
    sent = [str(r["id"]) for r in rows if str(r["id"]) not in filtered]
    ok = [done[i] for i in sent if i in done and done[i]["ok"]]
    err = [done[i] for i in sent if i in done and not done[i]["ok"]]
    if written["ok"] + written["error"] + skipped + len(rows) - len(sent) != len(rows):
        raise RuntimeError(f"generate: accounting broken: {written['ok']} ok + {written['error']} errors "
                           f"+ {skipped} skipped + {len(rows) - len(sent)} over the limit != {len(rows)} input")
    if len(ok) + len(err) != len(sent):
        raise RuntimeError(f"generate: {len(sent) - len(ok) - len(err)} input ids have no result in {parts}")
    mine = {r["id"]: r for r in ok}
    original = [r for r in everything if str(r["id"]) not in inputs and str(r["id"]) not in filtered]
    kept = mine.keys() | {str(r["id"]) for r in original}
    write_conversations(out_dir / "conversations.parquet",
                        [mine.get(str(r["id"]), r) for r in everything if str(r["id"]) in kept])
    err_schema = pa.schema([("id", pa.string()), ("error_kind", pa.string()), ("reason", pa.string())])
    err_rows = [{"id": e["id"], "error_kind": e["error_kind"], "reason": e["reason"]} for e in err]
    err_rows += [{"id": str(r["id"]), "error_kind": OVER_LIMIT, "reason": filtered[str(r["id"])]}
                 for r in everything if str(r["id"]) in filtered]
    write_parquet(out_dir / "errors.parquet", pa.Table.from_pylist(err_rows, schema=err_schema))
    turns = sum(r["generated_turns"] for r in ok)
    finish = Counter(f for r in ok for f in r["finish_reasons"])
    completion = sum(r["completion_tokens"] for r in ok)
    gen_s = timing["generation_s"]
    summary = {
        "samples": len(ok) + len(original), "input": len(everything), "errors": len(err),
        # data.mix: regenerated + original = samples
        "mix": cfg["mix"], "regenerated": len(ok), "original": len(original),
        # never sent (nor passed on when data.mix keeps the dataset's response): the prompt leaves
        # fewer than answer_room tokens under max_length
        "filtered": len(filtered), "filtered_by_reason": {OVER_LIMIT: len(filtered)} if filtered else {},
        "filtered_original": len(filtered) - (len(rows) - len(sent)),
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
        # checked by tokenize (and an evaluation set read from here) before reading (digests.verify_beside)
        DIGESTS_KEY: record_digests(out_dir, ["conversations.parquet", "errors.parquet"]),
    }
    write_json(out_dir / "generate_summary.json", summary)
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
    setup_logging(a.log)
    verify_beside(a.conversations, "summary.json")  # the prompts stage's record, when it made them
    generate(a.conversations, a.target, a.out_dir, parse_json_arg(a.config, {}), a.retry_errors,
             a.server_log, a.chat_template or None)


if __name__ == "__main__":
    main()
