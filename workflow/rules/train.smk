# Training: TTT training of the EAGLE-3 drafter on the extracted hidden states (eagle3.md §3).
# Checkpoints live in train/checkpoints/, which is not an output, so Snakemake does not delete it
# before a rerun: a killed training job resumes from its latest checkpoint.


rule train:
    input:
        code=src(
            "train",
            "model",
            "hidden_store",
            "gpu_slots",
            "target",
            "chain",
            "contract_record",
            "labels",
            "rope",
            "target_check",
            "io",
        ),
        hidden=expand(
            f"{RUN}/extract/shard_{{shard}}", shard=range(config["extract"]["shards"])
        ),
        vocab=f"{RUN}/vocab_map/vocab.safetensors",
        identity=TARGET_ID,
    output:
        drafter=f"{RUN}/train/drafter.safetensors",
        metrics=f"{RUN}/train/metrics.parquet",
        summary=report(
            f"{RUN}/train/train_summary.json",
            caption="../report/train.rst",
            category="3. Drafter",
            labels={"artifact": "training summary"},
        ),
    log:
        f"{LOGS}/train.log",
    conda:
        "../../envs/eaglet.yaml"
    # CPU training uses every core it is given
    threads: workflow.cores
    # gpu: every GPU of the job (train.gpus on each of train.nodes)
    resources:
        **train_resources(),
        gpu=config["train"]["gpus"] * config["train"]["nodes"],
    params:
        **key_params("train", train_params()),
        out=out_dir,
        train=stage_config("train", train_params()),
        launcher=train_launcher,
    shell:
        "python -m eaglet.gpu_slots --gpus {resources.gpu} --"
        " {params.launcher} -m eaglet.train --hidden {input.hidden:q} --vocab {input.vocab:q}"
        " --target-identity {input.identity:q} --out-dir {params.out:q}"
        " --params @{params.train:q} --log {log:q}"


FINAL_OUTPUTS.append(rules.train.output.summary)
