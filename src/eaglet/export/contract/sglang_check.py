"""Contract check ``loader.sglang``: SGLang's own EAGLE-3 loader, run on the export (eaglet.export.contract).

SGLang cannot serve on this CPU, but its drafter class and ``load_weights`` run in-process: the runner
(``eaglet/engines/sglang_loader_runner.py``, in SGLang's own environment ``envs/sglang/.venv``) builds
SGLang's ``LlamaForCausalLMEagle3`` from config.json, feeds it the file's tensors, and reports what each
name set. The check passes when every parameter of SGLang's drafter, and ``hot_token_id``, was set
exactly once and equals the export's tensor (fused q/k/v and gate/up included), no weight name was
dropped without a word (SGLang's ``load_weights`` skips names it does not know silently; ``t2d`` it
skips on purpose), and SGLang's model reads every drafter variant the config turns on.

Without SGLang's environment the check is **not run** (no pass: the contract fails unless
``loader.sglang`` is named in ``export.accept_not_run``), with how to build it: ``make sglang-env``.

The runner's report is a function of the bytes SGLang reads (config.json and the safetensors files),
the runner's code and the SGLang install (its interpreter and setup stamp): a report is kept under
that digest (``$EAGLET_SGLANG_CACHE``, default ``~/.cache/eaglet/sglang-loader``, owner-only; ``off``
keeps none) and an identical export is judged on it without starting SGLang again, the details
saying so (``report``: ``cached``, with the run's time). Only a finished run's report is kept; the
judgement is always made anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from eaglet.engines import vllm_env
from eaglet.export.contract.record import check, not_run
from eaglet.export.contract.static_checks import effective_config, variants

NAME = "loader.sglang"
RUNNER = Path(vllm_env.__file__).with_name("sglang_loader_runner.py")  # runs in SGLang's venv
DEFAULT_ENV = "envs/sglang/.venv"
# Overrides DEFAULT_ENV (a venv folder or its bin/python)
ENV_VAR = "EAGLET_SGLANG_PYTHON"
SETUP = "`make sglang-env` (envs/sglang/setup.sh)"
# Where the runner's reports are kept by digest (module docstring); "off": none
CACHE_VAR = "EAGLET_SGLANG_CACHE"
EMBED = "model.embed_tokens.weight"
# What SGLang does with a parameter nobody set: it does not say so.
SILENT = {"model.fc.weight": "fc stays at its random init", "lm_head.weight": "the head is uninitialised memory",
          "hot_token_id": "no hot-token map: SGLang drafts over the wrong ids"}


class SglangEnvMissing(RuntimeError):
    """SGLang's environment is absent or its install never finished."""


def sglang_python(env=None) -> Path:
    """The interpreter of SGLang's environment: ``env`` (a venv folder or its bin/python), else
    ``$EAGLET_SGLANG_PYTHON``, else ``envs/sglang/.venv``; SglangEnvMissing unless setup.sh finished there."""
    return vllm_env.venv_python(env, ENV_VAR, DEFAULT_ENV, "SGLang", SETUP, SglangEnvMissing)


def run_sglang_loader(drafter_dir, python, timeout: float = 600) -> dict:
    """The runner's JSON on ``drafter_dir``, or {"error": the runner's own error lines}."""
    with tempfile.TemporaryDirectory(prefix="eaglet-sglang-") as work:
        # a copy, run from its own folder: nothing of eaglet's shadows a module in SGLang's interpreter
        runner = Path(shutil.copy(RUNNER, work))
        out = Path(work) / "sglang.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        # on the CPU whatever GPUs the machine has: SGLang's CUDA code paths need kernels this venv lacks
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   CUDA_VISIBLE_DEVICES="")
        log = Path(work) / "runner.log"
        try:
            # a fresh interpreter, or where the suite keeps fork servers, a child of one that has run the
            # runner's preload (SGLang's imports, ~7 s of CPU; eaglet.engines.forkserver)
            with open(log, "w") as fh:
                rc = vllm_env.run([str(python), str(runner), "--drafter", str(Path(drafter_dir).absolute()),
                                   "--out", str(out)], log=fh, env=env, cwd=work, timeout=timeout,
                                  preload=(f"{RUNNER.absolute()}:preload",))
        except subprocess.TimeoutExpired:
            return {"error": f"SGLang's loader did not finish in {timeout:.0f} s"}
        text = log.read_text(errors="replace")
        if rc != 0 or not out.exists():
            # imported here: the workflow reads this module's names when it parses, and vllm_checks
            # brings torch (1.2 s of every `snakemake` start)
            from eaglet.export.contract.vllm_checks import engine_error

            lines = engine_error(text) or text.strip().splitlines()[-3:]
            return {"error": "\n".join(lines) or f"runner exited with {rc}"}
        return json.loads(out.read_text())


def sglang_check(drafter_dir, conf: dict, python=None) -> dict:
    """``loader.sglang`` on an export whose config.json is ``conf``: SGLang's own loader run (or its
    report on these very bytes, kept: module docstring), its report judged; not run without SGLang's
    environment."""
    try:
        py = sglang_python(python)
    except SglangEnvMissing as e:
        return not_run(NAME, f"SGLang's own loader could not run: {e}. Build its environment with {SETUP}")
    kept = _cache_file(drafter_dir, py)
    res = _read_kept(kept)
    if res is not None:
        ch = judge(res, conf)
        ch["details"]["report"] = f"cached: SGLang's loader ran on identical bytes at {res.get('ran_at', '?')}"
        return ch
    res = run_sglang_loader(drafter_dir, py)
    if "error" in res:
        return check(NAME, False, {"error": res["error"]})
    res["ran_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(kept)
    ch = judge(res, conf)
    ch["details"]["report"] = "this run"
    return ch


def _read_kept(kept: Path | None) -> dict | None:
    """A kept report, or None: none kept, or one that cannot be read whole (SGLang runs again)."""
    if kept is None or not kept.is_file():
        return None
    try:
        res = json.loads(kept.read_text())
    except (OSError, ValueError):
        return None
    return res if isinstance(res, dict) and {"params", "reads", "names"} <= set(res) else None


def _cache_file(drafter_dir, python: Path) -> Path | None:
    """Where the runner's report on these bytes with this SGLang is kept, or None (cache off)."""
    where = os.environ.get(CACHE_VAR) or str(Path.home() / ".cache/eaglet/sglang-loader")
    if where.lower() == "off":
        return None
    h = hashlib.sha256()
    venv = Path(python).parent.parent
    stamp = venv / vllm_env.SETUP_STAMP
    h.update(f"{Path(python).absolute()}\0".encode())
    h.update(stamp.read_bytes() if stamp.is_file() else b"-")
    h.update(RUNNER.read_bytes())
    for f in sorted(Path(drafter_dir).iterdir()):
        if f.is_file() and (f.name == "config.json" or f.suffix == ".safetensors"):
            h.update(f"\0{f.name}\0".encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
    return Path(where) / f"{h.hexdigest()}.json"


def judge(res: dict, conf: dict) -> dict:
    """The check from the runner's report: every parameter set once and equal to the export's tensor,
    no name dropped, every variant the config turns on read by SGLang's model."""
    _, c = effective_config(conf)
    params, reads = res["params"], res["reads"]
    ver = f"SGLang {res['sglang_version']}"
    problems, unset, differ, twice, notes = [], [], [], [], {}
    for name, p in params.items():
        if p["kind"] == "buffer" and not p["from"]:
            continue  # computed by SGLang (the rotary cache), not read from the file
        if name == EMBED and not p["from"] and _shares_embedding(c):
            notes["embed_tokens"] = f"not in the file: {ver}'s EAGLE-3 worker gives the drafter the target's " \
                                    "(set_embed)"
            continue
        if p["unset"]:
            unset.append(f"{name}: never set ({SILENT.get(name, 'left at its initial value')})")
        if p["rewritten"]:
            twice.append(f"{name}: {p['rewritten']} element(s) written twice, by {p['from']}")
        if p["from"] and p["equal"] is not True:
            want = p["expected_from"] or "no tensor of the export in eaglet's layout"
            differ.append(f"{name}: set by {p['from']}, not equal to {want}")
    if params.get(EMBED, {}).get("from"):
        notes["embed_tokens"] = (f"shipped in the file: {ver} loads it, and its EAGLE-3 worker then replaces it "
                                 "with the target's (set_embed)" if _shares_embedding(c) else
                                 "shipped in the file: the drafter's own (hidden size differs from the target's)")
    dropped = [n for n, set_ in res["names"].items() if not set_ and n not in res["skipped_by_sglang"]]
    if reads.get("load_lm_head_from_target"):
        problems.append("draft_vocab_size missing: SGLang loads the target's full lm_head instead")
    flags = variants(conf, c)
    unread = [f for f, v in flags.items() if v and reads.get(f) is not True]
    if unread:
        problems.append(f"{ver}'s LlamaForCausalLMEagle3 does not read {unread} (no such setting on its model, or "
                        "False): it would load this drafter and silently run a different one")
    extra = [f for f, v in flags.items() if not v and reads.get(f) is True]
    if extra:
        problems.append(f"{ver} reads {extra} as on, which the drafter was not trained with")
    det = {"engine": ver, "seconds": res.get("seconds"), "dtype": res.get("dtype"),
           "parameters": sorted(n for n, p in params.items() if p["kind"] != "buffer"),
           "unset": unset, "not_equal": differ, "written_twice": twice, "silently_dropped": dropped,
           "skipped_by_sglang": res["skipped_by_sglang"], "problems": problems, "reads": reads, **notes}
    return check(NAME, not (unset or differ or twice or dropped or problems), det)


def _shares_embedding(c: dict) -> bool:
    """SGLang 0.5.23's set_embed gives the drafter the target's embedding unless the config names a
    target hidden size other than its own."""
    return c.get("target_hidden_size") in (None, c.get("hidden_size"))
