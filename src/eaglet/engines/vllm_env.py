"""What eaglet needs of the separate vLLM environment (``envs/vllm/.venv``, made by
``envs/vllm/setup.sh``): where its interpreter is, how to run a script in it, and how to read
vLLM's speculative-decoding counters.

One copy of each, shared by the server (eaglet.engines.vllm_server), the export contract
(eaglet.export.contract: its vllm_checks and known_answer), the vLLM evaluation (eaglet.eval.evaluate_vllm)
and the tests: three resolvers once disagreed on whether a half-installed venv counts (issue 16), and two counter
parsers on several engines (one kept the last engine's value, one summed).

Standard library only: the runner scripts (vllm_check_runner.py, vllm_eval_runner.py) import it
inside vLLM's interpreter, where eaglet's own dependencies are not installed.

    py = vllm_python("envs/vllm/.venv")       # VllmEnvMissing unless setup.sh finished there
    runner = copy_runner(RUNNER, work_dir)    # the runner and this module, side by side
    env = process_env(work_dir, py, VLLM_CPU_KVCACHE_SPACE="1")   # a vLLM process's environment
    counters = spec_decode_counters(metric_samples(llm.get_metrics()))
    reading = cpu_times()                     # two of them: how busy others kept the CPUs
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

DEFAULT_ENV = "envs/vllm/.venv"
# How the vLLM environment is built (named by every refusal of a missing one)
SETUP = "`make vllm-env` (envs/vllm/setup.sh)"
# envs/vllm/setup.sh writes it last: a venv without it is an interrupted install (setup.sh rebuilds it)
SETUP_STAMP = ".eaglet-setup-complete"
# Overrides DEFAULT_ENV (a venv folder or its bin/python) where no environment is given.
ENV_VAR = "EAGLET_VLLM_PYTHON"
# Beside the venv's stamp: vLLM's answers about its model classes, shared by every run (process_env)
MODELINFOS = "eaglet-vllm-modelinfos"
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"


class VllmEnvMissing(RuntimeError):
    """The vLLM environment is absent or its install never finished."""


def vllm_python(env: str | os.PathLike | None = None) -> Path:
    """The interpreter of the vLLM environment ``env`` (a venv folder or its ``bin/python``;
    default ``$EAGLET_VLLM_PYTHON`` or ``envs/vllm/.venv``); a relative path that does not exist
    from here is taken from the repository root. Refuses a venv without setup.sh's stamp: a
    half-installed vLLM fails minutes later inside the engine, with an error that names no cause."""
    return venv_python(env, ENV_VAR, DEFAULT_ENV, "vLLM", SETUP, VllmEnvMissing)


def venv_python(env, env_var: str, default: str, what: str, setup: str, missing: type[Exception],
                root: str | os.PathLike | None = None) -> Path:
    """The interpreter of one of eaglet's separate environments (vLLM here, SGLang in
    eaglet.export.contract.sglang_check): ``env``, else ``$env_var``, else ``default``, as :func:`vllm_python`
    says; ``missing`` raised, naming ``setup``, when it is absent or its install never finished.
    ``root``: the repository a relative path falls back to (default: this eaglet's; the workflow's
    parse names the one its jobs import, eaglet.workflow.environments)."""
    p = Path(env if env is not None else os.environ.get(env_var) or default)
    if not p.is_absolute() and not p.exists():
        p = Path(root if root is not None else Path(__file__).resolve().parents[3]) / p
    p = p.absolute()  # not resolve(): the venv's python is a symlink, and resolving it leaves the venv
    py = p if p.name.startswith("python") else p / "bin" / "python"
    venv = py.parent.parent
    if not py.exists():
        raise missing(f"{py}: {what} environment missing; create it with {setup}")
    if not (venv / SETUP_STAMP).exists():
        raise missing(f"{venv}: {what} environment incomplete (no {SETUP_STAMP}: its install did not "
                      f"finish); rerun {setup}")
    return py


def timeout(seconds: float) -> float:
    """A vLLM process's time limit: ``seconds``, or less where ``EAGLET_VLLM_TIMEOUT_S`` caps it (the
    test suite sets it, so that one hung engine costs minutes, not the CI run). A limit only: it
    defines no output, and no stage is keyed by it."""
    cap = os.environ.get("EAGLET_VLLM_TIMEOUT_S")
    return min(float(seconds), float(cap)) if cap else float(seconds)


def process_env(work: str | os.PathLike, python: str | os.PathLike, **extra: str) -> dict[str, str]:
    """Environment of a vLLM process that eaglet starts with ``python`` (from vllm_python) for a run
    in ``work``: eaglet's interpreter settings removed (they must not leak into vLLM's venv), vLLM's
    caches inside ``work`` (share_modelinfos aside), no hub access, no usage report; ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    cache = Path(work).absolute() / "vllm_cache"
    share_modelinfos(cache, python)
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CACHE_ROOT=str(cache), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def share_modelinfos(cache: Path, python: str | os.PathLike) -> Path | None:
    """Link ``cache``/modelinfos to one folder in the vLLM venv; that folder, or None where it cannot
    be made (a read-only venv: the run then keeps its own). Before it serves a model class, vLLM asks
    a fresh interpreter about it (about 15 s on two cores, once for the target and once for the
    drafter of every run) unless VLLM_CACHE_ROOT/modelinfos has the answer, stored under a digest of
    the class's source file: a pure function of the installed vLLM, which goes with the venv."""
    link = cache / "modelinfos"
    shared = Path(python).absolute().parent.parent / MODELINFOS  # python: VENV/bin/python
    try:
        if link.is_symlink() and not link.exists():  # the venv was rebuilt since
            link.unlink()
        if link.exists():
            return shared if link.is_symlink() else None
        shared.mkdir(exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)
    except OSError:
        return None
    return shared


def copy_runner(runner: Path, work: Path) -> Path:
    """Copy a runner script, and this module it imports, into ``work``; the copy's path. Run from
    src/eaglet/, eaglet/data/tokenization.py would head sys.path and shadow the standard library's tokenize
    inside vLLM's interpreter."""
    work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__), work / Path(__file__).name)
    shutil.copyfile(runner, work / runner.name)
    return work / runner.name


# --------------------------------------------------------------------------- starting a script in it
# Where a test run keeps its fork servers (eaglet/engines/forkserver.py): unset, every script starts in
# a fresh interpreter, as `make run` has it.
FORKSERVER_VAR = "EAGLET_FORKSERVER_DIR"
# What a vLLM fork server imports before it serves: the engine and its offline entry point (LLM)
PRELOAD = ("vllm", "vllm.entrypoints.llm")
# Settings read when OpenMP or the allocator loads (with torch, in the server): one server per set of them
LOAD_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_", "LD_")


def start(cmd: list, *, log, env: dict | None, cwd: str | os.PathLike, preload: tuple[str, ...] = PRELOAD):
    """``cmd`` (``[python, script, *args]``, ``python`` a venv's interpreter) started with its standard
    output and error into the open file ``log``: a fresh interpreter (``subprocess.Popen``), or, where
    ``$EAGLET_FORKSERVER_DIR`` is set, a child forked from that venv's server, which has imported
    ``preload`` already (eaglet.engines.forkserver.Forked; the server is started on first use). Settings
    that act when an interpreter starts: ``LD_PRELOAD`` or a ``PYTHON*`` one other than ``PYTHONPATH`` in
    ``env`` (which the child puts on sys.path itself) start a fresh interpreter; OpenMP's and the
    allocator's pick a server started with the same. Either has ``pid``, ``returncode``, ``poll()``,
    ``wait(timeout)`` and ``kill()``."""
    import subprocess

    from eaglet.engines import forkserver

    where = os.environ.get(FORKSERVER_VAR)
    full = dict(os.environ if env is None else env)
    sock = None
    if where and len(cmd) >= 2 and not str(cmd[1]).startswith("-") and not forkserver.needs_fresh(full):
        at_load = sorted((k, v) for k, v in full.items() if k.startswith(LOAD_TIME))
        try:
            sock = forkserver.server_socket(Path(where), Path(cmd[0]), full, preload, at_load)
        except RuntimeError:  # the server did not start (its log says why): the script meets the same
            pass  # error in a fresh interpreter, and reports it as it would without a server
    if sock is None:
        return subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        return forkserver.Forked(sock, [str(c) for c in cmd[1:]], (null, log.fileno(), log.fileno()), full, cwd)
    finally:
        os.close(null)


def run(cmd: list, *, log, env: dict | None, cwd: str | os.PathLike, timeout: float | None,
        preload: tuple[str, ...] = PRELOAD) -> int:
    """:func:`start`, waited for: its exit code; past ``timeout`` it is killed (its whole session, where
    forked) and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    import subprocess

    proc = start(cmd, log=log, env=env, cwd=cwd, preload=preload)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def metric_samples(metrics: Iterable) -> list[tuple[str, dict, float | list[float]]]:
    """``(name, labels, value)`` of vLLM's ``LLM.get_metrics()`` objects; a Vector's ``values``
    (the per-position counts) as a list."""
    out = []
    for m in metrics:
        value = list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
        if value is not None:
            out.append((m.name, dict(getattr(m, "labels", None) or {}), value))
    return out


def spec_decode_counters(samples: Iterable[tuple[str, dict, float | list[float]]]) -> dict:
    """vLLM's speculative-decoding counters, summed over engines (data-parallel ranks each report
    their own, labelled ``engine``): ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``
    and ``num_accepted_tokens_per_pos`` as a list. Takes Prometheus samples (``vllm:..._total``,
    the per-position count labelled ``position``) and :func:`metric_samples` (a list per engine)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    for name, labels, value in samples:
        if "spec_decode_" not in name:
            continue
        key = name.split("spec_decode_", 1)[1].removesuffix("_total")
        if key == PER_POS:
            pairs = enumerate(value) if isinstance(value, list) else [(int(labels.get("position", 0)), value)]
            for pos, v in pairs:
                per_pos[pos] = per_pos.get(pos, 0.0) + v
        elif key in totals:
            totals[key] += value
    res: dict = {k: int(v) for k, v in totals.items()}
    res[PER_POS] = [int(per_pos.get(p, 0)) for p in range(max(per_pos) + 1)] if per_pos else []
    return res


# --------------------------------------------------------------------------- how busy the CPUs were
def cpu_times(pid: int | None = None) -> dict:
    """A reading for "how much of the CPUs did others use": the seconds this process's CPUs (its
    affinity) spent busy since boot (/proc/stat), the CPU seconds of process ``pid`` (default this
    one) and all its live descendants (/proc/PID/stat: user + system, and their reaped children's),
    and a monotonic clock. Two readings give other processes' share (eaglet.eval.evaluate_vllm):
    vLLM computes in engine-core and worker processes that eaglet does not wait for, so the runner
    takes both readings while its engines are alive. Empty where /proc is missing."""
    import time

    try:
        cpus = sorted(os.sched_getaffinity(0))
        lines = Path("/proc/stat").read_text().splitlines()
    except (AttributeError, OSError):
        return {}
    want, busy = {f"cpu{c}" for c in cpus}, 0
    for line in lines:
        f = line.split()
        if f and f[0] in want:
            v = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(v) - v[3] - v[4]
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), sum(int(x) for x in f[11:15]))  # ppid; utime stime cutime cstime
    root = pid or os.getpid()
    tree, todo = set(), [root]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, (pp, _) in stats.items() if pp == p and c not in tree]
    tick = os.sysconf("SC_CLK_TCK")
    return {"t": time.monotonic(), "cpus": len(cpus), "busy_s": busy / tick,
            "tree_s": sum(stats[p][1] for p in tree if p in stats) / tick}


# --------------------------------------------------------------------------- the runners' engine
def add_serving_args(p) -> None:
    """target.vllm / target.trust_remote_code as a runner's flags (defaults: vLLM-CPU's)."""
    p.add_argument("--dtype", default="float32", help="float32 on CPU builds (bf16 on AVX2 corrupts text)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")


def drafter_method(drafter: str | os.PathLike) -> str:
    """vLLM's speculative method for a drafter folder: "dflash" when its config.json names a DFlash
    architecture (eaglet.export.dflash_format; vLLM itself guesses it only from a path containing
    "dflash"), else "eagle3"."""
    conf = Path(drafter) / "config.json"
    try:
        archs = json.loads(conf.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return "eagle3"
    return "dflash" if any(str(x).startswith("DFlash") for x in archs) else "eagle3"


def engine_kwargs(a, drafter: str | None = None, max_num_seqs: int | None = None,
                  draft_sample_method: str | None = None) -> dict:
    """``vllm.LLM`` keyword arguments from a runner's parsed flags (a pure function, tested without
    vLLM); ``max_num_seqs`` defaults to the runner's ``--max-num-seqs``; ``draft_sample_method``
    (vLLM's SpeculativeConfig field: "greedy", its default, or "probabilistic") goes into the
    speculative config when given."""
    kw = dict(model=a.target, dtype=a.dtype, tensor_parallel_size=a.tensor_parallel_size,
              trust_remote_code=a.trust_remote_code, enforce_eager=True, disable_log_stats=False,
              max_model_len=a.max_model_len, max_num_seqs=max_num_seqs or a.max_num_seqs, seed=0)
    if a.enable_expert_parallel:
        kw["enable_expert_parallel"] = True
    if drafter:
        kw["speculative_config"] = {"method": drafter_method(drafter), "model": drafter, "num_speculative_tokens": a.k}
        if draft_sample_method:
            kw["speculative_config"]["draft_sample_method"] = draft_sample_method
    return kw
