"""Online hidden states (``train.hidden_states: online``): the training job runs the target itself.

The trainer reads its micro-batches from a source with HiddenStateDataset's face (``meta``,
``ids``, ``num_tokens``, ``label_references``, ``sample``) plus ``collate(batch)``. Offline, that
source is the extracted shards; online it is ``OnlineHiddenStates``: the tokens file, and the
target loaded in this process (extraction's loading, ``eaglet.target.capture``, on this rank's device, in
``target.dtype``; ``target.device: cpu`` keeps it on the CPU). Each micro-batch runs one no-grad
target forward with extraction's own hooks (``capture.Capture``), and the aux and pre-norm final
states are rounded to the storage dtype (``extract.dtype``: bf16, fp8 or float32) exactly as a
shard write + read rounds them (``hidden_store.storage_round``), and the target's full-vocabulary
statistics of the rounded final states are computed as extraction stores them
(eaglet.target.head.TargetHead.full_stats). So, on the same samples, the
trainer sees the states offline training reads from disk, up to what batching changes in the
target's own forward (padded batches of other shapes than extraction's; see docs/clusters.md,
"Hidden states: offline or online").

The label check needs the real model's top-1 tokens at some positions (offline: recorded by
extraction). Online they come from the same forward: the first ``LABEL_SAMPLES`` samples (by id)
are run once with the head at a few positions (``logits_to_keep``), before training.
"""

from __future__ import annotations

import logging
import time

import torch

from eaglet.base import schema
from eaglet.hidden.dtypes import storage_dtype
from eaglet.hidden.store import storage_round
from eaglet.target import capture
from eaglet.target.head import TargetHead
from eaglet.target.load import default_layer_ids, validate_layer_ids

log = logging.getLogger("eaglet.train.online")

LABEL_SAMPLES = 8    # samples whose real top-1 tokens the label check compares against (one extra
                     # forward over them before training)
LABEL_REF_PER_BATCH = 16


class OnlineHiddenStates:
    """Hidden states computed on demand by the target, rounded to ``dtype`` (see the module doc)."""

    def __init__(self, tokens_path, identity: dict, layer_ids: list[int] | None, dtype: str,
                 device: torch.device | str, model_dtype: str | None = None, trust_remote_code: bool = False,
                 token_budget: int = 8192):
        self.dtype = storage_dtype(dtype)
        N, H = int(identity["num_layers"]), int(identity["hidden_size"])
        self.layer_ids = validate_layer_ids(layer_ids or default_layer_ids(N), N)
        self.ids, self.inputs, self.masks = capture.read_tokens(tokens_path)
        self.num_tokens = [len(r) for r in self.inputs]
        self.H = H
        self.meta = {"layer_ids": self.layer_ids, "final_layer": N, "final_is_prenorm": True,
                     "dtype": self.dtype, "hidden_size": H, "target_digest": identity["digest"]}
        dev = str(device)
        mdtype = model_dtype or ("bfloat16" if dev.startswith("cuda") else "float32")
        t0 = time.perf_counter()
        # one target per rank, on this rank's device (ngpu 1: no device_map spread)
        self.model = capture.load_cached(identity["path"], identity["digest"], mdtype, dev, 1, trust_remote_code)
        self.device = self.model.get_input_embeddings().weight.device
        # how the target computes the states (their bytes): part of a checkpoint's identity (eaglet.train.setup)
        self.target_load = {"dtype": mdtype, "device": self.device.type, "trust_remote_code": bool(trust_remote_code)}
        log.info("online hidden states: target loaded in %.1f s on %s (%s); states rounded to %s; %d samples, "
                 "%d tokens", time.perf_counter() - t0, dev, mdtype, self.dtype, len(self.ids), sum(self.num_tokens))
        self.cap = capture.Capture(self.model, self.layer_ids)
        # the target's full-vocabulary statistics of the rounded states, as extraction stores them
        self.stats_head = TargetHead(identity["path"], device=self.device, trust_remote_code=bool(trust_remote_code))
        self._stats_chunks = self.stats_head.full_head()
        self._token_budget = int(token_budget)
        self._ref_final: dict[str, dict[int, torch.Tensor]] = {}
        self._refs: list[list] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @torch.no_grad()
    def _forward(self, batch: list[int], ref_positions: torch.Tensor | None = None):
        """-> (aux_BT3H, final_BTH rounded, zero at padding; mask_BT bool; real logits or None)."""
        ids_BT, mask_BT = capture.pad_batch([self.inputs[i] for i in batch], self.device)
        aux, final_BTH, logits = self.cap(ids_BT, mask_BT, ref_positions)
        aux_BT3H = torch.stack([a.to(final_BTH.device) for a in aux], dim=2)
        if aux_BT3H.shape[-1] != self.H:
            raise RuntimeError(f"captured hidden size {aux_BT3H.shape[-1]}, identity says {self.H}")
        keep = mask_BT.bool().to(final_BTH.device)
        if not (torch.isfinite(aux_BT3H[keep]).all() and torch.isfinite(final_BTH[keep]).all()):
            raise FloatingPointError(f"NaN/Inf in hidden states of samples {[self.ids[i] for i in batch]}")
        zero = final_BTH.new_zeros(())
        aux_BT3H = torch.where(keep[..., None, None], storage_round(aux_BT3H, self.dtype), zero.float())
        final_BTH = torch.where(keep[..., None], storage_round(final_BTH, self.dtype), zero.float())
        return aux_BT3H, final_BTH, keep, logits

    def _stats(self, final_BTH: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(target_lse_BT, target_top1_BT) of the rounded states (zero at padding), as stored offline."""
        lse_N, top1_N = self.stats_head.full_stats(final_BTH[keep], self._stats_chunks)
        lse = torch.zeros(keep.shape, device=final_BTH.device)
        top1 = torch.zeros(keep.shape, dtype=torch.long, device=final_BTH.device)
        lse[keep], top1[keep] = lse_N.to(lse.device), top1_N.to(lse.device)
        return lse, top1

    def collate(self, batch: list[int]) -> dict:
        """The micro-batch as eaglet.train.data.collate builds it from stored samples (on the target's device)."""
        aux, final, keep, _ = self._forward(batch)
        lse, top1 = self._stats(final, keep)
        B, T = keep.shape
        x = torch.zeros(B, T, dtype=torch.long)
        m = torch.zeros(B, T, dtype=torch.bool)
        for b, i in enumerate(batch):
            n = self.num_tokens[i]
            x[b, :n] = torch.as_tensor(self.inputs[i], dtype=torch.long)
            m[b, :n] = torch.as_tensor(self.masks[i]).bool()
        return {"x": x.to(final.device), "mask": m.to(final.device), "aux": aux, "final": final,
                "target_lse": lse, "target_top1": top1, "tokens": sum(self.num_tokens[i] for i in batch)}

    def sample(self, i: int) -> dict:
        """One sample, run alone (the label check; tests)."""
        aux, final, keep, _ = self._forward([i])
        lse, top1 = self._stats(final, keep)
        return {"id": self.ids[i], "input_ids": torch.as_tensor(self.inputs[i], dtype=torch.long),
                "loss_mask": torch.as_tensor(self.masks[i], dtype=torch.int8), "aux": aux[0].cpu(),
                "final": final[0].cpu(), "target_lse": lse[0].cpu(), "target_top1": top1[0].cpu()}

    @property
    def label_references(self) -> list[list]:
        """[sample id, position, real top-1, top-1 - top-2 logit] over the first LABEL_SAMPLES samples
        by id, from the target's full forward (head at a few positions per batch), as extract records
        them; the rounded final states at those positions are kept for ``reference_final``."""
        if self._refs is None:
            self._refs = []
            first = sorted(range(len(self.ids)), key=self.ids.__getitem__)[:LABEL_SAMPLES]
            for rel in capture.make_batches([self.num_tokens[i] for i in first], self._token_budget):
                batch = [first[j] for j in rel]
                pos = capture.reference_positions([self.num_tokens[i] for i in batch], LABEL_REF_PER_BATCH)
                _, final, _, logits = self._forward(batch, pos)
                if logits is None:
                    continue
                v, top = logits.float().topk(2, -1)  # B P 2
                for b, i in enumerate(batch):
                    sid = self.ids[i]
                    for j, q in enumerate(pos.tolist()):
                        self._refs.append([sid, int(q), int(top[b, j, 0]), float(v[b, j, 0] - v[b, j, 1])])
                        self._ref_final.setdefault(sid, {})[int(q)] = final[b, q].cpu()
        return self._refs

    def reference_final(self, sid: str) -> torch.Tensor:
        """final_TH of sample ``sid`` holding the rounded states at its reference positions (zeros
        elsewhere: the label check reads only those)."""
        rows = self._ref_final[sid]
        out = torch.zeros(max(rows) + 1, self.H)
        for q, f in rows.items():
            out[q] = f
        return out

    def close(self) -> None:
        self.cap.remove()


def open_source(online: dict, identity: dict, device: torch.device, token_budget: int) -> OnlineHiddenStates:
    """The online source of a training rank on ``device``, from the trainer's ``--online`` settings:
    ``tokens``, ``layer_ids`` and ``dtype`` (extract's), ``target_load`` (the target section's dtype,
    device, trust_remote_code). The target runs on the rank's GPU, or on the CPU without one (or with
    ``target.device: cpu``)."""
    ld = online.get("target_load") or {}
    setting = ld.get("device", schema.default("target.device"))
    if setting == "cuda" and device.type != "cuda":
        raise ValueError("target.device: cuda, but train.gpus is 0: online training runs the target on "
                         "the training ranks' GPUs (set train.gpus, or target.device: auto)")
    dev = "cpu" if setting == "cpu" else str(device)
    return OnlineHiddenStates(online["tokens"], identity, online.get("layer_ids"),
                              online.get("dtype", schema.default("extract.dtype")), dev, ld.get("dtype"),
                              bool(ld.get("trust_remote_code")), token_budget)


def check_settings(mode: str, online: dict | None) -> None:
    """``train.hidden_states`` against what the trainer was given."""
    if mode not in schema.allowed("train.hidden_states"):
        raise ValueError(f"train.hidden_states: {mode!r} not one of {schema.allowed('train.hidden_states')}")
    if mode == "online" and not online:
        raise ValueError("train.hidden_states: online needs the tokens file and extract settings (--online)")
    if mode == "offline" and online:
        raise ValueError("train.hidden_states: offline, but online settings were given (--online)")
    if online:
        unknown = set(online) - {"tokens", "layer_ids", "dtype", "target_load"}
        if unknown:
            raise ValueError(f"--online: unknown keys {sorted(unknown)}")
        if not online.get("tokens"):
            raise ValueError("--online: no tokens file")
