"""The hidden-state shard format (docs/artifacts.md, "Hidden states"): writer and reader (the
reader, HiddenStateDataset, lives in eaglet.hidden.reader and is re-exported here).

Shared by ``eaglet.features.extract`` (writes) and ``eaglet.train.train`` / ``eaglet.eval.evaluate_offline`` (read).

A shard folder holds ``chunk_{j:05d}.safetensors`` files, each the concatenated tokens of whole
samples, and ``index.json``. While a shard is being written, ``progress.json`` (same fields,
``"complete": false``, plus the chunk size and the writer's ``settings``) is rewritten atomically
after every chunk, so a killed writer resumes from its last complete chunk; a chunk is saved
atomically, so a partial file never looks complete. A resume happens only when every field that
defines the bytes (header, source digest, chunk size, settings) is the same; otherwise the saved
chunks are discarded and the log line names each difference (before -> after).

    w = ShardWriter(out_dir, shard=0, num_shards=1, layer_ids=[2, 15, 27], final_is_prenorm=True,
                    dtype="bfloat16", hidden_size=576, target_digest=digest, chunk_bytes=512 << 20)
    todo = [s for s in samples if s.id not in w.done_ids]
    w.add(sample_id, input_ids_T, loss_mask_T, aux_T3H, final_TH, lse_T, top1_T); ...; w.finish()

    ds = HiddenStateDataset(["shard_0/index.json", "shard_1/index.json"])
    ds.sample(0) -> {"id", "input_ids" [T] long, "loss_mask" [T], "aux" [T,3,H] f32, "final" [T,H] f32,
                     "target_lse" [T] f32, "target_top1" [T] long}

``lse_T``/``top1_T``: the target's log-sum-exp and argmax over its whole vocabulary at each token,
from the stored (rounded) final state (eaglet.target.head.TargetHead.full_stats): format 2.

Shape legend: T tokens, S samples, H hidden size, 3 = the three aux layers (ascending).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import file_digest
from eaglet.base.files import read_json, write_json
from eaglet.base.settings_files import setting_changes
from eaglet.base.tensors import save_tensors
from eaglet.hidden.dtypes import bytes_per_token, storage_dtype
from eaglet.hidden.reader import FORMAT

log = logging.getLogger("eaglet.hidden.store")

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (last dim) scaled e4m3: value = stored.float() * scale, scale = amax / 448."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def storage_round(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``x`` as a shard in storage ``dtype`` gives it back to a reader (float32): what writing it
    (ShardWriter) and reading it (HiddenStateDataset.sample) do, without the disk. Online training
    (eaglet.train.online) rounds its fresh states with it, so they equal the stored ones bit for bit."""
    d = storage_dtype(dtype)
    if d == "float8_e4m3fn":
        q, scale = fp8_encode(x)
        return q.float() * scale.unsqueeze(-1)
    return x.to(getattr(torch, d)).float()


def chunk_name(j: int) -> str:
    return f"chunk_{j:05d}.safetensors"


# --------------------------------------------------------------------------- writer
class ShardWriter:
    """Append samples to a shard; chunks are flushed atomically in a background thread.

    ``work_dir`` (default ``out_dir``) is where chunks and progress.json live while the shard is
    written; ``finish()`` moves them into ``out_dir`` next to index.json. A separate work dir
    lets Snakemake declare ``out_dir`` as a ``directory()`` output (deleted before each job, and
    cacheable as a whole) while a killed job still resumes from the work dir.
    """

    def __init__(self, out_dir, shard: int, num_shards: int, layer_ids: list[int],
                 final_is_prenorm: bool, dtype: str, hidden_size: int, target_digest: str,
                 chunk_bytes: int, final_layer: int | None = None, work_dir=None,
                 source_digest: str | None = None, settings: dict | None = None):
        self.out_dir = Path(out_dir)
        self.work_dir = Path(work_dir) if work_dir else self.out_dir
        self.header = {"format": FORMAT, "shard": int(shard), "num_shards": int(num_shards),
                       "layer_ids": [int(i) for i in layer_ids], "final_layer": final_layer,
                       "final_is_prenorm": bool(final_is_prenorm), "dtype": storage_dtype(dtype),
                       "hidden_size": int(hidden_size), "target_digest": str(target_digest),
                       # Digest of the input data: a resume after the data changed starts over.
                       "source_digest": source_digest}
        if len(self.header["layer_ids"]) != 3:
            raise ValueError(f"layer_ids: need 3, got {layer_ids}")
        self.chunk_bytes = max(1, int(chunk_bytes))
        # What a resume needs equal besides the header (which is also the index's): the chunk size
        # (it places the chunk boundaries) and the caller's ``settings`` that change the stored
        # bytes (eaglet.features.extract: the batching token budget, the target forward's dtype and device).
        self.resume_key = {**self.header, "chunk_bytes": self.chunk_bytes,
                           "settings": json.loads(json.dumps(settings or {}, sort_keys=True))}
        self.bpt = bytes_per_token(dtype, hidden_size)
        self.chunks: list[dict] = []
        self.samples: list[dict] = []
        # [sample id, position, real top-1 id, real top-1 - top-2 logit] recorded by the target's
        # full forward (eaglet.features.extract): the trainer proves its labels against them (eaglet.train.labels)
        self.references: list[list] = []
        self._buf: list[tuple] = []
        self._buf_tokens = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending: list[Future] = []
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._resume()

    @property
    def progress_path(self) -> Path:
        return self.work_dir / "progress.json"

    @property
    def done_ids(self) -> set[str]:
        """Ids of samples already in complete chunks (or buffered for the next one)."""
        return {s["id"] for s in self.samples} | {b[0] for b in self._buf}

    def _resume(self) -> None:
        for tmp in self.work_dir.glob(".chunk_*.tmp"):  # leftovers of a kill mid-save
            tmp.unlink()
        prog = None
        if self.progress_path.exists():
            try:
                prog = read_json(self.progress_path)
            except ArtifactError as e:
                log.warning("%s; starting the shard over", e)
        if prog is not None:
            changed = setting_changes({k: prog[k] for k in self.resume_key if k in prog}, self.resume_key)
            if changed:
                log.warning("%s: written with other settings (%s); discarding its %d chunks, starting the "
                            "shard over", self.progress_path, "; ".join(changed), len(prog.get("chunks") or []))
                prog = None
        kept: list[dict] = []
        for c in (prog or {}).get("chunks", []):
            path = self.work_dir / c["file"]
            if not path.exists() or file_digest(path) != c["sha256"]:
                log.warning("%s: missing or altered; recomputing from here", path)
                break
            kept.append(c)
        names = {c["file"] for c in kept}
        # Chunks saved after the last progress update (or not verified) are recomputed.
        for stray in self.work_dir.glob("chunk_*.safetensors"):
            if stray.name not in names:
                stray.unlink()
        self.chunks = kept
        self.samples = [s for s in (prog or {}).get("samples", []) if s["chunk"] < len(kept)]
        done = {s["id"] for s in self.samples}
        self.references = [r for r in (prog or {}).get("label_reference", []) if r[0] in done]
        if kept:
            log.info("shard %d: resuming after %d complete chunks (%d samples, %d tokens)",
                     self.header["shard"], len(kept), len(self.samples),
                     sum(c["num_tokens"] for c in kept))
        self._write_progress()

    def add(self, sample_id: str, input_ids, loss_mask, aux_T3H: torch.Tensor,
            final_TH: torch.Tensor, lse_T: torch.Tensor, top1_T: torch.Tensor) -> None:
        ids_T = torch.as_tensor(input_ids).to(torch.int32).reshape(-1)
        mask_T = torch.as_tensor(loss_mask).to(torch.int8).reshape(-1)
        T, H = ids_T.numel(), self.header["hidden_size"]
        if mask_T.numel() != T or tuple(aux_T3H.shape) != (T, 3, H) or tuple(final_TH.shape) != (T, H) \
                or tuple(lse_T.shape) != (T,) or tuple(top1_T.shape) != (T,):
            raise ValueError(f"sample {sample_id}: shapes ids {T}, mask {mask_T.numel()}, "
                             f"aux {tuple(aux_T3H.shape)}, final {tuple(final_TH.shape)}, lse {tuple(lse_T.shape)}, "
                             f"top1 {tuple(top1_T.shape)}; want H={H}")
        if not torch.isfinite(lse_T).all():
            raise FloatingPointError(f"sample {sample_id}: the target's log-sum-exp is not finite")
        if self._buf and (self._buf_tokens + T) * self.bpt > self.chunk_bytes:
            self._flush()
        self._buf.append((str(sample_id), ids_T, mask_T, aux_T3H.detach().cpu(), final_TH.detach().cpu(),
                          lse_T.detach().float().cpu(), top1_T.detach().to(torch.int32).cpu()))
        self._buf_tokens += T
        if self._buf_tokens * self.bpt >= self.chunk_bytes:
            self._flush()

    def add_references(self, rows: list[list]) -> None:
        """Record real-model top-1 tokens: rows of [sample id, position, top-1 id, margin]."""
        self.references += [[str(a), int(b), int(c), float(d)] for a, b, c, d in rows]

    def _flush(self) -> None:
        if not self._buf:
            return
        buf, self._buf, self._buf_tokens = self._buf, [], 0
        j = len(self.chunks)
        name = chunk_name(j)
        lengths = [b[1].numel() for b in buf]
        offsets = torch.zeros(len(buf) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        entry = {"file": name, "num_samples": len(buf), "num_tokens": int(offsets[-1])}
        self.chunks.append(entry)
        for row, b in enumerate(buf):
            self.samples.append({"id": b[0], "num_tokens": lengths[row], "chunk": j, "row": row})
        self._check_pending()
        # Casting, hashing and the fsync'ed save run beside the next forward pass.
        self._pending.append(self._pool.submit(self._save_chunk, buf, offsets, entry, j))

    def _save_chunk(self, buf, offsets, entry, j: int) -> None:
        aux = torch.cat([b[3] for b in buf])
        final = torch.cat([b[4] for b in buf])
        t = {"input_ids": torch.cat([b[1] for b in buf]), "loss_mask": torch.cat([b[2] for b in buf]),
             "offsets": offsets, "target_lse": torch.cat([b[5] for b in buf]),
             "target_top1": torch.cat([b[6] for b in buf])}
        if self.header["dtype"] == "float8_e4m3fn":
            t["aux"], t["aux_scale"] = fp8_encode(aux)
            t["final"], t["final_scale"] = fp8_encode(final)
        else:
            dt = getattr(torch, self.header["dtype"])
            t["aux"], t["final"] = aux.to(dt), final.to(dt)
        path = self.work_dir / entry["file"]
        save_tensors(path, t, metadata={"format": f"eaglet-hidden-states-v{FORMAT}"})
        entry["sha256"] = file_digest(path)
        entry["bytes"] = path.stat().st_size
        self._write_progress(upto=j + 1)  # chunks are saved in order by the one worker

    def _write_progress(self, upto: int | None = None) -> None:
        upto = len(self.chunks) if upto is None else upto
        samples = [s for s in self.samples if s["chunk"] < upto]
        done = {s["id"] for s in samples}
        write_json(self.progress_path, {
            **self.resume_key, "chunks": self.chunks[:upto], "samples": samples,
            "label_reference": [r for r in self.references if r[0] in done], "complete": False})

    def _check_pending(self, wait: bool = False) -> None:
        keep = []
        for f in self._pending:
            if wait or f.done():
                f.result()  # re-raises a failed save here, in the caller's thread
            else:
                keep.append(f)
        self._pending = keep

    def finish(self) -> dict:
        """Flush, wait for the saves, move chunks into out_dir, write index.json; return it."""
        self._flush()
        self._check_pending(wait=True)
        self._pool.shutdown()
        index = {**self.header, "chunks": self.chunks, "samples": self.samples,
                 "label_reference": self.references, "complete": True}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.work_dir.resolve() != self.out_dir.resolve():
            for c in self.chunks:
                os.replace(self.work_dir / c["file"], self.out_dir / c["file"])
        write_json(self.out_dir / "index.json", index)
        if self.work_dir.resolve() != self.out_dir.resolve():
            shutil.rmtree(self.work_dir)
        else:
            self.progress_path.unlink(missing_ok=True)
        return index

    def close(self) -> None:
        """Stop without finishing (the chunks saved so far stay resumable)."""
        self._pool.shutdown(wait=True)
