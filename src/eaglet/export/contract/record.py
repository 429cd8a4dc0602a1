"""A contract check's record, its names, and the verdict over all of them (eaglet.export.contract).

Each check is a pass, a FAIL, or **not run** (``ok: null``, with the reason). A check that did not run
is not a pass: the contract is ``ok`` only when nothing failed and every check that did not run is
named in ``accept_not_run`` (the config key ``export.accept_not_run``).
"""

from __future__ import annotations

TRAINED_VLLM_CHECKS = ("vllm.load_run", "vllm.lossless", "vllm.aux_layers", "vllm.shared_weights",
                       "vllm.acceptance")
# eaglet.export.contract.known_answer: a drafter whose first draft is right by construction, on a twin of the target
KNOWN_ANSWER = "vllm.known_answer"
VLLM_CHECKS = TRAINED_VLLM_CHECKS + (KNOWN_ANSWER,)
STATUS = {True: "pass", False: "FAIL", None: "not run"}
ACCEPT_KEY = "export.accept_not_run"


def check(name: str, ok: bool | None, details=None) -> dict:
    """A check's record. ``ok`` None means the check did not run: its reason is ``details["not_run"]``
    (or the older spelling ``details["skipped"]``) and it is no pass (see the module docstring)."""
    details = details if details is not None else {}
    ch = {"name": name, "ok": ok, "status": STATUS[ok], "details": details}
    if ok is None:
        ch["reason"] = str(details.get("not_run") or details.get("skipped") or "no reason recorded")
    return ch


def not_run(name: str, reason: str) -> dict:
    return check(name, None, {"not_run": reason})


def status_line(ch: dict) -> str:
    """One log line per check: pass / FAIL / NOT RUN (with the reason, and whether it is accepted)."""
    if ch["ok"] is None:
        how = f"accepted by {ACCEPT_KEY}" if ch.get("accepted") else f"not accepted: {ACCEPT_KEY}"
        return f"{ch['name']:<24} NOT RUN ({ch.get('reason')}; {how})"
    return f"{ch['name']:<24} {STATUS[ch['ok']]}"



def verdict(checks: list[dict], accept_not_run=()) -> dict:
    """The aggregation: failed checks, checks that did not run (each marked accepted or not), and
    ``ok`` = nothing failed and every check that did not run is accepted by name."""
    accept = set(accept_not_run or ())
    for ch in checks:
        if ch["ok"] is None:
            ch["accepted"] = ch["name"] in accept
    missing = [ch for ch in checks if ch["ok"] is None]
    out = {"failed": [ch["name"] for ch in checks if ch["ok"] is False],
           "not_run": [{"name": ch["name"], "reason": ch["reason"], "accepted": ch["accepted"]} for ch in missing],
           "not_run_unaccepted": [ch["name"] for ch in missing if not ch["accepted"]],
           "accept_not_run": sorted(accept)}
    out["ok"] = not out["failed"] and not out["not_run_unaccepted"]
    return out


def failure_errors(checks: list[dict]) -> dict[str, str]:
    """The error text each failed check recorded (``details.error``: an exception, the engine's
    own error lines), by check name: the top of a failure record, and its message."""
    return {ch["name"]: str(ch["details"]["error"]) for ch in checks
            if ch["ok"] is False and isinstance(ch.get("details"), dict) and ch["details"].get("error")}
