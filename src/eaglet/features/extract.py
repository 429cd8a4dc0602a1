"""Stage extract_hidden_states: run the target over tokenized samples, store aux + final states.

One shard of ``num_shards`` per call. Samples are split between shards balanced by token count
(deterministic over the whole tokens file), then run longest-first in right-padded batches under
a token budget. Forward hooks capture only the three aux layers (vLLM ids: id j = the residual
stream entering decoder layer j = HF ``hidden_states[j]`` = the output of layer j-1); the final
state is the last layer's output **before** the final norm (``final_is_prenorm: true``; a hook
reads the norm's input). The model runs its own full forward, but its head only at a few
positions per batch (``logits_to_keep``): the real top-1 token there goes into the index as
``label_reference``, the evidence the trainer checks its reconstructed labels against. At every
stored token the target's log-sum-exp and argmax over its whole vocabulary are stored beside the
states (``target_lse``, ``target_top1``; 8 bytes a token), computed from the final state as stored
(rounded to the storage dtype) by the target's own norm and head (eaglet.target.head.TargetHead,
the reconstruction the trainer's labels use): the draft vocabulary's probability mass and whether
the greedy token is draftable follow from them, so no training step reads the head's other rows.
Padded positions are never stored. Output format: docs/artifacts.md, ``eaglet.hidden.store``.

    python -m eaglet.features.extract --tokens results/r/tokenize/tokens.parquet \
        --identity resources/targets/smollm2/identity.json --out results/r/extract/shard_0 \
        --shard 0 --num-shards 1 [--layer-ids '[2,15,27]'] [--dtype bfloat16|float32|fp8] \
        [--token-budget 16384] [--chunk-mb 512] [--work DIR] [--device auto] [--log FILE]

A killed run restarts from its last complete chunk (kept in ``--work``, default ``--out``).
Shape legend: B batch, T tokens (padded), N real tokens, H hidden, 3 aux layers.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

import torch

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import file_digest, verify_recorded
from eaglet.base.files import write_json
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.hidden.dtypes import bytes_per_token, storage_dtype
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.hidden.store import ShardWriter, storage_round
from eaglet.target.capture import (
    REF_PER_BATCH,
    Capture,
    assign_shards,
    load_cached,
    make_batches,
    pad_batch,
    pick_device,
    read_tokens,
    reference_positions,
)
from eaglet.target.head import TargetHead
from eaglet.target.load import default_layer_ids, load_identity, validate_layer_ids

__all__ = ["extract", "assign_shards", "make_batches", "HiddenStateDataset"]

log = logging.getLogger("eaglet.features.extract")
def extract(tokens_path, identity_path, out_dir, shard: int = 0, num_shards: int = 1,
            layer_ids: list[int] | None = None, dtype: str = schema.default("extract.dtype"),
            token_budget: int = schema.default("extract.token_budget"),
            chunk_mb: float = schema.default("extract.chunk_mb"), device: str = schema.default("target.device"),
            work_dir=None, model_dtype: str | None = None, progress: bool = True,
            trust_remote_code: bool = schema.default("target.trust_remote_code"),
            dtype_reason: str | None = None) -> dict:
    """Extract one shard; return its index dict (also written to ``out_dir/index.json``).
    ``model_dtype`` (``target.dtype``; None = bf16 on a GPU, fp32 on the CPU), ``device``
    (``target.device``) and ``trust_remote_code`` say how the target is loaded."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
    sdtype = storage_dtype(dtype)
    ident = load_identity(identity_path)
    N, H = int(ident["num_layers"]), int(ident["hidden_size"])
    layer_ids = validate_layer_ids(layer_ids or default_layer_ids(N), N)

    ids, all_input, all_mask = read_tokens(tokens_path)
    lengths = [len(r) for r in all_input]
    mine = [i for i, s in enumerate(assign_shards(ids, lengths, num_shards)) if s == shard]

    # The target forward's device and dtype, resolved now: with the token budget (the batches, so
    # the padding and the reference positions) they change the stored bytes, so a resumed shard
    # needs them equal (ShardWriter.resume_key; the tokens digest, layer ids, dtype, shard and
    # chunk size are the writer's own fields).
    dev = pick_device(device)
    mdtype = model_dtype or ("bfloat16" if dev.startswith("cuda") else "float32")
    settings = {"token_budget": int(token_budget), "reference_per_batch": REF_PER_BATCH,
                "target_dtype": mdtype, "target_device": dev.split(":")[0],
                "trust_remote_code": bool(trust_remote_code)}
    writer = ShardWriter(out_dir, shard, num_shards, layer_ids, final_is_prenorm=True, dtype=dtype,
                         hidden_size=H, target_digest=ident["digest"],
                         chunk_bytes=int(chunk_mb * (1 << 20)), final_layer=N, work_dir=work_dir,
                         source_digest=file_digest(tokens_path), settings=settings)
    done = writer.done_ids
    todo = [i for i in mine if ids[i] not in done]
    shard_tokens = sum(lengths[i] for i in mine)
    todo_tokens = sum(lengths[i] for i in todo)
    bpt = bytes_per_token(dtype, H)
    # Users fill disks with this stage: state the need before loading a (possibly huge) target.
    log.info("shard %d/%d: %d samples, %d tokens -> %.3f GB on disk (%d tokens x 4 x %d hidden x %s); "
             "all shards: %.3f GB; to do now: %d samples, %d tokens", shard, num_shards, len(mine),
             shard_tokens, shard_tokens * bpt / 1e9, shard_tokens, H, sdtype, sum(lengths) * bpt / 1e9,
             len(todo), todo_tokens)
    free = shutil.disk_usage(writer.work_dir).free
    if todo_tokens * bpt > free:
        writer.close()
        raise OSError(f"{writer.work_dir}: needs {todo_tokens * bpt / 1e9:.2f} GB, "
                      f"only {free / 1e9:.2f} GB free")

    t0 = time.perf_counter()
    if todo:
        ngpu = torch.cuda.device_count() if dev.startswith("cuda") else 0
        model = load_cached(ident["path"], ident["digest"], mdtype, dev, ngpu, trust_remote_code)
        in_dev = model.get_input_embeddings().weight.device
        log.info("target loaded in %.1f s on %s (%s)", time.perf_counter() - t0,
                 "device_map=auto" if ngpu > 1 else dev, mdtype)
        stats = _Stats(ident["path"], trust_remote_code)
        _run(model, writer, [ids[i] for i in todo], [all_input[i] for i in todo],
             [all_mask[i] for i in todo], layer_ids, H, token_budget, in_dev, sdtype,
             shard_tokens - todo_tokens, shard_tokens, progress, stats)
    index = writer.finish()
    # the target forward's dtype and why (extract.target_dtype, eaglet.base.capability): in the artifact
    write_json(Path(out_dir) / "target_load.json", {"dtype": mdtype, "reason": dtype_reason, "device": dev})
    _verify(out_dir, [ids[i] for i in mine], {ids[i]: all_input[i] for i in mine})
    dt = time.perf_counter() - t0
    log.info("shard %d/%d done: %d samples, %d tokens in %d chunks; %d tokens computed in %.1f s "
             "(%.0f tok/s incl. load)", shard, num_shards, len(index["samples"]),
             sum(c["num_tokens"] for c in index["chunks"]), len(index["chunks"]), todo_tokens, dt,
             todo_tokens / max(dt, 1e-9))
    return index


class _Stats:
    """The target's full-vocabulary statistics of stored final states (TargetHead.full_stats), its
    head built once on the device the final states come out on (the last GPU under device_map)."""

    def __init__(self, path, trust_remote_code: bool):
        self.path, self.trust_remote_code = path, trust_remote_code
        self.head = self.chunks = None

    def __call__(self, stored_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.head is None:
            self.head = TargetHead(self.path, device=stored_NH.device, trust_remote_code=self.trust_remote_code)
            self.chunks = self.head.full_head()
        return self.head.full_stats(stored_NH, self.chunks)


@torch.inference_mode()
def _run(model, writer, ids, inputs, masks, layer_ids, H, token_budget, device, sdtype,
         done_tokens, total_tokens, progress, stats: _Stats, ref_per_batch: int = REF_PER_BATCH) -> None:
    from tqdm import tqdm

    cap = Capture(model, layer_ids)
    # Cast on the device before the copy when storing bf16/f32 (halves the transfer from f32).
    xfer = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(sdtype)
    bar = tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True,
               desc=f"shard {writer.header['shard']}", disable=not progress, mininterval=2.0)
    try:
        for batch in make_batches([len(r) for r in inputs], token_budget):
            ids_BT, mask_BT = pad_batch([inputs[i] for i in batch], device)
            ref_pos = reference_positions([len(inputs[i]) for i in batch], ref_per_batch)
            aux, final_BTH, ref_logits = cap(ids_BT, mask_BT, ref_pos)
            if ref_logits is not None:
                v, top = ref_logits.float().topk(2, -1)  # B P 2
                writer.add_references([[ids[i], int(p), int(top[b, j, 0]), float(v[b, j, 0] - v[b, j, 1])]
                                       for b, i in enumerate(batch) for j, p in enumerate(ref_pos.tolist())])
            keep_BT = mask_BT.bool()
            aux_N3H = torch.stack([a[keep_BT.to(a.device)].to(final_BTH.device) for a in aux], dim=1)
            final_NH = final_BTH[keep_BT.to(final_BTH.device)]
            if aux_N3H.shape[-1] != H:
                raise RuntimeError(f"captured hidden size {aux_N3H.shape[-1]}, identity says {H}")
            if not (torch.isfinite(aux_N3H).all() and torch.isfinite(final_NH).all()):
                raise FloatingPointError(f"NaN/Inf in hidden states of samples {[ids[i] for i in batch]}")
            lse_N, top1_N = stats(storage_round(final_NH, sdtype))  # of the states as the trainer reads them
            if xfer is not None:
                aux_N3H, final_NH = aux_N3H.to(xfer), final_NH.to(xfer)
            aux_N3H, final_NH, lse_N, top1_N = aux_N3H.cpu(), final_NH.cpu(), lse_N.cpu(), top1_N.cpu()
            a = 0
            for i in batch:  # rows of x[keep] are sample-major, in batch order
                n = len(inputs[i])
                writer.add(ids[i], inputs[i], masks[i], aux_N3H[a:a + n], final_NH[a:a + n],
                           lse_N[a:a + n], top1_N[a:a + n])
                a += n
            bar.update(a)
    except BaseException:
        writer.close()
        raise
    finally:
        bar.close()
        cap.remove()


def _verify(out_dir, want_ids: list[str], want_input: dict) -> None:
    """Re-read the finished shard: shapes checked, ids equal the tokens; reading every sample's
    ids hashes every chunk (HiddenStateDataset hashes a chunk when first read)."""
    ds = HiddenStateDataset([Path(out_dir) / "index.json"], verify="sha")
    if sorted(ds.ids) != sorted(want_ids):
        raise ArtifactError(f"{out_dir}/index.json: holds {len(ds)} samples, shard needs {len(want_ids)}")
    for i, sid in enumerate(ds.ids):
        if ds.input_ids(i).tolist() != list(want_input[sid]):
            raise ArtifactError(f"{out_dir}: stored token ids of sample {sid} differ from the tokens file")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True, help="tokenize/tokens.parquet")
    p.add_argument("--identity", required=True, help="the target's identity.json")
    p.add_argument("--out", required=True, help="shard folder (index.json + chunk files)")
    p.add_argument("--work", default=None, help="folder for chunks while running (resume point)")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--layer-ids", default=None, help="JSON list in vLLM convention; null = default")
    p.add_argument("--dtype", default=schema.default("extract.dtype"), help=" | ".join(schema.allowed("extract.dtype")))
    p.add_argument("--token-budget", type=int, default=schema.default("extract.token_budget"),
                   help="padded tokens per batch")
    p.add_argument("--chunk-mb", type=float, default=schema.default("extract.chunk_mb"), help="max chunk file size")
    p.add_argument("--device", default=schema.default("target.device"),
                   help="target.device: auto (cuda when the job has a GPU), cpu, cuda")
    p.add_argument("--target-load", default=None,
                   help='JSON {"dtype", "device", "trust_remote_code"}: the target section\'s (overrides --device); '
                        'default dtype bf16 on a GPU, fp32 on the CPU')
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    verify_recorded(a.tokens, Path(a.tokens).with_name("metadata.json"))  # tokenize's record
    ld = parse_json_arg(a.target_load, {})
    extract(a.tokens, a.identity, a.out, a.shard, a.num_shards, parse_json_arg(a.layer_ids),
            a.dtype, a.token_budget, a.chunk_mb, ld.get("device", a.device), a.work, model_dtype=ld.get("dtype"),
            progress=not a.no_progress, trust_remote_code=bool(ld.get("trust_remote_code")),
            dtype_reason=ld.get("dtype_reason"))


if __name__ == "__main__":
    main()
