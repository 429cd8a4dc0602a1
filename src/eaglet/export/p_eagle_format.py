"""A P-EAGLE drafter in the format vLLM 0.32 serves with parallel drafting (docs/block-drafters.md §3):
eaglet's EAGLE-3 format A (eaglet.export.vllm_format: ``LlamaForCausalLMEagle3``, ``midlayer.*``, the
aux layer ids at top level and in ``eagle_config``) plus

- the tensor ``mask_hidden`` [3·H_t] (fp32, like every weight): vLLM's ``llama_eagle3.load_weights``
  copies it into its buffer (and fails without it when parallel drafting is on); the proposer sets
  every masked slot's hidden to ``combine_hidden_states(mask_hidden)`` at load;
- ``mask_token_id`` at top level: the proposer's ``parallel_drafting_token_id``
  (``_init_parallel_drafting_params`` reads it there);
- ``parallel_drafting: true`` at top level: not read by vLLM from the drafter's config (it is a field
  of the *speculative* config); eaglet's runners read it (eaglet.engines.vllm_env.engine_kwargs) and
  serve the folder with ``{"method": "eagle3", "parallel_drafting": true}``;
- ``eaglet.kind: p_eagle`` and ``eaglet.num_speculative_tokens`` = K (the number of slots trained;
  served with ``num_speculative_tokens = K``).

    export_p_eagle(out_dir, tensors, cfg, identity, target_conf)   # tensors: the trainer's file's
    checks = p_eagle_static_checks(out_dir, identity, trained)      # EAGLE-3's static checks + p_eagle.static
    as_p_eagle(eagle3_dir, out_dir, mask_token_id=m, k=K)          # a format A folder served in parallel
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eaglet.base.files import read_json
from eaglet.base.tensors import load_tensors
from eaglet.export.contract.record import check
from eaglet.export.contract.static_checks import (
    config_problems,
    effective_config,
    expected_tensors,
    key_set_check,
    layer_id_check,
    read_export,
    shapes_dtypes_check,
    vocab_map_check,
)
from eaglet.export.vllm_format import export_tensors, vllm_config, write_dir

# the export stage's engine checks (eaglet.export.p_eagle_export), run with export.vllm_check: p_eagle.parity
# (vLLM's own module in its interpreter, eaglet.export.contract.p_eagle_parity), then the served ones
P_EAGLE_VLLM_CHECKS = ("p_eagle.parity", "vllm.known_answer", "vllm.lossless", "vllm.acceptance", "vllm.aux_layers")
# EAGLE-3's checks with no P-EAGLE counterpart built, each with why (named in export.accept_not_run)
P_EAGLE_NOT_BUILT = {
    "loader.sglang": "SGLang's loader is not run on a P-EAGLE directory by eaglet (vLLM serves it, "
    "p_eagle.parity checks vLLM's own module)",
}


def parallel_fields(conf: dict, mask_token_id: int, k: int) -> dict:
    """A format A config.json made P-EAGLE's: mask_token_id, parallel_drafting, the kind and K."""
    return {**conf, "mask_token_id": int(mask_token_id), "parallel_drafting": True,
            "eaglet": {**(conf.get("eaglet") or {}), "kind": "p_eagle", "num_speculative_tokens": int(k)}}


def p_eagle_export_config(cfg, identity: dict, target_conf: dict | None = None) -> dict:
    """config.json: format A's (vllm_config) plus mask_token_id, parallel_drafting and the kind."""
    c = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    return parallel_fields(vllm_config(c, identity, target_conf or {}), c["mask_token_id"], c["parallel_k"])


def as_p_eagle(eagle3_dir: str | Path, out_dir: str | Path, *, mask_token_id: int, k: int) -> Path:
    """An EAGLE-3 format A folder (the known-answer drafter, eaglet.export.contract.twin) as a P-EAGLE one:
    its tensors plus ``mask_hidden`` = 0 (the masked slots read fc(0) = 0) and parallel_fields. vLLM's
    parallel round computes its first slot as EAGLE-3's first step (x_{t+1} with fc(aux_t) at position t,
    the slots after it unseen: causal), so the folder's first draft is EAGLE-3's."""
    import torch

    src = Path(eagle3_dir)
    conf = read_json(src / "config.json")
    tensors = load_tensors(src / "model.safetensors")
    tensors["mask_hidden"] = torch.zeros(3 * int(conf.get("target_hidden_size") or conf["hidden_size"]))
    write_dir(Path(out_dir), parallel_fields(conf, mask_token_id, k), tensors)
    return Path(out_dir)


def export_p_eagle(out_dir: str | Path, tensors: dict, cfg, identity: dict, target_conf: dict | None = None) -> Path:
    """Write the export from the trainer's tensors (eaglet.drafter.p_eagle.save_p_eagle's names, with
    d2t and t2d): format A's tensors (export_tensors) with mask_hidden among them."""
    c = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    if "mask_hidden" not in tensors:
        raise ValueError("P-EAGLE tensors without mask_hidden (an EAGLE-3 drafter file?)")
    write_dir(Path(out_dir), p_eagle_export_config(c, identity, target_conf), export_tensors(tensors, c))
    return Path(out_dir)


def expected_p_eagle_tensors(conf: dict) -> dict[str, tuple]:
    """Format A's tensor set and shapes for the config, plus mask_hidden [3·H_t]."""
    want = expected_tensors(conf)
    want["mask_hidden"] = (3 * int(conf.get("target_hidden_size") or conf["hidden_size"]),)
    return want


def p_eagle_problems(conf: dict, header: dict) -> list[str]:
    """What is P-EAGLE's own in the export: the mask token, the flag, mask_hidden present and shaped."""
    bad = []
    m, V = conf.get("mask_token_id"), conf.get("vocab_size")
    if not isinstance(m, int) or isinstance(m, bool) or not isinstance(V, int) or not 0 <= m < V:
        bad.append(f"mask_token_id {m!r} not a token id of the vocabulary 0 .. {V - 1 if isinstance(V, int) else '?'}")
    if (conf.get("dflash_config") or {}).get("mask_token_id") is not None:
        bad.append("dflash_config.mask_token_id present: vLLM reads it before mask_token_id")
    if conf.get("parallel_drafting") is not True:
        bad.append("parallel_drafting is not true: eaglet's runners would serve it as plain EAGLE-3")
    k = (conf.get("eaglet") or {}).get("num_speculative_tokens")
    if not isinstance(k, int) or k < 2:
        bad.append(f"eaglet.num_speculative_tokens {k!r}: the K the drafter was trained for (>= 2) is needed")
    want = (3 * int(conf.get("target_hidden_size") or conf.get("hidden_size") or 0),)
    if "mask_hidden" not in header:
        bad.append("mask_hidden missing: vLLM refuses to serve parallel drafting without it")
    elif header["mask_hidden"][0] != want:
        bad.append(f"mask_hidden shape {list(header['mask_hidden'][0])} != {list(want)} (3 x target hidden)")
    return bad


def p_eagle_static_checks(drafter_dir: str | Path, identity: dict, trained: dict | None = None) -> list[dict]:
    """EAGLE-3's static checks of format A (config fields, key set, shapes and dtypes, vocabulary map,
    layer ids: the same functions) over the P-EAGLE tensor set, and ``p_eagle.static``."""
    d = Path(drafter_dir)
    conf, header = read_export(d)
    fmt, c = effective_config(conf)
    want = expected_p_eagle_tensors(c) if c.get("hidden_size") else {}
    problems = config_problems(conf, fmt, c, identity, trained) if fmt == "A" else ["not format A"]
    return [
        check("static.config_fields", not problems, {"format": fmt, "problems": problems}),
        key_set_check(want, header),
        shapes_dtypes_check(want, header),
        vocab_map_check(d / "model.safetensors", header, c),
        layer_id_check(conf, fmt, identity["num_layers"], trained),
        check(
            "p_eagle.static",
            not (p := p_eagle_problems(conf, header)),
            {"problems": p, "mask_token_id": conf.get("mask_token_id")},
        ),
    ]


def p_eagle_static_problems(drafter_dir: str | Path, identity: dict, trained: dict | None = None) -> list[str]:
    """The failed static checks' names with their details ([] = passes)."""
    return [
        f"{c['name']}: {c['details']}"
        for c in p_eagle_static_checks(drafter_dir, identity, trained)
        if c["ok"] is not True
    ]
