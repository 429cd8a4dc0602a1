"""SGLang's own EAGLE-3 loader run on an exported drafter, for the export contract's ``loader.sglang``.

Run by the SGLang environment's interpreter (``envs/sglang/.venv``, made by envs/sglang/setup.sh), not
eaglet's: it imports only the standard library, torch, safetensors and sglang. eaglet.export.contract.sglang_check
starts it and reads its JSON.

SGLang cannot serve on this CPU (its CPU kernels are not on PyPI), but its drafter class and its
``load_weights`` run in-process. The runner reads config.json with SGLang's own config reader, builds
``sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3`` on one gloo rank, fills every floating
parameter with NaN, and gives ``load_weights`` the file's tensors under the file's names, as SGLang's
model loader does, one name at a time. After each name it records which parameters and buffers
changed, element by element, and whether ``hot_token_id`` was set: what SGLang did, not what eaglet
thinks it does. Then each one is compared with the tensor the export means for it (eaglet's layout,
``expected_sources``).

    envs/sglang/.venv/bin/python src/eaglet/engines/sglang_loader_runner.py --drafter DIR --out result.json
    envs/sglang/.venv/bin/python src/eaglet/engines/sglang_loader_runner.py --selftest   # setup.sh's check

Output JSON: {"sglang_version", "torch_version", "dtype", "seconds",
  "params": {name: {"kind": "parameter" | "buffer" | "attribute", "shape", "from": [file names that
             changed it], "unset": elements no name wrote, "rewritten": elements written twice,
             "expected_from": [file names] | null, "equal": bool | null}},
  "names": {file name: [what it changed]}, "skipped_by_sglang": {file name: why},
  "reads": {config field: the value SGLang's model holds, null where it has no such attribute}}
"""

import argparse
import json
import os
import socket
import sys
import time
import types

# A name SGLang's load_weights skips on purpose (the target-to-draft map: SGLang reads d2t only)
SKIPPED = {"t2d": "SGLang reads d2t only (hot_token_id = d2t + arange); t2d is skipped on purpose"}
# Fused parameters: the export's shards, in the order the fused weight stacks them
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The drafter's config fields whose reading decides what SGLang's model computes (eaglet's variants)
READS = ("norm_before_fc", "norm_before_residual", "norm_output")


def _without_cuda_kernels():
    """Two imports SGLang makes for kernels the loader never calls, satisfied without CUDA.

    torchvision (SGLang's image models import it): PyPI's 0.28 is built against CUDA torch, so its
    ops do not load with the CPU torch and its import stops registering fake kernels for two of
    them; their schemas are declared here. vllm._custom_ops: on a machine with neither CUDA nor
    SGLang's CPU kernels, SGLang's rotary embedding imports vLLM's kernel at construction; it is only
    called in a forward, which the loader check never runs. Once per process: a runner forked from a
    server that did it (:func:`preload`) finds both in place."""
    import glob
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    ext = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")) if spec else []
    try:
        if ext and not hasattr(torch.ops.torchvision, "nms"):
            torch.ops.load_library(ext[0])
    except OSError:  # linked against CUDA torch
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _without_cuda_kernels.lib = lib  # a Library unregisters its ops when collected
    if "vllm" not in sys.modules:
        def rotary_embedding(*_a, **_k):
            raise RuntimeError("eaglet's SGLang loader check runs no forward: no rotary kernel here")

        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = rotary_embedding
        sys.modules["vllm"], sys.modules["vllm._custom_ops"] = types.ModuleType("vllm"), ops


def preload() -> None:
    """What a fork server of SGLang's venv does before it serves (eaglet.engines.forkserver; the suite's
    runs): the two stand-ins, then SGLang's drafter class and what :func:`load` imports (~7 s of CPU)."""
    import importlib

    _without_cuda_kernels()
    for name in ("safetensors", "sglang.srt.distributed.parallel_state", "sglang.srt.models.llama_eagle3",
                 "sglang.srt.runtime_context", "sglang.srt.server_args", "sglang.srt.utils.hf_transformers.config"):
        importlib.import_module(name)


def init_sglang(model_path: str) -> None:
    """The least SGLang needs to build a model in this process: its server arguments published (CPU),
    a one-rank gloo process group and its model-parallel groups."""
    _without_cuda_kernels()
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=model_path, device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")


def expected_sources(name: str, file_names) -> list[str] | None:
    """The export's tensors that SGLang's parameter ``name`` should hold, in eaglet's layout (docs/eagle3.md
    §6): the name without ``model.``, the decoder layer as ``midlayer.`` (or ``layers.0.``), a fused
    parameter as its shards in stacking order. None when the file has none of them."""
    base = name[len("model."):] if name.startswith("model.") else name
    spellings = [base, base.replace("layers.0.", "midlayer.")] if base.startswith("layers.0.") else [base]
    for fused, shards in FUSED.items():
        if f".{fused}." in base:
            spellings = [[s.replace(f".{fused}.", f".{shard}.") for shard in shards] for s in spellings]
            break
    else:
        spellings = [[s] for s in spellings]
    found = [srcs for srcs in spellings if all(s in file_names for s in srcs)]
    return found[0] if len(found) == 1 else None


def _bits(t):
    """A tensor's bits as integers, so that NaN compares equal to NaN."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t.detach()


def load(drafter: str) -> dict:
    t0 = time.time()
    init_sglang(drafter)
    import safetensors
    import sglang
    import torch
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.utils.hf_transformers.config import get_config

    with safetensors.safe_open(os.path.join(drafter, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    config = get_config(drafter, trust_remote_code=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as SGLang's loader builds the model in the serving dtype
    try:
        model = LlamaForCausalLMEagle3(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    entries = {n: ("parameter", p) for n, p in model.named_parameters()}
    entries.update({n: ("buffer", b) for n, b in model.named_buffers()})
    with torch.no_grad():
        for _, p in entries.values():
            if p.is_floating_point() and isinstance(p, torch.nn.Parameter):
                p.fill_(float("nan"))  # a parameter no name sets stays NaN, whatever its init was
    before = {n: _bits(t).clone() for n, (_, t) in entries.items()}
    written = {n: torch.zeros(t.shape, dtype=torch.bool) for n, (_, t) in entries.items()}
    rewritten = {n: torch.zeros(t.shape, dtype=torch.bool) for n, (_, t) in entries.items()}
    changed_by: dict[str, list[str]] = {n: [] for n in entries}
    names: dict[str, list[str]] = {}
    hot_from: list[str] = []
    with torch.no_grad():
        for fname, tensor in tensors.items():
            hot = model.hot_token_id
            model.load_weights([(fname, tensor)])  # SGLang's model loader yields (name in file, tensor)
            names[fname] = []
            for n, (_, t) in entries.items():
                now = _bits(t)
                diff = now != before[n]
                if diff.any():
                    rewritten[n] |= diff & written[n]
                    written[n] |= diff
                    before[n] = now.clone()
                    changed_by[n].append(fname)
                    names[fname].append(n)
            if model.hot_token_id is not hot:
                hot_from.append(fname)
                names[fname].append("hot_token_id")

    params = {}
    for n, (kind, t) in entries.items():
        src = expected_sources(n, tensors)
        want = torch.cat([tensors[s] for s in src], dim=0) if src else None
        params[n] = {"kind": kind, "shape": list(t.shape), "from": changed_by[n],
                     "unset": int((~written[n]).sum()), "rewritten": int(rewritten[n].sum()),
                     "expected_from": src, "equal": None if want is None else
                     bool(want.shape == t.shape and torch.equal(want.to(t.dtype), t))}
    d2t = [k for k in tensors if k.endswith("d2t")]
    hot = model.hot_token_id
    params["hot_token_id"] = {
        "kind": "attribute", "shape": list(hot.shape) if hot is not None else None, "from": hot_from,
        "unset": 0 if hot is not None else 1, "rewritten": max(len(hot_from) - 1, 0),
        "expected_from": d2t[:1] if len(d2t) == 1 else None,
        "equal": None if len(d2t) != 1 or hot is None else bool(
            torch.equal(hot, tensors[d2t[0]] + torch.arange(tensors[d2t[0]].shape[0])))}
    m = model.model
    reads = {f: getattr(m, f, None) for f in READS}
    reads.update(num_aux_hidden_states=m.num_aux_hidden_states, fc_norm=m.fc_norm is not None,
                 load_lm_head_from_target=model.load_lm_head_from_target,
                 lm_head_is_embedding=model.lm_head is m.embed_tokens,
                 draft_vocab_size=getattr(model.config, "draft_vocab_size", None))
    return {"sglang_version": sglang.__version__, "torch_version": torch.__version__, "dtype": str(dtype),
            "params": params, "names": names,
            "skipped_by_sglang": {k: SKIPPED[k] for k in tensors if k in SKIPPED and not names[k]},
            "reads": reads, "seconds": round(time.time() - t0, 1)}


def selftest() -> None:
    """setup.sh's check: SGLang's drafter class built on one rank from a minimal config."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 8,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                       "intermediate_size": 16, "vocab_size": 32, "draft_vocab_size": 16}, fh)
        init_sglang(d)
        import sglang
        import torch
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
        from sglang.srt.utils.hf_transformers.config import get_config

        n = sum(p.numel() for p in LlamaForCausalLMEagle3(get_config(d, trust_remote_code=False)).parameters())
    print(f"sglang {sglang.__version__}, torch {torch.__version__}: LlamaForCausalLMEagle3 built ({n} parameters)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", help="the exported drafter directory (config.json, model.safetensors)")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--selftest", action="store_true", help="only import SGLang's drafter class and set up its rank")
    a = p.parse_args(argv)
    if a.selftest:
        selftest()
        return
    res = load(a.drafter)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(res, fh)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
