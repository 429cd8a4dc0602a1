"""Generation-stage throughput vs a bare OpenAI-client loop, same server, prompts, params, concurrency.

    python benchmarks/bench_generate.py [--target resources/targets/smollm2-135m-instruct/identity.json]
        [--conversations results/smollm2/prompts/train.parquet] [--n 32] [--max-tokens 64]
        [--concurrency 8] [--base-url http://127.0.0.1:8000/v1]

Without --base-url it starts a vLLM (CPU build) server for the target through eaglet.engines.vllm_server.
The bare loop is what the engine delivers to any client: AsyncOpenAI, a semaphore, nothing else.
The stage adds conversation planning, retries, Parquet parts, the progress bar and the final merge.
Prints completion tokens/s of both and the ratio (goal >= 0.9). At temperature 0 both produce the
same tokens, so the token counts match and the ratio compares wall times.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eaglet.base.conversations import read_conversations, write_conversations  # noqa: E402
from eaglet.base.logs import setup_logging  # noqa: E402
from eaglet.engines import vllm_server  # noqa: E402
from eaglet.generate.generate import generate, plan_turns  # noqa: E402


def prompts_of(rows: list[dict]) -> list[list[dict]]:
    """The request each conversation makes in `last` mode (what the stage sends)."""
    out = []
    for r in rows:
        kept, answer = plan_turns(r["messages"], "last")
        if answer:
            out.append([{"role": m["role"], "content": m["content"]} for m in kept])
    return out


async def bare_loop(base_url: str, model: str, prompts: list[list[dict]], concurrency: int,
                    max_tokens: int) -> tuple[int, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(msgs):
        nonlocal tokens
        async with sem:
            r = await client.chat.completions.create(model=model, messages=msgs, temperature=0.0,
                                                     top_p=1.0, max_tokens=max_tokens)
            tokens += r.usage.completion_tokens

    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.monotonic() - t0
    await client.close()
    return tokens, wall


def default_rows(n: int) -> list[dict]:
    topics = ["the moon", "bread", "rivers", "chess", "volcanoes", "tea", "bees", "glass"]
    return [{"id": f"b{i:04d}", "source": "bench",
             "messages": [{"role": "user",
                           "content": f"Explain {topics[i % len(topics)]} to a child ({i})."}]}
            for i in range(n)]


def run(base_url: str, model: str, ident: Path, rows: list[dict], concurrency: int, max_tokens: int) -> None:
    prompts = prompts_of(rows)
    asyncio.run(bare_loop(base_url, model, prompts[:concurrency], concurrency, 8))  # warm-up
    bare1 = asyncio.run(bare_loop(base_url, model, prompts, concurrency, max_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        write_conversations(Path(tmp) / "in.parquet", rows)
        t0 = time.monotonic()
        s = generate(Path(tmp) / "in.parquet", ident, Path(tmp) / "out",
                     {"backend": "openai", "base_urls": [base_url], "model": model,
                      "concurrency": concurrency, "max_tokens": max_tokens, "temperature": 0.0})
        stage_wall = time.monotonic() - t0
    bare2 = asyncio.run(bare_loop(base_url, model, prompts, concurrency, max_tokens))
    bare_tps = (bare1[0] + bare2[0]) / (bare1[1] + bare2[1])  # two runs around the stage: less drift
    stage_tps = s["completion_tokens"] / stage_wall
    print(f"prompts {len(prompts)}, max_tokens {max_tokens}, concurrency {concurrency}")
    print(f"bare openai loop : {bare_tps:8.1f} tok/s  ({bare1[0]} tok in {bare1[1]:.1f} s, "
          f"{bare2[0]} tok in {bare2[1]:.1f} s)")
    print(f"generate stage   : {stage_tps:8.1f} tok/s  ({s['completion_tokens']} tok in {stage_wall:.1f} s, "
          f"errors {s['errors']})")
    print(f"ratio stage/bare : {stage_tps / bare_tps:8.3f}  (goal >= 0.9)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    p.add_argument("--conversations", default=None, help="conversation Parquet (default: made-up prompts)")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--base-url", default=None, help="an already running server (else one is started)")
    p.add_argument("--model", default=None, help="served model name with --base-url")
    p.add_argument("--env", default=str(ROOT / "envs/vllm/.venv"))
    a = p.parse_args()
    setup_logging()
    rows = read_conversations(a.conversations)[: a.n] if a.conversations else default_rows(a.n)
    if a.base_url:
        run(a.base_url, a.model, Path(a.target), rows, a.concurrency, a.max_tokens)
        return
    from eaglet.target.load import load_identity

    ident = load_identity(a.target)
    with tempfile.TemporaryDirectory() as work, vllm_server.serve(
            ident["path"], work_dir=work, env=a.env, served_model_name="bench", kv_cache_gb=2) as srv:
        run(srv.base_url, srv.model, Path(a.target), rows, a.concurrency, a.max_tokens)


if __name__ == "__main__":
    main()
