# Target materialisation and the data stages: prompts -> tokenize -> token_freq -> vocab_map.
from eaglet.base.datasets import SHAREGPT
from eaglet.target.load import packaged_file_identity


rule target_model:
    input:
        code=stage_code("data.target_model"),
    output:
        model=directory(f"{TARGET_DIR}/model"),
        identity=TARGET_ID,
    log:
        f"logs/target_model/{config['target']['name']}.log",
    # Cached: the job hashes the weights once (a 547 GB target takes the better part of an hour),
    # keyed on the folder's content identity. Safe to cache because its outputs hold no link to a
    # file the pipeline does not own: a local target.path is read in place (eaglet.data.target_model.materialise).
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    params:
        # what defines the checkpoint (R.target_source: its source by content, and how it is built),
        # one entry per key; the job's settings (with the chat template it checks) come from a
        # file, so target.device or target.vllm.* rerun nothing here
        **key_params("target", R.target_source),
        # with the local folder's content digest, which the job checks the folder against
        config=settings_file(
            f"logs/target_model/{config['target']['name']}.config.json",
            dict(R.target_settings) | {"content_digest": R.user_files["target.path"]},
        ),
        out=out_dir,
    shell:
        "python -m eaglet.data.target_model --config @{params.config:q} --out {params.out:q} --log {log:q}"


# What prompts reads, by content: the packaged ShareGPT file (version + recorded sha256, as the
# target), a local prompts.path (a file, or a folder of files) by its sha256, or a datasets data set
# (saved with save_to_disk, or a name in the datasets cache) by the fingerprint datasets gives it
# (eaglet.base.prompt_sources), so a new content reruns the stage whatever its mtime or name, and the
# job checks the source against it before reading.
PROMPTS_SHAREGPT = config["prompts"]["source"] == "sharegpt"
PROMPTS_DATA = (
    packaged_file_identity(*SHAREGPT)
    if PROMPTS_SHAREGPT
    else R.user_files["prompts.path"]
)


rule prompts:
    input:
        code=stage_code("data.prompts"),
    output:
        train=f"{RUN}/prompts/train.parquet",
        heldout=f"{RUN}/prompts/heldout.parquet",
        summary=report(
            f"{RUN}/prompts/summary.json",
            caption="../report/prompts.rst",
            category="1. Data",
            labels={"artifact": "prompts summary"},
        ),
    log:
        f"{LOGS}/prompts.log",
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    params:
        out=out_dir,
        source=config["prompts"]["source"],
        data=verbatim(PROMPTS_DATA),
        # where to read it, and data again for the job to check it with: derived from the output, so
        # not compared (data is), and a renamed or moved copy of the same content reruns nothing
        path=lambda wildcards, output: config["prompts"]["path"] or "",
        path_digest=lambda wildcards, output: "" if PROMPTS_SHAREGPT else PROMPTS_DATA,
        split=verbatim(config["prompts"]["split"]),
        n=config["prompts"]["n"],
        heldout=config["prompts"]["heldout"],
        seed=config["prompts"]["seed"],
        max_turns=config["prompts"]["max_turns"] or 0,
    shell:
        "python -m eaglet.data.prompts --source {params.source} --path={params.path:q}"
        " --path-digest={params.path_digest:q}"
        " --split {params.split:q} --n {params.n} --heldout {params.heldout} --seed {params.seed}"
        " --max-turns {params.max_turns} --out-dir {params.out:q} --log {log:q}"


rule tokenize:
    input:
        code=stage_code("data.tokenization"),
        conversations=R.tokenize_conversations,
        identity=TARGET_ID,
    output:
        tokens=f"{RUN}/tokenize/tokens.parquet",
        metadata=report(
            f"{RUN}/tokenize/metadata.json",
            caption="../report/tokenize.rst",
            category="1. Data",
            labels={"artifact": "tokenize metadata"},
        ),
    log:
        f"{LOGS}/tokenize.log",
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    params:
        # the versions of tokenizers, transformers and jinja2 (eaglet.base.library_versions): another
        # venv's renders and tokenises its own way, so it misses the cache
        **library_params("tokenize"),
        digest=target_digest,
        out=out_dir,
        max_length=config["tokenize"]["max_length"],
        overlong=config["tokenize"]["overlong"],
        batch_size=config["tokenize"]["batch_size"],
        chat_template=verbatim(R.chat_template),
        chat_template_kwargs=as_json(R.chat_template_kwargs),
        think_markers=as_json(config["tokenize"]["think_markers"]),
    shell:
        "python -m eaglet.data.tokenization --conversations {input.conversations:q} --target {input.identity:q}"
        " --max-length {params.max_length} --overlong {params.overlong} --chat-template={params.chat_template:q}"
        " --chat-template-kwargs={params.chat_template_kwargs:q} --think-markers={params.think_markers:q}"
        " --batch-size {params.batch_size} --out-dir {params.out:q} --log {log:q}"


rule token_freq:
    input:
        code=stage_code("data.freq"),
        tokens=rules.tokenize.output.tokens,
        identity=TARGET_ID,
    output:
        counts=f"{RUN}/token_freq/freq.safetensors",
        # the counts' sha256 and totals: vocab_map checks the counts against it
        summary=f"{RUN}/token_freq/summary.json",
        top=report(
            f"{RUN}/token_freq/top.tsv",
            caption="../report/token_freq.rst",
            category="1. Data",
            labels={"artifact": "top tokens"},
        ),
    log:
        f"{LOGS}/token_freq.log",
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    params:
        **library_params("token_freq"),
        digest=target_digest,
        out=out_dir,
    shell:
        "python -m eaglet.data.freq --tokens {input.tokens:q} --target {input.identity:q}"
        " --out-dir {params.out:q} --log {log:q}"


rule vocab_map:
    input:
        code=stage_code("data.vocab"),
        counts=rules.token_freq.output.counts,
        identity=TARGET_ID,
    output:
        vocab=f"{RUN}/vocab_map/vocab.safetensors",
        summary=report(
            f"{RUN}/vocab_map/vocab.json",
            caption="../report/vocab_map.rst",
            category="1. Data",
            labels={"artifact": "draft vocabulary"},
        ),
    log:
        f"{LOGS}/vocab_map.log",
    cache: True
    conda:
        "../../envs/eaglet.yaml"
    params:
        **library_params("vocab_map"),
        digest=target_digest,
        out=out_dir,
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        pin_special=config["vocab"]["pin_special_tokens"],
        pinned=as_json(config["vocab"]["pinned"]),
        curve_points=config["vocab"]["curve_points"],
        chat_template=verbatim(R.chat_template),
        # the reasoning frame is pinned as tokenize renders it
        chat_template_kwargs=as_json(R.chat_template_kwargs),
        think_markers=as_json(config["tokenize"]["think_markers"]),
    shell:
        "python -m eaglet.data.vocab --counts {input.counts:q} --target {input.identity:q}"
        " --draft-vocab-size {params.draft_vocab_size} --pin-special {params.pin_special}"
        " --pinned {params.pinned:q} --curve-points {params.curve_points} --chat-template={params.chat_template:q}"
        " --chat-template-kwargs={params.chat_template_kwargs:q} --think-markers={params.think_markers:q}"
        " --out-dir {params.out:q} --log {log:q}"


FINAL_OUTPUTS.append(rules.vocab_map.output.summary)
