"""vLLM's own DFlash module on given inputs, for the DFlash parity check (eaglet.export.contract.dflash_parity).

Run by the vLLM environment's interpreter (standard library, torch, safetensors and vllm only; no
eaglet import: this is the engine's side). For each case it builds ``DFlashQwen3ForCausalLM``
(vllm/model_executor/models/qwen3_dflash.py) under ``set_current_vllm_config`` from the export's
config.json, loads the export's model.safetensors through the model's own ``load_weights`` (names,
the q/k/v and gate/up stacking, the ``model.`` prefix), and computes what one drafting round of
vLLM's DFlashProposer computes, without an engine:

- ``fc``: ``combine_hidden_states(taps)`` of the context (positions 0 .. P−1);
- ``ctx_k`` / ``ctx_v`` [L, P, g, d]: what ``precompute_and_store_context_kv`` writes into each
  draft layer's KV cache (its own code runs; the cache write is intercepted);
- ``embed`` [K, H]: ``embed_input_ids`` of the block vLLM builds: the bonus token at P, then
  ``num_speculative_tokens`` copies of the mask token the module read from the config;
- ``layer_out`` [L, K, H] (the residual stream after each layer) and ``normed`` [K, H]: the block
  through vLLM's layers (its norms, qkv, q_norm/k_norm, rotary, o_proj, MLP), the attention over the
  cached context K/V plus the block's own K/V computed by a plain non-causal softmax (vLLM's
  attention op needs a forward context; the served path is the contract's engine check);
- ``logits`` = normed @ head.T (the target's head, given), ``aux_layers``: the target layers vLLM
  taps for this config (get_eagle3_aux_layers_from_config), ``mask_token_id``, ``causal`` per layer.

    envs/vllm/.venv/bin/python vllm_dflash_probe.py CASES.json
    # CASES.json: [{"drafter": DIR, "inputs": IN.safetensors, "out": OUT.safetensors,
    #               "k": num_speculative_tokens, "target_layers": L, "target_vocab": V}, ...]
    # IN: taps [P, N], bonus [1] (int64), embed [V, H], head [V, H]
    # OUT: the tensors above, metadata {"aux_layers", "mask_token_id", "causal"} as JSON
A case that raises writes OUT.error (the traceback) and the next case runs.
"""

import json
import sys
import tempfile
import traceback
from types import SimpleNamespace


class _Stub(SimpleNamespace):
    """A config stand-in: the attributes the model reads are set, any other reads as None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _vllm_config(conf_dir: str, k: int, target_layers: int, target_vocab: int, hf=None, **speculative):
    """vLLM's config stand-in for one drafter folder: ``hf`` its hf config (default: AutoConfig's
    reading of the folder), a speculative config of ``num_speculative_tokens`` k and ``speculative``
    (default: method dflash), the target's layer count and vocabulary. Shared with the P-EAGLE probe
    (eaglet.engines.vllm_p_eagle_probe, copied beside this file)."""
    import torch
    from transformers import AutoConfig
    from vllm.config import VllmConfig

    hf = hf if hf is not None else AutoConfig.from_pretrained(conf_dir)
    vc = VllmConfig()
    draft = _Stub(hf_config=hf, model=conf_dir, revision=None, dtype=torch.float32, quantization=None)
    object.__setattr__(vc, "speculative_config", _Stub(draft_model_config=draft, num_speculative_tokens=k,
                                                       **(speculative or {"method": "dflash"})))
    object.__setattr__(vc, "model_config", _Stub(get_total_num_hidden_layers=lambda: target_layers,
                                                 get_vocab_size=lambda: target_vocab, dtype=torch.float32,
                                                 max_model_len=int(hf.max_position_embeddings),
                                                 is_moe=False, is_mm_prefix_lm=False))
    return vc


def run_case(case: dict) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    inp = load_file(case["inputs"])
    vc = _vllm_config(case["drafter"], int(case["k"]), int(case["target_layers"]), int(case["target_vocab"]))
    with set_current_vllm_config(vc), torch.no_grad():
        m = DFlashQwen3ForCausalLM(vllm_config=vc)
        m.load_weights(load_file(f"{case['drafter']}/model.safetensors").items())
        # what vLLM's model loader does next (on the CPU: the linear layers' GEMM set-up)
        process_weights_after_loading(m, vc.model_config, torch.device("cpu"))
        emb = inp["embed"].float()
        m.model.embed_tokens.weight.data[: emb.shape[0]].copy_(emb)  # the target's, shared at serve time
        taps, P = inp["taps"].float(), inp["taps"].shape[0]
        fc = m.combine_hidden_states(taps)
        written = []

        class Recorder:  # stands in for a layer's Attention: receives the cache write
            kv_cache = None
            impl = SimpleNamespace(do_kv_cache_update=lambda attn, k, v, cache, slots: written.append(
                (k.clone(), v.clone())))

        m.model._attn_layers = [Recorder() for _ in m.model.layers]
        m.precompute_and_store_context_kv(fc.clone(), torch.arange(P), torch.arange(P))
        ctx_k = torch.stack([k for k, _ in written])  # L P g d
        ctx_v = torch.stack([v for _, v in written])

        mask_id = m.model.mask_token_id
        K = int(case["k"]) + 1
        ids = torch.tensor([int(inp["bonus"][0])] + [int(mask_id)] * (K - 1))
        pos = torch.arange(P, P + K)
        embed = m.embed_input_ids(ids)
        hidden, residual, outs = embed.clone(), None, []
        for i, layer in enumerate(m.model.layers):
            sa = layer.self_attn
            if residual is None:
                residual = hidden
                x = layer.input_layernorm(hidden)
            else:
                x, residual = layer.input_layernorm(hidden, residual)
            qkv, _ = sa.qkv_proj(x)
            q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
            q = sa.q_norm(q.reshape(K, -1, sa.head_dim)).reshape(K, -1)
            k = sa.k_norm(k.reshape(K, -1, sa.head_dim)).reshape(K, -1)
            q, k = sa.rotary_emb(pos, q, k)
            kk = torch.cat([ctx_k[i], k.reshape(K, -1, sa.head_dim)])  # P+K g d
            vv = torch.cat([ctx_v[i], v.reshape(K, -1, sa.head_dim)])
            rep = sa.num_heads // sa.num_kv_heads
            qh = q.reshape(K, sa.num_heads, sa.head_dim).transpose(0, 1)            # h K d
            kh = kk.transpose(0, 1).repeat_interleave(rep, 0)                      # h P+K d
            vh = vv.transpose(0, 1).repeat_interleave(rep, 0)
            att = ((qh @ kh.transpose(1, 2)) * sa.scaling).softmax(-1) @ vh       # non-causal
            o, _ = sa.o_proj(att.transpose(0, 1).reshape(K, -1))
            hidden, residual = layer.post_attention_layernorm(o, residual)
            hidden = layer.mlp(hidden)
            outs.append((hidden + residual).clone())
        normed, _ = m.model.norm(hidden, residual)
        logits = normed @ inp["head"].float().T
        meta = {"aux_layers": json.dumps(list(get_eagle3_aux_layers_from_config(vc.speculative_config) or [])),
                "mask_token_id": json.dumps(mask_id), "causal": json.dumps(m.get_draft_attn_causal())}
        save_file({"fc": fc.contiguous(), "ctx_k": ctx_k.contiguous(), "ctx_v": ctx_v.contiguous(),
                   "embed": embed.contiguous(), "layer_out": torch.stack(outs).contiguous(),
                   "normed": normed.contiguous(), "logits": logits.contiguous(), "ids": ids},
                  case["out"], metadata=meta)


def run_cases(cases_path: str, run_case, tag: str) -> None:
    """Every case of CASES.json through ``run_case`` in one interpreter (vLLM's distributed state set
    up once); a case that raises writes OUT.error and the next runs. Shared with the P-EAGLE probe."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    cases = json.loads(open(cases_path).read())
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mkstemp()[1])
        ensure_model_parallel_initialized(1, 1)
    for case in cases:
        try:
            run_case(case)
            print(f"eaglet-{tag}-probe: done", case["out"], flush=True)
        except Exception:
            with open(case["out"] + ".error", "w") as fh:
                fh.write(traceback.format_exc())
            print(f"eaglet-{tag}-probe: error", case["out"], flush=True)


def main(cases_path: str) -> None:
    run_cases(cases_path, run_case, "dflash")


if __name__ == "__main__":
    main(sys.argv[1])
