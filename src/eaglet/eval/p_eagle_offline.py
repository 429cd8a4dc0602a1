"""The offline evaluation of a P-EAGLE drafter (drafter.kind p_eagle, docs/block-drafters.md §8): what
eaglet.eval.evaluate_offline runs for the kind, in the shapes its EAGLE-3 and DFlash paths produce, so
the same aggregation (τ per set and domain with intervals, the matrix rows) and the same offline.json
follow.

T = 0, the exact parallel chain. The HF target continues each prompt greedily for max_new_tokens + K − 1
tokens (K = the drafter's parallel_k = vLLM's num_speculative_tokens), capturing the aux states at the
drafter's layer ids; from every start g (tokens emitted so far, the prefill emits the first) the round
vLLM runs with parallel drafting drafts K tokens in one forward: slot 1 reads the bonus token
x[P + g − 1] and g_t = fc(aux_t) at t = P + g − 2, slots 2 .. K the mask token and fc(mask_hidden)
(eaglet.drafter.p_eagle: all starts of a sequence in K passes of
:meth:`~eaglet.drafter.p_eagle.PEagleDrafter.parallel_unroll`), and the accepted prefix of its K greedy
drafts against the continuation is counted. The rounds are those vLLM's proposer runs
(eaglet.drafter.chain.served_rounds: every round drafts K), the chain
:meth:`~eaglet.drafter.p_eagle.PEagleDrafter.parallel_chain_along` gives and the export's served
check proved equal to vLLM's counters. Only k = K is measured: the drafter is served at
num_speculative_tokens = parallel_k.

T > 0, the expected chain: vLLM's parallel drafting takes the one-forward branch of
``llm_base_proposer.propose`` and ``_sample_draft_tokens``, as DFlash does (eaglet.eval.dflash_offline):
with ``draft_sample_method`` greedy each slot drafts argmax q_j, accepted with probability p(draft);
with "probabilistic" it samples q_j and accepts with min(1, p/q). Along the target's own seeded sample
at T, from every start: q_j = softmax(slot j's logits / T) over the draft vocabulary (slots 2 .. K
read mask inputs, so a round's drafts depend only on the context and the bonus token), p_j the
target's tempered distribution after the text before draft j, α_j by rule
(eaglet.drafter.chain.ACCEPT). An estimate past draft 0, as for the other kinds.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from eaglet.drafter.chain import ACCEPT, accepted_prefix
from eaglet.engines.hf_loop import Target, greedy, margin, probs, sample
from eaglet.eval.dflash_offline import block_replay

log = logging.getLogger("eaglet.eval.p_eagle_offline")


def is_p_eagle(drafter_path) -> bool:
    """Whether the trainer's file holds a P-EAGLE drafter (its metadata key)."""
    from eaglet.base.tensors import tensor_metadata
    from eaglet.drafter.p_eagle import META_KEY

    return META_KEY in (tensor_metadata(drafter_path) or {})


class PEagleSide:
    """The P-EAGLE drafter and its draft vocabulary: the K slots' logits of every round along one
    sequence."""

    def __init__(self, model, cfg, d2t: torch.Tensor):
        self.model, self.cfg = model.eval(), cfg
        self.K = int(cfg.parallel_k)
        self.ids = torch.arange(len(d2t)) + d2t.long()  # draft index -> target id (docs/eagle3.md §4)

    @torch.no_grad()
    def logits(self, aux_S3H: torch.Tensor, x: list[int], S: int) -> torch.Tensor:
        """[S, K, V_d] slot logits: row t is the round whose bonus token is x[t + 1] and whose slot 1
        reads fc(aux_t); ``aux_S3H`` the target's aux states of x (at least S rows)."""
        dtype = next(self.model.parameters()).dtype
        g = self.model.project(aux_S3H[:S].reshape(1, S, -1).to(dtype))
        xs = torch.tensor(x[:S])[None]
        return torch.stack([lg[0] for _, lg, _ in self.model.parallel_unroll(xs, g, self.K)], 1)


def setup(drafter_path, identity_path, threads, stop_at_eos=True, chat_template=None, load: dict | None = None):
    """Target (aux states at the drafter's layer ids), the P-EAGLE side, config and tokenizer: as
    eaglet.engines.hf_loop.setup for EAGLE-3."""
    from eaglet.base.artifacts import ArtifactError
    from eaglet.drafter.p_eagle import load_p_eagle
    from eaglet.target.load import (
        job_device,
        load_identity,
        load_model,
        load_target_embedding,
        load_tokenizer,
        stop_ids,
        target_load,
    )

    ld = target_load(load)
    if threads:
        torch.set_num_threads(int(threads))
    ident = load_identity(identity_path)
    model, cfg, d2t, _ = load_p_eagle(drafter_path, load_target_embedding(ident["path"]))
    if cfg.target_digest and cfg.target_digest != ident["digest"]:
        raise ArtifactError(f"{drafter_path}: trained for target {cfg.target_digest[:12]}, "
                            f"not {ident['digest'][:12]} ({identity_path})")
    tok = load_tokenizer(ident["path"], chat_template, need_template=True, trust_remote_code=ld["trust_remote_code"])
    target = load_model(ident["path"], dtype=ld["dtype"], trust_remote_code=ld["trust_remote_code"],
                        device=job_device(ld["device"]))
    log.info("target on %s (%s); P-EAGLE drafter, K %d, layer ids %s", target.device, ld["dtype"], cfg.parallel_k,
             list(cfg.layer_ids))
    eos = stop_ids(tok, target)
    return (ident, Target(target, list(cfg.layer_ids), eos if stop_at_eos else set()),
            PEagleSide(model, cfg, d2t), cfg, tok)


def parallel_prompt(target: Target, side: PEagleSide, prompt: list[int], K: int, max_new: int) -> dict:
    """eaglet.engines.hf_loop.offline_prompt for a P-EAGLE drafter: the greedy continuation (``tokens``:
    the first max_new, what is served), and from every start the accepted prefix of the round's K
    drafts judged against the continuation extended by K − 1 tokens (``valid``: tokens judged)."""
    gr = greedy(target, prompt, max_new + K - 1, capture=True)
    full = gr["tokens"]
    n = min(len(full), max_new)
    x, P = prompt + full, len(prompt)
    starts = []
    if n > 1:
        rows = side.logits(gr["aux"], x, P + n - 1)[P - 1:P + n - 2]  # start g: row t = P + g - 2
        drafts = side.ids[rows.argmax(-1)].tolist()
        for g in range(1, n):
            a = accepted_prefix(drafts[g - 1], x[P + g:P + g + K])
            deciding = min(a + 1, K)
            starts.append({"g": g, "accepted": a, "valid": len(full) - g,
                           "drafter_margin": min(margin(rows[g - 1, j]) for j in range(deciding)),
                           "target_margin": min(gr["margins"][g:g + a + 1])})
    return {"tokens": full[:n], "starts": starts, "target_margins": gr["margins"][:n]}


def parallel_expected(target: Target, side: PEagleSide, prompt: list[int], K: int, temperature: float,
                      max_new: int | None = None, gen: torch.Generator | None = None,
                      tokens: list[int] | None = None) -> dict:
    """eaglet.engines.hf_loop.expected_prompt for a P-EAGLE drafter (the module docstring): α of each
    slot from every start, under each rule vLLM serves."""
    if tokens is None:
        tokens = sample(target, prompt, max_new, temperature, gen)["tokens"]
    x, P, N = prompt + list(tokens), len(prompt), len(tokens)
    logits, aux = target.forward(x[:-1], target.new_cache())  # row r: p of x[r + 1]
    starts = []
    if N > 1:
        ql = side.logits(aux, x, P + N - 1)[P - 1:P + N - 2]
        for g in range(1, N):
            n = min(K, N - g)  # slots the text covers
            q = probs(ql[g - 1, :n], temperature)
            p = probs(logits[P + g - 1:P + g - 1 + n], temperature)
            by_rule = {rule: f(p[:, side.ids], q).tolist() for rule, f in ACCEPT.items()}
            starts.append({"g": g, "valid": N - g, "alpha": by_rule["probabilistic"], "alpha_by_rule": by_rule})
    return {"tokens": list(tokens), "starts": starts}


# What evaluate_offline.offline_results runs for the kind: per prompt, the expected chain, the replay
# (every round drafts K, as DFlash's)
CHAIN = SimpleNamespace(prompt=parallel_prompt, expected=parallel_expected, replay=block_replay)
