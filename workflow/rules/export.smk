# Export: the trained drafter in the directory format vLLM and SGLang load (docs/eagle3.md §6), checked
# by the contract (static, vLLM's loader emulated and SGLang's own run, numeric parity, a real vLLM-CPU load + run) before it
# appears. A failing contract fails the rule; the report lands in drafter/contract.failed.json.

EXPORT_SPECULATORS = config["export"]["speculators"]
# target.vllm + trust_remote_code for the real-vLLM checks, target.dtype/device for the
# in-process offline chain: the same settings as every other stage
EXPORT = config["export"] | {"serving": R.serving, "target_load": R.target_load}
# The contract's real-vLLM checks on a GPU machine (CUDA build) hold the GPUs the target's engine
# needs (target.vllm.tensor_parallel_size) through eaglet.planner.gpu_slots; its in-process offline
# chain (vllm.acceptance) runs after the engine, spread over the same GPUs (eaglet.target.load).
EXPORT_GPUS = R.vllm_gpus if config["export"]["vllm_check"] else 0
# drafter.kind dflash: the DFlash directory and its own contract (eaglet.export.dflash_export); for
# eagle3 the shell line (its second branch) is that of before the key existed
EXPORT_DFLASH = R.drafter_kind == "dflash"
# drafter.kind p_eagle: format A + mask_hidden and its own contract (eaglet.export.p_eagle_export)
EXPORT_P_EAGLE = R.drafter_kind == "p_eagle"


rule export:
    input:
        code=stage_code(
            (
                "export.dflash_export"
                if EXPORT_DFLASH
                else ("export.p_eagle_export" if EXPORT_P_EAGLE else "export.export")
            ),
            launcher=True,
        ),
        drafter=f"{RUN}/train/drafter.safetensors",
        summary=f"{RUN}/train/train_summary.json",
        identity=TARGET_ID,
    output:
        **(
            {"speculators": directory(f"{RUN}/drafter_speculators")}
            if EXPORT_SPECULATORS
            else {}
        ),
        config=f"{RUN}/drafter/config.json",
        weights=f"{RUN}/drafter/model.safetensors",
        # what the directory needs to prove itself alone (eaglet.export.contract.reference)
        reference=f"{RUN}/drafter/reference.json",
        contract=report(
            f"{RUN}/drafter/contract.json",
            caption="../report/export.rst",
            category="3. Drafter",
            labels={"artifact": "export contract"},
        ),
    log:
        f"{LOGS}/export.log",
    conda:
        "../../envs/eaglet.yaml"
    # the vLLM check serves the target twice on every core
    threads: workflow.cores
    resources:
        gpu=EXPORT_GPUS,
    params:
        **key_params("export", EXPORT),
        out=lambda wildcards, output: str(Path(output.config).parent),
        speculators_out=f"{RUN}/drafter_speculators",
        export=settings(EXPORT),
        # vLLM's own logs and cache: logs, not results
        work=f"{LOGS}/export_check",
    shell:
        (
            "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
            " python -m eaglet.export.dflash_export --drafter {input.drafter:q} --identity {input.identity:q}"
            " --train-summary {input.summary:q} --out {params.out:q}"
            " --speculators-out {params.speculators_out:q} --work-dir {params.work:q}"
            " --config {params.export:q} --log {log:q}"
            if EXPORT_DFLASH
            else (
                "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
                " python -m eaglet.export.p_eagle_export --drafter {input.drafter:q} --identity {input.identity:q}"
                " --train-summary {input.summary:q} --out {params.out:q}"
                " --speculators-out {params.speculators_out:q} --work-dir {params.work:q}"
                " --config {params.export:q} --log {log:q}"
                if EXPORT_P_EAGLE
                else "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
                " python -m eaglet.export.export --drafter {input.drafter:q} --identity {input.identity:q}"
                " --train-summary {input.summary:q} --out {params.out:q}"
                " --speculators-out {params.speculators_out:q} --work-dir {params.work:q}"
                " --config {params.export:q} --log {log:q}"
            )
        )


FINAL_OUTPUTS.append(rules.export.output.contract)
# Requested too, so that turning export.speculators on reruns the export: Snakemake checks only the
# outputs something asks for, and a new output of a finished job went unnoticed.
if EXPORT_SPECULATORS:
    FINAL_OUTPUTS.append(rules.export.output.speculators)
