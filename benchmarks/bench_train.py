"""Training throughput as achieved FLOP/s / this machine's measured matmul peak in the dtype the
trainer computes in (bf16 under train.autocast's bf16 autocast, else fp32; one run).

    python benchmarks/bench_train.py [--run smollm2] [--steps 4] [--params '{"token_budget": 2048}']
        [--identity resources/targets/smollm2-135m-instruct/identity.json] [--synthetic]

Data: the run's extracted hidden states and vocab map (results/<run>/extract, vocab_map) when
they exist, else (or with --synthetic) random hidden states of the target's shape: FLOPs and
timing do not depend on the values. The trainer itself (eaglet.train.train.train) runs ``--steps``
optimizer steps with validation off; each step's time is the trainer's own (tokens / tok_s in
metrics.parquet, so setup and the checkpoint write do not count); the first step is warm-up.

FLOPs counted are the matmuls the trainer actually executes per micro-batch of B x T padded
tokens (forward 2mnk; backward twice that for weights + activations, once for fc, whose input
needs no gradient): target logits over the draft rows (no grad; what the other rows gave comes from
the store's full-vocabulary statistics), fc, and per TTT step q/k/v/o, MLP, lm_head and attention (step 0 causal SDPA
counted as half of T^2, later steps compute the full T x T block). The peak is the best of several
square matmuls in the trainer's dtype on the same device, measured before and after training; the
larger counts (with bf16 autocast an fp32 peak would read > 1 and say nothing of the limit).
Prints both numbers and the ratio (goal >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from eaglet.base.logs import setup_logging  # noqa: E402
from eaglet.base.tensors import load_tensors, save_tensors  # noqa: E402
from eaglet.hidden.reader import HiddenStateDataset  # noqa: E402
from eaglet.hidden.store import ShardWriter, storage_round  # noqa: E402
from eaglet.target.head import TargetHead  # noqa: E402
from eaglet.target.load import default_layer_ids, load_identity  # noqa: E402
from eaglet.train.data import plan_micro_batches  # noqa: E402
from eaglet.train.loop import autocast_on  # noqa: E402
from eaglet.train.train import resolve_params, train  # noqa: E402


def matmul_peak(device: torch.device, n: int, repeats: int = 5, dtype=torch.float32) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def micro_flops(ident: dict, vd: int, B: int, T: int, K: int) -> float:
    H, h, g = ident["hidden_size"], ident["num_heads"], ident["num_kv_heads"]
    d, inter = ident["head_dim"], ident["intermediate_size"]
    N = B * T
    head = 2 * N * H * vd                                          # no grad
    fc = 2 * N * 3 * H * H * 2                                     # fwd + weight grad
    lin = 2 * N * (2 * H * (h + 2 * g) * d + h * d * H + 3 * H * inter + H * vd)
    att_full = 4 * B * h * T * T * d                               # QK^T and PV
    per_step = [lin + att_full * (0.5 if k == 0 else 1.0) for k in range(K)]
    return head + fc + 3 * sum(per_step)


def synthetic(ident: dict, out: Path, n: int, length: int, vd: int) -> tuple[list[str], str]:
    H, V = ident["hidden_size"], ident["vocab_size"]
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(out / "shard_0", 0, 1, default_layer_ids(ident["num_layers"]), True, "bfloat16", H,
                    ident["digest"], 256 << 20)
    head = TargetHead(ident["path"])  # the statistics extraction stores, of the states as stored (bf16)
    chunks = head.full_head()
    for i in range(n):
        T = int(torch.randint(length // 2, 3 * length // 2 + 1, (1,), generator=g))
        final = torch.randn(T, H, generator=g)
        w.add(f"b{i:05d}", torch.randint(0, V, (T,), generator=g), torch.ones(T, dtype=torch.int8),
              torch.randn(T, 3, H, generator=g), final, *head.full_stats(storage_round(final, "bfloat16"), chunks))
    w.finish()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:vd] = True
    save_tensors(out / "vocab.safetensors", {"d2t": torch.zeros(vd, dtype=torch.int64), "t2d": t2d})
    return [str(out / "shard_0")], str(out / "vocab.safetensors")


def data_args(ap: argparse.ArgumentParser) -> None:
    """The options of the training benchmarks' data and params (this one, bench_autocast)."""
    ap.add_argument("--run", default="smollm2")
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--params", default="{}", help="train params overriding config/config.yaml's")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--n", type=int, default=64, help="synthetic samples")
    ap.add_argument("--length", type=int, default=512, help="synthetic mean length")


def config_params(a, max_steps: int) -> tuple[dict, dict, dict]:
    """(config.yaml, the target's identity, train params: config.yaml's train section, --params,
    ``max_steps`` optimizer steps, validation and checkpoints off)."""
    import yaml

    conf = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    params = {**(conf.get("train") or {}), **json.loads(a.params)}
    params.update(max_steps=max_steps, val_fraction=0.0, checkpoint_every=10**9)
    return conf, load_identity(a.identity), params


def store(a, conf: dict, ident: dict, params: dict, tmp: Path) -> tuple[list[str], str, str]:
    """(hidden-state stores, vocab map, description): results/<run>'s, else (or --synthetic) random
    states written under ``tmp``, which hold no real-model references: ``params`` then trains
    with the label check off."""
    run = ROOT / "results" / a.run
    shards = sorted(run.glob("extract/shard_*/index.json"))
    vocab = run / "vocab_map/vocab.safetensors"
    if shards and vocab.exists() and not a.synthetic:
        return [str(s) for s in shards], str(vocab), f"results/{a.run}"
    vd = int((conf.get("vocab") or {}).get("draft_vocab_size", 32000))
    hidden, vocab_path = synthetic(ident, tmp / "data", a.n, a.length, vd)
    params["accept_unchecked_labels"] = True
    return hidden, vocab_path, f"synthetic ({a.n} samples, mean length {a.length})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data_args(ap)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    setup_logging()

    conf, ident, params = config_params(a, a.steps + 1)
    device = torch.device("cuda" if params.get("gpus") else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        hidden, vocab_path, source = store(a, conf, ident, params, Path(tmp))
        p = resolve_params(params)
        n_mm = 4096 if device.type == "cuda" else 1024
        dtype = torch.bfloat16 if autocast_on(p["autocast"], device) else torch.float32
        peak0 = matmul_peak(device, n_mm, dtype=dtype)
        out = Path(tmp) / "train"
        train(hidden, vocab_path, ident, out, p)
        peak = max(peak0, matmul_peak(device, n_mm, dtype=dtype))

        ds = HiddenStateDataset(hidden, verify="header")
        vd = len(load_tensors(vocab_path, ["d2t"])["d2t"])
        micro, _, _ = plan_micro_batches(ds.ids, list(ds.num_tokens), p)
        M = p["grad_accum"]
        rows = pd.read_parquet(out / "metrics.parquet")
        rows = rows[rows.split == "train"].reset_index(drop=True)
        flops = secs = tokens = 0.0
        for s in range(1, len(rows)):  # step 0 is warm-up
            for mb in micro[s * M:(s + 1) * M]:
                T = max(ds.num_tokens[i] for i in mb)
                flops += micro_flops(ident, vd, len(mb), T, p["ttt_steps"])
            secs += rows.tokens[s] / rows.tok_s[s]
            tokens += rows.tokens[s]
    achieved = flops / secs
    print(f"data: {source}; target {ident['name']} (hidden {ident['hidden_size']}), V_d {vd}, "
          f"ttt_steps {p['ttt_steps']}, token_budget {p['token_budget']}, device {device.type}, "
          f"threads {torch.get_num_threads()}")
    print(f"timed steps: {len(rows) - 1}, {tokens:.0f} tokens in {secs:.2f} s ({tokens / secs:.0f} tok/s)")
    print(f"achieved training FLOP/s: {achieved / 1e9:.1f} GFLOP/s")
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    print(f"measured {name} matmul peak ({n_mm}x{n_mm}), the trainer's dtype (train.autocast {p['autocast']}): "
          f"{peak / 1e9:.1f} GFLOP/s")
    print(f"ratio: {achieved / peak:.3f}  (goal >= 0.5)")


if __name__ == "__main__":
    main()
