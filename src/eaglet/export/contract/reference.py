"""The exported directory's own reference (``reference.json`` beside ``config.json``): what a drafter
directory needs to prove itself when the trainer's file is gone, as a user who downloads it has it
(eaglet.export.contract, checks ``reference.*``).

It holds, written at export from the *trained* weights:

- ``weights_sha256``: the sha256 of every exported tensor (its dtype, shape and bytes), and
  ``config_sha256`` of config.json's content. A copy whose ``lm_head`` rows or ``fc`` blocks were
  permuted, re-saved in another dtype, truncated, or whose layer ids were edited fails
  ``reference.weights``, naming the tensors (or config.json).
- ``chain``: eaglet's exact drafting on fixed prompts, along a fixed continuation of each (the target's
  own greedy tokens; vLLM's plain output when the real-vLLM check ran, else the HF target's): at
  every round the k draft ids proposed and how many were accepted, counted the way vLLM counts them
  (``served_rounds``). ``reference.chain`` reruns it with the directory's weights and the HF target
  and must propose the same drafts; ``vllm.acceptance`` compares vLLM's counters with it.

The one aggregation rule (``agreement``): τ pooled over verification rounds, 1 + accepted / rounds,
for the served run (vLLM's ``num_accepted_tokens`` / ``num_drafts``) and for the simulation along the
same text. Both count every round, the last ones included, the way vLLM does: a round drafts k
tokens even when fewer remain before ``max_tokens``, and its accepted drafts count in full. On
identical numbers they are equal; they may differ only where two implementations' floating point
can flip a decision: a round whose deciding drafts (the accepted ones and the first rejected) had
the drafter's top-2 logits within ``TIE`` of each other, or whose verified positions had the
target's within ``TIE``. Each such round may move the accepted count by at most k (and the round
count by as much), so the tolerance is k × (those rounds), zero when there are none. ``TIE`` is
1e-3: the parity check holds eaglet's and an independent forward within 1e-4 in fp32, and vLLM's
drafter and target logits on this CPU build agreed with eaglet's to a few 1e-5 in the runs measured
(docs/guarantees.md, "The acceptance gate").

Shape suffixes: T tokens, 3 the three aux layers, H target hidden.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json, write_json
from eaglet.base.tensors import load_tensors
from eaglet.drafter.chain import chain_along

FILE = "reference.json"
VERSION = 1
TIE = 1e-3


# --------------------------------------------------------------------------- weights
def tensor_digests(path: str | Path) -> dict[str, str]:
    """sha256 of every tensor in a safetensors file: its dtype, shape and bytes."""
    import torch

    tensors = load_tensors(path)
    out = {}
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


def weights_check(drafter_dir: str | Path, ref: dict) -> dict:
    from eaglet.export.contract.record import check

    want = ref.get("weights_sha256") or {}
    got = tensor_digests(Path(drafter_dir) / "model.safetensors")
    changed = sorted(n for n in want if n in got and got[n] != want[n])
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    conf = config_digest(Path(drafter_dir) / "config.json")
    if ref.get("config_sha256") and conf != ref["config_sha256"]:
        changed.append("config.json")
    return check("reference.weights", bool(want) and not (changed or missing or extra),
                 {"tensors": len(want), "changed": changed, "missing": missing, "unexpected": extra,
                  "rule": f"every tensor's sha256, and config.json's content, equal what {FILE} recorded at export"})


def config_digest(path: str | Path) -> str:
    """sha256 of config.json's content (keys sorted: a re-indented file is the same config)."""
    return hashlib.sha256(json.dumps(read_json(path), sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- the exported drafter
def load_exported(drafter_dir: str | Path, identity: dict):
    """An exported format-A directory as eaglet's drafter: (model, DrafterConfig, d2t), read by the
    format's reader (eaglet.drafter.published, which the trainer's train.init_from reads with too).
    The config's ``eaglet`` block names the target digest it was exported for."""
    from eaglet.drafter import published
    from eaglet.drafter.eagle3 import Eagle3Drafter, load_target_embedding

    d = Path(drafter_dir)
    cfg = published.drafter_config(published.read_config(d), d)
    if cfg.target_digest and cfg.target_digest != identity.get("digest"):
        raise ArtifactError(f"{d}: exported for target {cfg.target_digest[:12]}, not "
                            f"{str(identity.get('digest'))[:12]} ({identity.get('name')})")
    weights, d2t, _t2d, embed = published.read_tensors(d, cfg)
    if embed is not None:
        raise ArtifactError(f"{d}: ships its own {published.EMBED} (engines would use it instead of the target's)")
    model = Eagle3Drafter(cfg, load_target_embedding(identity["path"]))
    model.load_state_dict({**weights, "embed_tokens.weight": model.embed_tokens.weight}, strict=True)
    return model.eval(), cfg, d2t


# --------------------------------------------------------------------------- the chain
def reference_chain(drafter, identity: dict, prompt_ids: list[list[int]] | None,
                    continuations: list[list[int]] | None, *, k: int, max_tokens: int, load: dict | None = None,
                    prompts: list[str] | None = None) -> dict:
    """The chain of ``drafter`` (a trainer's drafter.safetensors, or an exported format-A directory)
    along the given continuations, on the HF target in-process (eaglet.engines.hf_loop). Without
    continuations, along the HF target's own greedy ones (max_tokens + k - 1 tokens); without
    prompt ids, ``prompts`` tokenised as vLLM tokenises a text prompt."""
    from eaglet.engines import hf_loop
    from eaglet.target.load import job_device, load_model, target_load

    ld = target_load(load)
    if Path(drafter).is_dir():
        model, cfg, d2t = load_exported(drafter, identity)
    else:
        from eaglet.drafter.eagle3 import load_drafter

        model, cfg, d2t, _ = load_drafter(drafter, identity)
    tgt = hf_loop.Target(load_model(identity["path"], dtype=ld["dtype"], trust_remote_code=ld["trust_remote_code"],
                                    device=job_device(ld["device"])), cfg.layer_ids, set())
    prop = hf_loop.EagleProposer(model, d2t)
    if prompt_ids is None:
        from eaglet.target.load import load_tokenizer

        tok = load_tokenizer(identity["path"], trust_remote_code=ld["trust_remote_code"])
        prompt_ids = [list(tok(p)["input_ids"]) for p in prompts]
    source = "given"
    if continuations is None:
        continuations = [hf_loop.greedy(tgt, p, max_tokens + k - 1)["tokens"] for p in prompt_ids]
        source = "the HF target's greedy output"
    per = [chain_along(tgt, prop, p, c, k, max_tokens, TIE)["rounds"] for p, c in zip(prompt_ids, continuations,
                                                                                    strict=True)]
    return summarise(per, k) | {"k": k, "max_tokens": max_tokens, "prompts": prompts,
                                "prompt_token_ids": prompt_ids, "continuations": continuations,
                                "continuation_source": source}


def summarise(per_prompt: list[list[dict]], k: int) -> dict:
    rounds = [r for p in per_prompt for r in p]
    acc = sum(r["accepted"] for r in rounds)
    return {"per_prompt": per_prompt, "rounds": len(rounds), "accepted": acc,
            "tie_rounds": sum(r["tie"] for r in rounds),
            "accepted_per_pos": [sum(r["accepted"] > j for r in rounds) for j in range(k)],
            "tau": 1 + acc / len(rounds) if rounds else None}


# --------------------------------------------------------------------------- agreement
def agreement(rounds: int, accepted: int, ref: dict, k: int) -> dict:
    """Served (rounds, accepted) against the simulated chain ``ref`` (``summarise``): τ pooled over
    verification rounds for both, and ``ok`` when the counts differ by no more than k × the
    reference's near-tie rounds (see the module docstring)."""
    allow = k * ref["tie_rounds"]
    d_acc, d_rounds = abs(accepted - ref["accepted"]), abs(rounds - ref["rounds"])
    return {"ok": rounds > 0 and d_acc <= allow and d_rounds <= allow,
            "served_tau": 1 + accepted / rounds if rounds else None, "simulated_tau": ref["tau"],
            "served": {"rounds": rounds, "accepted": accepted},
            "simulated": {"rounds": ref["rounds"], "accepted": ref["accepted"], "tie_rounds": ref["tie_rounds"]},
            "allowed_difference": allow,
            "rule": ("τ pooled over verification rounds (1 + accepted / rounds), served vs eaglet's exact chain "
                     f"along the same text counted as vLLM counts; accepted and rounds may differ by at most "
                     f"k × near-tie rounds = {k} × {ref['tie_rounds']} = {allow} (tie: top-2 logits within {TIE})")}


def same_drafts(got: dict, ref: dict) -> dict:
    """``reference.chain``: the directory's drafter proposes, round by round, the drafts recorded at
    export; a round may differ only where the record marks a near tie."""
    diff, untied = 0, []
    for i, (gp, rp) in enumerate(zip(got["per_prompt"], ref["per_prompt"], strict=True)):
        for j, (a, b) in enumerate(zip(gp, rp)):
            if (a["g"], a["drafts"]) != (b["g"], b["drafts"]):
                diff += 1
                if not b["tie"]:
                    untied.append({"prompt": i, "round": j, "g": b["g"], "recorded": b["drafts"],
                                   "got": a["drafts"]})
        if len(gp) != len(rp) and not any(r["tie"] for r in rp):
            untied.append({"prompt": i, "rounds_recorded": len(rp), "rounds_got": len(gp)})
    return {"ok": not untied, "rounds_differing": diff, "untied_differences": untied[:10],
            "recorded_tau": ref["tau"], "got_tau": got["tau"],
            "rule": "every round proposes the recorded drafts, except rounds the record marks as a near tie"}


def write(drafter_dir: str | Path, weights_from: str | Path, chain: dict | None, why_no_chain: str | None) -> dict:
    ref = {"version": VERSION, "weights_sha256": tensor_digests(weights_from),
           "config_sha256": config_digest(Path(drafter_dir) / "config.json"),
           "chain": chain, "chain_not_recorded": why_no_chain}
    write_json(Path(drafter_dir) / FILE, ref)
    return ref


def read(drafter_dir: str | Path) -> dict | None:
    p = Path(drafter_dir) / FILE
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{p}: not JSON ({e})") from None
