"""The layering rule (issue 16), read from the code itself: stages never import stages, the library
never imports a stage, and every rule lists as inputs the code its stage runs.

A *stage* is a module a Snakemake rule runs with ``python -m eaglet.<stage>`` (workflow/rules/*.smk);
every other module under src/eaglet is *library* (``eaglet.gpu_slots`` is the launcher a rule puts
in front of a stage's command: library too). Stages meet only through artifacts on disk; code two
stages share lives in the library. The rule is stated in ``eaglet/__init__.py``.

Imports are read with ``ast`` from every module, function-level imports included (they run too),
except those under ``if __name__ == "__main__":`` (an entry point, not a dependency of importers:
``python -m eaglet.target`` still runs the target_model stage). A vLLM runner script a module copies
and runs (``Path(__file__).with_name("vllm_*_runner.py")``) is code that module runs.
"""

import re
from pathlib import Path

from eaglet import code_inputs

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "eaglet"
RULES = sorted((REPO / "workflow" / "rules").glob("*.smk"))
LAUNCHER = code_inputs.LAUNCHER


def modules() -> list[str]:
    return code_inputs.modules()


def imports(module: str) -> set[str]:
    return set(code_inputs.imports(module))


def closure(module: str) -> set[str]:
    return code_inputs.closure(module)


def rules() -> dict[str, dict]:
    """{rule: {"stage": the module it runs or None, "code": its code inputs, "launcher": bool}}."""
    out = {}
    for smk in RULES:
        parts = re.split(r"^rule (\w+):", smk.read_text(), flags=re.M)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            ran = re.findall(r"-m eaglet\.(\w+)", body)  # python -m, or torchrun -m
            stages = [m for m in ran if m != LAUNCHER]
            assert len(stages) <= 1, (smk.name, name, stages)
            code = re.search(r"code=stage_code\((.*?)\)", body, re.S)
            out[name] = {"stage": stages[0] if stages else None, "launcher": LAUNCHER in ran,
                         "code": code.group(1) if code else None}
    return out


STAGES = {r["stage"] for r in rules().values() if r["stage"]}


def test_the_stages_are_the_modules_rules_run():
    assert {"target_model", "prompts", "tokenize", "freq", "vocab", "extract", "train", "export",
            "evaluate", "evaluate_vllm", "eval_summary", "generate", "plots", "provenance"} <= STAGES, STAGES
    # the target's library is not a stage: nine modules read the target through it
    assert "target" not in STAGES and LAUNCHER not in STAGES
    assert STAGES <= set(modules())


def test_the_written_rule_names_the_stages():
    """eaglet/__init__.py is the one place that says what a stage may import; its list is the rules'."""
    import eaglet

    text = eaglet.__doc__.split("(workflow/rules/*.smk):", 1)[1].split(". A stage", 1)[0]
    assert set(re.findall(r"\w+", text)) == STAGES


def test_no_stage_imports_a_stage_and_no_library_imports_a_stage():
    bad = {m: sorted(imports(m) & STAGES) for m in modules()}
    assert not {m: s for m, s in bad.items() if s}, "a module imports a stage (shared code goes in the library)"


def test_the_workflow_reads_only_library_modules_at_parse_time():
    used = set()
    for f in [*RULES, REPO / "Snakefile"]:
        for mod, name in re.findall(r"^\s*from eaglet(?:\.(\w+))? import ([\w, ]+)", f.read_text(), re.M):
            used |= {mod} if mod else {n.strip().split(" ")[0] for n in name.split(",")}
    assert used and not used & STAGES, used


def test_every_rule_lists_the_code_its_stage_runs():
    """Code inputs are what reruns a stage when its code changes (the cache key never sees code
    imported by `python -m`): every rule that runs a stage derives them from that stage's whole
    import closure (eaglet.code_inputs), with the launcher's when the rule runs one."""
    for name, r in rules().items():
        if r["stage"] is None:
            continue
        want = f'"{r["stage"]}"' + (", launcher=True" if r["launcher"] else "")
        assert r["code"] == want, f"rule {name} runs eaglet.{r['stage']}: code=stage_code({want}), not {r['code']}"
    # what only the parse reads is no stage's code: editing the tiny families' specs (which
    # eaglet.target_shape reads to resolve the layer ids) reruns target_model, nothing else
    assert not [s for s in STAGES if "target_shape" in closure(s)]
    assert [s for s in STAGES if "families" in closure(s)] == ["target_model"]
    files = code_inputs.files("train", launcher=True)
    assert {"src/eaglet/train.py", "src/eaglet/gpu_slots.py", "src/eaglet/io.py"} <= set(files)
    assert "src/eaglet/export.py" not in files and files == sorted(set(files))


def test_imports_are_read_as_written():
    """The reader itself: a function-level import counts, a `__main__` alias does not, a copied runner does."""
    assert "hf_loop" in imports("contract_vllm")  # function-level
    assert "target_model" not in imports("target")  # only under `if __name__ == "__main__":`
    assert {"vllm_check_runner", "vllm_env"} <= closure("contract_vllm")
    assert "vllm_env" in imports("vllm_eval_runner")
