"""Extraction throughput vs the bare forward pass of the same model, same batches, one run.

    python benchmarks/bench_extract.py [--identity resources/targets/smollm2-135m-instruct/identity.json]
        [--tokens results/smollm2/tokenize/tokens.parquet] [--n 48] [--length 512]
        [--token-budget 8192] [--dtype bfloat16] [--repeats 8] [--device auto]

Without --tokens it makes ``--n`` samples of random ids, lengths uniform in [length/2, 3*length/2].
The bare pass is the decoder stack alone (``model.model``: no LM head, no hooks) over exactly the
batches the stage forms; the stage adds the hooks, gathering unpadded rows, casting, the
background chunk saves (fsync + sha256), the progress file and the final re-read check. The model
is loaded once before either is timed. Bare and stage runs form ``--repeats`` pairs, back to back
in ABBA order (bare first, then stage first: drift cancels); each pair gives a ratio. Prints the
median tok/s of each, the median pair ratio (goal >= 0.95) with a distribution-free interval
(benchmarks/paired.py), and says "cannot conclude" when that interval holds the goal: this VM's
speed drifts by tens of percent over seconds.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from benchmarks.paired import spread_note  # noqa: E402
from eaglet.base.files import read_parquet, write_parquet  # noqa: E402
from eaglet.base.logs import setup_logging  # noqa: E402
from eaglet.features.extract import extract, load_cached, make_batches, pad_batch, pick_device  # noqa: E402
from eaglet.target.load import default_layer_ids, load_identity  # noqa: E402


def make_tokens(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> None:
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        T = rnd.randint(length // 2, 3 * length // 2)
        rows.append({"id": f"b{i:04d}", "source": "bench", "input_ids": [rnd.randrange(vocab) for _ in range(T)],
                     "loss_mask": [1] * T, "num_tokens": T, "num_assistant_tokens": T})
    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32()),
                        ("num_assistant_tokens", pa.int32())])
    write_parquet(path, pa.Table.from_pylist(rows, schema=schema))


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def bare(model, inputs: list[list[int]], budget: int, dev: str) -> float:
    base = model.get_decoder()
    t0 = time.perf_counter()
    for batch in make_batches([len(r) for r in inputs], budget):
        ids_BT, mask_BT = pad_batch([inputs[i] for i in batch], dev)
        base(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False)
    sync(dev)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    p.add_argument("--tokens", default=None)
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-mb", type=float, default=64)
    p.add_argument("--repeats", type=int, default=8, help="pairs of (bare, stage) runs")
    p.add_argument("--device", default="auto")
    a = p.parse_args()
    setup_logging()
    ident = load_identity(a.identity)
    dev = pick_device(a.device)
    mdtype = "bfloat16" if dev.startswith("cuda") else "float32"
    with tempfile.TemporaryDirectory(prefix="bench_extract.") as tmp:
        tmp = Path(tmp)
        tokens = Path(a.tokens) if a.tokens else tmp / "tokens.parquet"
        if not a.tokens:
            make_tokens(tokens, a.n, a.length, ident["vocab_size"])
        inputs = read_parquet(tokens, columns=["input_ids"]).column("input_ids").to_pylist()
        ntok = sum(len(r) for r in inputs)
        ngpu = torch.cuda.device_count() if dev.startswith("cuda") else 0
        t0 = time.perf_counter()
        model = load_cached(ident["path"], ident["digest"], mdtype, dev, ngpu)  # what extract() reuses
        print(f"target {ident['name']} loaded in {time.perf_counter() - t0:.1f} s on {dev} ({mdtype}); "
              f"{len(inputs)} samples, {ntok} tokens, budget {a.token_budget}", flush=True)
        bare(model, inputs[:2], a.token_budget, dev)  # warm-up (allocator, kernels)
        t_bare, t_ext = [], []

        def stage(r: int) -> float:
            t1 = time.perf_counter()
            extract(tokens, a.identity, tmp / f"out{r}", dtype=a.dtype, token_budget=a.token_budget,
                    chunk_mb=a.chunk_mb, device=dev, progress=False)
            t = time.perf_counter() - t1
            shutil.rmtree(tmp / f"out{r}")
            return t

        for r in range(a.repeats):
            if r % 2 == 0:
                t_bare.append(bare(model, inputs, a.token_budget, dev))
                t_ext.append(stage(r))
            else:
                t_ext.append(stage(r))
                t_bare.append(bare(model, inputs, a.token_budget, dev))
            print(f"  pair {r}: bare {ntok / t_bare[-1]:.0f} tok/s, extract {ntok / t_ext[-1]:.0f} tok/s, "
                  f"ratio {t_bare[-1] / t_ext[-1]:.3f}", flush=True)
    ratios = [b / e for b, e in zip(t_bare, t_ext)]
    med = statistics.median(ratios)
    print(f"bare forward:  {ntok / statistics.median(t_bare):10.0f} tok/s (median)")
    print(f"extraction:    {ntok / statistics.median(t_ext):10.0f} tok/s (median; dtype {a.dtype}, layers "
          f"{default_layer_ids(ident['num_layers'])})")
    print(spread_note(ratios, 0.95, "pair ratios"))
    print(f"ratio:         {med:10.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
