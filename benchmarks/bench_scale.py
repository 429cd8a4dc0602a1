"""Each stage's cost at 2x the tokens / at 1x (same code, same machine, side by side in one run).

    python benchmarks/bench_scale.py [--stages tokenize,extract,train,generate]
        [--conversations FILE.parquet] [--n-tokenize 800] [--n-extract 12] [--extract-budget N]
        [--repeats 2] [--heavy-repeats 2] [--params '{"token_budget": 2048}'] [--threads 0]
        [--base-url http://127.0.0.1:8000/v1 --model NAME | --serve] [--n-generate 16]

Inputs are real and distinct at both sizes: the 1x input of a stage is the first samples of a
pool, the 2x input the prefix of the same pool whose tokens come closest to twice as many (no
copies: a copy would hit the tokenizer's word cache and pack into batches better than new data).
The ratio is normalised to exactly 2x tokens, (t_2x / t_1x) x 2 / (tok_2x / tok_1x), assuming
linear interpolation over the few percent of difference; the raw figures are printed too. Goal:
<= 2.3 (2.0 is linear; fixed costs pull it lower).

Each stage is its module's stage function, timed whole, as the workflow calls it (minus the
Python start-up, the same at both sizes): ``eaglet.data.tokenization.run`` (read conversations, load the
tokenizer, tokenise, write tokens + metadata); ``eaglet.features.extract.extract`` (config's extract dtype
and token budget; the target is loaded once before timing, so neither size pays it; the final
sha256 re-read counts); ``eaglet.train.train.train`` (config's train section, one epoch, no
validation, no checkpoints; setup and the drafter write count). The chain is the workflow's: the
pool of conversations (``--conversations``, default 3 x ``--n-tokenize`` ShareGPT conversations
by eaglet.data.prompts, seed 0, max_turns 2) is tokenised once as a warm-up, which also gives every
conversation's token count; extract's inputs are prefixes of that tokens file (1x: the first
``--n-extract`` samples); train's inputs are extract's 1x and 2x stores. A warm-up call before
each stage takes the one-time costs (imports, thread pools, first kernels). 1x and 2x alternate
``--repeats`` times (``--heavy-repeats`` for extract, train and generate); the best of each
counts. Beside the wall-time ratio, the process CPU time ratio (all threads, same
normalisation): on a shared machine it moves less with other work's load.

generate needs a vLLM server: with ``--base-url`` it uses that one, with ``--serve`` it starts
the CPU build through eaglet.engines.vllm_server (minutes); otherwise it is skipped, and says so. Its
inputs are made-up one-turn prompts (``--n-generate`` and twice as many, at temperature 0), its
tokens the completion tokens. Prints one line ``ratio <stage>: <value>`` per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eaglet.base.conversations import read_conversations, write_conversations  # noqa: E402
from eaglet.base.files import read_parquet, write_parquet  # noqa: E402
from eaglet.base.logs import quiet_third_party, setup_logging  # noqa: E402
from eaglet.data import tokenization  # noqa: E402
from eaglet.features.extract import extract, pick_device  # noqa: E402
from eaglet.target import capture  # noqa: E402
from eaglet.target.load import load_identity  # noqa: E402
from eaglet.train.train import resolve_params, train  # noqa: E402

GOAL = 2.3
STAGES = ("tokenize", "extract", "train", "generate")


def prefix_closest(counts: list[int], n1: int) -> int:
    """Length m of the prefix of ``counts`` whose sum is closest to twice the sum of the first n1."""
    want, cum, best, best_m = 2 * sum(counts[:n1]), 0, None, n1
    for m, c in enumerate(counts, 1):
        cum += c
        if m > n1 and (best is None or abs(cum - want) < best):
            best, best_m = abs(cum - want), m
        if cum > want:
            break
    return best_m


def alternate(fn, repeats: int, warmup=None) -> tuple[dict, dict, list]:
    """fn(size, rep) for size 1 and 2, alternating ``repeats`` times. Returns the best wall time
    and the best process CPU time (all threads) of each size, and every (size, result)."""
    if warmup is not None:
        warmup()
    wall = {1: float("inf"), 2: float("inf")}
    cpu = {1: float("inf"), 2: float("inf")}
    results = []
    for r in range(repeats):
        for k in (1, 2):
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn(k, r)
            wall[k] = min(wall[k], time.perf_counter() - t0)
            cpu[k] = min(cpu[k], time.process_time() - c0)
            results.append((k, out))
    return wall, cpu, results


def report(stage: str, wall: dict, cpu: dict, tok1: int, tok2: int, extra: str = "") -> None:
    t1, t2 = wall[1], wall[2]
    f = tok2 / tok1
    r, rc = t2 / t1 * 2 / f, cpu[2] / max(cpu[1], 1e-9) * 2 / f
    verdict = "superlinear" if r > GOAL else "linear" if r >= 1.7 else "sublinear (fixed costs)"
    if f < 1.8:
        print(f"{stage}: the pool holds only {f:.2f}x the 1x tokens; lower the 1x size for a fair ratio")
    print(f"{stage:9}: 1x {tok1:7d} tok {t1:7.2f} s ({tok1 / t1:8.0f} tok/s) | 2x {tok2:7d} tok (x{f:.3f}) "
          f"{t2:7.2f} s ({tok2 / t2:8.0f} tok/s); raw x{t2 / t1:.3f}; CPU time {cpu[1]:.2f} -> {cpu[2]:.2f} s"
          f"{extra}")
    print(f"note {stage}: {tok1} tok {t1:.2f} s, {tok2} tok {t2:.2f} s, {verdict}; CPU time ratio {rc:.2f}")
    print(f"ratio {stage}: {r:.3f}  (at exactly 2x tokens; goal <= {GOAL}; 2.0 = linear)", flush=True)


def conversation_pool(path: str | None, n: int, dst: Path) -> str:
    """The pool of conversations (3n, or all of --conversations) into dst/pool.parquet."""
    if path:
        rows, src = read_conversations(path)[:3 * n], path
    else:
        from eaglet.data import prompts

        rows = prompts.build_prompts("sharegpt", n=3 * n, heldout=0, seed=0, max_turns=2)["train"]
        src = "ShareGPT (eaglet.data.prompts, seed 0, max_turns 2)"
    write_conversations(dst / "pool.parquet", rows)
    return f"pool of {len(rows)} conversations from {src}"


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--stages", default="tokenize,extract,train,generate")
    ap.add_argument("--conversations", default=None,
                    help="conversation Parquet (default: ShareGPT conversations through eaglet.data.prompts)")
    ap.add_argument("--vocab", default=str(ROOT / "results/smollm2/vocab_map/vocab.safetensors"),
                    help="draft vocab map for train (built from the pool's tokens when missing)")
    ap.add_argument("--n-tokenize", type=int, default=800, help="conversations at 1x (pool: 3x as many)")
    ap.add_argument("--n-extract", type=int, default=12, help="samples at 1x for extract and train")
    ap.add_argument("--extract-budget", type=int, default=None, help="extract token budget (default: config's)")
    ap.add_argument("--repeats", type=int, default=2, help="1x/2x pairs for tokenize")
    ap.add_argument("--heavy-repeats", type=int, default=2, help="1x/2x pairs for extract, train, generate")
    ap.add_argument("--params", default="{}", help="train params (JSON) over config/config.yaml's")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--base-url", default=None, help="generate: an already running OpenAI-compatible server")
    ap.add_argument("--model", default=None, help="generate: served model name with --base-url")
    ap.add_argument("--serve", action="store_true", help="generate: start a vLLM (CPU) server (minutes)")
    ap.add_argument("--env", default=str(ROOT / "envs/vllm/.venv"), help="vLLM venv for --serve")
    ap.add_argument("--n-generate", type=int, default=16,
                    help="generate: prompts at 1x (several times the concurrency, or both sizes are one wave)")
    ap.add_argument("--max-tokens", type=int, default=48, help="generate: max tokens per reply")
    ap.add_argument("--concurrency", type=int, default=8, help="generate: requests in flight")
    a = ap.parse_args()
    stages = [s for s in a.stages.split(",") if s]
    bad = set(stages) - set(STAGES)
    if bad:
        ap.error(f"--stages: unknown {sorted(bad)} (known: {', '.join(STAGES)})")
    return a, stages


def main() -> None:
    a, stages = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    setup_logging()
    quiet_third_party()

    import yaml

    conf = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    ident = load_identity(a.identity)
    tcfg, ecfg = conf.get("tokenize") or {}, conf.get("extract") or {}
    max_len, overlong = int(tcfg.get("max_length", 2048)), tcfg.get("overlong", "truncate")
    print(f"target {ident['name']}, device {pick_device(a.device)}, torch threads {torch.get_num_threads()}",
          flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_scale.") as tmp:
        tmp = Path(tmp)
        need_tokens = any(s in stages for s in ("tokenize", "extract", "train"))
        if need_tokens:
            pool_tok = prepare_pool(a, tmp, max_len, overlong)

        if "tokenize" in stages:
            scale_tokenize(a, tmp, max_len, overlong)

        # ---- extract: prefixes of the pool's tokens
        if "extract" in stages or "train" in stages:
            scale_extract(a, stages, pool_tok, tmp, ecfg)

        # ---- train on extract's 1x and 2x stores
        if "train" in stages:
            scale_train(a, conf, ident, tmp)

        # ---- generate (needs a server)
        if "generate" in stages:
            generate_stage(a, ident, tmp)


def prepare_pool(a: argparse.Namespace, tmp: Path, max_len: int, overlong: str):
    """The pool of conversations, tokenised once (the warm-up of tokenize), and tokenize's 1x and 2x
    inputs; returns the pool's tokens table."""
    print(f"input: {conversation_pool(a.conversations, a.n_tokenize, tmp)}", flush=True)
    # The warm-up of tokenize, and every conversation's token count (0: skipped by the stage).
    tokenization.run(tmp / "pool.parquet", a.identity, tmp / "tok_pool", max_len, overlong)
    pool_tok = read_parquet(tmp / "tok_pool/tokens.parquet")
    ntok = dict(zip(pool_tok.column("id").to_pylist(), pool_tok.column("num_tokens").to_pylist()))
    conv = read_conversations(tmp / "pool.parquet")
    n1 = min(a.n_tokenize, len(conv))
    n2 = prefix_closest([ntok.get(r["id"], 0) for r in conv], n1)
    write_conversations(tmp / "conv_1x.parquet", conv[:n1])
    write_conversations(tmp / "conv_2x.parquet", conv[:n2])
    return pool_tok


def scale_tokenize(a: argparse.Namespace, tmp: Path, max_len: int, overlong: str) -> None:
    """tokenize on the pool's first conversations (1x) and the prefix with about twice their tokens (2x)."""
    def tok_run(k: int, r: int) -> dict:
        return tokenization.run(tmp / f"conv_{k}x.parquet", a.identity, tmp / f"tok_{k}x_{r}", max_len,
                            overlong)

    wall, cpu, res = alternate(tok_run, a.repeats)
    m1 = next(m for k, m in res if k == 1)
    m2 = next(m for k, m in res if k == 2)
    report("tokenize", wall, cpu, m1["total_tokens"], m2["total_tokens"],
           f"  [{m1['samples_in']} -> {m2['samples_in']} conversations]")


def scale_extract(a: argparse.Namespace, stages: list[str], pool_tok, tmp: Path, ecfg: dict) -> None:
    """extract on prefixes of the pool's tokens; its 1x and 2x stores are train's inputs."""
    e1 = min(a.n_extract, pool_tok.num_rows)
    e2 = prefix_closest(pool_tok.column("num_tokens").to_pylist(), e1)
    write_parquet(tmp / "tokens_1x.parquet", pool_tok.slice(0, e1))
    write_parquet(tmp / "tokens_2x.parquet", pool_tok.slice(0, e2))
    dev = pick_device(a.device)
    dtype, budget = ecfg.get("dtype", "bfloat16"), a.extract_budget or int(ecfg.get("token_budget", 16384))

    def ext_run(k: int, r: int) -> dict:
        return extract(tmp / f"tokens_{k}x.parquet", a.identity, tmp / f"ext_{k}x_{r}" / "shard_0",
                       dtype=dtype, token_budget=budget, device=dev, progress=False)

    def ext_warm() -> None:
        write_parquet(tmp / "tokens_w.parquet", pool_tok.slice(0, 2))
        extract(tmp / "tokens_w.parquet", a.identity, tmp / "ext_w", dtype=dtype,
                token_budget=budget, device=dev, progress=False)  # loads the target once

    reps = a.heavy_repeats if "extract" in stages else 1
    wall, cpu, res = alternate(ext_run, reps, warmup=ext_warm)
    x1 = sum(s["num_tokens"] for s in res[0][1]["samples"])
    x2 = sum(s["num_tokens"] for s in res[1][1]["samples"])
    if "extract" in stages:
        report("extract", wall, cpu, x1, x2, f"  [{e1} -> {e2} samples, dtype {dtype}, budget {budget}]")
    capture.LOADED.clear()


def scale_train(a: argparse.Namespace, conf: dict, ident: dict, tmp: Path) -> None:
    """train on extract's 1x and 2x stores."""
    vocab_map = Path(a.vocab)
    if not vocab_map.exists():
        from eaglet.data import freq, vocab

        freq.run(tmp / "tok_pool/tokens.parquet", a.identity, tmp / "freq")
        vocab.run(tmp / "freq/freq.safetensors", a.identity, tmp / "vocab",
                  int((conf.get("vocab") or {}).get("draft_vocab_size", 8192)))
        vocab_map = tmp / "vocab/vocab.safetensors"
    params = {**(conf.get("train") or {}), "epochs": 1, "val_fraction": 0.0,
              "checkpoint_every": 10**9, "max_steps": None, **json.loads(a.params)}
    p = resolve_params(params)

    def train_run(k: int, r: int) -> tuple[dict, float]:
        out = tmp / f"train_{k}x_{r}"
        s = train([str(tmp / f"ext_{k}x_0/shard_0/index.json")], str(vocab_map), ident, out, p)
        import pandas as pd

        m = pd.read_parquet(out / "metrics.parquet")
        m = m[m.split == "train"]
        return s, float((m.tokens / m.tok_s).sum())  # the steps alone, setup excluded

    def train_warm() -> None:
        train([str(tmp / "ext_1x_0/shard_0/index.json")], str(vocab_map), ident, tmp / "train_w",
              {**p, "max_steps": 1})

    wall, cpu, res = alternate(train_run, a.heavy_repeats, warmup=train_warm)
    s1, s2 = res[0][1][0], res[1][1][0]
    step1 = min(x[1][1] for x in res if x[0] == 1)
    step2 = min(x[1][1] for x in res if x[0] == 2)
    f = s2["tokens_this_run"] / s1["tokens_this_run"]
    report("train", wall, cpu, s1["tokens_this_run"], s2["tokens_this_run"],
           f"  [{s1['steps']} -> {s2['steps']} steps, token_budget {p['token_budget']}, "
           f"ttt_steps {p['ttt_steps']}; the steps alone {step1:.2f} -> {step2:.2f} s, "
           f"ratio at 2x {step2 / step1 * 2 / f:.3f}]")


def generate_stage(a: argparse.Namespace, ident: dict, tmp: Path) -> None:
    """generate, when a server is given or started (--base-url, --serve); else skipped, saying so."""
    if a.base_url:
        scale_generate(a, a.base_url, a.model, tmp)
    elif a.serve:
        from eaglet.engines import vllm_server

        with vllm_server.serve(ident["path"], work_dir=str(tmp / "vllm"), env=a.env,
                               served_model_name="bench", kv_cache_gb=2) as srv:
            scale_generate(a, srv.base_url, srv.model, tmp)
    else:
        print("note generate: skipped: needs a vLLM server (pass --base-url URL --model NAME, or --serve "
              "to start the CPU build, minutes); bench_generate.py covers its throughput")
        print("ratio generate: skipped")


def scale_generate(a, base_url: str, model: str, tmp: Path) -> None:
    from eaglet.generate.generate import generate

    rows = default_rows(2 * a.n_generate)
    write_conversations(tmp / "gen_1x.parquet", rows[:a.n_generate])
    write_conversations(tmp / "gen_2x.parquet", rows)
    cfg = {"backend": "openai", "base_urls": [base_url], "model": model, "concurrency": a.concurrency,
           "max_tokens": a.max_tokens, "temperature": 0.0}

    def run(k: int, r: int) -> dict:
        return generate(tmp / f"gen_{k}x.parquet", a.identity, tmp / f"gen_{k}x_{r}", cfg)

    def warm() -> None:
        write_conversations(tmp / "gen_w.parquet", rows[:2])
        generate(tmp / "gen_w.parquet", a.identity, tmp / "gen_w", {**cfg, "max_tokens": 8})

    wall, cpu, res = alternate(run, a.heavy_repeats, warmup=warm)
    report("generate", wall, cpu, res[0][1]["completion_tokens"], res[1][1]["completion_tokens"],
           f"  [completion tokens, max_tokens {a.max_tokens}, concurrency {a.concurrency}; "
           "CPU time is this client's, the server's is not counted]")


def default_rows(n: int) -> list[dict]:
    topics = ["the moon", "bread", "rivers", "chess", "volcanoes", "tea", "bees", "glass"]
    return [{"id": f"g{i:04d}", "source": "bench",
             "messages": [{"role": "user", "content": f"Explain {topics[i % len(topics)]} to a child ({i})."}]}
            for i in range(n)]


if __name__ == "__main__":
    main()
