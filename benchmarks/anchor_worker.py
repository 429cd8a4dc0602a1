"""The anchor half of benchmarks/bench_anchor.py: trains the speculators library's Eagle3 model class
on eaglet's micro-batches. Runs in envs/anchor/.venv (speculators' stack); never imports eaglet.

    envs/anchor/.venv/bin/python benchmarks/anchor_worker.py DIR

DIR (written by bench_anchor.py): ``plan.json`` (micro-batches of sample indices, validation
batches and steps, the recipe), ``samples.safetensors`` (per sample ``{i}.ids`` [n], ``{i}.mask``
[n], ``{i}.aux`` [n, 3H], ``{i}.final`` [n, H], read by eaglet's HiddenStateDataset) and
``heads.safetensors`` (the target's embedding, the draft-vocab rows of its head, its final norm,
d2t, t2d, as eaglet's trainer reads them). Writes ``result.json`` (per-step time, tokens, loss)
and ``drafts_{step}.safetensors`` at each validation step: per validation sample ``{i}`` the greedy
draft-vocab token of every TTT step, [K, n - 1] (index t of step k drafts x_{t+2+k}: the same
alignment as eaglet's ttt_unroll), which bench_anchor.py scores with eaglet's chain code. With
``target_p.safetensors`` in DIR (per validation sample ``{i}``: the target's probability of every
draft-vocab token at each position, [n, Vd], as vLLM's rejection sampler sees it), also
``alpha_{step}.safetensors``: per sample the acceptance α = Σ min(p, q) of every TTT step at T = 1,
[K, n - 1] (0 where the drafted token is past the end), q being the softmax of this model's own
logits (read off its ``lm_head`` by a forward hook: its forward returns only the argmax drafts).

The model is speculators' own: ``create_transformer_layer_config`` (its CLI's draft builder) and
``Eagle3DraftModel.from_training_args`` (loads embedding, head rows and verifier norm from the
target folder itself; checked equal to eaglet's below), its eagle3 defaults (norm before the
residual, before fc and on the output; frozen embedding and head; one llama layer), its loss
(``kl_div``, no step decay; the eager implementation, the fused one needs Triton) and its optimizer
builder (AdamW, weight decay 0.01, or Muon) with its default linear schedule (1 % warm-up) and its
Trainer's gradient clipping at norm 1.0. Its Trainer runs the forward under bf16 autocast on CUDA;
here it runs in fp32, as eaglet's trainer does on the CPU. Each
micro-batch is packed the way its data loader packs samples (``shift_batch`` per sample, then
concatenated with document ids), attention ``sdpa`` (its option for hardware without flex
attention). Its trainer itself needs CUDA, so this is the loop around the model.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def pack(samples: dict, idx: list[int], device="cpu") -> dict:
    """speculators' packed batch of samples ``idx``: per sample shift_batch (x[1:], aux[:-1],
    final[1:], mask[1:], positions 1..n-1), concatenated along one row with document ids."""
    parts = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask",
                             "position_ids", "document_ids")}
    for d, i in enumerate(idx):
        ids, mask = samples[f"{i}.ids"], samples[f"{i}.mask"]
        aux, final = samples[f"{i}.aux"], samples[f"{i}.final"]
        n = len(ids)
        parts["input_ids"].append(ids[1:])
        parts["hidden_states"].append(aux[:-1].float())
        parts["verifier_last_hidden_states"].append(final[1:].float())
        parts["loss_mask"].append(mask[1:].bool())
        parts["position_ids"].append(torch.arange(1, n))
        parts["document_ids"].append(torch.full((n - 1,), d, dtype=torch.long))
    return {k: torch.cat(v)[None].to(device) for k, v in parts.items()}


def build(plan: dict, heads: dict):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    tl = create_transformer_layer_config(
        verifier_name_or_path=plan["target_path"], num_layers=1, draft_arch="llama", hidden_act=None,
        sliding_window=2048, full_attention_indices=[])
    t2d, d2t = heads["t2d"].bool(), heads["d2t"].long()
    model = Eagle3DraftModel.from_training_args(
        tl, t2d=t2d, d2t=d2t, verifier_name_or_path=plan["target_path"], draft_vocab_size=len(d2t),
        norm_before_residual=True, norm_before_fc=True, norm_output=True, embed_requires_grad=False,
        ttt_steps=plan["ttt_steps"], target_layer_ids=plan["layer_ids"], draft_attn_impl="sdpa")
    # The same initial embedding and head rows as eaglet's trainer (both read the target): checked,
    # then set from eaglet's copy so the two runs start from identical frozen tensors.
    same = {}
    with torch.no_grad():
        for name, mod, key in (("embed", model.embed_tokens, "embed"), ("lm_head", model.lm_head, "head_rows"),
                               ("verifier_lm_head", model.verifier_lm_head, "head_rows"),
                               ("verifier_norm", model.verifier_norm, "norm")):
            w = heads[key].float()
            if tuple(mod.weight.shape) != tuple(w.shape):
                raise SystemExit(f"anchor: {name} shape {tuple(mod.weight.shape)} != eaglet's {tuple(w.shape)}")
            same[name] = float((mod.weight.float() - w).abs().max())
            mod.weight.copy_(w)
    return model, same


def acceptance(p_nV: torch.Tensor, logits_k: list) -> torch.Tensor:
    """[K, n - 1]: α at index t of step k = Σ_v min(p_{t+1+k}(v), q_k,t(v)) for the t whose drafted
    token x_{t+2+k} exists (n - 2 - k of them), else 0. p: the target's probabilities of the draft
    vocab at each of the sample's n positions; logits_k[k]: [n - 1, Vd], step k's at each index."""
    n, K = p_nV.shape[0], len(logits_k)
    a = torch.zeros(K, n - 1)
    for k, lg in enumerate(logits_k):
        m = n - 2 - k
        if m > 0:
            q = torch.softmax(lg[:m].float(), -1)
            a[k, :m] = torch.minimum(p_nV[1 + k:1 + k + m].float(), q).sum(-1)
    return a


def main(d: Path) -> None:
    plan = json.loads((d / "plan.json").read_text())
    torch.set_num_threads(int(plan["threads"]))
    torch.manual_seed(int(plan["seed"]))
    from importlib.metadata import version

    import transformers
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
    from transformers import get_linear_schedule_with_warmup

    heads = load_file(str(d / "heads.safetensors"))
    samples = load_file(str(d / "samples.safetensors"))
    target_p = load_file(str(d / "target_p.safetensors")) if (d / "target_p.safetensors").exists() else None
    model, same = build(plan, heads)
    K = int(plan["ttt_steps"])
    train_kw, val_kw = model.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager", ttt_steps=K,
                                                ttt_step_loss_decay=1.0)
    micro, total = plan["micro"], int(plan["total"])
    cfg = TrainerConfig(lr=float(plan["lr"]), num_epochs=1, save_path=str(d), optimizer=plan["optimizer"],
                        weight_decay=float(plan["weight_decay"]), muon_lr=float(plan["lr"]))
    opts = build_optimizers(model, cfg)
    warmup, sched_total = _resolve_scheduler_steps(cfg, total)
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=warmup, num_training_steps=sched_total)
              for o in opts]
    val_steps = set(plan["val_steps"])
    rows = []
    model.train()
    for step in range(total):
        t0 = time.perf_counter()
        for o in opts:
            o.zero_grad(set_to_none=True)
        b = pack(samples, micro[step])
        _, loss, metrics = model(**b, **train_kw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as its Trainer does
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        dt = time.perf_counter() - t0
        tokens = sum(len(samples[f"{i}.ids"]) for i in micro[step])
        row = {"step": step + 1, "seconds": dt, "tokens": tokens, "loss": float(loss.detach())}
        for k in range(K):
            tot = float(metrics[f"cond_acc_{k}_total"])
            row[f"cond_acc_{k}"] = float(metrics[f"cond_acc_{k}_sum"]) / tot if tot else None
        rows.append(row)
        print(f"anchor step {step + 1}/{total}: loss {row['loss']:.3f}, {tokens} tokens in {dt:.2f} s", flush=True)
        if step + 1 in val_steps:
            model.eval()
            out, alpha = {}, {}
            logits: list = []  # this model's lm_head outputs, one per TTT step, in order
            hook = model.lm_head.register_forward_hook(lambda m, i, o, seen=logits: seen.append(o.detach()))
            with torch.no_grad():
                for vb in plan["val_batches"]:
                    logits.clear()
                    drafts = model(**{k: v for k, v in pack(samples, vb).items()
                                      if k not in ("loss_mask", "verifier_last_hidden_states")}, ttt_steps=K)
                    D = torch.cat(drafts, 0)  # [K, N]
                    if len(logits) != K:
                        raise SystemExit(f"anchor: lm_head ran {len(logits)} times for {K} TTT steps")
                    o = 0
                    for i in vb:
                        n = len(samples[f"{i}.ids"]) - 1
                        out[str(i)] = D[:, o:o + n].contiguous()
                        if target_p is not None:
                            alpha[str(i)] = acceptance(target_p[str(i)], [lg[0, o:o + n] for lg in logits])
                        o += n
            hook.remove()
            save_file(out, str(d / f"drafts_{step + 1}.safetensors"))
            if target_p is not None:
                save_file(alpha, str(d / f"alpha_{step + 1}.safetensors"))
            model.train()
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    (d / "result.json").write_text(json.dumps({
        "rows": rows, "same_init_max_abs_diff": same, "trainable_params": sum(trainable.values()),
        "trainable": sorted(trainable), "warmup_steps": warmup, "optimizers": [type(o).__name__ for o in opts],
        "config": {k: getattr(model.config, k) for k in ("norm_before_residual", "norm_before_fc", "norm_output",
                                                         "embed_requires_grad", "draft_vocab_size")},
        "versions": {"speculators": version("speculators"), "transformers": transformers.__version__,
                     "torch": torch.__version__}, "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
