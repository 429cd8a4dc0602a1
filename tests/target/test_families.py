"""Tiny models of every target family (eaglet.target.families): each is what its family claims to be,
survives a save/reload, renders its own chat template, fits its vocab, and runs under extract's
Capture hooks with the same states as the model's own forward."""

import math

import pytest
import torch
import yaml

from conftest import REPO
from eaglet.data import target_model
from eaglet.features.extract import Capture
from eaglet.target import families
from eaglet.target.families import FAMILIES, build_tiny
from eaglet.target.load import load_model, load_tokenizer

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "And of Italy? Tell me more about its long history, please."},
        {"role": "assistant", "content": "Rome. It was the centre of the Roman Empire for centuries."}]

# Per family: the turn markers a rendered chat must hold, the text add_generation_prompt appends,
# and the text ending an assistant turn.
MARKERS = {
    "llama": (["<|im_start|>", "<|im_end|>"], "<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen2": (["<|im_start|>", "<|im_end|>"], "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3_moe": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_start|>assistant\n", "<|im_end|>"),
    "gemma3_text": (["<bos>", "<start_of_turn>", "<end_of_turn>"], "<start_of_turn>model\n", "<end_of_turn>"),
    "deepseek_v3": (["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                    "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "gpt_oss": (["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"], "<|start|>assistant",
                "<|return|>"),
}


@pytest.fixture(scope="module", params=FAMILIES)
def built(request):
    return request.param, *build_tiny(request.param)


def _ids(tok, messages=CHAT, **kw):
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def _pre_family_tiny_llama(tok):
    """target._build_model's tiny branch as it was before families existed (commit 027fd2e)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=False,
                       rope_theta=10000.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, hidden_size=128, num_hidden_layers=8,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    model = LlamaForCausalLM(conf)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.2)
    return model


def test_every_family_is_tested_and_in_the_schema():
    assert set(MARKERS) == set(FAMILIES)
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    fam = schema["properties"]["target"]["properties"]["tiny"]["properties"]["family"]
    assert fam["enum"] == list(FAMILIES) and "default" not in fam  # tiny is null by default (see schema)


def test_schema_accepts_each_family_and_refuses_others():
    import jsonschema

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    for fam in FAMILIES:
        jsonschema.validate({"run": "r", "target": {"name": "t", "tiny": {"family": fam, "seed": 3}}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="mistral"):
        jsonschema.validate({"run": "r", "target": {"name": "t", "tiny": {"family": "mistral"}}}, schema)


def test_unknown_family_names_the_key():
    with pytest.raises(ValueError, match="target.tiny.family"):
        build_tiny("mistral")


def test_llama_is_the_historical_tiny_model():
    model, tok = build_tiny("llama")
    ref = _pre_family_tiny_llama(tok)
    old, new = ref.state_dict(), model.state_dict()
    assert old.keys() == new.keys()
    assert all(torch.equal(old[k], new[k]) for k in old)
    assert model.config.to_diff_dict() == ref.config.to_diff_dict()


def test_save_reload_gives_identical_logits(built, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, model, tok = built
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert type(model2) is type(model)
    ids = _ids(tok)
    assert torch.equal(ids, _ids(tok2))
    assert tok2("hi there")["input_ids"] == tok("hi there")["input_ids"]  # same BOS behaviour
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    # Deterministic under the seed; another seed is another model (4 layers: cheaper, same code).
    one, again, other = (families.build_model(family, tok, seed=s, num_hidden_layers=4) for s in (0, 0, 1))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, one(ids).logits)
        assert not torch.allclose(other(ids).logits, one(ids).logits)


def test_chat_template_has_the_family_markers(built):
    family, model, tok = built
    markers, gen_prompt, turn_end = MARKERS[family]
    no_gen = tok.apply_chat_template(CHAT[:4], tokenize=False)
    gen = tok.apply_chat_template(CHAT[:4], tokenize=False, add_generation_prompt=True)
    assert gen.startswith(no_gen) and gen[len(no_gen):].startswith(gen_prompt), (no_gen, gen)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert full.rstrip().endswith(turn_end)
    think = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}]
    rendered = full + tok.apply_chat_template(think, tokenize=False)
    for m in markers:
        assert m in rendered, (family, m, rendered)
        # Every marker is one token of the vocabulary, never split into pieces.
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1, m
    assert rendered.count("What is the capital of France?") == 1


def test_tokenizer_fits_the_model(built):
    family, model, tok = built
    conf = model.config
    V = conf.vocab_size
    assert len(tok) <= V and model.get_output_embeddings().weight.shape[0] == V
    assert max(_ids(tok)[0].tolist()) < V
    assert max(tok.get_vocab().values()) < V
    assert tok.eos_token_id is not None and tok.eos_token_id < V
    assert tok.eos_token_id in (conf.eos_token_id if isinstance(conf.eos_token_id, list) else [conf.eos_token_id])
    stop = model.generation_config.eos_token_id
    stop = stop if isinstance(stop, list) else [stop]
    assert tok.convert_tokens_to_ids(MARKERS[family][2]) in stop  # generation stops at the turn end
    if family != "llama":
        spec = families.TOKENIZERS[family]
        assert conf.bos_token_id == (tok.bos_token_id if spec["bos"] else None)
        # BOS added on encode exactly where the family's tokenizer adds it (Llama 3, Gemma, DeepSeek).
        first = tok("hi")["input_ids"][0]
        assert (first == tok.bos_token_id) == spec["add_bos"] and (first == tok.bos_token_id) == (family in (
            "llama3", "gemma3_text", "deepseek_v3"))
    if V > len(tok):  # padded rows exist in the head but are never predicted
        assert V % 64 == 0 and not model.get_output_embeddings().weight[len(tok):].any()


def _rmsnorm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_family_features(built):
    family, model, tok = built
    conf, base = model.config, model.model
    attn0 = base.layers[0].self_attn
    if family in ("llama", "llama3"):
        assert conf.model_type == "llama"
    else:
        assert conf.model_type == family
    if family == "llama3":
        rope = conf.rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
        assert {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} <= set(rope)
        plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64)
        assert not torch.allclose(base.rotary_emb.inv_freq, plain)  # the scaling is applied
    if family == "qwen2":
        for p in ("q_proj", "k_proj", "v_proj"):
            assert getattr(attn0, p).bias is not None and getattr(attn0, p).bias.abs().sum() > 0
        assert attn0.o_proj.bias is None
    if family in ("qwen3", "qwen3_moe", "gemma3_text"):
        assert attn0.q_norm.weight.shape == (64,) and not torch.allclose(attn0.q_norm.weight, torch.ones(64))
        assert attn0.k_norm is not None
    if family == "qwen3_moe":
        assert conf.num_experts == 8 and conf.num_experts_per_tok == 2
        assert base.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    if family == "gemma3_text":
        assert conf.tie_word_embeddings and model.lm_head.weight is base.embed_tokens.weight
        assert conf.sliding_window == 16
        assert set(conf.layer_types) == {"sliding_attention", "full_attention"}
        rp = conf.rope_parameters
        assert rp["full_attention"]["rope_type"] == "linear" and rp["sliding_attention"]["rope_type"] == "default"
        ids = _ids(tok)
        emb = base.embed_tokens(ids)
        assert torch.allclose(emb, base.embed_tokens.weight[ids] * math.sqrt(conf.hidden_size))  # scaled
        x = torch.randn(3, conf.hidden_size)
        w, eps = base.norm.weight, conf.rms_norm_eps
        assert torch.allclose(base.norm(x), (1 + w) * _rmsnorm(x, eps), atol=1e-5)  # (1 + w) norm
        assert not torch.allclose(base.norm(x), w * _rmsnorm(x, eps), atol=1e-2)
        cap = conf.final_logit_softcapping
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            raw = model.lm_head(out.hidden_states[-1])
        assert cap and torch.allclose(out.logits, cap * torch.tanh(raw / cap), atol=1e-5)
        assert not torch.allclose(out.logits.softmax(-1), raw.softmax(-1), atol=1e-3)  # the cap matters
    if family == "deepseek_v3":
        # Latent 512 + rope 64: the only MLA size vLLM's CPU kernel serves.
        assert conf.kv_lora_rank == 512 and conf.q_lora_rank == 64 and hasattr(attn0, "kv_a_proj_with_mqa")
        assert conf.qk_rope_head_dim == 64 and conf.qk_nope_head_dim == 64 and conf.v_head_dim == 64
        rope = conf.rope_parameters
        assert rope["rope_type"] == "yarn" and rope["mscale_all_dim"] == 1.0 and rope["factor"] > 1
        # DeepSeek's YaRN: mscale == mscale_all_dim, so the rotary factor is 1 and the softmax scale
        # carries mscale(factor)^2 instead; the frequencies are interpolated.
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        assert attn0.scaling == pytest.approx((64 + 64) ** -0.5 * mscale ** 2)
        plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64)
        assert not torch.allclose(base.rotary_emb.inv_freq, plain)
        assert not hasattr(base.layers[0].mlp, "experts")  # first_k_dense_replace = 1
        assert base.layers[1].mlp.experts.gate_up_proj.shape[0] == conf.n_routed_experts == 8
        assert base.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    if family == "gpt_oss":
        assert conf.num_local_experts == 4 and base.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
        assert set(conf.layer_types) == {"sliding_attention", "full_attention"} and conf.sliding_window == 16
        assert conf.rope_parameters["rope_type"] == "yarn"
        assert attn0.sinks.abs().sum() > 0 and attn0.o_proj.bias.abs().sum() > 0
        assert base.layers[0].mlp.router.bias.abs().sum() > 0


def test_capture_matches_the_models_own_hidden_states(built):
    family, model, tok = built
    N = model.config.num_hidden_layers
    # Two samples, right-padded, both longer than Gemma's 16-token window.
    a = _ids(tok)[0]
    b = _ids(tok, CHAT[:3])[0]
    assert len(b) > 16 and len(a) > len(b)
    ids_BT = torch.zeros(2, len(a), dtype=torch.long)
    mask_BT = torch.zeros(2, len(a), dtype=torch.long)
    ids_BT[0], mask_BT[0] = a, 1
    ids_BT[1, :len(b)], mask_BT[1, :len(b)] = b, 1
    with torch.no_grad():
        ref = [model(x[None], output_hidden_states=True) for x in (a, b)]
        cap = Capture(model, list(range(1, N + 1)))
        try:
            pos = torch.tensor([0, 5, len(b) - 1])
            aux, final, ref_logits = cap(ids_BT, mask_BT, pos)
        finally:
            cap.remove()
        assert not model.model.norm._forward_hooks  # the hooks are gone
        for s, r in enumerate(ref):  # the real head ran at the reference positions (label proof)
            assert torch.allclose(ref_logits[s], r.logits[0, pos], atol=1e-4), family
        for s, (x, r) in enumerate(zip((a, b), ref)):
            T = len(x)
            for j in range(1, N):
                assert torch.allclose(aux[j - 1][s, :T], r.hidden_states[j][0], atol=1e-4), (family, j, s)
            # The final state is pre-norm: the model's own norm and head on it give its logits.
            assert torch.equal(aux[N - 1], final)
            assert torch.allclose(model.model.norm(final[s, :T]), r.hidden_states[N][0], atol=1e-4)
            logits = model.lm_head(model.model.norm(final[s, :T]))
            if model.config.get_text_config().to_dict().get("final_logit_softcapping"):
                c = model.config.final_logit_softcapping
                logits = c * torch.tanh(logits / c)
            assert torch.allclose(logits, r.logits[0], atol=1e-4), family


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_materialise_saves_the_family_model_and_tokenizer(family, tmp_path):
    ident = target_model.materialise({"name": "t", "tiny": {"family": family, "num_hidden_layers": 6}}, tmp_path)
    model_dir = tmp_path / "model"
    assert ident["model_type"] == family and ident["num_layers"] == 6
    tok = load_tokenizer(model_dir)
    assert tok.chat_template == families.TOKENIZERS[family]["template"]
    ref_model, ref_tok = build_tiny(family, num_hidden_layers=6)
    assert tok.get_vocab() == ref_tok.get_vocab()
    model = load_model(model_dir)
    ids = _ids(tok)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_model(ids).logits)
    stop = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids(MARKERS[family][2]) in stop


def test_materialise_default_tiny_is_unchanged(tmp_path):
    """No family key: the historical tiny Llama with the SmolLM2 tokenizer and template."""
    ident = target_model.materialise({"name": "t", "tiny": {}}, tmp_path)
    tok = load_tokenizer(tmp_path / "model")
    assert ident["model_type"] == "llama" and ident["vocab_size"] == len(tok) == 49152
    assert "<|im_start|>" in tok.chat_template
    model = load_model(tmp_path / "model")
    old = _pre_family_tiny_llama(tok).state_dict()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in old.items())
