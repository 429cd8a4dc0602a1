"""The export contract: does an exported drafter directory load and run the way we trained it?

"vLLM loads it" proves little (docs/eagle3.md §9): a missing ``fc.weight`` runs on uninitialised memory,
a missing ``lm_head`` borrows the target's rows, a missing ``d2t`` becomes identity, SGLang drops
names it does not know. So every export is checked four ways, each recorded in ``contract.json``
(and a directory checked alone, without the trainer's file, a fifth: ``reference.*``, below):

1. static   — exact key set, shapes, dtypes, the d2t/t2d vocabulary map, layer ids, config fields;
2. loaders  — vLLM's weight-name mapping replayed, and SGLang's own loader run (its drafter class and
              load_weights, in its environment envs/sglang: eaglet.export.contract.sglang_check): every parameter
              written exactly once and equal to the export, no weight name dropped without a word;
3. parity   — an independent reference forward written here from vLLM's semantics reproduces the
              trainer's (``eaglet.drafter.eagle3``) step-0 logits and pre-norm hidden within 1e-4 in fp32;
4. vllm     — the real thing: vLLM-CPU loads target + drafter, output equals plain greedy, the aux
              layers it reports equal the trained ones, its acceptance equals eaglet's exact chain
              along the same text (eaglet.export.contract.reference.agreement: no slack but near ties). First,
              ``vllm.known_answer`` (eaglet.export.contract.known_answer): a drafter written by the same writer with
              the trained layer ids, whose first draft is right by construction on a twin of the
              target, must have ~every first draft accepted (a wrong layer id, d2t, norm or fc
              reading in the engine drops that to ~0).

Each check is a pass, a FAIL, or **not run** (``ok: null``, with the reason). A check that did not run
is not a pass: the contract is ``ok`` only when nothing failed and every check that did not run is
named in ``accept_not_run`` (the config key ``export.accept_not_run``); the report still lists it as
not run. The real-vLLM checks (``VLLM_CHECKS``) are listed as not run when the vLLM run is off, and
those after ``vllm.load_run`` when it failed; ``loader.sglang`` is not run when SGLang's environment is
missing (``make sglang-env`` builds it) or when it is left out (``--no-sglang``). Checks that do not
apply to a format are not listed for it: SGLang loads format A only, so format B's contract has no
``loader.sglang`` (format A's, written by the same export, has it).

    python -m eaglet.export.contract results/run/drafter --identity resources/targets/x/identity.json \
        [--trained results/run/train/drafter.safetensors] [--vllm [--vllm-python VENV]] [--no-sglang] \
        [--out contract.json] [--work-dir DIR]

Without ``--trained`` (a directory as a user who downloads it has it), the directory proves itself by
the ``reference.json`` the export wrote (eaglet.export.contract.reference): ``reference.weights`` (every tensor's
sha256), ``reference.chain`` (eaglet's drafting with these weights on the recorded prompts and text
proposes the recorded drafts), ``parity.step0`` against eaglet's model on the same weights, and with
``--vllm`` vLLM's acceptance against the recorded chain. A copy with permuted ``lm_head`` rows or ``fc``
blocks fails them.

The four kinds of check live beside this module in eaglet.export.contract: static_checks, loaders and
sglang_check, parity and vllm_checks; a check's record and the verdict in record. This module runs them
all (``python -m eaglet.export.contract`` runs its main).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglet.base.files import read_json, write_json
from eaglet.base.logs import setup_logging
from eaglet.engines import vllm_env
from eaglet.export.contract import reference, vllm_checks
from eaglet.export.contract.loaders import emulate_vllm
from eaglet.export.contract.parity import parity_check
from eaglet.export.contract.record import (
    KNOWN_ANSWER,
    VLLM_CHECKS,
    check,
    failure_errors,
    not_run,
    status_line,
    verdict,
)
from eaglet.export.contract.sglang_check import sglang_check
from eaglet.export.contract.static_checks import effective_config, read_export, static_checks, trained_config

log = logging.getLogger("eaglet.export.contract")
# a directory checked alone (no trainer's file): its reference.json proves it (eaglet.export.contract.reference)
REFERENCE_CHECKS = ("reference.weights", "reference.chain")


def check_export(drafter_dir: str | Path, identity: dict, *, trained_path: str | Path | None = None,
                 vllm: dict | None = None, train_summary: str | Path | dict | None = None,
                 accept_not_run=(), k: int | None = None, target_load: dict | None = None,
                 chain_size: tuple[int, int] = (4, 32), sglang: bool = True) -> dict:
    """Run every check on an exported directory; return the report: ``ok`` False if any failed or
    did not run without being named in ``accept_not_run``. ``vllm``: None to not run the real
    vLLM checks (they are then listed as not run), else kwargs for :func:`vllm_checks.vllm_checks`
    (``work_dir`` required). ``k``: drafts per round the export is for (default: vllm's ``k``, 3),
    the k of the trainer's chain τ recorded (and gating vllm.acceptance). ``target_load``: dtype, device,
    trust_remote_code of the in-process HF target (eaglet's chain); ``chain_size``: (prompts, tokens) of
    the chain recorded for reference.json when vLLM does not run (else vLLM's own). ``sglang``: False
    to leave SGLang's own loader out (``loader.sglang`` is then listed as not run, and fails the report
    unless accepted by name): for a quick look at a directory, and for tests whose claim is another check's.

    With the trainer's file (``trained_path``, the export stage), a passing format-A report carries
    ``reference_chain``, which the export writes into reference.json (eaglet.export.contract.reference). Without
    it (a directory checked alone), the checks ``reference.weights`` and ``reference.chain`` prove the
    directory against that record, and vllm.acceptance compares vLLM with the recorded chain."""
    trained = trained_config(trained_path) if trained_path else None
    conf, header = read_export(drafter_dir)
    fmt, _ = effective_config(conf)
    with ThreadPoolExecutor(1) as pool:
        # SGLang's loader runs in its own process (about 8 s, most of it importing SGLang): beside the
        # in-process checks below, not before them. SGLang is given format A only: format B has no SGLang check.
        sglang_run = pool.submit(sglang_check, drafter_dir, conf) if fmt == "A" and sglang else None
        checks = _guarded("static", lambda: static_checks(drafter_dir, identity, trained))
        checks += _guarded("loader.vllm", lambda: [emulate_vllm(conf, header)])
        at = len(checks)
        checks += _guarded("parity.step0", lambda: [parity_check(drafter_dir, trained_path, identity)])
        recorded = None
        if trained_path is None and fmt == "A":  # the directory alone: it proves itself by its reference.json
            ref_checks, recorded = reference_checks(drafter_dir, identity, target_load)
            checks += ref_checks
        if sglang_run:
            checks[at:at] = _guarded("loader.sglang", lambda: [sglang_run.result()])
        elif fmt == "A":
            checks[at:at] = [not_run("loader.sglang", "SGLang's own loader was left out (--no-sglang / "
                                                      "check_export(sglang=False))")]
    k = k or (vllm or {}).get("k", 3)
    tau = train_tau(train_summary, k=k)
    if vllm is not None:
        want = (trained or {}).get("layer_ids") or conf.get("eagle_aux_hidden_state_layer_ids")
        try:  # the known answer's engine run goes first in the trained drafter's runner process
            ka = known_answer_check(identity, want, vllm)
        except Exception as e:
            ka = check(KNOWN_ANSWER, False, {"error": f"{type(e).__name__}: {e}"})
        checks += [ka] if isinstance(ka, dict) else []
        checks += vllm_checks.vllm_checks(drafter_dir, identity, want, train_tau=tau, trained_path=trained_path,
                                          recorded=recorded, before=None if isinstance(ka, dict) else ka, **vllm)
    else:
        checks += [not_run(n, "the real vLLM-CPU load + run was off (export.vllm_check: false / no --vllm)")
                   for n in VLLM_CHECKS]
    report = {"format": fmt, "drafter_dir": str(drafter_dir),
              "target": {x: identity.get(x) for x in ("name", "digest", "path")},
              "layer_ids": conf.get("eagle_aux_hidden_state_layer_ids"),
              "train_chain_tau": tau, "checks": checks}
    report.update(verdict(checks, accept_not_run))
    report["errors"] = failure_errors(checks)
    acc = next((ch for ch in checks if ch["name"] == "vllm.acceptance"), None)
    if acc:
        report["vllm_tau"] = acc["details"].get("vllm_tau")
    if trained_path is not None and fmt == "A" and report["ok"]:
        report["reference_chain"] = _chain_to_record(acc, trained_path, identity, k, chain_size, target_load)
    return report


def reference_checks(drafter_dir, identity: dict, load: dict | None) -> tuple[list[dict], dict | None]:
    """``reference.weights`` and ``reference.chain`` of a directory checked alone (eaglet.export.contract.reference),
    and the chain it recorded (vllm.acceptance's reference when vLLM's text is the recorded one)."""
    try:
        ref = reference.read(drafter_dir)
    except Exception as e:
        return [check(n, False, {"error": f"{type(e).__name__}: {e}"}) for n in REFERENCE_CHECKS], None
    if ref is None:
        why = (f"no {reference.FILE} in {drafter_dir} (exported by another tool, or by eaglet before it recorded "
               "one): nothing to prove the weights against without the trainer's file (--trained)")
        return [not_run(n, why) for n in REFERENCE_CHECKS], None
    out = _guarded("reference.weights", lambda: [reference.weights_check(drafter_dir, ref)])
    rec = ref.get("chain")
    if not rec:
        return out + [not_run("reference.chain", f"{reference.FILE} holds no chain: "
                                                 f"{ref.get('chain_not_recorded')}")], None

    def chain():
        got = vllm_checks.simulated_chain(drafter_dir, identity, rec["prompt_token_ids"], rec["continuations"],
                                              rec["k"], rec["max_tokens"], load)
        if "error" in got:
            return [check("reference.chain", False, {"error": got["error"]})]
        return [check("reference.chain", (res := reference.same_drafts(got, rec))["ok"], res)]

    return out + _guarded("reference.chain", chain), rec


def _chain_to_record(acc: dict | None, trained_path, identity: dict, k: int, size: tuple[int, int],
                     load: dict | None) -> dict:
    """The chain reference.json records: the one vllm.acceptance simulated from the trained weights
    along vLLM's text, else (vLLM off) the trained weights along the HF target's greedy text."""
    if acc and acc["details"].get("simulated_chain") and "error" not in acc["details"]["simulated_chain"]:
        return acc["details"]["simulated_chain"]
    n, max_tokens = size
    prompts = [vllm_checks.PROMPTS[i % len(vllm_checks.PROMPTS)] for i in range(n)]
    return vllm_checks.simulated_chain(trained_path, identity, None, None, k, max_tokens, load, prompts=prompts)


def known_answer_check(identity: dict, layer_ids, vllm: dict):
    """``vllm.known_answer`` (eaglet.export.contract.known_answer), run before the trained drafter's vLLM checks:
    proves vLLM reads this export format, layer ids, d2t, norm and fc as eaglet writes them. The check
    when it cannot run, else its pending engine run (known_answer.Pending), which
    vllm_checks.vllm_checks runs first in the trained drafter's runner process."""
    from eaglet.export.contract import known_answer

    kw = {key: vllm[key] for key in ("python", "k", "n_prompts", "max_tokens", "serving") if key in vllm}
    return known_answer.pending_check(identity, layer_ids, work_dir=Path(vllm["work_dir"]) / "known_answer", **kw)


def _guarded(name: str, fn) -> list[dict]:
    """A broken export can break a check itself (a missing config field, an impossible shape):
    that is a failed check, not a crash."""
    try:
        return fn()
    except Exception as e:
        return [check(name, False, {"error": f"{type(e).__name__}: {e}"})]


def train_tau(summary, k: int | None = None) -> float | None:
    """The trainer's exact greedy-chain τ on its validation set, from train_summary.json, for the
    weights it kept (``best_val``, else ``final_val``): ``chain_tau_<k>`` at the k drafts vLLM runs,
    else ``chain_tau``. None when the summary has none (no validation set, or a summary from
    before the chain τ): the teacher-forced ``tf_tau`` overstates acceptance and gates nothing."""
    if summary is None:
        return None
    s = summary if isinstance(summary, dict) else read_json(summary)
    for key in ("best_val", "final_val"):
        row = s.get(key)
        if not isinstance(row, dict):
            continue
        for name in ([f"chain_tau_{k}"] if k is not None else []) + ["chain_tau"]:
            if isinstance(row.get(name), (int, float)):
                return float(row[name])
    return None


@contextlib.contextmanager
def _temporary_folder():
    """A temporary folder removed on any exit. SIGTERM is held while it is made: a signal between
    ``mkdtemp`` and the ``with`` taking it over would leave it behind (seen when SIGTERM came the moment
    the folder appeared); the held signal is delivered once the folder is owned."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        tmp = tempfile.TemporaryDirectory(prefix="eaglet-contract-")
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    with tmp as work:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        yield work


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eaglet.export.contract", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter_dir")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--trained", default=None, help="the trainer's drafter.safetensors (ids, parity)")
    p.add_argument("--train-summary", default=None)
    p.add_argument("--vllm", action="store_true", help="also load and run it in vLLM-CPU")
    p.add_argument("--vllm-python", default=None, metavar="VENV_OR_PYTHON",
                   help=f"the vLLM interpreter --vllm runs (a venv folder or its bin/python); default "
                        f"${vllm_env.ENV_VAR} if set, else {vllm_env.DEFAULT_ENV} (made by envs/vllm/setup.sh)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--no-sglang", action="store_true",
                   help="leave SGLang's own loader out (loader.sglang is then not run: accept it by name)")
    p.add_argument("--out", default=None, help="write the report here (else stdout)")
    p.add_argument("--work-dir", default=None,
                   help="keep the vLLM runs' files and logs here (default: a temporary folder, removed at the "
                        "end, also on failure or interruption: the report then holds each failure's error lines)")
    p.add_argument("--accept-not-run", action="append", default=[], metavar="CHECK",
                   help="a check that may stay not run (repeatable; like the config's export.accept_not_run)")
    a = p.parse_args(argv)
    setup_logging()
    from eaglet.target.load import load_identity

    ident = load_identity(a.identity)
    ident["identity_path"] = str(a.identity)
    # SIGTERM as an exception (exit 143): the engine's process is killed (subprocess.run does it on any
    # exception) and the temporary folder removed, as on success, failure and Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    kept = contextlib.nullcontext(a.work_dir) if a.work_dir else None
    if a.work_dir:
        Path(a.work_dir).mkdir(parents=True, exist_ok=True)
    with kept or _temporary_folder() as work:
        vllm = {"work_dir": work, "k": a.k, "python": a.vllm_python} if a.vllm else None
        ref = reference.read(a.drafter_dir) if not a.trained else None
        if vllm and ref and ref.get("chain"):  # vLLM runs the recorded prompts at the recorded length
            vllm.update(n_prompts=len(ref["chain"]["prompt_token_ids"]), max_tokens=ref["chain"]["max_tokens"])
        rep = check_export(a.drafter_dir, ident, trained_path=a.trained, train_summary=a.train_summary,
                           vllm=vllm, accept_not_run=a.accept_not_run, k=a.k, sglang=not a.no_sglang)
    if a.out:
        write_json(a.out, rep)
    else:
        print(json.dumps(rep, indent=2))
    for ch in rep["checks"]:
        log.info("%s", status_line(ch))
    sys.exit(0 if rep["ok"] else 1)


if __name__ == "__main__":
    main()
