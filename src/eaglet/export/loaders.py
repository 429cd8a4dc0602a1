"""Contract checks 2, loaders: vLLM's and SGLang's weight-name mapping replayed on an export's
tensor header, so every engine parameter is written exactly once (eaglet.export.contract).

What each engine does with a parameter nobody wrote: it does not say so (``SILENT``).
"""

from __future__ import annotations

from collections import Counter

from eaglet.export.record import check, not_run
from eaglet.export.static import dims, effective_config, variants

# (fused parameter, shard name, shard id): the stacked-parameter table both engines use.
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


def _vllm_params(c: dict) -> dict[str, dict]:
    """Eagle3LlamaForCausalLM's parameters: name -> {shard id: shape} (None = unsharded)."""
    k = dims(c)
    H, d, L = k["H"], k["d"], "model.layers.0."
    p = {"model.embed_tokens.weight": {None: (k["V"], H)},
         L + "self_attn.qkv_proj.weight": {"q": (k["nh"] * d, 2 * H), "k": (k["nkv"] * d, 2 * H),
                                           "v": (k["nkv"] * d, 2 * H)},
         L + "self_attn.o_proj.weight": {None: (H, k["nh"] * d)},
         L + "mlp.gate_up_proj.weight": {0: (k["I"], H), 1: (k["I"], H)},
         L + "mlp.down_proj.weight": {None: (H, k["I"])},
         "model.norm.weight": {None: (H,)}, "lm_head.weight": {None: (k["Vd"], H)}}
    if k["Vd"] != k["V"]:
        p["draft_id_to_target_id"] = {None: (k["Vd"],)}
    for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        p[L + n + ".weight"] = {None: (H,)}
    if (c.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        p["model.fc.weight"] = {None: (H, 3 * k["Ht"])}
        if variants(c)["norm_before_fc"]:
            p["model.input_norm.weight"] = {None: (3 * k["Ht"],)}
    return p


# What each engine does with a parameter nobody wrote: it does not say so.
SILENT = {"model.fc.weight": "fc runs on uninitialised memory", "fc": "fc stays at its random init",
          "lm_head.weight": "vLLM borrows the first V_d rows of the target's lm_head",
          "draft_id_to_target_id": "identity draft→target map: acceptance collapses",
          "hot_token_id": "no hot-token map: SGLang drafts over the wrong ids"}


def _resolve(params: dict, name: str, shard, shape, written: Counter, errors: list, orig: str) -> None:
    if name not in params or shard not in params[name]:
        errors.append(f"{orig}: no parameter {name}" + (f" shard {shard!r}" if shard is not None else ""))
        return
    want = params[name][shard]
    if tuple(shape) != tuple(want):
        errors.append(f"{orig}: shape {list(shape)} != parameter {name}[{shard}] {list(want)}")
        return
    written[(name, shard)] += 1


def emulate_vllm(conf: dict, header: dict) -> dict:
    """Replay Eagle3LlamaForCausalLM.load_weights (vLLM ≥0.10): t2d skipped, d2t renamed to
    draft_id_to_target_id, every other non-lm_head name prefixed ``model.``, then ``midlayer.`` →
    ``layers.0.`` and q/k/v, gate/up stacked. Names it cannot place raise in vLLM (errors here);
    parameters nobody writes stay as they are, silently (reported here)."""
    _, c = effective_config(conf)
    params = _vllm_params(c)
    written: Counter = Counter()
    errors, ignored = [], []
    has_embed = any("embed_tokens" in n for n in header)
    for orig, (shape, _dt) in header.items():
        name = orig
        if "t2d" in name:
            ignored.append(orig)
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        if not name.startswith("model."):
            _resolve(params, name, None, shape, written, errors, orig)
            continue
        sub = name[len("model."):].replace("midlayer.", "layers.0.")
        for fused, shard_name, shard in STACKED:
            if shard_name in sub:
                fused_name = "model." + sub.replace(shard_name, fused)
                _resolve(params, fused_name, shard, shape, written, errors, orig)
                break
        else:
            _resolve(params, "model." + sub, None, shape, written, errors, orig)
    # vLLM skips draft_id_to_target_id silently when d2t is absent (it stays zero: identity);
    # we report it as never written. embed_tokens absent is the intended sharing.
    skip = {"model.embed_tokens.weight"} if not has_embed else set()
    return _summarise("vllm", params, written, errors, ignored, skip,
                      shipped_embed="model.embed_tokens.weight" if has_embed else None)


def _sglang_params(c: dict) -> dict[str, dict]:
    p = {}
    for name, shards in _vllm_params(c).items():
        if name == "draft_id_to_target_id":
            p["hot_token_id"] = shards
        elif name.startswith("model.layers.0."):
            p[name.replace("model.layers.0.", "model.midlayer.")] = shards
        else:
            p[name] = shards
    p["model.fc.weight"] = {None: (dims(c)["H"], 3 * dims(c)["Ht"])}  # SGLang always builds fc
    if c.get("tie_word_embeddings"):
        p.pop("lm_head.weight")  # tied: lm_head *is* the embedding, and not in named_parameters
    return p


def emulate_sglang(conf: dict, header: dict) -> dict:
    """Replay SGLang's LlamaForCausalLMEagle3.load_weights: d2t → hot_token_id, t2d skipped,
    q/k/v and gate/up stacked, a name tried as-is then with ``model.``; anything still unknown is
    **dropped without a word** — so ``layers.0.*`` (speculators names) never reaches the midlayer."""
    _, c = effective_config(conf)
    on = [f for f, v in variants(conf, c).items() if v]
    if on:  # SGLang's EAGLE-3 model is not replayed for these: no verdict either way
        return not_run("loader.sglang", f"the drafter variants {on} are not emulated for SGLang's loader "
                       "(vLLM's llama_eagle3 reads them; whether SGLang does is unchecked)")
    params = _sglang_params(c)
    written: Counter = Counter()
    errors, ignored = [], []
    has_embed = any("embed_tokens" in n for n in header)
    for orig, (shape, _dt) in header.items():
        if "d2t" in orig:
            _resolve(params, "hot_token_id", None, shape, written, errors, orig)
            continue
        if "t2d" in orig:
            continue
        name, shard = orig, None
        for fused, shard_name, shard_id in STACKED:
            if shard_name in name:
                name, shard = name.replace(shard_name, fused), shard_id
                break
        pname = name if name in params else f"model.{name}"
        if pname in params:
            _resolve(params, pname, shard, shape, written, errors, orig)
        else:
            ignored.append(orig)
    problems_extra = []
    if c.get("draft_vocab_size") is None:
        problems_extra.append("draft_vocab_size missing: SGLang loads the target's full lm_head instead")
    skip = {"model.embed_tokens.weight"} if not has_embed else set()
    res = _summarise("sglang", params, written, errors, [], skip,
                     shipped_embed="model.embed_tokens.weight" if has_embed else None)
    if ignored:
        res["details"]["silently_dropped"] = ignored
        res["ok"] = False
    if problems_extra:
        res["details"]["problems"] = problems_extra
        res["ok"] = False
    return res


def _summarise(engine: str, params: dict, written: Counter, errors: list, ignored: list, skip: set,
               shipped_embed: str | None) -> dict:
    unwritten, twice = [], []
    for name, shards in params.items():
        if name in skip:
            continue
        for shard in shards:
            n = written[(name, shard)]
            label = name + (f"[{shard}]" if shard is not None else "")
            if n == 0:
                unwritten.append(f"{label}: never written ({SILENT.get(name, 'left at its initial value')})")
            elif n > 1:
                twice.append(f"{label}: written {n} times")
    det = {"errors": errors, "unwritten": unwritten, "written_twice": twice, "ignored": ignored}
    if shipped_embed:
        det["embed_tokens"] = "the drafter's own embedding is loaded instead of the target's"
    ok = not errors and not unwritten and not twice and not shipped_embed
    return check(f"loader.{engine}", ok, det)
