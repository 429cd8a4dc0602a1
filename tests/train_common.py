"""Data for the extraction and training tests: random tokens, a real shard of the tiny target's
hidden states with a vocab map, the trainer's test parameters and its command line."""

import json
import random
import sys

import pyarrow as pa
import torch

from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import write_json, write_parquet
from eaglet.base.tensors import save_tensors
from eaglet.hidden.store import ShardWriter

LAYERS = [2, 4, 5]
VD = 96
# fp32 stated: train.autocast auto would follow the CPU (bf16 autocast where it has bf16 units), and
# these tests check the trainer's arithmetic the same way on every machine.
# soft_ce stated: these tests check the trainer's mechanics (alignment, greedy agreement learned on
# memorisable random data, resume, DDP, online = offline to the last count) on a random tiny target,
# whose near-flat distributions give the default -log α (which rewards overlap, not the argmax) a
# weak signal and amplify last-bit input differences into argmax flips; the LK losses have their
# own tests (tests/train/test_lk_loss.py) and the default is measured on a real target (docs/studies.md).
PARAMS = dict(ttt_steps=3, lr=3e-3, token_budget=256, epochs=6, val_fraction=0.15, val_every=10,
              checkpoint_every=1000, warmup_ratio=0.05, seed=3, autocast="float32", loss="soft_ce")



def write_tokens(path, n, seed=0, lo=3, hi=48):
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        T = rnd.randint(lo, hi)
        rows.append({"id": f"s{i:03d}", "source": "test",
                     "input_ids": [rnd.randrange(49152) for _ in range(T)],
                     "loss_mask": [rnd.randint(0, 1) for _ in range(T)],
                     "num_tokens": T, "num_assistant_tokens": 0})
    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32()),
                        ("num_assistant_tokens", pa.int32())])
    write_parquet(path, pa.Table.from_pylist(rows, schema=schema))
    return rows



def target_stats(identity, final_TH):
    """(target_lse, target_top1) of pre-norm final states by the target's own head, as extraction
    stores them (eaglet.target.head.TargetHead.full_stats)."""
    from eaglet.target.head import TargetHead

    return TargetHead(identity["path"]).full_stats(final_TH)


def tiny_run(tiny_target, results):
    """``results/tiny`` laid out as a workflow run (extract/shard_0, vocab_map/vocab.safetensors)
    holding hidden_data's store: what the benchmarks' find_store reads."""
    import shutil

    run = results / "tiny"
    hidden_data(tiny_target, run / "extract")
    (run / "vocab_map").mkdir()
    shutil.move(run / "extract" / "vocab.safetensors", run / "vocab_map" / "vocab.safetensors")
    return run


def hidden_data(tiny_target, out):
    """Greedy continuations of the tiny target (its own data, as the pipeline generates), with
    aux states at LAYERS and the pre-norm final state, in a real shard; plus a vocab map."""
    from eaglet.target.load import load_model

    model = load_model(tiny_target["path"])
    captured = {}
    model.model.norm.register_forward_hook(lambda mod, inp, o: captured.__setitem__("pre", inp[0]))
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(out / "shard_0", 0, 1, LAYERS, True, "float32", 128, tiny_target["digest"], 1 << 16)
    counts = torch.zeros(tiny_target["vocab_size"], dtype=torch.long)
    P, N = 4, 36
    with torch.no_grad():  # one batched generate + forward (equal lengths, no padding), then cut
        prompts = torch.randint(100, 5000, (N, P), generator=g)
        seqs = model.generate(prompts, max_new_tokens=26, min_new_tokens=26, do_sample=False,
                              pad_token_id=0, attention_mask=torch.ones_like(prompts))
        o = model(seqs, output_hidden_states=True)
    aux = torch.stack([o.hidden_states[j] for j in LAYERS], 2)
    for i in range(N):
        T = P + 14 + i % 13  # causal: a prefix's states are those of the whole sequence
        mask = torch.zeros(T, dtype=torch.int8)
        mask[P:] = 1
        lg = o.logits[i, :T].float()  # the target's own full-vocabulary statistics, as extraction stores them
        w.add(f"s{i}", seqs[i, :T], mask, aux[i, :T], captured["pre"][i, :T], torch.logsumexp(lg, -1), lg.argmax(-1))
        v, top = o.logits[i, :T:5].topk(2, -1)  # the real model's top-1 (as eaglet.features.extract records it)
        w.add_references([[f"s{i}", 5 * j, int(top[j, 0]), float(v[j, 0] - v[j, 1])] for j in range(len(top))])
        counts.index_add_(0, seqs[i, P:T], torch.ones(T - P, dtype=torch.long))
    w.finish()
    used = counts.argsort(descending=True)[:VD]
    used = torch.where(counts[used] > 0, used, -1)
    fill = [j for j in range(tiny_target["vocab_size"]) if counts[j] == 0][: int((used < 0).sum())]
    used = torch.cat([used[used >= 0], torch.tensor(fill, dtype=torch.long)]).sort().values
    t2d = torch.zeros(tiny_target["vocab_size"], dtype=torch.bool)
    t2d[used] = True
    save_tensors(out / "vocab.safetensors", {"d2t": used - torch.arange(VD), "t2d": t2d})
    # vocab_map's record of its file, which `python -m eaglet.train.train` checks before reading it
    write_json(out / "vocab.json", {DIGESTS_KEY: record_digests(out, ["vocab.safetensors"])})
    return {"index": [str(out / "shard_0" / "index.json")], "vocab": str(out / "vocab.safetensors"),
            "model": model, "t2d": t2d}


def train_cmd(data, tiny_target, out, params, nproc=1):
    ident = out.parent / f"{out.name}_identity.json"
    ident.write_text(json.dumps(tiny_target))
    args = ["--hidden", *data["index"], "--vocab", data["vocab"], "--target-identity", str(ident),
            "--out-dir", str(out), "--params", json.dumps(params)]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "-m", "eaglet.train.train", *args]
    return [sys.executable, "-m", "eaglet.train.train", *args]
