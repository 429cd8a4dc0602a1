"""How `make test` spreads the suite over the machine's cores (pytest-xdist, one worker a core).

A work unit is a test module, or several modules that share an expensive session fixture (the
tiny vLLM server: one engine start, shared, instead of one per worker). Module fixtures therefore run
once, as they do without xdist. Units go out longest first (the module times recorded in
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

TIMINGS = Path(__file__).resolve().parent / "timings.json"
UNKNOWN_S = 30.0
# Session fixtures worth building once for the whole run (the tiny vLLM server: an engine start;
# the finished smoke run: a whole DAG): every module using one is in one work unit
SHARED_FIXTURES = ("vllm_tiny_server", "finished_run")
GROUP_SEP = "@"
# Shared fixture -> the unit it belongs to in this run (filled by ``units``)
FIXTURE_UNITS: dict[str, str] = {}


def module_of(nodeid: str) -> str:
    """``tests/x/test_y.py::test_z[p]@unit`` -> ``tests/x/test_y.py``."""
    return nodeid.split("::", 1)[0]


def _split(nodeid: str) -> tuple[str, str | None]:
    """``(test id, work unit)``; the unit is None on an id without one. An ``@`` inside a
    parameter's brackets is part of the id (the rule pytest-xdist's loadgroup uses)."""
    at = nodeid.rfind(GROUP_SEP)
    if at > nodeid.rfind("]") and at > nodeid.rfind("::"):
        return nodeid[:at], nodeid[at + 1:]
    return nodeid, None


def unit_of(nodeid: str) -> str | None:
    """The work unit a tagged test id names (None on an untagged id)."""
    return _split(nodeid)[1]


def bare(nodeid: str) -> str:
    """The test id without the work unit's suffix (what the user types, what logs list)."""
    return _split(nodeid)[0]


def units(items) -> dict[str, str]:
    """Module path -> work unit name: a module is its own unit unless a test in it uses a shared
    session fixture; modules that share one (transitively) are one unit, named after the fixture."""
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for item in items:
        mod = module_of(item.nodeid)
        find(mod)
        for fx in SHARED_FIXTURES:
            if fx in getattr(item, "fixturenames", ()) or fx in _source(item):
                a, b = find(mod), find(fx)
                if a != b:
                    # name the merged unit after the fixture (a name without "/")
                    parent[a if "/" in a else b] = b if "/" in a else a
    FIXTURE_UNITS.update({fx: find(fx) for fx in SHARED_FIXTURES if fx in parent})
    return {m: find(m) for m in parent if "/" in m}


_SOURCES: dict[str, str] = {}


def _source(item) -> str:
    """The module's text: a test may ask for the fixture by name (``request.getfixturevalue``)."""
    path = str(getattr(item, "path", "") or "")
    if path not in _SOURCES:
        try:
            _SOURCES[path] = Path(path).read_text() if path else ""
        except OSError:
            _SOURCES[path] = ""
    return _SOURCES[path]


def tag(items) -> None:
    """Suffix each test id with its work unit (read back by ``WeightedScheduling``)."""
    by_module = units(items)
    for item in items:
        item._nodeid = f"{item.nodeid}{GROUP_SEP}{by_module[module_of(item.nodeid)]}"


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
        """LoadScope over the units of ``tag``, handed out longest first."""

        timings = load_timings()

        def _split_scope(self, nodeid: str) -> str:
            test, unit = _split(nodeid)
            return unit or module_of(test)

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
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return WeightedScheduling(config, log)
