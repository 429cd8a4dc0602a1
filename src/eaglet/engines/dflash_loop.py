"""A DFlash drafter as the proposer of the HF speculative loop (eaglet.engines.hf_loop ``speculative`` at
T = 0, ``speculative_sampling`` at T > 0): drafter.kind dflash's timed loop (docs/block-drafters.md §6).

    proposer = DFlashProposer(drafter, embed_VH, head_VH)            # the target's frozen embedding and head
    hf_loop.speculative(target, proposer, prompt_ids, k, max_new)     # k <= block_size - 1

It has :class:`eaglet.engines.hf_loop.EagleProposer`'s interface (reset / extend / draft /
draft_sampled / target_probs / step_times / margins) and drafts as vLLM's DFlash proposer does
(vllm/v1/spec_decode/dflash.py, read for facts), one drafter forward per round:

- ``extend(aux, next_ids)`` is told the taps of the positions the target just verified and the
  token after each. The context of a round is the taps of every verified position before the bonus
  token (the last token the target emitted, at position n = the positions seen so far). Its
  projected K/V, per layer ``K = RoPE(k_norm(k_proj(ctx)))``, ``V = v_proj(ctx)`` with ``ctx =
  hidden_norm(fc(taps))`` (eaglet.drafter.dflash.DFlashDrafter.context_kv), are cached and only the
  new positions are computed each round, as vLLM's ``precompute_and_store_context_kv`` writes the
  verified tokens' K/V into its cache: a round's drafter cost does not grow with the text but for
  the attention over the cached K/V. Drafts never enter the cache (the context is verified positions
  only), so nothing is rolled back.
- ``draft(k)`` runs the block [bonus, mask × (block_size − 1)] at positions n .. n + block_size − 1
  through the layers (non-causal: every query sees the whole context and the whole block), and the
  drafts are the argmax of block positions 1 .. k: for k < block_size − 1 the block's first k (the
  block is always whole, so a draft does not depend on k): the round that
  eaglet.drafter.dflash.DFlashDrafter.draft_block and block_chain_along compute at that bonus position.
- ``draft_sampled(k, T, gen)`` at T > 0 follows vLLM's ``draft_sample_method``
  (eaglet.eval.dflash_offline's docstring): "probabilistic" (the default here, as the EAGLE-3
  proposer's: the HF loop draws drafts from q) draws draft j from q_j = softmax(block logits_j / T)
  and returns q, so the loop's exact verification (hf_loop.verify_exact) accepts it with min(1, p/q)
  and resamples a rejection from normalize(max(0, p − q)); "greedy" drafts argmax q_j and returns
  q as one-hot at that draft, so the same verification accepts it with probability p(draft) and
  resamples a rejection from p without the draft: vLLM's rule for greedy drafts, lossless as well.
  A block's q_j depend only on the context and the bonus token, never on the earlier drafts.

``step_times``: seconds of every drafter call after the prompt's prefill (each ``extend``, the
context K/V of the newly verified positions, and each block forward); ``margins``: the top-2 gap of
every greedy draft's logits.

Shape suffixes: B block size, K = B − 1, V vocabulary, H hidden, g kv heads, S cached context, d head dim.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from eaglet.drafter.dflash import DFlashDrafter
from eaglet.engines.hf_loop import draw, margin, probs

# vLLM's SpeculativeConfig.draft_sample_method values (eaglet.drafter.chain.ACCEPT names the same rules)
SAMPLE_METHODS = ("probabilistic", "greedy")


class DFlashProposer:
    """One DFlash round per ``draft``; the verified context's K/V cached across rounds (the module docstring)."""

    def __init__(self, drafter: DFlashDrafter, embed_VH: torch.Tensor, head_VH: torch.Tensor,
                 sample_method: str = "probabilistic"):
        if sample_method not in SAMPLE_METHODS:
            raise ValueError(f"draft sample method {sample_method!r}: expected one of {SAMPLE_METHODS}")
        self.m, self.cfg = drafter.eval(), drafter.cfg
        dtype = drafter.fc.weight.dtype
        self.embed, self.head = embed_VH.to(dtype), head_VH.to(dtype)
        self.sample_method = sample_method
        self.K = self.cfg.block_size - 1
        self.step_times: list[float] = []
        self.reset()

    def reset(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (K [1,g,S,d], V [1,g,S,d])
        self.n, self.bonus = 0, None
        self.margins: list[float] = []

    @torch.inference_mode()
    def extend(self, aux_T3H: torch.Tensor, next_ids: list[int]) -> None:
        """Positions n .. n+T−1 verified: their taps join the context; the bonus token is the last of
        ``next_ids`` (the token at position n + T)."""
        T = len(next_ids)
        if aux_T3H.shape[0] != T:
            raise ValueError(f"{aux_T3H.shape[0]} tapped positions for {T} next tokens")
        timed, t0 = self.n > 0, time.perf_counter()  # the prompt's prefill is not a step
        taps = aux_T3H.reshape(1, T, -1).to(self.m.fc.weight.dtype)
        new = self.m.context_kv(self.m.context(taps), torch.arange(self.n, self.n + T)[None])
        self.kv = new if not self.kv else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                           for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.n += T
        self.bonus = int(next_ids[-1])
        if timed:
            self.step_times.append(time.perf_counter() - t0)

    @torch.inference_mode()
    def block_logits(self, k: int) -> torch.Tensor:
        """[k, V] logits of block positions 1 .. k of this round's block (one forward, timed)."""
        if not 0 < k <= self.K:
            raise ValueError(f"k={k}: a DFlash drafter of block size {self.cfg.block_size} drafts 1 .. {self.K}")
        if self.bonus is None:
            raise RuntimeError("draft before extend: the round has no bonus token")
        t0 = time.perf_counter()
        B = self.cfg.block_size
        ids = torch.tensor([[self.bonus] + [self.cfg.mask_token_id] * self.K])
        pos = torch.arange(self.n, self.n + B)[None]
        x = F.embedding(ids, self.embed)
        see_all = torch.ones(1, B, self.n + B, dtype=torch.bool)  # the verified context and the whole block
        h = self.m.run_block(x, pos, self.kv, see_all)
        logits = h[0, 1:1 + k] @ self.head.T
        self.step_times.append(time.perf_counter() - t0)
        return logits.float()

    def draft(self, k: int) -> list[int]:
        """The block's first k greedy drafts (target ids: DFlash drafts over the target's vocabulary)."""
        logits = self.block_logits(k)
        self.margins += [margin(row) for row in logits]
        return logits.argmax(-1).tolist()

    def target_probs(self, q_KV: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary is the target's: q as it is."""
        return q_KV

    def draft_sampled(self, k: int, temperature: float, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """k drafts at temperature T > 0 under ``sample_method`` and the q [k, V] the loop's exact
        verification must use with them (the module docstring)."""
        q = probs(self.block_logits(k), temperature)
        if self.sample_method == "greedy":
            drafts = q.argmax(-1)
            return drafts.tolist(), F.one_hot(drafts, q.shape[-1]).to(q.dtype)
        drafts = [draw(q[j], gen) for j in range(k)]
        return drafts, self.target_probs(q)
