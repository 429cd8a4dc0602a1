"""The command line of a block kind's export stage (eaglet.export.dflash_export,
eaglet.export.p_eagle_export): the same flags, the trained file's digests checked against its
train_summary.json, the contract's lines logged, a failure one error line and exit status 1."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import verify_recorded
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.engines import vllm_env
from eaglet.export.contract.record import status_line


def main(argv: list[str] | None, *, doc: str, drafter: str, export: Callable[..., dict],
         error: type[Exception], done: Callable[[str, dict], str], log: logging.Logger) -> None:
    """Parse ``argv``, run ``export`` (the kind's: drafter file, out folder, identity, work_dir,
    vllm_python, the export section's keys) and log ``done(out, report)`` to the kind's ``log`` once the
    contract passed; the kind's contract ``error``, a bad artifact or value: one error line, exit 1.
    ``drafter``: what the --drafter file holds, for the help line."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help=f"train/drafter.safetensors ({drafter})")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--out", required=True, help="folder for config.json, model.safetensors, contract.json")
    p.add_argument("--train-summary", default=None, help="train_summary.json (its digests are checked)")
    p.add_argument("--speculators-out", default=None, help="refused: the speculators format is EAGLE-3's")
    p.add_argument("--work-dir", default=None, help="vLLM check logs and cache (default OUT.check/)")
    p.add_argument("--vllm-python", default=None, help=f"vLLM interpreter or venv (default {vllm_env.DEFAULT_ENV})")
    p.add_argument("--config", default=None, help="the export section of the config: JSON, or @FILE")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    try:
        verify_recorded(a.drafter, a.train_summary or Path(a.drafter).with_name("train_summary.json"))
        rep = export(a.drafter, a.out, a.identity, work_dir=a.work_dir, vllm_python=a.vllm_python,
                     **parse_json_arg(a.config, {}))
    except (error, ArtifactError, ValueError) as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    for ch in rep["checks"]:
        (log.warning if ch["ok"] is None else log.info)("%s", status_line(ch))
    log.info("%s", done(a.out, rep))
