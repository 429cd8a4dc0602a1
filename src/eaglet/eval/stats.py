"""Statistics of the evaluation figures: bootstrap intervals over prompts, an honest verdict on
whether an interval allows a conclusion, the break-even acceptance length of a draft length, and the
two-proportion test that compares vLLM's acceptance counts with the offline simulator's.
Also the results matrix every evaluation stage writes (one row per engine, temperature, k, set and
domain) and its table.

Why prompts are the unit: rounds and repeated timings of one prompt are not independent (a prompt
the drafter knows well gives long accepted runs all along; a background job slows every repeat
of a few seconds), so intervals resample whole prompts (a cluster bootstrap), seeded, so the same
artifacts give the same interval.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from statistics import NormalDist

import numpy as np

BOOTSTRAP_SAMPLES = 2000
SEED = 0
# Timings are not trusted when other processes kept more than this share of the machine's CPU
# busy while they were taken: paired timing cancels a steady slowdown, not contention, which hits
# the speculative loop's many small operations (thread wake-ups, synchronisation) far harder than
# plain greedy's (measured: a speedup of 0.65 read 0.12 beside a 2-thread job on 2 cores).
BUSY_SHARE = 0.25


def _cpus() -> list[int]:
    """The CPUs this process may run on (all where affinity is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _cpu_busy_s(cpus: list[int]) -> float | None:
    """Seconds the given CPUs spent busy since boot (their /proc/stat lines), None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    want, busy, seen = {f"cpu{c}" for c in cpus}, 0, 0
    for line in lines:
        f = line.split()
        if f and f[0] in want:
            v = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(v) - v[3] - v[4]
            seen += 1
    return busy / os.sysconf("SC_CLK_TCK") if seen else None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """The share of this process's CPUs (its affinity: a cluster job's cores, not the whole node)
    that other processes used between ``start()`` and ``stop()``: (their busy seconds - this
    process's CPU seconds) / (wall seconds x CPUs)."""

    def __init__(self):
        self.t0 = self.busy0 = self.own0 = None
        self.cpu_ids = _cpus()

    def start(self) -> OtherLoad:
        self.t0, self.busy0, self.own0 = time.monotonic(), _cpu_busy_s(self.cpu_ids), _own_cpu_s()
        return self

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        busy = _cpu_busy_s(self.cpu_ids)
        cpus = len(self.cpu_ids)
        if busy is None or self.busy0 is None or wall <= 0:
            return {"other_cpu_share": None, "cpus": cpus, "busy": None, "threshold": BUSY_SHARE,
                    "note": "other processes' CPU use not measured (no /proc/stat)"}
        other = max(0.0, (busy - self.busy0) - (_own_cpu_s() - self.own0)) / (wall * cpus)
        busy_flag = other > BUSY_SHARE
        return {"other_cpu_share": round(other, 4), "cpus": cpus, "busy": busy_flag, "threshold": BUSY_SHARE,
                "note": (f"other processes used {100 * other:.0f}% of the {cpus} CPUs while the timings were "
                         f"taken: {'too busy to trust them' if busy_flag else 'quiet enough'}")}


def busy_verdict(ci: dict, load: dict) -> dict:
    """A timing interval's verdict, not conclusive when the machine was busy (``OtherLoad``)."""
    if not load.get("busy"):
        return ci
    return {**ci, "conclusive": False, "note": f"{ci['note']}; not conclusive: {load['note']}"}


# --------------------------------------------------------------------------- bootstrap
def bootstrap(groups: list, stat, level: float = 0.95, n_boot: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> dict:
    """Percentile interval of ``stat(groups)`` from resampling the groups (prompts) with
    replacement. ``stat`` maps a list of groups to a float (None when undefined). With fewer than
    two groups there is no interval (lo = hi = None)."""
    est = stat(groups)
    out = {"estimate": est, "lo": None, "hi": None, "level": level, "n": len(groups),
           "bootstrap": n_boot, "seed": seed}
    if est is None or len(groups) < 2:
        return out
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(groups), size=(n_boot, len(groups)))
    vals = [v for v in (stat([groups[i] for i in row]) for row in idx) if v is not None]
    if not vals:
        return out
    a = (1 - level) / 2
    out["lo"], out["hi"] = (float(x) for x in np.quantile(vals, [a, 1 - a]))
    return out


def pooled_tau(groups: list[tuple[int, int]]) -> float | None:
    """τ of prompts pooled: 1 + Σ accepted / Σ rounds with drafts; a group = (accepted, rounds)."""
    rounds = sum(g[1] for g in groups)
    return 1 + sum(g[0] for g in groups) / rounds if rounds else None


def median(groups: list[float]) -> float | None:
    return float(np.median(groups)) if len(groups) else None


def tau_interval(per_prompt: list[tuple[int, int]], level: float = 0.95, max_rel_width: float = 0.5) -> dict:
    """τ with its interval over prompts; ``per_prompt`` = (accepted, rounds with drafts) each."""
    ci = bootstrap([g for g in per_prompt if g[1]], pooled_tau, level)
    return {**ci, **verdict(ci, "τ", null=None, max_rel_width=max_rel_width)}


def speedup_interval(per_prompt: list[float], level: float = 0.95, max_rel_width: float = 0.5) -> dict:
    """Median over prompts of each prompt's median paired speedup, with its interval over prompts."""
    ci = bootstrap(list(per_prompt), median, level)
    return {**ci, **verdict(ci, "speedup", null=1.0, max_rel_width=max_rel_width)}


def verdict(ci: dict, what: str, null: float | None, max_rel_width: float) -> dict:
    """Whether the interval allows a conclusion, and a sentence that says so.

    Not conclusive when there is no interval (fewer than two prompts), when it contains ``null``
    (for a speedup, 1.0: it cannot tell faster from slower), or when its width exceeds
    ``max_rel_width`` times the estimate (the figure is mostly noise)."""
    est, lo, hi = ci["estimate"], ci["lo"], ci["hi"]
    if est is None:
        return {"conclusive": False, "note": f"{what}: nothing measured"}
    if lo is None:
        return {"conclusive": False, "note": f"{what} {est:.3g} from {ci['n']} prompt(s): no interval, not conclusive"}
    band = f"{what} {est:.3g} ({100 * ci['level']:.0f}% CI {lo:.3g}-{hi:.3g}, {ci['n']} prompts)"
    if null is not None and lo <= null <= hi:
        return {"conclusive": False, "note": f"{band} spans {null:g}: cannot tell whether it is above or below"}
    if hi - lo > max_rel_width * abs(est):
        return {"conclusive": False,
                "note": f"{band} is wider than {max_rel_width:g} x the estimate: too noisy to conclude"}
    return {"conclusive": True, "note": band}


# --------------------------------------------------------------------------- cost model
def break_even_tau(t_verify: float, k: int, t_draft: float, t_step: float) -> float:
    """The τ at which speculation with k drafts breaks even: one round costs a verify forward of
    k+1 tokens and k drafter steps and emits τ tokens; plain decoding emits one token per step."""
    return (t_verify + k * t_draft) / t_step


# --------------------------------------------------------------------------- vLLM vs offline
def two_proportion_z(a1: int, n1: int, a2: int, n2: int) -> float | None:
    """z of the difference of two acceptance proportions a1/n1 and a2/n2 (pooled variance); None
    when a side has no drafts."""
    if not n1 or not n2:
        return None
    p = (a1 + a2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:  # both 0 % or both 100 %: equal
        return 0.0
    return (a1 / n1 - a2 / n2) / se


def z_critical(alpha: float, m: int) -> float:
    """Two-sided critical |z| at family-wise level ``alpha`` over ``m`` tests (Bonferroni)."""
    return NormalDist().inv_cdf(1 - alpha / (2 * max(m, 1)))


# --------------------------------------------------------------------------- the results matrix
# One row per engine x temperature x k x set x domain, written by every evaluation stage (offline.json,
# speculative.json, vllm.json: a list ``matrix``) and concatenated by eaglet.eval.eval_summary. engine:
# "chain" (the exact greedy chain offline, T = 0), "expected" (Σ min(p, q) offline, T > 0),
# "hf_loop" (measured in the HF loop), "vllm" (measured in vLLM). ``set``/``domain`` are ALL for
# the rows over a whole set or over every prompt; ``ci`` is [lo, hi] over prompts or null. ``rule``:
# how drafts are made and accepted, by vLLM's draft_sample_method (eaglet.drafter.chain.ACCEPT):
# "greedy" (argmax q, accepted with probability p(draft); at T = 0 every engine's chain),
# "probabilistic" (sampled from q, accepted with min(1, p/q): the HF loop at T > 0). A consumer
# that keys rows by engine, temperature, k, set and domain keys them by the rule too: at T > 0 the
# expected chain and vLLM have a row per rule.
MATRIX_KEYS = ("engine", "temperature", "k", "set", "domain", "tau", "ci", "prompts", "rule")
ALL = "all"


def matrix_row(engine: str, temperature: float, k: int, set_name: str, domain: str, interval: dict | None,
               prompts: int, rule: str | None = None) -> dict:
    """One matrix row from a τ interval (:func:`tau_interval`'s dict, or None when nothing was
    measured). ``rule``: required at T > 0; at T = 0 drafting is greedy whatever the setting."""
    if rule is None:
        if temperature > 0:
            raise ValueError(f"{engine} at T={temperature:g}: a row at T > 0 names its rule (greedy or probabilistic)")
        rule = "greedy"
    iv = interval or {}
    lo, hi = iv.get("lo"), iv.get("hi")
    return {"engine": engine, "temperature": float(temperature), "k": int(k), "set": set_name, "domain": domain,
            "tau": iv.get("estimate"), "ci": [lo, hi] if lo is not None and hi is not None else None,
            "prompts": int(prompts), "rule": rule}


def matrix_rows(engine: str, temperature: float, ks: list[int], overall: dict, sets: dict, domains: dict,
                rule: str | None = None) -> list[dict]:
    """The rows of one engine at one temperature (and rule: :func:`matrix_row`): every prompt, each
    set, each domain. Each of ``overall``, ``sets[name]``, ``domains[name]`` is {"prompts": n,
    "tau": {k: interval}} (a domain also names its "set"); intervals keyed by int or str k."""
    def iv(d, k):
        t = d.get("tau") or {}
        return t.get(k, t.get(str(k)))

    rows = [matrix_row(engine, temperature, k, ALL, ALL, iv(overall, k), overall["prompts"], rule) for k in ks]
    rows += [matrix_row(engine, temperature, k, s, ALL, iv(v, k), v["prompts"], rule)
             for s, v in sets.items() for k in ks]
    rows += [matrix_row(engine, temperature, k, v["set"], d, iv(v, k), v["prompts"], rule)
             for d, v in domains.items() for k in ks]
    return rows


def matrix_table(rows: list[dict]) -> str:
    """The matrix as a text table, one line per domain x k x T x engine, sorted in that order."""
    head = (f"{'set':<12} {'domain':<22} {'k':>2} {'T':>4} {'engine':<9} {'rule':<13} {'tau':>6}  {'interval':<13} "
            "prompts")
    order = {"chain": 0, "expected": 1, "regen": 2, "hf_loop": 3, "vllm": 4}
    lines = [head]
    for r in sorted(rows, key=lambda r: (str(r["set"]) == ALL, str(r["set"]), str(r["domain"]) != ALL,
                                         str(r["domain"]), r["k"], r["temperature"], order.get(r["engine"], 9),
                                         str(r["engine"]), str(r.get("rule")))):
        tau = "n/a" if r.get("tau") is None else f"{r['tau']:.3f}"
        ci = "-" if not r.get("ci") else f"{r['ci'][0]:.2f}-{r['ci'][1]:.2f}"
        lines.append(f"{str(r['set'])[:12]:<12} {str(r['domain'])[:22]:<22} {r['k']:>2} {r['temperature']:>4g} "
                     f"{r['engine']:<9} {str(r.get('rule')):<13} {tau:>6}  {ci:<13} {r.get('prompts')}")
    return "\n".join(lines)
