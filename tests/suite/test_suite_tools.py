"""The suite's own tools: the work units and their order (tests/suite_schedule.py), the time ledger
(scripts/suite_ledger.py) and the generated list of checks (scripts/list_checks.py)."""

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest

import suite_schedule
from conftest import REPO


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _item(nodeid, *fixtures):
    return SimpleNamespace(nodeid=nodeid, _nodeid=nodeid, fixturenames=list(fixtures))


def test_a_module_naming_a_shared_fixture_is_in_its_unit_and_the_others_are_their_own():
    server, run = suite_schedule.SHARED_FIXTURES
    # the modules that use them today, read from their files (by fixture argument or getfixturevalue)
    for module in ("tests/generate/test_generate.py", "tests/faults/test_faults_network.py",
                   "tests/engines/test_vllm_server.py"):
        assert suite_schedule.unit_of(f"{module}::t[p]") == server, module
    for module in ("tests/workflow/test_workflow.py", "tests/workflow/test_rerun_table.py",
                   "tests/report/test_card.py", "tests/workflow/test_slurm.py"):
        assert suite_schedule.unit_of(f"{module}::t") == run, module
    assert suite_schedule.unit_of("tests/train/test_train.py::t") == "tests/train/test_train.py"
    assert suite_schedule.unit_of("tests/nowhere/test_gone.py::t") == "tests/nowhere/test_gone.py"


class _Node:
    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent.append(indices)

    def shutdown(self):
        self.shutting_down = True


def _scheduled(pytestconfig, monkeypatch, timings, ids, unit_of=None):
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"], raising=False)  # two workers expected
    sched = suite_schedule.make_scheduler(pytestconfig, None)
    sched.timings = timings
    if unit_of:
        monkeypatch.setattr(suite_schedule, "unit_of", unit_of)
    nodes = [_Node("gw0"), _Node("gw1")]
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, ids)
    sched.schedule()
    return sched, nodes


def test_the_scheduler_hands_out_the_longest_units_first(pytestconfig, monkeypatch):
    pytest.importorskip("xdist")
    ids = ["tests/a/test_short.py::s", "tests/b/test_long.py::l1", "tests/b/test_long.py::l2",
           "tests/b/test_long.py::l3", "tests/c/test_mid.py::m", "tests/d/test_new.py::n",
           "tests/e/test_tail.py::t"]  # unit u: mid + a new module (30 s)
    sched, nodes = _scheduled(pytestconfig, monkeypatch,
                              {"tests/a/test_short.py": 5.0, "tests/b/test_long.py": 600.0,
                               "tests/c/test_mid.py": 100.0, "tests/e/test_tail.py": 1.0}, ids,
                              lambda n: "u" if "mid" in n or "new" in n else suite_schedule.module_of(n))
    # the long module to one worker, the 130-second unit to the other, which (two tests: nearly done)
    # is given the next longest at once; the shortest waits for the first worker nearly done
    assert nodes[0].sent == [[1, 2, 3]] and nodes[1].sent == [[4, 5], [0]]
    assert list(sched.workqueue) == ["tests/e/test_tail.py"] and not any(n.shutting_down for n in nodes)


def test_a_worker_given_a_one_test_unit_is_given_a_second_at_once(pytestconfig, monkeypatch):
    """A worker runs a test once it knows the next (or is told to stop): with one test and nothing
    more it would wait out the run (`make test-fast` ran on one of its two workers so)."""
    pytest.importorskip("xdist")
    ids = ["tests/a/test_short.py::s", "tests/b/test_long.py::l", "tests/c/test_mid.py::m"]
    sched, nodes = _scheduled(pytestconfig, monkeypatch, {"tests/a/test_short.py": 5.0, "tests/b/test_long.py": 600.0,
                                                          "tests/c/test_mid.py": 100.0}, ids)
    assert nodes[0].sent == [[1], [0]] and nodes[1].sent == [[2]]
    # nothing left: both told to stop, each runs what it holds and ends
    assert not sched.workqueue and all(n.shutting_down for n in nodes)


def test_the_ledger_names_a_folder_over_its_budget_and_one_without_a_line(tmp_path):
    led = _script("suite_ledger")
    durations = {"tests/a/test_x.py::t": 120.0, "tests/a/test_y.py::t": 60.0, "tests/b/test_z.py::t": 30.0,
                 "tests/new/test_n.py::t": 6.0}
    budget = {"folders": {"tests/a": 2, "tests/b": 1}, "total": {"make_test_minutes": 3, "ci_minutes": 4}}
    lines, over = led.ledger(durations, budget, wall_s=150, installs_s=60)
    assert over == ["tests/a", "tests/new"]
    text = "\n".join(lines)
    assert "OVER by 1.0 min" in text and "NO BUDGET LINE" in text
    _, over = led.ledger(durations, budget, wall_s=200, installs_s=60)
    assert over[-2:] == ["make test", ".ci/run in all"]
    bad = tmp_path / "budget.toml"
    bad.write_text('[folders]\n"tests/a" = 0\n')
    with pytest.raises(ValueError, match="positive minutes"):
        led.read_budget(bad)


def test_every_test_folder_has_a_budget_line():
    led = _script("suite_ledger")
    folders = {str(p.parent.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    assert folders <= set(led.read_budget()["folders"]), folders - set(led.read_budget()["folders"])


def test_a_test_that_left_the_suite_must_name_its_replacement():
    lc = _script("list_checks")
    listed = {"tests/a.py::old": "x", "tests/a.py::kept": "y"}
    now = [("tests/a.py::kept", "y"), ("tests/a.py::new", "z")]
    bad = lc.problems(listed, now, {})
    assert any("tests/a.py::old: gone from the suite" in b for b in bad)
    assert not any("gone" in b for b in lc.problems(listed, now, {"tests/a.py::old": "tests/a.py::new\tmerged"}))
    bad = lc.problems(listed, now, {"tests/a.py::old": "tests/a.py::nowhere\tmerged"})
    assert any("names 'tests/a.py::nowhere', which is not in the suite" in b for b in bad)


def test_the_committed_list_of_checks_is_the_suites():
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "list_checks.py"), "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_machine_speed_line_that_ci_prints_before_and_after_the_tests():
    """scripts/cpu_speed.py (.ci/run prints it around the tests): one line with both figures, in ranges a
    real CPU gives (one core's fp32 products; an interpreter importing torch)."""
    import re

    out = subprocess.run([sys.executable, str(REPO / "scripts/cpu_speed.py"), "--seconds", "0.2", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    m = re.fullmatch(r"cpu_speed: matmul ([\d.]+) GFLOP/s \(fp32, one thread\), start ([\d.]+) s "
                     r"\(python \+ import torch\)\n", out)
    assert m, out
    assert 1 < float(m[1]) < 5000 and 0.05 < float(m[2]) < 60, out
