"""The offline evaluation of a DFlash drafter (drafter.kind dflash, docs/block-drafters.md §6): what
eaglet.eval.evaluate_offline runs for the kind, in the shapes its EAGLE-3 path produces, so the same
aggregation (τ per set and domain with intervals, the matrix rows) and the same offline.json follow.

T = 0, the exact block chain. The HF target continues each prompt greedily for max_new_tokens + K − 1
tokens (K = block_size − 1 = vLLM's num_speculative_tokens for DFlash), capturing the taps; from
every start g (tokens emitted so far, the prefill emits the first) the drafter drafts one block with
the bonus token x[P + g − 1] and the context < P + g − 1 (all starts in a few batched forwards, the
training forward's blocks: eaglet.drafter.dflash.DFlashDrafter.block_logits), and the accepted prefix
of its K greedy drafts against the continuation is counted. The rounds are those vLLM's DFlash
proposer runs (eaglet.drafter.chain.served_rounds: every round drafts K, also near max_new_tokens;
no cap as in the HF loop's replay), which is the chain eaglet.drafter.dflash.block_chain_along gives
and the export's served check proved equal to vLLM's counters. Only k = K is measured: vLLM serves
DFlash at num_speculative_tokens = block_size − 1.

T > 0, the expected chain. Read from vLLM 0.32 (vllm/v1/spec_decode/dflash.py: DFlashProposer
subclasses SpecDecodeBaseProposer with parallel drafting; llm_base_proposer.py ``propose`` takes the
one-forward branch for parallel drafting and calls ``_sample_draft_tokens``): the draft sample
method applies to DFlash as to EAGLE-3. With ``draft_sample_method`` greedy (vLLM's default) each
block position drafts argmax q_j, accepted with probability p(draft); with "probabilistic" each
position's draft is sampled from q_j (the request's temperature) and accepted with min(1, p/q).
Along the target's own seeded sample at T, from every start: q_j = softmax(block logits_j / T) (a
block's drafts depend only on the context and the bonus token, not on earlier drafts), p_j the
target's tempered distribution after the text before draft j, α_j by rule
(eaglet.drafter.chain.ACCEPT). As for EAGLE-3 it is an estimate past draft 0: the real loop
conditions the target's p of draft j on the accepted drafts, here on the text.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from eaglet.drafter.chain import ACCEPT, accepted_prefix, served_rounds
from eaglet.engines.hf_loop import Target, greedy, margin, probs, sample

log = logging.getLogger("eaglet.eval.dflash_offline")

# anchors per batched drafter forward (bounds the [A·B, S + A·B] mask and the [A, B, V] logits)
CHUNK = 64


def is_dflash(drafter_path) -> bool:
    """Whether the trainer's file holds a DFlash drafter (its metadata key)."""
    from eaglet.base.tensors import tensor_metadata
    from eaglet.drafter.dflash import META_KEY

    return META_KEY in (tensor_metadata(drafter_path) or {})


class DFlashSide:
    """The DFlash drafter with the target's frozen embedding and head: the block logits of many
    starts along one sequence."""

    def __init__(self, model, cfg, embed_VH: torch.Tensor, head_VH: torch.Tensor):
        self.model, self.cfg, self.embed, self.head = model.eval(), cfg, embed_VH, head_VH
        self.K = cfg.block_size - 1

    @torch.no_grad()
    def logits(self, aux_S3H: torch.Tensor, x: list[int], anchors: list[int]) -> torch.Tensor:
        """[A, K, V] drafting logits (block positions 1 .. K) of the block at each anchor (the bonus
        token's position); ``aux_S3H`` the target's taps of x's first S positions."""
        S = aux_S3H.shape[0]
        taps = aux_S3H.reshape(S, -1)[None].float()
        ids = torch.tensor(x[:S])[None]
        out = []
        for i in range(0, len(anchors), CHUNK):
            a = torch.tensor([anchors[i:i + CHUNK]])
            out.append(self.model.block_logits(taps, ids, a, self.embed, self.head)[0, :, 1:])
        return torch.cat(out) if out else torch.zeros(0, self.K, self.head.shape[0])


def setup(drafter_path, identity_path, threads, stop_at_eos=True, chat_template=None, load: dict | None = None):
    """Target (taps at the drafter's target_layer_ids), DFlash side, config and tokenizer: as
    eaglet.engines.hf_loop.setup for EAGLE-3."""
    from eaglet.base.artifacts import ArtifactError
    from eaglet.drafter.dflash import load_dflash
    from eaglet.target.load import job_device, load_identity, load_model, load_tokenizer, stop_ids, target_load

    ld = target_load(load)
    if threads:
        torch.set_num_threads(int(threads))
    ident = load_identity(identity_path)
    model, cfg = load_dflash(drafter_path)
    if cfg.target_digest and cfg.target_digest != ident["digest"]:
        raise ArtifactError(f"{drafter_path}: trained for target {cfg.target_digest[:12]}, "
                            f"not {ident['digest'][:12]} ({identity_path})")
    tok = load_tokenizer(ident["path"], chat_template, need_template=True, trust_remote_code=ld["trust_remote_code"])
    target = load_model(ident["path"], dtype=ld["dtype"], trust_remote_code=ld["trust_remote_code"],
                        device=job_device(ld["device"]))
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    head = target.get_output_embeddings().weight.detach().float().cpu()
    log.info("target on %s (%s); DFlash drafter, block size %d, taps %s", target.device, ld["dtype"],
             cfg.block_size, list(cfg.target_layer_ids))
    eos = stop_ids(tok, target)
    return (ident, Target(target, list(cfg.target_layer_ids), eos if stop_at_eos else set()),
            DFlashSide(model, cfg, embed, head), cfg, tok)


def block_prompt(target: Target, side: DFlashSide, prompt: list[int], K: int, max_new: int) -> dict:
    """eaglet.engines.hf_loop.offline_prompt for a DFlash drafter: the greedy continuation (``tokens``:
    the first max_new, what is served), and from every start the accepted prefix of the block's K
    drafts judged against the continuation extended by K − 1 tokens (``valid``: tokens judged)."""
    gr = greedy(target, prompt, max_new + K - 1, capture=True)
    full = gr["tokens"]
    n = min(len(full), max_new)
    x, P = prompt + full, len(prompt)
    starts = []
    if n > 1:
        lg = side.logits(gr["aux"], x, [P + g - 1 for g in range(1, n)])
        drafts = lg.argmax(-1).tolist()
        for g in range(1, n):
            d = drafts[g - 1]
            a = accepted_prefix(d, x[P + g:P + g + K])
            deciding = min(a + 1, K)
            starts.append({"g": g, "accepted": a, "valid": len(full) - g,
                           "drafter_margin": min(margin(lg[g - 1, j]) for j in range(deciding)),
                           "target_margin": min(gr["margins"][g:g + a + 1])})
    return {"tokens": full[:n], "starts": starts, "target_margins": gr["margins"][:n]}


def block_replay(accepted: list[int], n_tokens: int, max_new: int, k: int) -> list[tuple[int, int, int]]:
    """The rounds vLLM's DFlash proposer runs over n_tokens served tokens, from ``accepted[g]``
    (eaglet.drafter.chain.served_rounds): every round drafts k. (g, k, accepted) per round, in the
    shape of eaglet.drafter.chain.chain_replay."""
    at = {g: min(a, k) for g, a in enumerate(accepted) if g}
    return [(g, k, at[g]) for g in served_rounds(at, min(n_tokens, max_new))]


def block_expected(target: Target, side: DFlashSide, prompt: list[int], K: int, temperature: float,
                   max_new: int | None = None, gen: torch.Generator | None = None,
                   tokens: list[int] | None = None) -> dict:
    """eaglet.engines.hf_loop.expected_prompt for a DFlash drafter (the module docstring): α of each
    block position from every start, under each rule vLLM serves."""
    if tokens is None:
        tokens = sample(target, prompt, max_new, temperature, gen)["tokens"]
    x, P, N = prompt + list(tokens), len(prompt), len(tokens)
    logits, aux = target.forward(x[:-1], target.new_cache())  # row r: p of x[r + 1]
    starts = []
    if N > 1:
        ql = side.logits(aux, x, [P + g - 1 for g in range(1, N)])
        for g in range(1, N):
            n = min(K, N - g)  # block positions the text covers
            q = probs(ql[g - 1, :n], temperature)
            p = probs(logits[P + g - 1:P + g - 1 + n], temperature)
            by_rule = {rule: f(p, q).tolist() for rule, f in ACCEPT.items()}
            starts.append({"g": g, "valid": N - g, "alpha": by_rule["probabilistic"], "alpha_by_rule": by_rule})
    return {"tokens": list(tokens), "starts": starts}


# What evaluate_offline.offline_results runs for the kind: per prompt, the expected chain, the replay
CHAIN = SimpleNamespace(prompt=block_prompt, expected=block_expected, replay=block_replay)
