"""Provenance manifest for the HTML report: what Snakemake's report does not hold for
``python -m`` rules — package versions, the workflow's git describe, the hardware, the target's
identity digest, the config as written, what the parse resolved from it with the reasons
(eaglet.workflow.resolve: the storage choice, the layer ids, the dtypes; logs/<run>/resolved.json),
and the wall time of every stage of this run.

    python -m eaglet.report.provenance --run-dir results/smollm2 --target resources/targets/x/identity.json \
        --config-json "$(cat config.json)" --resolved-json @logs/smollm2/resolved.json \
        --out results/smollm2/provenance.json
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path

from eaglet.base import library_versions
from eaglet.base.files import read_json, write_json
from eaglet.base.job_records import stage_times
from eaglet.base.settings_files import parse_json_arg

PACKAGES = ("eaglet", "torch", "transformers", "safetensors", "tokenizers", "snakemake", "pyarrow",
            "pandas", "numpy", "openai", "gguf", "accelerate")


def versions() -> dict[str, str | None]:
    return {p: library_versions.installed(p) for p in PACKAGES}


def git_describe(cwd: str | Path = ".") -> str | None:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=cwd, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def hardware() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    gpus = []
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch or no CUDA: a CPU machine
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": mem_gb, "gpus": gpus, "gpu_count": len(gpus),
            "platform": platform.platform(), "python": platform.python_version()}


def manifest(run_dir: str | Path, identity: str | Path | None, config: dict, resolved: dict | None = None) -> dict:
    run_dir = Path(run_dir)
    ident = read_json(identity) if identity and Path(identity).exists() else None
    return {
        "versions": {**versions(), "vllm (envs/vllm)": library_versions.vllm_version("envs/vllm/.venv")},
        "git_describe": git_describe(),
        "hardware": hardware(),
        "target": {k: ident[k] for k in ("name", "source", "digest", "architecture", "num_layers",
                                          "hidden_size", "vocab_size") if k in ident} if ident else None,
        "config": config,
        "resolved": resolved,
        "stage_wall_times": stage_times(run_dir),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--target", default=None, help="the target's identity.json")
    p.add_argument("--config-json", default="{}", help="the workflow's config as written: JSON, or @FILE")
    p.add_argument("--resolved-json", default=None,
                   help="what the parse resolved (eaglet.workflow.resolve.Resolved.record): JSON, or @FILE")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    write_json(a.out, manifest(a.run_dir, a.target, parse_json_arg(a.config_json, {}),
                                  parse_json_arg(a.resolved_json)))


if __name__ == "__main__":
    main()
