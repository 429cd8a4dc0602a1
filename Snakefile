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


rule all:
    default_target: True
    input:
        FINAL_OUTPUTS,
