# Hidden-state extraction: the target's aux + final hidden states per token, sharded.
# Each shard is a folder (index.json + chunk files, docs/artifacts.md) declared as a directory()
# output, so the between-workflow cache stores and restores the chunks with their index. Work in
# progress lives in the sibling `shard_<i>.partial/` (not an output, so Snakemake does not delete
# it before a rerun): a killed shard resumes from its last complete chunk.

# The dtype of the target's forward here (extract.target_dtype) is decided at parse time, with the
# reason (R.extract_load, eaglet.workflow.resolve); so are the layer ids and the storage dtype. The key
# holds the dtype, the device and the remote-code switch, not the reason.


rule extract_hidden_states:
    input:
        code=stage_code("features.extract", launcher=True),
        tokens=rules.tokenize.output.tokens,
        identity=TARGET_ID,
    output:
        shard=directory(f"{RUN}/extract/shard_{{shard}}"),
    log:
        f"{LOGS}/extract_hidden_states/shard_{{shard}}.log",
    wildcard_constraints:
        shard=r"\d+",
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    # The cores split over the shards that run side by side (Snakemake sets OMP/MKL threads from
    # this; without it a CPU shard runs its forward pass on one core).
    threads: max(1, workflow.cores // len(R.extract_shards))
    resources:
        gpu=config["extract"]["gpus_per_shard"],
    params:
        **key_params("load", R.extract_load, ["dtype", "device", "trust_remote_code"]),
        # the versions of torch and transformers (eaglet.base.library_versions): the forward's numerics
        **library_params("extract_hidden_states"),
        # where the forward runs (a GPU's numbers are not a CPU's; target.device auto follows it)
        on_gpu=R.extract_on_gpu,
        # Shard index and count in params: otherwise every shard hits one cache entry.
        shard=lambda wildcards: int(wildcards.shard),
        num_shards=len(R.extract_shards),
        digest=target_digest,
        layer_ids=as_json(R.layer_ids),
        # extract.dtype as resolved (storage.budget_gb may choose fp8)
        dtype=R.storage.dtype,
        token_budget=config["extract"]["token_budget"],
        chunk_mb=config["extract"]["chunk_mb"],
        # how the target is loaded (extract.target_dtype resolved, target.device, target.trust_remote_code)
        # with the dtype's reason, which the job logs and records: a settings file, so the reason
        # is in no key (two CPUs picking the same dtype for different reasons share the cache)
        load=settings_file(f"{LOGS}/config/extract_load.json", R.extract_load),
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.features.extract --tokens {input.tokens:q} --identity {input.identity:q}"
        " --out {output.shard:q} --work {output.shard:q}.partial"
        " --shard {params.shard} --num-shards {params.num_shards} --layer-ids {params.layer_ids:q}"
        " --dtype {params.dtype} --token-budget {params.token_budget} --chunk-mb {params.chunk_mb}"
        " --target-load @{params.load:q} --log {log:q}"


# Online training (train.hidden_states online) stores no hidden states: no extract job then.
if not R.storage.online:
    FINAL_OUTPUTS.extend(
        expand(rules.extract_hidden_states.output.shard, shard=R.extract_shards)
    )
