"""The training job's wiring (workflow/rules/train.smk, and learning_curve.smk's train_fraction): how
its ranks are launched and what it asks of a scheduler (from the config's train section), where its
hidden states come from and the data flags of its command line (from the storage choice,
eaglet.workflow.resolve.Resolved)."""

from __future__ import annotations

import json
import shlex

from eaglet.planner.gpu_slots import train_launch
from eaglet.workflow.resolve import Resolved, thaw


def launcher(train: dict):
    """The launcher param: torchrun with one process per GPU (DDP) when train.gpus >= 1, else plain
    python; with train.nodes > 1, one srun of torchrun per node of the SLURM allocation
    (eaglet.planner.gpu_slots). Its command line stands in the cache key for train.nodes and
    train.rdzv_port (Resolved.train leaves them out)."""
    return lambda wildcards, resources: train_launch(int(train["gpus"]), int(train["nodes"]),
                                                     int(train["rdzv_port"]))


def hidden_input(R: Resolved):
    """The input function of the trainer's hidden states: extract's shards (offline), or the tokens
    the target runs on inside the job (online)."""
    if R.storage.online:
        tokens = R.online["tokens"]
        return lambda wildcards: tokens
    shards = [f"{R.paths.run}/extract/shard_{i}" for i in R.extract_shards]
    return lambda wildcards: shards


def data_args(R: Resolved):
    """The trainer's data flags: the shards (offline) or the online settings, inline."""
    if R.storage.online:
        flags = f"--online {shlex.quote(json.dumps(thaw(R.online), sort_keys=True))}"
        return lambda wildcards, input: flags
    return lambda wildcards, input: f"--hidden {' '.join(shlex.quote(str(p)) for p in input.hidden)}"


def resources(train: dict) -> dict:
    """What the training job asks of a scheduler beyond `gpu` (all GPUs of the job). Several
    nodes: `nodes` (sbatch --nodes) and the plugin's MPI mode (`mpi` + `tasks`), in which the job
    step runs the rule's shell in the batch script, not inside its own one-task `srun`, so that
    the rule's srun can start one task per node; tasks_per_gpu=0 keeps `tasks` from also becoming
    --ntasks-per-gpu."""
    nodes = int(train["nodes"])
    if nodes == 1:
        return {}
    return {"nodes": nodes, "mpi": "srun", "tasks": nodes, "tasks_per_gpu": 0}
