"""The target forward that extraction and online training share (library): samples balanced over
shards, longest-first batches under a token budget, right padding, the hooks that capture the aux
layers and the pre-norm final state (``Capture``), the positions where the real head runs, and the
target loaded once per process. ``eaglet.features.extract`` stores what this computes; ``eaglet.train.online``
trains on it directly.

Shape legend: B batch, T tokens (padded), N real tokens, H hidden, 3 aux layers.
"""

from __future__ import annotations

import logging

import torch

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_parquet
from eaglet.target.load import job_device, load_model

log = logging.getLogger("eaglet.features.extract")

# Positions per batch where the target's real head runs (a [B, P, V] logits tensor: small).
REF_PER_BATCH = 4


def assign_shards(ids: list[str], num_tokens: list[int], num_shards: int) -> list[int]:
    """Shard of each sample: longest first onto the shard with the fewest tokens so far
    (ties: lowest shard). Depends only on the data and num_shards, so every shard job agrees."""
    order = sorted(range(len(ids)), key=lambda i: (-num_tokens[i], ids[i]))
    load = [0] * num_shards
    out = [0] * len(ids)
    for i in order:
        s = min(range(num_shards), key=lambda k: (load[k], k))
        out[i] = s
        load[s] += num_tokens[i]
    return out


def make_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices (into ``lengths``, taken longest first) grouped so that B x max_len <= budget;
    a sample longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def pad_batch(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids_BT and attention mask_BT (position ids 0.. stay those of each sample)."""
    T = max(len(r) for r in rows)
    ids_BT = torch.zeros(len(rows), T, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids_BT[b, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask_BT[b, :len(r)] = 1
    return ids_BT.to(device), mask_BT.to(device)


class Capture:
    """Forward hooks that keep the outputs of the decoder layers feeding the aux ids and the
    input of the final norm (the pre-norm final state). The model runs its own full forward, head
    included, but the head only at ``ref_positions`` (``logits_to_keep``): the real model's top-1
    token there is recorded so the trainer can prove its reconstructed labels (eaglet.train.labels)."""

    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = self.base.layers
        self.n = len(self.layers)
        self.layer_ids = layer_ids
        self.out: dict[int, torch.Tensor] = {}
        self._handles = []
        for j in layer_ids:
            if j < self.n:  # id n is the final state itself
                self._handles.append(self.layers[j - 1].register_forward_hook(self._hook(j)))
        self._handles.append(self.base.norm.register_forward_hook(self._norm_hook))

    def _hook(self, j: int):
        def fn(_module, _inputs, output):
            self.out[j] = output[0] if isinstance(output, tuple) else output
        return fn

    def _norm_hook(self, _module, inputs, _output):
        self.out["final"] = inputs[0]

    def __call__(self, ids_BT, mask_BT, ref_positions: torch.Tensor | None = None):
        """-> (aux states, pre-norm final_BTH, real logits at ref_positions [B, P, V] or None)."""
        self.out.clear()
        logits = None
        if ref_positions is not None and len(ref_positions):
            logits = self.model(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False,
                                logits_to_keep=ref_positions.to(ids_BT.device)).logits
        else:
            self.base(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False)
        final_BTH = self.out["final"]
        aux = [final_BTH if j == self.n else self.out[j] for j in self.layer_ids]
        return aux, final_BTH, logits

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def read_tokens(tokens_path) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """(ids, input_ids, loss_mask) of a tokens file, checked: unique ids, non-empty, equal lengths."""
    table = read_parquet(tokens_path, columns=["id", "input_ids", "loss_mask"])
    ids = [str(x) for x in table.column("id").to_pylist()]
    if len(set(ids)) != len(ids):
        raise ArtifactError(f"{tokens_path}: duplicate sample ids")
    all_input = table.column("input_ids").to_pylist()
    all_mask = table.column("loss_mask").to_pylist()
    for i, (r, m) in enumerate(zip(all_input, all_mask)):
        if len(r) == 0 or len(r) != len(m):
            raise ArtifactError(f"{tokens_path}: sample {ids[i]}: {len(r)} ids, {len(m)} mask values")
    return ids, all_input, all_mask


def reference_positions(lengths: list[int], per_batch: int) -> torch.Tensor:
    """Positions (shared by the batch's rows) where the real head runs: spread over the shortest
    row, so every row has a real token there."""
    n = min(lengths)
    if per_batch <= 0 or n < 1:
        return torch.zeros(0, dtype=torch.long)
    return torch.linspace(0, n - 1, min(per_batch, n)).round().long().unique()


def pick_device(device: str) -> str:
    """``target.device`` for this job (eaglet.target.load.job_device); an explicit ``cuda:1`` stays."""
    return job_device(device) if device in schema.allowed("target.device") else device



LOADED: dict = {}


def load_cached(path: str, digest: str, dtype: str, dev: str, ngpu: int, trust_remote_code: bool = False):
    """Load the target once per process (callers extracting several shards in-process reuse it)."""
    key = (path, digest, dtype, dev, ngpu, trust_remote_code)
    if key not in LOADED:
        LOADED.clear()
        # Several visible GPUs = one target spread over them (a model too big for one GPU).
        model = load_model(path, dtype=dtype, device_map="auto" if ngpu > 1 else None,
                           trust_remote_code=trust_remote_code)
        if ngpu <= 1:
            model.to(dev)
        LOADED[key] = model
    return LOADED[key]
