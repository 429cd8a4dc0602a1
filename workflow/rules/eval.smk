# Evaluation (docs/eagle3.md §7): the exact offline acceptance simulator, the real speculative loop on
# the HF target (speed + lossless check), vLLM serving with and without the drafter, and a summary
# with the draft-length recommendation and plots. Measurements, so never cached.
from eaglet.base.datasets import PACKAGED
from eaglet.target.load import packaged_file_identity

EVAL = config["evaluate"]
# drafter.kind dflash: evaluate_offline (the block chain, eaglet.eval.dflash_offline: the stage reads the
# kind from the drafter's file), evaluate_speculative (the timed HF loop with eaglet.engines.dflash_loop,
# at the k_values up to block_size - 1: the stage reads the kind too), evaluate_vllm (method dflash at
# k = block_size - 1) and eval_summary run; the modes and the regenerated sets are not wired for the
# kind (workflow/rules/report.smk, eaglet.workflow.resolve.DFLASH_NOT_RUN): eval_summary reads neither. vLLM does not
# wait for the HF loop (both take every core, so they never run side by side here)
EVAL_DFLASH = R.drafter_kind == "dflash"
# drafter.kind p_eagle: evaluate_offline (the parallel chain, eaglet.eval.p_eagle_offline: the stage reads
# the kind from the drafter's file), evaluate_speculative (the timed HF loop with eaglet.engines.p_eagle_loop,
# at the k_values up to parallel_k: the stage reads the kind too), evaluate_vllm (method eagle3 with
# parallel_drafting at k = parallel_k) and eval_summary; the modes and the regenerated sets are not wired
# for the kind (eaglet.workflow.resolve.P_EAGLE_NOT_RUN). vLLM does not wait for the HF loop, as for DFlash
EVAL_P_EAGLE = R.drafter_kind == "p_eagle"
EVAL_DIR = f"{RUN}/eval"
# "heldout" = this run's held-out prompts; other names and .parquet paths go to eaglet.base.datasets
EVAL_SETS = [
    f"{RUN}/prompts/heldout.parquet" if s == "heldout" else s for s in EVAL["sets"]
]
# A set given as the path to a user's own .parquet: by content, its (path, digest) pairs in the
# settings the stages compare (a new content reruns them whatever its mtime; each job checks the file
# before reading it); this run's held-out set is an input file, the output of rule prompts.
USER_SETS = R.user_files["evaluate.sets"]
RUN_SETS = [s for s in EVAL_SETS if s.endswith(".parquet") and s not in dict(USER_SETS)]
EVAL_OPTS = {
    k: EVAL[k]
    for k in (
        "num_prompts",
        "max_new_tokens",
        "k_values",
        "tie_eps",
        "stop_at_eos",
        "max_prompt_tokens",
        "repeats",
        "confidence",
        "max_relative_width",
        "temperatures",
        "seed",
    )
} | {
    "chat_template": R.chat_template or None,
    "chat_template_kwargs": R.chat_template_kwargs,
    # the HF loop: run or not (eaglet.planner.plan.hf_loop at parse time, logged), on the target's dtype/device
    "hf_loop": R.hf_loop,
    "hf_loop_reason": R.hf_loop_why,
    **R.target_load,
    "set_digests": USER_SETS,
}
# The settings that define the measurements, compared one by one (key_params): all but the HF
# loop's reason, which follows from hf_loop.
EVAL_KEYS = [k for k in EVAL_OPTS if k != "hf_loop_reason"]
# The packaged evaluation sets by content (version + recorded sha256): another package version
# reruns the evaluation; a .parquet set is an input file.
EVAL_DATA = {
    s: packaged_file_identity(*PACKAGED[s])
    for s in EVAL_SETS
    if s in PACKAGED
}
# The in-process target on a GPU machine (CUDA vLLM build) takes its GPUs through
# eaglet.planner.gpu_slots: one, or the several its vLLM engine holds, spread over them
# (eaglet.planner.plan.hf_loop); the timed loop only where it runs.
HF_LOOP_GPUS = R.hf_gpus if R.hf_loop else 0
SPEC_GPUS = R.hf_gpus if R.hf_timed else 0
# The timed loop's own verdict: the same as the untimed stages' unless the target is spread over GPUs
SPEC_OPTS = EVAL_OPTS | {"hf_loop": R.hf_timed, "hf_loop_reason": R.hf_timed_why}


rule evaluate_offline:
    input:
        code=stage_code("eval.evaluate_offline", launcher=True),
        drafter=f"{RUN}/train/drafter.safetensors",
        identity=TARGET_ID,
        sets=RUN_SETS,
    output:
        offline=f"{EVAL_DIR}/offline.json",
        positions=f"{EVAL_DIR}/offline_positions.parquet",
        rounds=f"{EVAL_DIR}/offline_rounds.parquet",
    log:
        f"{LOGS}/evaluate_offline.log",
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        gpu=HF_LOOP_GPUS,
    params:
        **key_params("evaluate", EVAL_OPTS, EVAL_KEYS),
        **key_params("set", EVAL_DATA),
        **library_params("evaluate"),
        sets=as_json(EVAL_SETS),
        opts=settings(EVAL_OPTS),
        out=out_dir,
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.eval.evaluate_offline --drafter {input.drafter:q} --identity {input.identity:q}"
        " --sets {params.sets:q} --config {params.opts:q} --out-dir {params.out:q}"
        " --threads {threads} --log {log:q}"


# Timing: run alone (all cores), after the offline stage so the two never share the CPU.
rule evaluate_speculative:
    input:
        code=stage_code("eval.evaluate_speculative", launcher=True),
        drafter=f"{RUN}/train/drafter.safetensors",
        identity=TARGET_ID,
        sets=RUN_SETS,
        after=rules.evaluate_offline.output.offline,
    output:
        speculative=f"{EVAL_DIR}/speculative.json",
        rounds=f"{EVAL_DIR}/speculative_rounds.parquet",
    log:
        f"{LOGS}/evaluate_speculative.log",
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        gpu=SPEC_GPUS,
    params:
        **key_params("evaluate", SPEC_OPTS, EVAL_KEYS),
        **key_params("set", EVAL_DATA),
        **library_params("evaluate"),
        sets=as_json(EVAL_SETS),
        opts=settings(SPEC_OPTS),
        out=out_dir,
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.eval.evaluate_speculative --drafter {input.drafter:q} --identity {input.identity:q}"
        " --sets {params.sets:q} --config {params.opts:q} --out-dir {params.out:q}"
        " --threads {threads} --log {log:q}"


EVAL_VLLM_OPTS = {
    **{
        k: EVAL[k]
        for k in (
            "num_prompts",
            "max_new_tokens",
            "stop_at_eos",
            "max_prompt_tokens",
            # paired timing as the HF loop's, at every temperature (eaglet.eval.evaluate_vllm)
            "temperatures",
            "repeats",
            "confidence",
            "max_relative_width",
        )
    },
    **{k: v for k, v in EVAL["vllm"].items() if k != "enabled"},
    "chat_template": R.chat_template or None,
    "chat_template_kwargs": R.chat_template_kwargs,
    "serving": R.serving,
    "set_digests": USER_SETS,
}
# DFlash is served at num_speculative_tokens = block_size - 1 only, P-EAGLE at its parallel_k only
# (eaglet.eval.evaluate_vllm.served_kind)
if EVAL_DFLASH:
    EVAL_VLLM_OPTS["k_values"] = [R.drafter["dflash"]["block_size"] - 1]
if EVAL_P_EAGLE:
    EVAL_VLLM_OPTS["k_values"] = [R.drafter["p_eagle"]["parallel_k"]]
# what defines vLLM's measurements: all but how long a run may take
EVAL_VLLM_KEYS = [k for k in EVAL_VLLM_OPTS if k != "timeout_s"]


rule evaluate_vllm:
    input:
        code=stage_code("eval.evaluate_vllm", launcher=True),
        config=rules.export.output.config,
        weights=rules.export.output.weights,
        identity=TARGET_ID,
        sets=RUN_SETS,
        offline=rules.evaluate_offline.output.offline,
        **(
            {}
            if EVAL_DFLASH or EVAL_P_EAGLE
            else {"after": rules.evaluate_speculative.output.speculative}
        ),
    output:
        vllm=f"{EVAL_DIR}/vllm.json",
    log:
        f"{LOGS}/evaluate_vllm.log",
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        # vLLM's tensor-parallel GPUs (target.vllm), taken through eaglet.planner.gpu_slots
        gpu=R.vllm_gpus,
    params:
        **key_params("evaluate_vllm", EVAL_VLLM_OPTS, EVAL_VLLM_KEYS),
        **key_params("set", EVAL_DATA),
        # vLLM's package and version from its venv (eaglet.base.library_versions)
        **library_params("evaluate_vllm", vllm_env=EVAL["vllm"]["env"]),
        sets=as_json(EVAL_SETS),
        opts=settings(EVAL_VLLM_OPTS),
        drafter=lambda wildcards, input: str(Path(input.config).parent),
        out=out_dir,
        # vLLM's own logs and caches: logs, not results
        work=f"{LOGS}/evaluate_vllm",
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.eval.evaluate_vllm --drafter-dir {params.drafter:q} --identity {input.identity:q}"
        " --sets {params.sets:q} --config {params.opts:q} --out-dir {params.out:q}"
        " --work-dir {params.work:q} --offline {input.offline:q} --log {log:q}"


# The drafter along the target's own regenerated answers (rule generate_eval): the exact chain at
# T = 0, the expected chain at T > 0 (eaglet.eval.regenerated). After the timed stages: never beside them.
REGEN_OPTS = {
    k: EVAL_OPTS[k]
    for k in (
        "k_values",
        "seed",
        "confidence",
        "max_relative_width",
        "chat_template",
        "chat_template_kwargs",
        "hf_loop",
        "hf_loop_reason",
        "dtype",
        "device",
        "trust_remote_code",
    )
}


rule evaluate_regenerated:
    input:
        code=stage_code("eval.regenerated", launcher=True),
        drafter=f"{RUN}/train/drafter.safetensors",
        identity=TARGET_ID,
        answers=rules.generate_eval.output.conversations,
        generation=rules.generate_eval.output.summary,
        after=rules.evaluate_speculative.output.speculative,
    output:
        regenerated=f"{EVAL_DIR}/regenerated.json",
    log:
        f"{LOGS}/evaluate_regenerated.log",
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        gpu=HF_LOOP_GPUS,
    params:
        **key_params(
            "evaluate", REGEN_OPTS, [k for k in REGEN_OPTS if k != "hf_loop_reason"]
        ),
        **library_params("evaluate"),
        opts=settings(REGEN_OPTS),
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.eval.regenerated --drafter {input.drafter:q} --identity {input.identity:q}"
        " --answers {input.answers:q} --generation {input.generation:q} --config {params.opts:q}"
        " --out {output.regenerated:q} --threads {threads} --log {log:q}"


# Each chat-template mode (evaluate.modes, e.g. Qwen3's enable_thinking on and off) measured offline
# on the evaluation sets rendered its way (eaglet.eval.evaluate_modes). After the timed stages.
MODES = EVAL["modes"]


rule evaluate_modes:
    input:
        code=stage_code("eval.evaluate_modes", launcher=True),
        drafter=f"{RUN}/train/drafter.safetensors",
        identity=TARGET_ID,
        sets=RUN_SETS,
        after=rules.evaluate_speculative.output.speculative,
    output:
        modes=f"{EVAL_DIR}/modes.json",
    log:
        f"{LOGS}/evaluate_modes.log",
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        gpu=HF_LOOP_GPUS,
    params:
        **key_params("evaluate", EVAL_OPTS, EVAL_KEYS),
        **key_params("evaluate_modes", {"modes": MODES}),
        **key_params("set", EVAL_DATA),
        **library_params("evaluate"),
        sets=as_json(EVAL_SETS),
        modes=as_json(MODES),
        opts=settings(EVAL_OPTS),
        out=out_dir,
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.eval.evaluate_modes --drafter {input.drafter:q} --identity {input.identity:q}"
        " --sets {params.sets:q} --modes {params.modes:q} --config {params.opts:q} --out-dir {params.out:q}"
        " --threads {threads} --log {log:q}"


rule eval_summary:
    input:
        **(
            {"vllm": rules.evaluate_vllm.output.vllm}
            if EVAL["vllm"]["enabled"]
            else {}
        ),
        **(
            {"regenerated": rules.evaluate_regenerated.output.regenerated}
            if EVAL["regenerate"]["enabled"] and not (EVAL_DFLASH or EVAL_P_EAGLE)
            else {}
        ),
        **(
            {"learning_curve": rules.learning_curve.output.curve}
            if config["plan"]["learning_curve"]
            else {}
        ),
        **(
            {"modes": rules.evaluate_modes.output.modes}
            if MODES and not (EVAL_DFLASH or EVAL_P_EAGLE)
            else {}
        ),
        code=stage_code("eval.eval_summary"),
        offline=rules.evaluate_offline.output.offline,
        positions=rules.evaluate_offline.output.positions,
        offline_rounds=rules.evaluate_offline.output.rounds,
        speculative=rules.evaluate_speculative.output.speculative,
        spec_rounds=rules.evaluate_speculative.output.rounds,
    output:
        summary=report(
            f"{EVAL_DIR}/summary.json",
            caption="../report/eval_summary.rst",
            category="4. Evaluation",
            labels={"artifact": "evaluation summary"},
        ),
        recommendation=f"{EVAL_DIR}/recommendation.parquet",
        tau_per_position=report(
            f"{EVAL_DIR}/tau_per_position.png",
            caption="../report/tau_per_position.rst",
            category="4. Evaluation",
            labels={"figure": "acceptance per position"},
        ),
        tau_per_k=report(
            f"{EVAL_DIR}/tau_per_k.png",
            caption="../report/tau_per_k.rst",
            category="4. Evaluation",
            labels={"figure": "tau per k"},
        ),
        speedup_vs_k=report(
            f"{EVAL_DIR}/speedup_vs_k.png",
            caption="../report/speedup_vs_k.rst",
            category="4. Evaluation",
            labels={"figure": "speedup vs k"},
        ),
    log:
        f"{LOGS}/eval_summary.log",
    conda:
        "../../envs/eaglet.yaml"
    params:
        eval_dir=lambda wildcards, input: str(Path(input.offline).parent),
        vllm=lambda wildcards, input: (
            f"--vllm {input.vllm}" if "vllm" in input.keys() else ""
        ),
        learning_curve=lambda wildcards, input: (
            f"--learning-curve {input.learning_curve}"
            if "learning_curve" in input.keys()
            else ""
        ),
        regenerated=lambda wildcards, input: (
            f"--regenerated {input.regenerated}"
            if "regenerated" in input.keys()
            else ""
        ),
        modes=lambda wildcards, input: (
            f"--modes {input.modes}" if "modes" in input.keys() else ""
        ),
        opts=as_json({"tie_eps": EVAL["tie_eps"], "headline_k": EVAL["headline_k"]}),
    shell:
        "python -m eaglet.eval.eval_summary --eval-dir {params.eval_dir:q} {params.vllm} {params.learning_curve}"
        " {params.regenerated} {params.modes}"
        " --config {params.opts:q} --log {log:q}"


FINAL_OUTPUTS.append(rules.eval_summary.output.summary)
EVAL_SUMMARY.append(rules.eval_summary.output.summary)
