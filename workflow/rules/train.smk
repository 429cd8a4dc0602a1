# Training: TTT training of the EAGLE-3 drafter on the target's hidden states (docs/eagle3.md §3):
# read from extract's shards (train.hidden_states offline), or computed by the target inside this
# job (online, eaglet.train.online: no extract job in the DAG; see eaglet.planner.storage for the choice).
# Checkpoints live in train/checkpoints/, which is not an output, so Snakemake does not delete it
# before a rerun: a killed training job resumes from its latest checkpoint.
from eaglet.workflow import train_job

# drafter.kind dflash trains a DFlash drafter on the same store (eaglet.train.dflash_train): its module
# (the shell line's first branch) and drafter.* in the params; for eagle3 the shell line and params are
# those of before the key existed.
DFLASH = R.drafter_kind == "dflash"
# drafter.kind p_eagle: the P-EAGLE trainer (eaglet.train.p_eagle_train) on the same store and vocab map,
# drafter.p_eagle.* in the params (the shell line's second branch)
P_EAGLE = R.drafter_kind == "p_eagle"

# The training job's params, shared with the learning curve's train_fraction (learning_curve.smk):
# train.* as resolved (R.train: train.hidden_states and train.autocast decided at parse time), the
# keys that define the drafter one by one (R.train_keys), train.init_from by the drafter's content
# digest (R.train_init_from: none without it), and online the target's settings.
TRAIN_PARAMS = dict(
    **key_params("train", R.train, R.train_keys),
    **key_params("train", R.train_init_from),
    **(
        key_params("online", R.online, ["layer_ids", "dtype", "target_load"])
        if R.storage.online
        else {}
    ),
    # the versions of torch and transformers (eaglet.base.library_versions): the training's numerics
    **library_params("train"),
    out=out_dir,
    train=settings(R.train),
    data=train_job.data_args(R),
    # the storage statement, the job's first log line (a file: a log line is no cache key)
    note=settings(R.train_note),
    launcher=train_job.launcher(config["train"]),
    **(
        {**key_params("drafter", R.drafter), "drafter": settings(R.drafter["dflash"])}
        if DFLASH
        else {}
    ),
    **(
        {**key_params("drafter", R.drafter), "drafter": settings(R.drafter["p_eagle"])}
        if P_EAGLE
        else {}
    ),
)


rule train:
    input:
        code=stage_code(
            (
                "train.dflash_train"
                if DFLASH
                else ("train.p_eagle_train" if P_EAGLE else "train.train")
            ),
            launcher=True,
        ),
        hidden=train_job.hidden_input(R),
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
        **train_job.resources(config["train"]),
        gpu=config["train"]["gpus"] * config["train"]["nodes"],
    params:
        **TRAIN_PARAMS,
    shell:
        (
            "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
            " {params.launcher} -m eaglet.train.dflash_train {params.data} --vocab {input.vocab:q}"
            " --target-identity {input.identity:q} --out-dir {params.out:q}"
            " --params {params.train:q} --note {params.note:q} --log {log:q}"
            " --drafter {params.drafter:q}"
            if DFLASH
            else (
                "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
                " {params.launcher} -m eaglet.train.p_eagle_train {params.data} --vocab {input.vocab:q}"
                " --target-identity {input.identity:q} --out-dir {params.out:q}"
                " --params {params.train:q} --note {params.note:q} --log {log:q}"
                " --drafter {params.drafter:q}"
                if P_EAGLE
                else "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
                " {params.launcher} -m eaglet.train.train {params.data} --vocab {input.vocab:q}"
                " --target-identity {input.identity:q} --out-dir {params.out:q}"
                " --params {params.train:q} --note {params.note:q} --log {log:q}"
            )
        )


FINAL_OUTPUTS.append(rules.train.output.summary)
