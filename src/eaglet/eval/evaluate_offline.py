"""Rule evaluate_offline: the exact offline acceptance simulator of a trained drafter on the HF
target (docs/eagle3.md §7).

    python -m eaglet.eval.evaluate_offline --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --sets '["mtbench"]' \
        --config '{"num_prompts": 10, "max_new_tokens": 128, "k_values": [1, 2, 3, 4, 5]}' \
        --out-dir results/RUN/eval [--threads 2] [--log LOG]

Greedy continuation of every prompt with the target (KV cache), capturing the aux hidden states at
the drafter's layer ids; from every verified position the drafter drafts K = max(k_values) tokens
(its own hidden states and tokens after step 0, as serving does) and the accepted prefix is
counted. Writes offline.json (τ for every k from every position, per-position acceptance, and the
chain replay: exactly what the real loop of evaluate_speculative accepts) and
offline_positions.parquet / offline_rounds.parquet. τ gets an interval over prompts (seeded
bootstrap, eaglet.eval.stats), per set and per domain (MT-Bench category, HumanEval, ...).

Temperatures (``temperatures``, default [0.0, 1.0]; docs/eagle3.md §13). T = 0 is always evaluated
as above: the exact greedy chain; those figures keep their places in offline.json. Each T > 0 adds
an entry to the list ``sampling``: along the target's own sampled text at T (seeded from ``seed``,
T and the prompt, eaglet.engines.hf_loop.expected_prompt), from every verified position the
expected acceptance of each draft position under each rule vLLM serves (``rules``, by vLLM's
``draft_sample_method``): "probabilistic", drafts sampled from q and accepted with min(1, p/q),
α = Σ min(p, q); "greedy" (vLLM's default), drafts argmax q accepted with probability p(draft),
α = p(argmax q). Per rule: expected τ per k, per draft position, per set and domain with intervals,
and per k the moments of a round's accepted count (``rounds``: what evaluate_vllm's T > 0 gate
tests vLLM against). The top-level figures
of a sampling entry (sets, overall, domains) stay the probabilistic rule's. The stage also writes
``matrix``: one row per engine, T, k, set, domain and rule (eaglet.eval.stats.matrix_rows) that
eval_summary concatenates with the other stages'.

drafter.kind dflash (a DFlash drafter file): the same figures and offline.json, from the block chain
of eaglet.eval.dflash_offline (its docstring: T = 0 the exact chain vLLM's DFlash proposer runs, T > 0
the expectation under each draft sample method), at the one k vLLM serves DFlash with,
block_size − 1 (``k_values`` is replaced by it; ``kind``, ``block_size`` recorded). drafter.kind
p_eagle (a P-EAGLE drafter file): the same from the parallel chain of eaglet.eval.p_eagle_offline (one
forward drafts the K slots of a round, as vLLM's parallel drafting), at k = parallel_k (``kind``,
``parallel_k`` recorded).

The settings (eaglet.eval.options), the conventions shared with the real loop and the outputs
when the HF loop does not run (eaglet.eval.hf_stage) are the HF-loop stages' own.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from eaglet.base import datasets
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import write_json, write_parquet
from eaglet.base.progress import Progress
from eaglet.drafter.chain import (
    ACCEPT,
    chain_counts,
    chain_replay,
    expected_counts,
    expected_position_rates,
    expected_round_stats,
    expected_tau,
    position_rates,
    prompt_chain,
    rounds_tau,
    tau_all_positions,
)
from eaglet.engines.hf_loop import expected_prompt, offline_prompt, setup
from eaglet.eval import dflash_offline, p_eagle_offline, stats
from eaglet.eval.hf_stage import domains, frame, hf_loop_not_run, parser, run, run_generator, tau_ci, tau_se
from eaglet.eval.options import hf_options, sampled_temperatures, target_load

log = logging.getLogger("eaglet.eval.evaluate_offline")


def _offline_stats(starts: list[dict], rounds_by_k: dict, K: int) -> dict:
    acc, valid = [s["accepted"] for s in starts], [s["valid"] for s in starts]
    return {"starts": len(starts),
            "tau": {k: tau_all_positions(acc, valid, k) for k in range(1, K + 1)},
            "tau_chain": {k: rounds_tau(r) for k, r in rounds_by_k.items()},
            "tau_chain_se": {k: tau_se(r) for k, r in rounds_by_k.items()},
            "rounds": {k: len(r) for k, r in rounds_by_k.items()},
            "chain_per_pos": {k: chain_counts(r) for k, r in rounds_by_k.items()},
            **position_rates(acc, valid, K)}


def evaluate_offline(drafter: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path,
                     threads: int | None = None, **opts) -> dict:
    o = hf_options(opts)
    if not o["hf_loop"]:
        return hf_loop_not_run("evaluate_offline", out_dir, o, "offline.json",
                               ("offline_positions.parquet", "offline_rounds.parquet"))
    kind = {}
    if dflash_offline.is_dflash(drafter):
        ident, target, proposer, cfg, tok = dflash_offline.setup(drafter, identity, threads, o["stop_at_eos"],
                                                                 o["chat_template"], target_load(o))
        # vLLM serves DFlash at num_speculative_tokens = block_size - 1 only
        o = {**o, "k_values": [cfg.block_size - 1]}
        kind = {"kind": "dflash", "block_size": cfg.block_size, "chain": dflash_offline.CHAIN}
        layer_ids, draft_vocab = list(cfg.target_layer_ids), cfg.vocab_size
    elif p_eagle_offline.is_p_eagle(drafter):
        ident, target, proposer, cfg, tok = p_eagle_offline.setup(drafter, identity, threads, o["stop_at_eos"],
                                                                  o["chat_template"], target_load(o))
        # vLLM serves a P-EAGLE drafter at num_speculative_tokens = parallel_k
        o = {**o, "k_values": [int(cfg.parallel_k)]}
        kind = {"kind": "p_eagle", "parallel_k": int(cfg.parallel_k), "chain": p_eagle_offline.CHAIN}
        layer_ids, draft_vocab = list(cfg.layer_ids), cfg.draft_vocab_size
    else:
        ident, target, proposer, cfg, tok = setup(drafter, identity, threads, o["stop_at_eos"], o["chat_template"],
                                                   target_load(o))
        layer_ids, draft_vocab = cfg.layer_ids, cfg.draft_vocab_size
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                     o["chat_template_kwargs"], o.get("set_digests"))
    res, pos_rows, round_rows = offline_results(target, proposer, prompts, o, kind.pop("chain", None))
    res = {"stage": "evaluate_offline", "drafter": str(drafter), "target": ident["name"],
           "target_digest": ident["digest"], "layer_ids": layer_ids, "draft_vocab_size": draft_vocab,
           "options": o, "sets_requested": sets, **kind, **res}
    out = Path(out_dir)
    write_parquet(out / "offline_positions.parquet", frame(pos_rows))
    write_parquet(out / "offline_rounds.parquet", frame(round_rows))
    # checked by eval_summary (verify_recorded)
    res[DIGESTS_KEY] = record_digests(out, ["offline_positions.parquet", "offline_rounds.parquet"])
    write_json(out / "offline.json", res)
    log.info("offline: tau %s (all positions), chain %s", res["overall"]["tau"], res["overall"]["tau_chain"])
    for smp in res["sampling"]:
        for rule, v in smp["rules"].items():
            log.info("offline T=%g, %s drafts: expected tau %s", smp["temperature"], rule, v["overall"]["tau"])
    return res


# How the figures are drawn per prompt for an EAGLE-3 drafter: the greedy chain, the expected chain,
# the replay of the rounds (eaglet.eval.dflash_offline.CHAIN is the DFlash drafter's,
# eaglet.eval.p_eagle_offline.CHAIN the P-EAGLE drafter's)
EAGLE3_CHAIN = SimpleNamespace(prompt=offline_prompt, expected=expected_prompt, replay=chain_replay)


def offline_results(target, proposer, prompts: list[dict], o: dict,
                    chain: SimpleNamespace | None = None) -> tuple[dict, list[dict], list[dict]]:
    """The offline figures of ``prompts`` (tokenised as ``o`` renders them): the exact greedy chain
    at T = 0, the expected chain at each T > 0, and their matrix rows; with the per-position and
    per-round rows (offline_positions / offline_rounds.parquet). ``chain``: :data:`EAGLE3_CHAIN`
    (default), the DFlash or the P-EAGLE drafter's."""
    chain = chain or EAGLE3_CHAIN
    K, max_new, eps = max(o["k_values"]), o["max_new_tokens"], o["tie_eps"]
    t0 = time.time()
    pos_rows, round_rows, per_set = [], [], defaultdict(lambda: {"starts": [], "rounds": defaultdict(list)})
    target_ties, per_prompt = 0, []
    progress = Progress(log, "evaluate_offline, greedy chain (T = 0)", len(prompts), "prompts")
    for i, p in enumerate(prompts):
        r = chain.prompt(target, proposer, p["prompt_ids"], K, max_new)
        row = {"set": p["set"], "domain": p["domain"], "id": p["id"], "prompt_tokens": len(p["prompt_ids"]),
               "tokens": r["tokens"], "chain": {}}  # the greedy continuation, for evaluate_vllm
        per_prompt.append(row)
        target_ties += sum(m < eps for m in r["target_margins"])
        for s in r["starts"]:
            pos_rows.append({"set": p["set"], "id": p["id"], **s})
        accepted = [0] + [s["accepted"] for s in r["starts"]]
        for k in o["k_values"]:
            rr = chain.replay(accepted, len(r["tokens"]), max_new, k)
            row["chain"][k] = prompt_chain(rr)
            per_set[p["set"]]["rounds"][k] += rr
            round_rows += [{"set": p["set"], "id": p["id"], "k": k, "g": g, "k_eff": ke, "accepted": a}
                           for g, ke, a in rr]
        per_set[p["set"]]["starts"] += r["starts"]
        log.info("offline %d/%d %s %s: %d tokens, tau(k=%d) %.2f", i + 1, len(prompts), p["set"], p["id"],
                 len(r["tokens"]), min(3, K), tau_all_positions([s["accepted"] for s in r["starts"]],
                                                                [s["valid"] for s in r["starts"]], min(3, K)) or 1)
        progress.step()
    all_starts = [s for v in per_set.values() for s in v["starts"]]
    all_rounds = {k: [x for v in per_set.values() for x in v["rounds"][k]] for k in o["k_values"]}
    res = {"K": K, "prompts": len(prompts), "new_tokens": len(all_starts) + len(prompts),
           "sets": {name: {"prompts": sum(p["set"] == name for p in prompts),
                           **_offline_stats(v["starts"], v["rounds"], K),
                           "tau_chain_ci": tau_ci([q for q in per_prompt if q["set"] == name], "chain",
                                                   o["k_values"], o)}
                    for name, v in per_set.items()},
           "overall": {**_offline_stats(all_starts, all_rounds, K),
                       "tau_chain_ci": tau_ci(per_prompt, "chain", o["k_values"], o)},
           "domains": domains(per_prompt, "chain", o["k_values"], o),
           "ties": {"tie_eps": eps, "target_near_ties": target_ties,
                    "drafter_near_ties": sum(s["drafter_margin"] < eps for s in all_starts)},
           "seconds": round(time.time() - t0, 2), "per_prompt": per_prompt}
    res["sampling"] = [offline_sampling(target, proposer, prompts, per_prompt, K, max_new, t, o, chain=chain)
                       for t in sampled_temperatures(o)]
    res["matrix"] = offline_matrix(res, o)
    return res, pos_rows, round_rows


def _expected_stats(starts: list[dict], K: int, rule: str) -> dict:
    alphas, valid = [s["alpha_by_rule"][rule] for s in starts], [s["valid"] for s in starts]
    return {"starts": len(starts), "tau": {k: expected_tau(alphas, valid, k) for k in range(1, K + 1)},
            "rounds": {k: expected_round_stats(alphas, valid, k) for k in range(1, K + 1)},
            **expected_position_rates(alphas, valid, K)}


# How each rule's expectation is computed (offline.json sampling[i].rules[rule].estimate)
ESTIMATES = {"probabilistic": "drafts sampled from q, accepted with probability min(1, p/q): "
                              "alpha = sum_x min(p(x), q(x))",
             "greedy": "drafts argmax q (vLLM's default draft_sample_method), accepted with probability "
                       "p(draft): alpha = p(argmax q)"}
# The rule of the figures at the top of a sampling entry (sets, overall, domains), as before the rules
TOP_RULE = "probabilistic"


def offline_sampling(target, proposer, prompts: list[dict], per_prompt: list[dict], K: int, max_new: int,
                     temp: float, o: dict, texts: list[list[int]] | None = None,
                     chain: SimpleNamespace | None = None) -> dict:
    """Expected acceptance at ``temp`` along each prompt's sampled text, under each rule vLLM serves
    (eaglet.drafter.chain.ACCEPT: ``rules``, each with its sets, overall and domains; the top-level
    sets, overall and domains are the probabilistic rule's, where they always were). The text and
    the per-prompt (Σ expected accepted, starts) go into ``per_prompt[i]["sampling"][str(temp)]``
    (``expected``: probabilistic; ``expected_by_rule``: each rule). ``texts``: one continuation
    (token ids) per prompt produced elsewhere (e.g. vLLM's at ``temp``) instead of the target's own
    seeded samples. ``chain``: as :func:`offline_results`."""
    chain = chain or EAGLE3_CHAIN
    rows, starts = {r: [] for r in ACCEPT}, defaultdict(list)
    t0 = time.time()
    progress = Progress(log, f"expected acceptance at T = {temp:g} along "
                             f"{'the given texts' if texts else 'the target samples'}", len(prompts), "prompts")
    for i, p in enumerate(prompts):
        e = chain.expected(target, proposer, p["prompt_ids"], K, temp, max_new,
                            run_generator(o["seed"], "offline", temp, i), tokens=texts[i] if texts else None)
        valid = [s["valid"] for s in e["starts"]]
        by_rule = {r: {k: list(expected_counts([s["alpha_by_rule"][r] for s in e["starts"]], valid, k))
                       for k in range(1, K + 1)} for r in ACCEPT}
        per_prompt[i].setdefault("sampling", {})[str(temp)] = {"tokens": e["tokens"], "expected": by_rule[TOP_RULE],
                                                              "expected_by_rule": by_rule}
        for r in ACCEPT:
            rows[r].append({"set": p["set"], "domain": p["domain"], "expected": by_rule[r]})
        starts[p["set"]] += e["starts"]
        progress.step()
    ks = o["k_values"]
    every = [x for v in starts.values() for x in v]
    rules = {r: {"estimate": ESTIMATES[r] + "; expected accepted at k = sum_{j<k} prod_{i<=j} alpha_i, "
                                            "tau = 1 + mean over starts",
                 "sets": {s: {"prompts": sum(x["set"] == s for x in rows[r]), **_expected_stats(v, K, r),
                              "tau_ci": tau_ci([x for x in rows[r] if x["set"] == s], "expected", ks, o)}
                          for s, v in starts.items()},
                 "overall": {"prompts": len(rows[r]), **_expected_stats(every, K, r),
                             "tau_ci": tau_ci(rows[r], "expected", ks, o)},
                 "domains": domains(rows[r], "expected", ks, o)} for r in ACCEPT}
    top = rules[TOP_RULE]
    return {"temperature": temp, "seed": o["seed"], "text": "given" if texts else "sampled by the target, seeded",
            "rule": TOP_RULE, "estimate": top["estimate"],
            "sets": top["sets"], "overall": top["overall"], "domains": top["domains"], "rules": rules,
            "seconds": round(time.time() - t0, 2)}


def offline_matrix(res: dict, o: dict) -> list[dict]:
    """Matrix rows of the offline stage: the exact chain at T = 0, the expected chain at each T > 0
    under each rule."""
    ks = o["k_values"]
    rows = stats.matrix_rows(
        "chain", 0.0, ks, {"prompts": res["prompts"], "tau": res["overall"]["tau_chain_ci"]},
        {s: {"prompts": v["prompts"], "tau": v["tau_chain_ci"]} for s, v in res["sets"].items()}, res["domains"])
    for smp in res["sampling"]:
        for rule, v in smp["rules"].items():
            rows += stats.matrix_rows(
                "expected", smp["temperature"], ks, {"prompts": v["overall"]["prompts"], "tau": v["overall"]["tau_ci"]},
                {s: {"prompts": x["prompts"], "tau": x["tau_ci"]} for s, x in v["sets"].items()}, v["domains"],
                rule=rule)
    return rows


def main(argv: list[str] | None = None) -> None:
    run(evaluate_offline, parser(__doc__).parse_args(argv))


if __name__ == "__main__":
    main()
