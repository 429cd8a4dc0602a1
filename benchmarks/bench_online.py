"""Online training's cost against offline's, on the same tokens (issue 17), paired and repeated.

    python benchmarks/bench_online.py [--identity resources/targets/smollm2-135m-instruct/identity.json]
        [--n 24] [--length 256] [--repeats 3] [--params '{"token_budget": 2048}']

Each repeat runs, back to back on the same tokens, (a) offline: ``eaglet.features.extract`` (bf16 shard) then
``eaglet.train.train`` on it, and (b) online: ``eaglet.train.train`` with ``hidden_states: online`` (the target in
the training process). One epoch, no validation, checkpoints off; wall time of each whole call
(target loads and set-up included, as a job pays them). Prints medians with min..max:

    ratio: online tok/s / offline tok/s, offline = the tokens / (extraction + training) seconds,
           for one epoch (> 1: online is cheaper at one epoch)
    note:  the same at E epochs from the measured parts, offline = extract + E x train_offline,
           online = E x train_online (one target forward per epoch), and the disk online avoids.

Data: results/smollm2/tokenize/tokens.parquet when present (the first --n samples), else random
token ids (--n samples of --length on average): the costs do not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eaglet.base.files import read_parquet, write_parquet  # noqa: E402
from eaglet.base.logs import setup_logging  # noqa: E402
from eaglet.base.tensors import save_tensors  # noqa: E402
from eaglet.features.extract import extract  # noqa: E402
from eaglet.hidden.dtypes import bytes_per_token  # noqa: E402
from eaglet.target.load import load_identity  # noqa: E402
from eaglet.train.train import train  # noqa: E402


def tokens_file(out: Path, n: int, length: int, vocab_size: int) -> tuple[Path, int]:
    import pyarrow as pa

    src = ROOT / "results/smollm2/tokenize/tokens.parquet"
    if src.exists():
        t = read_parquet(src).slice(0, n)
        rows = [{"id": str(i), "input_ids": x, "loss_mask": m} for i, x, m in
                zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist())]
    else:
        g = torch.Generator().manual_seed(0)
        rows = []
        for i in range(n):
            T = int(torch.randint(length // 2, 3 * length // 2 + 1, (1,), generator=g))
            rows.append({"id": f"b{i:05d}", "input_ids": torch.randint(0, vocab_size, (T,), generator=g).tolist(),
                         "loss_mask": [0] * (T // 4) + [1] * (T - T // 4)})
    schema = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    path = out / "tokens.parquet"
    write_parquet(path, pa.Table.from_pylist(rows, schema=schema))
    return path, sum(len(r["input_ids"]) for r in rows)


def vocab_file(out: Path, vocab_size: int, vd: int) -> str:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:vd] = True
    save_tensors(out / "vocab.safetensors", {"d2t": torch.zeros(vd, dtype=torch.int64), "t2d": t2d})
    return str(out / "vocab.safetensors")


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}..{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="the E of the note line (the runs do one epoch)")
    ap.add_argument("--params", default="{}", help="train params overriding config/config.yaml's")
    a = ap.parse_args()
    setup_logging()
    import yaml

    conf = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    ident = load_identity(a.identity)
    vd = min(int(conf["vocab"]["draft_vocab_size"]), ident["vocab_size"])
    params = {**(conf.get("train") or {}), **json.loads(a.params)}
    params.update(epochs=1, val_fraction=0.0, checkpoint_every=10**9, max_steps=None, accept_unchecked_labels=True)
    times: dict[str, list[float]] = {"extract": [], "train_offline": [], "train_online": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens, n_tokens = tokens_file(tmp, a.n, a.length, ident["vocab_size"])
        vocab = vocab_file(tmp, ident["vocab_size"], vd)
        dtype = conf["extract"]["dtype"]
        online = {"tokens": str(tokens), "layer_ids": None, "dtype": dtype, "target_load": {"dtype": "float32"}}
        for r in range(a.repeats):
            order = ("offline", "online") if r % 2 == 0 else ("online", "offline")  # paired, alternating
            for mode in order:
                if mode == "offline":
                    t0 = time.perf_counter()
                    extract(tokens, a.identity, tmp / f"x{r}", dtype=dtype,
                            token_budget=conf["extract"]["token_budget"], progress=False)
                    t1 = time.perf_counter()
                    train([str(tmp / f"x{r}" / "index.json")], vocab, ident, tmp / f"off{r}", params)
                    times["extract"].append(t1 - t0)
                    times["train_offline"].append(time.perf_counter() - t1)
                else:
                    t0 = time.perf_counter()
                    train([], vocab, ident, tmp / f"on{r}", {**params, "hidden_states": "online"}, online=online)
                    times["train_online"].append(time.perf_counter() - t0)
    x, off, on = (statistics.median(times[k]) for k in ("extract", "train_offline", "train_online"))
    per_pair = [(times["extract"][i] + times["train_offline"][i]) / times["train_online"][i] for i in range(a.repeats)]
    E = a.epochs
    disk = n_tokens * bytes_per_token(dtype, ident["hidden_size"])
    print(f"target {ident['name']} (hidden {ident['hidden_size']}), {a.n} samples, {n_tokens} tokens, extract.dtype "
          f"{dtype}, token_budget {params['token_budget']}, threads {torch.get_num_threads()}, repeats {a.repeats}")
    for k, v in times.items():
        print(f"{k}: median {_med(v)}")
    print(f"offline tok/s {n_tokens / (x + off):.0f} (extract + train), online tok/s {n_tokens / on:.0f}")
    print(f"note: per pair {min(per_pair):.2f}..{max(per_pair):.2f}; at {E} epochs online/offline "
          f"{(x + E * off) / (E * on):.2f} (offline = extract + {E} x train, online = {E} x train with the forward); "
          f"online avoids {disk / 1e6:.1f} MB of hidden states")
    print(f"ratio: {statistics.median(per_pair):.3f}")


if __name__ == "__main__":
    main()
