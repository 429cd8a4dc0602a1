# eaglet: target LLM -> trained EAGLE-3 drafter, one rule per stage.
#   snakemake --cores 2 --configfile config/config.yaml   (see README.md)


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/features.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/learning_curve.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"


# When a run starts, never in a preview: SLURM's client commands checked (with --executor slurm),
# and the settings files of the cached stages written
# (eaglet.workflow.params.SettingsFiles), and what the parse resolved, with the reasons
# (eaglet.workflow.resolve.Resolved.record).
onstart:
    # SLURM's commands, where the run is sent to SLURM (the environments were checked at parse time)
    environments.slurm_commands(
        workflow.executor_plugin.name if workflow.executor_plugin else None
    )
    SETTINGS_FILES.write()
    R.write_record(f"{LOGS}/resolved.json")


# drafter.kind p_eagle: the run ends at the checked export (train, export with its served contract) and
# the evaluation's summary (evaluate_offline, evaluate_vllm, eval_summary); the stages not wired for it are left
# out of the DAG, each named NOT RUN with why in the parse's log (eaglet.workflow.resolve.p_eagle_checks).
# (drafter.kind dflash's final outputs: workflow/rules/report.smk.)
if R.drafter_kind == "p_eagle":
    FINAL_OUTPUTS[:] = [
        rules.train.output.summary,
        rules.export.output.contract,
        rules.eval_summary.output.summary,
    ]


rule all:
    default_target: True
    input:
        FINAL_OUTPUTS,
