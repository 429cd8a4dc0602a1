"""The dtype of the target's forward in extraction, chosen by what the machine computes fast
(``extract.target_dtype: auto``; issue 15).

On the CPU, bf16 pays only where the CPU has bf16 matrix units (AMX: ``amx_bf16`` and
``amx_tile`` in /proc/cpuinfo): the SmolLM2 forward ran ~5x faster there than in fp32. Without
them bf16 is slower than fp32: ~5x slower on AVX2-only CPUs, and on an AMD EPYC with
``avx512_bf16`` but no AMX 0.86x (benchmarks/bench_bf16.py). On a GPU bf16 is the norm.
Generation keeps its own dtypes (``target.dtype``, ``target.vllm.dtype``): vLLM-CPU in bf16
answered garbage.
"""

from __future__ import annotations

from pathlib import Path

AMX = ("amx_bf16", "amx_tile")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's ``flags`` in /proc/cpuinfo (empty where there is none: not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model(cpuinfo: str | None = None) -> str:
    try:
        cpuinfo = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def cpu_target_dtype(flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype, reason) for a target forward on this CPU."""
    flags = cpu_flags() if flags is None else flags
    if all(f in flags for f in AMX):
        return "bfloat16", "CPU has AMX bf16 matrix units (amx_bf16, amx_tile): bf16 forward ~5x faster"
    have = "avx512_bf16 but no AMX" if "avx512_bf16" in flags else "no AMX"
    return "float32", f"CPU has {have}: bf16 forward slower than fp32"


def resolve_target_dtype(setting: str, on_gpu: bool, flags: set[str] | None = None) -> tuple[str, str]:
    """``extract.target_dtype`` resolved: (dtype, reason). ``auto``: bf16 on a GPU, else by the
    CPU's capability; any other value as written."""
    if setting != "auto":
        return setting, "set in the config (extract.target_dtype)"
    if on_gpu:
        return "bfloat16", "GPU job"
    return cpu_target_dtype(flags)
