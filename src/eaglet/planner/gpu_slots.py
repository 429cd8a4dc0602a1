"""Run a command on N free GPUs of this machine, or as-is when a scheduler already chose them.

Snakemake only counts a ``gpu`` resource locally; it never sets ``CUDA_VISIBLE_DEVICES``. This
launcher takes N per-GPU slot files in a lock folder with a non-blocking ``flock`` (retrying
until N are free), exports their indices as ``CUDA_VISIBLE_DEVICES`` and ``exec``s the command.
The locks live on in the command's process (flock survives exec), so they are released exactly
when it exits, however it exits. It does nothing when ``CUDA_VISIBLE_DEVICES`` is already set
(SLURM, Kubernetes) or when N is 0 (CPU jobs).

    python -m eaglet.planner.gpu_slots --gpus 1 -- python -m eaglet.features.extract --shard 0 ...

Slots: ``--total`` or ``$EAGLET_GPU_SLOTS``, else the GPUs ``nvidia-smi -L`` lists. Lock folder:
``--lock-dir`` or ``$EAGLET_GPU_LOCK_DIR``, else ``/tmp/eaglet-gpu-slots-<uid>``.

``train_launch`` builds what starts the training processes after the slot launcher: plain python,
torchrun on one machine, or one ``srun`` of torchrun per node inside a SLURM allocation.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

# The rendezvous host of a multi-node job: the allocation's first node, as SLURM names it.
# snakemake-executor-plugin-slurm-jobstep (0.6.1) strips SLURM_* from the rule's environment except
# SLURM_JOB_ID, so SLURM_JOB_NODELIST is asked of squeue when it is gone.
SLURM_MASTER = '$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(squeue -h -o %N -j "$SLURM_JOB_ID")}" | head -n1)'


def train_launch(nproc: int, nodes: int = 1, port: int = 29500, srun: bool | None = None) -> str:
    """The command (without ``-m eaglet.train.train ...``) that starts ``nodes`` x ``nproc`` ranks.

    One machine: ``python`` on the CPU (nproc 0), else torchrun ``--standalone`` (a private
    rendezvous on a free port), on one GPU too, so that a one-GPU run (scripts/gpu-check.sh) goes
    through the launcher that 8 GPUs use. Several nodes (or ``srun=True``, which the one-node SLURM test uses): one
    ``srun`` task per node, each running torchrun with ``nproc`` local ranks, meeting through the
    c10d rendezvous on the allocation's first node; torchrun then sets RANK / LOCAL_RANK /
    WORLD_SIZE as it does on one machine, so eaglet.train.train needs nothing else. A shell string:
    SLURM_MASTER expands in the job's shell, on the node running the batch script.
    """
    if srun is None:
        srun = nodes > 1
    if not srun:
        if nodes != 1:
            raise ValueError(f"{nodes} nodes need srun (a SLURM allocation)")
        return "python" if nproc < 1 else f"python -m torch.distributed.run --standalone --nproc_per_node {nproc}"
    # --kill-on-bad-exit (its value only after "="): a node whose torchrun fails ends the others,
    # which would otherwise wait out the rendezvous timeout
    return (f"srun --nodes {nodes} --ntasks-per-node 1 --kill-on-bad-exit=1 torchrun --nnodes {nodes}"
            f" --nproc-per-node {max(1, nproc)}"
            f' --rdzv-backend c10d --rdzv-endpoint "{SLURM_MASTER}:{port}"')


def count_gpus() -> int:
    if os.environ.get("EAGLET_GPU_SLOTS"):
        return int(os.environ["EAGLET_GPU_SLOTS"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def acquire(n: int, total: int, lock_dir: Path, poll_s: float = 0.2,
            timeout_s: float | None = None) -> tuple[list[int], list[int]]:
    """Take n of ``total`` slots; return (slot indices, open locked fds).

    All-or-nothing per attempt: a job holding some slots while waiting for more could deadlock
    with another doing the same, so a partial grab is released before sleeping.
    """
    if n > total:
        raise SystemExit(f"gpu_slots: {n} GPUs wanted, this machine has {total} slots")
    lock_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    while True:
        got: list[tuple[int, int]] = []
        for k in range(total):
            fd = os.open(lock_dir / f"gpu{k}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            got.append((k, fd))
            if len(got) == n:
                return [k for k, _ in got], [fd for _, fd in got]
        for _, fd in got:
            os.close(fd)  # closing the last fd of a description drops its flock
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"gpu_slots: no {n} free slots in {lock_dir} after {timeout_s} s")
        time.sleep(poll_s * (1 + random.random()))  # jitter: waiters don't retry in lockstep


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="python -m eaglet.planner.gpu_slots --gpus N [--total M] [--lock-dir D] "
                                      "-- cmd ...")
    p.add_argument("--gpus", type=int, required=True, help="GPUs this command needs (0 = CPU)")
    p.add_argument("--total", type=int, default=None, help="GPU slots on this machine")
    p.add_argument("--lock-dir", default=None)
    p.add_argument("--timeout", type=float, default=None, help="give up waiting after this many s")
    a = p.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        raise SystemExit("gpu_slots: no command after --")
    env = dict(os.environ)
    if a.gpus > 0 and "CUDA_VISIBLE_DEVICES" not in env:
        total = a.total if a.total is not None else count_gpus()
        lock_dir = Path(a.lock_dir or env.get("EAGLET_GPU_LOCK_DIR")
                        or f"/tmp/eaglet-gpu-slots-{os.getuid()}")
        slots, fds = acquire(a.gpus, total, lock_dir, timeout_s=a.timeout)
        for fd in fds:
            os.set_inheritable(fd, True)  # the command keeps the locks until it exits
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        print(f"gpu_slots: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
