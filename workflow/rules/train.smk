# Training: TTT training of the EAGLE-3 drafter on the target's hidden states (docs/eagle3.md §3):
# read from extract's shards (train.hidden_states offline), or computed by the target inside this
# job (online, eaglet.train.online: no extract job in the DAG; see eaglet.planner.storage for the choice).
# Checkpoints live in train/checkpoints/, which is not an output, so Snakemake does not delete it
# before a rerun: a killed training job resumes from its latest checkpoint.

# The training job's params, shared with the learning curve's train_fraction (learning_curve.smk).
TRAIN_PARAMS = dict(
    **key_params(
        "train",
        train_params(),
        [k for k in train_params() if k not in TRAIN_NOT_DEFINING],
    ),
    **(
        key_params("online", ONLINE_SETTINGS, ["layer_ids", "dtype", "target_load"])
        if ONLINE
        else {}
    ),
    out=out_dir,
    train=settings(train_params()),
    data=train_data_args,
    # the storage statement, the job's first log line (a file: a log line is no cache key)
    note=settings(storage.job_note(config, STORAGE_LINES)),
    launcher=train_launcher,
)


rule train:
    input:
        code=stage_code("train.train", launcher=True),
        hidden=train_hidden_input,
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
        **TRAIN_PARAMS,
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " {params.launcher} -m eaglet.train.train {params.data} --vocab {input.vocab:q}"
        " --target-identity {input.identity:q} --out-dir {params.out:q}"
        " --params {params.train:q} --note {params.note:q} --log {log:q}"


FINAL_OUTPUTS.append(rules.train.output.summary)
