"""The hidden-state shard format's reader (eaglet.hidden.store): all shards of an extraction as one
dataset, checked on opening and read lazily per chunk.

    ds = HiddenStateDataset(["shard_0/index.json", "shard_1/index.json"])
    ds.sample(0) -> {"id", "input_ids" [T] long, "loss_mask" [T], "aux" [T,3,H] f32, "final" [T,H] f32,
                     "target_lse" [T] f32, "target_top1" [T] long}

Shape legend: T tokens, S samples, H hidden size, 3 = the three aux layers (ascending).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import file_digest
from eaglet.base.files import read_json

# The store's format: 2 adds the target's full-vocabulary statistics per token (``target_lse``,
# ``target_top1``: eaglet.target.head.TargetHead.full_stats), so no training step reads the head's
# rows outside the draft vocabulary. A store of an older format is refused (FormatError).
FORMAT = 2

HEADER_KEYS = ("shard", "num_shards", "layer_ids", "final_layer", "final_is_prenorm", "dtype",
               "hidden_size", "target_digest")


class FormatError(ArtifactError):
    """A hidden-state store written in another format than this eaglet reads."""


def check_format(idx: dict, path: Path) -> None:
    """Refuse a store of another format, saying how to rebuild it."""
    got = idx.get("format", 1)
    if got != FORMAT:
        raise FormatError(
            f"{path}: hidden-state store format {got}, this eaglet reads format {FORMAT} (it stores the "
            "target's full-vocabulary log-sum-exp and argmax per token, which the trainer reads instead of "
            "the head's other rows). Rebuild it: rerun the workflow (the extract_hidden_states jobs rerun: "
            "their code changed), or `snakemake --forcerun extract_hidden_states`, or "
            "`python -m eaglet.features.extract` on its tokens file for a store made by hand")


class HiddenStateDataset:
    """All shards as one dataset, read lazily per chunk (memory-mapped), never copied.

    Opening is cheap: the index must be complete, and each chunk must exist and hold (header and
    file size) the token/sample counts the index says. ``verify="sha"`` (default) also hashes a
    chunk against index.json's sha256 the first time it is read, before any tensor of it is
    returned, once per process. Hashing every chunk up front cost rank 0 minutes to hours at TB
    scale while the other ranks sat in DDP init until NCCL timed out (issue 14). ``"header"``
    never hashes.
    """

    def __init__(self, index_paths, verify: str = "sha", max_open: int = 16):
        if isinstance(index_paths, (str, os.PathLike)):
            index_paths = [index_paths]
        if not index_paths:
            raise ArtifactError("HiddenStateDataset: no index.json given")
        if verify not in ("sha", "header"):
            raise ValueError(f"verify: {verify!r} not 'sha' or 'header'")
        self.meta: dict | None = None
        self.ids: list[str] = []
        self.num_tokens: list[int] = []
        self.label_references: list[list] = []  # see ShardWriter.references
        self._where: list[tuple[Path, int]] = []  # (chunk path, row)
        self._max_open = max_open
        self._open: OrderedDict[Path, tuple] = OrderedDict()
        self._verify = verify
        self._sha: dict[Path, tuple[str, Path]] = {}  # chunk -> (sha256 in its index, the index)
        self._verified: set[Path] = set()  # chunks hashed and found intact by this process
        for p in index_paths:
            self._add_shard(Path(p), verify)

    def _add_shard(self, path: Path, verify: str) -> None:
        if path.is_dir():
            path = path / "index.json"
        idx = read_json(path)
        check_format(idx, path)
        missing = [k for k in (*HEADER_KEYS, "chunks", "samples", "complete") if k not in idx]
        if missing:
            raise ArtifactError(f"{path}: not a hidden-state index (missing {missing})")
        if idx["complete"] is not True:
            raise ArtifactError(f"{path}: shard is not complete")
        meta = {k: idx[k] for k in ("layer_ids", "final_layer", "final_is_prenorm", "dtype",
                                    "hidden_size", "target_digest")}
        if self.meta is None:
            self.meta = meta
        elif meta != self.meta:
            diff = sorted(k for k in meta if meta[k] != self.meta[k])
            raise ArtifactError(f"{path}: shard disagrees with the first shard on {diff}")
        H = idx["hidden_size"]
        for c in idx["chunks"]:
            f = path.parent / c["file"]
            if not f.exists():
                raise ArtifactError(f"{f}: chunk listed in {path} is missing")
            if verify == "sha":  # hashed when first read (_check_sha), not here
                if not isinstance(c.get("sha256"), str):
                    raise ArtifactError(f"{path}: chunk {c['file']} has no sha256")
                self._sha[f] = (c["sha256"], path)
            shapes = _chunk_shapes(f)
            T, S = c["num_tokens"], c["num_samples"]
            want = {"input_ids": [T], "loss_mask": [T], "offsets": [S + 1], "aux": [T, 3, H], "final": [T, H],
                    "target_lse": [T], "target_top1": [T]}
            bad = {k: shapes.get(k) for k, v in want.items() if shapes.get(k) != v}
            if bad:
                raise ArtifactError(f"{f}: shapes {bad} disagree with {path} (want {want})")
        self.label_references += idx.get("label_reference", [])
        seen = set(self.ids)
        for s in idx["samples"]:
            if s["chunk"] >= len(idx["chunks"]) or s["row"] >= idx["chunks"][s["chunk"]]["num_samples"]:
                raise ArtifactError(f"{path}: sample {s['id']} points outside its chunks")
            if s["id"] in seen:
                raise ArtifactError(f"{path}: sample id {s['id']} appears twice")
            seen.add(s["id"])
            self.ids.append(s["id"])
            self.num_tokens.append(int(s["num_tokens"]))
            self._where.append((path.parent / idx["chunks"][s["chunk"]]["file"], int(s["row"])))
        if sum(c["num_tokens"] for c in idx["chunks"]) != sum(s["num_tokens"] for s in idx["samples"]):
            raise ArtifactError(f"{path}: token counts of samples and chunks disagree")

    def __len__(self) -> int:
        return len(self.ids)

    def _handle(self, f: Path):
        if f in self._open:
            self._open.move_to_end(f)
            return self._open[f]
        from safetensors import safe_open

        self._check_sha(f)
        try:
            h = safe_open(str(f), framework="pt", device="cpu")
            offsets = h.get_tensor("offsets")
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise ArtifactError(f"{f}: not a readable safetensors file ({e})") from None
        self._open[f] = (h, offsets, "aux_scale" in h.keys())
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return self._open[f]

    def _check_sha(self, f: Path) -> None:
        """Hash chunk ``f`` against its index the first time this process reads it.

        A handle evicted from the LRU and reopened is not hashed again: the hash proves the
        file was intact when read, and re-hashing per reopen would cost a full read each time.
        """
        if f in self._verified or f not in self._sha:
            return
        want, index = self._sha[f]
        if file_digest(f) != want:
            raise ArtifactError(f"{f}: sha256 differs from {index} (corrupt or altered chunk)")
        self._verified.add(f)

    def sample(self, i: int) -> dict:
        f, row = self._where[i]
        h, offsets, fp8 = self._handle(f)
        a, b = int(offsets[row]), int(offsets[row + 1])
        if b - a != self.num_tokens[i]:
            raise ArtifactError(f"{f}: sample {self.ids[i]} has {b - a} tokens, index says "
                                f"{self.num_tokens[i]}")
        aux = h.get_slice("aux")[a:b].float()
        final = h.get_slice("final")[a:b].float()
        if fp8:
            aux = aux * h.get_slice("aux_scale")[a:b].unsqueeze(-1)
            final = final * h.get_slice("final_scale")[a:b].unsqueeze(-1)
        return {"id": self.ids[i], "input_ids": h.get_slice("input_ids")[a:b].long(),
                "loss_mask": h.get_slice("loss_mask")[a:b], "aux": aux, "final": final,
                "target_lse": h.get_slice("target_lse")[a:b].float(),
                "target_top1": h.get_slice("target_top1")[a:b].long()}

    def input_ids(self, i: int) -> torch.Tensor:
        """Only the token ids of sample i (cheap: no hidden states read)."""
        f, row = self._where[i]
        h, offsets, _ = self._handle(f)
        return h.get_slice("input_ids")[int(offsets[row]):int(offsets[row + 1])].long()

    def loss_mask(self, i: int) -> torch.Tensor:
        """Only the loss mask of sample i (cheap: no hidden states read)."""
        f, row = self._where[i]
        h, offsets, _ = self._handle(f)
        return h.get_slice("loss_mask")[int(offsets[row]):int(offsets[row + 1])]

    def __getitem__(self, i: int) -> dict:
        return self.sample(i)


def _chunk_shapes(f: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            shapes = {k: list(h.get_slice(k).get_shape()) for k in h.keys()}
    except Exception as e:  # noqa: BLE001
        raise ArtifactError(f"{f}: not a readable safetensors file ({e})") from None
    # A truncated file can still carry a whole header: check the data extent too.
    size = f.stat().st_size
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        import json

        hdr = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ArtifactError(f"{f}: {size} bytes, header says {8 + n + end} (truncated chunk)")
    return shapes
