"""The config resolved once, at parse time (workflow/rules/common.smk: ``R = resolve(config)``):
what the schema cannot say and the rule files read, decided here in one place, each decision with
its reason, into a frozen ``Resolved`` the rule files read as ``R.<field>``.

The config the user wrote (validated, defaults filled) is never rewritten: a value decided here
(the storage choice, ``auto`` dtypes, the layer ids) lives in ``Resolved``, and the stages receive
it from there. ``Resolved.lines()`` are what ``snakemake -n`` logs; ``Resolved.record()`` is what
was resolved, with the reasons, as JSON (written to ``logs/<run>/resolved.json`` when a run starts,
and into the run's provenance record).

Nothing is validated twice: each decision is the existing function's (eaglet.workflow.checks,
eaglet.planner.storage, eaglet.planner.plan, eaglet.target.shape, eaglet.base.capability, ...).

    R = resolve(config)          # a validated config, in the workflow's folder
    R.storage.mode, R.layer_ids  # "offline", (2, 4, 5)
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from eaglet.base.artifacts import ArtifactError
from eaglet.base.capability import resolve_autocast, resolve_target_dtype
from eaglet.base.content_digests import CACHE_FILE, DigestCache
from eaglet.base.settings_files import write_settings
from eaglet.drafter import published
from eaglet.planner import plan, storage
from eaglet.target import hub
from eaglet.target.chat_template import chat_template_text
from eaglet.target.families import check_tiny
from eaglet.target.load import LOAD_KEYS, serving
from eaglet.target.shape import layer_ids
from eaglet.workflow import checks, environments
from eaglet.workflow.inputs import local_target, prompts_key, target_source, user_digest, user_sets
from eaglet.workflow.paths import Paths


def freeze(value: Any) -> Any:
    """``value`` read-only all the way down: dicts as MappingProxyType, lists as tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain copy of a frozen value (dicts and lists, as the config holds them): what JSON, the
    params and the stages' settings are made of."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class Storage:
    """Where the hidden states live (eaglet.planner.storage, issue 17): stored by extract (offline)
    or computed in the training job (online). ``storage.budget_gb`` picks bf16 offline, fp8 offline
    or online, in that order, to fit; without a budget, train.hidden_states and extract.dtype as
    configured. The DAG (no extract job online), the params and the memory plan all follow it."""

    mode: str  # train.hidden_states, resolved: offline | online
    dtype: str  # extract.dtype, resolved (online: how the states are rounded, as offline would store them)
    lines: tuple[str, ...]  # the sizes and costs of each choice, and the choice with its reason (logged)
    why: str  # the choice's reason: the last line, or why nothing was chosen before the target's shape is known

    @property
    def online(self) -> bool:
        return self.mode == "online"


@dataclass(frozen=True)
class Resolved:
    """Everything decided at parse time that the rule files read; see the module docstring."""

    paths: Paths
    # the parse-time check of the config against its target and the installed vLLM (eaglet.workflow.checks)
    check_lines: tuple[str, ...]
    storage: Storage
    # the memory plan (eaglet.planner.plan): hidden-state disk and the peak GPU memory of each job, in
    # one line; a job that cannot fit resources.gpu_memory_gb stops the run here, not hours into it
    plan_lines: tuple[str, ...]
    # How the target is run, one place for every stage (issue 14): in-process loads (extract, the HF
    # evaluation loop, the contract's offline chain, generate's local backend) read target_load; every
    # vLLM engine (generate's server, the contract's check, evaluate_vllm) reads serving.
    target_load: Mapping
    serving: Mapping
    # GPUs of a job that serves the target with vLLM: its tensor parallelism with the CUDA build.
    vllm_gpus: int
    # The in-process target in evaluation (eaglet.planner.plan.hf_loop): the untimed stages (exact
    # chain, regenerated scoring, modes) and the timed loop, each with why; `-n` says both.
    hf_loop: bool
    hf_loop_why: str
    hf_timed: bool
    hf_timed_why: str
    # GPUs each in-process evaluation job holds (the target spread over them when more than one)
    hf_gpus: int
    # The template's text (not its path) is a param of every stage that renders conversations, so it
    # is in their cache keys; "" = the checkpoint's own.
    chat_template: str
    # The template's keyword arguments as the target is served (generate.chat_template_kwargs, e.g.
    # Qwen3's enable_thinking): generate sends them to the server, tokenize and evaluate render with
    # them, so training sequences and evaluation prompts are the served ones (vocab_map pins the
    # reasoning frame so rendered).
    chat_template_kwargs: Mapping
    # Aux layer ids in vLLM convention, resolved now from the target's config (extract.layer_ids, or
    # vLLM's default for the target's layer count): a plain param, so a change reruns extraction and
    # everything after it, and an id >= N stops `snakemake -n` (a param computed from an input file is
    # never compared by Snakemake's rerun trigger).
    layer_ids: tuple[int, ...]
    layer_ids_why: str
    extract_shards: tuple[int, ...]
    # The dtype of the target's forward in extraction (extract.target_dtype), with the reason: auto =
    # bf16 on a GPU job, else bf16 where the CPU computes it natively (AMX or avx512_bf16), fp32 on
    # AVX2-only CPUs (eaglet.base.capability, issue 15). Where the forward runs is a param too (a GPU's
    # numbers are not a CPU's; target.device auto follows it).
    extract_on_gpu: bool
    extract_target_dtype: str
    extract_target_dtype_why: str
    # how extraction loads the target: target_load with its dtype resolved
    extract_load: Mapping
    # train.autocast decided now, with the reason (eaglet.base.capability.resolve_autocast): auto = bf16
    # autocast on a GPU job and on a CPU with bf16 units, fp32 elsewhere. The resolved value is the
    # trainer's param, so a drafter trained on one kind of CPU is no cache hit for the other.
    train_autocast: str
    train_autocast_why: str
    # train.ttt_attention decided now by the memory plan (eaglet.planner.plan.choose_ttt_attention), with
    # the reason: the trainer's setting (R.train), no cache key (the same values and gradients either way).
    train_ttt_attention_why: str
    # train.* for eaglet.train.train, less how its ranks are launched: nodes and rdzv_port reach the
    # cache key through the launcher param instead, so a one-node config keeps its old key; with
    # train.hidden_states and train.autocast resolved.
    train: Mapping
    # the train.* keys that define the drafter (its params): all but eaglet.planner.plan.TRAIN_NOT_DEFINING,
    # which the trainer still reads from its settings, and init_from (by content: train_init_from)
    train_keys: tuple[str, ...]
    # train.init_from by content: {"init_from": the directory's digest} (eaglet.drafter.published.digest),
    # {} without it; the train rule's params, so a changed drafter reruns train and a moved one does not
    train_init_from: Mapping
    # the storage statement, the training job's first log line (eaglet.planner.storage.job_note)
    train_note: Mapping
    # Online: the tokens, the aux layer ids and storage rounding (extract's keys) and how the target is
    # loaded (the target section), handed to the trainer as one settings file.
    online: Mapping
    # What defines the built target (eaglet.workflow.inputs.target_source): the source it comes from,
    # by content, and how it is built from it.
    target_source: Mapping
    # A target named by its hub id (eaglet.target.hub): the repo, the revision asked, the commit it
    # resolved to and the snapshot folder read in place ({} for any other target). The parse reads
    # that folder as it reads a local target.path.
    target_hub: Mapping
    # The target section as target_model's job reads it: the config's, with target.revision pinned
    # to the commit the parse resolved (a branch moving during the run changes nothing).
    target_settings: Mapping
    # tokenize's input: the regenerated conversations when generation is on, the source ones otherwise
    tokenize_conversations: str
    # The user's own files and folders a stage reads, by content (eaglet.workflow.inputs.user_digest):
    # "prompts.path" and "target.path" as "sha256:..." ("" when the stage reads none; a datasets data
    # set's as "datasets:<fingerprint>", eaglet.base.prompt_sources), the .parquet
    # paths of "evaluate.sets" and "evaluate.regenerate.sets" as (path, digest) pairs. In the reading
    # rule's params, so a new content reruns it whatever the file's mtime says, and checked by its job.
    user_files: Mapping
    # drafter.kind and, for dflash, its settings (drafter.dflash) and what the DAG runs for it
    # (dflash_checks): the train and export rules' params hold the DFlash settings only for that kind
    drafter_kind: str
    drafter: Mapping
    drafter_lines: tuple[str, ...]

    def lines(self) -> list[str]:
        """What `snakemake -n` logs of the resolution, in the order it was decided."""
        return [
            *self.check_lines,
            *self.storage.lines,
            *self.plan_lines,
            f"evaluation HF loop: {'runs' if self.hf_loop else 'NOT RUN'} ({self.hf_loop_why})",
            *([] if self.hf_timed == self.hf_loop else
              [f"evaluation HF loop, timed: {'runs' if self.hf_timed else 'NOT RUN'} ({self.hf_timed_why})"]),
            f"aux layer ids: {list(self.layer_ids)}"
            + ("" if self.layer_ids_why == LAYER_IDS_SET else f" ({self.layer_ids_why})"),
            f"training autocast: {self.train_autocast} ({self.train_autocast_why})",
            f"training TTT attention: {self.train['ttt_attention']} ({self.train_ttt_attention_why})"
            if self.drafter_kind == "eagle3" else
            "training TTT attention: recompute (the P-EAGLE trainer's K-depth unroll; train.ttt_attention is not "
            "read for the kind)" if self.drafter_kind == "p_eagle" else
            f"training TTT attention: not used (drafter.kind {self.drafter_kind} trains blocks, no TTT unroll)",
            f"extraction target forward: {self.extract_target_dtype} ({self.extract_target_dtype_why})",
            *self.drafter_lines,
        ]

    def record(self) -> dict:
        """What was resolved, with the reasons, as plain JSON-able data (logs/<run>/resolved.json)."""
        out = {f.name: thaw(getattr(self, f.name)) for f in fields(self) if f.name not in ("paths", "storage")}
        out["paths"] = {f.name: getattr(self.paths, f.name) for f in fields(self.paths)}
        out["storage"] = {"hidden_states": self.storage.mode, "dtype": self.storage.dtype,
                          "why": self.storage.why, "lines": list(self.storage.lines)}
        return out

    def write_record(self, path: str | Path) -> None:
        """The record as a JSON file (the Snakefile's onstart: a run, never a preview)."""
        write_settings(path, json.dumps(self.record(), indent=2, sort_keys=True) + "\n")


LAYER_IDS_SET = "extract.layer_ids"
LAYER_IDS_DEFAULT = "vLLM's default for the target"


def storage_why(mode: str, dtype: str, lines: list[str]) -> str:
    """The reason of a storage choice (eaglet.planner.storage.decide's last line): without the
    target's shape (a built target before target_model has run), no budget is allowed, so the keys
    are as configured."""
    if lines:
        return lines[-1]
    return (f"storage: no storage.budget_gb: train.hidden_states {mode}"
            + (f", extract.dtype {dtype}" if mode == "offline" else "")
            + " as configured (the target's size is known once target_model has built it)")


def init_from_key(path: str | None, workdir: str | Path = ".") -> dict:
    """train.init_from's cache key and rerun trigger: the drafter directory's content digest (its
    config.json and model.safetensors hashed at parse time: a second or two for a large drafter);
    a folder that is not a drafter directory stops the parse, naming the key."""
    if not path:
        return {}
    try:
        return {"init_from": published.digest(Path(workdir) / path)}
    except ArtifactError as e:
        raise ValueError(f"train.init_from: {e}") from None


# The stages drafter.kind dflash runs (docs/block-drafters.md §6): the data stages, extraction, train
# (eaglet.train.dflash_train), export (eaglet.export.dflash_export), evaluate_offline (the block chain,
# eaglet.eval.dflash_offline), evaluate_speculative (the timed HF loop, eaglet.engines.dflash_loop),
# evaluate_vllm (method dflash at k = block_size - 1), eval_summary, drafter_card, plots and provenance;
# the rest are not wired for it, each with why.
DFLASH_NOT_RUN = {
    "evaluate_modes": "per chat-template mode offline figures are EAGLE-3's",
    "evaluate_regenerated": "the chain along regenerated answers is EAGLE-3's",
    "learning_curve": "refused for the kind (plan.learning_curve)",
}


def dflash_checks(config: dict, storage_mode: str, ids: list[int]) -> list[str]:
    """drafter.kind dflash: refuse what its trainer and export cannot do, naming the key; the lines
    that say what runs and what does not. [] for eagle3."""
    if config["drafter"]["kind"] != "dflash":
        return []
    t = config["train"]
    refusals = [
        (storage_mode == "online", "train.hidden_states: online (chosen or set): the DFlash trainer reads stored "
                                   "states; set train.hidden_states offline (and a storage.budget_gb that fits)"),
        (bool(t["init_from"]), "train.init_from: continuing a published drafter is EAGLE-3 only"),
        (bool(config["export"]["speculators"]), "export.speculators: the speculators format is EAGLE-3's"),
        (bool(config["plan"]["learning_curve"]), "plan.learning_curve: not wired for drafter.kind dflash"),
        (min(ids) < 1, f"extract.layer_ids {ids}: DFlash taps are residual streams entering a layer (>= 1)"),
    ]
    bad = [why for hit, why in refusals if hit]
    if bad:
        raise ValueError("drafter.kind dflash: " + "; ".join(bad))
    d = config["drafter"]["dflash"]
    return [f"drafter: dflash (block size {d['block_size']}, {d['num_layers']} layer(s), taps {ids} = the "
            f"run's aux layers; vLLM serves it at num_speculative_tokens {d['block_size'] - 1})",
            f"drafter kind dflash: NOT RUN (not wired for this kind, docs/block-drafters.md §6): "
            f"{', '.join(DFLASH_NOT_RUN)} ({'; '.join(f'{n}: {why}' for n, why in DFLASH_NOT_RUN.items())}); "
            f"the run ends at the evaluation summary, the drafter card, the plots and the provenance"]


# The stages drafter.kind p_eagle runs (docs/block-drafters.md §8): the data stages, extraction, train
# (eaglet.train.p_eagle_train), export (eaglet.export.p_eagle_export, its contract served by real vLLM
# with parallel drafting), evaluate_offline (the exact parallel chain at T = 0 and each rule's expectation
# at T > 0, eaglet.eval.p_eagle_offline), evaluate_speculative (the timed HF loop with a parallel-drafting
# proposer, eaglet.engines.p_eagle_loop), evaluate_vllm (timed, served with parallel drafting),
# eval_summary, the drafter card, the plots and the provenance; the rest are not wired for it yet, each
# with why.
P_EAGLE_NOT_RUN = {
    "evaluate_modes": "per chat-template mode offline figures are EAGLE-3's",
    "evaluate_regenerated": "the chain along regenerated answers is EAGLE-3's",
    "learning_curve": "refused for the kind (plan.learning_curve)",
}


def p_eagle_checks(config: dict, storage_mode: str) -> list[str]:
    """drafter.kind p_eagle: refuse what its trainer and export cannot do, naming the key; the lines
    that say what runs and what does not. [] for the other kinds."""
    if config["drafter"]["kind"] != "p_eagle":
        return []
    t = config["train"]
    refusals = [
        (storage_mode == "online", "train.hidden_states: online (chosen or set): the P-EAGLE trainer reads stored "
                                   "states; set train.hidden_states offline (and a storage.budget_gb that fits)"),
        (bool(t["init_from"]), "train.init_from: continuing a published drafter is EAGLE-3 only"),
        (bool(config["export"]["speculators"]), "export.speculators: the speculators format is EAGLE-3's"),
        (bool(config["plan"]["learning_curve"]), "plan.learning_curve: not wired for drafter.kind p_eagle"),
        (int(t["gpus"] or 0) * int(t["nodes"] or 1) > 1,
         "train.gpus x train.nodes > 1: the P-EAGLE trainer runs one process (no DDP yet)"),
    ]
    bad = [why for hit, why in refusals if hit]
    if bad:
        raise ValueError("drafter.kind p_eagle: " + "; ".join(bad))
    k = config["drafter"]["p_eagle"]["parallel_k"]
    return [f"drafter: p_eagle (K {k} drafts in one forward; vLLM serves it with method eagle3, parallel_drafting, "
            f"num_speculative_tokens {k})",
            f"drafter kind p_eagle: NOT RUN (not wired for this kind, docs/block-drafters.md §8): "
            f"{', '.join(P_EAGLE_NOT_RUN)} ({'; '.join(f'{n}: {why}' for n, why in P_EAGLE_NOT_RUN.items())}); "
            f"the run ends at the evaluation summary, the drafter card, the plots and the provenance"]


def resolve(config: dict, workdir: str | Path = ".", job_root: str | Path | None = None) -> Resolved:
    """Resolve a validated workflow config (``eaglet.base.schema.validate``, defaults filled) in
    the workflow folder ``workdir``; ``config`` is left as it is. Raises ValueError naming the key
    when the run cannot succeed (each check is the named function's). ``job_root``: the repository
    of the eaglet the jobs import, where they find the separate environments a relative path names
    (eaglet.workflow.environments; default: this eaglet's)."""
    check_tiny(config["target"]["tiny"])  # the schema leaves target.tiny's keys to the family's config class
    # every separate environment the DAG will run (vLLM, SGLang), before anything else is decided
    env_lines = environments.check(config, job_root)
    snap = hub.target_snapshot(config["target"], workdir)
    target_settings = dict(config["target"])
    if snap is not None:
        # the parse reads the snapshot folder as a local target.path; the config stays as written
        target_settings["revision"] = snap.commit
        config = copy.deepcopy(config)
        config["target"]["path"] = str(snap.folder)
    lines = checks.parse_time(config, workdir) + env_lines
    if snap is not None:
        lines.insert(0, f"target {snap.repo_id} revision {snap.revision!r}: commit {snap.commit} in the hub "
                        f"cache {snap.cache} (read in place from {snap.folder})")
    checks.settings_consistent(config)
    shapes = plan.parse_time_shapes(config, workdir)
    mode, dtype, storage_lines = storage.decide(config, shapes)
    # The config as the jobs read it: the user's with the storage choice in, a copy (the memory plan,
    # the trainer's params and its note follow the choice; the config stays as written).
    chosen = copy.deepcopy(config)
    chosen["train"]["hidden_states"], chosen["extract"]["dtype"] = mode, dtype
    plan_lines = plan.parse_time(chosen, workdir)
    # the TTT attention's memory path (issue 43): the plan's choice, the same as its line states
    ttt, ttt_why = plan.choose_ttt_attention(chosen, shapes)

    t = config["target"]
    target_load = {k: t[k] for k in LOAD_KEYS}
    serve = serving(t)
    hf = plan.hf_loop(config)
    template = chat_template_text(t["chat_template"], workdir) or ""
    ids = layer_ids(config)
    extract_on_gpu = config["extract"]["gpus_per_shard"] > 0 or t["device"] == "cuda"
    target_dtype, target_dtype_why = resolve_target_dtype(config["extract"]["target_dtype"], on_gpu=extract_on_gpu)
    autocast, autocast_why = resolve_autocast(config["train"]["autocast"],
                                              on_gpu=int(config["train"]["gpus"] or 0) > 0)
    train = ({k: v for k, v in chosen["train"].items() if k not in ("nodes", "rdzv_port")}
             | {"autocast": autocast, "ttt_attention": ttt})
    # hashed once per change of a file's stat (.snakemake/eaglet-digests.json of the workflow folder)
    digests = DigestCache(Path(workdir) / CACHE_FILE)
    source = target_source(t, digests, snap.key() if snap is not None else None)
    p = config["prompts"]
    user = {
        # a hub snapshot is keyed by its commit and its files' content hashes (target_source), not read again
        "target.path": "" if snap is not None else user_digest(local_target(t), "target.path", digests,
                                                                base=workdir),
        # a local file or folder by its content digest, a datasets data set by its fingerprint
        "prompts.path": prompts_key(p, digests, workdir),
        "evaluate.sets": user_sets(config["evaluate"]["sets"], "evaluate.sets", digests, workdir),
        "evaluate.regenerate.sets": user_sets(config["evaluate"]["regenerate"]["sets"],
                                              "evaluate.regenerate.sets", digests, workdir),
    }
    digests.save()
    drafter_lines = dflash_checks(config, mode, list(ids)) + p_eagle_checks(config, mode)
    paths = Paths.of(config)
    run = paths.run
    return Resolved(
        paths=paths,
        check_lines=tuple(lines),
        storage=Storage(mode, dtype, tuple(storage_lines), storage_why(mode, dtype, storage_lines)),
        plan_lines=tuple(plan_lines),
        target_load=freeze(target_load),
        serving=freeze(serve),
        vllm_gpus=serve["tensor_parallel_size"] if config["generate"]["vllm"]["package"] == "vllm" else 0,
        hf_loop=hf.chain,
        hf_loop_why=hf.chain_why,
        hf_timed=hf.timed,
        hf_timed_why=hf.timed_why,
        hf_gpus=hf.gpus,
        chat_template=template,
        chat_template_kwargs=freeze(config["generate"]["chat_template_kwargs"]),
        layer_ids=tuple(ids),
        layer_ids_why=LAYER_IDS_SET if config["extract"]["layer_ids"] else LAYER_IDS_DEFAULT,
        extract_shards=tuple(range(config["extract"]["shards"])),
        extract_on_gpu=extract_on_gpu,
        extract_target_dtype=target_dtype,
        extract_target_dtype_why=target_dtype_why,
        extract_load=freeze(target_load | {"dtype": target_dtype, "dtype_reason": target_dtype_why}),
        train_autocast=autocast,
        train_autocast_why=autocast_why,
        train_ttt_attention_why=ttt_why,
        train=freeze(train),
        train_keys=tuple(k for k in train if k not in (*plan.TRAIN_NOT_DEFINING, "init_from")),
        train_init_from=freeze(init_from_key(config["train"]["init_from"], workdir)),
        train_note=freeze(storage.job_note(chosen, storage_lines)),
        online=freeze({"tokens": f"{run}/tokenize/tokens.parquet",  # rules.tokenize.output.tokens
                       "layer_ids": ids, "dtype": dtype, "target_load": target_load}),
        target_source=freeze(source),
        target_hub=freeze(snap.record() if snap is not None else {}),
        target_settings=freeze(target_settings),
        tokenize_conversations=(f"{run}/generate/conversations.parquet" if config["generate"]["enabled"]
                                else f"{run}/prompts/train.parquet"),
        user_files=freeze(user),
        drafter_kind=config["drafter"]["kind"],
        drafter=freeze(config["drafter"]),
        drafter_lines=tuple(drafter_lines),
    )
