"""The P-EAGLE drafter (docs/block-drafters.md §3, §8): eaglet's EAGLE-3 drafter trained for *parallel
drafting*, i.e. to propose all K draft tokens of a round in ONE forward, as vLLM 0.32 serves it with
``{"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}``.

The model is :class:`eaglet.drafter.eagle3.Eagle3Drafter` plus one trained parameter
``mask_hidden`` [3·H_t] (an fc input: vLLM projects it once at load, ``fc(mask_hidden)``, through
``combine_hidden_states``). What vLLM computes in one round (``llm_base_proposer`` with
``copy_and_expand_eagle_inputs``, shift on; read from vLLM 0.32's source):

    slot 1      token x_{t+1} (the bonus), hidden g_t = fc(aux_t),  position t      -> drafts x_{t+2}
    slot 1 + d  mask token, hidden fc(mask_hidden),                 position t + d  -> drafts x_{t+2+d}
                (d = 1 .. K − 1)

in one causal forward over the request's draft KV cache: the cache at positions < t holds the real
entries (x_{p+1}, g_p) written by earlier rounds (mask slots of earlier rounds sit at positions the
next round's real tokens overwrite), so slot 1 + d attends to the real entries 0 .. t and to slots
2 .. 1 + d of its own chain, never to a later real token. The residual of a masked slot is its
hidden, fc(mask_hidden), as for any EAGLE-3 input. The drafts are the argmax of the K slots.

This is the TTT unroll's attention pattern (eaglet.drafter.eagle3.ttt_unroll, ttt_attention) with the
inputs of steps d ≥ 1 replaced by (mask token, fc(mask_hidden)) instead of (x_{t+1+d}, the drafter's
own previous hidden): :meth:`PEagleDrafter.parallel_unroll` computes every depth at every position in
K passes (depth 0 is EAGLE-3's step 0 exactly).

Objective (:class:`PEagleObjective`): depth d at index t is trained on the target's greedy token at
t + 2 + d (the EAGLE-3 trainer's labels: the store's ``target_top1`` of position t + 1 + d; the loss
mask: position t + 1 + d counts), cross-entropy over the draft vocabulary. SpecForge's P-EAGLE
("conditional-on-distribution" sampling) keeps every depth-0 position and, at depth d, a random
subset of ratio max(0.7^d, 0.2) (:func:`depth_keep_ratio`); here every depth is computed densely
(one pass per depth, as the TTT unroll), so the subset only selects which positions count in depth d's
loss; each depth's loss is its mean over the counted positions, and the depths are summed with
equal weight (a rejected slot ends the round, but each depth's mean is already over positions whose
earlier slots are not required to be right: the weighting of deeper depths is the sampling ratio's).

    cfg = PEagleConfig.from_identity(identity, draft_vocab_size=V_d, layer_ids=[2, 4, 5],
                                     mask_token_id=m, parallel_k=3)
    model = PEagleDrafter(cfg, embed_weight)
    for d, logits, _ in model.parallel_unroll(x_BT, g_BTH): ...   # depth d at index t drafts x_{t+2+d}
    drafts = model.draft_parallel(x_prefix, g_prefix)             # one vLLM round: K target ids
    model.parallel_chain_along(aux_SN, x, prompt_len, max_tokens, d2t)  # vLLM's T = 0 counters

Shape suffixes as eaglet.drafter.eagle3.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.base.artifacts import ArtifactError
from eaglet.base.tensors import load_tensors, save_tensors, tensor_metadata
from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter, KVCache, config_from_dict
from eaglet.drafter.ttt_attention import ttt_attention

META_KEY = "eaglet_p_eagle"


@dataclasses.dataclass
class PEagleConfig(DrafterConfig):
    mask_token_id: int = 0  # the token id of slots 2 .. K (vLLM's parallel_drafting_token_id)
    parallel_k: int = 3  # K: tokens drafted in one forward = vLLM's num_speculative_tokens

    def __post_init__(self):
        if not 0 <= int(self.mask_token_id) < int(self.vocab_size):
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary 0 .. {self.vocab_size - 1}")
        if int(self.parallel_k) < 1:
            raise ValueError(f"parallel_k {self.parallel_k} < 1")

    @classmethod
    def from_json(cls, text: str, where: str = "config") -> PEagleConfig:
        import json

        return config_from_dict(cls, json.loads(text), where, "P-EAGLE drafter")


def depth_keep_ratio(d: int) -> float:
    """SpecForge's P-EAGLE sampling ratio: depth 0 keeps every position, depth d a random max(0.7^d, 0.2)."""
    return 1.0 if d == 0 else max(0.7**d, 0.2)


class PEagleDrafter(Eagle3Drafter):
    def __init__(self, cfg: PEagleConfig, embed_weight: torch.Tensor | None = None):
        super().__init__(cfg, embed_weight)
        self.mask_hidden = nn.Parameter(0.02 * torch.randn(3 * cfg.target_hidden_size))

    def mask_state(self) -> torch.Tensor:
        """fc(mask_hidden) [H]: the hidden (and residual) of every masked slot, as vLLM's
        ``combine_hidden_states(mask_hidden)`` at load (with input_norm under norm_before_fc)."""
        return self.project(self.mask_hidden.view(1, 1, -1))[0, 0]

    # ----------------------------------------------------------------- training forward
    def parallel_unroll(
        self, x_BT: torch.Tensor, g_BTH: torch.Tensor, steps: int | None = None, attention=None, logits_at=None
    ):
        """Yield ``(d, logits_d, h_d)`` for depth d = 0 .. K − 1 over whole sequences: depth 0 at index
        t reads x_{t+1}, g_t at position t (EAGLE-3's step 0); depth d ≥ 1 at index t reads the mask
        token and fc(mask_hidden) at position t + d; its query sees depth-0 keys 0 .. t and the depth
        1 .. d keys of index t (vLLM's round from t). ``logits_at`` as Eagle3Drafter.ttt_unroll."""
        attend = attention or ttt_attention
        K = int(steps or self.cfg.parallel_k)
        B, T = x_BT.shape
        pos0 = torch.arange(T, device=x_BT.device).expand(B, T)
        ids = torch.zeros_like(x_BT)
        ids[:, : T - 1] = x_BT[:, 1:]
        q, k0, v0 = self._qkv(ids, g_BTH, pos0)
        k0, v0 = self._rep(k0), self._rep(v0)
        att = F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
        logits, h = self._out(self._finish(att, g_BTH), None if logits_at is None else logits_at(0))
        yield 0, logits, h
        if K == 1:
            return
        hid = self.mask_state().to(g_BTH.dtype).expand(B, T, -1)
        mids = torch.full_like(x_BT, int(self.cfg.mask_token_id))
        dk, dv = [], []
        for d in range(1, K):
            q, kk, vv = self._qkv(mids, hid, pos0 + d)
            dk.append(self._rep(kk))
            dv.append(self._rep(vv))
            att = attend(q, k0, v0, dk, dv)
            logits, h = self._out(self._finish(att, hid), None if logits_at is None else logits_at(d))
            yield d, logits, h

    # ----------------------------------------------------------------- serving
    @torch.no_grad()
    def parallel_logits(
        self, x_prefix: list[int] | torch.Tensor, g_PH: torch.Tensor, steps: int | None = None
    ) -> torch.Tensor:
        """One vLLM round from scratch -> the K slots' logits [K, V_d]. ``x_prefix`` = x_0 .. x_{t+1}
        (x_{t+1} the bonus token), ``g_PH`` = g_0 .. g_t (fc of the aux states, t + 1 rows). One
        causal forward over the real slots (x_{p+1}, g_p) at positions 0 .. t and the K − 1 masked
        slots at t + 1 .. t + K − 1: the query vLLM builds (its cache holds the same real entries)."""
        K = int(steps or self.cfg.parallel_k)
        x = torch.as_tensor(x_prefix, dtype=torch.long)
        t = g_PH.shape[0] - 1
        if x.shape[0] != t + 2:
            raise ValueError(f"{x.shape[0]} tokens for {t + 1} hidden states: x_0 .. x_(t+1) needed")
        ids = torch.cat([x[1:], torch.full((K - 1,), int(self.cfg.mask_token_id), dtype=torch.long)])
        hid = torch.cat([g_PH, self.mask_state().to(g_PH.dtype).expand(K - 1, -1)])
        logits, _ = self.forward_step(ids[None], hid[None], torch.arange(t + K)[None])
        return logits[0, t:]

    @torch.no_grad()
    def parallel_logits_slow(self, x_prefix, g_PH: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """:meth:`parallel_logits` built position by position through a KV cache (the reference: each
        slot's keys appended, then its query over every cached key at a position ≤ its own)."""
        K = int(steps or self.cfg.parallel_k)
        x = torch.as_tensor(x_prefix, dtype=torch.long)
        t = g_PH.shape[0] - 1
        cache, out = KVCache(), []
        mh = self.mask_state().to(g_PH.dtype)
        for p in range(t + K):
            tok, h = (x[p + 1], g_PH[p]) if p <= t else (torch.tensor(int(self.cfg.mask_token_id)), mh)
            logits, _ = self.forward_step(tok.view(1, 1), h.view(1, 1, -1), torch.tensor([[p]]), cache)
            if p >= t:
                out.append(logits[0, 0])
        return torch.stack(out)

    def draft_parallel(
        self, x_prefix, g_PH: torch.Tensor, d2t: torch.Tensor | None = None, steps: int | None = None
    ) -> list[int]:
        """The K drafts of one round (:meth:`parallel_logits`' argmax) as target ids (i + d2t[i])."""
        i = self.parallel_logits(x_prefix, g_PH, steps).argmax(-1)
        return (i if d2t is None else i + d2t[i]).tolist()

    @torch.no_grad()
    def parallel_chain_along(
        self, aux_SN: torch.Tensor, x: list[int], prompt_len: int, max_tokens: int, d2t: torch.Tensor | None = None
    ) -> dict:
        """The rounds vLLM's parallel-drafting EAGLE proposer runs at T = 0 along a fixed greedy
        continuation (the target's own output: every draft is judged against it). ``x`` = prompt +
        at least max_tokens + K − 1 tokens; ``aux_SN`` the target's aux states of x (teacher-forced,
        [S, 3·H_t], S ≥ P + max_tokens − 2). At start g (tokens emitted so far) the bonus token is
        x[P + g − 1], i.e. the round is index t = P + g − 2 of :meth:`parallel_unroll` (all starts in
        K passes), drafts judged against x[P + g ..]. Rounds by eaglet.drafter.chain.served_rounds,
        counts by chain_counts (vLLM's counters). Returns {"rounds", "counts"}."""
        from eaglet.drafter.chain import accepted_prefix, chain_counts, served_rounds

        K, P = int(self.cfg.parallel_k), prompt_len
        if len(x) < P + max_tokens + K - 1:
            raise ValueError(
                f"{len(x) - P} continuation tokens: the chain over {max_tokens} tokens at "
                f"K = {K} needs {max_tokens + K - 1}"
            )
        S = P + max_tokens - 1  # the last round's index t = S - 2 reads x_{t+1} = x[S - 1] and g_t
        if aux_SN.shape[0] < S - 1:
            raise ValueError(f"aux states of {aux_SN.shape[0]} positions: the last round needs {S - 1}")
        xs = torch.tensor(x[:S])[None]
        aux = aux_SN[:S]
        if aux.shape[0] < S:  # the last index's aux state is never read by a round
            aux = torch.cat([aux, aux.new_zeros(S - aux.shape[0], aux.shape[1])])
        g = self.eval().project(aux.reshape(1, S, -1))
        cols = []
        for _, logits, _ in self.parallel_unroll(xs, g, K):
            i = logits[0].argmax(-1)
            cols.append(i if d2t is None else i + d2t[i])
        drafts_TK = torch.stack(cols, -1).tolist()
        starts = list(range(1, max_tokens))
        dr = {g_: drafts_TK[P + g_ - 2] for g_ in starts}
        at = {g_: accepted_prefix(dr[g_], x[P + g_ : P + g_ + K]) for g_ in starts}
        rounds = [{"g": g_, "drafts": dr[g_], "accepted": at[g_]} for g_ in served_rounds(at, max_tokens)]
        return {"rounds": rounds, "counts": chain_counts([(r["g"], K, r["accepted"]) for r in rounds])}


# --------------------------------------------------------------------------- the objective
def depth_targets(labels_BT: torch.Tensor, valid_BT: torch.Tensor, d: int):
    """(labels [B, T], counted [B, T]) of depth d at index t: the label of position t + 1 + d
    (``labels_BT[s]`` = the target's greedy token after position s, i.e. x_{s+1} in regenerated data;
    ``valid_BT[s]`` = it counts), nothing past the end."""
    B, T = labels_BT.shape
    lab = torch.zeros_like(labels_BT)
    ok = torch.zeros_like(valid_BT, dtype=torch.bool)
    n = T - 1 - d
    if n > 0:
        lab[:, :n] = labels_BT[:, 1 + d :]
        ok[:, :n] = valid_BT[:, 1 + d :].bool()
    return lab, ok


class PEagleObjective(nn.Module):
    """Drafter + P-EAGLE loss in one module (one forward per micro-batch, as TTTObjective).

    forward(x_BT, aux_BT3H, labels_BT, valid_BT, t2d, generator=None) -> (loss, stats [3, K])
    ``labels_BT[s]``: the target token wanted after position s (the target's greedy top-1 at s);
    ``valid_BT[s]``: it counts (an assistant position); ``t2d`` [V] bool: the draft vocab (labels
    outside it do not count). Depth d at index t predicts ``labels[t + 1 + d]``. ``generator``: the
    depth subsets of ratio :func:`depth_keep_ratio` (None = every position counts at every depth,
    e.g. validation). stats rows: loss, correct, counted per depth."""

    def __init__(self, drafter: PEagleDrafter, sample_depths: bool = True):
        super().__init__()
        self.drafter, self.sample_depths = drafter, sample_depths

    def forward(self, x_BT, aux_BT3H, labels_BT, valid_BT, t2d, generator: torch.Generator | None = None):
        dr = self.drafter
        K = int(dr.cfg.parallel_k)
        t2d = t2d.to(x_BT.device).bool()
        draft_index = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft index (where t2d)
        counted = []
        for d in range(K):
            lab, ok = depth_targets(labels_BT, valid_BT, d)
            ok = ok & t2d[lab]
            if generator is not None and self.sample_depths and d > 0:
                keep = torch.rand(ok.shape, generator=generator) < depth_keep_ratio(d)
                ok = ok & keep.to(ok.device)
            counted.append((draft_index[lab], ok))
        g = dr.project(aux_BT3H)
        loss = g.new_zeros((), dtype=torch.float32)
        stats = torch.zeros(3, K, device=x_BT.device)
        for d, logits, _ in dr.parallel_unroll(x_BT, g, K, logits_at=lambda d: counted[d][1]):
            lab, ok = counted[d]
            if not bool(ok.any()):
                loss = loss + 0.0 * logits.sum()  # every parameter stays in the graph
                continue
            L = F.cross_entropy(logits.float(), lab[ok])
            loss = loss + L
            with torch.no_grad():
                stats[0, d] = L.detach()
                stats[1, d] = (logits.argmax(-1) == lab[ok]).sum()
                stats[2, d] = ok.sum()
        return loss, stats


# --------------------------------------------------------------------------- files
def save_p_eagle(
    path: str | Path, model: PEagleDrafter, cfg: PEagleConfig, d2t: torch.Tensor, t2d: torch.Tensor
) -> None:
    """The trainer's file: the export-named tensors (fp32, mask_hidden among them) + d2t/t2d + config."""
    tensors = {k: v.detach().float().cpu() for k, v in model.trainable_state_dict().items()}
    tensors["d2t"] = d2t.to(torch.int64).cpu()
    tensors["t2d"] = t2d.to(torch.bool).cpu()
    save_tensors(path, tensors, metadata={META_KEY: cfg.to_json()})


def load_p_eagle(path: str | Path, embed_weight: torch.Tensor, map_location: str = "cpu"):
    """(model, cfg, d2t, t2d) from :func:`save_p_eagle`'s file; the model in eval mode."""
    path = Path(path)
    meta = tensor_metadata(path) if path.exists() else None
    if not meta or META_KEY not in meta:
        raise ArtifactError(f"{path}: not a P-EAGLE drafter file (no {META_KEY!r} metadata)")
    cfg = PEagleConfig.from_json(meta[META_KEY], where=str(path))
    tensors = load_tensors(path, device=map_location)
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    model = PEagleDrafter(cfg, embed_weight)
    want = set(model.trainable_state_dict())
    if set(tensors) != want:
        raise ArtifactError(
            f"{path}: tensors missing {sorted(want - set(tensors))}, unexpected {sorted(set(tensors) - want)}"
        )
    model.load_state_dict({**tensors, "embed_tokens.weight": model.embed_tokens.weight}, strict=True)
    return model.to(map_location).eval(), cfg, d2t, t2d
