"""One vLLM (CPU) generation run, plain or with an EAGLE-3 drafter, for the export contract check.

Run by the vLLM environment's interpreter, not eaglet's: it imports only the standard library and
vllm (eaglet's venv has a different torch/transformers). eaglet.export.contract starts it once for
the export's runs (the known-answer twin with its drafter, the target with the drafter, the target
plain: eaglet.export.contract.vllm_checks.run_vllm_batch), a fresh ``LLM`` for each run, and compares
their JSON results. One process for the runs saves the interpreter start and the vLLM import of
each further run; a run that raises ends the process, and eaglet starts the runs after it afresh.

On one device (tensor parallel size 1) vLLM's engine core runs inside this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the environment says otherwise): the check compares token
ids and counters, which do not depend on where the core runs (identical on SmolLM2 both ways), and
each LLM starts without two more interpreters importing vLLM (SmolLM2 on 2 CPU cores: 59 -> 26 s
with the drafter, 52 -> 25 s plain). The timed evaluation (vllm_eval_runner) and the server keep
vLLM's own processes, as a deployment runs them.

    envs/vllm/.venv/bin/python src/eaglet/engines/vllm_check_runner.py --target MODEL_DIR \
        --prompts prompts.json --max-tokens 32 --out spec.json [--drafter DRAFTER_DIR --k 3]
        [--more '[{"out": "plain.json", "drafter": null, "target": DIR, "max_tokens": 34, "k": 3}, ...]']
        # more runs after the first, a fresh LLM each; a key left out is the flags' value
        [--dtype float32] [--tensor-parallel-size 1] [--enable-expert-parallel] [--trust-remote-code]

The serving flags are ``target.vllm`` and ``target.trust_remote_code`` (eaglet.target.load.vllm_runner_args);
the defaults are the vLLM-CPU ones.

Each run's log section starts with the line ``eaglet-runner: start OUT``.
Output JSON: {"vllm_version", "seconds", "token_ids": [[...] per prompt], "prompt_token_ids": [[...] per prompt],
              "texts": [...],
              "spec_decode": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                              "num_accepted_tokens_per_pos"}, "metrics": [every spec_decode metric]}
"""

import argparse
import json
import os

try:  # in vLLM's interpreter: copied beside this file (eaglet.engines.vllm_env.copy_runner)
    from vllm_env import add_serving_args, metric_samples, spec_decode_counters
    from vllm_env import engine_kwargs as _engine_kwargs
except ImportError:  # imported as part of eaglet (tests of the argument building)
    from eaglet.engines.vllm_env import add_serving_args, metric_samples, spec_decode_counters
    from eaglet.engines.vllm_env import engine_kwargs as _engine_kwargs


def _metric_json(m):
    out = {"name": m.name, "type": type(m).__name__, "labels": dict(getattr(m, "labels", {}) or {})}
    for attr in ("value", "values", "count", "sum"):
        if hasattr(m, attr):
            v = getattr(m, attr)
            out[attr] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def engine_kwargs(a, drafter=None):
    """``vllm.LLM`` keyword arguments (eaglet.engines.vllm_env.engine_kwargs), 8 sequences at a time; a
    drafter folder whose config.json says ``parallel_drafting: true`` (a P-EAGLE export,
    eaglet.export.p_eagle_format) is served with that flag in the speculative config (vLLM takes it only
    there). Here, not in vllm_env, so that only the export stage's code changed with the P-EAGLE kind."""
    kw = _engine_kwargs(a, drafter, max_num_seqs=8)
    if drafter and drafter_parallel(drafter):
        kw["speculative_config"]["parallel_drafting"] = True
    return kw


def drafter_parallel(drafter) -> bool:
    """Whether the drafter folder's config.json says ``parallel_drafting: true``."""
    try:
        with open(os.path.join(drafter, "config.json")) as f:
            return json.load(f).get("parallel_drafting") is True
    except (OSError, ValueError, AttributeError):
        return False


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", required=True)
    p.add_argument("--more", default=None,
                   help="JSON list of runs after the first, each {out, and any of drafter (null: plain), target, "
                        "max_tokens, k; else the flags'}, each with a fresh LLM in this process (saves the "
                        "interpreter start and vLLM import per run)")
    add_serving_args(p)
    return p.parse_args(argv)


def main():
    a = parse_args()
    if a.tensor_parallel_size == 1:  # read when vllm is imported (in run)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(a.prompts) as fh:
        prompts = json.load(fh)
    for more in [{}] + json.loads(a.more or "[]"):
        run(argparse.Namespace(**{**vars(a), **more}), prompts)


def run(a, prompts):
    import gc
    import time

    import vllm
    from vllm import LLM, SamplingParams

    print(f"eaglet-runner: start {a.out}", flush=True)
    t0 = time.monotonic()
    llm = LLM(**engine_kwargs(a, a.drafter))
    # ignore_eos: every prompt runs to max_tokens, so both runs compare the same number of tokens
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    got = llm.get_metrics()
    metrics = [_metric_json(m) for m in got if "spec_decode" in m.name]
    sd = spec_decode_counters(metric_samples(got))  # summed over engines
    res = {"vllm_version": vllm.__version__, "seconds": round(time.monotonic() - t0, 1),
           "token_ids": [list(o.outputs[0].token_ids) for o in outs],
           "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
           "texts": [o.outputs[0].text for o in outs], "spec_decode": sd, "metrics": metrics}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh)
    os.replace(tmp, a.out)
    print(f"eaglet-runner: done {a.out}", flush=True)
    llm.llm_engine.engine_core.shutdown()  # workers and their memory go before the next LLM
    del llm
    gc.collect()


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
