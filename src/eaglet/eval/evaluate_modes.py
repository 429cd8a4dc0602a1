"""Rule evaluate_modes: the offline figures of evaluate_offline once per chat-template mode
(``evaluate.modes``: keyword arguments over the served ones, e.g. Qwen3's enable_thinking on and
off), on the evaluation sets rendered each mode's way; writes modes.json (docs/eagle3.md §7).

    python -m eaglet.eval.evaluate_modes --drafter results/RUN/train/drafter.safetensors \
        --identity resources/targets/NAME/identity.json --sets '["mtbench"]' \
        --modes '{"thinking": {"enable_thinking": true}, "no_thinking": {"enable_thinking": false}}' \
        --config '{"num_prompts": 10, "max_new_tokens": 128}' --out-dir results/RUN/eval [--threads 2] [--log LOG]

Each mode's figures are evaluate_offline's (eaglet.eval.evaluate_offline.offline_results): the
exact chain at T = 0 and the expected chain at each T > 0, with their matrix rows (``mode`` added).
"""

from __future__ import annotations

import logging
from pathlib import Path

from eaglet.base import datasets
from eaglet.base.files import write_json
from eaglet.base.settings_files import parse_json_arg
from eaglet.engines.hf_loop import setup
from eaglet.eval.evaluate_offline import offline_results
from eaglet.eval.hf_stage import NOT_RUN, not_run_reason, parser, run
from eaglet.eval.options import hf_options, target_load

log = logging.getLogger("eaglet.eval.evaluate_modes")


def evaluate_modes(drafter: str | Path, identity: str | Path, sets: list[str], out_dir: str | Path,
                   modes: dict[str, dict], threads: int | None = None, **opts) -> dict:
    """The offline figures (exact chain at T = 0, expected chain at T > 0) once per chat-template
    mode: each mode's keyword arguments over the served ones (``chat_template_kwargs``), e.g.
    Qwen3's ``enable_thinking`` true and false. A drafter trained in one mode can collapse in the
    other, so each mode is measured on the same prompts rendered its way. Two modes whose renders
    of every prompt are identical are refused: the template ignores the switch. Writes modes.json."""
    o = hf_options(opts)
    out = Path(out_dir) / "modes.json"
    if not modes or any(not isinstance(v, dict) for v in modes.values()):
        raise ValueError(f"evaluate.modes: a mapping mode name -> chat template keyword arguments, got {modes!r}")
    if not o["hf_loop"]:
        why = not_run_reason("evaluate_modes", o)
        res = {"stage": "evaluate_modes", "status": NOT_RUN, "hf_loop_reason": why, "options": o,
               "modes": {m: {"chat_template_kwargs": {**o["chat_template_kwargs"], **kw}} for m, kw in modes.items()},
               "matrix": []}
        write_json(out, res)
        return res
    ident, target, proposer, cfg, tok = setup(drafter, identity, threads, o["stop_at_eos"], o["chat_template"],
                                               target_load(o))
    rendered, per_mode, matrix = {}, {}, []
    for name, kw in modes.items():
        mo = {**o, "chat_template_kwargs": {**o["chat_template_kwargs"], **kw}}
        prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"],
                                         mo["chat_template_kwargs"], o.get("set_digests"))
        ids = [tuple(p["prompt_ids"]) for p in prompts]
        same = [m for m, other in rendered.items() if other == ids]
        if same:
            raise ValueError(f"evaluate.modes: modes {same[0]!r} and {name!r} render every prompt identically: "
                             f"the chat template ignores {kw}")
        rendered[name] = ids
        log.info("mode %s (%s): %d prompts", name, mo["chat_template_kwargs"], len(prompts))
        res, _, _ = offline_results(target, proposer, prompts, mo)
        per_mode[name] = {
            "chat_template_kwargs": mo["chat_template_kwargs"], "prompts": res["prompts"],
            "new_tokens": res["new_tokens"],
            # what the generation prompt ends with in this mode (e.g. Qwen3's pre-filled empty think block)
            "prompt_tail": tok.decode(list(ids[0][-16:])),
            "tau_chain": res["overall"]["tau_chain"],
            "expected": {str(smp["temperature"]): smp["overall"]["tau"] for smp in res["sampling"]},
            "expected_by_rule": {str(smp["temperature"]): {r: v["overall"]["tau"] for r, v in smp["rules"].items()}
                                 for smp in res["sampling"]},
            "seconds": res["seconds"] + sum(smp["seconds"] for smp in res["sampling"])}
        matrix += [{**r, "mode": name} for r in res["matrix"]]
        log.info("mode %s: chain tau %s; expected %s", name, per_mode[name]["tau_chain"], per_mode[name]["expected"])
    res = {"stage": "evaluate_modes", "drafter": str(drafter), "target": ident["name"],
           "target_digest": ident["digest"], "options": o, "sets_requested": sets, "modes": per_mode,
           "matrix": matrix}
    write_json(out, res)
    return res


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--modes", required=True,
                   help="JSON object, mode name -> chat template keyword arguments (evaluate.modes)")
    a = p.parse_args(argv)
    run(evaluate_modes, a, modes=parse_json_arg(a.modes))


if __name__ == "__main__":
    main()
