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


# The settings files of the cached stages are written when a run starts, never by a preview
# (common.smk, settings_file).
onstart:
    write_settings_files()


rule all:
    default_target: True
    input:
        FINAL_OUTPUTS,
