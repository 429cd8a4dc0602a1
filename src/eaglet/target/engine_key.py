"""The generation settings that define the text the target answers with: one definition, read by
the workflow for the cache key and rerun trigger of ``generate`` and ``generate_eval`` (their
params, workflow/rules/generate.smk) and by the stage for the key of its finished rows, which a
rerun resumes only under an equal key (eaglet.generate.generate.parts_key). Two lists once said
this, and disagreed: the cache key left out vLLM's parallelism, context length and remote code,
which the rows' key held, so an output made under one setting was served from the cache under
another while a rerun discarded its rows.

The decision, per backend (``ENGINE_KEYS``): a setting is in when another value of it can change the
replies' text; what changes only how fast or how robustly rows are made is out.

- ``openai``: the model asked for (``generate.model``). The servers (``base_urls``) are where it is
  asked, not what answers: a server reached by another route keeps the rows. Without a name the
  servers' first listed model answers, known only once a server is asked: the key is then the
  target's digest alone (the stage's premise that the servers serve the target).
- ``vllm``: the package (the CPU build or GPU vLLM: other kernels), the dtype, tensor and expert
  parallelism (the partial sums are reduced across GPUs in another order, and a near tie in the
  greedy choice can flip), remote code (which model code runs), the context length (a prompt or
  answer over it fails or stops: other rows), the extra arguments of the server and the reasoning
  parser (what is split off into ``reasoning_content``). The model is the target's (its digest).
- ``local``: how the target is loaded (dtype, device as configured, remote code) and the batch size
  (``concurrency``: left-padded batches, whose padding moves the last bits). ``device: auto`` is
  kept as written: where ``auto`` lands is the job's machine, which the parse cannot see; write
  ``cpu`` or ``cuda`` to keep GPU- and CPU-made text apart.

Out of every backend: base_urls, the concurrency of a server backend, timeouts, retries,
chunk_size, flush_s, the server's memory (kv_cache_gb), enforce_eager, start-up timeout and the
venv's path. The sampling settings, the chat template and the prompts are the stage's other keys
(its params and parts_key). The versions of the libraries that answer are part of the engine
(eaglet.base.library_versions): a row made by another vLLM or transformers is made anew, as the
cache makes the whole output anew.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eaglet.base.library_versions import versions

# generate's settings (dotted within the section as the stage reads it: ``vllm`` holds the serving
# settings, ``target_load`` how the local backend loads the target) that define the text, per backend
ENGINE_KEYS: dict[str, tuple[str, ...]] = {
    "openai": ("model",),
    "vllm": ("vllm.package", "vllm.dtype", "vllm.tensor_parallel_size", "vllm.enable_expert_parallel",
             "vllm.trust_remote_code", "vllm.max_model_len", "vllm.extra_args", "vllm.reasoning_parser"),
    "local": ("target_load.dtype", "target_load.device", "target_load.trust_remote_code", "concurrency"),
}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def engine_key(cfg: Mapping) -> dict:
    """``{"backend": ..., "settings": {dotted key: value}, "libraries": {library: version}}``: the
    settings of ``ENGINE_KEYS`` for generate's settings ``cfg`` (the workflow's, defaults filled, or
    the stage's resolved config: the same values), and the versions of the libraries that answer
    (eaglet.base.library_versions: vLLM's read from ``generate.vllm.env``)."""
    backend = cfg["backend"]
    settings = {}
    for key in ENGINE_KEYS[backend]:
        value = cfg
        for part in key.split("."):
            value = value[part]
        settings[key] = _plain(value)
    return {"backend": backend, "settings": settings,
            "libraries": versions("generate", backend, cfg["vllm"]["env"])}
