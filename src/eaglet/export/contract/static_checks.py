"""Contract checks 1, static: an exported drafter directory read without running it (eaglet.export.contract).

Exact key set, shapes, dtypes, the d2t/t2d vocabulary map, layer ids, config fields; and how to read
an export (its config as vLLM ends up with it, its tensor header without the weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json
from eaglet.base.tensors import load_tensors, tensor_metadata
from eaglet.export.contract.record import check

ARCH_A = "LlamaForCausalLMEagle3"  # vLLM's registry maps it to Eagle3LlamaForCausalLM; SGLang's name
ARCH_B = "Eagle3Speculator"
# Drafter variants the trainer can train (eaglet.drafter.eagle3.DrafterConfig, same names) and vLLM 0.32's
# llama_eagle3 reads from config.json (``norm_before_fc`` also inside ``eagle_config``).
VARIANTS = ("norm_before_fc", "norm_before_residual", "norm_output")


def variants(conf: dict, c: dict | None = None) -> dict[str, bool]:
    """The variant flags as vLLM reads them: ``c`` the flat config (effective_config), ``conf`` the
    file (its ``eagle_config`` may hold norm_before_fc)."""
    c = conf if c is None else c
    ec = conf.get("eagle_config") or {}
    return {"norm_before_fc": bool(ec.get("norm_before_fc", c.get("norm_before_fc", False))),
            "norm_before_residual": bool(c.get("norm_before_residual", False)),
            "norm_output": bool(c.get("norm_output", False))}


# --------------------------------------------------------------------------- reading an export
def read_export(drafter_dir: str | Path) -> tuple[dict, dict]:
    """(config.json dict, {name: (shape tuple, dtype str)}) without loading the weights."""
    from safetensors import safe_open

    d = Path(drafter_dir)
    conf = read_json(d / "config.json")
    path = d / "model.safetensors"
    if not path.exists():
        raise ArtifactError(f"{path}: missing")
    with safe_open(str(path), framework="pt") as f:
        header = {k: (tuple(f.get_slice(k).get_shape()), str(f.get_slice(k).get_dtype())) for k in f.keys()}
    return conf, header


def trained_config(path: str | Path) -> dict:
    """The trainer's DrafterConfig from its drafter.safetensors metadata."""
    meta = tensor_metadata(path)
    if "eaglet" not in meta:
        raise ArtifactError(f"{path}: no 'eaglet' DrafterConfig in the safetensors metadata")
    try:
        return json.loads(meta["eaglet"])
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: metadata 'eaglet' is not JSON ({e})") from None


def effective_config(conf: dict) -> tuple[str, dict]:
    """Which format this is, and the flat config vLLM ends up with (speculators → vLLM conversion,
    including its ``norm_before_residual`` default of True)."""
    if "speculators_model_type" in conf:
        flat = dict(conf.get("transformer_layer_config") or {})
        flat["draft_vocab_size"] = conf.get("draft_vocab_size")
        if conf.get("target_hidden_size") is not None:
            flat["target_hidden_size"] = conf["target_hidden_size"]
        flat["norm_before_residual"] = conf.get("norm_before_residual", True)
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):  # vLLM's conversion: default False
            flat[flag] = conf.get(flag, False)
        if conf.get("eagle_aux_hidden_state_layer_ids"):
            flat["eagle_aux_hidden_state_layer_ids"] = conf["eagle_aux_hidden_state_layer_ids"]
        return "B", flat
    return "A", conf


def dims(c: dict) -> dict:
    H, nh = c["hidden_size"], c["num_attention_heads"]
    return dict(H=H, Ht=c.get("target_hidden_size") or H, nh=nh, nkv=c.get("num_key_value_heads", nh),
                d=c.get("head_dim") or H // nh, I=c["intermediate_size"], V=c["vocab_size"],
                Vd=c.get("draft_vocab_size") or c["vocab_size"])


def expected_tensors(c: dict, prefix: str = "midlayer") -> dict[str, tuple]:
    """The exact tensor set of §6 with shapes, for a flat config."""
    k = dims(c)
    H, d = k["H"], k["d"]
    layer = {"self_attn.q_proj.weight": (k["nh"] * d, 2 * H),
             "self_attn.k_proj.weight": (k["nkv"] * d, 2 * H),
             "self_attn.v_proj.weight": (k["nkv"] * d, 2 * H), "self_attn.o_proj.weight": (H, k["nh"] * d),
             "mlp.gate_proj.weight": (k["I"], H), "mlp.up_proj.weight": (k["I"], H),
             "mlp.down_proj.weight": (H, k["I"]), "input_layernorm.weight": (H,),
             "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    out = {"fc.weight": (H, 3 * k["Ht"])}
    out.update({f"{prefix}.{n}": s for n, s in layer.items()})
    out.update({"norm.weight": (H,), "lm_head.weight": (k["Vd"], H), "d2t": (k["Vd"],), "t2d": (k["V"],)})
    if k["Vd"] == k["V"]:
        del out["d2t"]  # full vocab: vLLM 0.32 has no d2t parameter then and would reject one
    if c.get("norm_before_fc") or (c.get("eagle_config") or {}).get("norm_before_fc"):
        out["input_norm.weight"] = (3 * k["Ht"],)  # vLLM's RMSNorm over concat(aux) before fc
    return out




# --------------------------------------------------------------------------- static checks
def static_checks(drafter_dir: str | Path, identity: dict, trained: dict | None = None) -> list[dict]:
    """Key set, shapes, dtypes, vocabulary map, layer ids, config fields. ``trained`` is the
    trainer's DrafterConfig (the drafter.safetensors metadata); without it the ids can only be
    range-checked, not compared."""
    drafter_dir = Path(drafter_dir)
    conf, header = read_export(drafter_dir)
    fmt, c = effective_config(conf)
    prefix = "layers.0" if fmt == "B" else "midlayer"
    # config fields first: everything after reads them
    need = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "hidden_act", "vocab_size", "draft_vocab_size", "max_position_embeddings"]
    missing = [f for f in need if c.get(f) is None]
    if c.get("rope_theta") is None and (c.get("rope_parameters") or {}).get("rope_theta") is None:
        missing.append("rope_theta")
    if missing:
        return [check("static.config_fields", False, {"missing": missing})]
    problems = config_problems(conf, fmt, c, identity, trained)
    want = expected_tensors(c, prefix)
    return [check("static.config_fields", not problems, {"format": fmt, "problems": problems}),
            key_set_check(want, header), shapes_dtypes_check(want, header),
            vocab_map_check(drafter_dir / "model.safetensors", header, c),
            layer_id_check(conf, fmt, identity["num_layers"], trained)]


def config_problems(conf: dict, fmt: str, c: dict, identity: dict, trained: dict | None) -> list[str]:
    """``static.config_fields``: what in the exported config (``c``: as vLLM ends up with it) an
    engine would read differently from what was trained."""
    problems = []
    want_arch = ARCH_B if fmt == "B" else ARCH_A
    if conf.get("architectures") != [want_arch]:
        problems.append(f"architectures {conf.get('architectures')} != [{want_arch!r}]")
    if c.get("model_type") != "llama":
        problems.append(f"model_type {c.get('model_type')!r} != 'llama'")
    if c.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers {c.get('num_hidden_layers')} != 1")
    if c.get("tie_word_embeddings", True) is not False or conf.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings must be written false "
                        "(SGLang would tie lm_head to the embedding)")
    if c["hidden_act"] != "silu":
        problems.append(f"hidden_act {c['hidden_act']!r} != 'silu'")
    if c["vocab_size"] != identity["vocab_size"]:
        problems.append(f"vocab_size {c['vocab_size']} != target vocab {identity['vocab_size']}")
    got = variants(conf, c)
    for flag in VARIANTS:  # what vLLM will compute must be what was trained
        want = bool((trained or {}).get(flag, False))
        if got[flag] != want:
            problems.append(f"{flag} is {str(got[flag]).lower()} in the export, {str(want).lower()} in training"
                            + ("; the speculators format defaults norm_before_residual to true when absent"
                               if fmt == "B" and flag == "norm_before_residual" else ""))
    if fmt == "B" and not isinstance(conf.get("norm_before_residual"), bool):
        problems.append("speculators config must write norm_before_residual explicitly (absent = true)")
    if c.get("fc_norm") or (conf.get("eagle_config") or {}).get("fc_norm"):  # a vLLM variant we do not train
        problems.append("fc_norm is set: vLLM would add per-layer norms the trainer does not have")
    if fmt == "A":
        ec = conf.get("eagle_config") or {}
        if ec.get("use_aux_hidden_state") is not True:
            problems.append("eagle_config.use_aux_hidden_state must be true")
    ht = c.get("target_hidden_size") or c["hidden_size"]
    if ht != identity["hidden_size"]:
        problems.append(f"target hidden {ht} (target_hidden_size or hidden_size) "
                        f"!= target's {identity['hidden_size']}")
    if trained:
        for key, ckey in (("hidden_size", "hidden_size"), ("num_heads", "num_attention_heads"),
                          ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                          ("intermediate_size", "intermediate_size"), ("rms_norm_eps", "rms_norm_eps"),
                          ("rope_theta", "rope_theta"), ("draft_vocab_size", "draft_vocab_size")):
            got = c.get(ckey) if ckey != "rope_theta" else _rope_theta(c)
            if key in trained and got != trained[key]:
                problems.append(f"{ckey} {got} != trained {trained[key]}")
        want_rope = trained.get("rope_parameters") or {"rope_type": "default", "rope_theta": trained.get("rope_theta")}
        if "rope_theta" in trained and _flat_rope(c) != want_rope:
            problems.append(f"RoPE {_flat_rope(c)} != trained {want_rope}")
    rp = c.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rp.values()):
        problems.append("rope_parameters is per layer type: vLLM's get_rope takes one flat dict")
    return problems


def key_set_check(want: dict, header: dict) -> dict:
    """``static.key_set``: exactly the tensors of §6, and no embedding of the drafter's own."""
    have = set(header)
    miss, extra = sorted(set(want) - have), sorted(have - set(want))
    embed = [k for k in have if "embed_tokens" in k]
    det = {"missing": miss, "unexpected": extra}
    if embed:
        det["embed_tokens"] = "shipped: engines would use this copy instead of the target's embedding"
    return check("static.key_set", not miss and not extra, det)


def shapes_dtypes_check(want: dict, header: dict) -> dict:
    """``static.shapes_dtypes``: every tensor's shape, one float dtype for the weights, int64 d2t, bool t2d."""
    bad_shape = {k: {"have": list(header[k][0]), "want": list(s)} for k, s in want.items()
                 if k in header and header[k][0] != s}
    float_dtypes = {header[k][1] for k in want if k in header and k not in ("d2t", "t2d")}
    dt_problems = []
    if len(float_dtypes) > 1:
        dt_problems.append(f"mixed weight dtypes {sorted(float_dtypes)}")
    if not float_dtypes <= {"F32", "BF16", "F16"}:
        dt_problems.append(f"weights not floating point: {sorted(float_dtypes)}")
    if "d2t" in header and header["d2t"][1] != "I64":
        dt_problems.append(f"d2t dtype {header['d2t'][1]} != I64")
    if "t2d" in header and header["t2d"][1] != "BOOL":
        dt_problems.append(f"t2d dtype {header['t2d'][1]} != BOOL")
    return check("static.shapes_dtypes", not bad_shape and not dt_problems,
                 {"shapes": bad_shape, "dtypes": dt_problems})


def vocab_map_check(weights: Path, header: dict, c: dict) -> dict:
    """``static.vocab_map``: target_id = i + d2t[i], unique, in range, and t2d marks exactly those ids."""
    import torch

    if "d2t" in header:
        t = load_tensors(weights, ["d2t"] + (["t2d"] if "t2d" in header else []))
        d2t = t["d2t"].long()
        tgt = torch.arange(d2t.numel()) + d2t
        vp = []
        if tgt.numel() != c["draft_vocab_size"]:
            vp.append(f"d2t has {tgt.numel()} entries, draft_vocab_size is {c['draft_vocab_size']}")
        if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= c["vocab_size"]):
            vp.append(f"d2t targets outside [0, {c['vocab_size']}): "
                      f"min {int(tgt.min())} max {int(tgt.max())}")
        if tgt.unique().numel() != tgt.numel():
            vp.append(f"d2t targets not unique ({tgt.numel() - tgt.unique().numel()} duplicates)")
        if "t2d" in t:
            nz = t["t2d"].bool().nonzero().flatten()
            if nz.numel() != tgt.numel() or not torch.equal(nz, tgt):
                vp.append("nonzero(t2d) != arange(V_d) + d2t")
        if torch.equal(d2t, torch.zeros_like(d2t)) and c["draft_vocab_size"] != c["vocab_size"]:
            vp.append("d2t is all zeros (identity map) with a reduced draft vocab")
        return check("static.vocab_map", not vp, {"problems": vp})
    if c["draft_vocab_size"] == c["vocab_size"]:
        return check("static.vocab_map", True, {"note": "full vocabulary: no d2t needed"})
    return check("static.vocab_map", False, {"problems": [
        "no d2t: vLLM silently uses the identity map (acceptance collapses)"]})


def _flat_rope(c: dict) -> dict:
    """The exported RoPE as one dict (rope_parameters, else legacy rope_scaling + rope_theta)."""
    rp = dict(c.get("rope_parameters") or {})
    if not rp:
        rp = {k: v for k, v in (c.get("rope_scaling") or {}).items() if k != "type"}
        rp["rope_type"] = (c.get("rope_scaling") or {}).get("rope_type") or \
            (c.get("rope_scaling") or {}).get("type") or "default"
        rp["rope_theta"] = _rope_theta(c)
    return rp


def _rope_theta(c: dict):
    return c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta"))


def layer_id_check(conf: dict, fmt: str, num_layers: int, trained: dict | None) -> dict:
    """The layer-id trap (§5). vLLM reads the top-level ids (residual stream entering layer j);
    SGLang reads ``eagle_config`` ids and adds 1 (it counts "output of layer i"), so the physical
    layer SGLang taps is eagle_config id + 1. Both must equal the ids trained with."""
    p, det = [], {}
    top = conf.get("eagle_aux_hidden_state_layer_ids")
    det["vllm"] = top
    if not isinstance(top, list) or len(top) != 3 or not all(isinstance(i, int) for i in top):
        p.append(f"top-level eagle_aux_hidden_state_layer_ids {top!r}: vLLM falls back to its defaults")
    else:
        if sorted(set(top)) != top:
            p.append(f"ids {top} not strictly ascending (fc concatenates low, mid, high)")
        if top[0] < 1 or top[-1] > num_layers - 1:  # vLLM taps only the inputs of layers 0..N-1
            p.append(f"ids {top} outside [1, {num_layers - 1}] for a {num_layers}-layer target")
    if fmt == "A":
        ec = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        sg = [i + 1 for i in ec] if isinstance(ec, list) else None
        det["eagle_config"], det["sglang_physical"] = ec, sg
        if sg is None:
            p.append("eagle_config.eagle_aux_hidden_state_layer_ids missing: "
                     "SGLang falls back to its defaults")
        elif isinstance(top, list) and sg != top:
            p.append(f"SGLang would tap {sg} (eagle_config ids + 1), vLLM {top}")
    if trained is not None:
        det["trained"] = trained.get("layer_ids")
        if isinstance(top, list) and top != trained.get("layer_ids"):
            p.append(f"exported ids {top} != trained ids {trained.get('layer_ids')}")
    det["problems"] = p
    return check("static.layer_ids", not p, det)
