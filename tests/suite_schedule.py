"""How `make test` spreads the suite over the machine's cores (pytest-xdist, one worker a core).

A work unit is a test module, or all the modules that share an expensive session fixture (the tiny
vLLM server: one engine start instead of one per worker; the finished smoke run: one DAG run). Module
fixtures therefore run once, as they do without xdist. A module's unit is read from its file (the
fixture's name in its text: a test may also ask for it by ``request.getfixturevalue``), by the
controller and the workers alike: pytest 9 derives a test's id from its collection address, so a
unit cannot travel as a suffix of the id (pytest-xdist's own ``loadgroup`` does that, and is a no-op
there). Units go out longest first (the module times recorded in
``tests/timings.json`` from an earlier run, ``scripts/suite_ledger.py --record``), so the long
end-to-end modules start at once and the short ones fill the gaps: the run's wall time is close to
the longest unit or to half the total, whichever is larger. A module missing from the record
(a new one) weighs ``UNKNOWN_S``.

Every worker is given one torch thread (``OMP_NUM_THREADS=1``, inherited by the Snakemake, trainer
and engine processes its tests start): two workers with two threads each would spin-wait each other
on two cores.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = Path(__file__).resolve().parent / "timings.json"
UNKNOWN_S = 30.0
# Session fixtures worth building once for the whole run (the tiny vLLM server: an engine start;
# the finished smoke run: a whole DAG): every module that names one is in its work unit. A module
# naming two joins the first (the second is then built once more, on its worker: correct, slower).
SHARED_FIXTURES = ("vllm_tiny_server", "finished_run")
_SOURCES: dict[str, str] = {}


def module_of(nodeid: str) -> str:
    """``tests/x/test_y.py::test_z[p]`` -> ``tests/x/test_y.py``."""
    return nodeid.split("::", 1)[0]


def _source(module: str) -> str:
    if module not in _SOURCES:
        try:
            _SOURCES[module] = (ROOT / module).read_text()
        except OSError:
            _SOURCES[module] = ""
    return _SOURCES[module]


def unit_of(nodeid: str) -> str:
    """The work unit of a test: the first shared fixture its module names, else its module."""
    module = module_of(nodeid)
    text = _source(module)
    return next((fx for fx in SHARED_FIXTURES if fx in text), module)


def load_timings(path: Path = TIMINGS) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text())["modules"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def make_scheduler(config, log):
    """The xdist scheduler (``pytest_xdist_make_scheduler``), imported lazily: xdist is a dev
    dependency, and a plain ``pytest`` run must not need it."""
    from xdist.scheduler.loadscope import LoadScopeScheduling

    class WeightedScheduling(LoadScopeScheduling):
        """LoadScope over the units of ``unit_of``, handed out longest first."""

        timings = load_timings()

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def weight(self, nodeids) -> float:
            mods = {module_of(n) for n in nodeids}
            return sum(self.timings.get(m, UNKNOWN_S) for m in mods)

        def schedule(self) -> None:
            if self.collection is not None or not self.collection_is_completed:
                return super().schedule()
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            found: dict[str, dict[str, bool]] = OrderedDict()
            for nodeid in self.collection:
                found.setdefault(self._split_scope(nodeid), OrderedDict())[nodeid] = False
            for scope in sorted(found, key=lambda s: -self.weight(found[s])):
                self.workqueue[scope] = found[scope]
            for _ in range(max(0, len(self.nodes) - len(self.workqueue))):
                node, _assigned = self.assigned_work.popitem()
                node.shutdown()
            for node in self.nodes:  # one unit each; the next one when a node is nearly done
                self._assign_work_unit(node)
            # and a second where the first is short (as xdist's own LoadScope does, its #277): a worker
            # runs a test only once it knows the next one (or is told to stop), so a node given a
            # one-test unit would wait for the whole run with it (test-fast ran on one worker so)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return WeightedScheduling(config, log)
