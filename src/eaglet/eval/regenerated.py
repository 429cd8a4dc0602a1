"""Score the drafter along the target's own regenerated answers: the evaluation and validation sets
(MT-Bench's questions, the held-out prompts) answered by the target through the live server at each
evaluation temperature (workflow/rules/generate.smk, rules ``eval_prompts`` and ``generate_eval``).
That is the text the drafter faces when served; the training data need not be (``data.mix: 0.0``
trains on the dataset's own answers).

    python -m eaglet.eval.regenerated --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json \
        --answers results/RUN/generate_eval/conversations.parquet \
        --config '{"k_values": [1, 2, 3], "seed": 0}' --out results/RUN/eval/regenerated.json [--log LOG]

Along each answer (prompt rendered by the chat template as served, the answer's text tokenised
after it), one teacher-forced target forward gives p and the aux states at every position, and the
drafter drafts from every verified start:

- T = 0: the exact greedy chain: how many of its k drafts match the text, replayed round by round
  (eaglet.drafter.chain.chain_replay), τ = 1 + accepted / rounds. Along the target's greedy text this
  is what serving accepts.
- T > 0: the expected acceptance (eaglet.eval.evaluate_offline.offline_sampling along the given texts) under
  each rule vLLM serves: α = Σ_x min(p(x), q(x)) per draft position for drafts sampled from q
  (probabilistic), α = p(argmax q) for greedy drafts; the expected chain Σ_{j<k} Π_{i<=j} α_i per
  start; one matrix row set per rule (``rule``).

τ per set and per domain with intervals over prompts; the rows go to the results matrix as engine
``regen`` (summary.json's ``matrix``), beside the generation's own figures (answers, tok/s).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import defaultdict
from pathlib import Path

from eaglet.base import datasets, schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.conversations import read_conversations
from eaglet.base.digests import verify_beside, verify_recorded
from eaglet.base.files import read_json, write_json
from eaglet.base.logs import setup_logging
from eaglet.base.progress import Progress
from eaglet.base.settings_files import parse_json_arg
from eaglet.drafter.chain import accepted_prefix, chain_replay, prompt_chain
from eaglet.engines.hf_loop import setup
from eaglet.eval import stats
from eaglet.eval.evaluate_offline import offline_sampling
from eaglet.eval.options import target_load

log = logging.getLogger("eaglet.eval.regenerated")

ENGINE = "regen"
# The settings it takes (eval.smk's REGEN_OPTS), by the schema settings that give their defaults
# (eaglet.base.schema.settings_at), beside the HF loop's verdict and reason (``regenerated_options``)
SETTINGS = ("evaluate.k_values", "evaluate.seed", "evaluate.confidence", "evaluate.max_relative_width",
            "target.chat_template", "generate.chat_template_kwargs", "target.dtype", "target.device",
            "target.trust_remote_code")


def texts(answers: str | Path, tok, template_kwargs: dict | None) -> dict[float, list[dict]]:
    """The regenerated answers by temperature: prompt ids (the chat template as served) and the
    answer's token ids; answers under two tokens carry no draft position and are left out."""
    verify_beside(answers, "generate_summary.json")
    by_t = defaultdict(list)
    for r in read_conversations(answers):
        msgs = r["messages"] or []
        if not msgs or msgs[-1]["role"] != "assistant":
            continue
        set_name, temp, rid = datasets.row_key(str(r["id"]))
        ids = tok(msgs[-1]["content"], add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            continue
        by_t[temp].append({"set": set_name, "domain": r.get("source") or set_name, "id": rid,
                           "prompt_ids": datasets.encode(tok, msgs[:-1], template_kwargs), "tokens": list(ids)})
    return dict(by_t)


def greedy_along(target, proposer, prompt: list[int], tokens: list[int], K: int) -> list[int]:
    """Accepted drafts (of K) from every verified start g = 1 .. N-1 along a fixed text: the drafter
    knows x_0 .. x_{P+g-1} and drafts x_{P+g} ..."""
    x, P, N = prompt + tokens, len(prompt), len(tokens)
    _, aux = target.forward(x[:-1], target.new_cache())
    proposer.reset()
    proposer.extend(aux[:P], x[1:P + 1])
    acc = []
    for g in range(1, N):
        if g > 1:
            proposer.extend(aux[P + g - 2:P + g - 1], x[P + g - 1:P + g])
        acc.append(accepted_prefix(proposer.draft(K), x[P + g:]))
    return acc


def _ci(rows: list[dict], k: int, o: dict) -> dict:
    return stats.tau_interval([tuple(r["chain"][k]) for r in rows], o["confidence"], o["max_relative_width"])


def greedy_scores(target, proposer, rows: list[dict], ks: list[int], o: dict) -> dict:
    """The exact chain at T = 0 along each text; per set, per domain and overall with intervals."""
    K = max(ks)
    progress = Progress(log, "regenerated answers, greedy chain (T = 0)", len(rows), "answers")
    for r in rows:
        acc = [0] + greedy_along(target, proposer, r["prompt_ids"], r["tokens"], K)
        n = len(r["tokens"])
        r["chain"] = {k: prompt_chain(chain_replay(acc, n, n, k)) for k in ks}
        progress.step()

    def group(sel):
        return {"prompts": len(sel), "tau": {k: _ci(sel, k, o) for k in ks}}

    sets = {s: group([r for r in rows if r["set"] == s]) for s in dict.fromkeys(r["set"] for r in rows)}
    domains = {d: {"set": next(r["set"] for r in rows if r["domain"] == d),
                   **group([r for r in rows if r["domain"] == d])} for d in dict.fromkeys(r["domain"] for r in rows)}
    return {"temperature": 0.0, "estimate": "exact greedy chain along the target's greedy text",
            "overall": group(rows), "sets": sets, "domains": domains}


def regenerated_options(given: dict | None) -> dict:
    # the HF loop's verdict and its reason come from the workflow; a direct call runs the loop
    return schema.settings_at("regenerated", SETTINGS, given, extra={"hf_loop": True, "hf_loop_reason": None})


def score(drafter: str | Path, identity: str | Path, answers: str | Path, out: str | Path,
          generation: str | Path | None = None, threads: int | None = None, **opts) -> dict:
    o = regenerated_options(opts)
    ks = sorted({int(k) for k in o["k_values"]})
    gen = read_json(generation) if generation else None
    texts_from = {"answers": str(answers), **({k: gen.get(k) for k in ("regenerated", "errors", "completion_tokens",
                                                                        "tokens_per_s", "backend")} if gen else {})}
    if not o["hf_loop"]:
        why = o["hf_loop_reason"] or "evaluate.hf_loop: false"
        log.warning("not scored (the HF target does not run here): %s", why)
        res = {"stage": "evaluate_regenerated", "status": "not run", "hf_loop_reason": why, "texts": texts_from,
               "temperatures": [], "matrix": []}
        write_json(out, res)
        return res
    _ident, target, proposer, _cfg, tok = setup(drafter, identity, threads, True, o["chat_template"], target_load(o))
    t0 = time.time()
    by_t = texts(answers, tok, o["chat_template_kwargs"])
    if not by_t:
        raise ArtifactError(f"{answers}: no regenerated answer to score")
    results, matrix = [], []
    for temp in sorted(by_t):
        rows = by_t[temp]
        if temp == 0:
            r = greedy_scores(target, proposer, rows, ks, o)
            ov, sets, doms = r["overall"], r["sets"], r["domains"]
        else:
            prompts = [{"set": x["set"], "domain": x["domain"], "prompt_ids": x["prompt_ids"]} for x in rows]
            per_prompt = [{} for _ in rows]
            r = offline_sampling(target, proposer, prompts, per_prompt, max(ks), None, temp,
                                 {**o, "k_values": ks}, texts=[x["tokens"] for x in rows])
            for rule, v in r["rules"].items():  # one row set per rule vLLM serves
                matrix += stats.matrix_rows(ENGINE, temp, ks, {"prompts": v["overall"]["prompts"],
                                                               "tau": v["overall"]["tau_ci"]},
                                            {s: {"prompts": x["prompts"], "tau": x["tau_ci"]}
                                             for s, x in v["sets"].items()}, v["domains"], rule=rule)
            ov = {"prompts": r["overall"]["prompts"], "tau": r["overall"]["tau_ci"]}
        r["answers"], r["tokens"] = len(rows), sum(len(x["tokens"]) for x in rows)
        results.append(r)
        if temp == 0:
            matrix += stats.matrix_rows(ENGINE, temp, ks, ov, sets, doms)
        log.info("T=%g: %d answers, %d tokens, tau %s", temp, r["answers"], r["tokens"],
                 {k: round(ov["tau"][k]["estimate"] or 1, 3) for k in ks})
    res = {"stage": "evaluate_regenerated", "texts": texts_from, "k_values": ks, "temperatures": results,
           "matrix": matrix, "seconds": round(time.time() - t0, 1)}
    write_json(out, res)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--answers", required=True, help="generate_eval/conversations.parquet")
    p.add_argument("--generation", default=None, help="generate_eval/generate_summary.json (its figures are carried)")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(regenerated_options({})))
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    verify_recorded(a.drafter, Path(a.drafter).with_name("train_summary.json"))
    score(a.drafter, a.identity, a.answers, a.out, a.generation, a.threads, **parse_json_arg(a.config, {}))


if __name__ == "__main__":
    main()
