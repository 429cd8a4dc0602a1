# Report assets: plots and tables drawn from the stage artifacts, and the provenance manifest
# (versions, git describe, hardware, target digest, config, wall time per stage) that Snakemake's
# own report lacks for `python -m` rules. Included last: provenance waits for every other output.
from eaglet.base.digests import digest_of


rule plots:
    input:
        code=stage_code("report.plots"),
        vocab=rules.vocab_map.output.summary,
        metadata=rules.tokenize.output.metadata,
        metrics=rules.train.output.metrics,
        evaluation=EVAL_SUMMARY,
        contract=rules.export.output.contract,
    output:
        coverage=report(
            f"{RUN}/plots/coverage.png",
            caption="../report/coverage.rst",
            category="1. Data",
            labels={"figure": "draft vocabulary coverage"},
        ),
        training=report(
            f"{RUN}/plots/training.png",
            caption="../report/training.rst",
            category="3. Drafter",
            labels={"figure": "training curves"},
        ),
        tables=report(
            f"{RUN}/plots/tables.html",
            caption="../report/tables.rst",
            category="0. Summary",
            labels={"table": "run tables"},
        ),
    log:
        f"{LOGS}/plots.log",
    conda:
        "../../envs/eaglet.yaml"
    params:
        out=out_dir,
        evaluation=lambda wildcards, input: (
            f"--evaluation {input.evaluation[0]}" if input.evaluation else ""
        ),
    shell:
        "python -m eaglet.report.plots --vocab {input.vocab:q} --metadata {input.metadata:q}"
        " --metrics {input.metrics:q} --contract {input.contract:q} {params.evaluation}"
        " --out-dir {params.out:q} 2> {log:q}"


FINAL_OUTPUTS.extend(rules.plots.output)


# The drafter's model card (eaglet.report.card): drafter/README.md from the run's artifacts, in the
# format the model hubs read; base_model is target.hub_id (else a target.path naming a hub model,
# else the target's name).
CARD = {
    "base_model": config["target"]["hub_id"] or R.target_hub.get("repo_id"),
    "serving": R.serving,
    "shown_dir": f"{RUN}/drafter",
}


rule drafter_card:
    input:
        code=stage_code("report.card"),
        config=rules.export.output.config,
        contract=rules.export.output.contract,
        reference=rules.export.output.reference,
        identity=TARGET_ID,
        evaluation=EVAL_SUMMARY,
        train=f"{RUN}/train/train_summary.json",
        tokenize=rules.tokenize.output.metadata,
        vocab=rules.vocab_map.output.summary,
        prompts=rules.prompts.output.summary,
    output:
        card=f"{RUN}/drafter/README.md",
    log:
        f"{LOGS}/drafter_card.log",
    conda:
        "../../envs/eaglet.yaml"
    params:
        **key_params("card", CARD),
        drafter=lambda wildcards, input: str(Path(input.config).parent),
        evaluation=lambda wildcards, input: (
            f"--evaluation {input.evaluation[0]}" if input.evaluation else ""
        ),
        opts=settings(CARD),
    shell:
        "python -m eaglet.report.card --drafter-dir {params.drafter:q} --identity {input.identity:q}"
        " --train {input.train:q} --tokenize {input.tokenize:q} --vocab {input.vocab:q}"
        " --prompts {input.prompts:q} {params.evaluation} --config {params.opts:q} --log {log:q}"


FINAL_OUTPUTS.append(rules.drafter_card.output.card)


# drafter.kind dflash and p_eagle: the run ends at the evaluation summary (offline: the block or parallel
# chain; the timed HF loop; vLLM), the drafter card, the plots and the provenance; the stages
# not wired for the kind are left out of the DAG, each named NOT RUN with why in the parse's log
# (eaglet.workflow.resolve.dflash_checks, p_eagle_checks). Set here, before provenance names what it
# waits for.
if R.drafter_kind in ("dflash", "p_eagle"):
    FINAL_OUTPUTS[:] = [
        rules.train.output.summary,
        rules.export.output.contract,
        rules.eval_summary.output.summary,
        *rules.plots.output,
        rules.drafter_card.output.card,
    ]


rule provenance:
    input:
        code=stage_code("report.provenance"),
        identity=TARGET_ID,
        outputs=list(FINAL_OUTPUTS),
    output:
        report(
            f"{RUN}/provenance.json",
            caption="../report/provenance.rst",
            category="0. Summary",
            labels={"table": "provenance"},
        ),
    log:
        f"{LOGS}/provenance.log",
    conda:
        "../../envs/eaglet.yaml"
    params:
        run=lambda wildcards, output: str(Path(output[0]).parent),
        # the config's digest is compared (a changed key reruns provenance in one short line); the
        # config as written, and what the parse resolved from it with the reasons (R.record()),
        # reach the job as derived params (eaglet.workflow.params.settings)
        config_digest=digest_of(config),
        config=settings(config),
        resolved=settings(R.record()),
    shell:
        "python -m eaglet.report.provenance --run-dir {params.run:q} --target {input.identity:q}"
        " --config-json {params.config:q} --resolved-json {params.resolved:q} --out {output:q} 2> {log:q}"


FINAL_OUTPUTS.append(rules.provenance.output[0])
