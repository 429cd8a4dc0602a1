"""The workflow's parse-time checks (eaglet.workflow.resolve, at the parse of workflow/rules/common.smk):
of a whole config against the target it names and the engine installed, and of keys that contradict
one another; ``snakemake -n`` already refuses a run that cannot succeed, naming the config key.
Files only: no torch, no transformers, no vLLM import."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.base import schema
from eaglet.export.contract.dflash_parity import DFLASH_NOT_APPLICABLE, DFLASH_VLLM_CHECKS
from eaglet.export.contract.record import VLLM_CHECKS
from eaglet.export.p_eagle_format import P_EAGLE_NOT_BUILT, P_EAGLE_VLLM_CHECKS
from eaglet.target.chat_template import chat_template_text, has_chat_template, no_template_message
from eaglet.target.check import DRAFTER_NAMES, architecture, read_config, serving, text_config


def unaccepted_not_run(export: dict, kind: str | None = None) -> list[str]:
    """Contract checks the config already says will not run (the real-vLLM ones with
    ``export.vllm_check: false``; format B's always; for drafter.kind dflash its own engine checks
    and EAGLE-3's it has no counterpart of) that ``export.accept_not_run`` does not list. Each would
    fail the export at the end of the run, after training."""
    if kind == "dflash":  # export.speculators is refused for the kind (eaglet.workflow.resolve.dflash_checks)
        off = [*([] if export.get("vllm_check", schema.default("export.vllm_check")) else DFLASH_VLLM_CHECKS),
               *DFLASH_NOT_APPLICABLE]
        accepted = set(export.get("accept_not_run") or ())
        return [n for n in off if n not in accepted]
    if kind == "p_eagle":  # export.speculators is refused for the kind (eaglet.workflow.resolve.p_eagle_checks)
        off = [*([] if export.get("vllm_check", schema.default("export.vllm_check")) else P_EAGLE_VLLM_CHECKS),
               *P_EAGLE_NOT_BUILT]
        accepted = set(export.get("accept_not_run") or ())
        return [n for n in off if n not in accepted]
    off = [] if export.get("vllm_check", schema.default("export.vllm_check")) else list(VLLM_CHECKS)
    if export.get("speculators"):  # format B is never run in real vLLM
        off += [f"speculators.{n}" for n in VLLM_CHECKS]
    accepted = set(export.get("accept_not_run") or ())
    return [n for n in off if n not in accepted]


def parse_time(config: dict, workdir: str | Path = ".") -> list[str]:
    """Check a validated workflow config against the target it names; return the lines to log.
    Raises ValueError naming the config key when the run cannot succeed."""
    t = config["target"]
    lines: list[str] = []
    missing = unaccepted_not_run(config.get("export", {}), (config.get("drafter") or {}).get("kind"))
    if missing:
        raise ValueError(f"export.accept_not_run: the config turns off contract checks {missing} "
                         "(export.vllm_check: false / export.speculators: true / drafter.kind: dflash or "
                         "p_eagle), and a check that did not run fails the export after training unless it is "
                         "named here: add them to export.accept_not_run, or turn the check on")
    template = chat_template_text(t.get("chat_template"), workdir)
    kind = (config.get("drafter") or {}).get("kind", schema.default("drafter.kind"))
    # a P-EAGLE drafter is an EAGLE-3 drafter served with parallel drafting: the same targets (named
    # here, not in eaglet.target.check, whose change would rerun every run's target_model)
    kind = "eagle3" if kind == "p_eagle" else kind
    ev = config.get("evaluate", {}).get("vllm", {})
    env = Path(workdir) / ev.get("env", schema.default("evaluate.vllm.env"))
    if not t.get("path") or t.get("tiny") is not None:
        # A built or GGUF target is known once the first job (target_model) has made it: that job
        # checks the template and says whether vLLM serves it; later runs read what it recorded.
        ident = Path(workdir) / "resources" / "targets" / t["name"] / "identity.json"
        if ident.is_file():
            rec = json.loads(ident.read_text())
            arch = rec.get("architecture", "?")
            status, line = serving(arch, env, rec.get("attention"), kind)
            lines.append(line)
            _refuse_unserved(status, line, config, ev)
        else:
            lines.append(f"target {t['name']!r} is built by the first job (target_model), which checks its chat "
                         f"template and whether vLLM can serve {DRAFTER_NAMES[kind]} for it")
        return lines
    conf = read_config(t["path"])
    text = text_config(conf)
    if template is None and not has_chat_template(t["path"]):
        raise ValueError(no_template_message(f"target.path {t['path']!r}"))
    arch = architecture(conf)
    status, line = serving(arch, env, "mla" if text.get("kv_lora_rank") else None, kind)
    lines.append(line)
    _refuse_unserved(status, line, config, ev)
    return lines


def settings_consistent(config: dict) -> None:
    """Refuse keys the schema accepts one by one but that contradict one another, naming them."""
    if config["train"]["hidden_states"] == "online":
        # no extract job runs online: its own keys say nothing then
        for key, unused in (("shards", 1), ("gpus_per_shard", 0)):
            if config["extract"][key] != unused:
                raise ValueError(
                    f"extract.{key}: {config['extract'][key]} has no effect with train.hidden_states: online "
                    "(no extract job runs; the target runs in the training job, on its train.gpus): "
                    f"set it to {unused} or train offline"
                )
    if config["data"]["mix"] < 1 and not config["generate"]["enabled"]:
        raise ValueError(
            f"data.mix: {config['data']['mix']} asks for a share of regenerated responses, but "
            "generate.enabled is false (nothing is regenerated); set data.mix: 1 or enable generate"
        )


def _refuse_unserved(status: str, line: str, config: dict, ev: dict) -> None:
    """Refuse a run that would serve the drafter in a vLLM that cannot serve this architecture."""
    uses = [k for k, on in (("export.vllm_check", config.get("export", {}).get("vllm_check")),
                            ("evaluate.vllm.enabled", ev.get("enabled"))) if on]
    if status == "unsupported" and uses:
        raise ValueError(f"{' and '.join(uses)}: {line}. Set {' and '.join(f'{k}: false' for k in uses)} "
                         "(and list the real-vLLM checks that then do not run in export.accept_not_run) to train "
                         "and export without serving it in vLLM")
