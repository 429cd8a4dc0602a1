# Hidden-state extraction: the target's aux + final hidden states per token, sharded.
# Each shard is a folder (index.json + chunk files, docs/artifacts.md) declared as a directory()
# output, so the between-workflow cache stores and restores the chunks with their index. Work in
# progress lives in the sibling `shard_<i>.partial/` (not an output, so Snakemake does not delete
# it before a rerun): a killed shard resumes from its last complete chunk.

# The dtype of the target's forward here (extract.target_dtype), decided now, with the reason: auto
# = bf16 on a GPU job, else bf16 where the CPU computes it natively (AMX or avx512_bf16), fp32 on
# AVX2-only CPUs (eaglet.base.capability, issue 15).
from eaglet.base import capability

EXTRACT_ON_GPU = (
    config["extract"]["gpus_per_shard"] > 0 or config["target"]["device"] == "cuda"
)
EXTRACT_TARGET_DTYPE, EXTRACT_TARGET_DTYPE_WHY = capability.resolve_target_dtype(
    config["extract"]["target_dtype"], on_gpu=EXTRACT_ON_GPU
)
logger.info(
    f"extraction target forward: {EXTRACT_TARGET_DTYPE} ({EXTRACT_TARGET_DTYPE_WHY})"
)
EXTRACT_LOAD = TARGET_LOAD | {
    "dtype": EXTRACT_TARGET_DTYPE,
    "dtype_reason": EXTRACT_TARGET_DTYPE_WHY,
}


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
    threads: max(1, workflow.cores // len(EXTRACT_SHARDS))
    resources:
        gpu=config["extract"]["gpus_per_shard"],
    params:
        **key_params("load", EXTRACT_LOAD, ["dtype", "device", "trust_remote_code"]),
        # where the forward runs (a GPU's numbers are not a CPU's; target.device auto follows it)
        on_gpu=EXTRACT_ON_GPU,
        # Shard index and count in params: otherwise every shard hits one cache entry.
        shard=lambda wildcards: int(wildcards.shard),
        num_shards=len(EXTRACT_SHARDS),
        digest=target_digest,
        layer_ids=as_json(LAYER_IDS),
        dtype=config["extract"]["dtype"],
        token_budget=config["extract"]["token_budget"],
        chunk_mb=config["extract"]["chunk_mb"],
        # how the target is loaded: extract.target_dtype (resolved), target.device, target.trust_remote_code
        load=settings(EXTRACT_LOAD),
    shell:
        "python -m eaglet.planner.gpu_slots --gpus {resources.gpu} --"
        " python -m eaglet.features.extract --tokens {input.tokens:q} --identity {input.identity:q}"
        " --out {output.shard:q} --work {output.shard:q}.partial"
        " --shard {params.shard} --num-shards {params.num_shards} --layer-ids {params.layer_ids:q}"
        " --dtype {params.dtype} --token-budget {params.token_budget} --chunk-mb {params.chunk_mb}"
        " --target-load {params.load:q} --log {log:q}"


# Online training (train.hidden_states online) stores no hidden states: no extract job then.
if not ONLINE:
    FINAL_OUTPUTS.extend(
        expand(rules.extract_hidden_states.output.shard, shard=EXTRACT_SHARDS)
    )
