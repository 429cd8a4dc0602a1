"""What the export contract's vLLM runs cost in one runner process against one process each.

The contract's real-vLLM checks make three engine runs (eaglet.export.contract.vllm_checks): the
known-answer twin with its drafter, the target with the drafter, the target plain. They run in one
runner process (run_vllm_batch, a fresh LLM each), which pays the interpreter start and the vLLM
import once; before, each run had its own process. This times both on the same runs, alternated in
pairs, the first pair dropped as warm-up:

    python benchmarks/bench_contract_runs.py [--identity resources/targets/X/identity.json] [--repeats 4]

Without ``--identity``, a tiny random Llama target made in a temporary folder (the suite's tiny
target); the drafter is the known answer's, on its twin, for both drafter runs (a trained one loads
the same way). Needs envs/vllm (make vllm-env). Prints each median and the median of the paired
ratios (separate / one process) with its interval (paired.median_interval), and checks that both
ways gave the same tokens (else they timed different work).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paired import alternate, print_paired  # noqa: E402


def contract_runs(identity: dict, layer_ids: list[int], work: Path, python, n_prompts: int, max_tokens: int,
                  k: int = 3):
    """The contract's three runs (known answer, drafter, plain) and their prompts and serving."""
    from eaglet.export.contract import known_answer

    ka = known_answer.pending_check(identity, layer_ids, work_dir=work / "known_answer", python=python, k=k,
                                    n_prompts=n_prompts, max_tokens=max_tokens)
    if isinstance(ka, dict):
        raise SystemExit(f"no known answer for this target: {ka}")
    spec = {**ka.run, "tag": "spec"}
    plain = {"tag": "plain", "target": identity["path"], "drafter": None, "k": k, "max_tokens": max_tokens + k - 1,
             "needs": "spec"}
    return [ka.run, spec, plain], ka.prompts, ka.serving


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--identity", default=None, help="a target's identity.json (default: a tiny random Llama)")
    ap.add_argument("--layer-ids", default="2,4,5", help="the drafter's aux layer ids (vLLM convention)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4, help="pairs, the first dropped as warm-up")
    ap.add_argument("--vllm-python", default=None, help="the vLLM venv or its python (default: envs/vllm/.venv)")
    a = ap.parse_args(argv)

    from eaglet.data.target_model import materialise
    from eaglet.engines import vllm_env
    from eaglet.export.contract.vllm_checks import run_vllm_batch
    from eaglet.target.load import load_identity

    try:
        py = vllm_env.vllm_python(a.vllm_python)
    except vllm_env.VllmEnvMissing as e:
        raise SystemExit(f"bench_contract_runs: no vLLM environment ({e}): make vllm-env") from None
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-contract-") as tmp:
        work = Path(tmp)
        if a.identity is None:
            materialise({"name": "tiny", "tiny": {}}, work / "target")
            ident_path = work / "target" / "identity.json"
        else:
            ident_path = Path(a.identity)
        identity = load_identity(ident_path)
        runs, prompts, serving = contract_runs(identity, [int(x) for x in a.layer_ids.split(",")], work, py,
                                               a.prompts, a.max_tokens)
        tokens: dict[str, list] = {}

        def batch(name: str, groups: list[list[dict]]):
            def call():
                got = {}
                for i, group in enumerate(groups):
                    got.update(run_vllm_batch(group, prompts, work_dir=work / name / str(i), python=py,
                                              serving=serving))
                bad = {t: r.get("engine_error") or r.get("skipped") for t, r in got.items() if r.get("rc") != 0}
                if bad:
                    raise SystemExit(f"{name}: runs failed: {bad}")
                tokens.setdefault(name, [got[r["tag"]]["token_ids"] for r in runs])
            return call

        times = alternate({"one process": batch("one", [runs]),
                           "one process each": batch("each", [[r] for r in runs])}, a.repeats)
        print(f"target {identity['name']} ({identity['path']}), runs {[r['tag'] for r in runs]}, "
              f"{len(prompts)} prompts x {a.max_tokens} tokens")
        print_paired(times, "one process each", "one process")
        same = tokens["one"] == tokens["each"]
        print(f"same tokens both ways: {same}")
        if not same:
            raise SystemExit("the two ways gave different tokens: they timed different work")


if __name__ == "__main__":
    main()
