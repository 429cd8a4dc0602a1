"""What the HF-loop stages (evaluate_offline, evaluate_speculative, evaluate_modes) share: their
command line, the seeded generator of every sampling run, τ over prompts with intervals per k and
per domain, and their outputs when the HF loop does not run.

Conventions. The drafter at position t reads g_t = fc(aux_t) and the token x_{t+1} (vLLM's);
aux id j = HF ``hidden_states[j]`` (residual stream entering layer j). A round starts when the
target has emitted g tokens after the prompt; with k drafts it may accept at most
``min(k, max_new - g - 1)`` (never past max_new_tokens), and stops at EOS: the offline simulator and
the real loop use the same rule, so their accepted counts agree token for token. The drafter stays
on the CPU in fp32; the target's logits and aux states come back as fp32 CPU tensors.

``hf_loop`` false (eaglet.eval.options) runs none of the stages: each writes its JSON with ``status:
not run`` and ``hf_loop_reason``, empty Parquet files, and logs the reason first; eval_summary shows
the HF-loop figures as not run, never as a pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
from pathlib import Path

from eaglet.base.digests import DIGESTS_KEY, record_digests, verify_recorded
from eaglet.base.files import write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.engines.hf_loop import generator
from eaglet.eval import stats
from eaglet.eval.options import hf_options

NOT_RUN = "not run"


def run_generator(seed: int, *parts):
    """A generator for one sampling run, seeded from the run's seed and what identifies the run
    (stage, T, prompt, configuration): independent streams, the same ones on every rerun."""
    digest = hashlib.sha256(json.dumps([seed, *parts]).encode()).digest()
    return generator(int.from_bytes(digest[:8], "little") >> 1)


def tau_se(rounds) -> float | None:
    """Standard error of τ over the rounds with drafts (the noise of a τ estimate)."""
    xs = [r[2] for r in rounds if r[1] > 0]
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None


def tau_ci(per_prompt: list[dict], key: str, ks: list[int], o: dict) -> dict:
    """τ at each k with its interval over the prompts; ``per_prompt[i][key][k]`` = prompt_chain."""
    return {k: stats.tau_interval([tuple(p[key][k]) for p in per_prompt], o["confidence"],
                                  o["max_relative_width"]) for k in ks}


def domains(per_prompt: list[dict], key: str, ks: list[int], o: dict) -> dict:
    """τ per domain (MT-Bench category, HumanEval, math, held-out) with intervals over prompts."""
    out = {}
    for d in dict.fromkeys(p["domain"] for p in per_prompt):
        rows = [p for p in per_prompt if p["domain"] == d]
        out[d] = {"set": rows[0]["set"], "prompts": len(rows), "tau": tau_ci(rows, key, ks, o)}
    return out


def frame(rows):
    import pandas as pd

    return pd.DataFrame(rows)


def not_run_reason(stage: str, o: dict) -> str:
    """Why the HF loop does not run, logged first by the stage's own logger."""
    why = o["hf_loop_reason"] or "evaluate.hf_loop: false"
    logging.getLogger(f"eaglet.eval.{stage}").warning("HF loop not run (%s): %s", stage, why)
    return why


def hf_loop_not_run(stage: str, out_dir: str | Path, o: dict, json_name: str, parquets: tuple[str, ...]) -> dict:
    """The stage's outputs when the HF loop is off: its JSON says ``status: not run`` with the reason
    (eval_summary reports it as such), its Parquet files are empty. The target is never loaded."""
    why = not_run_reason(stage, o)
    res = {"stage": stage, "status": NOT_RUN, "hf_loop_reason": why, "options": o, "per_prompt": [],
           "sampling": [], "matrix": []}
    out = Path(out_dir)
    for name in parquets:
        write_parquet(out / name, frame([]))
    res[DIGESTS_KEY] = record_digests(out, list(parquets))  # checked by eval_summary
    write_json(out / json_name, res)
    return res


# --------------------------------------------------------------------------- command line
def parser(doc: str) -> argparse.ArgumentParser:
    """The command line of an HF-loop stage (workflow/rules/eval.smk), described by its docstring."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="train/drafter.safetensors")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--sets", default='["mtbench"]', help="JSON list: mtbench, humaneval, *.parquet")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(hf_options({})))
    p.add_argument("--out-dir", required=True)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--log", default=None)
    return p


def run(stage, a: argparse.Namespace, **kw):
    """``stage`` on the parsed command line, the drafter checked against train's record first."""
    setup_logging(a.log)
    verify_recorded(a.drafter, Path(a.drafter).with_name("train_summary.json"))  # train's record
    return stage(a.drafter, a.identity, parse_json_arg(a.sets), a.out_dir, threads=a.threads, **kw,
                 **parse_json_arg(a.config, {}))
