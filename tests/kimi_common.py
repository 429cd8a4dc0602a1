"""A Kimi-K2.5-shaped target with no weights, for the tests that plan or dry-run the Kimi
configuration (test_kimi_config, test_plan, test_online)."""

import json
from pathlib import Path

NUM_LAYERS, HIDDEN, VOCAB = 61, 7168, 163840
KIMI_MARKERS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                "<think>", "</think>"]
# Kimi's chat format: role marker, role name, <|im_middle|>, content, <|im_end|>.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}"
)


def make_config_only_checkpoint(path: Path) -> Path:
    """config.json in Kimi-K2.5's layout (a DeepSeek-V3 text model inside a multimodal wrapper)
    plus a small word-level tokenizer with Kimi's special tokens; no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    text = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": NUM_LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB,
            "num_attention_heads": 64, "num_key_value_heads": 64, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8,
            "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 262144,
            "hidden_act": "silu", "tie_word_embeddings": False}
    conf = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "tie_word_embeddings": False, "dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(conf, indent=1))
    words = ["[UNK]", "[PAD]", "[BOS]", "[EOS]", "system", "user", "assistant", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]",
                                   unk_token="[UNK]", pad_token="[PAD]",
                                   additional_special_tokens=KIMI_MARKERS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path
