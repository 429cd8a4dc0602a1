"""R8: no pickle is loaded from a data path; hostile config strings reach the shell quoted and execute
nothing.

Part of the fault-injection suite (marker `faults`; docs/guarantees.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import yaml

from conftest import REPO, clone
from eaglet.base.files import read_json
from eaglet.engines import vllm_env
from faults_common import _smk

pytestmark = pytest.mark.faults


# =========================================================================== R8: no pickle, no shell
def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Calls that can unpickle data: torch.load without weights_only=True, pickle/dill/joblib
    loads, numpy load with allow_pickle other than False, pandas read_pickle. Import aliases are
    followed (``import numpy as np``, ``from torch import load``)."""
    tree = ast.parse(source, filename)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        name = ".".join(x for x in (alias.get(head, head), rest) if x)
        kw = {k.arg: k.value for k in node.keywords if k.arg}

        def const(k, kw=kw):
            return kw[k].value if isinstance(kw.get(k), ast.Constant) else "<not a constant>"

        where = f"{filename}:{node.lineno} {name}"
        if name == "torch.load" and const("weights_only") is not True:
            found.append(f"{where} without weights_only=True")
        elif name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
                      "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "joblib.load",
                      "cloudpickle.load", "cloudpickle.loads", "pandas.read_pickle", "torch.serialization.load"):
            found.append(where)
        elif name in ("numpy.load", "numpy.lib.npyio.load") and "allow_pickle" in kw and \
                const("allow_pickle") is not False:
            found.append(f"{where} with allow_pickle")
    return found


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(p)", "import torch\ntorch.load(p, weights_only=False)",
    "import torch\ntorch.load(p, weights_only=flag)", "from torch import load\nload(p)",
    "import pickle\npickle.load(f)", "import pickle as pk\npk.loads(b)", "from pickle import loads\nloads(b)",
    "import numpy as np\nnp.load(p, allow_pickle=True)", "import pandas as pd\npd.read_pickle(p)",
    "import joblib\njoblib.load(p)",
])
def test_pickle_scanner_catches_unsafe_loads(snippet):
    assert unsafe_loads(snippet), snippet


def test_no_pickle_is_loaded_from_a_data_path():
    files = sorted((REPO / "src").rglob("*.py"))
    assert len(files) > 10
    found = [f for p in files for f in unsafe_loads(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, found
    assert not unsafe_loads("import torch\ntorch.load(p, map_location='cpu', weights_only=True)\n"
                            "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)")


def shell_commands(path: Path) -> list[tuple[str, str]]:
    """(rule, shell string) of every `shell:` directive of a .smk file: the adjacent string
    literals that follow it, concatenated (f-strings are refused: placeholders must stay visible).
    A directive that picks its line at parse time, ``("..." if NAME else "...")`` (drafter.kind's
    train and export), gives one entry per branch, each scanned like a plain line."""
    toks = list(tokenize.generate_tokens(iter(path.read_text().splitlines(keepends=True)).__next__))
    out, rule = [], None
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT)
    for i, t in enumerate(toks):
        if t.type == tokenize.NAME and t.string == "rule" and toks[i + 1].type == tokenize.NAME:
            rule = toks[i + 1].string
        if t.type == tokenize.NAME and t.string == "shell" and toks[i + 1].string == ":" and \
                toks[i - 1].type in skip:
            branches, parts, j, depth = [], [], i + 2, 0
            while True:
                tk = toks[j]
                if tk.type == tokenize.STRING:
                    assert not re.match(r"[rRbBuU]*[fF]", tk.string), f"{path}: f-string shell in {rule}"
                    parts.append(ast.literal_eval(tk.string))
                elif tk.type == tokenize.OP and tk.string in "()":
                    depth += 1 if tk.string == "(" else -1
                elif tk.type == tokenize.NAME and tk.string == "if" and depth:
                    branches.append("".join(parts))
                    parts = []
                    while toks[j].string != "else":  # the condition: a name, not a command
                        j += 1
                elif tk.type not in skip:
                    break
                j += 1
            branches.append("".join(parts))
            out += [(rule, b) for b in branches]
    return out


def _schema_node(schema: dict, key: str) -> dict:
    node = schema
    for part in key.split("."):
        node = node["properties"][part]
    return node


# Placeholders a shell line may use without :q, and why each value cannot carry a shell
# metacharacter. ("schema", key): checked below against workflow/schemas/config.schema.yaml (an
# enum of plain words, or an integer / number / boolean, printed as digits or True/False).
# ("run-path", why): a path built by the workflow under results/<run>/ or logs/<run>/, where
# `run` (like target.name) is restricted by the schema to [A-Za-z0-9_.-]. ("int", why): an
# integer made by Snakemake or the workflow itself.
UNQUOTED_OK = {
    ("prompts", "params.source"): ("schema", "prompts.source"),
    ("prompts", "params.n"): ("schema", "prompts.n"),
    ("prompts", "params.heldout"): ("schema", "prompts.heldout"),
    ("prompts", "params.seed"): ("schema", "prompts.seed"),
    ("prompts", "params.max_turns"): ("schema", "prompts.max_turns"),  # null becomes 0 in the rule
    ("tokenize", "params.max_length"): ("schema", "tokenize.max_length"),
    ("tokenize", "params.overlong"): ("schema", "tokenize.overlong"),
    ("tokenize", "params.batch_size"): ("schema", "tokenize.batch_size"),
    ("vocab_map", "params.draft_vocab_size"): ("schema", "vocab.draft_vocab_size"),
    ("vocab_map", "params.pin_special"): ("schema", "vocab.pin_special_tokens"),
    ("vocab_map", "params.curve_points"): ("schema", "vocab.curve_points"),
    ("extract_hidden_states", "params.dtype"): ("schema", "extract.dtype"),
    ("extract_hidden_states", "params.token_budget"): ("schema", "extract.token_budget"),
    ("extract_hidden_states", "params.chunk_mb"): ("schema", "extract.chunk_mb"),
    ("extract_hidden_states", "resources.gpu"): ("schema", "extract.gpus_per_shard"),
    ("extract_hidden_states", "params.shard"): ("int", "int() of the shard wildcard, constrained to \\d+"),
    ("extract_hidden_states", "params.num_shards"): ("int", "len() of the shard list"),
    ("train", "resources.gpu"): ("schema", "train.gpus"),
    ("export", "resources.gpu"): ("int", "target.vllm.tensor_parallel_size (a schema integer) with the CUDA build "
                                         "and export.vllm_check, else 0 (eaglet.workflow.resolve.vllm_gpus)"),
    # target.vllm.tensor_parallel_size with the CUDA vLLM backend, else 0
    ("generate", "resources.gpu"): ("schema", "target.vllm.tensor_parallel_size"),
    ("evaluate_vllm", "resources.gpu"): ("schema", "target.vllm.tensor_parallel_size"),
    ("evaluate_offline", "resources.gpu"): ("int", "1 when the HF loop runs with the CUDA vLLM build, else 0"),
    ("evaluate_speculative", "resources.gpu"): ("int", "1 when the HF loop runs with the CUDA vLLM build, else 0"),
    ("train", "params.launcher"): ("int", "'python' or the torchrun line with int(resources.gpu)"),
    ("generate_eval", "resources.gpu"): ("schema", "target.vllm.tensor_parallel_size"),
    ("evaluate_regenerated", "resources.gpu"): ("int", "1 when the HF loop runs with the CUDA vLLM build, else 0"),
    ("evaluate_regenerated", "threads"): ("int", "Snakemake's thread count"),
    ("eval_summary", "params.regenerated"): ("run-path", "'' or --regenerated results/<run>/eval/regenerated.json"),
    ("eval_summary", "params.modes"): ("run-path", "'' or --modes results/<run>/eval/modes.json"),
    ("evaluate_modes", "resources.gpu"): ("int", "1 when the HF loop runs with the CUDA vLLM build, else 0"),
    ("evaluate_modes", "threads"): ("int", "Snakemake's thread count"),
    ("evaluate_offline", "threads"): ("int", "Snakemake's thread count"),
    ("evaluate_speculative", "threads"): ("int", "Snakemake's thread count"),
    ("eval_summary", "params.vllm"): ("run-path", "'' or --vllm results/<run>/eval/vllm.json"),
    ("eval_summary", "params.learning_curve"): ("run-path", "'' or --learning-curve "
                                                            "results/<run>/learning_curve/learning_curve.json"),
    ("learning_curve", "params.generate"): ("run-path", "'' or --generate "
                                                        "results/<run>/generate/generate_summary.json"),
    ("train", "params.data"): ("run-path", "--hidden + shlex-quoted results/<run>/extract/shard_<i>, "
                                           "or --online + shlex-quoted JSON (the online settings)"),
    ("plots", "params.evaluation"): ("run-path", "'' or --evaluation results/<run>/eval/summary.json"),
    ("drafter_card", "params.evaluation"): ("run-path", "'' or --evaluation results/<run>/eval/summary.json"),
}
SAFE_NAME = "^[A-Za-z0-9][A-Za-z0-9_.-]*$"


def unquoted_placeholders(commands: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(rule, placeholder name) of every {...} in the shell strings without the :q format spec."""
    found = []
    for rule, cmd in commands:
        for field in re.findall(r"(?<!\{)\{([^{}]+)\}(?!\})", cmd):
            name, _, spec = field.partition(":")
            if "q" not in spec:
                found.append((rule, name))
    return found


def test_shell_scanner_finds_unquoted_placeholders(tmp_path):
    smk = tmp_path / "x.smk"
    smk.write_text('rule a:\n    params:\n        p=config["x"],\n    shell:\n'
                   '        "tool --x {params.p} --y {input.y:q}"\n        " > {output}  # {{literal}}"\n\n\n'
                   'rule b:\n    shell:\n        "tool {log:q} {wildcards.w}"\n\n\n'
                   'rule c:\n    shell:\n        (\n            "one {params.k}"\n            " --x {log:q}"\n'
                   '            if KIND\n            else "two {params.m}"\n        )\n')
    commands = shell_commands(smk)
    # a line picked at parse time: each branch scanned
    assert commands[2:] == [("c", "one {params.k} --x {log:q}"), ("c", "two {params.m}")]
    assert [r for r, _ in commands] == ["a", "b", "c", "c"]
    assert unquoted_placeholders(commands) == [("a", "params.p"), ("a", "output"), ("b", "wildcards.w"),
                                               ("c", "params.k"), ("c", "params.m")]


def test_config_strings_reach_the_shell_quoted():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    commands = [c for f in sorted((REPO / "workflow/rules").glob("*.smk")) for c in shell_commands(f)]
    assert len(commands) >= 14 and all(rule for rule, _ in commands)
    used = set(unquoted_placeholders(commands))
    unquoted = sorted(used - set(UNQUOTED_OK))
    assert not unquoted, f"placeholders without :q that may carry config strings: {unquoted}"
    assert used == set(UNQUOTED_OK), f"stale allowlist entries: {set(UNQUOTED_OK) - used}"
    for (rule, name), (kind, what) in UNQUOTED_OK.items():
        if kind == "schema":
            node = _schema_node(schema, what)
            types = set(node["type"]) if isinstance(node["type"], list) else {node["type"]}
            plain_enum = "enum" in node and all(re.fullmatch(r"[A-Za-z0-9_.-]+", str(v)) for v in node["enum"])
            assert plain_enum or types <= {"integer", "number", "boolean", "null"}, (rule, name, node)
    # What the run-path entries rely on: run and target.name cannot hold a shell metacharacter.
    for key in ("run", "target.name"):
        assert _schema_node(schema, key)["pattern"] == SAFE_NAME, key


EVIL = "we ird;touch {c}1;$(touch {c}2)`touch {c}3`|touch {c}4&&touch {c}5>x'q'<y"


def test_hostile_config_strings_execute_nothing(tmp_path, monkeypatch):
    """Shell metacharacters in every free-text config string (paths, URLs, names, markers, set
    names, extra args): (0) an environment path and a prompts file that hold them and are absent are
    refused by the parse, named intact, before any job; (1) each shell line Snakemake would run,
    printed by `snakemake -n -p`, is run by bash with a `python` that only records its argv —
    nothing is executed and every string arrives as one intact argument; (2) a real run of the
    `prompts` rule reads a source file whose path holds those characters."""
    wf = clone(tmp_path / "wf")
    canary = tmp_path / "PWNED"
    evil = EVIL.format(c=canary)
    conf = yaml.safe_load((wf / "config" / "smoke.yaml").read_text())
    conf["prompts"].update(source="file", path=str(tmp_path / evil / "data.jsonl"), split=evil)
    conf["generate"].update(backend="openai", base_urls=[f"http://{evil}/v1"], model=evil,
                            reject_markers=[evil], chat_template_kwargs={"k": evil})
    conf["generate"]["vllm"] = {"env": evil, "extra_args": [evil]}
    conf["vocab"]["pinned"] = [evil]
    conf["evaluate"]["sets"] = ["mtbench", evil]
    # an environment path the parse checks (eaglet.workflow.environments): absent first, then a venv there
    venv = tmp_path / "venvs" / evil
    conf["evaluate"]["vllm"] = {"enabled": True, "env": str(venv)}
    conf["evaluate"]["modes"] = {"a": {"k": evil}, "b": {"k": 2}}  # template arguments per mode
    conf["target"]["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}" + evil  # inline Jinja
    (wf / "config" / "evil.yaml").write_text(yaml.safe_dump(conf))
    # (0) No environment at that path: the parse refuses the run before any job, naming the path
    # intact, and runs nothing of it.
    code, out = _smk(wf, "-n", "-p", configfile="config/evil.yaml")
    assert code != 0 and "environments this run needs are missing, found before any job" in out, out[-3000:]
    assert f"evaluate.vllm.enabled: {venv / 'bin' / 'python'}: vLLM environment missing" in out, out[-3000:]
    assert "Shell command: " not in out and not (wf / "results").exists() and not (wf / "resources").exists()
    assert not list(tmp_path.glob("PWNED*")) and not list(wf.rglob("PWNED*"))
    # A (stand-in) venv at the hostile path: the check finds it; the prompts file at its hostile path
    # is read at parse time too (its content digest, eaglet.workflow.inputs.user_digest): absent, it is
    # refused, named intact, before any job.
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / vllm_env.SETUP_STAMP).write_text("")
    src = tmp_path / evil / "data.jsonl"
    code, out = _smk(wf, "-n", "-p", configfile="config/evil.yaml")
    assert code != 0 and f"prompts.path: {str(src)!r} does not exist" in out, out[-3000:]
    assert "Shell command: " not in out and not (wf / "results").exists() and not (wf / "resources").exists()
    assert not list(tmp_path.glob("PWNED*")) and not list(wf.rglob("PWNED*"))
    # With both there, the preview goes on to print every job's shell line.
    src.parent.mkdir(parents=True)
    src.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}) + "\n" for i in range(12)))
    monkeypatch.setenv("EAGLET_PREVIEW_SETTINGS", str(tmp_path / "preview"))  # the settings files, to read
    code, out = _smk(wf, "-n", "-p", configfile="config/evil.yaml")
    monkeypatch.delenv("EAGLET_PREVIEW_SETTINGS")
    assert code == 0, out[-3000:]
    commands = [line.split("Shell command: ", 1)[1] for line in out.splitlines() if "Shell command: " in line]
    commands = [c for c in commands if c != "None"]  # rule all
    assert len(commands) >= 14, out[-3000:]

    stub = tmp_path / "stub"
    stub.mkdir()
    record = tmp_path / "argv.jsonl"
    (stub / "python").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                 f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (stub / "python").chmod(0o755)
    scratch = tmp_path / "scratch"
    (scratch / "logs" / "smoke").mkdir(parents=True)

    def run_line(cmd: str) -> None:
        # `<TBD>`: a params value Snakemake computes from inputs only when the job runs.
        r = subprocess.run(["bash", "-c", cmd.replace("<TBD>", "TBD")], cwd=scratch, capture_output=True,
                           text=True, env={**os.environ, "PATH": f"{stub}{os.pathsep}/usr/bin:/bin"}, timeout=60)
        assert r.returncode == 0 or not cmd.startswith("python -m eaglet"), (cmd, r.stderr)

    run_line(f"true --split {evil}")  # the harness detects an unquoted value: it runs the canary
    assert len(list(tmp_path.glob("PWNED*"))) >= 3
    for f in tmp_path.glob("PWNED*"):
        f.unlink()
    for cmd in commands:
        run_line(cmd)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == len(commands)
    # The stub python records the GPU-slot launcher's argv: the stage's follows its `--`.
    calls = [c[c.index("--") + 2:] if c[:2] == ["-m", "eaglet.planner.gpu_slots"] else c for c in calls]
    assert not list(tmp_path.glob("PWNED*")) and not list(scratch.rglob("PWNED*"))
    holding = [a for c in calls for a in c if evil in a]
    modules = {c[c.index("-m") + 1] for c in calls if any(evil in a for a in c)}
    # The strings reach every stage that takes them on its command line: prompts (path, split),
    # generate, vocab (pinned), evaluation, tokenize and provenance (the whole config); the target's
    # and generate's backend settings are read from the files a run writes when it starts (intact
    # there: a preview writes them only under EAGLET_PREVIEW_SETTINGS).
    assert {"eaglet.data.prompts", "eaglet.generate.generate", "eaglet.data.vocab", "eaglet.eval.evaluate_offline",
            "eaglet.eval.evaluate_vllm",
            "eaglet.data.tokenization", "eaglet.report.provenance"} <= modules, modules
    assert not (wf / "logs" / "smoke" / "config").exists()
    written = json.loads((tmp_path / "preview/logs/smoke/config/generate.json").read_text())
    assert written["base_urls"] == [f"http://{evil}/v1"] and written["model"] == evil
    target = json.loads((tmp_path / "preview/logs/target_model/tiny-llama.config.json").read_text())
    assert target["chat_template"] == conf["target"]["chat_template"]
    provenance = next(c for c in calls if c[:2] == ["-m", "eaglet.report.provenance"])
    assert json.loads(provenance[provenance.index("--config-json") + 1])["vocab"]["pinned"] == [evil]
    assert conf["target"]["chat_template"] in holding or f"--chat-template={conf['target']['chat_template']}" in holding
    assert f"--path={tmp_path / evil / 'data.jsonl'}" in holding and evil in holding
    modes = next(c for c in calls if c[:2] == ["-m", "eaglet.eval.evaluate_modes"])
    assert json.loads(modes[modes.index("--modes") + 1])["a"] == {"k": evil}

    # (2) A real job: the prompts rule reads the file at that path (written above) and records it.
    code, out = _smk(wf, "results/smoke/prompts/summary.json", configfile="config/evil.yaml")
    assert code == 0, out[-3000:]
    assert read_json(wf / "results/smoke/prompts/summary.json")["path"] == str(src)
    assert not list(tmp_path.glob("PWNED*")) and not list(wf.rglob("PWNED*"))


def test_run_name_with_shell_characters_is_refused_at_parse_time(tmp_path):
    """`run` and `target.name` become paths in shell lines unquoted-safe only because the schema
    restricts them: a hostile value fails validation naming the key, before any job."""
    wf = clone(tmp_path / "wf")
    canary = tmp_path / "PWNED"
    for section, value in (("run", f"x;touch {canary}"), ("target.name", f"t $(touch {canary})")):
        conf = yaml.safe_load((wf / "config" / "smoke.yaml").read_text())
        if section == "run":
            conf["run"] = value
        else:
            conf["target"]["name"] = value
        (wf / "config" / "bad.yaml").write_text(yaml.safe_dump(conf))
        code, out = _smk(wf, "-n", "-p", configfile="config/bad.yaml")
        # refused by the schema's validation (eaglet.base.schema.validate), naming the key's whole path
        assert code != 0 and "config refused by config.schema.yaml" in out and "does not match" in out, out[-3000:]
        assert f"{section}: " in out
    assert not canary.exists() and not (wf / "results").exists()
