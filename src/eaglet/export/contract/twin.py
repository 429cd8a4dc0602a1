"""The known answer, constructed: a twin of the target and an EAGLE-3 drafter whose first draft is
the twin's greedy token by construction, exported by eaglet.export.vllm_format's own writer, and copies of
that export with one deliberate fault each (``BREAKAGES``). Why, and the check that serves them in
vLLM: eaglet.export.contract.known_answer.

The alignment makes this impossible for an arbitrary target (docs/eagle3.md §3): at position t the
drafter sees the target's aux states at t and the token x_{t+1}, and must propose x_{t+2}, the
target's greedy token at t+1, which a one-layer drafter cannot compute for a real model. So the
answer is built for a **twin** of the target: the same architecture, config (hidden size, heads,
head_dim, layer count, vocabulary, RoPE) and tokenizer, with constructed weights such that:

- the twin's greedy next token depends only on the current token, through a single-cycle
  permutation pi of the vocabulary (no fixed points or short cycles: x_{t+2} differs from x_t and
  x_{t+1}). Embedding rows are [a_v (m dims, answer space A) | b (bias dim) | 0 (register r) | 0...];
  attention is off (o_proj = 0); layer j's MLP adds a positive constant rho_j to the register dim r,
  so the aux state with vLLM id k carries S_k = rho_0 + ... + rho_{k-1} there (distinct for every k);
  the final norm weight w is negative and uneven on A (-0.5 .. -1.5), the head row of token u is
  a_{pi^-1(u)} / w. So logits_u(v) ~ a_{pi^-1(u)} . a_v: greedy(v) = pi(v).
- the drafter (export format of docs/eagle3.md §6, written by eaglet.export.export's own writer):
  attention focused on its own position (q = k = a constant read from the embedding's bias dim;
  RoPE makes q.k peak on the diagonal, scaled to a margin of ``MIN_MARGIN`` nats over every other
  position up to the context length), v = the normed embedding of x_{t+1} (answer dims + bias dim),
  o_proj copies the answer dims and turns the bias dim into a large decoy vector D;
  ``fc`` reads the register dim of each of the three aux states and writes -D/3 / S_{id} each, so
  the decoy cancels exactly **only** with the right aux layers; MLP off; the final ``norm`` is the
  twin's own and ``lm_head`` the draft rows of the twin's head. Then the draft is
  pi(x_{t+1}) = x_{t+2} whenever that token is in the draft vocab (all chain tokens of the check
  prompts are put in it).

Each breakage changes the drafts (``BREAKAGES``), by construction:
- ``d2t_shifted``: draft id i maps to the next used id: every draft is a different token;
- ``layer_ids_minus_one`` (the SpecForge "output of layer i" count written as vLLM ids): the
  register values S_{id-1} != S_id, the decoy is left uncancelled (>= |D| / (3 N) >> the answer);
- ``norm_ones``: the final norm weight not the target's (ones): logits_u ~ -sum a_{pi^-1(u)} a_v / |w|,
  which ranks pi(v) last;
- ``fc_transposed``: each H x H block of fc transposed (an [in, out] layout): it reads the decoy
  direction and writes the register dim instead, the decoy stays.

Only the first draft of a round is known (later steps read the drafter's own hidden, where the
decoy is not cancelled): vLLM's ``num_accepted_tokens_per_pos[0] / num_drafts`` must be ~1.

Twins are built for plain decoder families whose weights use Llama's names and norm semantics
(``SUPPORTED``); anything else is "not run" with the reason, never a pass.

    twin = build_twin(identity, work / "twin")                   # HF checkpoint + known.json
    path = build_drafter(twin, identity, work / "d.safetensors", prompts, layer_ids=[2, 4, 7])
    d = write_export(path, twin, work / "drafter")                 # format A dir (eaglet.export.vllm_format)
    bad = break_export(d, "d2t_shifted", work / "bad")
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import folder_manifest
from eaglet.base.files import read_json, write_json
from eaglet.target.load import read_target_tensor

SUPPORTED = ("llama", "qwen2", "qwen3")  # Llama parameter names, w * x RMSNorm, o_proj, gate/up/down
BREAKAGES = ("d2t_shifted", "layer_ids_minus_one", "norm_ones", "fc_transposed")
MAX_TWIN_PARAMS = 400_000_000   # the twin is written to disk and served: refuse a Llama-70B-size one
MIN_MARGIN = 60.0               # nats between the diagonal attention score and any other position
DECOY = 1000.0                  # |D| relative to the answer vector's norm
TWIN_INTERMEDIATE = 8           # the twin's MLP only writes a constant
KNOWN = "known.json"


# --------------------------------------------------------------------------- what can be built
def _text_config(target_dir: str | Path) -> dict:
    return read_json(Path(target_dir) / "config.json")


def unsupported(identity: dict) -> str | None:
    """Why no twin can be built for this target (None: it can)."""
    try:
        conf = _text_config(identity["path"])
    except (ArtifactError, OSError) as e:
        return f"target config.json not readable ({e})"
    mt = conf.get("model_type")
    if "text_config" in conf or mt not in SUPPORTED:
        return (f"a known-answer twin is built only for plain decoder families {list(SUPPORTED)}; "
                f"this target is model_type {mt!r}")
    H, nh = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    d = int(conf.get("head_dim") or H // nh)
    if H < d + 2 or d < 4:
        return f"hidden_size {H} < head_dim {d} + 2: no room for the answer, bias and register dims"
    if (conf.get("hidden_act") or "silu") != "silu":
        return f"hidden_act {conf.get('hidden_act')!r}: the twin's constant MLP assumes silu"
    n = int(conf["vocab_size"]) * H * 2 + int(conf["num_hidden_layers"]) * (2 * H * nh * d + 2 * H * d)
    if n > MAX_TWIN_PARAMS:
        return f"the twin would have {n / 1e6:.0f}M parameters (> {MAX_TWIN_PARAMS / 1e6:.0f}M)"
    return None


def _layout(H: int, d: int) -> dict:
    """Answer dims 0..m-1, bias dim m, register dim m+1; the value vector of kv head 0 (d dims)
    carries the answer and the bias dim."""
    m = min(d, H - 1) - 1
    return {"m": m, "bias": m, "reg": m + 1}


# --------------------------------------------------------------------------- the twin target
def build_twin(identity: dict, out_dir: str | Path, seed: int = 0) -> dict:
    """Write the twin (HF checkpoint, the target's tokenizer files, ``known.json``) to
    ``out_dir/model`` and its identity to ``out_dir/identity.json``; return the identity."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eaglet.target.load import identity_of, load_identity

    why = unsupported(identity)
    if why:
        raise ValueError(f"{identity.get('path')}: {why}")
    out = Path(out_dir)
    model_dir, tmp = out / "model", out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src = Path(identity["path"])
    for f in src.iterdir():  # tokenizer, generation config, chat template: the target's own
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth")) \
                and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    conf = _text_config(src)
    conf.update(tie_word_embeddings=False, intermediate_size=TWIN_INTERMEDIATE)
    conf.pop("quantization_config", None)
    for k in ("attention_bias", "mlp_bias"):
        conf.pop(k, None)
    (tmp / "config.json").write_text(json.dumps(conf))
    hf_conf = AutoConfig.from_pretrained(str(tmp))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_conf, dtype=torch.float32).eval()
    V, H, N = hf_conf.vocab_size, hf_conf.hidden_size, hf_conf.num_hidden_layers
    d = getattr(hf_conf, "head_dim", None) or H // hf_conf.num_attention_heads
    lay = _layout(H, d)
    m, bias, reg = lay["m"], lay["bias"], lay["reg"]
    g = torch.Generator().manual_seed(seed)
    # One cycle through the tokenizer's ids (Qwen/Gemma pad the vocabulary past them: padded ids
    # keep zero head rows, logit 0 < the answer's, so they are never greedy).
    n = min(V, _tokenizer_size(tmp) or V)
    order = torch.randperm(n, generator=g)
    pi = torch.arange(V)
    pi[order] = order.roll(-1)
    pi_inv = torch.arange(V)
    pi_inv[pi[:n]] = torch.arange(n)
    a = torch.randn(V, m, generator=g)
    a = a / a.norm(dim=-1, keepdim=True) * math.sqrt(H - 1)   # |E_v| = sqrt(H): rms 1
    w = torch.ones(H)
    w[:m] = -(0.5 + torch.rand(m, generator=g))  # negative, uneven: a norm of ones (or |w|) ranks pi(v) last
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and p.dim() == 1 and p.numel() == H:
                p.fill_(1.0)  # every layer norm (q/k norms of qwen3 have head_dim entries: untouched)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
        emb = model.get_input_embeddings().weight
        emb[:, :m] = a
        emb[:, bias] = 1.0
        for layer in model.model.layers:              # attention stays off: o_proj = 0
            layer.mlp.gate_proj.weight[0, bias] = 4.0
            layer.mlp.up_proj.weight[0, bias] = 1.0
            layer.mlp.down_proj.weight[reg, 0] = 1.0  # + silu(4 n_b) n_b > 0 into the register
        model.model.norm.weight.copy_(w)
        model.get_output_embeddings().weight[:n, :m] = a[pi_inv[:n]] / w[:m]
    # The register values, measured (vLLM computes the same fp32 sums)
    with torch.no_grad():
        hs = model(torch.arange(16)[None] * 7 % V, output_hidden_states=True).hidden_states
    S = [float(h[0, :, reg].mean()) for h in hs[:N]]  # ids 0..N-1 (hidden_states[N] is post-norm)
    spread = max(float(h[0, :, reg].std()) for h in hs[:N])
    if spread > 1e-4 or len({round(s, 6) for s in S}) != N:
        raise RuntimeError(f"twin register not constant per layer or not distinct: {S} (spread {spread})")
    model.save_pretrained(tmp, safe_serialization=True)
    write_json(tmp / KNOWN, {"layout": lay, "register": S, "seed": seed, "pi_head": pi[:8].tolist(),
                             "note": "eaglet known-answer twin: greedy(v) = pi(v)"})
    torch.save(pi, tmp / "pi.pt")
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    ident = identity_of(model_dir, f"{identity.get('name', 'target')}-known-answer-twin",
                        "eaglet.export.contract.known_answer")
    ident["files"] = folder_manifest(model_dir)  # what load_identity checks on every read
    write_json(out / "identity.json", ident)
    return load_identity(out / "identity.json")


def _tokenizer_size(model_dir: Path) -> int | None:
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(str(model_dir)))
    except (OSError, ValueError):
        return None


def successor(twin: dict) -> torch.Tensor:
    """pi: the twin's greedy next token of every token id."""
    return torch.load(Path(twin["path"]) / "pi.pt", weights_only=True)  # never unpickle objects


def chain(twin: dict, last_token: int, n: int) -> list[int]:
    """The twin's greedy continuation of a prompt ending in ``last_token``: pi(x), pi(pi(x)), ..."""
    pi, out, x = successor(twin), [], int(last_token)
    for _ in range(n):
        x = int(pi[x])
        out.append(x)
    return out


def prompt_ids(twin: dict, prompts: list[str]) -> list[list[int]]:
    """Token ids as vLLM's generate() makes them (the tokenizer's own special tokens added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(twin["path"])
    return [tok(p).input_ids for p in prompts]


# --------------------------------------------------------------------------- the drafter
def _qk_scale(cfg, head_dim: int, max_len: int) -> float:
    """gamma such that q = k = gamma * ones scores the own position MIN_MARGIN nats above every
    other position 1..max_len back, with the drafter's own rotary (eaglet.drafter.rope.Rotary)."""
    from eaglet.drafter.rope import Rotary

    rot = Rotary(cfg.rope, head_dim, cfg.num_heads, cfg.max_position_embeddings)
    pos = torch.arange(max_len + 1)[None]
    cos, sin = rot(pos, torch.float64)
    c = torch.ones(1, 1, max_len + 1, head_dim, dtype=torch.float64)
    from eaglet.drafter.eagle3 import rope

    r = rope(c, cos, sin)[0, 0]                            # [L, d]
    scores = (r @ r[0]) / math.sqrt(head_dim)              # relative: position 0 vs 0..max_len
    margin = float(scores[0] - scores[1:].max())
    if margin <= 1e-6:
        raise ValueError(f"RoPE {cfg.rope}: no diagonal peak within {max_len} positions")
    return math.sqrt(MIN_MARGIN / margin)


def build_drafter(twin: dict, identity: dict, path: str | Path, prompts: list[str], *, layer_ids: list[int],
                  max_tokens: int = 64, k: int = 3, draft_vocab_size: int = 1024, max_len: int = 2048,
                  seed: int = 0) -> Path:
    """The known-answer drafter in the trainer's file format (eaglet.drafter.eagle3.save_drafter) for the twin,
    with the shapes and RoPE of a drafter for ``identity`` (the real target). The draft vocabulary
    holds every token of the prompts' greedy chains (max_tokens + k + 2 of them) plus random ids."""
    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter, save_drafter
    from eaglet.target.load import load_target_embedding, validate_layer_ids

    tdir = Path(twin["path"])
    known = read_json(tdir / KNOWN)
    lay, S = known["layout"], known["register"]
    ids = validate_layer_ids([int(i) for i in layer_ids], int(twin["num_layers"]))
    V = int(twin["vocab_size"])
    want = set()
    for p in prompt_ids(twin, prompts):
        want.update(chain(twin, p[-1], max_tokens + k + 2))
    vd = min(max(draft_vocab_size, len(want) + 1), V - 1)
    g = torch.Generator().manual_seed(seed)
    seen = torch.tensor(sorted(want), dtype=torch.long)
    rest = torch.randperm(V, generator=g)
    rest = rest[~torch.isin(rest, seen)][: vd - len(seen)]
    used = torch.cat([seen, rest]).sort().values
    cfg = DrafterConfig.from_identity(identity, draft_vocab_size=vd, layer_ids=ids,
                                      target_digest=twin["digest"])
    H, d = cfg.hidden_size, cfg.head_dim
    m, bias, reg = lay["m"], lay["bias"], lay["reg"]
    emb = load_target_embedding(tdir).float()
    drafter = Eagle3Drafter(cfg, emb)
    gamma = _qk_scale(cfg, d, max_len)
    delta = torch.randn(m, generator=g)
    D = delta / delta.norm() * DECOY * math.sqrt(H)         # the decoy, in the answer space
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.zero_()
        a = drafter.midlayer
        for norm in (a.input_layernorm, a.hidden_norm, a.post_attention_layernorm):
            norm.weight.fill_(1.0)
        drafter.norm.weight.copy_(read_target_tensor(tdir, "model.norm.weight").float())
        drafter.lm_head.weight.copy_(read_target_tensor(tdir, "lm_head.weight", rows=used).float())
        # kv head 0 = rows 0..d-1 of k/v; query head 0 (which reads kv head 0) = rows 0..d-1 of q.
        # Input columns 0..H-1 are the normed embedding (embedding block first), H..2H-1 the hidden.
        a.self_attn.q_proj.weight[:d, bias] = gamma
        a.self_attn.k_proj.weight[:d, bias] = gamma
        a.self_attn.v_proj.weight[:m + 1, :m + 1] = torch.eye(m + 1)
        a.self_attn.o_proj.weight[:m, :m] = torch.eye(m)       # the answer: n(E[x_{t+1}]) on A
        a.self_attn.o_proj.weight[:m, bias] = D                # the decoy (bias dim of v is 1)
        for s, lid in enumerate(ids):                          # fc cancels it from the registers
            drafter.fc.weight[:m, s * H + reg] = -D / (3.0 * S[lid])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    save_drafter(path, drafter, cfg, used - torch.arange(vd), t2d)
    return Path(path)


def write_export(drafter_path: str | Path, twin: dict, out_dir: str | Path) -> Path:
    """Format A (config.json + model.safetensors) with eaglet.export.export's own writer."""
    from eaglet.export import vllm_format

    tensors, cfg = vllm_format.read_trained(drafter_path, twin)
    target_conf = read_json(Path(twin["path"]) / "config.json")
    out = Path(out_dir)
    vllm_format.write_dir(out, vllm_format.vllm_config(cfg, twin, target_conf),
                          vllm_format.export_tensors(tensors, cfg, "midlayer"))
    return out


def break_export(good_dir: str | Path, how: str, out_dir: str | Path) -> Path:
    """A copy of a known-answer export with one deliberate fault (``BREAKAGES``)."""
    from safetensors.torch import load_file, save_file

    if how not in BREAKAGES:
        raise ValueError(f"breakage {how!r}: expected one of {BREAKAGES}")
    good, out = Path(good_dir), Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    conf = read_json(out / "config.json")
    t = load_file(out / "model.safetensors")
    if how == "d2t_shifted":
        d2t = t["d2t"]
        used = torch.arange(len(d2t)) + d2t
        t["d2t"] = used.roll(-1) - torch.arange(len(d2t))  # draft i -> the next used id
    elif how == "layer_ids_minus_one":
        ids = [i - 1 for i in conf["eagle_aux_hidden_state_layer_ids"]]
        conf["eagle_aux_hidden_state_layer_ids"] = ids
        conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
    elif how == "norm_ones":
        t["norm.weight"] = torch.ones_like(t["norm.weight"])
    elif how == "fc_transposed":
        blocks = t["fc.weight"].chunk(3, dim=1)
        if blocks[0].shape[0] != blocks[0].shape[1]:
            raise ValueError("fc blocks are not square (target hidden != draft hidden): no transpose")
        t["fc.weight"] = torch.cat([b.T for b in blocks], dim=1).contiguous()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    write_json(out / "config.json", conf)
    return out
