"""The settings of the evaluation stages, every default read from the config schema
(eaglet.base.schema: workflow/schemas/config.schema.yaml, section ``evaluate``; ``target`` and
``generate`` for the chat template and where the HF target runs).

A stage names the settings it takes by their schema paths (``HF_STAGES`` here for evaluate_offline,
evaluate_speculative and evaluate_modes; ``SETTINGS`` in evaluate_vllm, regenerated and
eval_summary): a key is its setting's name, its default the schema's. ``schema.settings_at`` lays
what the stage was given over those defaults and refuses a key the stage does not take. The workflow passes
every key (workflow/rules/eval.smk builds each stage's settings from the validated config); a
direct call (tests, benchmarks, ``python -m`` by hand) gets the schema's defaults. What the workflow
resolves that is no setting of the schema (the HF loop's verdict and its reason, vLLM's serving) is
a stage's ``extra``: taken, with the value a direct call gets written where the stage resolves.

Where the HF target runs: ``dtype`` (``target.dtype``), ``device`` (``target.device``: cuda when
the job has a GPU) and ``trust_remote_code`` come from the target section, as in extract.
``hf_loop`` is the verdict of eaglet.planner.plan.hf_loop on ``evaluate.hf_loop`` at parse time
(false: a target served over several GPUs or bigger than one), ``hf_loop_reason`` its sentence.
"""

from __future__ import annotations

from eaglet.base import schema
from eaglet.target.load import LOAD_KEYS

# evaluate_offline, evaluate_speculative and evaluate_modes (eval.smk's EVAL_OPTS), in the order
# their JSON records them (``options``)
HF_STAGES = (
    "evaluate.num_prompts",
    "evaluate.max_new_tokens",
    "evaluate.k_values",
    "evaluate.tie_eps",
    "evaluate.stop_at_eos",
    "evaluate.max_prompt_tokens",
    "target.chat_template",  # the workflow passes the template's text (None: the checkpoint's own)
    "generate.chat_template_kwargs",  # as the target is served
    "evaluate.repeats",
    "evaluate.confidence",
    "evaluate.max_relative_width",
    "target.dtype",
    "target.device",
    "target.trust_remote_code",
    "evaluate.temperatures",
    "evaluate.seed",
)


def hf_options(given: dict | None) -> dict:
    """The HF-loop stages' settings, checked: k_values and temperatures sorted, without repeats."""
    # the HF loop's verdict and its reason come from the workflow; a direct call runs the loop
    # set_digests: the user's .parquet sets by content, as the workflow's parse hashed them (issue 46)
    o = schema.settings_at("evaluate", HF_STAGES, given, extra={"hf_loop": True, "hf_loop_reason": None,
                                                                "set_digests": ()})
    o["k_values"] = sorted({int(k) for k in o["k_values"]})
    if not o["k_values"] or o["k_values"][0] < 1:
        raise ValueError(f"evaluate.k_values must be >= 1, got {o['k_values']}")
    if o["max_new_tokens"] < 2:
        raise ValueError("evaluate.max_new_tokens must be >= 2 (one round needs a draft)")
    if int(o["repeats"]) < 1:
        raise ValueError(f"evaluate.repeats must be >= 1, got {o['repeats']}")
    if not 0 < o["confidence"] < 1:
        raise ValueError(f"evaluate.confidence must be in (0, 1), got {o['confidence']}")
    o["temperatures"] = sorted({float(t) for t in o["temperatures"]})
    if any(t < 0 for t in o["temperatures"]):
        raise ValueError(f"evaluate.temperatures must be >= 0, got {o['temperatures']}")
    return o


def sampled_temperatures(o: dict) -> list[float]:
    """The temperatures that add sampling figures; T = 0 (greedy) is always evaluated."""
    return [t for t in o["temperatures"] if t > 0]


def target_load(o: dict) -> dict:
    """How the HF target is loaded (eaglet.engines.hf_loop.setup): its dtype, device, remote code."""
    return {k: o[k] for k in LOAD_KEYS}
