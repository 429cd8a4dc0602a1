"""Peak memory and disk of a config, stated before any job runs (issue 14).

    python -m eaglet.planner.plan --configfile config/kimi-k2.5.yaml [--target-config DIR/config.json] \
        [--target-bytes 547e9]

A run that dies of OOM after hours of generation and extraction costs more than a table read at
the start, so `snakemake -n` logs this module's one-line summary (workflow/rules/common.smk) and
stops a config whose training rank, extraction shard or vLLM server cannot fit
``resources.gpu_memory_gb`` (GiB per GPU), naming the key. Figures, per config:

- hidden states on disk: ``storage.bytes_per_token`` x tokens, per shard and in total; the
  token count is bounded by ``prompts.n x tokenize.max_length`` (and stated at 1,500 tokens per
  conversation, the typical length of a regenerated reply, as the Kimi config's comment does);
- training rank: the drafter's weights (fp32, frozen target embedding included), gradients, AdamW
  state, DDP gradient buckets (gpus > 1), the target's head rows (labels), one micro-batch at
  ``train.token_budget`` in its worst shape (the longest samples, T = min(max_length, budget)),
  the tensors the TTT unroll keeps for backward, and the backward's largest transient;
- extraction shard, per GPU: the target's weights over ``gpus_per_shard`` GPUs (``device_map``)
  plus one forward at ``extract.token_budget``: the captured states and the largest per-layer
  transient (MLP or routed experts). An estimate from shapes, not measured;
- vLLM server, per GPU: what vLLM reserves (``--gpu-memory-utilization`` x the GPU) and the
  target's weights over ``tensor_parallel_size`` inside it; the rest is its KV cache.

The training figure is a census of the tensors autograd keeps, per token and TTT step, checked
against a measured peak of a real training step at small shapes (tests/planner/test_plan.py: within 15 %,
fp32 on the CPU and bf16 autocast, as CUDA runs it). It assumes ``ttt_unroll``'s attention as
written when this was measured (``TTT_ATTENTION = "scores"``): step 0 through SDPA (flash: q, k, v,
output and log-sum-exp kept), steps >= 1 materialising the softmax weights [B, h, T, T+k] of every
query over the step-0 keys (fp32, plus a bf16 copy under autocast). Those weights grow as T^2 and
dominate at long T; an O(T) formulation drops them (``attention="recompute"``), and the census test
fails at the quadratic shape until ``TTT_ATTENTION`` says which one the code uses.

The O(T) attention runs two ways (issue 43, ``train.ttt_attention``): ``recompute`` (each query chunk
recomputed in backward: nothing T-wide kept) or ``saved`` (every chunk's softmax weights kept for
backward: about half the dense form's, and no recompute; 1.02-1.06x faster steps where they are small).
``choose_ttt_attention`` plans both and takes ``saved`` where its training rank fits the memory it has
(``resources.gpu_memory_gb`` on a GPU, the machine's memory on the CPU), ``recompute`` otherwise;
`snakemake -n` says which and why, and the trainer runs it. Both are checked against measured peaks.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import NamedTuple

from eaglet.base import schema
from eaglet.base.capability import resolve_autocast
from eaglet.planner.shapes import GIB, TYPICAL_TOKENS, drafter_params, target_shapes

CONTEXT_GIB = 1.0       # per GPU process, outside PyTorch's allocator: CUDA context + cuBLAS workspace
TTT_ATTENTION = "recompute"  # the code's default, and the plan's without a memory figure
# Bytes kept for backward by one TTT step, per token, by what they scale with (census of
# ttt_unroll + TTTObjective's saved tensors). H: norms' inputs and outputs, the cat(embed, hidden)
# input of q/k/v (one bf16 cast per projection under autocast), residuals; I: the MLP's four;
# q: (4 + k) x heads*head_dim (q, k, v, attention output, and step k's stack of k diagonal values);
# d: RoPE cos/sin; V: the loss's log-softmax (fp32 always); one: three rsqrt columns.
SAVED = {"float32": {"H": 40, "I": 16, "q": 4, "d": 8, "V": 4, "one": 12},
         "bfloat16": {"H": 38, "I": 8, "q": 2, "d": 4, "V": 4, "one": 12}}
SCORES_BYTES = {"float32": 4, "bfloat16": 6}  # softmax weights per element (+ bf16 copy under autocast)
# their backward's transient per element: the weights' gradient and the softmax backward's product
SCORES_GRAD_BYTES = {"float32": 10, "bfloat16": 4}
# The O(T) attention (model.ttt_attention; "recompute"): query chunks of TTT_QUERY_CHUNK recomputed one at
# a time in backward, so the only T-wide tensors are one chunk's scores [B, h, C, <=T+k], its masked
# copy, the concatenation with the diagonal scores, the fp32 softmax and their gradients, alive together
# for the last chunk (C x T). Bytes per element of that chunk, from the measured census (tests/planner/test_plan.py).
# = eaglet.drafter.ttt_attention.TTT_QUERY_CHUNK (asserted by tests/planner/test_plan.py; no torch import here)
TTT_QUERY_CHUNK = 256
CHUNK_BYTES = {"float32": 14, "bfloat16": 10}
# "saved" keeps every chunk's weights (SCORES_BYTES per element, counted in the activations); backward's
# transient is then one chunk's gradients only, no recomputed forward
SAVED_CHUNK_BYTES = {"float32": 8, "bfloat16": 6}


# --------------------------------------------------------------------------- training
def _chunks(T: int) -> list[tuple[int, int]]:
    """The query chunks of ``ttt_attention``: (queries C, keys hi) of each, queries lo..hi-1 over keys 0..hi-1."""
    return [(min(T, lo + TTT_QUERY_CHUNK) - lo, min(T, lo + TTT_QUERY_CHUNK)) for lo in range(0, T, TTT_QUERY_CHUNK)]


def ttt_activations(B: int, T: int, s: dict, draft_vocab_size: int, steps: int, dtype: str,
                    attention: str = TTT_ATTENTION) -> dict:
    """Bytes the TTT unroll keeps for backward over a [B, T] micro-batch (module docstring)."""
    c, N, Vd = SAVED[dtype], B * T, draft_vocab_size
    H, Im, d, h = s["hidden_size"], s["intermediate_size"], s["head_dim"], s["num_heads"]
    linear = 0
    scores = 0
    for k in range(steps):
        # the dense and the saved chunks also keep step k's stack of k diagonal values; the recomputed ones do not
        kept = 4 + (k if attention in ("scores", "saved") else 0)
        linear += N * (c["H"] * H + c["I"] * Im + c["q"] * kept * h * d + c["d"] * d + c["one"])
        linear += 4 * B * max(0, T - 2 - k) * Vd
        if k and attention == "scores":
            scores += SCORES_BYTES[dtype] * B * h * T * (T + k)
        elif k and attention == "saved":  # every chunk's softmax weights over keys 0..hi-1 (+ k), and its mask
            scores += sum(SCORES_BYTES[dtype] * B * h * C * (hi + k) + C * hi for C, hi in _chunks(T))
    # once: g = fc(aux) (fp32), or under autocast the bf16 casts of aux and of the weights
    once = 4 * N * H if dtype == "float32" else 2 * 3 * N * H + 2 * drafter_params(s, Vd)["cast"]
    once += 4 * B * h * T + (2 * T * T if attention == "scores" else 0)  # step 0's log-sum-exp, the causal masks
    return {"per_token_steps": linear, "attention_scores": scores, "once": once}


def _attention_transient(B: int, T: int, h: int, K: int, dtype: str, attention: str) -> int:
    """Backward's largest attention transient: the whole softmax weights' gradient (scores) or one
    query chunk's, recomputed (linear) or from its kept weights (saved)."""
    if attention == "scores":
        return SCORES_GRAD_BYTES[dtype] * B * h * T * (T + K)
    # chunk i holds queries lo..hi-1 over keys 0..hi-1 (+ its diagonals): the widest is not always the last
    widest = max(C * (hi + K) for C, hi in _chunks(T))
    per = CHUNK_BYTES if attention == "recompute" else SAVED_CHUNK_BYTES
    return per[dtype] * B * h * widest if K > 1 else 0


# train.* keys that do not change what a training run computes, written once for the workflow (kept
# out of the train rule's params: no rerun, no other cache key) and the trainer (kept out of its
# checkpoints' identity, eaglet.train.setup.run_identity): how often a checkpoint is written and how
# many are kept (writing one draws no random number and changes no state), the gates of the label
# check and of train.init_from's vocabulary overlap (whether the run may start, not what it computes),
# and the TTT attention's memory path (the same values and gradients either way, tested).
TRAIN_NOT_DEFINING = ("checkpoint_every", "keep_checkpoints", "label_min_agreement", "accept_unchecked_labels",
                      "init_min_overlap", "ttt_attention")


def bf16_autocast(setting: str, on_gpu: bool, flags: set[str] | None = None) -> bool:
    """``train.autocast`` resolved: "bfloat16" = always, "float32" = never, "auto" = on a GPU and
    on a CPU with bf16 units (eaglet.base.capability.resolve_autocast; ``flags``: the CPU's, default
    this machine's). The trainer's rule (eaglet.train.loop.autocast_on) and the memory plan's."""
    return resolve_autocast(setting, on_gpu, flags)[0] == "bfloat16"


def machine_memory() -> int:
    """Bytes of this machine's memory (a CPU training rank's budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_ttt_attention(config: dict, s: dict | None, cpu_bytes: int | None = None) -> tuple[str, str]:
    """``train.ttt_attention`` resolved -> (recompute | saved, why). ``auto``: saved, the faster, where the
    training rank's peak with it fits what the rank has: ``resources.gpu_memory_gb`` on a GPU, this
    machine's memory on the CPU (``cpu_bytes``, default :func:`machine_memory`); recompute where it does
    not, on a GPU without a declared memory, and before the target's shapes are known (``s`` None)."""
    want = config["train"].get("ttt_attention", schema.default("train.ttt_attention"))
    if want != "auto":
        return want, f"train.ttt_attention: {want}"
    if s is None:
        return TTT_ATTENTION, "auto: the target's shapes are known once target_model has built it"
    gpu = int(config["train"].get("gpus") or 0) > 0
    gib = (config.get("resources") or {}).get("gpu_memory_gb")
    if gpu and gib is None:
        return TTT_ATTENTION, ("auto: no resources.gpu_memory_gb to check the saved weights against "
                               "(declare it to let the plan choose)")
    cap = gib * GIB if gpu else (cpu_bytes or machine_memory())
    where = f"resources.gpu_memory_gb {gib}" if gpu else f"this machine's {cap / GIB:.1f} GiB"
    peak = {a: training_rank(config, s, a)["peak"] for a in ("saved", "recompute")}
    figures = f"a training rank {peak['saved'] / GIB:.2f} GiB saved, {peak['recompute'] / GIB:.2f} GiB recomputed"
    if peak["saved"] <= cap:
        return "saved", f"auto: {figures}; saved fits {where}"
    return "recompute", f"auto: {figures}; saved does not fit {where}"


def training_rank(config: dict, s: dict, attention: str = TTT_ATTENTION) -> dict:
    """Peak bytes of one training rank (module docstring), by part."""
    t, Vd = config["train"], int(config["vocab"]["draft_vocab_size"])
    gpu = int(t.get("gpus") or 0) > 0
    dtype = "bfloat16" if bf16_autocast(t.get("autocast", schema.default("train.autocast")), gpu) else "float32"
    budget, max_len = int(t["token_budget"]), int(config["tokenize"]["max_length"])
    T = min(max_len, budget)
    B = max(1, budget // T)
    N, H, V = B * T, s["hidden_size"], s["vocab_size"]
    p = drafter_params(s, Vd)
    act = ttt_activations(B, T, s, Vd, int(t["ttt_steps"]), dtype, attention)
    greedy = t.get("oov_rule", schema.default("train.oov_rule")) == "greedy"
    rest = (V - Vd) * H * (2 if gpu else 4) if greedy and V > Vd else 0
    parts = {
        "weights": 4 * (p["frozen"] + p["trainable"]),
        "gradients": 4 * p["trainable"],
        "optimizer": 8 * p["trainable"],  # AdamW: exp_avg, exp_avg_sq (fp32)
        "ddp_buckets": 4 * p["trainable"] if int(t.get("gpus") or 0) * int(t.get("nodes") or 1) > 1 else 0,
        "target_head": 4 * (Vd * H + H) + rest,
        "batch": N * (8 + 2 + 4 * 3 * H + 4 * H + 4 * Vd) + (12 * N * H if t.get("noise_std") else 0),
        "activations": sum(act.values()),
        # backward of the last step's loss: d(lp) and d(logits) [N, V_d] fp32; or of its
        # softmax weights [B, h, T, T+K]; or of one recomputed query chunk (linear)
        "backward_transient": max(8 * N * Vd, _attention_transient(B, T, s["num_heads"], int(t["ttt_steps"]),
                                                                   dtype, attention)),
        "context": int(CONTEXT_GIB * GIB) if gpu else 0,
    }
    if t.get("hidden_states") == "online":  # the target runs in the rank (eaglet.train.online), no grad
        parts.update(online_target(config, s, N))
    return {"shape": {"B": B, "T": T, "tokens": N, "dtype": dtype, "attention": attention},
            "parts": parts, "activation_parts": act, "params": p, "peak": sum(parts.values())}


def dflash_params(s: dict, layers: int, n_taps: int = 3) -> int:
    """Trainable parameters of a DFlash drafter (eaglet.drafter.dflash) on a target of shapes ``s``:
    fc over the taps, the norms, ``layers`` Qwen3 layers; the embedding and head are the target's."""
    H, h, g, d, Im = s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["intermediate_size"]
    layer = H * d * (2 * h + 2 * g) + 3 * H * Im + 2 * H + 2 * d
    return n_taps * H * H + 2 * H + layers * layer


def dflash_training_rank(config: dict, s: dict) -> dict:
    """Peak bytes of one DFlash training rank (eaglet.train.dflash_train), by part, in the worst shape of
    a micro-batch (B sequences of T = min(max_length, token_budget) tokens, every position supervised,
    drafter.dflash.num_anchors anchors each): the drafter's weights, gradients and AdamW state; the
    target's embedding and head (fp32 copies, frozen); the batch (the taps in fp32); what autograd keeps
    of the context (T keys a sequence) and of the A x K block queries per layer; the attention's
    [Q, T + Q] mask and scores; and the loss: the head's logits at the B x A x (K - 1) counted positions
    over the whole vocabulary, the cross-entropy's log-softmax, and backward's gradient of them. A census
    checked against a measured step (tests/planner/test_plan.py, within 20 %)."""
    t, dd = config["train"], config["drafter"]["dflash"]
    gpu = int(t.get("gpus") or 0) > 0
    bf16 = bf16_autocast(t.get("autocast", schema.default("train.autocast")), gpu)
    budget, max_len = int(t["token_budget"]), int(config["tokenize"]["max_length"])
    T = min(max_len, budget)
    B = max(1, budget // T)
    K, layers = int(dd["block_size"]), int(dd["num_layers"])
    A = max(1, min(int(dd.get("num_anchors", schema.default("drafter.dflash.num_anchors"))), T - K + 1))
    H, V, h, g, d, Im = (s["hidden_size"], s["vocab_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"],
                         s["intermediate_size"])
    N, Q = B * T, A * K            # context tokens; block queries a sequence
    NQ, L, Nc = B * Q, T + Q, B * A * (K - 1)
    a = 2 if bf16 else 4           # bytes of an activation under autocast, else fp32
    P = dflash_params(s, layers)
    heads_kv = h if h != g else g  # keys and values repeated to every query head (GQA)
    per_query = layers * (a * (6 * H + 4 * Im + 8 * h * d + 6 * g * d) + 4 * 4 * H) + 4 * 3 * H
    per_key = layers * (a * 2 * (g + heads_kv) * d)
    context = N * (4 * 3 * H + layers * a * 6 * g * d)
    # the bool mask [B, Q, T + Q] and the attention's log-sum-exp: SDPA's CPU/flash kernels keep no scores
    attention = B * Q * L + layers * B * h * Q * 4
    parts = {
        "weights": 4 * P + 2 * 4 * V * H,
        "gradients": 4 * P,
        "optimizer": 8 * P,
        "ddp_buckets": 4 * P if int(t.get("gpus") or 0) * int(t.get("nodes") or 1) > 1 else 0,
        "batch": N * (4 * 3 * H + 8 + 8 + 1),
        "activations": NQ * per_query + B * L * per_key + context + attention,
        # the cross-entropy's log-softmax [counted positions, V] kept for backward (the logits are
        # not), with the counted hidden rows; backward's transient: the gradients of the log-softmax
        # and of the logits (+ the bf16 logits' under autocast), the peak beside the kept one
        "loss": Nc * V * 4 + Nc * H * 4,
        "backward_transient": Nc * V * (8 + (2 if bf16 else 0)),
        "context": int(CONTEXT_GIB * GIB) if gpu else 0,
    }
    return {"shape": {"B": B, "T": T, "tokens": N, "anchors": A, "block_size": K, "counted": Nc,
                      "dtype": "bfloat16" if bf16 else "float32"},
            "parts": parts, "params": P, "peak": sum(parts.values())}


def online_target(config: dict, s: dict, N: int) -> dict:
    """What ``train.hidden_states: online`` adds to a training rank: the whole target's weights (one
    copy per rank; unknown weights count 0 and the table says "?") and one no-grad forward over a
    micro-batch of N tokens, estimated as extraction's (its captured states, residual stream and
    largest per-layer transient, in ``target.dtype``)."""
    fwd = _forward_parts(config, s, N)
    return {"target_weights": int(s["weight_bytes"] or 0), **{f"target_{k}": v for k, v in fwd.items()}}


def _forward_parts(config: dict, s: dict, N: int) -> dict:
    b = 4 if config["target"].get("dtype", schema.default("target.dtype")) == "float32" else 2
    H = s["hidden_size"]
    moe = s["experts_per_token"] * (H + 3 * s["moe_intermediate_size"])
    transient = max(3 * s["intermediate_size"], moe, 4 * s["num_heads"] * s["head_dim"])
    return {"captured_states": 8 * N * H * b, "residual_stream": 2 * N * H * b, "layer_transient": N * transient * b}


# --------------------------------------------------------------------------- the other jobs
def extraction_shard(config: dict, s: dict) -> dict:
    """Peak bytes per GPU of an extraction shard: the target's weights split over the shard's GPUs
    and one no-grad forward at ``extract.token_budget``, all of its activations counted on one GPU
    (conservative: device_map puts them with the layers that make them). Estimated, not measured:
    the captured states (3 aux + final, and the stacked copies written out), the residual stream,
    and the largest per-layer transient: the dense MLP, the routed experts' gathered inputs and
    intermediates, or q/k/v/output with memory-efficient attention (SDPA)."""
    e = config["extract"]
    gpus = int(e.get("gpus_per_shard") or 0)
    w = s["weight_bytes"]
    parts = {"weights": None if w is None else -(-w // max(1, gpus)),
             **_forward_parts(config, s, int(e["token_budget"])), "context": int(CONTEXT_GIB * GIB) if gpus else 0}
    return {"gpus": gpus, "parts": parts, "peak": None if w is None else sum(parts.values())}


def _vllm_utilization(args: list[str]) -> float:
    """``--gpu-memory-utilization`` from the server's extra args (vLLM's default 0.9)."""
    for i, a in enumerate(args):
        if a.startswith("--gpu-memory-utilization"):
            return float(a.split("=", 1)[1] if "=" in a else args[i + 1])
    return 0.9


def vllm_server(config: dict, s: dict, gpu_gib: float | None) -> dict | None:
    """Per GPU of the generation server: vLLM reserves utilization x the GPU up front and puts the
    target's weights (split by tensor parallelism) inside it; what is left is its KV cache."""
    g = schema.defaults("generate") | config.get("generate", {})
    if not g["enabled"] or g["backend"] != "vllm":
        return None
    v = g.get("vllm", {})
    tp = int((config["target"].get("vllm") or {}).get("tensor_parallel_size") or 1)
    util = _vllm_utilization(list(v.get("extra_args") or []))
    w = s["weight_bytes"]
    reserved = None if gpu_gib is None else int(util * gpu_gib * GIB)
    weights = None if w is None else -(-w // tp)
    kv = None if reserved is None or weights is None else reserved - weights
    return {"tensor_parallel_size": tp, "utilization": util, "reserved": reserved, "weights": weights,
            "kv_cache": kv, "peak": reserved}


def hidden_states(config: dict, s: dict) -> dict:
    """Disk bytes of the extracted hidden states (hidden_store's format), bounded and typical."""
    from eaglet.hidden.dtypes import bytes_per_token

    per_tok = bytes_per_token(config["extract"]["dtype"], s["hidden_size"])
    n, max_len, shards = int(config["prompts"]["n"]), int(config["tokenize"]["max_length"]), \
        int(config["extract"]["shards"])
    upper, typical = n * max_len * per_tok, n * min(TYPICAL_TOKENS, max_len) * per_tok
    return {"bytes_per_token": per_tok, "max_tokens": n * max_len, "total": upper,
            "per_shard": -(-upper // shards), "typical_total": typical, "shards": shards}


# --------------------------------------------------------------------------- the plan
def make_plan(config: dict, target_config: str | Path | None = None,
              target_bytes: float | None = None, attention: str | None = None) -> dict:
    """Every figure for a validated config (bytes; None where the target's weights are unknown).
    ``attention``: the TTT attention to plan (default: :func:`choose_ttt_attention`'s choice)."""
    s = target_shapes(config, target_config, target_bytes)
    gpu_gib = (config.get("resources") or {}).get("gpu_memory_gb")
    why = "as asked"
    if attention is None:
        attention, why = choose_ttt_attention(config, s)
    if (config.get("drafter") or {}).get("kind") == "dflash":  # its own trainer, its own census
        train = dflash_training_rank(config, s)
    else:
        train = training_rank(config, s, attention) | {"attention_why": why}
    return {"target": s, "gpu_memory_gb": gpu_gib, "hidden_states": hidden_states(config, s),
            "online": config["train"].get("hidden_states") == "online",
            "train": train,
            "extract": extraction_shard(config, s), "vllm": vllm_server(config, s, gpu_gib)}


def refusals(p: dict, config: dict) -> list[str]:
    """Why the config cannot fit ``resources.gpu_memory_gb``, one sentence per job (empty: fits)."""
    gib = p["gpu_memory_gb"]
    if gib is None:
        return []
    cap, out = gib * GIB, []
    t = p["train"]
    if int(config["train"].get("gpus") or 0) > 0 and t["peak"] > cap:
        big = max(t["parts"], key=t["parts"].get)
        dflash = "anchors" in t["shape"]
        fix = ("train.hidden_states online puts the whole target on every rank: train offline (storage.budget_gb)"
               if big == "target_weights" else
               "train.ttt_attention: auto or recompute keeps no attention weights for backward"
               if big == "activations" and t["shape"].get("attention") == "saved" else
               "lower drafter.dflash.num_anchors or train.token_budget (the loss's logits over the whole "
               "vocabulary scale with both)" if dflash else
               "lower train.token_budget (raise train.grad_accum to keep the step)")
        out.append(f"a training rank needs {t['peak'] / GIB:.1f} GiB (largest: {big} "
                   f"{t['parts'][big] / GIB:.1f} GiB; {shape_words(t['shape'])}): {fix}")
    e = p["extract"]
    if e["gpus"] > 0 and e["peak"] is not None and e["peak"] > cap and not p.get("online"):
        out.append(f"an extraction shard needs {e['peak'] / GIB:.1f} GiB per GPU: raise "
                   "extract.gpus_per_shard or lower extract.token_budget")
    v = p["vllm"]
    if v and v["kv_cache"] is not None and v["kv_cache"] <= 0:
        out.append(f"the vLLM server's weights ({v['weights'] / GIB:.1f} GiB per GPU) fill its "
                   f"{v['utilization']:.2f} x {gib} GiB: raise target.vllm.tensor_parallel_size")
    return out


def shape_words(shape: dict) -> str:
    """A training rank's micro-batch shape, as the plan's lines say it."""
    if "anchors" in shape:  # drafter.kind dflash
        return (f"B={shape['B']} x T={shape['T']}, DFlash {shape['anchors']} anchors x block {shape['block_size']}, "
                f"{shape['counted']:,} counted positions")
    return f"attention '{shape['attention']}' at B={shape['B']}, T={shape['T']}"


def check(p: dict, config: dict) -> None:
    """Raise ValueError naming resources.gpu_memory_gb when a job cannot fit it."""
    why = refusals(p, config)
    if why:
        raise ValueError(f"resources.gpu_memory_gb: {p['gpu_memory_gb']} GiB per GPU is too small: "
                         + "; ".join(why))


def _parse_time_config(config: dict, workdir: str | Path = ".") -> tuple[Path, bool]:
    """(the target's config.json, whether it is target.path's) for the parse-time plan."""
    t = config["target"]
    path = t.get("path") if t.get("tiny") is None else None
    conf = Path(path) / "config.json" if path else Path(workdir) / "resources/targets" / t["name"] / "model/config.json"
    return conf, bool(path)


def parse_time_shapes(config: dict, workdir: str | Path = ".") -> dict | None:
    """The target's shapes at parse time (target_shapes), or None before a built target exists."""
    conf, own = _parse_time_config(config, workdir)
    return target_shapes(config, None if own else conf) if conf.is_file() else None


def parse_time(config: dict, workdir: str | Path = ".") -> list[str]:
    """The plan's line for `snakemake -n`; raises ValueError naming the key when a job cannot fit.
    A built or GGUF target is planned once target_model has written its checkpoint."""
    conf, own = _parse_time_config(config, workdir)
    if not conf.is_file():
        return ["memory plan: after the first job (target_model) writes the target's config.json"]
    from eaglet.planner.text import summary_line

    p = make_plan(config, None if own else conf)
    check(p, config)
    return [summary_line(p)]


class HfPlan(NamedTuple):
    """Where evaluation runs the target in-process (eaglet.engines.hf_loop), decided at parse time.
    ``chain``: the untimed stages (the exact offline chain and its served-vs-simulated gate, the
    scoring along regenerated answers, the chat-template modes); ``timed``: the speculative loop's
    speed and losslessness (evaluate_speculative); ``gpus``: the GPUs each of those jobs holds
    (0 on a CPU build), the target spread over them by ``device_map`` when more than one."""

    chain: bool
    chain_why: str
    timed: bool
    timed_why: str
    gpus: int


def hf_loop(config: dict) -> HfPlan:
    """What evaluation runs of the in-process HF target, and why, from ``evaluate.hf_loop``.
    ``auto``: a target that fits one process runs every stage (on one GPU of a GPU build); a
    target served over several GPUs (``target.vllm.tensor_parallel_size`` > 1) by the GPU build
    runs the untimed stages spread over those GPUs (the ones the run already holds for vLLM), so
    the served-vs-simulated gate and the regenerated scoring stay on at scale, while the timed loop
    is not run (a target split layer by layer over GPUs times nothing a server serves); a target
    too big for one GPU that vLLM does not spread, or a several-GPU target on the CPU build, runs
    none. ``true`` runs everything (spread when tensor_parallel_size > 1); ``false`` runs none.
    Not run is recorded with the reason, never as a pass; `snakemake -n` says it."""
    want = config.get("evaluate", {}).get("hf_loop", schema.default("evaluate.hf_loop"))
    tp = int((config["target"].get("vllm") or {}).get("tensor_parallel_size") or 1)
    gpu_build = (config.get("generate", {}).get("vllm") or {}).get("package") == "vllm"
    gpus = (tp if tp > 1 else 1) if gpu_build else 0
    if want is True:
        why = "evaluate.hf_loop: true"
        return HfPlan(True, why, True, why, gpus)
    if want is False:
        why = "evaluate.hf_loop: false (the target is evaluated through vLLM only)"
        return HfPlan(False, why, False, why, 0)
    if tp > 1:
        if gpu_build:
            return HfPlan(True, f"evaluate.hf_loop auto: the target spread over the {tp} GPUs its vLLM engine "
                                f"holds (target.vllm.tensor_parallel_size {tp}, device_map auto)",
                          False, f"evaluate.hf_loop auto: target.vllm.tensor_parallel_size is {tp}: the timed "
                                 f"loop would split the target layer by layer over {tp} GPUs, which times "
                                 "nothing a server serves", tp)
        why = (f"evaluate.hf_loop auto: target.vllm.tensor_parallel_size is {tp}, the target needs "
               f"{tp} GPUs and the HF loop runs it in one process")
        return HfPlan(False, why, False, why, 0)
    t, gib = config["target"], config.get("resources", {}).get("gpu_memory_gb")
    path = Path(str(t.get("path"))) if t.get("path") and t.get("tiny") is None else None
    weights = sum(os.path.getsize(f) for f in path.glob("*.safetensors")) if path and path.is_dir() else 0
    if gib and weights > gib * GIB:
        why = (f"evaluate.hf_loop auto: the target's weights ({weights / GIB:.1f} GiB) exceed one GPU "
               f"(resources.gpu_memory_gb {gib})")
        return HfPlan(False, why, False, why, 0)
    why = "evaluate.hf_loop auto: the target fits one process"
    return HfPlan(True, why, True, why, gpus)


def main(argv: list[str] | None = None) -> None:
    from eaglet.planner.text import table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--configfile", required=True, help="a workflow config (validated and defaulted)")
    ap.add_argument("--target-config", default=None, help="the target's config.json (default: target.path's)")
    ap.add_argument("--target-bytes", type=float, default=None,
                    help="bytes of the target's weights (default: its *.safetensors files, when present)")
    ap.add_argument("--attention", choices=["scores", "recompute", "saved"], default=None,
                    help="TTT attention formulation to plan for (default: the one the plan chooses, "
                         "train.ttt_attention)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    config = load_config(a.configfile)
    p = make_plan(config, a.target_config, a.target_bytes, a.attention)
    print(json.dumps(p, indent=1) if a.json else table(p))
    why = refusals(p, config)
    if why:
        raise SystemExit("REFUSED: resources.gpu_memory_gb: " + "; ".join(why))


def load_config(path: str | Path) -> dict:
    """The config a run of ``snakemake --configfile path`` sees: the Snakefile's own
    ``config/config.yaml`` updated key by key with ``path`` (Snakemake's merge: the Kimi config
    inherits ``train.oov_rule: label`` from it), validated with the schema's defaults filled."""
    import yaml
    from snakemake.utils import update_config

    root = Path(__file__).resolve().parents[3]
    config = yaml.safe_load((root / "config/config.yaml").read_text())
    update_config(config, yaml.safe_load(Path(path).read_text()))
    return schema.validate(config)  # as workflow/rules/common.smk validates it


if __name__ == "__main__":
    main()
