"""Contract check 3, parity: an independent reference forward, written here from vLLM's semantics
(not from eaglet.drafter.eagle3), reproduces the trainer's step-0 logits and pre-norm hidden within 1e-4 in
fp32 (eaglet.export.contract).

Shape legend: B batch, T tokens, H draft hidden, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.tensors import load_tensors
from eaglet.export.contract.record import check
from eaglet.export.contract.static_checks import dims, effective_config, read_export, variants


def target_embedding(model_dir: str | Path):
    """The target's ``model.embed_tokens.weight`` [V, H] (the drafter shares it)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith("embed_tokens.weight"):
                    return fh.get_tensor(key)
    raise ArtifactError(f"{model_dir}: no embed_tokens.weight in {[f.name for f in files]}")


def reference_inv_freq(c: dict, head_dim: int):
    """(inv_freq [d/2], attention scaling) of an exported drafter config, via transformers'
    config parsing and its rope init functions (never through eaglet.drafter.eagle3)."""
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
    its semantics (not from eaglet.drafter.eagle3), its config variants included (norm_before_fc,
    norm_before_residual, norm_output): returns (logits over the full vocab [B,T,V] with −inf
    outside the draft vocab, the hidden [B,T,H] fed to the next draft step: pre-norm, or post-norm
    with norm_output)."""
    import torch

    k = dims(c)
    eps = c["rms_norm_eps"]
    B, T = ids_BT.shape
    nh, nkv, d = k["nh"], k["nkv"], k["d"]
    lw = {n.removeprefix("midlayer.").removeprefix("layers.0."): v for n, v in w.items()
          if n.startswith(("midlayer.", "layers.0."))}

    def rms(x, g):
        return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    var = variants(c)
    if var["norm_before_fc"]:  # combine_hidden_states: input_norm over the whole concat first
        aux_BT3H = rms(aux_BT3H, w["input_norm.weight"])
    g_BTH = aux_BT3H @ w["fc.weight"].T  # combine_hidden_states
    e_BTH = embed_VH[ids_BT]
    # _norm_after_residual (default): the residual is the un-normed hidden; _norm_before_residual:
    # the normed one
    residual_BTH = rms(g_BTH, lw["hidden_norm.weight"]) if var["norm_before_residual"] else g_BTH
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
    normed_BTH = rms(pre_BTH, w["norm.weight"])
    logits_BTVd = normed_BTH @ w["lm_head.weight"].T
    full = logits_BTVd.new_full((B, T, k["V"]), float("-inf"))
    full[..., torch.arange(k["Vd"]) + w["d2t"].long()] = logits_BTVd
    return full, (normed_BTH if var["norm_output"] else pre_BTH)  # norm_output: aux_output is post-norm


def parity_check(drafter_dir: str | Path, trained_path: str | Path | None, identity: dict,
                 tol: float = 1e-4, seed: int = 0) -> dict:
    """Reference forward on the exported files vs eaglet.drafter.eagle3 on the trainer's file, step 0
    (``identity``: the target's; its checkpoint gives the embedding). Without the trainer's file
    (a directory checked alone), eaglet's model reads the directory's own weights
    (eaglet.export.contract.reference.load_exported): the two implementations must then agree on the same
    weights, which is what lets ``reference.chain`` stand in for the engine."""
    import torch

    try:
        from eaglet.drafter.eagle3 import load_drafter
    except ImportError as e:
        return check("parity.step0", None, {"skipped": f"eaglet.drafter.eagle3 not importable ({e})"})
    conf, _ = read_export(drafter_dir)
    _, c = effective_config(conf)
    w = {n: t.float() for n, t in load_tensors(Path(drafter_dir) / "model.safetensors").items()}
    w["d2t"] = load_tensors(Path(drafter_dir) / "model.safetensors", ["d2t"])["d2t"]
    embed = target_embedding(identity["path"]).float()
    k = dims(c)
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 12
    aux = torch.randn(B, T, 3 * k["Ht"], generator=g)
    ids = torch.randint(0, k["V"], (B, T), generator=g)
    pos = torch.arange(T).repeat(B, 1) + torch.tensor([[0], [5]])  # a batch row not starting at 0
    ref_full, ref_pre = reference_step0(w, c, embed, aux, ids, pos)
    with torch.no_grad():
        if trained_path is None:
            from eaglet.export.contract.reference import load_exported

            drafter, _cfg, d2t = load_exported(drafter_dir, identity)
        else:
            drafter, _cfg, d2t, _t2d = load_drafter(trained_path, identity, embed_weight=embed)
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
           "shape": [B, T], "against": "the trainer's file" if trained_path else "the directory's own weights"}
    return check("parity.step0", same_support and dl <= tol and dh <= tol, det)
