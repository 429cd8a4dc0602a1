"""DFlash contract check 1, parity with vLLM's own module: the export loaded by vLLM's
``DFlashQwen3ForCausalLM`` (its config parsing and ``load_weights``, in vLLM's interpreter:
eaglet.engines.vllm_dflash_probe) and eaglet's trained drafter (eaglet.drafter.dflash) compute the
same drafting round on the same inputs, piece by piece:

    aux_layers     the target layers vLLM taps for the export's config == the trained taps (eaglet ids)
    mask_token_id  the one vLLM feeds the masked slots == the trained one
    causal         every draft layer non-causal in vLLM (as trained)
    fc, ctx_k, ctx_v, embed, layer_out (each layer), normed, logits   within ``tol`` (relative to
                   the largest value, at least 1), and the drafts (argmax at the masked slots) equal

so a permuted or mis-stacked layer, q_norm/k_norm swapped, target_layer_ids off by one (the DFlash
"output of layer i" vs vLLM +1 trap) or a wrong mask token each fail it. Several exports are probed
against their trained drafters in one vLLM interpreter (its start and import cost ~10-20 s).

    recs = dflash_parity_checks([(export_dir, model), ...], embed_VH, head_VH, python=PY, work_dir=W)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from eaglet.engines import vllm_env
from eaglet.export.contract.record import KNOWN_ANSWER, check

# A DFlash export's contract (eaglet.export.dflash_export): the checks that run in vLLM (with
# export.vllm_check; vllm.known_answer is eaglet.export.dflash_known_answer's), and EAGLE-3's
# that have no DFlash counterpart, always not run (a dflash config names them in export.accept_not_run;
# eaglet.workflow.checks refuses one that does not at parse time)
DFLASH_VLLM_CHECKS = ("dflash.parity", KNOWN_ANSWER, "vllm.lossless", "vllm.acceptance")
DFLASH_NOT_APPLICABLE = ("loader.sglang",)
PROBE = Path(vllm_env.__file__).with_name("vllm_dflash_probe.py")  # engine-side, copied and run in its venv
PIECES = ("fc", "ctx_k", "ctx_v", "embed", "layer_out", "normed", "logits")


def probe_inputs(cfg, embed_VH, head_VH, context: int = 6, seed: int = 0) -> dict:
    """One round's inputs: random taps of ``context`` positions, a bonus token, the target's
    embedding and head."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"taps": torch.randn(context, cfg.n_taps * cfg.target_hidden_size, generator=g),
            "bonus": torch.randint(0, cfg.vocab_size, (1,), generator=g),
            "embed": embed_VH.detach().float().contiguous(), "head": head_VH.detach().float().contiguous()}


def eaglet_round(model, inputs: dict) -> dict:
    """eaglet's side: the same pieces as the probe's, from eaglet.drafter.dflash (in fp32, eval mode)."""
    import copy

    import torch
    import torch.nn.functional as F

    cfg = model.cfg
    K, taps = cfg.block_size, inputs["taps"][None].float()
    P = taps.shape[1]
    if next(model.parameters()).dtype != torch.float32 or model.training:  # never change the caller's model
        model = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        fc = model.fc(taps)
        ctx_kv = model.context_kv(model.hidden_norm(fc), torch.arange(P)[None])
        ids = torch.tensor([[int(inputs["bonus"][0])] + [cfg.mask_token_id] * (K - 1)])
        pos = torch.arange(P, P + K)[None]
        h = F.embedding(ids, inputs["embed"])
        embed = h[0]
        cos, sin = model.rotary(pos, h.dtype)
        mask = torch.ones(1, K, P + K, dtype=torch.bool)
        outs = []
        for layer, (k, v) in zip(model.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
            outs.append(h[0])
        normed = model.norm(h)[0]
    return {"fc": fc[0], "ctx_k": torch.stack([k[0].transpose(0, 1) for k, _ in ctx_kv]),
            "ctx_v": torch.stack([v[0].transpose(0, 1) for _, v in ctx_kv]), "embed": embed,
            "layer_out": torch.stack(outs), "normed": normed, "logits": normed @ inputs["head"].T,
            "ids": ids[0]}


def run_probe(cases: list[dict], *, python, work_dir, timeout: float = 600, probe: Path = PROBE) -> list[dict]:
    """Run ``probe`` (eaglet.engines.vllm_dflash_probe; P-EAGLE's: eaglet.export.contract.p_eagle_parity)
    once for all ``cases`` ({"drafter", "inputs", "k", "target_layers", "target_vocab"}); per case its
    tensors + "meta", or {"error": text, "log"}."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    work = Path(work_dir).absolute()
    runner = vllm_env.copy_runner(probe, work)
    shutil.copyfile(PROBE, work / PROBE.name)  # the P-EAGLE probe imports the DFlash probe's shared parts
    todo = [{**c, "out": str(work / f"probe{i}.safetensors")} for i, c in enumerate(cases)]
    for c in todo:
        for p in (Path(c["out"]), Path(c["out"] + ".error")):
            p.unlink(missing_ok=True)
    (work / "cases.json").write_text(json.dumps(todo))
    log = work / "probe.log"
    with open(log, "w") as fh:
        try:
            vllm_env.run([python, runner, work / "cases.json"], log=fh, env=vllm_env.process_env(work, python),
                         cwd=work, timeout=vllm_env.timeout(timeout))
        except subprocess.TimeoutExpired:
            pass
    out = []
    for c in todo:
        o, err = Path(c["out"]), Path(c["out"] + ".error")
        if o.exists():
            with safe_open(str(o), framework="pt") as f:
                meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
            out.append({**load_file(str(o)), "meta": meta})
        else:
            text = err.read_text() if err.exists() else log.read_text(errors="replace")[-3000:]
            out.append({"error": text.strip().splitlines()[-1] if text.strip() else "no output", "log": text})
    return out


def compare(ours: dict, theirs: dict, cfg, tol: float = 1e-4) -> dict:
    """The check record of one export: eaglet's round (``ours``) against vLLM's (``theirs``)."""
    if "error" in theirs:
        return check("dflash.parity", False, {"error": theirs["error"]})
    meta = theirs["meta"]
    det = {"aux_layers_vllm": meta["aux_layers"], "aux_layers_trained": list(cfg.target_layer_ids),
           "mask_token_id_vllm": meta["mask_token_id"], "mask_token_id_trained": cfg.mask_token_id,
           "causal_vllm": meta["causal"], "tol": tol}
    bad = []
    if meta["aux_layers"] != list(cfg.target_layer_ids):
        bad.append("aux_layers")
    if meta["mask_token_id"] != cfg.mask_token_id:
        bad.append("mask_token_id")
    if any(meta["causal"]):
        bad.append("causal")
    for name in PIECES:
        a, b = ours[name].float(), theirs[name].float()
        if a.shape != b.shape:
            det[name] = f"shape {tuple(a.shape)} vs vLLM {tuple(b.shape)}"
            bad.append(name)
            continue
        scale = max(1.0, float(b.abs().max()))
        det[name] = float((a - b).abs().max()) / scale
        if not det[name] <= tol:
            bad.append(name)
    drafts = ours["logits"][1:].argmax(-1).tolist(), theirs["logits"][1:].argmax(-1).tolist()
    det["drafts"] = {"eaglet": drafts[0], "vllm": drafts[1]}
    if drafts[0] != drafts[1]:
        bad.append("drafts")
    det["failed"] = bad
    return check("dflash.parity", not bad, det)


def save_probe_inputs(inp: dict, path) -> None:
    """The probe's inputs as one safetensors file, each tensor its own copy: a target with tied
    embeddings (SmolLM2) hands the same storage as embed and head, which safetensors refuses."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in inp.items()}, str(path))


def dflash_parity_checks(pairs: list[tuple], embed_VH, head_VH, *, python, work_dir, tol: float = 1e-4,
                         seed: int = 0, timeout: float = 600) -> list[dict]:
    """``pairs``: (export dir, its trained DFlashDrafter); one check record each, one vLLM process."""
    work = Path(work_dir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    cases, ours = [], []
    for i, (d, model) in enumerate(pairs):
        cfg = model.cfg
        inp = probe_inputs(cfg, embed_VH, head_VH, seed=seed)
        save_probe_inputs(inp, work / f"in{i}.safetensors")
        cases.append({"drafter": str(Path(d).absolute()), "inputs": str(work / f"in{i}.safetensors"),
                      "k": cfg.block_size - 1, "target_layers": cfg.num_target_layers,
                      "target_vocab": cfg.vocab_size})
        ours.append(eaglet_round(model, inp))
    theirs = run_probe(cases, python=python, work_dir=work, timeout=timeout)
    return [compare(o, t, m.cfg, tol) for o, t, (_, m) in zip(ours, theirs, pairs)]
