"""Stage export for ``drafter.kind: dflash``: the trained DFlash drafter (eaglet.train.dflash_train) as the
directory vLLM serves with method dflash (eaglet.export.dflash_format), proven by its contract before
it appears; the same outputs as the EAGLE-3 export (config.json, model.safetensors, reference.json,
contract.json last; a failure leaves contract.failed.json and the CLI exits nonzero).

    python -m eaglet.export.dflash_export --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --out results/RUN/drafter \
        [--train-summary ...] [--work-dir DIR] [--config '{"vllm_check": true, ...}'] [--log LOG]

The contract's checks (eaglet.export.contract.record: pass, FAIL or not run with its reason):
  dflash.static     the directory as vLLM reads it (eaglet.export.dflash_format.dflash_static_check)
  dflash.parity     vLLM's own DFlashQwen3ForCausalLM, loaded from the directory, computes the trained
                    drafter's round piece by piece (eaglet.export.contract.dflash_parity)
  vllm.lossless     served by real vLLM with method dflash at k = block_size − 1 and T = 0, the output
                    equals plain greedy's on the contract's prompts
  vllm.acceptance   vLLM's acceptance counters equal eaglet's exact block chain along vLLM's own plain
                    output (eaglet.drafter.dflash.block_chain_along, the trained weights)
  vllm.known_answer a DFlash drafter with the trained taps, mask token, block size and shapes, built so
                    that its first draft is right, on a twin of the target
                    (eaglet.export.dflash_known_answer), written by the same writer and served
                    by vLLM: ~every first draft accepted (run first, in the same runner process; not run
                    with the reason for targets no twin can be built for)
The four engine checks run with export.vllm_check (else not run). EAGLE-3's ``loader.sglang`` does not
apply to this kind (SGLang's loader is not run on a DFlash directory by eaglet): it is reported not run
with the reason, so a config must name it in export.accept_not_run. Not run is no pass.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import read_json, write_json
from eaglet.engines import vllm_env
from eaglet.export import kind_cli
from eaglet.export.contract.dflash_parity import DFLASH_NOT_APPLICABLE, DFLASH_VLLM_CHECKS
from eaglet.export.contract.known_answer import Pending
from eaglet.export.contract.record import KNOWN_ANSWER, check, not_run, verdict
from eaglet.export.contract.vllm_checks import check_prompts, run_vllm_batch
from eaglet.export.dflash_format import dflash_static_check, export_dflash
from eaglet.target.load import load_identity, vllm_runner_args

log = logging.getLogger("eaglet.export.dflash_export")
TARGET_KEYS = ("serving", "target_load")
OUTPUTS = ("config.json", "model.safetensors", "reference.json", "contract.json")
# EAGLE-3's checks with no DFlash counterpart in eaglet, each with why (named in export.accept_not_run)
NOT_FOR_DFLASH = {
    DFLASH_NOT_APPLICABLE[0]: "SGLang's loader is not run on a DFlash directory by eaglet (vLLM serves it, "
                              "dflash.parity checks vLLM's own module)",
}


class ContractError(RuntimeError):
    """The DFlash export failed its contract; the report says which checks."""


def served_checks(drafter_dir: Path, model, identity: dict, *, python, work_dir: Path, n_prompts: int,
                  max_tokens: int, serving: dict | None, before: Pending | None = None) -> tuple[list[dict], dict]:
    """vllm.lossless and vllm.acceptance: plain and dflash runs in one vLLM process; the chain along
    vLLM's plain output with the trained weights and the target's own taps (in-process HF target).
    ``before``: vllm.known_answer's pending run (eaglet.export.dflash_known_answer), run first in
    the same process where its serving is the target's (else in its own), its check first in the list."""
    import torch

    from eaglet.drafter.dflash import block_chain_along
    from eaglet.engines import hf_loop
    from eaglet.target.load import load_model

    k = model.cfg.block_size - 1
    prompts = check_prompts(n_prompts)
    runs = [{"tag": "spec", "target": identity["path"], "drafter": str(drafter_dir), "k": k, "max_tokens": max_tokens},
            {"tag": "plain", "target": identity["path"], "drafter": None, "k": k, "max_tokens": max_tokens + k - 1,
             "needs": "spec"}]
    head = []
    if before is not None:
        if before.prompts != prompts:
            raise ValueError("the check run first must use the contract's prompts")
        if vllm_runner_args(before.serving) == vllm_runner_args(serving):
            res = run_vllm_batch([before.run, *runs], prompts, work_dir=work_dir, python=python, serving=serving)
        else:  # another serving (the twin on one device beside a tensor-parallel target): its own process
            res = run_vllm_batch([before.run], prompts, work_dir=work_dir, python=python, serving=before.serving)
            res.update(run_vllm_batch(runs, prompts, work_dir=work_dir, python=python, serving=serving))
        head = [before.finish(res[before.run["tag"]])]
    else:
        res = run_vllm_batch(runs, prompts, work_dir=work_dir, python=python, serving=serving)
    spec, plain = res["spec"], res["plain"]
    if spec.get("rc") != 0 or plain.get("rc") != 0:
        err = spec.get("engine_error") or spec.get("log_tail") or plain.get("engine_error") or plain.get("log_tail")
        bad = check("vllm.lossless", False, {"error": f"vLLM run failed: {err}", "method": "dflash"})
        return head + [bad, not_run("vllm.acceptance", "vLLM did not serve the drafter")], {}
    same = spec["token_ids"] == [t[:max_tokens] for t in plain["token_ids"]]
    out = head + [check("vllm.lossless", same, {"prompts": len(prompts), "k": k, "method": "dflash",
                                                "tokens": sum(map(len, spec["token_ids"]))})]
    target = load_model(identity["path"])
    tap = hf_loop.Target(target, list(model.cfg.target_layer_ids), set())
    embed = target.get_input_embeddings().weight.detach().float()
    head = target.get_output_embeddings().weight.detach().float()
    want = {"drafts": 0, "accepted_per_pos": [0] * k}
    with torch.no_grad():
        for p, cont in zip(spec["prompt_token_ids"], plain["token_ids"]):
            x = list(p) + list(cont)
            _, aux = tap.forward(x[:-1], tap.new_cache())
            c = block_chain_along(model, aux.reshape(len(x) - 1, -1), x, len(p), max_tokens, embed, head)["counts"]
            want = {"drafts": want["drafts"] + c["drafts"],
                    "accepted_per_pos": [a + b for a, b in zip(want["accepted_per_pos"], c["accepted_per_pos"])]}
    sd = spec["spec_decode"]
    got = {"drafts": int(sd["num_drafts"]), "accepted_per_pos": [int(v) for v in sd["num_accepted_tokens_per_pos"]]}
    ok = got == want and int(sd["num_draft_tokens"]) == want["drafts"] * k
    tau = 1 + sum(want["accepted_per_pos"]) / max(want["drafts"], 1)
    out.append(check("vllm.acceptance", ok, {"vllm": got, "chain": want, "k": k, "tau": tau,
                                             "draft_tokens": int(sd["num_draft_tokens"])}))
    return out, {"counts": want, "tau": tau, "prompts": prompts, "max_tokens": max_tokens}


def export(drafter_path: str | Path, out_dir: str | Path, identity_path: str | Path, *,
           work_dir: str | Path | None = None, vllm_python: str | None = None, **opts) -> dict:
    """Write and check the DFlash directory; return the contract report. Raises ContractError
    (after writing contract.failed.json) when a check fails or one not run is not accepted."""
    import torch

    from eaglet.drafter.dflash import load_dflash
    from eaglet.export import dflash_known_answer
    from eaglet.export.contract.dflash_parity import dflash_parity_checks

    o = {key: None for key in TARGET_KEYS} | schema.settings("export", opts, "export", extra=TARGET_KEYS)
    identity = load_identity(identity_path)
    identity["path"] = str(Path(identity["path"]).resolve())
    model, cfg = load_dflash(drafter_path)
    if cfg.target_digest and cfg.target_digest != identity["digest"]:
        raise ArtifactError(f"{drafter_path}: trained for target {cfg.target_digest[:12]}, "
                            f"identity says {identity['digest'][:12]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS + ("contract.failed.json",):
        (out / name).unlink(missing_ok=True)
    work = Path(work_dir) if work_dir else out.parent / f"{out.name}.check"
    stage = out / ".staging"
    shutil.rmtree(stage, ignore_errors=True)
    export_dflash(stage, model.state_dict(), cfg, read_json(Path(identity["path"]) / "config.json"))
    checks = [dflash_static_check(stage, cfg.num_target_layers)]
    chain = {}
    if not o["vllm_check"]:
        why = "export.vllm_check is false"
        checks += [not_run(n, why) for n in DFLASH_VLLM_CHECKS]
    elif checks[0]["ok"] is not True:
        checks += [not_run(n, "dflash.static failed") for n in DFLASH_VLLM_CHECKS]
    else:
        try:
            py = vllm_env.vllm_python(vllm_python)
        except vllm_env.VllmEnvMissing as e:
            py = None
            checks += [check(n, False, {"error": f"vLLM environment not found or incomplete: {e}"})
                       for n in ("dflash.parity", KNOWN_ANSWER, "vllm.lossless")]
            checks += [not_run("vllm.acceptance", "no vLLM")]
        if py is not None:
            from eaglet.target.load import load_model

            target = load_model(identity["path"])
            embed = target.get_input_embeddings().weight.detach().float()
            head = target.get_output_embeddings().weight.detach().float()
            del target
            checks += dflash_parity_checks([(stage, model)], embed, head, python=py, work_dir=work / "parity")
            known = dflash_known_answer.pending_check(identity, cfg, work_dir=work / "known_answer", python=py,
                                                      n_prompts=o["vllm_check_prompts"],
                                                      max_tokens=o["vllm_check_max_tokens"], serving=o["serving"])
            pending = known if isinstance(known, Pending) else None
            with torch.no_grad():
                served, chain = served_checks(stage, model, identity, python=py, work_dir=work / "vllm",
                                              n_prompts=o["vllm_check_prompts"],
                                              max_tokens=o["vllm_check_max_tokens"], serving=o["serving"],
                                              before=pending)
            checks += ([] if pending else [known]) + served
    checks += [not_run(n, why) for n, why in NOT_FOR_DFLASH.items()]
    report = {"kind": "dflash", "checks": checks, **verdict(checks, list(o["accept_not_run"])),
              "method": vllm_env.drafter_method(stage), "num_speculative_tokens": cfg.block_size - 1,
              "drafter_dir": str(out), "vllm_tau": chain.get("tau")}
    if not report["ok"]:
        write_json(out / "contract.failed.json", report)
        shutil.rmtree(stage, ignore_errors=True)
        raise ContractError(f"{out}: DFlash export failed its contract: failed {report['failed']}, not run and "
                            f"not named in export.accept_not_run {report['not_run_unaccepted']} "
                            f"(details in {out / 'contract.failed.json'})")
    # what the directory proves alone: the served chain's counters (or why none was recorded)
    write_json(stage / "reference.json", {"kind": "dflash", "chain": chain or None,
                                          "chain_not_recorded": None if chain else "the served checks did not run"})
    for name in ("config.json", "model.safetensors", "reference.json"):
        (stage / name).replace(out / name)
    shutil.rmtree(stage)
    report[DIGESTS_KEY] = record_digests(out, ["config.json", "model.safetensors", "reference.json"])
    write_json(out / "contract.json", report)  # last: its presence means a complete, checked export
    return report


def main(argv: list[str] | None = None) -> None:
    kind_cli.main(argv, doc=__doc__, drafter="a DFlash drafter", export=export, error=ContractError, log=log,
                  done=lambda out, rep: (f"DFlash export {out}: contract passed (method {rep['method']}, k "
                                   f"{rep['num_speculative_tokens']}), {len(rep['not_run'])} check(s) not run by "
                                   "export.accept_not_run"))


if __name__ == "__main__":
    main()
