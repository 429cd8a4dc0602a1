"""The HF evaluation loop: the target in-process with its KV cache, the drafter as proposer, and the
per-prompt decoding eaglet measures with (docs/eagle3.md §7). A library shared by the evaluation stages
(eaglet.eval.evaluate_offline, evaluate_speculative, evaluate_modes, regenerated), the export contract's
offline chain (eaglet.export.contract.vllm_checks) and the known-answer check
(eaglet.export.contract.known_answer).

    ident, target, proposer, cfg, tok = setup(drafter_path, identity_path, threads=2)
    greedy(target, prompt_ids, max_new)                      # plain greedy, optionally the aux states
    speculative(target, proposer, prompt_ids, k, max_new)    # the real loop: draft, verify, roll back
    offline_prompt(target, proposer, prompt_ids, K, max_new) # K drafts from every verified position
    sample(target, prompt_ids, max_new, T, gen)              # plain sampling at temperature T > 0
    speculative_sampling(target, proposer, prompt_ids, k, max_new, T, gen)  # the real loop at T > 0
    expected_prompt(target, proposer, prompt_ids, K, T, ...) # α per rule from every verified position

Conventions. The drafter at position t reads g_t = fc(aux_t) and the token x_{t+1} (vLLM's);
aux id j = HF ``hidden_states[j]`` (residual stream entering layer j). A round starts when the
target has emitted g tokens after the prompt; with k drafts it may accept at most
``min(k, max_new - g - 1)`` (never past max_new_tokens), and stops at EOS. The drafter stays on the
CPU in fp32; the target's logits and aux states come back as fp32 CPU tensors.

Sampling (T > 0; docs/eagle3.md §13). The target's distribution is p = softmax(logits / T) over
the whole vocabulary V; the drafter's is q = softmax(draft logits / T) over the draft vocabulary
(draft id i is target id i + d2t[i]), and q is 0 for every target id outside it. A draft x drawn
from q is accepted with probability min(1, p(x) / q(x)); at the first rejection the emitted token
is drawn from normalize(max(0, p − q)) (:func:`residual`), and when all k drafts are accepted the
bonus token is drawn from p. The emitted text then has exactly the distribution of plain sampling
(:func:`sample`) from the target; tests/engines/test_speculative_sampling.py checks that with a
goodness-of-fit test. Every random draw takes a ``torch.Generator`` (:func:`generator`), so a
seeded run is reproducible. The verification rule is a parameter (``verify``, default
:func:`verify_exact`) only so that the tests can run deliberately wrong rules through the same loop
and show that the statistical test rejects them. T = 0 never reaches this code: greedy,
speculative and offline_prompt are the exact greedy paths.

Shape suffixes: T tokens, V target vocab, Vd draft vocab, H target hidden, 3 the three aux layers,
K draft positions.
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
from collections import defaultdict

import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.drafter.chain import ACCEPT, accepted_prefix
from eaglet.drafter.eagle3 import KVCache, load_drafter
from eaglet.target.load import job_device, load_identity, load_model, load_tokenizer, stop_ids, target_load

log = logging.getLogger("eaglet.engines.hf_loop")


# --------------------------------------------------------------------------- the target
def _recurrent(layer) -> bool:
    """A cache layer that folds every token into a state (see ``Target.arm_rollback``)."""
    if not getattr(layer, "is_croppable", True) and not getattr(layer, "is_sliding", False):
        return True
    record = getattr(layer, "activate_past_recording", None)
    return record is not None and "recurrent_states_to_keep" in inspect.signature(record).parameters


class Target:
    """An HF causal LM with a KV cache, on any device; returns fp32 CPU logits and aux hidden states."""

    def __init__(self, model, layer_ids: list[int], eos_ids: set[int], rollback: str = "auto"):
        """``rollback``: how the speculative loop drops rejected drafts from the KV cache: "auto"
        (``crop`` where every cache layer can, else snapshot + re-feed), or force "crop" / "refeed"."""
        if rollback not in ("auto", "crop", "refeed"):
            raise ValueError(f"rollback {rollback!r}: expected auto, crop or refeed")
        self.rollback = rollback
        n = model.config.num_hidden_layers
        if max(layer_ids) >= n:
            # HF hidden_states[N] is after the final norm; vLLM's id N is before it (docs/eagle3.md §5)
            raise ValueError(f"layer ids {layer_ids}: id {max(layer_ids)} >= {n} layers has no HF equivalent")
        self.model, self.layer_ids, self.eos_ids = model, list(layer_ids), set(eos_ids)
        self.device = getattr(model, "device", torch.device("cpu"))  # inputs go where the weights are
        # transformers >= 5.2x names the cache argument `cache`; earlier `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.times: dict[int, list[float]] = defaultdict(list)  # forward seconds by input length

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache, aux: bool = True):
        """Run ``ids`` after what the cache holds; return (logits_TV, aux_T3H or None)."""
        timed = cache.get_seq_length() > 0  # step costs: decode / verify forwards, not prefills
        t0 = time.perf_counter()
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True,
                         output_hidden_states=aux, **{self._cache_kw: cache})
        # no-ops for an fp32 CPU target; a bf16 GPU target hands the CPU drafter what it reads
        logits = out.logits[0].to("cpu", torch.float32)
        aux_T3H = torch.stack([out.hidden_states[j][0] for j in self.layer_ids], 1).to("cpu", torch.float32) \
            if aux else None
        if timed:
            self.times[len(ids)].append(time.perf_counter() - t0)
        return logits, aux_T3H

    def arm_rollback(self, cache) -> bool:
        """Call after the prefill. Make ``cache`` able to drop rejected drafts with ``crop`` and say
        whether it can; False means the loop must roll back by snapshot and re-feed instead.

        A sliding-window layer (Gemma 2/3, Mistral, gpt-oss, ...) keeps only its last window - 1
        keys, so past the window it cannot drop the keys of rejected drafts unless it records past
        states: with recording it keeps the ≤ k+1 keys of a verify forward until the next ``crop``
        trims it back to the window (a few extra keys per layer, no extra compute). Recording is
        turned on only after the prefill so a long prompt is not kept whole. A recurrent layer
        (linear attention, Mamba) folds every fed token into its state and can never be cropped;
        ``is_croppable`` says so once the prefill initialised it. Older transformers without
        ``activate_past_recording`` cannot crop a sliding layer either."""
        if self.rollback == "refeed":
            return False
        # A recurrent layer (linear attention, Mamba): before transformers 5.25 it says it cannot crop;
        # from 5.25 it can only when told how many states to record (``recurrent_states_to_keep``;
        # recording on without it fails its next forward). Either way: snapshot and re-feed.
        recurrent = sorted({type(layer).__name__ for layer in getattr(cache, "layers", []) if _recurrent(layer)})
        if recurrent:
            if self.rollback == "crop":
                raise ValueError(f"rollback='crop': cache layers {recurrent} cannot crop")
            return False
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        stuck = [type(layer).__name__ for layer in getattr(cache, "layers", [])
                 if not getattr(layer, "is_croppable", True)
                 or (getattr(layer, "is_sliding", False) and not getattr(layer, "record_past", False))]
        if stuck and self.rollback == "crop":
            raise ValueError(f"rollback='crop': cache layers {sorted(set(stuck))} cannot crop")
        return not stuck

    @staticmethod
    def crop(cache, n: int) -> None:
        """Keep the first n positions (drop the keys of rejected drafts). With past recording on
        (``arm_rollback``), ``crop(0)`` also trims sliding layers back to their window; older
        transformers read ``crop(0)`` as "keep nothing", so it is only called with the new API."""
        extra = cache.get_seq_length() - n
        if extra > 0:
            cache.crop(-extra)  # a negative count removes that many (all transformers versions)
        elif hasattr(cache, "activate_past_recording"):
            cache.crop(0)

    @torch.inference_mode()
    def refeed(self, ids: list[int], cache) -> None:
        """Feed accepted tokens into a cache restored from a snapshot (the fallback rollback); not
        timed, so the verify-cost model keeps measuring verify forwards only."""
        self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, **{self._cache_kw: cache})


def margin(logits_V: torch.Tensor) -> float:
    """Gap between the two largest logits: below tie_eps, argmax is a numerical coin flip."""
    top = logits_V.topk(2).values
    return float(top[0] - top[1])


def greedy(target: Target, prompt: list[int], max_new: int, capture: bool = False) -> dict:
    """Plain greedy decoding. ``capture``: also the aux states of every position fed (prompt and
    emitted tokens but the last), i.e. rows 0 .. len(prompt)+len(tokens)-2."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, aux = target.forward(prompt, cache, aux=capture)
    tokens, margins, auxes = [int(logits[-1].argmax())], [margin(logits[-1])], [aux]
    while len(tokens) < max_new and tokens[-1] not in target.eos_ids:
        logits, aux = target.forward(tokens[-1:], cache, aux=capture)
        tokens.append(int(logits[-1].argmax()))
        margins.append(margin(logits[-1]))
        auxes.append(aux)
    out = {"tokens": tokens, "margins": margins, "seconds": time.perf_counter() - t0}
    if capture:
        out["aux"] = torch.cat(auxes)
    return out


# --------------------------------------------------------------------------- the drafter side
class EagleProposer:
    """Greedy chain drafting with the EAGLE-3 drafter and its KV cache, as vLLM runs it.

    ``extend`` feeds verified positions (step 0: fc(aux_t) with token x_{t+1}); ``draft(k)`` then
    proposes k target token ids, later steps reading the drafter's own pre-norm hidden and its own
    token. Draft-step cache entries are dropped at the next ``extend`` (rejected or not, vLLM
    recomputes accepted positions from the target's hidden states)."""

    def __init__(self, drafter, d2t: torch.Tensor):
        self.m, self.d2t = drafter, d2t.long()
        self.ids = torch.arange(len(self.d2t)) + self.d2t  # draft index -> target id (docs/eagle3.md §4)
        self.step_times: list[float] = []
        self.reset()

    def reset(self):
        self.cache, self.n, self.last = KVCache(), 0, None
        self.margins: list[float] = []  # drafter top-2 gap of every drafted token

    @torch.inference_mode()
    def extend(self, aux_T3H: torch.Tensor, next_ids: list[int]) -> None:
        timed, t0 = self.n > 0, time.perf_counter()  # the prompt's prefill is not a step
        self.cache.truncate(self.n)
        T = len(next_ids)
        g = self.m.project(aux_T3H[None])
        pos = torch.arange(self.n, self.n + T)[None]
        logits, h = self.m.forward_step(torch.tensor([next_ids]), g, pos, self.cache)
        self.n += T
        self.last = (logits[0, -1], h[:, -1:])
        if timed:
            self.step_times.append(time.perf_counter() - t0)

    @torch.inference_mode()
    def draft(self, k: int) -> list[int]:
        logits, h = self.last
        out = []
        for j in range(k):
            i = int(logits.argmax())
            self.margins.append(margin(logits))
            out.append(i + int(self.d2t[i]))  # draft id -> target id (offset map)
            if j == k - 1:
                break
            logits, h = self._step(out[-1], h, j)
        return out

    def _step(self, token: int, h, j: int):
        """Draft step j + 1 (timed): the drafter fed its own last draft and hidden state."""
        t0 = time.perf_counter()
        lg, h = self.m.forward_step(torch.tensor([[token]]), h, torch.tensor([[self.n + j]]), self.cache)
        self.step_times.append(time.perf_counter() - t0)
        return lg[0, -1], h

    def target_probs(self, q_JVd: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary probabilities as target-vocabulary ones: 0 outside the draft vocabulary."""
        out = torch.zeros(q_JVd.shape[0], self.m.cfg.vocab_size, dtype=q_JVd.dtype)
        out[:, self.ids] = q_JVd
        return out

    @torch.inference_mode()
    def draft_sampled(self, k: int, temperature: float, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """k drafts, each drawn from q = softmax(logits / T) over the draft vocabulary and fed to
        the next step; returns the target ids and q over the target vocabulary [k, V]."""
        logits, h = self.last
        out, qs = [], []
        for j in range(k):
            q = probs(logits, temperature)
            i = draw(q, gen)
            qs.append(q)
            out.append(int(self.ids[i]))
            if j == k - 1:
                break
            logits, h = self._step(out[-1], h, j)
        return out, self.target_probs(torch.stack(qs))

    @torch.inference_mode()
    def unroll(self, tokens: list[int], temperature: float) -> torch.Tensor:
        """q over the draft vocabulary of 1 + len(tokens) draft steps from the verified position,
        step j ≥ 1 fed ``tokens[j-1]`` (the text's token, as training-time test feeds it) and the
        drafter's own hidden state: [1 + len(tokens), Vd]. Not timed: this is no serving step."""
        logits, h = self.last
        qs = [probs(logits, temperature)]
        for j, t in enumerate(tokens):
            lg, h = self.m.forward_step(torch.tensor([[t]]), h, torch.tensor([[self.n + j]]), self.cache)
            qs.append(probs(lg[0, -1], temperature))
        return torch.stack(qs)


def speculative(target: Target, proposer, prompt: list[int], k: int, max_new: int) -> dict:
    """The real loop at temperature 0. ``rounds``: (emitted so far g, drafts k_eff, accepted)."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, aux = target.forward(prompt, cache)
    # Rollback of rejected drafts: crop where the cache can (every full-attention cache, sliding
    # ones with past recording). Otherwise (recurrent layers) snapshot the cache before each verify
    # and, when a draft was rejected, restore it and re-feed the accepted tokens: a copy of the
    # cache every round and one more forward of ≤ k tokens per rejection. That costs memory traffic
    # and time (the measured speedup is then pessimistic), never correctness.
    by_crop = target.arm_rollback(cache)
    tokens, margins, rounds = [int(logits[-1].argmax())], [margin(logits[-1])], []
    proposer.reset()
    proposer.extend(aux, prompt[1:] + tokens)
    while len(tokens) < max_new and tokens[-1] not in target.eos_ids:
        k_eff = min(k, max_new - len(tokens) - 1)
        drafts = proposer.draft(k_eff) if k_eff else []
        fed = tokens[-1:] + drafts
        snapshot = None if by_crop else copy.deepcopy(cache)
        logits, aux = target.forward(fed, cache)
        preds = logits.argmax(-1).tolist()
        a = 0
        while a < k_eff and drafts[a] == preds[a]:
            a += 1
        emitted = preds[:a + 1]
        eos = next((i for i, t in enumerate(emitted) if t in target.eos_ids), None)
        if eos is not None:  # nothing after EOS counts, accepted or not
            emitted, a = emitted[:eos + 1], min(a, eos + 1)
        rounds.append((len(tokens), k_eff, a))
        margins += [margin(lg) for lg in logits[:len(emitted)]]
        tokens += emitted
        if by_crop:
            Target.crop(cache, len(prompt) + len(tokens) - 1)
        elif len(emitted) < len(fed):  # fed[:len(emitted)] = the last token + the accepted drafts
            cache = snapshot
            target.refeed(fed[:len(emitted)], cache)
        proposer.extend(aux[:len(emitted)], emitted)
    return {"tokens": tokens, "margins": margins, "rounds": rounds, "seconds": time.perf_counter() - t0}


def offline_prompt(target: Target, proposer: EagleProposer, prompt: list[int], K: int, max_new: int) -> dict:
    """Greedy continuation + its aux states, then K drafts from every verified position."""
    gr = greedy(target, prompt, max_new, capture=True)
    x, P, N, aux = prompt + gr["tokens"], len(prompt), len(gr["tokens"]), gr["aux"]
    proposer.reset()
    proposer.extend(aux[:P], x[1:P + 1])
    starts = []
    for g in range(1, N):  # the drafter knows x_0 .. x_{P+g-1}; it drafts x_{P+g} ...
        if g > 1:
            proposer.extend(aux[P + g - 2:P + g - 1], x[P + g - 1:P + g])
        m0 = len(proposer.margins)
        d = proposer.draft(K)
        a = accepted_prefix(d, x[P + g:])
        # the drafts that decided the count: the accepted ones and the first rejected one
        dm = min(proposer.margins[m0:m0 + min(a + 1, K)])
        starts.append({"g": g, "accepted": a, "valid": N - g, "drafter_margin": dm,
                       "target_margin": min(gr["margins"][g:g + a + 1])})
    return {"tokens": gr["tokens"], "starts": starts, "target_margins": gr["margins"]}


# --------------------------------------------------------------------------- sampling (T > 0)
def generator(seed: int) -> torch.Generator:
    """A seeded CPU generator: every draw of a sampling run takes it, so a seed fixes the run."""
    return torch.Generator().manual_seed(int(seed))


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in fp32 over the last axis."""
    if not temperature > 0:
        raise ValueError(f"temperature {temperature}: sampling needs T > 0 (T = 0 is greedy)")
    return torch.softmax(logits.float() / temperature, -1)


def draw(p_V: torch.Tensor, gen: torch.Generator) -> int:
    """One index drawn from the distribution p."""
    return int(torch.multinomial(p_V, 1, generator=gen))


def residual(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p − q)): what a rejected draft is replaced with. ``q`` over the target
    vocabulary (0 outside the draft vocabulary, so the target's mass there stays whole). A
    rejection implies p(x) < q(x) somewhere, hence mass elsewhere; should rounding leave none, p."""
    r = (p_V - q_V).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p_V


def verify_exact(p_JV: torch.Tensor, q_JV: torch.Tensor | None, drafts: list[int],
                 gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling's verification. ``p_JV``: the target's distributions at the k draft
    positions and the bonus position [k+1, V]; ``q_JV``: the drafter's at the k positions [k, V]
    (0 outside the draft vocabulary). Returns (accepted drafts a, the token emitted after them):
    draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); the first rejection emits a
    token from residual(p_j, q_j); all accepted, the bonus token comes from p_k."""
    for j, x in enumerate(drafts):
        px, qx = float(p_JV[j, x]), float(q_JV[j, x])
        if float(torch.rand((), generator=gen)) * qx >= px:  # u ≥ p/q: rejected
            return j, draw(residual(p_JV[j], q_JV[j]), gen)
    return len(drafts), draw(p_JV[len(drafts)], gen)


def sample(target: Target, prompt: list[int], max_new: int, temperature: float, gen: torch.Generator) -> dict:
    """Plain sampling from softmax(logits / T), the reference speculative sampling must match in
    distribution; the same EOS and max_new rules as :func:`greedy`."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, _ = target.forward(prompt, cache, aux=False)
    tokens = [draw(probs(logits[-1], temperature), gen)]
    while len(tokens) < max_new and tokens[-1] not in target.eos_ids:
        logits, _ = target.forward(tokens[-1:], cache, aux=False)
        tokens.append(draw(probs(logits[-1], temperature), gen))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def speculative_sampling(target: Target, proposer: EagleProposer, prompt: list[int], k: int, max_new: int,
                         temperature: float, gen: torch.Generator, verify=verify_exact) -> dict:
    """The real loop at temperature T > 0: drafts drawn from q, verified by ``verify`` (the module
    docstring; the default is the only correct rule), caches rolled back as in :func:`speculative`,
    the same EOS and max_new rules. ``rounds``: (emitted so far g, drafts k_eff, accepted)."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, aux = target.forward(prompt, cache)
    by_crop = target.arm_rollback(cache)
    tokens, rounds = [draw(probs(logits[-1], temperature), gen)], []
    proposer.reset()
    proposer.extend(aux, prompt[1:] + tokens)
    while len(tokens) < max_new and tokens[-1] not in target.eos_ids:
        k_eff = min(k, max_new - len(tokens) - 1)
        drafts, q = proposer.draft_sampled(k_eff, temperature, gen) if k_eff else ([], None)
        fed = tokens[-1:] + drafts
        snapshot = None if by_crop else copy.deepcopy(cache)
        logits, aux = target.forward(fed, cache)
        a, nxt = verify(probs(logits, temperature), q, drafts, gen)
        emitted = drafts[:a] + [nxt]
        eos = next((i for i, t in enumerate(emitted) if t in target.eos_ids), None)
        if eos is not None:  # nothing after EOS counts, accepted or not
            emitted, a = emitted[:eos + 1], min(a, eos + 1)
        rounds.append((len(tokens), k_eff, a))
        tokens += emitted
        if by_crop:
            Target.crop(cache, len(prompt) + len(tokens) - 1)
        elif len(emitted) < len(fed):
            cache = snapshot
            target.refeed(fed[:len(emitted)], cache)
        proposer.extend(aux[:len(emitted)], emitted)
    return {"tokens": tokens, "rounds": rounds, "seconds": time.perf_counter() - t0}


def expected_prompt(target: Target, proposer: EagleProposer, prompt: list[int], K: int, temperature: float,
                    max_new: int | None = None, gen: torch.Generator | None = None,
                    tokens: list[int] | None = None) -> dict:
    """Expected acceptance at T > 0 along one continuation of ``prompt``: ``tokens`` when given
    (text the target produced elsewhere, e.g. through vLLM), else the target's own sample of up to
    ``max_new`` tokens drawn with ``gen``. One target forward over prompt + continuation gives p at
    every position and the aux states; from every verified start (after g emitted tokens, as
    :func:`offline_prompt`) the drafter is unrolled K steps on its own hidden states, fed the
    text's tokens (training-time test's alignment), and α_j = Σ_x min(p(x), q_j(x)) is the
    probability that draft j is accepted given the text before it (eaglet.drafter.chain.overlap),
    when drafts are sampled from q; ``alpha_by_rule`` holds α under each rule vLLM serves
    (eaglet.drafter.chain.ACCEPT: "probabilistic", the same as ``alpha``, and "greedy", p(argmax q_j),
    the greedy draft's acceptance). It is an estimate past draft 0: the real loop conditions draft j
    on the accepted drafts, not on the text (under the greedy rule an accepted draft is argmax q,
    where the text holds a sample of p)."""
    if tokens is None:
        tokens = sample(target, prompt, max_new, temperature, gen)["tokens"]
    x, P, N = prompt + list(tokens), len(prompt), len(tokens)
    logits, aux = target.forward(x[:-1], target.new_cache())  # row r: p of x[r + 1]
    proposer.reset()
    proposer.extend(aux[:P], x[1:P + 1])
    starts = []
    for g in range(1, N):  # the drafter knows x_0 .. x_{P+g-1}; draft j proposes x_{P+g+j}
        if g > 1:
            proposer.extend(aux[P + g - 2:P + g - 1], x[P + g - 1:P + g])
        n = min(K, N - g)  # draft positions the text covers
        q = proposer.unroll(x[P + g:P + g + n - 1], temperature)
        p = probs(logits[P + g - 1:P + g - 1 + n], temperature)
        by_rule = {rule: f(p[:, proposer.ids], q).tolist() for rule, f in ACCEPT.items()}
        starts.append({"g": g, "valid": N - g, "alpha": by_rule["probabilistic"], "alpha_by_rule": by_rule})
    return {"tokens": list(tokens), "starts": starts}


# --------------------------------------------------------------------------- setup
def setup(drafter_path, identity_path, threads, stop_at_eos=True, chat_template=None, load: dict | None = None):
    """Target, drafter and tokenizer. ``load``: dtype, device, trust_remote_code of the target
    (the target section of the config; missing keys: its defaults, eaglet.target.load.target_load)."""
    ld = target_load(load)
    if threads:
        torch.set_num_threads(int(threads))
    ident = load_identity(identity_path)
    drafter, cfg, d2t, _ = load_drafter(drafter_path, ident)
    if cfg.target_digest and cfg.target_digest != ident["digest"]:
        raise ArtifactError(f"{drafter_path}: trained for target {cfg.target_digest[:12]}, "
                            f"not {ident['digest'][:12]} ({identity_path})")
    tok = load_tokenizer(ident["path"], chat_template, need_template=True, trust_remote_code=ld["trust_remote_code"])
    model = load_model(ident["path"], dtype=ld["dtype"], trust_remote_code=ld["trust_remote_code"],
                       device=job_device(ld["device"]))
    log.info("target on %s (%s)", model.device, ld["dtype"])
    eos = stop_ids(tok, model)  # the template's turn-end marker too: a base model's EOS alone never comes
    return ident, Target(model, cfg.layer_ids, eos if stop_at_eos else set()), EagleProposer(drafter, d2t), cfg, tok
