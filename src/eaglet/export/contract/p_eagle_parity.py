"""P-EAGLE contract check ``p_eagle.parity``, parity with vLLM's own module: the export loaded by vLLM's
``Eagle3LlamaForCausalLM`` with parallel drafting on (its config parsing, its ``load_weights``, the
proposer's mask-token rule, in vLLM's interpreter: eaglet.engines.vllm_p_eagle_probe) and eaglet's trained
drafter (eaglet.drafter.p_eagle.PEagleDrafter, its own ``project``, ``mask_state``, ``parallel_logits``
and ``draft_parallel``) compute the same parallel round on the same inputs, piece by piece:

    aux_layers     the target layers vLLM taps for the export's config == the trained layer ids
    mask_token_id  the one vLLM's proposer feeds the masked slots == the trained one
    parallel_drafting  the module vLLM built holds a mask_hidden (parallel drafting on)
    fc [P, H], mask_fc [H], embed [P+K−1, H], layer_out, normed, aux_out [P+K−1, H]   within ``tol``
                   (relative to the largest value of vLLM's piece, at least 1)
    logits [K, V]  the K slots' logits over the target vocabulary: the same support (−inf outside the
                   draft vocabulary's image under d2t) and the rest within ``tol``
    drafts         the argmax per slot (target ids) equal

The round (docs/block-drafters.md §3): P real entries (x_{p+1} with fc(aux_p) at position p, p = 0 .. t,
t = P − 1; x_{t+1} the bonus token) then K − 1 masked slots (the mask token with fc(mask_hidden) at
t + 1 .. t + K − 1), one causal forward. So a zeroed or stale mask_hidden fails mask_fc (the served
counters could not tell it on the tiny target: its greedy output repeats one token), a wrong mask token
fails mask_token_id and embed, layer ids off by one fail aux_layers, a permuted or swapped weight
fails the piece it first moves. Several exports are probed against their trained drafters in one vLLM
interpreter (its start and import cost ~10-20 s).

    recs = p_eagle_parity_checks([(export_dir, model, d2t), ...], target_layers=L, python=PY, work_dir=W)
    # model: the trained PEagleDrafter (its embed_tokens the target's embedding, shared by vLLM);
    # d2t: the trainer's draft -> target offsets [V_d] (None or omitted: the full vocabulary)

Shape legend: P real entries, K slots (cfg.parallel_k), H draft hidden, V target vocab, V_d draft vocab.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.engines import vllm_env
from eaglet.export.contract.dflash_parity import run_probe, save_probe_inputs
from eaglet.export.contract.record import check

NAME = "p_eagle.parity"
PROBE = Path(vllm_env.__file__).with_name("vllm_p_eagle_probe.py")  # engine-side, copied and run in its venv
PIECES = ("fc", "mask_fc", "embed", "layer_out", "normed", "aux_out")


def probe_inputs(cfg, embed_VH, context: int = 6, seed: int = 0) -> dict:
    """One round's inputs: random aux states of ``context`` real positions [P, 3·H_t], random tokens
    x_0 .. x_P [P + 1] (x_P the bonus; entry p reads x_{p+1}), the target's embedding [V, H]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"aux": torch.randn(context, len(cfg.layer_ids) * cfg.target_hidden_size, generator=g),
            "x": torch.randint(0, cfg.vocab_size, (context + 1,), generator=g),
            "embed": embed_VH.detach().float().contiguous()}


def engine_inputs(inp: dict) -> dict:
    """What the probe is handed: the aux states, the real entries' ids (vLLM's shifted input x_1 ..
    x_P, the last the bonus token) and the embedding."""
    return {"aux": inp["aux"], "ids": inp["x"][1:], "embed": inp["embed"]}


def eaglet_round(model, inputs: dict, d2t=None) -> dict:
    """eaglet's side: the probe's pieces from the trained drafter's own functions, in fp32 and eval mode
    on a copy (the caller's model is never changed): fc = ``project(aux)``, mask_fc = ``mask_state()``,
    and one ``parallel_logits`` round whose single ``forward_step`` is recorded (its ids, its embedding
    lookup, the norm's input = layer_out and output = normed, the hidden it returns = aux_out); logits
    over the target vocabulary through d2t (−inf elsewhere), drafts = ``draft_parallel``."""
    import copy

    import torch

    m = copy.deepcopy(model).float().eval()
    cfg = m.cfg
    aux, x = inputs["aux"].float(), inputs["x"].long()
    V_d = cfg.draft_vocab_size
    d2t = torch.zeros(V_d, dtype=torch.long) if d2t is None else torch.as_tensor(d2t).long()
    seen: dict = {"calls": 0}
    step = m.forward_step

    def recorded(ids_BT, hidden_BTH, pos_BT, cache=None):
        logits, h = step(ids_BT, hidden_BTH, pos_BT, cache)
        seen.update(ids=ids_BT[0], aux_out=h[0], calls=seen["calls"] + 1)
        return logits, h

    with torch.no_grad():
        g = m.project(aux[None])[0]
        mask_fc = m.mask_state()
        m.forward_step = recorded  # the copy's: parallel_logits runs one forward_step
        hooks = [m.embed_tokens.register_forward_hook(lambda _m, _a, out: seen.update(embed=out[0])),
                 m.norm.register_forward_hook(lambda _m, a, out: seen.update(layer_out=a[0][0], normed=out[0]))]
        try:
            logits = m.parallel_logits(x, g)  # [K, V_d]
        finally:
            for h in hooks:
                h.remove()
            del m.forward_step
        if seen["calls"] != 1:  # the recorded pieces are the round's only if it is one forward
            raise RuntimeError(f"parallel_logits ran {seen['calls']} forward steps, the pieces want one")
        full = logits.new_full((logits.shape[0], cfg.vocab_size), float("-inf"))
        full[:, torch.arange(V_d) + d2t] = logits
        drafts = m.draft_parallel(x, g, d2t)
    return {"fc": g, "mask_fc": mask_fc, "embed": seen["embed"], "layer_out": seen["layer_out"],
            "normed": seen["normed"], "aux_out": seen["aux_out"], "logits": full, "ids": seen["ids"],
            "drafts": drafts}


def compare(ours: dict, theirs: dict, cfg, tol: float = 1e-4) -> dict:
    """The check record of one export: eaglet's round (``ours``) against vLLM's (``theirs``); details
    name every failed piece in ``failed``."""
    import torch

    if "error" in theirs:
        return check(NAME, False, {"error": theirs["error"]})
    meta = theirs["meta"]
    det = {"aux_layers_vllm": meta["aux_layers"], "aux_layers_trained": list(cfg.layer_ids),
           "mask_token_id_vllm": meta["mask_token_id"], "mask_token_id_trained": cfg.mask_token_id,
           "parallel_drafting_vllm": meta["parallel_drafting"], "k": int(cfg.parallel_k), "tol": tol}
    bad = []
    if meta["aux_layers"] != list(cfg.layer_ids):
        bad.append("aux_layers")
    if meta["mask_token_id"] != cfg.mask_token_id:
        bad.append("mask_token_id")
    if meta["parallel_drafting"] is not True:
        bad.append("parallel_drafting")
    for name in (*PIECES, "logits"):
        a, b = ours[name].float(), theirs[name].float()
        if a.shape != b.shape:
            det[name] = f"shape {tuple(a.shape)} vs vLLM {tuple(b.shape)}"
            bad.append(name)
            continue
        on = ~torch.isneginf(b) if name == "logits" else torch.ones_like(b, dtype=torch.bool)
        if not torch.equal(on, ~torch.isneginf(a) if name == "logits" else on):
            det[name] = "the −inf entries differ (the draft vocabulary's image under d2t)"
            bad.append(name)
            continue
        scale = max(1.0, float(b[on].abs().max()))  # a NaN anywhere fails below
        det[name] = float((a[on] - b[on]).abs().max()) / scale
        if not det[name] <= tol:
            bad.append(name)
    vllm_drafts = theirs["logits"].argmax(-1).tolist()
    det["drafts"] = {"eaglet": ours["drafts"], "vllm": vllm_drafts}
    if ours["drafts"] != vllm_drafts:
        bad.append("drafts")
    det["failed"] = bad
    return check(NAME, not bad, det)


def p_eagle_parity_checks(pairs: list[tuple], *, target_layers: int, python, work_dir, tol: float = 1e-4,
                          seed: int = 0, context: int = 6, timeout: float = 600) -> list[dict]:
    """``pairs``: (export dir, its trained PEagleDrafter[, its d2t]); one ``p_eagle.parity`` record each,
    one vLLM process. ``target_layers``: the target's layer count (identity ``num_layers``; vLLM numbers
    the draft layer after it). The embedding handed to vLLM is the drafter's own frozen copy of the
    target's (vLLM shares the target's at serve time; the export carries none)."""
    work = Path(work_dir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    cases, ours = [], []
    for i, (d, model, *rest) in enumerate(pairs):
        cfg = model.cfg
        inp = probe_inputs(cfg, model.embed_tokens.weight, context=context, seed=seed)
        save_probe_inputs(engine_inputs(inp), work / f"in{i}.safetensors")
        cases.append({"drafter": str(Path(d).absolute()), "inputs": str(work / f"in{i}.safetensors"),
                      "k": int(cfg.parallel_k), "target_layers": int(target_layers), "target_vocab": cfg.vocab_size})
        ours.append(eaglet_round(model, inp, rest[0] if rest else None))
    theirs = run_probe(cases, python=python, work_dir=work, timeout=timeout, probe=PROBE)
    return [compare(o, t, p[1].cfg, tol) for o, t, p in zip(ours, theirs, pairs)]
