"""The drafter's model card (eaglet.report.card): drafter/README.md from the run's artifacts, front
matter a model hub reads, the evaluation's results matrix, digests that are the files', and a vLLM
snippet that runs as written on the CPU build (marker ``vllm``)."""

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from eaglet.engines import vllm_env
from eaglet.report.card import SNIPPET_MARK

RUN = "smoke"


def _card(finished_run) -> tuple[Path, str]:
    a, _ = finished_run
    run = a / "results" / RUN
    return run, (run / "drafter" / "README.md").read_text()


def test_card_front_matter_matrix_and_digests_are_the_runs(finished_run):
    run, text = _card(finished_run)
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    # smoke.yaml's target.hub_id is null: the card names the target itself
    assert meta["base_model"] == "tiny-llama" and meta["library_name"] == "vllm", meta
    assert {"eagle3", "speculative-decoding"} <= set(meta["tags"]) and meta["metrics"]
    assert "anon8231489123/ShareGPT_Vicuna_unfiltered" in meta["datasets"]
    # the matrix's every-prompt exact chain τ at the headline k, as summary.json has it
    summary = json.loads((run / "eval" / "summary.json").read_text())
    k = summary["headline"]["k"]
    row = next(r for r in summary["matrix"] if (r["engine"], r["temperature"], r["k"], r["set"], r["domain"])
               == ("chain", 0.0, k, "all", "all"))
    line = next(ln for ln in text.splitlines() if ln.startswith("| **every prompt** |"))
    assert f"{row['tau']:.2f} [{row['ci'][0]:.2f}, {row['ci'][1]:.2f}]" == line.split("|")[2].strip(), line
    assert any("T=1" in ln for ln in text.splitlines() if ln.startswith("| domain |"))  # both temperatures
    for name in ("config.json", "model.safetensors"):
        digest = hashlib.sha256((run / "drafter" / name).read_bytes()).hexdigest()
        assert f"| `{name}` | `{digest}` |" in text
    assert "python -m sglang.launch_server" in text and "--speculative-algorithm EAGLE3" in text


@pytest.mark.vllm
def test_the_cards_vllm_snippet_runs_on_the_cpu_build(finished_run, tmp_path):
    """The card's Python block, as written, with TARGET and DRAFTER pointed at this run's folders."""
    a, _ = finished_run
    run, text = _card(finished_run)
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if SNIPPET_MARK in b)
    ident = json.loads(next((a / "resources" / "targets").glob("*/identity.json")).read_text())
    target = (next((a / "resources" / "targets").glob("*/identity.json")).parent / ident["path"]).resolve()
    script = re.sub(r'^TARGET = ".*?"', f'TARGET = "{target}"', block, flags=re.M)
    script = re.sub(r'^DRAFTER = ".*?"', f'DRAFTER = "{(run / "drafter").resolve()}"', script, flags=re.M)
    assert script.count(str(target)) == 1 and script != block
    (tmp_path / "snippet.py").write_text(script)
    py = vllm_env.vllm_python()
    env = vllm_env.process_env(tmp_path, py, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="INFO")
    p = subprocess.run([str(py), "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=vllm_env.timeout(600))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert p.stdout.strip(), p.stderr[-2000:]  # the generated text
    assert "eagle3" in (p.stdout + p.stderr).lower()  # served with the drafter


def test_the_readme_serving_commands_are_the_cards_and_the_launchers_for_the_default_run():
    """README.md's serving lines, as written, for the default run: the vLLM and SGLang lines are the
    ones the card writes for its drafter, and the CPU build's line is one eaglet.engines.vllm_server parses
    (the launcher the workflow's own servers start through) pointing at the default run's folders."""
    import shlex

    from eaglet.engines import vllm_server
    from eaglet.report.card import sglang_command, speculative_config, vllm_serve_command

    root = Path(__file__).resolve().parents[2]
    conf = yaml.safe_load((root / "config" / "config.yaml").read_text())
    schema = yaml.safe_load((root / "workflow" / "schemas" / "config.schema.yaml").read_text())
    k = (conf.get("export") or {}).get("num_speculative_tokens") or \
        schema["properties"]["export"]["properties"]["num_speculative_tokens"]["default"]
    drafter = f"results/{conf['run']}/drafter"
    blocks = re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), re.S)
    text = "\n".join(blocks)
    assert vllm_serve_command("<target>", drafter, k) in text
    assert sglang_command("<target>", drafter, k) in text
    line = next(b for b in blocks if "eaglet.engines.vllm_server" in b)
    line = line[line.index("python -m eaglet.engines.vllm_server"):].replace("\\\n", " ").splitlines()[0]
    argv = shlex.split(line)[3:]
    a = vllm_server.parser().parse_args(argv)
    assert a.model == f"resources/targets/{conf['target']['name']}/model"
    assert json.loads(a.speculative_config) == json.loads(speculative_config(drafter, k))


def test_the_card_recommends_the_draft_sample_method_with_the_higher_predicted_tau():
    """Issue 43: at each T > 0 the card names the vLLM setting (draft_sample_method) whose offline
    expected τ at the headline k is higher, with both figures and vLLM's measured τ per rule; the
    matrix tables get one column per rule at T > 0 (none at T = 0, where both draft the argmax)."""
    from eaglet.report.card import matrix_tables, serving_recommendation

    def row(engine, t, rule, tau, ci=None, k=3, domain="all"):
        return {"engine": engine, "temperature": t, "k": k, "set": "all", "domain": domain, "tau": tau, "ci": ci,
                "prompts": 4, "rule": rule}

    matrix = [row("chain", 0.0, "greedy", 1.30, [1.2, 1.4]),
              row("expected", 1.0, "greedy", 1.21, [1.18, 1.24]),
              row("expected", 1.0, "probabilistic", 1.35, [1.3, 1.4]),
              row("vllm", 1.0, "greedy", 1.19, [1.1, 1.3]), row("vllm", 1.0, "probabilistic", 1.33, [1.2, 1.45]),
              row("expected", 0.7, "greedy", 1.40, [1.3, 1.5]),
              row("expected", 0.7, "probabilistic", 1.38, [1.3, 1.45])]
    text = serving_recommendation(matrix, 3)
    t1 = next(ln for ln in text.splitlines() if ln.startswith("- T = 1:"))
    assert '`{"draft_sample_method": "probabilistic"}`' in t1 and "1.35 [1.30, 1.40] under the probabilistic" in t1
    assert "against 1.21 [1.18, 1.24] under the greedy rule" in t1 and "overlap" not in t1
    assert "vLLM measured τ: greedy 1.19 [1.10, 1.30], probabilistic 1.33 [1.20, 1.45]" in t1
    t07 = next(ln for ln in text.splitlines() if ln.startswith("- T = 0.7:"))
    assert '`{"draft_sample_method": "greedy"}`' in t07 and "the intervals overlap" in t07
    assert serving_recommendation(matrix[:1], 3) == ""  # T = 0 only: nothing to choose
    head = next(ln for ln in matrix_tables(matrix, 3).splitlines() if ln.startswith("| domain |"))
    assert "exact chain (offline), T=0 |" in head
    assert "expected (offline), T=1, greedy drafts, p(draft)" in head
    assert "expected (offline), T=1, sampled drafts, Σmin(p,q)" in head and head.count("vLLM (measured), T=1") == 2
