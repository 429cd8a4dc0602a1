"""Rule evaluate_speculative: the real speculative decoding loop of a trained drafter on the HF
target, timed against plain decoding, with a lossless check (docs/eagle3.md §7).

    python -m eaglet.eval.evaluate_speculative --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --sets '["mtbench"]' \
        --config '{"num_prompts": 10, "max_new_tokens": 128, "k_values": [1, 2, 3, 4, 5]}' \
        --out-dir results/RUN/eval [--threads 2] [--log LOG]

The real loop: draft k, verify k+1 positions in one target forward, accept the longest matching
prefix + the bonus token, roll back both KV caches. Per prompt it also runs plain greedy by the
same code: tokens/s, speedup, and the lossless check (output == greedy token for token; a mismatch
fails unless the target's top-2 logits were within tie_eps there). Writes speculative.json and
speculative_rounds.parquet; its rounds are those evaluate_offline's chain replay predicts.

Timing is paired and interleaved: for each prompt and each of ``repeats`` repeats, plain greedy
and every k run back to back (one block; the order rotates from repeat to repeat and prompt to
prompt, so no configuration always runs first or last), and a speedup sample is greedy seconds /
speculative seconds of the same block. A background job that slows a few seconds then slows both
sides of a pair. Per prompt the median of its samples; the figure is the median over prompts with
a seeded bootstrap interval over prompts (eaglet.eval.stats), and ``conclusive: false`` with a
sentence when the interval spans 1.0 or is wider than ``max_relative_width`` times the estimate.
τ gets the same interval over prompts, per set and per domain (MT-Bench category, HumanEval, ...).

Temperatures (``temperatures``, default [0.0, 1.0]; docs/eagle3.md §13). T = 0 is always evaluated
as above: the exact greedy loop and the token-for-token lossless check; those figures keep their
places in speculative.json. Each T > 0 adds an entry to the list ``sampling``: plain sampling and
speculative sampling at every k, timed in the same paired, interleaved, rotated blocks as greedy
(the same repeats, one OtherLoad over all of them); τ measured = 1 + accepted / rounds; a speedup
sample is the ratio of the two sides' tokens/s in one block (sampled texts differ in length).
Losslessness at T > 0 is a property of the distribution, proven by
tests/engines/test_speculative_sampling.py, not by one run. Every random draw is seeded from
``seed``, the stage, T, the prompt and the configuration, so a rerun gives the same texts. The
stage also writes ``matrix``: one row per engine, T, k, set and domain (eaglet.eval.stats.matrix_rows)
that eval_summary concatenates with the other stages'.

drafter.kind dflash (a DFlash drafter file, read as evaluate_offline reads it): the same loop, timing,
lossless check and outputs with eaglet.engines.dflash_loop.DFlashProposer as the proposer (one drafter
forward per round, the verified context's K/V cached across rounds, as vLLM's DFlash proposer drafts),
at the k of ``k_values`` up to block_size − 1, with block_size − 1 (the k vLLM serves it with) always
in: a k below it drafts the block's first k (:func:`block_k_values`; ``kind`` and ``block_size``
recorded). At T > 0 the drafts are sampled from the block's q and verified exactly, as EAGLE-3's
drafts are (the probabilistic rule; tests/engines/test_speculative_sampling.py proves both rules
lossless in distribution for the kind).

drafter.kind p_eagle (a P-EAGLE drafter file, read as eaglet.eval.p_eagle_offline reads it): the same
with eaglet.engines.p_eagle_loop.PEagleProposer (one drafter forward per round: the newly verified
real entries and the masked slots, the real entries cached across rounds, as vLLM's EAGLE proposer
drafts with parallel_drafting), at the k of ``k_values`` up to parallel_k, with parallel_k (the k vLLM
serves it with) always in: a k below it drafts the round's first k slots (:func:`block_k_values`;
``kind`` and ``parallel_k`` recorded). At T > 0 each slot's draft is sampled from its own q and
verified exactly (the probabilistic rule).

The settings (eaglet.eval.options), the conventions shared with the offline simulator and the
outputs when the HF loop does not run (eaglet.eval.hf_stage) are the HF-loop stages' own.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from eaglet.base import datasets
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import write_json, write_parquet
from eaglet.base.progress import Progress
from eaglet.drafter.chain import prompt_chain, rounds_tau
from eaglet.engines.dflash_loop import DFlashProposer
from eaglet.engines.hf_loop import greedy, sample, setup, speculative, speculative_sampling
from eaglet.engines.p_eagle_loop import PEagleProposer
from eaglet.eval import dflash_offline, p_eagle_offline, stats
from eaglet.eval.hf_stage import domains, frame, hf_loop_not_run, parser, run, run_generator, tau_se
from eaglet.eval.options import hf_options, sampled_temperatures, target_load

log = logging.getLogger("eaglet.eval.evaluate_speculative")


def _median(xs):
    return statistics.median(xs) if xs else None



def block_k_values(k_values: list[int], K: int) -> list[int]:
    """The k a drafter that proposes K tokens in one forward (DFlash: K = block_size − 1; P-EAGLE: K =
    parallel_k) runs at in the HF loop: those of ``k_values`` up to K (a smaller k drafts the round's
    first k) and K itself, the k vLLM serves it with."""
    return sorted({int(k) for k in k_values if k <= K} | {int(K)})


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def timing_order(configs: list, prompt_index: int, repeat: int) -> list:
    """The order of one timing block: ``configs`` rotated by prompt + repeat, so every
    configuration takes every slot in turn (none always first, after the cold start, or last)."""
    r = (prompt_index + repeat) % len(configs)
    return configs[r:] + configs[:r]


def paired_speedups(samples: list[dict], k: int) -> list[float]:
    """Greedy seconds / speculative seconds of the same timing block, one per repeat."""
    return [s["greedy_s"] / s["spec_s"][k] for s in samples if s["spec_s"].get(k)]


def _timed_blocks(target, proposer, p: dict, i: int, ks: list[int], repeats: int, max_new: int,
                  mismatches: list[dict]) -> tuple[list[dict], dict]:
    """One prompt's timing samples: per repeat one block of greedy and every k back to back, the order
    rotated (timing_order); and each configuration's output of the first repeat (``None`` = greedy).
    Decoding is deterministic: a repeat that gives another output is recorded in ``mismatches``."""
    ids = p["prompt_ids"]
    samples, first = [], {}
    for r in range(repeats):
        order = timing_order([None] + ks, i, r)  # None = plain greedy
        block = {"repeat": r, "order": ["greedy" if c is None else c for c in order], "spec_s": {}}
        for c in order:
            res = greedy(target, ids, max_new) if c is None else speculative(target, proposer, ids, c, max_new)
            if c is None:
                block["greedy_s"] = res["seconds"]
            else:
                block["spec_s"][c] = res["seconds"]
            if r == 0:
                first[c] = res
            elif res["tokens"] != first[c]["tokens"]:  # decoding is deterministic: a repeat must agree
                mismatches.append({"set": p["set"], "id": p["id"], "k": c, "repeat": r, "index":
                                   first_mismatch(first[c]["tokens"], res["tokens"]), "explained_by_tie": False,
                                   "why": "a repeat gave another output"})
        samples.append(block)
    return samples, first


def _lossless(p: dict, k: int, gr: dict, sp: dict, eps: float, mismatches: list[dict]) -> int | None:
    """Where the drafter's output at ``k`` first differs from greedy (None: identical), recorded in
    ``mismatches``, explained when either side's top-2 logits were within ``eps`` there."""
    j = first_mismatch(gr["tokens"], sp["tokens"])
    if j is not None:
        gm = gr["margins"][j] if j < len(gr["margins"]) else None
        sm = sp["margins"][j] if j < len(sp["margins"]) else None
        tie = any(m is not None and m < eps for m in (gm, sm))
        mismatches.append({"set": p["set"], "id": p["id"], "k": k, "index": j,
                           "greedy_token": gr["tokens"][j] if j < len(gr["tokens"]) else None,
                           "spec_token": sp["tokens"][j] if j < len(sp["tokens"]) else None,
                           "greedy_margin": gm, "spec_margin": sm, "explained_by_tie": tie})
        log.warning("prompt %s k=%d: output differs from greedy at token %d (%s)", p["id"], k, j,
                    "numerical tie" if tie else "NOT a tie")
    return j


def evaluate_speculative(drafter: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path,
                         threads: int | None = None, **opts) -> dict:
    """Real speculative decoding vs plain greedy on the same prompts, timed in paired, interleaved
    repeats; raises LosslessError (after writing speculative.failed.json) when an output differs
    from greedy without a logged tie."""
    o = hf_options(opts)
    if not o["hf_loop"]:
        return hf_loop_not_run("evaluate_speculative", out_dir, o, "speculative.json", ("speculative_rounds.parquet",))
    kind = {}
    if dflash_offline.is_dflash(drafter):
        ident, target, side, cfg, tok = dflash_offline.setup(drafter, identity, threads, o["stop_at_eos"],
                                                             o["chat_template"], target_load(o))
        proposer = DFlashProposer(side.model, side.embed, side.head)
        o = {**o, "k_values": block_k_values(o["k_values"], cfg.block_size - 1)}
        kind, layer_ids = {"kind": "dflash", "block_size": cfg.block_size}, list(cfg.target_layer_ids)
    elif p_eagle_offline.is_p_eagle(drafter):
        ident, target, side, cfg, tok = p_eagle_offline.setup(drafter, identity, threads, o["stop_at_eos"],
                                                              o["chat_template"], target_load(o))
        proposer = PEagleProposer(side.model, side.ids - torch.arange(len(side.ids)))  # d2t: target id − draft index
        o = {**o, "k_values": block_k_values(o["k_values"], side.K)}
        kind, layer_ids = {"kind": "p_eagle", "parallel_k": side.K}, list(cfg.layer_ids)
    else:
        ident, target, proposer, cfg, tok = setup(drafter, identity, threads, o["stop_at_eos"], o["chat_template"],
                                                   target_load(o))
        layer_ids = cfg.layer_ids
    max_new, eps, ks, repeats = o["max_new_tokens"], o["tie_eps"], o["k_values"], int(o["repeats"])
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                     o["chat_template_kwargs"], o.get("set_digests"))
    greedy(target, prompts[0]["prompt_ids"], 4)  # warm-up: first calls pay allocator/thread start-up
    target.times.clear()
    per_prompt, round_rows, mismatches, sampled_rounds = [], [], [], defaultdict(list)
    other = stats.OtherLoad().start()
    progress = Progress(log, "evaluate_speculative (timed HF loop)", len(prompts), "prompts")
    for i, p in enumerate(prompts):
        ids = p["prompt_ids"]
        samples, first = _timed_blocks(target, proposer, p, i, ks, repeats, max_new, mismatches)
        gr = first[None]
        row = {"set": p["set"], "domain": p["domain"], "id": p["id"], "prompt_tokens": len(ids),
               "greedy_tokens": len(gr["tokens"]),
               "greedy_seconds": statistics.median(s["greedy_s"] for s in samples), "samples": samples,
               "chain": {}, "k": {}}
        for k in ks:
            sp = first[k]
            j = _lossless(p, k, gr, sp, eps, mismatches)
            pairs = paired_speedups(samples, k)
            row["chain"][k] = prompt_chain(sp["rounds"])
            row["k"][k] = {"tau": rounds_tau(sp["rounds"]), "tokens": len(sp["tokens"]),
                           "seconds": statistics.median(s["spec_s"][k] for s in samples),
                           "speedup_samples": pairs, "speedup": statistics.median(pairs),
                           "identical": j is None, "rounds": len(sp["rounds"])}
            round_rows += [{"set": p["set"], "id": p["id"], "k": k, "g": g, "k_eff": ke, "accepted": a}
                           for g, ke, a in sp["rounds"]]
        per_prompt.append(row)
        log.info("speculative %d/%d %s: greedy %.1f tok/s; %s", i + 1, len(prompts), p["id"],
                 len(gr["tokens"]) / row["greedy_seconds"],
                 ", ".join(f"k={k} tau {row['k'][k]['tau'] or 1:.2f} x{row['k'][k]['speedup']:.2f} "
                           f"(paired {', '.join(f'{x:.2f}' for x in row['k'][k]['speedup_samples'])})" for k in ks))
        for temp in sampled_temperatures(o):
            view = _sampling_prompt(target, proposer, p, i, ks, repeats, max_new, temp, o["seed"], sampled_rounds)
            row.setdefault("sampling", {})[str(temp)] = view
            log.info("speculative %d/%d %s T=%g: plain %.1f tok/s; %s", i + 1, len(prompts), p["id"], temp,
                     view["greedy_tokens"] / view["greedy_seconds"],
                     ", ".join(f"k={k} tau {view['k'][k]['tau'] or 1:.2f} x{view['k'][k]['speedup']:.2f}"
                               for k in ks))
        progress.step()
    load = other.stop()
    if load["busy"]:
        log.warning("speculative: %s; the speedups are reported not conclusive", load["note"])
    costs = {"target_forward_s": {T: _median(v) for T, v in sorted(target.times.items())},
             "draft_step_s": _median(proposer.step_times)}
    costs["target_step_s"] = costs["target_forward_s"].get(1)
    unexplained = [m for m in mismatches if not m["explained_by_tie"]]
    res = {"stage": "evaluate_speculative", "drafter": str(drafter), "target": ident["name"],
           "target_digest": ident["digest"], "layer_ids": layer_ids, "options": o, **kind,
           "threads": torch.get_num_threads(), "prompts": len(prompts),
           "timing": {"repeats": repeats, "design": "paired, interleaved: per prompt and repeat one block of "
                      "greedy and every k back to back, order rotated; speedup sample = greedy s / spec s "
                      "of the same block; per prompt the median; figure = median over prompts with a "
                      f"{100 * o['confidence']:.0f}% bootstrap interval over prompts "
                      f"({stats.BOOTSTRAP_SAMPLES} resamples, seed {stats.SEED})",
                      "load": load},
           "sets": {s: _spec_stats([r for r in per_prompt if r["set"] == s], round_rows, ks, s, o, load)
                    for s in dict.fromkeys(p["set"] for p in prompts)},
           "overall": _spec_stats(per_prompt, round_rows, ks, None, o, load),
           "domains": domains(per_prompt, "chain", ks, o),
           "lossless": {"pass": not unexplained, "compared": len(prompts) * len(ks), "mismatches": mismatches,
                        "unexplained": len(unexplained), "tie_eps": eps},
           "step_costs": costs, "per_prompt": per_prompt}
    res["sampling"] = [_sampling_result(per_prompt, sampled_rounds[t], ks, t, o, load) for t in sampled_temperatures(o)]
    res["matrix"] = speculative_matrix(res, o)
    out = Path(out_dir)
    write_parquet(out / "speculative_rounds.parquet", frame(round_rows))
    if unexplained:
        write_json(out / "speculative.failed.json", res)
        raise LosslessError(f"speculative decoding is not lossless on {len(unexplained)} prompt/k pairs "
                            f"(details in {out / 'speculative.failed.json'})")
    (out / "speculative.failed.json").unlink(missing_ok=True)
    res[DIGESTS_KEY] = record_digests(out, ["speculative_rounds.parquet"])  # checked by eval_summary
    write_json(out / "speculative.json", res)
    log.info("speculative: %s", {k: (v["tau"], v["speedup_ci"]["note"]) for k, v in res["overall"]["k"].items()})
    return res


def _sampling_prompt(target, proposer, p: dict, i: int, ks: list[int], repeats: int, max_new: int, temp: float,
                     seed: int, round_rows: dict) -> dict:
    """One prompt at ``temp``: per repeat one block of plain sampling and speculative sampling at
    every k, the order rotated as greedy's (timing_order); each run seeded from (seed, T, prompt,
    configuration), the same in every repeat, so the repeats time the same texts. Returns the
    prompt's figures under the keys _spec_stats reads ("greedy" = the plain-sampling baseline);
    the first repeat's rounds go to ``round_rows[temp]``."""
    ids, samples, first = p["prompt_ids"], [], {}
    for r in range(repeats):
        order = timing_order([None] + ks, i, r)  # None = plain sampling
        block = {"repeat": r, "order": ["plain" if c is None else c for c in order], "spec_s": {}, "spec_tokens": {}}
        for c in order:
            gen = run_generator(seed, "speculative", temp, i, "plain" if c is None else c)
            res = sample(target, ids, max_new, temp, gen) if c is None else \
                speculative_sampling(target, proposer, ids, c, max_new, temp, gen)
            if c is None:
                block["plain_s"], block["plain_tokens"] = res["seconds"], len(res["tokens"])
            else:
                block["spec_s"][c], block["spec_tokens"][c] = res["seconds"], len(res["tokens"])
            if r == 0:
                first[c] = res
        samples.append(block)
    view = {"set": p["set"], "domain": p["domain"], "id": p["id"], "greedy_tokens": len(first[None]["tokens"]),
            "greedy_seconds": statistics.median(s["plain_s"] for s in samples), "samples": samples,
            "chain": {}, "k": {}}
    for k in ks:
        sp = first[k]
        # tokens/s of speculative over plain sampling in the same block: the texts differ in length
        pairs = [(s["spec_tokens"][k] / s["spec_s"][k]) / (s["plain_tokens"] / s["plain_s"]) for s in samples]
        view["chain"][k] = prompt_chain(sp["rounds"])
        view["k"][k] = {"tau": rounds_tau(sp["rounds"]), "tokens": len(sp["tokens"]),
                        "seconds": statistics.median(s["spec_s"][k] for s in samples),
                        "speedup_samples": pairs, "speedup": statistics.median(pairs), "rounds": len(sp["rounds"])}
        round_rows[temp] += [{"set": p["set"], "id": p["id"], "k": k, "g": g, "k_eff": ke, "accepted": a}
                             for g, ke, a in sp["rounds"]]
    return view


def _plain(figures: dict) -> dict:
    """_spec_stats' figures at T > 0: its greedy baseline is plain sampling, so named."""
    return {k.replace("greedy_", "plain_"): v for k, v in figures.items()}


def _sampling_result(per_prompt: list[dict], round_rows: list[dict], ks: list[int], temp: float, o: dict,
                     load: dict) -> dict:
    views = [r["sampling"][str(temp)] for r in per_prompt]
    return {"temperature": temp, "seed": o["seed"],
            "design": "plain sampling and speculative sampling at every k, seeded, in the greedy timing blocks' "
                      "design; speedup sample = speculative tokens/s / plain tokens/s of the same block; "
                      "tau = 1 + accepted / rounds of the first repeat",
            "lossless": "in distribution, by tests/engines/test_speculative_sampling.py (not checkable per run)",
            "sets": {s: _plain(_spec_stats([v for v in views if v["set"] == s], round_rows, ks, s, o, load))
                     for s in dict.fromkeys(v["set"] for v in views)},
            "overall": _plain(_spec_stats(views, round_rows, ks, None, o, load)),
            "domains": domains(views, "chain", ks, o)}


def speculative_matrix(res: dict, o: dict) -> list[dict]:
    """Matrix rows of the HF loop: τ measured at T = 0 and at each T > 0."""
    def block(r):
        return ({"prompts": r["overall"]["prompts"], "tau": {k: v["tau_ci"] for k, v in r["overall"]["k"].items()}},
                {s: {"prompts": v["prompts"], "tau": {k: x["tau_ci"] for k, x in v["k"].items()}}
                 for s, v in r["sets"].items()}, r["domains"])

    rows = stats.matrix_rows("hf_loop", 0.0, o["k_values"], *block(res))
    for smp in res["sampling"]:
        # the HF loop's sampling draws its drafts from q (eaglet.engines.hf_loop.speculative_sampling)
        rows += stats.matrix_rows("hf_loop", smp["temperature"], o["k_values"], *block(smp), rule="probabilistic")
    return rows


class LosslessError(RuntimeError):
    """Speculative output differs from plain greedy where no numerical tie explains it."""


def _spec_stats(rows: list[dict], round_rows: list[dict], ks: list[int], set_name: str | None, o: dict,
                load: dict | None = None) -> dict:
    """Per k: τ and the speedup (median over prompts of each prompt's median paired speedup), each
    with its interval over prompts; tokens/s from the median seconds of every prompt. A speedup
    timed on a busy machine (``load``: eaglet.eval.stats.OtherLoad) is not conclusive, whatever its
    interval."""
    g_tok, g_s = sum(r["greedy_tokens"] for r in rows), sum(r["greedy_seconds"] for r in rows)
    out = {"prompts": len(rows), "greedy_tokens": g_tok, "greedy_seconds": round(g_s, 3),
           "greedy_tok_s": g_tok / g_s if g_s else None, "k": {}}
    for k in ks:
        rr = [(x["g"], x["k_eff"], x["accepted"]) for x in round_rows
              if x["k"] == k and (set_name is None or x["set"] == set_name)]
        s_tok, s_s = sum(r["k"][k]["tokens"] for r in rows), sum(r["k"][k]["seconds"] for r in rows)
        reach = [sum(1 for r in rr if r[1] > j) for j in range(k)]
        sp = stats.busy_verdict(stats.speedup_interval([r["k"][k]["speedup"] for r in rows],
                                                       o["confidence"], o["max_relative_width"]),
                                load or {})
        out["k"][k] = {"tau": rounds_tau(rr), "tau_se": tau_se(rr), "rounds": len(rr), "tokens": s_tok,
                       "tau_ci": stats.tau_interval([tuple(r["chain"][k]) for r in rows], o["confidence"],
                                                    o["max_relative_width"]),
                       "seconds": round(s_s, 3), "tok_s": s_tok / s_s if s_s else None,
                       "speedup": sp["estimate"], "speedup_ci": sp,
                       "accept_rate_per_pos": [sum(1 for r in rr if r[1] > j and r[2] > j) / reach[j]
                                               if reach[j] else None for j in range(k)]}
    return out



def main(argv: list[str] | None = None) -> None:
    try:
        run(evaluate_speculative, parser(__doc__).parse_args(argv))
    except LosslessError as e:
        log.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
