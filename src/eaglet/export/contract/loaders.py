"""Contract checks 2, loaders: vLLM's weight-name mapping replayed on an export's tensor header, so
every engine parameter is written exactly once (eaglet.export.contract). SGLang's is not replayed but
run, its own loader in its own environment: eaglet.export.contract.sglang_check.

What vLLM does with a parameter nobody wrote: it does not say so (``SILENT``).
"""

from __future__ import annotations

from collections import Counter

from eaglet.export.contract.record import check
from eaglet.export.contract.static_checks import dims, effective_config, variants

# (fused parameter, shard name, shard id): vLLM's stacked-parameter table.
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


# What vLLM does with a parameter nobody wrote: it does not say so.
SILENT = {"model.fc.weight": "fc runs on uninitialised memory",
          "lm_head.weight": "vLLM borrows the first V_d rows of the target's lm_head",
          "draft_id_to_target_id": "identity draft→target map: acceptance collapses"}


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
