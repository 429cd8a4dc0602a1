"""Stage export for ``drafter.kind: p_eagle``: the trained P-EAGLE drafter (eaglet.train.p_eagle_train) as
the directory vLLM serves with ``{"method": "eagle3", "parallel_drafting": true}``
(eaglet.export.p_eagle_format), proven by its contract before it appears; the same outputs as the
EAGLE-3 export (config.json, model.safetensors, reference.json, contract.json last; a failure leaves
contract.failed.json and the CLI exits nonzero).

    python -m eaglet.export.p_eagle_export --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --out results/RUN/drafter \
        [--train-summary ...] [--work-dir DIR] [--config '{"vllm_check": true, ...}'] [--log LOG]

The contract's checks (eaglet.export.contract.record: pass, FAIL or not run with its reason):
  static.*          EAGLE-3's static checks of format A over the P-EAGLE tensor set (config fields, key
                    set, shapes and dtypes, vocabulary map, layer ids) and p_eagle.static (mask_hidden
                    present and [3 H_t], mask_token_id in the vocabulary, parallel_drafting, K)
  p_eagle.parity    vLLM's own Eagle3LlamaForCausalLM with parallel drafting, loaded from the directory,
                    computes the trained drafter's parallel round piece by piece (fc, fc(mask_hidden),
                    the embedded ids with the mask token vLLM's proposer reads, the layer, the norm,
                    the K slots' logits and drafts; the aux layers it taps):
                    eaglet.export.contract.p_eagle_parity
  vllm.known_answer EAGLE-3's known-answer drafter for a twin of the target (eaglet.export.contract.known_answer),
                    with the trained layer ids, made a P-EAGLE folder (mask_hidden 0, the trained mask
                    token, K slots) and served with parallel drafting: the output is the twin's known
                    chain and every first draft is accepted (slot 1 of vLLM's round is EAGLE-3's step)
  vllm.lossless     served by real vLLM with parallel drafting at num_speculative_tokens = K and T = 0,
                    the output equals plain greedy's on the contract's prompts
  vllm.acceptance   vLLM's acceptance counters equal eaglet's exact parallel chain along vLLM's own plain
                    output (eaglet.drafter.p_eagle.PEagleDrafter.parallel_chain_along, trained weights)
  vllm.aux_layers   vLLM tapped the trained aux layers (its log)
The engine checks (P_EAGLE_VLLM_CHECKS) run with export.vllm_check (else not run). EAGLE-3's checks with
no P-EAGLE counterpart, reported not run with the reason (so a config names them in
export.accept_not_run): P_EAGLE_NOT_BUILT (SGLang's loader).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import read_json, write_json
from eaglet.base.tensors import load_tensors
from eaglet.engines import vllm_env
from eaglet.export import kind_cli
from eaglet.export.contract import known_answer
from eaglet.export.contract.record import check, not_run, verdict
from eaglet.export.contract.vllm_checks import check_prompts, run_vllm_batch
from eaglet.export.p_eagle_format import (
    P_EAGLE_NOT_BUILT,
    P_EAGLE_VLLM_CHECKS,
    as_p_eagle,
    export_p_eagle,
    p_eagle_static_checks,
)
from eaglet.target.load import load_identity, vllm_runner_args

log = logging.getLogger("eaglet.export.p_eagle_export")
TARGET_KEYS = ("serving", "target_load")
OUTPUTS = ("config.json", "model.safetensors", "reference.json", "contract.json")


class ContractError(RuntimeError):
    """The P-EAGLE export failed its contract; the report says which checks."""


def known_answer_pending(identity: dict, cfg, *, python, work_dir: Path, n_prompts: int, max_tokens: int,
                         serving: dict | None):
    """``vllm.known_answer`` for the kind up to its engine run: EAGLE-3's known-answer drafter built for a
    twin of the target with the trained layer ids (known_answer.pending_check), rewritten as a P-EAGLE
    folder (as_p_eagle: the trained mask token, K slots) and run with parallel drafting at K. The check
    itself (not run, or failed) when it cannot run."""
    k = int(cfg.parallel_k)
    p = known_answer.pending_check(identity, list(cfg.layer_ids), work_dir=work_dir, python=python, k=k,
                                   n_prompts=n_prompts, max_tokens=max_tokens, serving=serving)
    if isinstance(p, dict):
        return p
    try:
        d = as_p_eagle(p.run["drafter"], Path(p.run["drafter"]).with_name("drafter_p_eagle"),
                       mask_token_id=cfg.mask_token_id, k=k)
    except (OSError, ValueError, ArtifactError) as e:
        return check("vllm.known_answer", False, {"error": f"the P-EAGLE known answer: {type(e).__name__}: {e}"})

    def finish(spec: dict) -> dict:
        out = p.finish(spec)
        out["details"].update(drafter_dir=str(d), parallel_drafting=True)
        return out

    return dataclasses.replace(p, run={**p.run, "drafter": str(d)}, finish=finish)


def served_checks(
    drafter_dir: Path,
    model,
    d2t,
    identity: dict,
    *,
    python,
    work_dir: Path,
    n_prompts: int,
    max_tokens: int,
    serving: dict | None,
) -> tuple[list[dict], dict]:
    """vllm.known_answer, vllm.lossless, vllm.acceptance and vllm.aux_layers: the known answer's, the
    P-EAGLE and the plain runs in one vLLM process (the known answer's in its own where its serving
    differs); the chain along vLLM's plain output with the trained weights and the target's own aux
    states (in-process HF target)."""
    import torch

    from eaglet.engines import hf_loop
    from eaglet.target.load import load_model

    k = int(model.cfg.parallel_k)
    prompts = check_prompts(n_prompts)
    try:
        ka = known_answer_pending(identity, model.cfg, python=python, work_dir=work_dir.parent / "known_answer",
                                  n_prompts=n_prompts, max_tokens=max_tokens, serving=serving)
    except Exception as e:  # a failure to build it fails its check, not the others
        ka = check("vllm.known_answer", False, {"error": f"{type(e).__name__}: {e}"})
    runs = [
        {"tag": "spec", "target": identity["path"], "drafter": str(drafter_dir), "k": k, "max_tokens": max_tokens},
        {
            "tag": "plain",
            "target": identity["path"],
            "drafter": None,
            "k": k,
            "max_tokens": max_tokens + k - 1,
            "needs": "spec",
        },
    ]
    head = [ka] if isinstance(ka, dict) else []
    if head or vllm_runner_args(ka.serving) != vllm_runner_args(serving):
        res = run_vllm_batch(runs, prompts, work_dir=work_dir, python=python, serving=serving)
        if not head:  # another serving (the twin on one device beside a tensor-parallel target)
            res.update(run_vllm_batch([ka.run], prompts, work_dir=work_dir, python=python, serving=ka.serving))
    else:  # the known answer first, in the same runner process
        res = run_vllm_batch([ka.run, *runs], prompts, work_dir=work_dir, python=python, serving=serving)
    if not head:
        head = [ka.finish(res[ka.run["tag"]])]
    spec, plain = res["spec"], res["plain"]
    if spec.get("rc") != 0 or plain.get("rc") != 0:
        err = spec.get("engine_error") or spec.get("log_tail") or plain.get("engine_error") or plain.get("log_tail")
        bad = check("vllm.lossless", False, {"error": f"vLLM run failed: {err}", "parallel_drafting": True})
        return head + [
            bad,
            not_run("vllm.acceptance", "vLLM did not serve the drafter"),
            not_run("vllm.aux_layers", "vLLM did not serve the drafter"),
        ], {}
    same = spec["token_ids"] == [t[:max_tokens] for t in plain["token_ids"]]
    out = head + [
        check(
            "vllm.lossless",
            same,
            {"prompts": len(prompts), "k": k, "parallel_drafting": True, "tokens": sum(map(len, spec["token_ids"]))},
        )
    ]
    target = load_model(identity["path"])
    tap = hf_loop.Target(target, list(model.cfg.layer_ids), set())
    want = {"drafts": 0, "accepted_per_pos": [0] * k}
    with torch.no_grad():
        for p, cont in zip(spec["prompt_token_ids"], plain["token_ids"]):
            x = list(p) + list(cont)
            _, aux = tap.forward(x[:-1], tap.new_cache())
            c = model.parallel_chain_along(aux.reshape(len(x) - 1, -1), x, len(p), max_tokens, d2t)["counts"]
            want = {
                "drafts": want["drafts"] + c["drafts"],
                "accepted_per_pos": [a + b for a, b in zip(want["accepted_per_pos"], c["accepted_per_pos"])],
            }
    sd = spec["spec_decode"]
    got = {"drafts": int(sd["num_drafts"]), "accepted_per_pos": [int(v) for v in sd["num_accepted_tokens_per_pos"]]}
    ok = got == want and int(sd["num_draft_tokens"]) == want["drafts"] * k
    tau = 1 + sum(want["accepted_per_pos"]) / max(want["drafts"], 1)
    out.append(
        check(
            "vllm.acceptance",
            ok,
            {"vllm": got, "chain": want, "k": k, "tau": tau, "draft_tokens": int(sd["num_draft_tokens"])},
        )
    )
    taps = spec.get("aux_layers")
    out.append(
        check(
            "vllm.aux_layers", taps == list(model.cfg.layer_ids), {"vllm": taps, "trained": list(model.cfg.layer_ids)}
        )
    )
    return out, {"counts": want, "tau": tau, "prompts": prompts, "max_tokens": max_tokens}


def export(
    drafter_path: str | Path,
    out_dir: str | Path,
    identity_path: str | Path,
    *,
    work_dir: str | Path | None = None,
    vllm_python: str | None = None,
    **opts,
) -> dict:
    """Write and check the P-EAGLE directory; return the contract report. Raises ContractError
    (after writing contract.failed.json) when a check fails or one not run is not accepted."""
    import torch

    from eaglet.drafter.p_eagle import load_p_eagle
    from eaglet.export.contract.p_eagle_parity import p_eagle_parity_checks
    from eaglet.target.load import load_target_embedding

    o = {key: None for key in TARGET_KEYS} | schema.settings("export", opts, "export", extra=TARGET_KEYS)
    identity = load_identity(identity_path)
    identity["path"] = str(Path(identity["path"]).resolve())
    model, cfg, d2t, _ = load_p_eagle(drafter_path, load_target_embedding(identity["path"]))
    if cfg.target_digest and cfg.target_digest != identity["digest"]:
        raise ArtifactError(
            f"{drafter_path}: trained for target {cfg.target_digest[:12]}, identity says {identity['digest'][:12]}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS + ("contract.failed.json",):
        (out / name).unlink(missing_ok=True)
    work = Path(work_dir) if work_dir else out.parent / f"{out.name}.check"
    stage = out / ".staging"
    shutil.rmtree(stage, ignore_errors=True)
    export_p_eagle(stage, load_tensors(drafter_path), cfg, identity, read_json(Path(identity["path"]) / "config.json"))
    checks = p_eagle_static_checks(stage, identity, dataclasses.asdict(cfg))
    chain = {}
    if not o["vllm_check"]:
        checks += [not_run(n, "export.vllm_check is false") for n in P_EAGLE_VLLM_CHECKS]
    elif any(c["ok"] is not True for c in checks):
        checks += [not_run(n, "a static check failed") for n in P_EAGLE_VLLM_CHECKS]
    else:
        try:
            py = vllm_env.vllm_python(vllm_python)
        except vllm_env.VllmEnvMissing as e:
            py = None
            checks += [check("vllm.lossless", False, {"error": f"vLLM environment not found or incomplete: {e}"})]
            checks += [not_run(n, "no vLLM") for n in P_EAGLE_VLLM_CHECKS if n != "vllm.lossless"]
        if py is not None:
            checks += p_eagle_parity_checks([(stage, model, d2t)], target_layers=int(identity["num_layers"]),
                                            python=py, work_dir=work / "parity")
            with torch.no_grad():
                served, chain = served_checks(
                    stage,
                    model,
                    d2t,
                    identity,
                    python=py,
                    work_dir=work / "vllm",
                    n_prompts=o["vllm_check_prompts"],
                    max_tokens=o["vllm_check_max_tokens"],
                    serving=o["serving"],
                )
            checks += served
    checks += [not_run(n, why) for n, why in P_EAGLE_NOT_BUILT.items()]
    report = {
        "kind": "p_eagle",
        "checks": checks,
        **verdict(checks, list(o["accept_not_run"])),
        "method": "eagle3",
        "parallel_drafting": True,
        "num_speculative_tokens": cfg.parallel_k,
        "mask_token_id": cfg.mask_token_id,
        "drafter_dir": str(out),
        "vllm_tau": chain.get("tau"),
    }
    if not report["ok"]:
        write_json(out / "contract.failed.json", report)
        shutil.rmtree(stage, ignore_errors=True)
        raise ContractError(
            f"{out}: P-EAGLE export failed its contract: failed {report['failed']}, not run and "
            f"not named in export.accept_not_run {report['not_run_unaccepted']} "
            f"(details in {out / 'contract.failed.json'})"
        )
    write_json(
        stage / "reference.json",
        {
            "kind": "p_eagle",
            "chain": chain or None,
            "chain_not_recorded": None if chain else "the served checks did not run",
        },
    )
    for name in ("config.json", "model.safetensors", "reference.json"):
        (stage / name).replace(out / name)
    shutil.rmtree(stage)
    report[DIGESTS_KEY] = record_digests(out, ["config.json", "model.safetensors", "reference.json"])
    write_json(out / "contract.json", report)  # last: its presence means a complete, checked export
    return report


def main(argv: list[str] | None = None) -> None:
    kind_cli.main(argv, doc=__doc__, drafter="a P-EAGLE drafter", export=export, error=ContractError, log=log,
                  done=lambda out, rep: (f"P-EAGLE export {out}: contract passed (eagle3 + parallel_drafting, k "
                                   f"{rep['num_speculative_tokens']}), {len(rep['not_run'])} check(s) not run by "
                                   "export.accept_not_run"))


if __name__ == "__main__":
    main()
