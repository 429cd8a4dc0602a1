"""target: materialisation and identity, and the family facts the identity records."""

import shutil
from pathlib import Path

import pytest
import torch

from eaglet.base import digests
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import folder_manifest
from eaglet.data.target_model import materialise
from eaglet.target.load import default_layer_ids, identity_of, load_identity, load_tokenizer, validate_layer_ids


def user_checkpoint(tiny_target, dest: Path) -> Path:
    """A copy of the tiny target's checkpoint standing in for a user's own local folder, its files
    owner-only (0600) as a user's downloaded weights may be."""
    shutil.copytree(tiny_target["path"], dest)
    for f in dest.iterdir():
        f.chmod(0o600)
    return dest


def test_local_checkpoint_is_read_in_place_never_linked(tiny_target, tmp_path):
    """target.path: a local safetensors checkpoint is neither re-saved (a 1T target cannot be) nor
    linked (the cache would re-permission the user's files through the links): identity.json
    records the folder's absolute path; the digest equals that of the same weights materialised."""
    user = user_checkpoint(tiny_target, tmp_path / "user")
    modes = {f.name: f.stat().st_mode for f in user.iterdir()}
    ident = materialise({"name": "local", "path": str(user)}, tmp_path / "t")
    assert not [p for p in (tmp_path / "t").rglob("*") if p.is_symlink()]
    assert ident["digest"] == tiny_target["digest"] and ident["num_layers"] == tiny_target["num_layers"]
    loaded = load_identity(tmp_path / "t" / "identity.json")
    assert loaded["path"] == str(user)
    assert load_tokenizer(loaded["path"]).chat_template
    assert {f.name: f.stat().st_mode for f in user.iterdir()} == modes


def test_identity_records_a_manifest_that_every_read_checks(tiny_target, tmp_path):
    """load_identity refuses, naming the file, a target folder changed since target_model identified
    it: a small file edited, a file added (a legacy chat template file), a big file resized."""
    user = user_checkpoint(tiny_target, tmp_path / "user")
    materialise({"name": "local", "path": str(user)}, tmp_path / "t")
    ident_path = tmp_path / "t" / "identity.json"
    files = load_identity(ident_path)["files"]
    assert files["config.json"]["sha256"] and files["model.safetensors"]["size"] > 0

    conf = user / "config.json"
    original = conf.read_bytes()
    conf.write_bytes(original.replace(b'"hidden_act": "silu"', b'"hidden_act": "gelu"'))
    assert conf.stat().st_size == len(original)  # same size: only the digest can tell
    with pytest.raises(ArtifactError, match=r"config\.json: sha256 differs"):
        load_identity(ident_path)
    conf.write_bytes(original)
    load_identity(ident_path)

    (user / "chat_template.json").write_text('{"chat_template": "{{ messages }}"}')
    with pytest.raises(ArtifactError, match=r"chat_template\.json: not in the manifest"):
        load_identity(ident_path)
    (user / "chat_template.json").unlink()

    with open(user / "model.safetensors", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: \d+ bytes"):
        load_identity(ident_path)


def test_big_files_are_checked_by_size_small_ones_by_digest(tmp_path, monkeypatch):
    """The stated cost choice: files above digests.FULL_HASH_MAX_BYTES carry a size only."""
    (tmp_path / "big.bin").write_bytes(b"x" * 100)
    (tmp_path / "small.json").write_text("{}")
    monkeypatch.setattr(digests, "FULL_HASH_MAX_BYTES", 50)
    m = folder_manifest(tmp_path)
    assert m["big.bin"] == {"size": 100} and set(m["small.json"]) == {"size", "sha256"}


def test_layer_ids_default_and_validation():
    assert default_layer_ids(30) == [2, 15, 27]      # SmolLM2-135M (docs/eagle3.md §5)
    assert default_layer_ids(61) == [2, 30, 58]      # Kimi-K2
    with pytest.raises(ValueError, match="outside"):
        validate_layer_ids([2, 15, 31], 30)
    # id N is the final state: vLLM records aux states only entering layers 0..N-1, never serves it
    with pytest.raises(ValueError, match=r"extract.layer_ids: \[2, 15, 30\] outside \[1, 29\]"):
        validate_layer_ids([2, 15, 30], 30)
    assert validate_layer_ids([2, 15, 29], 30) == [2, 15, 29]
    with pytest.raises(ValueError, match="ascending"):
        validate_layer_ids([15, 2, 27], 30)


REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "eaglet_remote_llama"
'''
REMOTE_MODELING = '''from transformers import LlamaForCausalLM

from .configuration_remote import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
'''


def remote_code_checkpoint(tiny_target, dest: Path) -> Path:
    """The tiny target as a checkpoint whose classes live in its own folder (``auto_map``), as
    Kimi-K2.5's do: transformers loads it only with trust_remote_code."""
    import json

    shutil.copytree(tiny_target["path"], dest)
    (dest / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (dest / "modeling_remote.py").write_text(REMOTE_MODELING)
    conf = json.loads((dest / "config.json").read_text())
    conf.update(model_type="eaglet_remote_llama", architectures=["RemoteLlamaForCausalLM"],
                auto_map={"AutoConfig": "configuration_remote.RemoteLlamaConfig",
                          "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM"})
    (dest / "config.json").write_text(json.dumps(conf))
    return dest


def test_load_model_passes_trust_remote_code(tiny_target, tmp_path):
    """Issue 14: target.load_model had no trust_remote_code, so a checkpoint with its own modeling
    code (Kimi-K2.5) could not be loaded by extract or evaluate. Refused without the key, loaded
    with it, as the checkpoint's own class, in the dtype asked for."""
    import torch

    from eaglet.target.load import load_model

    ckpt = remote_code_checkpoint(tiny_target, tmp_path / "remote")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(ckpt)
    model = load_model(ckpt, dtype="bfloat16", trust_remote_code=True, device="cpu")
    assert type(model).__name__ == "RemoteLlamaForCausalLM" and model.dtype == torch.bfloat16
    assert not model.training
    assert load_tokenizer(ckpt, trust_remote_code=True).chat_template


def test_job_device_follows_the_gpus_the_job_was_given(monkeypatch):
    """target.device auto: cuda only when the job sees a GPU; an empty CUDA_VISIBLE_DEVICES (a job
    given none) is the CPU; cuda asked for without a GPU is refused, not silently the CPU."""
    import torch

    from eaglet.target.load import job_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert job_device("auto") == "cpu" and job_device("cpu") == "cpu"
    with pytest.raises(RuntimeError, match="target.device"):
        job_device("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert job_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_job_given_several_gpus_spreads_the_target_over_them():
    """Issue 45, every gate on at scale: an in-process stage (the exact chain, the regenerated scoring,
    the contract's acceptance chain) in a job given several GPUs loads the target over all of them
    (device_map auto, as extraction does); one GPU, the CPU or a map the caller chose stay as given.
    The several-GPU load itself runs only on a GPU machine (scripts/gpu-check.sh), not here."""
    from eaglet.target.load import placement

    assert placement("cuda", None, 8) == ("auto", None)
    assert placement("cuda", None, 1) == (None, "cuda")
    assert placement("cpu", None, 0) == (None, "cpu")
    assert placement("cuda", {"": 0}, 8) == ({"": 0}, "cuda")


def test_vllm_runner_arguments_come_from_the_config():
    """Issue 14: both vLLM runners hard-coded dtype float32 with no tensor parallelism or remote
    code. The flags are built from target.vllm + target.trust_remote_code (eaglet.target.load.serving)
    and each runner turns them into vllm.LLM's arguments; the defaults are the vLLM-CPU ones."""
    import argparse

    from eaglet.engines import vllm_check_runner, vllm_eval_runner
    from eaglet.target.load import serving, vllm_runner_args

    kimi = serving({"trust_remote_code": True,
                    "vllm": {"tensor_parallel_size": 8, "enable_expert_parallel": True, "dtype": "bfloat16"}})
    flags = vllm_runner_args(kimi)
    assert flags == ["--dtype", "bfloat16", "--tensor-parallel-size", "8", "--enable-expert-parallel",
                     "--trust-remote-code"]
    assert vllm_runner_args(serving({})) == ["--dtype", "float32", "--tensor-parallel-size", "1"]
    base = ["--target", "/m", "--out", "o.json"]
    a = vllm_eval_runner.parse_args(base + ["--input", "i.json"] + flags)
    # the runner holds one engine per configuration: the drafter's k is added per engine, as main() does
    kw = vllm_eval_runner.engine_kwargs(argparse.Namespace(**{**vars(a), "k": 3}), "/d")
    assert (kw["dtype"], kw["tensor_parallel_size"], kw["enable_expert_parallel"], kw["trust_remote_code"]) == \
        ("bfloat16", 8, True, True)
    assert kw["speculative_config"] == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    b = vllm_check_runner.parse_args(base + ["--prompts", "p.json"] + flags)
    kw = vllm_check_runner.engine_kwargs(b, None)
    assert (kw["dtype"], kw["tensor_parallel_size"], kw["trust_remote_code"]) == ("bfloat16", 8, True)
    assert "speculative_config" not in kw
    plain = vllm_check_runner.engine_kwargs(vllm_check_runner.parse_args(base + ["--prompts", "p.json"]))
    assert (plain["dtype"], plain["tensor_parallel_size"], plain["trust_remote_code"]) == ("float32", 1, False)
    assert "enable_expert_parallel" not in plain
    assert isinstance(a, argparse.Namespace)


# --------------------------------------------------------------------------- identity facts
def _identity(conf, tmp_path):
    from safetensors.torch import save_file

    conf.save_pretrained(tmp_path)
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")  # identity_of digests weights only
    return identity_of(tmp_path, "t", "test")


def test_identity_llama3_rope_scaling(tmp_path):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    i = _identity(LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=16384, rope_theta=500000.0,
                              rope_scaling=rope, architectures=["LlamaForCausalLM"]), tmp_path)
    assert i["rope_type"] == "llama3" and i["rope_parameters"]["factor"] == 8.0
    assert i["rope_theta"] == i["rope_parameters"]["rope_theta"] == 500000.0
    assert i["norm_class"] == "LlamaRMSNorm" and i["norm_kind"] == "rms" and not i["qk_norm"]
    assert i["hidden_act"] == i["activation"] == "silu" and i["embedding_scale"] == 1.0
    assert i["attention"] == "gqa" and i["mla"] is None and i["moe"] is None
    assert i["tie_word_embeddings"] is False and i["sliding_window"] is None
    for k in ("num_layers", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rms_norm_eps", "rope_theta", "hidden_act", "tie_word_embeddings",
              "digest", "path"):
        assert k in i, k


def test_identity_gemma3(tmp_path):
    from transformers import Gemma3TextConfig

    i = _identity(Gemma3TextConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, sliding_window=16,
                                   final_logit_softcapping=30.0, architectures=["Gemma3ForCausalLM"]), tmp_path)
    assert i["hidden_act"] == i["activation"] == "gelu_pytorch_tanh"  # hidden_activation, not Llama's silu
    assert i["norm_class"] == "Gemma3RMSNorm" and i["norm_kind"] == "rms_1p" and i["qk_norm"]
    assert i["embedding_scale"] == pytest.approx(64 ** 0.5)
    assert i["tie_word_embeddings"] is True and i["final_logit_softcapping"] == 30.0
    assert i["sliding_window"] == 16 and i["sliding_layers"] == 5
    by = i["rope_parameters_by_layer_type"]
    assert set(by) == {"full_attention", "sliding_attention"} and all(isinstance(v, dict) for v in by.values())
    assert i["rope_parameters"] == by["full_attention"] and i["rope_theta"] == by["full_attention"]["rope_theta"]
    assert all(not isinstance(v, dict) for v in i["rope_parameters"].values())  # flat: vLLM's get_rope can hash it


def test_identity_deepseek_v3_mla_moe_yarn(tmp_path):
    from transformers import DeepseekV3Config

    yarn = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    i = _identity(DeepseekV3Config(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                   moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                                   kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                   max_position_embeddings=163840, rope_scaling=yarn,
                                   architectures=["DeepseekV3ForCausalLM"]), tmp_path)
    assert i["attention"] == "mla" and i["mla"]["kv_lora_rank"] == 16 and i["mla"]["qk_rope_head_dim"] == 8
    assert i["moe"] == {"experts": 8, "experts_per_token": 2, "shared_experts": 1, "moe_intermediate_size": 32}
    assert i["rope_type"] == "yarn" and i["rope_parameters"]["factor"] == 40.0
    assert i["norm_class"] == "DeepseekV3RMSNorm" and i["norm_kind"] == "rms"


def test_identity_qwen3_moe(tmp_path):
    from transformers import Qwen3MoeConfig

    i = _identity(Qwen3MoeConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                 num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                 architectures=["Qwen3MoeForCausalLM"]), tmp_path)
    assert i["moe"]["experts"] == 8 and i["moe"]["experts_per_token"] == 2 and i["moe"]["shared_experts"] == 0
    assert i["qk_norm"] and i["norm_kind"] == "rms" and i["attention"] == "gqa"
    assert i["sliding_window"] is None  # use_sliding_window false: the field is not in force
