"""The EAGLE-3 drafter (docs/eagle3.md §2) in one file, shared by train, export and evaluate.

Parameter names are exactly vLLM's export names (docs/eagle3.md §6), so the trained state dict *is*
the export (minus the frozen ``embed_tokens.weight``, which engines share with the target):

    fc.weight                                   [H, 3*H_t]  over concat(aux low, mid, high)
    midlayer.self_attn.{q,k,v}_proj.weight      [heads*d, 2H]  read cat(embed, hidden): EMBED FIRST
    midlayer.self_attn.o_proj.weight            [H, heads*d]
    midlayer.mlp.{gate,up}_proj.weight [I, H], midlayer.mlp.down_proj.weight [H, I]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight  [H]
    norm.weight [H], lm_head.weight [V_d, H]
    input_norm.weight [3*H_t]                   only with cfg.norm_before_fc (vLLM's name)
    embed_tokens.weight [V, H]   frozen copy of the target's, never saved

API
    cfg = DrafterConfig.from_identity(identity, draft_vocab_size=V_d, layer_ids=[2, 4, 5])
    model = Eagle3Drafter(cfg, embed_weight)          # embed_weight: target embedding [V, H]
    g_BTH = model.project(aux_BT3H)                     # fc over the three aux states
    logits_BTVd, h_BTH = model.forward_step(ids_BT, hidden_BTH, pos_BT, cache=None)
        # one draft step: q/k/v read cat(input_layernorm(embed(ids)), hidden_norm(hidden)),
        # residual = hidden (un-normed); h is the PRE-norm output fed to the next draft step;
        # logits = lm_head(norm(h)) over the draft vocab (target id = i + d2t[i]).
        # cache=None: causal attention over the T inputs. cache=KVCache(): keys/values of the
        # inputs are appended first and each query sees every cached key at a position <= its own.
    for k, logits_k, h_k in model.ttt_unroll(x_BT, g_BTH, steps): ...
        # the training-time-test unroll (docs/eagle3.md §3) over a whole sequence x, see ttt_unroll.
        # On the target's own greedy continuation x it is also the offline greedy-chain
        # simulation: from index t, draft k is accepted iff drafts 0..k all hit, i.e.
        # argmax(logits_j[t]) + d2t[...] == x[t+2+j] for every j <= k (teacher forcing = the
        # inputs a real chain sees while it keeps being accepted).
    model, cfg, d2t, t2d = load_drafter("results/RUN/train/drafter.safetensors", identity)
        # identity: the target's (eaglet.target.load.load_identity); the file holds no path, only the
        # target's digest, checked against it: a drafter file can be moved or copied anywhere
    save_drafter(path, model, cfg, d2t, t2d)
    W = read_target_tensor(model_dir, "lm_head.weight", rows=idx)   # rows of a target tensor

Incremental drafting with a cache (greedy chain, one sequence):
    cache = KVCache()
    logits, h = model.forward_step(x[None, 1:n+1], g[None, :n], arange(n)[None], cache)  # prefill
    tok, hid, p = logits[0, -1].argmax(), h[:, -1:], n - 1
    for j in 1..k: logits, hid = model.forward_step(tok_target_id[None, None], hid, [[p + j]], cache)
    cache.truncate(m)   # drop the entries of rejected drafts before the next round

Shape suffixes: B batch, T tokens, H draft hidden, H_t target hidden, V_d draft vocab,
h heads, g kv heads, L cached keys, d head dim.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.base.artifacts import ArtifactError
from eaglet.base.tensors import load_tensors, save_tensors, tensor_metadata
from eaglet.drafter.rope import Rotary, drafter_rope

# the TTT attention lives in its own module; re-exported (tests and eaglet.planner.plan's notes name it here)
from eaglet.drafter.ttt_attention import ttt_attention
from eaglet.target.load import load_target_embedding

META_KEY = "eaglet"


@dataclasses.dataclass
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int            # target vocabulary V
    draft_vocab_size: int      # V_d
    layer_ids: list[int]       # aux layers, vLLM convention (HF hidden_states index)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    target_digest: str = ""    # the target it was trained for (its identity digest); no path: relocatable
    ttt_steps: int = 7
    # Flat RoPE config (eaglet.drafter.rope.drafter_rope of the target); None = plain RoPE at rope_theta
    # (drafters written before this key existed).
    rope_parameters: dict | None = None
    # Architecture variants (speculators / EAGLE-3.1; vLLM's llama_eagle3 reads the same names from
    # the exported config.json). All False = the EAGLE-3 drafter of docs/eagle3.md §2.
    norm_before_fc: bool = False        # RMSNorm ``input_norm`` [3*H_t] over concat(aux) before fc
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not the raw hidden
    norm_output: bool = False           # the hidden fed to the next draft step is norm(h), not h

    @property
    def rope(self) -> dict:
        return dict(self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta})

    @classmethod
    def from_identity(cls, identity: dict, draft_vocab_size: int, layer_ids: list[int],
                      **overrides) -> DrafterConfig:
        """Shapes from the target (draft hidden = target hidden, so the embedding is shared)."""
        h = int(identity["hidden_size"])
        rope = identity.get("drafter_rope") or rope_from_target(identity)
        kw = dict(hidden_size=h, target_hidden_size=h, num_heads=int(identity["num_heads"]),
                  num_kv_heads=int(identity.get("num_kv_heads") or identity["num_heads"]),
                  head_dim=int(identity.get("head_dim") or h // int(identity["num_heads"])),
                  intermediate_size=int(identity["intermediate_size"]),
                  vocab_size=int(identity["vocab_size"]), draft_vocab_size=int(draft_vocab_size),
                  layer_ids=[int(i) for i in layer_ids],
                  rms_norm_eps=float(identity.get("rms_norm_eps") or 1e-6),
                  rope_theta=float(rope["rope_theta"]) if rope else float(identity.get("rope_theta") or 1e4),
                  rope_parameters=rope,
                  # the drafter's own MLP, whatever the target's: vLLM's Llama MLP takes only silu
                  # (a Gemma target's gelu_pytorch_tanh would not load)
                  hidden_act="silu",
                  max_position_embeddings=int(identity.get("max_position_embeddings") or 4096),
                  target_digest=str(identity.get("digest", "")))
        kw.update(overrides)
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "config") -> DrafterConfig:
        d = json.loads(text)
        d.pop("target_path", None)  # files written before drafters were relocatable; never read
        return config_from_dict(cls, d, where, "drafter")


def config_from_dict(cls, d: dict, where: str, what: str):
    """A drafter config dataclass from its recorded dict, refused naming the file when a key is
    unknown or a required one missing (a drafter of another eaglet version or kind)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown, missing = set(d) - names, {f.name for f in dataclasses.fields(cls)
                                        if f.default is dataclasses.MISSING} - set(d)
    if unknown or missing:
        raise ArtifactError(f"{where}: {what} config has unknown keys {sorted(unknown)} or lacks {sorted(missing)}")
    return cls(**d)


def rope_from_target(identity: dict) -> dict | None:
    """The drafter RoPE from the target's config.json (None when the checkpoint is not at hand)."""
    conf = Path(str(identity.get("path", ""))) / "config.json"
    if not identity.get("path") or not conf.is_file():
        return None
    return drafter_rope(json.loads(conf.read_text()))


# --------------------------------------------------------------------------- blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in fp32 as HF/vLLM do, so bf16 training matches the fp32 engines closely.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(x_BhTd, cos_BTd, sin_BTd):
    """Rotate-half (NeoX) RoPE, the layout of HF Llama checkpoints and vLLM's llama."""
    x1, x2 = x_BhTd.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x_BhTd * cos_BTd[:, None] + rot * sin_BTd[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        hd = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r}: only silu is implemented")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer; named ``midlayer`` because every vLLM/SGLang version reads it."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class KVCache:
    """Append-only keys/values (post-RoPE) with their positions, for incremental drafting."""

    def __init__(self):
        self.k_BgLd: torch.Tensor | None = None
        self.v_BgLd: torch.Tensor | None = None
        self.pos_BL: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.pos_BL is None else self.pos_BL.shape[1]

    def append(self, k_BgTd, v_BgTd, pos_BT):
        if self.pos_BL is None:
            self.k_BgLd, self.v_BgLd, self.pos_BL = k_BgTd, v_BgTd, pos_BT
        else:
            self.k_BgLd = torch.cat([self.k_BgLd, k_BgTd], dim=2)
            self.v_BgLd = torch.cat([self.v_BgLd, v_BgTd], dim=2)
            self.pos_BL = torch.cat([self.pos_BL, pos_BT], dim=1)

    def truncate(self, n: int):
        """Keep the first ``n`` entries (drop the keys of rejected draft tokens)."""
        if self.pos_BL is not None:
            self.k_BgLd, self.v_BgLd = self.k_BgLd[:, :, :n], self.v_BgLd[:, :, :n]
            self.pos_BL = self.pos_BL[:, :n]


# --------------------------------------------------------------------------- the drafter
class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(f"embedding shape {tuple(embed_weight.shape)} != "
                                 f"({cfg.vocab_size}, {cfg.hidden_size})")
            with torch.no_grad():
                self.embed_tokens.weight.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)  # shared with the target by every engine
        if cfg.norm_before_fc:  # absent otherwise: the default's tensor set is unchanged
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # transformers' own Llama rotary over the exported RoPE config (eaglet.drafter.rope): every rope type
        # it knows, trained exactly as the engines will apply it.
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.num_heads, cfg.max_position_embeddings)
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that is saved: the export tensors, without the frozen embedding."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}

    # ----------------------------------------------------------------- pieces
    def project(self, aux_BT3H: torch.Tensor) -> torch.Tensor:
        """fc over concat(aux[..., 0, :], aux[..., 1, :], aux[..., 2, :]) (ascending layer ids)."""
        B, T = aux_BT3H.shape[:2]
        x = aux_BT3H.reshape(B, T, -1).to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:  # one RMSNorm over the whole concat, as vLLM's input_norm
            x = self.input_norm(x)
        return self.fc(x)

    def logits(self, h_BTH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h_BTH))

    def _out(self, h_BTH: torch.Tensor, at_BT: torch.Tensor | None = None):
        """(logits, the hidden fed to the next draft step): pre-norm h, or norm(h) (norm_output).
        ``at_BT`` (bool): the logits at those positions only, [N, V_d] in row-major order (the head
        is per position, so they equal the full logits there)."""
        if not self.cfg.norm_output:
            return self.logits(h_BTH if at_BT is None else h_BTH[at_BT]), h_BTH
        n = self.norm(h_BTH)
        return self.lm_head(n if at_BT is None else n[at_BT]), n

    def _qkv(self, ids_BT, hidden_BTH, pos_BT):
        a, c = self.midlayer, self.cfg
        x = torch.cat([a.input_layernorm(self.embed_tokens(ids_BT).to(hidden_BTH.dtype)),
                       a.hidden_norm(hidden_BTH)], dim=-1)  # embedding block FIRST (docs/eagle3.md §2)
        B, T, _ = x.shape
        q = a.self_attn.q_proj(x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = a.self_attn.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = a.self_attn.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rotary(pos_BT, q.dtype)  # [B, T, d]
        return rope(q, cos, sin), rope(k, cos, sin), v

    def _rep(self, kv_BgTd):
        n = self.cfg.num_heads // self.cfg.num_kv_heads
        return kv_BgTd if n == 1 else kv_BgTd.repeat_interleave(n, dim=1)

    def _finish(self, att_BhTd, hidden_BTH):
        a = self.midlayer
        B, _, T, _ = att_BhTd.shape
        res = a.hidden_norm(hidden_BTH) if self.cfg.norm_before_residual else hidden_BTH
        h = res + a.self_attn.o_proj(att_BhTd.transpose(1, 2).reshape(B, T, -1))
        return h + a.mlp(a.post_attention_layernorm(h))  # pre-norm output

    # ----------------------------------------------------------------- one draft step
    def forward_step(self, input_ids_BT, hidden_BTH, position_ids_BT, cache: KVCache | None = None):
        """One draft step; returns (logits_BTVd, hidden_BTH for the next step: pre-norm, or normed
        with cfg.norm_output). See the module docstring."""
        q, k, v = self._qkv(input_ids_BT, hidden_BTH, position_ids_BT)
        if cache is None:
            att = F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), is_causal=True)
        else:
            cache.append(k, v, position_ids_BT)
            mask = cache.pos_BL[:, None, None, :] <= position_ids_BT[:, None, :, None]
            att = F.scaled_dot_product_attention(q, self._rep(cache.k_BgLd), self._rep(cache.v_BgLd),
                                                 attn_mask=mask)
        return self._out(self._finish(att, hidden_BTH))

    forward = forward_step

    # ----------------------------------------------------------------- training-time test
    def ttt_unroll(self, x_BT: torch.Tensor, g_BTH: torch.Tensor, steps: int, attention=None, logits_at=None):
        """Yield ``(k, logits_k_BTVd, h_k_BTH)`` for k = 0..steps-1 over whole sequences x.
        ``logits_at``: k -> bool [B, T] or None; the head runs at those positions of step k only and
        its logits come as [N, V_d] (the training step's counted positions: the head and the
        softmax over V_d are the step's largest per-position cost, and padding or prompt positions
        read none of it).

        Alignment (docs/eagle3.md §3; vLLM feeds the drafter the target's hidden state at position t
        together with the NEXT token): at index t, step 0 reads g_t = fc(aux_t) and x_{t+1} at
        RoPE position t and drafts x_{t+2}, i.e. it should match the target's logits at t+1.
        Step k reads the drafter's own step-(k-1) hidden at t, token x_{t+1+k} (teacher forcing;
        0 past the end) at position t+k, drafts x_{t+2+k} (target logits at t+1+k).
        Its query attends to step-0 keys 0..t (causal) plus the keys of steps 1..k at index t
        (the diagonal), exactly the keys a real draft chain from position t has in its cache.
        Right-padded batches need no padding mask: causal queries never reach later pads.
        Memory is linear in T (issue 14): see ``ttt_attention``. ``attention`` replaces it (same
        arguments) for tests that compare it with a dense reference.
        """
        attend = attention or ttt_attention
        B, T = x_BT.shape
        pos0 = torch.arange(T, device=x_BT.device).expand(B, T)
        hidden = g_BTH
        k0 = v0 = None
        diag_k, diag_v = [], []
        for k in range(steps):
            ids = torch.zeros_like(x_BT)
            if T > 1 + k:
                ids[:, :T - 1 - k] = x_BT[:, 1 + k:]
            q, kk, vv = self._qkv(ids, hidden, pos0 + k)
            if k == 0:
                k0, v0 = self._rep(kk), self._rep(vv)
                att = F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
            else:
                diag_k.append(self._rep(kk))
                diag_v.append(self._rep(vv))
                att = attend(q, k0, v0, diag_k, diag_v)
            logits, hidden = self._out(self._finish(att, hidden), None if logits_at is None else logits_at(k))
            yield k, logits, hidden


# --------------------------------------------------------------------------- files
def save_drafter(path: str | Path, model: Eagle3Drafter, cfg: DrafterConfig,
                 d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write train/drafter.safetensors: export-named tensors (fp32) + d2t/t2d + config metadata."""
    tensors = {k: v.detach().float().cpu() for k, v in model.trainable_state_dict().items()}
    tensors["d2t"] = d2t.to(torch.int64).cpu()
    tensors["t2d"] = t2d.to(torch.bool).cpu()
    save_tensors(path, tensors, metadata={META_KEY: cfg.to_json()})


def load_drafter(path: str | Path, target: dict, map_location: str = "cpu",
                 embed_weight: torch.Tensor | None = None):
    """Read a drafter file for the target whose identity (eaglet.target.load.load_identity) is given:
    the file names no target path (it can be moved), only the digest of the target it was trained
    for, which must be ``target["digest"]``; the frozen embedding is read from ``target["path"]``
    unless ``embed_weight`` is given. Returns ``(model, cfg, d2t, t2d)``; the model is in eval mode."""
    path = Path(path)
    meta = tensor_metadata(path) if path.exists() else None
    if meta is None:
        raise ArtifactError(f"{path}: missing")
    if META_KEY not in meta:
        raise ArtifactError(f"{path}: no {META_KEY!r} metadata (not written by eaglet.train.train)")
    cfg = DrafterConfig.from_json(meta[META_KEY], where=str(path))
    tensors = load_tensors(path, device=map_location)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if d2t is None or t2d is None:
        raise ArtifactError(f"{path}: missing d2t/t2d")
    if cfg.target_digest and cfg.target_digest != target.get("digest"):
        raise ArtifactError(f"{path}: trained for target {cfg.target_digest[:12]}, not "
                            f"{str(target.get('digest'))[:12]} ({target.get('name')} at {target.get('path')})")
    if embed_weight is None:
        tp = Path(str(target.get("path", "")))
        if not target.get("path") or not tp.is_dir():
            raise ArtifactError(f"{path}: target checkpoint {tp} (the identity's path) not found; "
                                "the drafter shares the target's embedding")
        embed_weight = load_target_embedding(tp)
    model = Eagle3Drafter(cfg, embed_weight)
    want = set(model.trainable_state_dict())
    if set(tensors) != want:
        raise ArtifactError(f"{path}: tensors missing {sorted(want - set(tensors))}, "
                            f"unexpected {sorted(set(tensors) - want)}")
    model.load_state_dict({**tensors, "embed_tokens.weight": model.embed_tokens.weight}, strict=True)
    return model.to(map_location).eval(), cfg, d2t.to(map_location), t2d.to(map_location)
