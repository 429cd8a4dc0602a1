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


# Written when a run starts, never by a preview: the settings files of the cached stages
# (eaglet.workflow.params.SettingsFiles), and what the parse resolved, with the reasons
# (eaglet.workflow.resolve.Resolved.record).
onstart:
    SETTINGS_FILES.write()
    R.write_record(f"{LOGS}/resolved.json")


rule all:
    default_target: True
    input:
        FINAL_OUTPUTS,
