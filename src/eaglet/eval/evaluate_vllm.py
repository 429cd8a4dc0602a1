"""Serve the evaluation prompts with vLLM (the CPU build here), with and without the exported
drafter: vLLM's own acceptance length and per-position acceptance, output tokens/s, and whether the
outputs match plain decoding at temperature 0 (docs/eagle3.md §9).

    python -m eaglet.eval.evaluate_vllm --drafter-dir results/RUN/drafter \
        --identity resources/targets/NAME/identity.json --sets '["mtbench"]' \
        --config '{"num_prompts": 10, "max_new_tokens": 128, "k_values": [3], "iomp": true}' \
        --out-dir results/RUN/eval --work-dir logs/RUN/evaluate_vllm \
        [--offline results/RUN/eval/offline.json] [--log LOG]

One vLLM process per configuration (plain, then the drafter at each k), each timed after a
warm-up and with ``max_num_seqs`` 1 by default (one request at a time, like the HF loop). vLLM's
CPU docs recommend Intel OpenMP in LD_PRELOAD; when ``iomp`` is on and the vLLM venv has
``libiomp5.so``, plain and the first k also run with it. Writes ``vllm.json``; vLLM's logs stay in
the work dir.

With ``--offline`` (the rule always gives it), vLLM's acceptance is tested against eaglet's exact
offline chain replay on the same prompts (the stage refuses an offline.json made on other prompts),
and a difference beyond the sampling error of that many drafts FAILS the stage (``vllm.failed.json``
and an error with both numbers): the signature of a layer-id, ``d2t``, norm or format slip. The
test, per set, k and draft position j: accepted / drafted at j in vLLM (``num_accepted_tokens_per_pos``
/ ``num_drafts``) against the chain replay's rounds (accepted at j / rounds that drafted j), a
two-proportion z-test with pooled variance; it fails when |z| exceeds the two-sided critical value
at family-wise level ``agreement_alpha`` (default 0.001) with a Bonferroni correction over all the
positions tested. Treating the two as independent samples is lenient where they share prompts
(identical continuations give near-identical counts), so a failure is a real discrepancy. When the
HF loop did not run (offline.json ``status: not run``: a target served over several GPUs), there is
nothing to test against: ``offline_agreement`` is null and ``hf_loop`` holds the reason.

``serving`` (``target.vllm`` + ``target.trust_remote_code``, eaglet.target.load.serving) is how every
vLLM run serves the target: dtype, tensor and expert parallelism on the job's GPUs, remote code.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
from pathlib import Path

from eaglet.base import datasets as eval_sets
from eaglet.base import io
from eaglet.engines import vllm_env
from eaglet.eval import stats as eval_stats
from eaglet.target.load import load_identity, load_tokenizer, stop_ids, vllm_runner_args

log = logging.getLogger("eaglet.eval.evaluate_vllm")

RUNNER = Path(vllm_env.__file__).with_name("vllm_eval_runner.py")  # engine-side, copied and run in its venv
DEFAULTS = dict(num_prompts=10, max_new_tokens=128, k_values=[3], iomp=True, max_num_seqs=1,
                kv_cache_gb=2, timeout_s=1800, env="envs/vllm/.venv", stop_at_eos=True,
                max_prompt_tokens=1024, agreement_alpha=0.001, chat_template=None, chat_template_kwargs={},
                serving=None)


class VllmError(RuntimeError):
    """A vLLM run failed; the message holds its log tail."""


class AgreementError(VllmError):
    """vLLM's acceptance differs from the offline chain replay beyond sampling error."""


def iomp_library(py: Path) -> Path | None:
    lib = py.parent.parent / "lib" / "libiomp5.so"
    return lib if lib.exists() else None


def run_one(py: Path, target_dir: str, prompts_file: Path, work: Path, tag: str, *, drafter: str | None,
            k: int | None, iomp: Path | None, o: dict, max_model_len: int) -> dict:
    out, logf = work / f"{tag}.json", work / f"{tag}.log"
    runner = vllm_env.copy_runner(RUNNER, work)
    cmd = [str(py), str(runner), "--target", str(Path(target_dir).resolve()), "--input", str(prompts_file),
           "--out", str(out), "--max-num-seqs", str(o["max_num_seqs"]), "--max-model-len", str(max_model_len)]
    cmd += vllm_runner_args(o["serving"])
    if drafter:
        cmd += ["--drafter", str(Path(drafter).resolve()), "--k", str(k)]
    env = vllm_env.process_env(work, py, VLLM_CPU_KVCACHE_SPACE=str(o["kv_cache_gb"]))
    env.pop("LD_PRELOAD", None)
    if iomp:
        env["LD_PRELOAD"] = str(iomp)
    out.unlink(missing_ok=True)
    log.info("vLLM run %s: %s", tag, " ".join(cmd))
    t0 = time.time()
    with open(logf, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=work,
                                timeout=vllm_env.timeout(o["timeout_s"])).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not out.exists():
        raise VllmError(f"vLLM run {tag} failed (rc {rc}); log {logf}:\n"
                        f"{logf.read_text(errors='replace')[-3000:]}")
    res = json.loads(out.read_text())
    res.update(tag=tag, k=k, iomp=bool(iomp), wall_s=round(time.time() - t0, 1), log=str(logf))
    return res


def _spec_stats(sd: dict, k: int) -> dict:
    drafts = sd.get("num_drafts", 0)
    per_pos = list(sd.get("num_accepted_tokens_per_pos") or [])[:k]
    return {"tau": 1 + sd["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_rate": sd["num_accepted_tokens"] / sd["num_draft_tokens"] if sd.get("num_draft_tokens")
            else None,
            "accept_rate_per_pos": [c / drafts for c in per_pos] if drafts else None, **sd}


def summarise(runs: list[dict], offline: dict | None, o: dict) -> dict:
    """Per run and set: tok/s; for drafter runs τ, per-position acceptance, lossless vs plain,
    speedup vs plain (same LD_PRELOAD), and the test against the offline chain replay."""
    plain = {r["iomp"]: r for r in runs if r["k"] is None}
    out, lossless = [], True
    for r in runs:
        row = {"tag": r["tag"], "k": r["k"], "iomp": r["iomp"], "startup_s": r["startup_s"], "sets": {}}
        base = plain.get(r["iomp"])
        for name, s in r["sets"].items():
            st = {"seconds": round(s["seconds"], 3), "output_tokens": s["output_tokens"],
                  "tok_s": s["output_tokens"] / s["seconds"] if s["seconds"] else None}
            if r["k"] is not None:
                st.update(_spec_stats(s["spec_decode"], r["k"]))
                b = base["sets"][name] if base else None
                if b:
                    diff = [i for i, (x, y) in enumerate(zip(b["token_ids"], s["token_ids"])) if x != y]
                    st["lossless"] = not diff
                    st["differing_prompts"] = diff
                    st["speedup"] = b["seconds"] / s["seconds"] if s["seconds"] else None
                    lossless &= not diff
            row["sets"][name] = st
        out.append(row)
    agreement = offline_agreement(out, offline, o["agreement_alpha"])
    return {"runs": out, "lossless": lossless, "offline_agreement": agreement,
            "disagreements": [t["message"] for t in (agreement or {}).get("tests", []) if not t["ok"]],
            "hf_greedy_agreement": _hf_agreement(plain.get(False), offline)}


def _hf_agreement(plain: dict | None, offline: dict | None) -> dict | None:
    """vLLM plain output vs the HF greedy continuation (offline.json) prompt by prompt: both fp32,
    so they differ only after a near-tie; informative, not a failure."""
    if not plain or not offline or "per_prompt" not in offline:
        return None
    hf = {}
    for p in offline["per_prompt"]:
        hf.setdefault(p["set"], []).append(p["tokens"])
    same, first = 0, []
    n = 0
    for name, s in plain["sets"].items():
        for a, b in zip(s["token_ids"], hf.get(name, [])):
            n += 1
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            same += i is None and len(a) == len(b)
            if i is not None:
                first.append(i)
    return {"prompts": n, "identical": same, "first_difference_at": first}


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
    z_crit = eval_stats.z_critical(alpha, len(pairs))
    tests = []
    for r, name, st, ref, j, acc in pairs:
        n1, a2, n2 = st["num_drafts"], ref["accepted_per_pos"][j], ref["drafted_per_pos"][j]
        z = eval_stats.two_proportion_z(acc, n1, a2, n2)
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


def evaluate_vllm(drafter_dir: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path, *,
                  work_dir: str | Path, offline: str | Path | None = None, **opts) -> dict:
    o = {**DEFAULTS, **{k: v for k, v in opts.items() if v is not None}}
    unknown = set(o) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"evaluate.vllm: unknown options {sorted(unknown)}")
    ks = sorted({int(k) for k in o["k_values"]})
    try:
        py = vllm_env.vllm_python(o["env"])
    except vllm_env.VllmEnvMissing as e:
        raise VllmError(f"{e} (or set evaluate.vllm.enabled: false)") from None
    ident = load_identity(identity)
    conf = io.read_json(Path(drafter_dir) / "config.json")  # a clear error when the export is missing
    tok = load_tokenizer(ident["path"], o["chat_template"], need_template=True,
                         trust_remote_code=bool((o["serving"] or {}).get("trust_remote_code")))
    prompts = eval_sets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                     o["chat_template_kwargs"])
    off = io.read_json(offline) if offline else None
    hf_loop = None
    if off and off.get("status") == "not run":  # nothing to compare with; said, not passed
        hf_loop = f"not run: {off.get('hf_loop_reason')}"
        log.warning("offline agreement not tested: the HF loop was %s", hf_loop)
        off = None
    if off:
        same_prompts(prompts, off)
    by_set: dict[str, list] = {}
    for p in prompts:
        by_set.setdefault(p["set"], []).append(p["prompt_ids"])
    work = Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps({"sets": by_set, "max_tokens": o["max_new_tokens"],
                                 "ignore_eos": not o["stop_at_eos"],
                                 # the HF loop's stops: the template's turn-end marker as well as EOS
                                 "stop_token_ids": sorted(stop_ids(tok)) if o["stop_at_eos"] else []}))
    max_len = max(len(p["prompt_ids"]) for p in prompts) + o["max_new_tokens"] + max(ks) + 16
    iomp = iomp_library(py) if o["iomp"] else None
    common = dict(o=o, max_model_len=max_len)
    plan = [("plain", None, None, None)] + [(f"k{k}", drafter_dir, k, None) for k in ks]
    if iomp:
        plan += [("plain_iomp", None, None, iomp), (f"k{ks[0]}_iomp", drafter_dir, ks[0], iomp)]
    t0 = time.time()
    runs = [run_one(py, ident["path"], pfile, work, tag, drafter=d, k=k, iomp=lib, **common)
            for tag, d, k, lib in plan]
    res = {"stage": "evaluate_vllm", "vllm_version": runs[0]["vllm_version"], "drafter_dir": str(drafter_dir),
           "layer_ids": conf.get("eagle_aux_hidden_state_layer_ids"), "target": ident["name"],
           "target_digest": ident["digest"], "options": {**o, "k_values": ks}, "hf_loop": hf_loop or "run",
           "prompts": {s: len(v) for s, v in by_set.items()},
           "iomp": {"requested": bool(o["iomp"]), "library": str(iomp) if iomp else None,
                    "note": None if iomp or not o["iomp"] else f"libiomp5.so not found in {py.parent.parent}/lib"},
           **summarise(runs, off, o), "seconds": round(time.time() - t0, 1)}
    return finish(res, out_dir)


def finish(res: dict, out_dir: str | Path) -> dict:
    """Write vllm.json, or vllm.failed.json and raise AgreementError when vLLM's acceptance
    differs from the offline chain replay beyond sampling error."""
    out = Path(out_dir)
    if res["disagreements"]:
        io.write_json(out / "vllm.failed.json", res)
        (out / "vllm.json").unlink(missing_ok=True)
        raise AgreementError("vLLM's acceptance differs from eaglet's offline chain replay beyond sampling error ("
                             f"{res['offline_agreement']['test']}):\n  " + "\n  ".join(res["disagreements"])
                             + f"\n(details in {out / 'vllm.failed.json'})")
    (out / "vllm.failed.json").unlink(missing_ok=True)
    io.write_json(out / "vllm.json", res)
    if not res["lossless"]:
        log.warning("vLLM with the drafter does not reproduce plain vLLM output at temperature 0")
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter-dir", required=True, help="the exported drafter folder (config.json + weights)")
    p.add_argument("--identity", required=True)
    p.add_argument("--sets", default='["mtbench"]', help="JSON list: mtbench, humaneval, *.parquet")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(DEFAULTS))
    p.add_argument("--out-dir", required=True)
    p.add_argument("--work-dir", required=True, help="vLLM logs and caches")
    p.add_argument("--offline", default=None, help="offline.json, to compare τ")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    io.setup_logging(a.log)
    for name in ("config.json", "model.safetensors"):  # the export's record
        io.verify_recorded(Path(a.drafter_dir) / name, Path(a.drafter_dir) / "contract.json")
    try:
        evaluate_vllm(a.drafter_dir, a.identity, io.parse_json_arg(a.sets), a.out_dir, work_dir=a.work_dir,
                      offline=a.offline, **io.parse_json_arg(a.config, {}))
    except VllmError as e:
        log.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
