"""vLLM's own P-EAGLE module on given inputs, for the P-EAGLE parity check (eaglet.export.contract.p_eagle_parity).

Run by the vLLM environment's interpreter (standard library, torch, safetensors, transformers and vllm
only; no eaglet import: this is the engine's side). For each case it builds ``Eagle3LlamaForCausalLM``
(vllm/model_executor/models/llama_eagle3.py) under ``set_current_vllm_config`` from the export's
config.json, as vLLM serves it with ``{"method": "eagle3", "parallel_drafting": true,
"num_speculative_tokens": K}``: the hf config wrapped the way vLLM's SpeculativeConfig wraps an eagle3
drafter's (``EAGLEConfig(..., method="eagle3")``), a speculative config with ``parallel_drafting`` on (so
the module registers its ``mask_hidden`` buffer); it loads the export's model.safetensors through the
model's own ``load_weights`` (``midlayer.`` -> ``layers.0.``, the q/k/v and gate/up stacking, d2t ->
``draft_id_to_target_id``, ``mask_hidden`` into its buffer, the ``model.`` prefix), resolves the mask
token with the proposer's own ``_init_parallel_drafting_params`` (vllm/v1/spec_decode/llm_base_proposer.py:
``dflash_config.mask_token_id``, then top-level ``mask_token_id``, ...), and computes what one round of
vLLM's parallel-drafting proposer computes, without an engine, as one causal forward from scratch
(the KV cache of a served request holds the same real entries):

    entry p = 0 .. t      token ids[p] (x_{p+1}: vLLM's shifted input, the last the bonus), hidden
                          fc(aux_p), position p
    slot  d = 1 .. K − 1  the mask token, hidden fc(mask_hidden), position t + d

- ``fc`` [P, H]: ``combine_hidden_states(aux)`` of the real entries (input_norm first under
  norm_before_fc);
- ``mask_fc`` [H]: ``combine_hidden_states(mask_hidden.view(-1))``, what the proposer's load_model copies
  into every masked slot's hidden (llm_base_proposer, EAGLE-3 with aux hidden states);
- ``embed`` [P + K − 1, H]: ``embed_input_ids`` of [ids..., mask × (K − 1)] (the target's embedding,
  given: vLLM shares it at serve time, the export carries none);
- ``layer_out`` [P + K − 1, H] (the residual stream after the layer, pre-norm), ``normed`` and
  ``aux_out`` (``LlamaModel.forward``'s second output: normed under norm_output, else pre-norm): the
  inputs through the decoder layer's own submodules (input_layernorm, ``_residual_norm`` with
  hidden_norm, qkv_proj, rotary_emb, o_proj, post_attention_layernorm, mlp) and the model's norm, the
  attention a plain causal softmax (vLLM's attention op needs a forward context; the served path is the
  contract's engine checks);
- ``logits`` [K, V]: ``compute_logits`` of the K slots vLLM samples from (entry t and the mask slots):
  the target vocabulary, −inf outside the draft vocabulary's image under d2t;
- metadata: ``aux_layers`` (the target layers vLLM taps for this config,
  get_eagle3_aux_layers_from_config), ``mask_token_id``, ``parallel_drafting`` (the module's).

    envs/vllm/.venv/bin/python vllm_p_eagle_probe.py CASES.json
    # CASES.json: [{"drafter": DIR, "inputs": IN.safetensors, "out": OUT.safetensors,
    #               "k": num_speculative_tokens, "target_layers": L, "target_vocab": V}, ...]
    # IN: aux [P, N] (N = n_aux · H_t), ids [P] (int64), embed [V, H]
    # OUT: the tensors above and ids (the whole round's), metadata {"aux_layers", "mask_token_id",
    #      "parallel_drafting"} as JSON
A case that raises writes OUT.error (the traceback) and the next case runs.
"""

import json
import sys

# the DFlash probe's config stand-in and case loop, copied beside this file
# (eaglet.export.contract.dflash_parity.run_probe)
from vllm_dflash_probe import _Stub, _vllm_config, run_cases


def _eagle3_config(conf_dir: str, k: int, target_layers: int, target_vocab: int):
    """The stand-in for a P-EAGLE folder: its config wrapped as SpeculativeConfig wraps an eagle3
    drafter's (vllm/config/speculative.py), method eagle3 with parallel drafting, K drafts."""
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    hf = EAGLEConfig(AutoConfig.from_pretrained(conf_dir), method="eagle3", model_type="eagle")
    return _vllm_config(conf_dir, k, target_layers, target_vocab, hf=hf, method="eagle3", parallel_drafting=True)


def _mask_token_id(vc) -> int:
    """The proposer's parallel_drafting_token_id, by its own method on a stand-in proposer."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = _Stub(draft_model_config=vc.speculative_config.draft_model_config, pass_hidden_states_to_model=False)
    SpecDecodeBaseProposer._init_parallel_drafting_params(proposer)
    return int(proposer.parallel_drafting_token_id)


def run_case(case: dict) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    inp = load_file(case["inputs"])
    vc = _eagle3_config(case["drafter"], int(case["k"]), int(case["target_layers"]), int(case["target_vocab"]))
    with set_current_vllm_config(vc), torch.no_grad():
        m = Eagle3LlamaForCausalLM(vllm_config=vc)
        m.load_weights(load_file(f"{case['drafter']}/model.safetensors").items())
        # what vLLM's model loader does next (on the CPU: the linear layers' GEMM set-up)
        process_weights_after_loading(m, vc.model_config, torch.device("cpu"))
        emb = inp["embed"].float()
        m.model.embed_tokens.weight.data[: emb.shape[0]].copy_(emb)  # the target's, shared at serve time
        mask_id = _mask_token_id(vc)
        aux, P, K = inp["aux"].float(), inp["aux"].shape[0], int(case["k"])
        fc = m.combine_hidden_states(aux)
        mask_fc = m.combine_hidden_states(m.mask_hidden.view(-1))
        T = P + K - 1
        ids = torch.cat([inp["ids"].long(), torch.full((K - 1,), mask_id, dtype=torch.long)])
        pos = torch.arange(T)
        embed = m.embed_input_ids(ids)
        hidden = torch.cat([fc, mask_fc.reshape(1, -1).expand(K - 1, -1)])
        if len(m.model.layers) != 1:
            raise ValueError(f"{len(m.model.layers)} draft layers: the probe computes EAGLE-3's one")
        layer = m.model.layers[0]
        sa = layer.self_attn
        e = layer.input_layernorm(embed.clone())
        h, residual = layer._residual_norm(hidden_states=hidden.clone())
        x = torch.cat([e, h], dim=-1)
        qkv, _ = sa.qkv_proj(x)
        q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
        q, k = sa.rotary_emb(pos, q, k)
        rep = sa.num_heads // sa.num_kv_heads
        qh = q.reshape(T, sa.num_heads, sa.head_dim).transpose(0, 1)                            # h T d
        kh = k.reshape(T, sa.num_kv_heads, sa.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
        vh = v.reshape(T, sa.num_kv_heads, sa.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
        s = (qh @ kh.transpose(1, 2)) * sa.scaling
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))            # causal
        o, _ = sa.o_proj((s.softmax(-1) @ vh).transpose(0, 1).reshape(T, -1))
        h, residual = layer.post_attention_layernorm(o, residual)
        h = layer.mlp(h)
        layer_out = (h + residual).clone()
        normed, prenorm = m.model.norm(h, residual)
        aux_out = normed if m.model.norm_output else prenorm  # LlamaModel.forward's choice
        logits = m.compute_logits(normed[P - 1:])
        meta = {"aux_layers": json.dumps(list(get_eagle3_aux_layers_from_config(vc.speculative_config) or [])),
                "mask_token_id": json.dumps(mask_id), "parallel_drafting": json.dumps(bool(m.use_parallel_drafting))}
        out = {"fc": fc, "mask_fc": mask_fc.reshape(-1), "embed": embed, "layer_out": layer_out, "normed": normed,
               "aux_out": aux_out, "logits": logits, "ids": ids}
        # each its own copy: aux_out is normed or the pre-norm stream, which safetensors refuses to share
        save_file({n: t.contiguous().clone() for n, t in out.items()}, case["out"], metadata=meta)


def main(cases_path: str) -> None:
    run_cases(cases_path, run_case, "p-eagle")


if __name__ == "__main__":
    main(sys.argv[1])
