"""Where the hidden states live: the storage choice made from ``storage.budget_gb`` (issue 17).

Offline training stores the target's aux + final states of every token (``extract``) and reads
them back each epoch; online training (``train.hidden_states: online``, eaglet.train.online) stores
nothing and runs the target's forward again in the training job, once per epoch (and over the
held-out split at each validation pass), where extraction runs it once. With ``storage.budget_gb``
set (decimal GB of disk for the run's outputs), the workflow takes the first of

    bf16 offline, fp8 offline, online

whose disk fits the budget, logs the sizes and costs of all three on `snakemake -n` (and as the
training job's first log line), and refuses a run that fits none before any job runs. Without a
budget nothing is chosen: ``train.hidden_states`` and ``extract.dtype`` are used as written, and the
figures are stated all the same when the target's shape is known. A config that already says
``train.hidden_states: online`` stays online (it needs the least disk).

Figures (decimal GB): hidden states = ``bytes_per_token`` (below) x the token bound
``prompts.n x tokenize.max_length`` (what a run can reach; eaglet.planner.plan states the same bound);
the rest of what every mode writes = the tokens file (~5 B per token) + ``train.keep_checkpoints``
checkpoints (fp32 trainable weights + AdamW's two moments) + the drafter. The target checkpoint
itself (resources/) is not counted.
"""

from __future__ import annotations

from eaglet.hidden.dtypes import bytes_per_token

ORDER = (("offline", "bfloat16"), ("offline", "fp8"), ("online", None))
TOKEN_FILE_BYTES = 5  # per token in tokens.parquet: int32 id + int8 mask (before compression)


def figures(config: dict, s: dict) -> dict:
    """Disk bytes of each choice for target shapes ``s`` (eaglet.planner.plan.target_shapes)."""
    from eaglet.planner.shapes import drafter_params

    H, tokens = int(s["hidden_size"]), int(config["prompts"]["n"]) * int(config["tokenize"]["max_length"])
    trainable = drafter_params(s, int(config["vocab"]["draft_vocab_size"]))["trainable"]
    t = config["train"]
    rest = tokens * TOKEN_FILE_BYTES + (int(t["keep_checkpoints"]) * 3 + 1) * 4 * trainable
    hidden = {d: tokens * bytes_per_token(d, H) for d in ("bfloat16", "fp8")}
    return {"tokens": tokens, "hidden": hidden, "rest": rest,
            "disk": {"offline/bfloat16": hidden["bfloat16"] + rest, "offline/fp8": hidden["fp8"] + rest,
                     "online": rest}}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x >= 1e8 else f"{x / 1e6:,.1f} MB"


def statement(config: dict, f: dict) -> str:
    """One line: the hidden-state size in bf16 and fp8 and the cost of each choice."""
    t = config["train"]
    import math

    epochs = math.ceil(float(t["epochs"]))
    return (f"storage: hidden states of <= {f['tokens']:,} tokens: bf16 {_gb(f['hidden']['bfloat16'])}, "
            f"fp8 {_gb(f['hidden']['fp8'])}; costs: offline bf16 = {_gb(f['disk']['offline/bfloat16'])} disk "
            f"+ 1 target forward over the data (extraction); offline fp8 = {_gb(f['disk']['offline/fp8'])} "
            f"disk + 1 forward, states rounded to fp8; online = {_gb(f['disk']['online'])} disk + "
            f"{epochs} target forwards (one per epoch, train.epochs {t['epochs']}) + one over the held-out "
            "split per validation pass, in the training job")


def decide(config: dict, s: dict | None) -> tuple[str, str, list[str]]:
    """(train.hidden_states, extract.dtype, lines to log) for a validated config; raises ValueError
    naming storage.budget_gb when no choice fits it. ``s`` None: the target's shape is not known yet
    (built targets, before target_model has run)."""
    budget = (config.get("storage") or {}).get("budget_gb")
    mode, dtype = config["train"]["hidden_states"], config["extract"]["dtype"]
    if s is None:
        if budget is not None:
            raise ValueError("storage.budget_gb: the target's hidden size is not known yet (a built or GGUF "
                             "target is made by the first job): run `snakemake target_model` first, or set "
                             "target.path, or drop storage.budget_gb")
        return mode, dtype, []
    f = figures(config, s)
    lines = [statement(config, f)]
    if budget is None:
        lines.append(f"storage: no storage.budget_gb: train.hidden_states {mode}"
                     + (f", extract.dtype {dtype}" if mode == "offline" else "") + " as configured")
        return mode, dtype, lines
    cap = float(budget) * 1e9
    order = ORDER if mode == "offline" else (("online", None),)
    for m, d in order:
        need = f["disk"][m if m == "online" else f"{m}/{d}"]
        if need <= cap:
            d = d or dtype  # online rounds its states as offline would store them (extract.dtype)
            why = f"{_gb(need)} fits storage.budget_gb {budget}"
            if m == "online" and mode == "offline":
                why += " (offline fp8 needs " + _gb(f["disk"]["offline/fp8"]) + ")"
            lines.append(f"storage: chose {m} ({'states rounded to ' if m == 'online' else ''}{d}): {why}")
            return m, d, lines
    raise ValueError(f"storage.budget_gb: {budget} GB fits no storage choice: even online training writes "
                     f"{_gb(f['disk']['online'])} (tokens and {config['train']['keep_checkpoints']} checkpoints; "
                     "lower train.keep_checkpoints, prompts.n or tokenize.max_length, or raise the budget)")


def job_note(config: dict, lines: list[str]) -> dict:
    """What the training job logs first (``eaglet.train.train --note``): the parse-time lines, and the keys
    the statement is made of, so that a job whose target was built after the workflow was parsed
    (no shape then, no lines) states it from the target it trains against (``job_lines``)."""
    keep = {"prompts": ["n"], "tokenize": ["max_length"], "vocab": ["draft_vocab_size"],
            "train": ["epochs", "keep_checkpoints", "hidden_states"], "extract": ["dtype"]}
    return {"lines": list(lines), "config": {s: {k: config[s][k] for k in ks} for s, ks in keep.items()}}


def job_lines(note: dict | list | None, model_dir) -> list[str]:
    """The lines of a ``job_note``; computed from the target's config.json when the parse had none."""
    if not note:
        return []
    if isinstance(note, list):
        return note
    if note.get("lines"):
        return list(note["lines"])
    from pathlib import Path

    from eaglet.planner.shapes import target_shapes

    cfg = note["config"]
    f = figures(cfg, target_shapes(cfg, Path(model_dir) / "config.json", target_bytes=0))
    mode = cfg["train"]["hidden_states"]
    return [statement(cfg, f), f"storage: train.hidden_states {mode}"
            + (f", extract.dtype {cfg['extract']['dtype']}" if mode == "offline" else "") + " as configured"]
