"""One timed vLLM (CPU) run over the evaluation prompts, plain or with an EAGLE-3 drafter.

Run by the vLLM environment's interpreter (standard library + vllm only; eaglet's venv has another
torch/transformers), one process per configuration: vLLM spawns workers and keeps global state.
eaglet.eval.evaluate_vllm writes the input, starts this, and reads the output.

    envs/vllm/.venv/bin/python vllm_eval_runner.py --target MODEL_DIR --input in.json --out out.json \
        [--drafter DRAFTER_DIR --k 3] [--max-num-seqs 1] [--max-model-len 2048] \
        [--dtype float32] [--tensor-parallel-size 1] [--enable-expert-parallel] [--trust-remote-code]

The serving flags are ``target.vllm`` and ``target.trust_remote_code`` (eaglet.target.load.vllm_runner_args):
the same values every vLLM engine of the run uses; the defaults are the vLLM-CPU ones.

Input JSON: {"sets": {name: [[prompt token ids], ...]}, "max_tokens": int, "ignore_eos": bool}.
Output JSON: {"vllm_version", "startup_s", "sets": {name: {"token_ids", "seconds", "output_tokens",
"spec_decode": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
"num_accepted_tokens_per_pos"}}}}; counters are deltas over that set's generate call only.
"""

import argparse
import json
import os
import time

try:  # in vLLM's interpreter: copied beside this file (eaglet.engines.vllm_env.copy_runner)
    from vllm_env import add_serving_args, engine_kwargs, metric_samples, spec_decode_counters
except ImportError:  # imported as part of eaglet (tests of the argument building)
    from eaglet.engines.vllm_env import add_serving_args, engine_kwargs, metric_samples, spec_decode_counters

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def spec_counters(llm):
    """Spec-decode counters summed over engines; per-position as a list."""
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--input", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    add_serving_args(p)
    return p.parse_args(argv)


def main():
    a = parse_args()
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    with open(a.input) as fh:
        spec = json.load(fh)
    llm = LLM(**engine_kwargs(a, a.drafter))
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=spec.get("ignore_eos", False),
                        stop_token_ids=spec.get("stop_token_ids") or None)
    first = next(iter(spec["sets"].values()))[0]
    # warm-up: the first requests pay for allocations; not part of the timing
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    res = {"vllm_version": vllm.__version__, "startup_s": round(time.perf_counter() - t0, 2), "sets": {}}
    for name, prompts in spec["sets"].items():
        before = spec_counters(llm)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sp, use_tqdm=False)
        secs = time.perf_counter() - t
        ids = [list(o.outputs[0].token_ids) for o in outs]
        res["sets"][name] = {"token_ids": ids, "seconds": secs, "output_tokens": sum(map(len, ids)),
                             "spec_decode": delta(spec_counters(llm), before)}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh)
    os.replace(tmp, a.out)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
