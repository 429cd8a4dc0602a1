"""Shared test fixtures and helpers."""

import atexit
import contextlib
import inspect
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import suite_schedule

REPO = Path(__file__).resolve().parents[1]
# A pytest-xdist worker (`make test` runs one per core, tests/suite_schedule.py) gets one torch/OpenMP
# thread, and so does every process its tests start: two workers of two threads each would spin-wait
# each other on two cores. Set before anything imports torch.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    # Snakemake gives a DAG test's jobs OMP_NUM_THREADS=threads (2 with --cores 2): two such processes on
    # two cores spin-wait each other under libgomp's default policy. Passive waiting: 1.88x faster for
    # two 2-thread tiny-model processes at once, 0.96x for one alone (benchmarks/bench_omp_wait.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What a workflow clone needs (tests run Snakemake in copies so they never touch results/)
WORKFLOW_FILES = ["Snakefile", "workflow", "config", "src", "envs", "pyproject.toml"]
# A hung vLLM start or run costs at most this (eaglet.engines.vllm_env.timeout; inherited by every Snakemake
# and engine process a test starts): the slowest legitimate one here takes about two minutes.
os.environ.setdefault("EAGLET_VLLM_TIMEOUT_S", "420")
# vLLM's engine core in the process that makes the engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), for every
# vLLM a test starts: the timed evaluation's runners (eaglet.eval.evaluate_vllm, which takes vLLM's default
# from the environment), the card's snippet. vLLM-CPU's separate engine-core process costs ~19 s of CPU an
# engine (three engines: 82 s against 24 s, the same tokens; docs/measurements.md); no claim here depends
# on where the core runs. The export contract's runner does the same by itself (eaglet.engines.vllm_check_runner).
# The default model end to end (tests/workflow/test_e2e_default.py) sets it back to vLLM's default, the
# user's, and so runs the timed evaluation as `make run` does. The OpenAI server ignores it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# SGLang's loader reports, kept by the digest of what it read (eaglet.export.contract.sglang_check): one folder
# per test session, so every session runs SGLang's loader on each distinct export at least once
if "EAGLET_SGLANG_CACHE" not in os.environ:
    os.environ["EAGLET_SGLANG_CACHE"] = tempfile.mkdtemp(prefix="eaglet-sglang-reports-")
    atexit.register(shutil.rmtree, os.environ["EAGLET_SGLANG_CACHE"], True)

# vLLM's runners started by a fork server that has imported vLLM once (eaglet/engines/forkserver.py; the
# servers' sockets in one folder per test session, shared by both workers, each server stopped at its
# end): ``from vllm import LLM`` is ~7.5 s of CPU in each of ~35 runner processes. The default model end to end
# (tests/workflow/test_e2e_default.py) runs without it, as `make run` does: a fresh interpreter each.
# The same folder holds `python` for the jobs of the tests' Snakemake runs (job_path): each job a child
# forked from a server of this venv that has imported torch, transformers, pandas (~3.3 s of CPU a job,
# ~200 jobs a run), and `python` for the tests' own `python -m snakemake` (snakemake_cmd), forked from a
# server that has imported Snakemake (~1.2 s of CPU in each of ~140 starts). The runs that prove the fresh
# path: the default model end to end, SLURM, the faults.
if "EAGLET_FORKSERVER_DIR" not in os.environ:
    os.environ["EAGLET_FORKSERVER_DIR"] = tempfile.mkdtemp(prefix="eaglet-fs-")
    from eaglet.engines import forkserver

    forkserver.write_shim(Path(os.environ["EAGLET_FORKSERVER_DIR"]), sys.executable)
    forkserver.write_shim(Path(os.environ["EAGLET_FORKSERVER_DIR"]), sys.executable, folder="snakemake",
                          preload=forkserver.SNAKEMAKE_PRELOAD)

    @atexit.register
    def _stop_forkservers(where=Path(os.environ["EAGLET_FORKSERVER_DIR"])):
        import signal

        for pid in where.glob("*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError, OSError):
                os.killpg(int(pid.read_text()), signal.SIGKILL)
        shutil.rmtree(where, True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (the CI environment variable set) a skip is a failure: every skip here is a real
    component that is missing (the vLLM environment, SLURM, Chromium, shellcheck, a tmpfs), and a
    broken install step must not turn its checks into a green run. The skip's reason names the
    component and how to install it."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"not run under CI, so failed: {reason}"


# Every test's time (setup + call + teardown), slowest first, written where CI prints it from
# (.ci/run): the whole list, where `--durations=30` shows the top of it.
DURATIONS = REPO / "logs" / "test-durations.txt"
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    # A worker's share is reported to the controller, which writes the whole list; a pytest run by a
    # test inside a worker (test_contract's CI check) inherits the variable and writes nothing either.
    if not _durations or XDIST_WORKER:
        return
    DURATIONS.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(_durations.items(), key=lambda kv: -kv[1])
    total = sum(_durations.values())
    DURATIONS.write_text(f"# {len(rows)} tests, {total / 60:.1f} min in tests (exit status {exitstatus})\n"
                         + "".join(f"{d:9.1f} s  {node}\n" for node, d in rows))


# What makes a test a DAG test (marker `dag`, left out by `make test-fast`): it runs Snakemake on a
# clone of the workflow, itself or through one of these fixtures; a test that starts real vLLM
# (the shared server, or the engine through vllm_env_or_skip) is marked `vllm` too.
_DAG_FIXTURES = {"finished_run", "run_copy", "tokenized", "runs", "run", "repo", "kimi_plan", "workflow"}
_DAG_CALL = re.compile(r"\bclone\(|\b_?smk\(|\b_?dry(_run)?\(|\"snakemake\"")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Modules (or modules sharing the tiny vLLM server) as work units, longest first."""
    return suite_schedule.make_scheduler(config, log)


def _source(fn) -> str:
    try:
        return inspect.getsource(fn) if fn else ""
    except (OSError, TypeError):
        return ""


def _sources(item) -> str:
    """The test function's source and that of every fixture it uses (fixturenames is the closure), so
    that a module fixture starting vLLM or Snakemake marks the tests that use it."""
    parts = [_source(getattr(item, "function", None))]
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in defs.get(name, ()):
            parts.append(_source(getattr(fixturedef, "func", None)))
    return "\n".join(parts)


def pytest_collection_modifyitems(config, items):
    for item in items:
        source = _sources(item)
        if _DAG_FIXTURES & set(getattr(item, "fixturenames", ())) or _DAG_CALL.search(source):
            item.add_marker(pytest.mark.dag)
        if "vllm_tiny_server" in getattr(item, "fixturenames", ()) or "vllm_env_or_skip(" in source:
            item.add_marker(pytest.mark.vllm)
        if Path(str(item.path)).parent.name == "benchmarks":
            item.add_marker(pytest.mark.bench)


def job_path() -> str:
    """PATH for a test's Snakemake run: this venv's bin first (its jobs' ``python`` is this interpreter);
    in a test run with fork servers, before it the folder of ``python`` that forks each job from a server
    of this venv (eaglet.engines.forkserver.shim)."""
    parts = [str(Path(sys.executable).parent), os.environ["PATH"]]
    where = os.environ.get("EAGLET_FORKSERVER_DIR")
    if where and (Path(where) / "bin" / "python").is_file():
        parts.insert(0, str(Path(where) / "bin"))
    return os.pathsep.join(parts)


def snakemake_cmd() -> list[str]:
    """``python -m snakemake`` for a test: this venv's interpreter; in a test run with fork servers, the
    shim that forks it from a server of this venv that has imported Snakemake."""
    where = os.environ.get("EAGLET_FORKSERVER_DIR")
    shim = Path(where) / "snakemake" / "python" if where else None
    return [str(shim) if shim and shim.is_file() else sys.executable, "-m", "snakemake"]


def clone(dest: Path) -> Path:
    """A copy of the workflow (no venv, no results) in ``dest``, for a Snakemake run in isolation."""
    dest.mkdir(parents=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".venv"))
        else:
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A clone of the workflow run to the end on config/smoke.yaml with a private output cache:
    ``(clone, cache)``, shared by the DAG tests (tests/workflow/test_workflow.py and test_rerun_table.py)."""
    from workflow_common import smk

    root = tmp_path_factory.mktemp("dag")
    cache = root / "cache"
    cache.mkdir()
    a = clone(root / "a")
    smk(a, cache)
    return a, cache


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread: on a busy 2-core machine two threads spin-wait each other (10x slower).
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def canned():
    """The canned OpenAI-compatible chat server (tests/canned_server.py); its base URL."""
    from canned_server import serve_canned

    with serve_canned() as url:
        yield url


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Llama target (8 layers, hidden 128) with identity.json, built once."""
    from eaglet.data.target_model import materialise
    from eaglet.target.load import load_identity

    out = tmp_path_factory.mktemp("tiny_target")
    materialise({"name": "tiny", "tiny": {}}, out)
    # identity.json keeps `path` relative to itself; tests want the absolute model folder
    # (the identity file is then Path(path).parent / "identity.json").
    return load_identity(out / "identity.json")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """``tiny_family(family)``: the identity.json of a tiny random target of that family
    (eaglet.target.families, 2 layers), built once per session."""
    from eaglet.data.target_model import materialise

    built = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            materialise({"name": f"tiny-{family}", "tiny": {"family": family, "num_hidden_layers": 2}}, out)
            built[family] = out / "identity.json"
        return built[family]

    return get


# --------------------------------------------------------------------------- vLLM (envs/vllm)
VLLM_ENV = REPO / "envs" / "vllm" / ".venv"


def vllm_env_or_skip():
    """Path of the vLLM venv; skips the test when envs/vllm/setup.sh has not (completely) run."""
    from eaglet.engines import vllm_env

    try:
        vllm_env.vllm_python(VLLM_ENV)
    except vllm_env.VllmEnvMissing as e:
        pytest.skip(f"{e} (to enable the vLLM tests)")
    return VLLM_ENV


# --------------------------------------------------------------------------- SGLang (envs/sglang)
def sglang_env_or_skip():
    """The interpreter of SGLang's environment (envs/sglang/.venv, or $EAGLET_SGLANG_PYTHON); skips the
    test when envs/sglang/setup.sh has not (completely) run. Under CI the skip is a failure."""
    from eaglet.export.contract import sglang_check

    try:
        return sglang_check.sglang_python()
    except sglang_check.SglangEnvMissing as e:
        pytest.skip(f"{e} (to enable the SGLang loader tests)")


@pytest.fixture(scope="session")
def vllm_tiny_server(tiny_target, tmp_path_factory):
    """One real vLLM (CPU build) OpenAI server on the tiny target, shared by the whole session."""
    import time

    from eaglet.engines import vllm_server

    env = vllm_env_or_skip()
    work = tmp_path_factory.mktemp("vllm_tiny")
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(vllm_server.serve(tiny_target["path"], work_dir=work, env=env,
                                                    served_model_name="tiny", max_model_len=1024, kv_cache_gb=1,
                                                    startup_timeout_s=900))
        srv.startup_s = time.monotonic() - t0
        print(f"\n[vllm_tiny_server] healthy after {srv.startup_s:.0f} s at {srv.base_url}")
        _UNIT_CLOSERS["vllm_tiny_server"] = stack
        yield srv


# Under xdist the modules that share a session fixture run one after another on one worker (one work
# unit, tests/suite_schedule.py): a fixture holding a running process (the tiny vLLM server) is stopped
# when its unit ends instead of idling to the end of the worker's run.
_UNIT_CLOSERS: dict[str, contextlib.ExitStack] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if not (XDIST_WORKER and nextitem is not None):
        return
    done = suite_schedule.unit_of(item.nodeid)
    if done == suite_schedule.unit_of(nextitem.nodeid):
        return
    for fx in [fx for fx in _UNIT_CLOSERS if fx == done]:
        _UNIT_CLOSERS.pop(fx).close()
        print(f"\n[{fx}] stopped: its work unit is done")


def make_random_drafter(identity: dict, path, draft_vocab_size: int = 1024, layer_ids=(2, 4, 5),
                        seed: int = 0, **variants):
    """A random drafter in the trainer's file format (eaglet.drafter.eagle3.save_drafter) for the tiny
    target: norms perturbed away from 1 so the numeric parity check sees every weight.
    ``variants``: DrafterConfig variant flags (norm_before_fc=True, ...)."""
    import torch

    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter, save_drafter
    from eaglet.target.load import load_target_embedding

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_identity(identity, draft_vocab_size=draft_vocab_size,
                                      layer_ids=list(layer_ids), **variants)
    m = Eagle3Drafter(cfg, load_target_embedding(identity["path"]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    used = torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    save_drafter(path, m, cfg, used - torch.arange(draft_vocab_size), t2d)
    return path


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target, tmp_path_factory):
    """A random drafter.safetensors (trainer format, V_d 1024, layer ids [2, 4, 5]) for tiny_target."""
    from eaglet.base.digests import DIGESTS_KEY, record_digests
    from eaglet.base.files import write_json

    path = make_random_drafter(tiny_target, tmp_path_factory.mktemp("tiny_drafter") / "drafter.safetensors")
    # the digest record the train stage writes beside its drafter (the export/evaluate CLIs check it)
    write_json(path.with_name("train_summary.json"), {DIGESTS_KEY: record_digests(path.parent, [path.name])})
    return path


def slowed_trainer(cmd: list[str], seconds: float) -> list[str]:
    """``python -m eaglet.train.train ...`` sleeping ``seconds`` per optimizer step, so a test can kill it
    mid-way: the pause wraps the LR scheduler's step from outside (no test hook in the trainer)."""
    code = ("import sys, time\n"
            "from torch.optim.lr_scheduler import LambdaLR\n"
            "step = LambdaLR.step\n"
            f"LambdaLR.step = lambda self, *a: (time.sleep({seconds}), step(self, *a))[1]\n"
            "from eaglet.train.train import main\n"
            "main(sys.argv[1:])\n")
    assert cmd[1:3] == ["-m", "eaglet.train.train"], cmd
    return [cmd[0], "-c", code, *cmd[3:]]


def kill_when_written(cmd: list[str], path: Path, timeout: float, env: dict | None = None) -> None:
    """Run ``cmd``, and kill -9 it as soon as ``path`` exists (fails if it ends or times out first)."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"run ended before writing {path.name}"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
