# Synthetic generation: the target regenerates the assistant turns of the training prompts.
# Included after data.smk's prompts rule; tokenize reads its output when generate.enabled.

# The server's dtype, tensor/expert parallelism and trust_remote_code are target.vllm's (SERVING),
# the local backend's dtype and device the target's (TARGET_LOAD): one source for every stage.
# The token limit a sample meets downstream: tokenize's cut, and the server's context for the vllm
# backend. generate drops prompts that leave no room for an answer under it before generating
# (eaglet.generate.generate.over_limit); a param, so a changed tokenize.max_length reruns generate.
GENERATE_MAX_LENGTH = min(
    [config["tokenize"]["max_length"]]
    + (
        [config["generate"]["vllm"]["max_model_len"]]
        if config["generate"]["backend"] == "vllm"
        else []
    )
)
if config["data"]["mix"] < 1 and not config["generate"]["enabled"]:
    raise ValueError(
        f"data.mix: {config['data']['mix']} asks for a share of regenerated responses, but "
        "generate.enabled is false (nothing is regenerated); set data.mix: 1 or enable generate"
    )
GENERATE = config["generate"] | {
    "vllm": config["generate"]["vllm"] | SERVING,
    "target_load": TARGET_LOAD,
    "max_length": GENERATE_MAX_LENGTH,
    "mix": config["data"]["mix"],
}
GENERATE_GPUS = VLLM_GPUS if config["generate"]["backend"] == "vllm" else 0
# What defines the data is in params, so in the cache key; the stage reads all its settings from
# its config file, so the backend's (servers, concurrency, timeouts, memory), which change how the
# data is made and not what it is, stay out of the key and the rerun triggers. The engine that
# answers is in (engines differ in their greedy answers): its kind, and for vllm its package, dtype
# and extra arguments, for openai the model it is asked for (base_urls are where that model is
# served, not what it is), for local how the target is loaded and batched.
GENERATE_ENGINE_KEYS = {
    "vllm": ("vllm.package", "vllm.dtype", "vllm.extra_args", "vllm.reasoning_parser"),
    "openai": ("model",),
    "local": (
        "target_load.dtype",
        "target_load.device",
        "target_load.trust_remote_code",
        "concurrency",  # the batch size: padding changes the answers
    ),
}[config["generate"]["backend"]]
GENERATE_DATA_KEYS = (
    "backend",
    *GENERATE_ENGINE_KEYS,
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "turns",
    "chat_template_kwargs",
    "reject_markers",
    "max_length",
    "min_answer_tokens",
    "mix",
)


rule generate:
    input:
        code=stage_code("generate.generate", launcher=True),
        conversations=f"{RUN}/prompts/train.parquet",
        identity=TARGET_ID,
    output:
        conversations=f"{RUN}/generate/conversations.parquet",
        errors=f"{RUN}/generate/errors.parquet",
        summary=report(
            f"{RUN}/generate/generate_summary.json",
            caption="../report/generate.rst",
            category="1. Data",
            labels={"artifact": "generation summary"},
        ),
    log:
        main=f"{LOGS}/generate.log",
        server=f"{LOGS}/generate_vllm_server.log",
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        # The vLLM server's tensor-parallel GPUs: counted by the scheduler, taken through
        # eaglet.planner.gpu_slots like every GPU rule's (the server inherits CUDA_VISIBLE_DEVICES), so
        # it never lands on GPUs an extraction shard holds (issue 14). 0 runs the stage as is.
        gpu=GENERATE_GPUS,
    params:
        **key_params("generate", GENERATE, GENERATE_DATA_KEYS),
        digest=target_digest,
        config=settings_file(f"{LOGS}/config/generate.json", GENERATE),
        chat_template=verbatim(CHAT_TEMPLATE),
        out=out_dir,
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.generate.generate --conversations {input.conversations:q}"
        " --target {input.identity:q} --out-dir {params.out:q} --config @{params.config:q}"
        " --server-log {log.server:q} --chat-template={params.chat_template:q} --log {log.main:q}"


# The evaluation's own regeneration (evaluate.regenerate): the target answers the evaluation and
# validation sets (MT-Bench's questions, the held-out prompts) through the same backend and server
# settings as generate, once per evaluation temperature, so that the drafter is scored along the
# target's own text at each (eaglet.eval.regenerated). Runs in every default run: data.mix 0.0
# regenerates no training answer, this always starts the server.
REGEN = config["evaluate"]["regenerate"]
REGEN_SETS = [
    f"{RUN}/prompts/heldout.parquet" if s == "heldout" else s for s in REGEN["sets"]
]
# generate's settings but every row regenerated, each at its own temperature (the row's), up to
# the evaluation's length
GENERATE_EVAL = GENERATE | {
    "mix": 1.0,
    "turns": "last",
    "max_tokens": REGEN["max_tokens"],
    "temperature": 0.0,
}


rule eval_prompts:
    input:
        code=stage_code("generate.eval_prompts"),
        sets=[s for s in REGEN_SETS if s.endswith(".parquet")],
    output:
        prompts=f"{RUN}/generate_eval/prompts.parquet",
    log:
        f"{LOGS}/eval_prompts.log",
    conda:
        "../../envs/eaglet.yaml"
    params:
        # the packaged sets by content (version + recorded sha256); a .parquet set is an input file
        **key_params(
            "set",
            {
                s: packaged_file_identity(*PACKAGED_SETS[s])
                for s in REGEN_SETS
                if s in PACKAGED_SETS
            },
        ),
        sets=as_json(REGEN_SETS),
        num_prompts=as_json(REGEN["num_prompts"]),
        temperatures=as_json(config["evaluate"]["temperatures"]),
    shell:
        "python -m eaglet.generate.eval_prompts --sets {params.sets:q} --num-prompts {params.num_prompts:q}"
        " --temperatures {params.temperatures:q} --out {output.prompts:q} --log {log:q}"


rule generate_eval:
    input:
        code=stage_code("generate.generate", launcher=True),
        conversations=rules.eval_prompts.output.prompts,
        identity=TARGET_ID,
    output:
        conversations=f"{RUN}/generate_eval/conversations.parquet",
        errors=f"{RUN}/generate_eval/errors.parquet",
        summary=report(
            f"{RUN}/generate_eval/generate_summary.json",
            caption="../report/generate.rst",
            category="4. Evaluation",
            labels={"artifact": "regenerated evaluation sets"},
        ),
    log:
        main=f"{LOGS}/generate_eval.log",
        server=f"{LOGS}/generate_eval_vllm_server.log",
    conda:
        "../../envs/eaglet.yaml"
    threads: workflow.cores
    resources:
        gpu=GENERATE_GPUS,
    params:
        **key_params("generate_eval", GENERATE_EVAL, GENERATE_DATA_KEYS),
        digest=target_digest,
        config=settings_file(f"{LOGS}/config/generate_eval.json", GENERATE_EVAL),
        chat_template=verbatim(CHAT_TEMPLATE),
        out=out_dir,
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.generate.generate --conversations {input.conversations:q}"
        " --target {input.identity:q} --out-dir {params.out:q} --config @{params.config:q}"
        " --server-log {log.server:q} --chat-template={params.chat_template:q} --log {log.main:q}"
