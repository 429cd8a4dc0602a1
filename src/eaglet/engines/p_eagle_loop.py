"""A P-EAGLE drafter as the proposer of the HF speculative loop (eaglet.engines.hf_loop ``speculative`` at
T = 0, ``speculative_sampling`` at T > 0): drafter.kind p_eagle's timed loop (docs/block-drafters.md §8).

    proposer = PEagleProposer(drafter, d2t)                           # eaglet.drafter.p_eagle.load_p_eagle's
    hf_loop.speculative(target, proposer, prompt_ids, k, max_new)     # k <= K = cfg.parallel_k

It has :class:`eaglet.engines.hf_loop.EagleProposer`'s interface (reset / extend / draft /
draft_sampled / target_probs / step_times / margins) and drafts as vLLM's EAGLE proposer does with
``parallel_drafting`` (llm_base_proposer ``propose``'s one-forward branch, inputs laid out by
``copy_and_expand_eagle_inputs``; docs/block-drafters.md §3, §8), ONE drafter forward per round:

- The drafter's KV cache (eaglet.drafter.eagle3.KVCache) holds the *real entries* only: entry p is
  (token x_{p+1}, hidden g_p = fc(aux_p)) at position p, for every verified position p the drafter
  has read, exactly what vLLM's draft KV cache keeps across rounds (its masked slots of a round sit
  at positions the next round's real tokens overwrite; here they are dropped at once, the same
  thing for every later query, whose attention is by position).
- ``extend(aux, next_ids)`` is told the aux states of the positions the target just verified and
  the token after each: it only records them as *pending* real entries; the drafter does not run
  (vLLM writes them in the next round's forward too). The one exception is the prompt: its first
  P − 1 entries are written into the cache at once by one untimed ``forward_step`` (the prefill,
  as EagleProposer's first ``extend`` is not a step), and its last entry stays pending, so that
  every round's forward holds at least one real entry, the one slot 1 drafts from. Causal attention
  makes this split exact: an entry's keys do not depend on what comes after it.
- ``draft(k)`` (1 ≤ k ≤ K) runs the round in one ``forward_step`` through the cache: the pending real
  entries at their positions n .. t (t = the last verified position: the bonus token x_{t+1} with
  g_t), then k − 1 masked slots, each the mask token (``cfg.mask_token_id``) with the hidden
  ``fc(mask_hidden)`` (:meth:`eaglet.drafter.p_eagle.PEagleDrafter.mask_state`, computed once, as
  vLLM projects it once at load) at positions t + 1 .. t + k − 1. The cache then keeps the real
  entries and drops the masked slots'. Slot 1's logits are the output at the last real entry
  (position t), slot 1 + d's the output of masked slot d; the drafts are their argmax over the draft
  vocabulary mapped to target ids (draft id i is target id i + d2t[i]). This is the round
  :meth:`~eaglet.drafter.p_eagle.PEagleDrafter.parallel_logits` computes from scratch (real entries
  0 .. t, then the masked slots) and ``parallel_chain_along`` walks; with causal attention a slot never
  sees a later one, so drafting k < K gives the first k slots of the K-slot round (vLLM serves the
  kind at k = K; the smaller k are measured for comparison, as DFlash's block's first k are).
- ``draft_sampled(k, T, gen)`` at T > 0 follows vLLM's ``draft_sample_method`` as
  eaglet.engines.dflash_loop does: "probabilistic" (the default, as the EAGLE-3 proposer's: the HF
  loop draws drafts from q) draws slot j's draft from its own q_j = softmax(logits_j / T) over the
  draft vocabulary and returns q over the target vocabulary (0 outside the draft vocabulary), so the
  loop's exact verification (hf_loop.verify_exact) accepts it with min(1, p/q) and resamples a
  rejection from normalize(max(0, p − q)); "greedy" drafts argmax q_j and returns q one-hot at that
  draft, so the same verification accepts it with probability p(draft) and resamples a rejection
  from p without it: vLLM's rule for greedy drafts, lossless as well. A round's q_j depend only on
  the verified context and the bonus token (the later slots read the mask inputs), never on the
  earlier drafts, as a DFlash block's.

``step_times``: seconds of every drafter call after the prompt's prefill, i.e. one forward per
round that drafts (fc of the pending entries, the layer, the head; ``extend`` runs nothing);
``margins``: the top-2 gap of every greedy draft's logits (``draft``).

Shape suffixes: T tokens, V target vocabulary, Vd draft vocabulary, H hidden, 3 the aux layers,
K slots (parallel_k).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from eaglet.drafter.eagle3 import KVCache
from eaglet.drafter.p_eagle import PEagleDrafter
from eaglet.engines.dflash_loop import SAMPLE_METHODS
from eaglet.engines.hf_loop import draw, margin, probs


class PEagleProposer:
    """One parallel-drafting round per ``draft``; the real entries cached across rounds (the module docstring)."""

    def __init__(self, drafter: PEagleDrafter, d2t: torch.Tensor, sample_method: str = "probabilistic"):
        if sample_method not in SAMPLE_METHODS:
            raise ValueError(f"draft sample method {sample_method!r}: expected one of {SAMPLE_METHODS}")
        self.m, self.cfg = drafter.eval(), drafter.cfg
        self.K = int(self.cfg.parallel_k)
        self.d2t = d2t.long()
        self.ids = torch.arange(len(self.d2t)) + self.d2t  # draft index -> target id (docs/eagle3.md §4)
        self.sample_method = sample_method
        with torch.no_grad():
            self.mask_H = drafter.mask_state().detach()  # fc(mask_hidden), once (vLLM: at load)
        self.step_times: list[float] = []
        self.reset()

    def reset(self):
        self.cache, self.n = KVCache(), 0  # real entries at positions 0 .. n − 1
        self.pending_aux: list[torch.Tensor] = []  # verified, not yet in the cache: positions n ..
        self.pending_ids: list[int] = []
        self.margins: list[float] = []

    @torch.inference_mode()
    def extend(self, aux_T3H: torch.Tensor, next_ids: list[int]) -> None:
        """Positions n' .. n'+T−1 verified (n' = the positions the drafter has been told of): their real
        entries (x_{p+1} = ``next_ids``, aux_p) become pending. The prompt's (the first call after
        ``reset``) all but the last are written into the cache at once, untimed."""
        T = len(next_ids)
        if aux_T3H.shape[0] != T:
            raise ValueError(f"{aux_T3H.shape[0]} verified positions for {T} next tokens")
        next_ids = [int(x) for x in next_ids]
        if self.n == 0 and not self.pending_ids and T > 1:  # the prompt's prefill (not a step)
            g = self.m.project(aux_T3H[None, :T - 1])
            self.m.forward_step(torch.tensor([next_ids[:T - 1]]), g, torch.arange(T - 1)[None], self.cache)
            self.n = T - 1
            aux_T3H, next_ids = aux_T3H[T - 1:], next_ids[T - 1:]
        self.pending_aux.append(aux_T3H)
        self.pending_ids += next_ids

    @torch.inference_mode()
    def slot_logits(self, k: int) -> torch.Tensor:
        """[k, Vd] logits of slots 1 .. k of this round (one ``forward_step``, timed): the pending real
        entries, then k − 1 masked slots; the real entries stay in the cache, the masked slots' do not."""
        if not 0 < k <= self.K:
            raise ValueError(f"k={k}: a P-EAGLE drafter of parallel_k {self.K} drafts 1 .. {self.K}")
        if not self.pending_ids:
            raise RuntimeError("draft before extend: the round has no newly verified position to draft from")
        t0 = time.perf_counter()
        T = len(self.pending_ids)
        g = self.m.project(torch.cat(self.pending_aux)[None])  # [1, T, H]
        hid = torch.cat([g, self.mask_H.to(g.dtype).expand(1, k - 1, -1)], 1)
        ids = torch.tensor([self.pending_ids + [int(self.cfg.mask_token_id)] * (k - 1)])
        pos = torch.arange(self.n, self.n + T + k - 1)[None]  # last real entry at t = n + T − 1, slots t + 1 ..
        logits, _ = self.m.forward_step(ids, hid, pos, self.cache)
        self.cache.truncate(self.n + T)  # keep the real entries; the masked slots' are rewritten next round
        self.n += T
        self.pending_aux, self.pending_ids = [], []
        self.step_times.append(time.perf_counter() - t0)
        return logits[0, T - 1:].float()

    def draft(self, k: int) -> list[int]:
        """The round's first k greedy drafts, as target ids."""
        logits = self.slot_logits(k)
        self.margins += [margin(row) for row in logits]
        return self.ids[logits.argmax(-1)].tolist()

    def target_probs(self, q_KVd: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary probabilities as target-vocabulary ones: 0 outside the draft vocabulary."""
        out = torch.zeros(q_KVd.shape[0], self.cfg.vocab_size, dtype=q_KVd.dtype)
        out[:, self.ids] = q_KVd
        return out

    def draft_sampled(self, k: int, temperature: float, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """k drafts at temperature T > 0 under ``sample_method`` and the q [k, V] the loop's exact
        verification must use with them (the module docstring)."""
        if not temperature > 0:  # before the round's forward, which consumes the pending entries
            raise ValueError(f"temperature {temperature}: sampling needs T > 0 (T = 0 is greedy)")
        q = probs(self.slot_logits(k), temperature)
        if self.sample_method == "greedy":
            i = q.argmax(-1)
            return self.ids[i].tolist(), self.target_probs(F.one_hot(i, q.shape[-1]).to(q.dtype))
        i = torch.tensor([draw(q[j], gen) for j in range(k)])
        return self.ids[i].tolist(), self.target_probs(q)
