"""Evaluate a trained drafter on the HF target: an exact offline acceptance simulator and a real
speculative decoding loop with a lossless check (docs/eagle3.md §7).

    python -m eaglet.eval.evaluate offline --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --sets '["mtbench"]' \
        --config '{"num_prompts": 10, "max_new_tokens": 128, "k_values": [1, 2, 3, 4, 5]}' \
        --out-dir results/RUN/eval [--threads 2] [--log LOG]
    python -m eaglet.eval.evaluate speculative ... (same flags)
    python -m eaglet.eval.evaluate modes ... --modes '{"thinking": {"enable_thinking": true}, ...}'

offline      greedy continuation of every prompt with the target (KV cache), capturing the aux
             hidden states at the drafter's layer ids; from every verified position the drafter
             drafts K = max(k_values) tokens (its own hidden states and tokens after step 0, as
             serving does) and the accepted prefix is counted. Writes offline.json (τ for every
             k from every position, per-position acceptance, and the chain replay: exactly what the
             real loop accepts) and offline_positions.parquet / offline_rounds.parquet.
speculative  the real loop: draft k, verify k+1 positions in one target forward, accept the longest
             matching prefix + the bonus token, roll back both KV caches. Per prompt it also runs
             plain greedy by the same code: tokens/s, speedup, and the lossless check (output ==
             greedy token for token; a mismatch fails unless the target's top-2 logits were within
             tie_eps there). Writes speculative.json and speculative_rounds.parquet.

Timing is paired and interleaved: for each prompt and each of ``repeats`` repeats, plain greedy
and every k run back to back (one block; the order rotates from repeat to repeat and prompt to
prompt, so no configuration always runs first or last), and a speedup sample is greedy seconds /
speculative seconds of the same block. A background job that slows a few seconds then slows both
sides of a pair. Per prompt the median of its samples; the figure is the median over prompts with
a seeded bootstrap interval over prompts (eaglet.eval.stats), and ``conclusive: false`` with a
sentence when the interval spans 1.0 or is wider than ``max_relative_width`` times the estimate.
τ gets the same interval over prompts, per set and per domain (MT-Bench category, HumanEval, ...).

Temperatures (``temperatures``, default [0.0, 1.0]; docs/eagle3.md §13). T = 0 is always evaluated
as above: the exact greedy chain and the token-for-token lossless check; those figures keep their
places in both JSON files. Each T > 0 adds an entry to the list ``sampling``:
offline      along the target's own sampled text at T (seeded, eaglet.engines.hf_loop.expected_prompt),
             from every verified position the expected acceptance α = Σ min(p, q) of each draft
             position; expected τ per k, per draft position, per set and domain with intervals.
speculative  plain sampling and speculative sampling at every k, timed in the same paired,
             interleaved, rotated blocks as greedy (the same repeats, one OtherLoad over all of
             them); τ measured = 1 + accepted / rounds; a speedup sample is the ratio of the two
             sides' tokens/s in one block (sampled texts differ in length). Losslessness at T > 0 is
             a property of the distribution, proven by tests/engines/test_speculative_sampling.py,
             not by one run. Every random draw is seeded from ``seed``, the stage, T, the prompt and
             the configuration, so a rerun gives the same texts.
modes        the offline figures once per chat-template mode (``evaluate.modes``: keyword arguments
             over the served ones, e.g. Qwen3's enable_thinking on and off); writes modes.json.
Both stages also write ``matrix``: one row per engine, T, k, set and domain (eaglet.eval.stats.matrix_rows)
that eval_summary concatenates with vLLM's.

Conventions. The drafter at position t reads g_t = fc(aux_t) and the token x_{t+1} (vLLM's);
aux id j = HF ``hidden_states[j]`` (residual stream entering layer j). A round starts when the
target has emitted g tokens after the prompt; with k drafts it may accept at most
``min(k, max_new - g - 1)`` (never past max_new_tokens), and stops at EOS: both loops use the same
rule, so their accepted counts agree token for token.

Where the HF target runs: ``dtype`` (``target.dtype``), ``device`` (``target.device``: cuda when the
job has a GPU) and ``trust_remote_code`` come from the target section, as in extract. The drafter
stays on the CPU in fp32; the target's logits and aux states come back as fp32 CPU tensors.
``hf_loop`` false (``evaluate.hf_loop``, decided at parse time by eaglet.planner.plan.hf_loop: a target served
over several GPUs or bigger than one) runs neither stage: each writes its JSON with ``status: not
run`` and ``hf_loop_reason``, empty Parquet files, and logs the reason first; eval_summary shows the
HF-loop figures as not run, never as a pass.

Shape suffixes: T tokens, V target vocab, H target hidden, 3 the three aux layers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from eaglet.base import datasets
from eaglet.base.digests import DIGESTS_KEY, record_digests, verify_recorded
from eaglet.base.files import write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.drafter.chain import (
    chain_counts,
    chain_replay,
    expected_counts,
    expected_position_rates,
    expected_tau,
    position_rates,
    prompt_chain,
    rounds_tau,
    tau_all_positions,
)
from eaglet.engines.hf_loop import (
    expected_prompt,
    generator,
    greedy,
    offline_prompt,
    sample,
    setup,
    speculative,
    speculative_sampling,
)
from eaglet.eval import stats as eval_stats

log = logging.getLogger("eaglet.eval.evaluate")

# Sized for the default run (SmolLM2-135M on 2 CPU cores): a few minutes in all.
DEFAULTS = dict(num_prompts=10, max_new_tokens=128, k_values=[1, 2, 3, 4, 5], tie_eps=1e-5,
                stop_at_eos=True, max_prompt_tokens=1024, chat_template=None, chat_template_kwargs={}, repeats=3,
                confidence=0.95,
                max_relative_width=0.5, hf_loop=True, hf_loop_reason=None, dtype="float32", device="auto",
                trust_remote_code=False, temperatures=[0.0, 1.0], seed=0)
NOT_RUN = "not run"


def _options(opts: dict) -> dict:
    o = {**DEFAULTS, **{k: v for k, v in opts.items() if v is not None}}
    unknown = set(o) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"evaluate: unknown options {sorted(unknown)}")
    o["k_values"] = sorted({int(k) for k in o["k_values"]})
    if not o["k_values"] or o["k_values"][0] < 1:
        raise ValueError(f"evaluate.k_values must be >= 1, got {o['k_values']}")
    if o["max_new_tokens"] < 2:
        raise ValueError("evaluate.max_new_tokens must be >= 2 (one round needs a draft)")
    if int(o["repeats"]) < 1:
        raise ValueError(f"evaluate.repeats must be >= 1, got {o['repeats']}")
    if not 0 < o["confidence"] < 1:
        raise ValueError(f"evaluate.confidence must be in (0, 1), got {o['confidence']}")
    o["temperatures"] = sorted({float(t) for t in o["temperatures"]})
    if any(t < 0 for t in o["temperatures"]):
        raise ValueError(f"evaluate.temperatures must be >= 0, got {o['temperatures']}")
    return o


def sampled_temperatures(o: dict) -> list[float]:
    """The temperatures that add sampling figures; T = 0 (greedy) is always evaluated."""
    return [t for t in o["temperatures"] if t > 0]


def run_generator(seed: int, *parts):
    """A generator for one sampling run, seeded from the run's seed and what identifies the run
    (stage, T, prompt, configuration): independent streams, the same ones on every rerun."""
    digest = hashlib.sha256(json.dumps([seed, *parts]).encode()).digest()
    return generator(int.from_bytes(digest[:8], "little") >> 1)


def _median(xs):
    return statistics.median(xs) if xs else None


def _se(rounds) -> float | None:
    """Standard error of τ over the rounds with drafts (the noise of a τ estimate)."""
    xs = [r[2] for r in rounds if r[1] > 0]
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None


# --------------------------------------------------------------------------- offline
def _tau_ci(per_prompt: list[dict], key: str, ks: list[int], o: dict) -> dict:
    """τ at each k with its interval over the prompts; ``per_prompt[i][key][k]`` = prompt_chain."""
    return {k: eval_stats.tau_interval([tuple(p[key][k]) for p in per_prompt], o["confidence"],
                                       o["max_relative_width"]) for k in ks}


def _domains(per_prompt: list[dict], key: str, ks: list[int], o: dict) -> dict:
    """τ per domain (MT-Bench category, HumanEval, math, held-out) with intervals over prompts."""
    out = {}
    for d in dict.fromkeys(p["domain"] for p in per_prompt):
        rows = [p for p in per_prompt if p["domain"] == d]
        out[d] = {"set": rows[0]["set"], "prompts": len(rows), "tau": _tau_ci(rows, key, ks, o)}
    return out


def _offline_stats(starts: list[dict], rounds_by_k: dict, K: int) -> dict:
    acc, valid = [s["accepted"] for s in starts], [s["valid"] for s in starts]
    return {"starts": len(starts),
            "tau": {k: tau_all_positions(acc, valid, k) for k in range(1, K + 1)},
            "tau_chain": {k: rounds_tau(r) for k, r in rounds_by_k.items()},
            "tau_chain_se": {k: _se(r) for k, r in rounds_by_k.items()},
            "rounds": {k: len(r) for k, r in rounds_by_k.items()},
            "chain_per_pos": {k: chain_counts(r) for k, r in rounds_by_k.items()},
            **position_rates(acc, valid, K)}


def _load_opts(o: dict) -> dict:
    return {k: o[k] for k in ("dtype", "device", "trust_remote_code")}


def hf_loop_not_run(stage: str, out_dir: str | Path, o: dict, json_name: str, parquets: tuple[str, ...]) -> dict:
    """The stage's outputs when the HF loop is off: its JSON says ``status: not run`` with the reason
    (eval_summary reports it as such), its Parquet files are empty. The target is never loaded."""
    why = o["hf_loop_reason"] or "evaluate.hf_loop: false"
    log.warning("HF loop not run (%s): %s", stage, why)
    res = {"stage": stage, "status": NOT_RUN, "hf_loop_reason": why, "options": o, "per_prompt": [],
           "sampling": [], "matrix": []}
    out = Path(out_dir)
    for name in parquets:
        write_parquet(out / name, _frame([]))
    res[DIGESTS_KEY] = record_digests(out, list(parquets))  # checked by eval_summary
    write_json(out / json_name, res)
    return res


def evaluate_offline(drafter: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path,
                     threads: int | None = None, **opts) -> dict:
    o = _options(opts)
    if not o["hf_loop"]:
        return hf_loop_not_run("evaluate_offline", out_dir, o, "offline.json",
                               ("offline_positions.parquet", "offline_rounds.parquet"))
    ident, target, proposer, cfg, tok = setup(drafter, identity, threads, o["stop_at_eos"], o["chat_template"],
                                               _load_opts(o))
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                    o["chat_template_kwargs"])
    res, pos_rows, round_rows = offline_results(target, proposer, prompts, o)
    res = {"stage": "evaluate_offline", "drafter": str(drafter), "target": ident["name"],
           "target_digest": ident["digest"], "layer_ids": cfg.layer_ids, "draft_vocab_size": cfg.draft_vocab_size,
           "options": o, "sets_requested": sets, **res}
    out = Path(out_dir)
    write_parquet(out / "offline_positions.parquet", _frame(pos_rows))
    write_parquet(out / "offline_rounds.parquet", _frame(round_rows))
    # checked by eval_summary (digests.verify_recorded)
    res[DIGESTS_KEY] = record_digests(out, ["offline_positions.parquet", "offline_rounds.parquet"])
    write_json(out / "offline.json", res)
    log.info("offline: tau %s (all positions), chain %s", res["overall"]["tau"], res["overall"]["tau_chain"])
    for smp in res["sampling"]:
        log.info("offline T=%g: expected tau %s", smp["temperature"], smp["overall"]["tau"])
    return res


def offline_results(target, proposer, prompts: list[dict], o: dict) -> tuple[dict, list[dict], list[dict]]:
    """The offline figures of ``prompts`` (tokenised as ``o`` renders them): the exact greedy chain
    at T = 0, the expected chain at each T > 0, and their matrix rows; with the per-position and
    per-round rows (offline_positions / offline_rounds.parquet)."""
    K, max_new, eps = max(o["k_values"]), o["max_new_tokens"], o["tie_eps"]
    t0 = time.time()
    pos_rows, round_rows, per_set = [], [], defaultdict(lambda: {"starts": [], "rounds": defaultdict(list)})
    target_ties, per_prompt = 0, []
    for i, p in enumerate(prompts):
        r = offline_prompt(target, proposer, p["prompt_ids"], K, max_new)
        row = {"set": p["set"], "domain": p["domain"], "id": p["id"], "prompt_tokens": len(p["prompt_ids"]),
               "tokens": r["tokens"], "chain": {}}  # the greedy continuation, for evaluate_vllm
        per_prompt.append(row)
        target_ties += sum(m < eps for m in r["target_margins"])
        for s in r["starts"]:
            pos_rows.append({"set": p["set"], "id": p["id"], **s})
        accepted = [0] + [s["accepted"] for s in r["starts"]]
        for k in o["k_values"]:
            rr = chain_replay(accepted, len(r["tokens"]), max_new, k)
            row["chain"][k] = prompt_chain(rr)
            per_set[p["set"]]["rounds"][k] += rr
            round_rows += [{"set": p["set"], "id": p["id"], "k": k, "g": g, "k_eff": ke, "accepted": a}
                           for g, ke, a in rr]
        per_set[p["set"]]["starts"] += r["starts"]
        log.info("offline %d/%d %s %s: %d tokens, tau(k=%d) %.2f", i + 1, len(prompts), p["set"], p["id"],
                 len(r["tokens"]), min(3, K), tau_all_positions([s["accepted"] for s in r["starts"]],
                                                                [s["valid"] for s in r["starts"]], min(3, K)) or 1)
    all_starts = [s for v in per_set.values() for s in v["starts"]]
    all_rounds = {k: [x for v in per_set.values() for x in v["rounds"][k]] for k in o["k_values"]}
    res = {"K": K, "prompts": len(prompts), "new_tokens": len(all_starts) + len(prompts),
           "sets": {name: {"prompts": sum(p["set"] == name for p in prompts),
                           **_offline_stats(v["starts"], v["rounds"], K),
                           "tau_chain_ci": _tau_ci([q for q in per_prompt if q["set"] == name], "chain",
                                                   o["k_values"], o)}
                    for name, v in per_set.items()},
           "overall": {**_offline_stats(all_starts, all_rounds, K),
                       "tau_chain_ci": _tau_ci(per_prompt, "chain", o["k_values"], o)},
           "domains": _domains(per_prompt, "chain", o["k_values"], o),
           "ties": {"tie_eps": eps, "target_near_ties": target_ties,
                    "drafter_near_ties": sum(s["drafter_margin"] < eps for s in all_starts)},
           "seconds": round(time.time() - t0, 2), "per_prompt": per_prompt}
    res["sampling"] = [offline_sampling(target, proposer, prompts, per_prompt, K, max_new, t, o)
                       for t in sampled_temperatures(o)]
    res["matrix"] = offline_matrix(res, o)
    return res, pos_rows, round_rows


def evaluate_modes(drafter: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path,
                   modes: dict[str, dict], threads: int | None = None, **opts) -> dict:
    """The offline figures (exact chain at T = 0, expected chain at T > 0) once per chat-template
    mode: each mode's keyword arguments over the served ones (``chat_template_kwargs``), e.g.
    Qwen3's ``enable_thinking`` true and false. A drafter trained in one mode can collapse in the
    other, so each mode is measured on the same prompts rendered its way. Two modes whose renders
    of every prompt are identical are refused: the template ignores the switch. Writes modes.json."""
    o = _options(opts)
    out = Path(out_dir) / "modes.json"
    if not modes or any(not isinstance(v, dict) for v in modes.values()):
        raise ValueError(f"evaluate.modes: a mapping mode name -> chat template keyword arguments, got {modes!r}")
    if not o["hf_loop"]:
        why = o["hf_loop_reason"] or "evaluate.hf_loop: false"
        log.warning("HF loop not run (evaluate_modes): %s", why)
        res = {"stage": "evaluate_modes", "status": NOT_RUN, "hf_loop_reason": why, "options": o,
               "modes": {m: {"chat_template_kwargs": {**o["chat_template_kwargs"], **kw}} for m, kw in modes.items()},
               "matrix": []}
        write_json(out, res)
        return res
    ident, target, proposer, cfg, tok = setup(drafter, identity, threads, o["stop_at_eos"], o["chat_template"],
                                               _load_opts(o))
    rendered, per_mode, matrix = {}, {}, []
    for name, kw in modes.items():
        mo = {**o, "chat_template_kwargs": {**o["chat_template_kwargs"], **kw}}
        prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                        mo["chat_template_kwargs"])
        ids = [tuple(p["prompt_ids"]) for p in prompts]
        same = [m for m, other in rendered.items() if other == ids]
        if same:
            raise ValueError(f"evaluate.modes: modes {same[0]!r} and {name!r} render every prompt identically: "
                             f"the chat template ignores {kw}")
        rendered[name] = ids
        log.info("mode %s (%s): %d prompts", name, mo["chat_template_kwargs"], len(prompts))
        res, _, _ = offline_results(target, proposer, prompts, mo)
        per_mode[name] = {
            "chat_template_kwargs": mo["chat_template_kwargs"], "prompts": res["prompts"],
            "new_tokens": res["new_tokens"],
            # what the generation prompt ends with in this mode (e.g. Qwen3's pre-filled empty think block)
            "prompt_tail": tok.decode(list(ids[0][-16:])),
            "tau_chain": res["overall"]["tau_chain"],
            "expected": {str(smp["temperature"]): smp["overall"]["tau"] for smp in res["sampling"]},
            "seconds": res["seconds"] + sum(smp["seconds"] for smp in res["sampling"])}
        matrix += [{**r, "mode": name} for r in res["matrix"]]
        log.info("mode %s: chain tau %s; expected %s", name, per_mode[name]["tau_chain"], per_mode[name]["expected"])
    res = {"stage": "evaluate_modes", "drafter": str(drafter), "target": ident["name"],
           "target_digest": ident["digest"], "options": o, "sets_requested": sets, "modes": per_mode,
           "matrix": matrix}
    write_json(out, res)
    return res


def _expected_stats(starts: list[dict], K: int) -> dict:
    alphas, valid = [s["alpha"] for s in starts], [s["valid"] for s in starts]
    return {"starts": len(starts), "tau": {k: expected_tau(alphas, valid, k) for k in range(1, K + 1)},
            **expected_position_rates(alphas, valid, K)}


def offline_sampling(target, proposer, prompts: list[dict], per_prompt: list[dict], K: int, max_new: int,
                     temp: float, o: dict, texts: list[list[int]] | None = None) -> dict:
    """Expected acceptance at ``temp`` along each prompt's sampled text; the text and the per-prompt
    (Σ expected accepted, starts) go into ``per_prompt[i]["sampling"][str(temp)]``. ``texts``: one
    continuation (token ids) per prompt produced elsewhere (e.g. vLLM's at ``temp``) instead of the
    target's own seeded samples."""
    rows, starts = [], defaultdict(list)
    t0 = time.time()
    for i, p in enumerate(prompts):
        e = expected_prompt(target, proposer, p["prompt_ids"], K, temp, max_new,
                            run_generator(o["seed"], "offline", temp, i), tokens=texts[i] if texts else None)
        alphas, valid = [s["alpha"] for s in e["starts"]], [s["valid"] for s in e["starts"]]
        exp = {k: list(expected_counts(alphas, valid, k)) for k in range(1, K + 1)}
        per_prompt[i].setdefault("sampling", {})[str(temp)] = {"tokens": e["tokens"], "expected": exp}
        rows.append({"set": p["set"], "domain": p["domain"], "expected": exp})
        starts[p["set"]] += e["starts"]
    ks = o["k_values"]
    return {"temperature": temp, "seed": o["seed"], "text": "given" if texts else "sampled by the target, seeded",
            "estimate": "expected acceptance along the text: alpha = sum_x min(p(x), q(x)), "
                        "expected accepted at k = sum_{j<k} prod_{i<=j} alpha_i, tau = 1 + mean over starts",
            "sets": {s: {"prompts": sum(r["set"] == s for r in rows), **_expected_stats(v, K),
                         "tau_ci": _tau_ci([r for r in rows if r["set"] == s], "expected", ks, o)}
                     for s, v in starts.items()},
            "overall": {"prompts": len(rows), **_expected_stats([x for v in starts.values() for x in v], K),
                        "tau_ci": _tau_ci(rows, "expected", ks, o)},
            "domains": _domains(rows, "expected", ks, o), "seconds": round(time.time() - t0, 2)}


def offline_matrix(res: dict, o: dict) -> list[dict]:
    """Matrix rows of the offline stage: the exact chain at T = 0, the expected chain at each T > 0."""
    ks = o["k_values"]
    rows = eval_stats.matrix_rows(
        "chain", 0.0, ks, {"prompts": res["prompts"], "tau": res["overall"]["tau_chain_ci"]},
        {s: {"prompts": v["prompts"], "tau": v["tau_chain_ci"]} for s, v in res["sets"].items()}, res["domains"])
    for smp in res["sampling"]:
        rows += eval_stats.matrix_rows(
            "expected", smp["temperature"], ks, {"prompts": smp["overall"]["prompts"], "tau": smp["overall"]["tau_ci"]},
            {s: {"prompts": v["prompts"], "tau": v["tau_ci"]} for s, v in smp["sets"].items()}, smp["domains"])
    return rows


def _frame(rows):
    import pandas as pd

    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- speculative
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
    o = _options(opts)
    if not o["hf_loop"]:
        return hf_loop_not_run("evaluate_speculative", out_dir, o, "speculative.json", ("speculative_rounds.parquet",))
    ident, target, proposer, cfg, tok = setup(drafter, identity, threads, o["stop_at_eos"], o["chat_template"],
                                               _load_opts(o))
    max_new, eps, ks, repeats = o["max_new_tokens"], o["tie_eps"], o["k_values"], int(o["repeats"])
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                    o["chat_template_kwargs"])
    greedy(target, prompts[0]["prompt_ids"], 4)  # warm-up: first calls pay allocator/thread start-up
    target.times.clear()
    per_prompt, round_rows, mismatches, sampled_rounds = [], [], [], defaultdict(list)
    other = eval_stats.OtherLoad().start()
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
    load = other.stop()
    if load["busy"]:
        log.warning("speculative: %s; the speedups are reported not conclusive", load["note"])
    costs = {"target_forward_s": {T: _median(v) for T, v in sorted(target.times.items())},
             "draft_step_s": _median(proposer.step_times)}
    costs["target_step_s"] = costs["target_forward_s"].get(1)
    unexplained = [m for m in mismatches if not m["explained_by_tie"]]
    res = {"stage": "evaluate_speculative", "drafter": str(drafter), "target": ident["name"],
           "target_digest": ident["digest"], "layer_ids": cfg.layer_ids, "options": o,
           "threads": torch.get_num_threads(), "prompts": len(prompts),
           "timing": {"repeats": repeats, "design": "paired, interleaved: per prompt and repeat one block of "
                      "greedy and every k back to back, order rotated; speedup sample = greedy s / spec s "
                      "of the same block; per prompt the median; figure = median over prompts with a "
                      f"{100 * o['confidence']:.0f}% bootstrap interval over prompts "
                      f"({eval_stats.BOOTSTRAP_SAMPLES} resamples, seed {eval_stats.SEED})",
                      "load": load},
           "sets": {s: _spec_stats([r for r in per_prompt if r["set"] == s], round_rows, ks, s, o, load)
                    for s in dict.fromkeys(p["set"] for p in prompts)},
           "overall": _spec_stats(per_prompt, round_rows, ks, None, o, load),
           "domains": _domains(per_prompt, "chain", ks, o),
           "lossless": {"pass": not unexplained, "compared": len(prompts) * len(ks), "mismatches": mismatches,
                        "unexplained": len(unexplained), "tie_eps": eps},
           "step_costs": costs, "per_prompt": per_prompt}
    res["sampling"] = [_sampling_result(per_prompt, sampled_rounds[t], ks, t, o, load) for t in sampled_temperatures(o)]
    res["matrix"] = speculative_matrix(res, o)
    out = Path(out_dir)
    write_parquet(out / "speculative_rounds.parquet", _frame(round_rows))
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


def _plain(stats: dict) -> dict:
    """_spec_stats' figures at T > 0: its greedy baseline is plain sampling, so named."""
    return {k.replace("greedy_", "plain_"): v for k, v in stats.items()}


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
            "domains": _domains(views, "chain", ks, o)}


def speculative_matrix(res: dict, o: dict) -> list[dict]:
    """Matrix rows of the HF loop: τ measured at T = 0 and at each T > 0."""
    def block(r):
        return ({"prompts": r["overall"]["prompts"], "tau": {k: v["tau_ci"] for k, v in r["overall"]["k"].items()}},
                {s: {"prompts": v["prompts"], "tau": {k: x["tau_ci"] for k, x in v["k"].items()}}
                 for s, v in r["sets"].items()}, r["domains"])

    rows = eval_stats.matrix_rows("hf_loop", 0.0, o["k_values"], *block(res))
    for smp in res["sampling"]:
        rows += eval_stats.matrix_rows("hf_loop", smp["temperature"], o["k_values"], *block(smp))
    return rows


class LosslessError(RuntimeError):
    """Speculative output differs from plain greedy where no numerical tie explains it."""


def _spec_stats(rows: list[dict], round_rows: list[dict], ks: list[int], set_name: str | None, o: dict,
                load: dict | None = None) -> dict:
    """Per k: τ and the speedup (median over prompts of each prompt's median paired speedup), each
    with its interval over prompts; tokens/s from the median seconds of every prompt. A speedup
    timed on a busy machine (``load``: eval_stats.OtherLoad) is not conclusive, whatever its interval."""
    g_tok, g_s = sum(r["greedy_tokens"] for r in rows), sum(r["greedy_seconds"] for r in rows)
    out = {"prompts": len(rows), "greedy_tokens": g_tok, "greedy_seconds": round(g_s, 3),
           "greedy_tok_s": g_tok / g_s if g_s else None, "k": {}}
    for k in ks:
        rr = [(x["g"], x["k_eff"], x["accepted"]) for x in round_rows
              if x["k"] == k and (set_name is None or x["set"] == set_name)]
        s_tok, s_s = sum(r["k"][k]["tokens"] for r in rows), sum(r["k"][k]["seconds"] for r in rows)
        reach = [sum(1 for r in rr if r[1] > j) for j in range(k)]
        sp = eval_stats.busy_verdict(eval_stats.speedup_interval([r["k"][k]["speedup"] for r in rows],
                                                                 o["confidence"], o["max_relative_width"]),
                                     load or {})
        out["k"][k] = {"tau": rounds_tau(rr), "tau_se": _se(rr), "rounds": len(rr), "tokens": s_tok,
                       "tau_ci": eval_stats.tau_interval([tuple(r["chain"][k]) for r in rows], o["confidence"],
                                                         o["max_relative_width"]),
                       "seconds": round(s_s, 3), "tok_s": s_tok / s_s if s_s else None,
                       "speedup": sp["estimate"], "speedup_ci": sp,
                       "accept_rate_per_pos": [sum(1 for r in rr if r[1] > j and r[2] > j) / reach[j]
                                               if reach[j] else None for j in range(k)]}
    return out


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["offline", "speculative", "modes"])
    p.add_argument("--drafter", required=True, help="train/drafter.safetensors")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--sets", default='["mtbench"]', help="JSON list: mtbench, humaneval, *.parquet")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(DEFAULTS))
    p.add_argument("--out-dir", required=True)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--modes", default=None,
                   help="modes: JSON object, mode name -> chat template keyword arguments (evaluate.modes)")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    if a.mode == "modes" and not a.modes:
        p.error("modes needs --modes")
    setup_logging(a.log)
    fn = {"offline": evaluate_offline, "speculative": evaluate_speculative, "modes": evaluate_modes}[a.mode]
    modes = {"modes": parse_json_arg(a.modes)} if a.mode == "modes" else {}
    verify_recorded(a.drafter, Path(a.drafter).with_name("train_summary.json"))  # train's record
    try:
        fn(a.drafter, a.identity, parse_json_arg(a.sets), a.out_dir, threads=a.threads, **modes,
           **parse_json_arg(a.config, {}))
    except LosslessError as e:
        log.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
