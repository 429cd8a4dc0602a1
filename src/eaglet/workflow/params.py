"""How a rule's settings become its params (workflow/rules/*.smk): what enters the cache key and the
rerun triggers, what only reaches the job, and the settings files of the cached stages.

Values may be frozen (eaglet.workflow.resolve.freeze: read-only dicts and tuples); they are written
as the plain dicts and lists they hold, so a frozen value gives the same params as its plain copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglet.base import library_versions
from eaglet.base.settings_files import settings_preview_dir, write_settings
from eaglet.workflow.resolve import thaw


def verbatim(value: Any):
    """A params value passed exactly as written. Snakemake formats params *strings* with the job's
    wildcards: user text holding `{name}` (Jinja's `{{ bos_token }}` in Gemma's chat template) stopped
    the DAG with a WildcardError, or would be substituted. A function's value is used as is, and still
    enters the cache key and the rerun triggers (a frozen value as its plain copy: Snakemake's
    rerun trigger compares params by repr, and drops a value it cannot represent)."""
    value = thaw(value)
    return lambda wildcards: value


def settings(value: Any):
    """A job's whole settings as JSON text for its command line (`--config {params.x:q}`), as a
    param *derived* from the job's output: Snakemake stores and compares only the params that are
    not (snakemake.rules.Rule.expand_params, non_derived_params), so the settings reach the job
    without entering its rerun trigger, and a preview writes nothing. What defines the output is
    compared through key_params. Not for a cached rule: the cache key hashes every param, and a
    setting that changes how, not what, would split the cache (those use SettingsFiles).
    """
    text = json.dumps(thaw(value), sort_keys=True)
    return lambda wildcards, output: text


class SettingsFiles:
    """The settings files of cached rules: how a cached rule's job receives its settings (`--config
    @FILE`) while its params hold one entry per setting that defines its output (key_params), so a
    setting of how (servers, timeouts) neither reruns the job nor splits its cache entry. The files
    are written when the run starts (the Snakefile's onstart calls ``write``), never by a preview, so
    `snakemake -n` changes no file a run reads; EAGLET_PREVIEW_SETTINGS=DIR also writes each under DIR
    at parse time, to inspect."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.written = False

    def file(self, path: str | Path, value: Any) -> str:
        """The path of a file (under logs/) holding ``value`` as JSON, for the rule's params."""
        text = json.dumps(thaw(value), indent=2, sort_keys=True) + "\n"
        self.texts[str(path)] = text
        if self.written:  # evaluated after the run started
            write_settings(path, text)
        preview = settings_preview_dir()
        if preview:
            write_settings(preview / path, text)
        return str(path)

    def write(self) -> None:
        """Write every settings file of this run (the Snakefile's onstart: a run, never a preview)."""
        for path, text in self.texts.items():
            write_settings(path, text)
        self.written = True


def key_params(name: str, value: Any, keys=None) -> dict:
    """One params entry per key of the dict `value` (nested keys dotted; `keys` picks some), each
    "key=JSON": the cache key and the rerun triggers see every key, and a changed one shows in
    `snakemake -n` as `before: 'lr=0.001' now: 'lr=0.002'`. Snakemake prints the params that
    differ by value, so one JSON param of a whole section showed all of it, twice.
    """
    value = thaw(value)

    def leaves(key, v):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                yield from leaves(f"{key}.{k}", sub)
        else:
            yield key, v

    out = {}
    for key in keys or value:
        v = value
        for part in key.split("."):
            v = v[part]
        for dotted, leaf in leaves(key, v):
            text = f"{dotted}={json.dumps(leaf, sort_keys=True)}"
            out[f"{name}_{dotted.replace('.', '_')}"] = verbatim(text)
    return out


def library_params(stage: str, kind: str | None = None, vllm_env: str | None = None) -> dict:
    """The versions of the libraries whose behaviour defines ``stage``'s output (the table
    eaglet.base.library_versions.LIBRARIES), one ``lib_<library>`` param each, so that a venv with
    another transformers (or torch, tokenizers, jinja2, vLLM) misses the cache and reruns the stage:
    `snakemake -n` shows ``before: 'transformers="5.25.0"' now: 'transformers="5.24.0"'``."""
    return key_params("lib", library_versions.versions(stage, kind, vllm_env))


def as_json(value: Any):
    """A params value: the JSON text of `value` for a CLI flag (quoted with :q in the shell line),
    verbatim (user strings inside may hold braces)."""
    return verbatim(json.dumps(thaw(value), sort_keys=True))


def out_dir(wildcards, output) -> str:
    """The folder of a rule's first output: stages write all their files there."""
    return str(Path(output[0]).parent)


def target_digest(wildcards, input) -> str:
    """The target's content digest from its identity JSON (computed once by target_model)."""
    return json.loads(Path(input.identity).read_text())["digest"]
