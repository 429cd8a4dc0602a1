"""``train.init_from``: continue a published EAGLE-3 drafter (a directory as vLLM loads it, eaglet's
export or a peer's: eaglet.drafter.published reads it) instead of a fresh one.

Checked against the run before any step, each refusal naming the difference:
  - one decoder layer (eaglet's drafter has one ``midlayer``);
  - ``hidden_size`` and ``target_hidden_size`` = this target's hidden size (the drafter shares its
    embedding), ``vocab_size`` = this target's vocabulary;
  - the aux layer ids it was trained on (vLLM's reading of its config.json; none = vLLM's default for
    this target) = the ids of this run's hidden states (``extract.layer_ids`` says which);
  - the architecture variants = this run's ``train.norm_before_fc`` / ``norm_before_residual`` /
    ``norm_output``; ``hidden_act`` silu (vLLM's Llama MLP);
  - the tensors of the format, each of the shape its config gives (a missing or misshapen one is
    refused by name); an ``embed_tokens.weight`` it ships must be this target's embedding;
  - the draft vocabulary. The same map (target id = i + d2t[i]) is used as is. Another one is remapped
    row by row by target token id: the lm_head row of each draft token both vocabularies hold is
    copied to that token's row in this run's vocabulary; a token new to this run's vocabulary keeps
    its fresh row (``train.lm_head_init``: the target's head row or a random one); the drafter's
    tokens this run's vocabulary lacks are dropped. Both are logged and recorded in
    train_summary.json (``init_from``). When the shared tokens are fewer than ``train.init_min_overlap``
    of this run's draft vocabulary the run is refused (a drafter for other text, or another tokenizer
    with the same vocabulary size).
The width of the drafter's own layer (heads, KV heads, head dim, MLP width), its RMSNorm epsilon and
RoPE, where they differ from what this target would give a fresh drafter, are the drafter's: the run
continues that drafter (logged and recorded as ``adopted``). A drafter exported for another target
digest of the same shape (the base model of a fine-tuned target) is continued, with a log line.

Resume: a checkpoint of this run (eaglet.train.setup.resume) restores its own weights over the loaded
ones; the drafter's digest is part of the checkpoints' identity, so a checkpoint of a run that
started from another drafter (or none) is stale and discarded.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.drafter import published
from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
from eaglet.target.load import default_layer_ids

log = logging.getLogger("eaglet.train.train")

VARIANT_KEYS = ("norm_before_fc", "norm_before_residual", "norm_output")
# the drafter's own layer: taken from the directory where it differs from a fresh drafter's
ADOPTED = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta",
           "rope_parameters", "max_position_embeddings")


@dataclasses.dataclass
class Published:
    """A published drafter checked against the run: its config (the run's ``cfg`` with the drafter's
    own layer), tensors and vocabulary map, and what the check found (``record``)."""
    path: Path
    cfg: DrafterConfig
    weights: dict
    d2t: torch.Tensor
    embed: torch.Tensor | None
    record: dict


def open_checked(path: str | Path, cfg: DrafterConfig, identity: dict) -> Published:
    """Read ``path`` and check it against this run's fresh ``cfg`` (the target's shapes, the hidden
    states' layer ids, the run's variants and draft vocab size); raises ArtifactError naming the
    difference. Returns the config the run trains (``cfg`` with the drafter's own layer)."""
    d = Path(path)
    if not d.is_dir():
        raise ArtifactError(f"train.init_from: {d} is not a directory")
    dig = published.digest(d)
    conf = published.read_config(d)
    where = f"train.init_from {d}"
    n_layers = int(conf.get("num_hidden_layers") or 1)
    if n_layers != 1:
        raise ArtifactError(f"{where}: num_hidden_layers {n_layers}; eaglet's drafter has one decoder layer")
    H = int(identity["hidden_size"])
    for field in ("hidden_size", "target_hidden_size"):
        have = conf.get(field) or conf["hidden_size"]
        if int(have) != H:
            raise ArtifactError(f"{where}: a drafter for another target: {field} {have}, this target's hidden "
                                f"size is {H}")
    if int(conf["vocab_size"]) != int(identity["vocab_size"]):
        raise ArtifactError(f"{where}: a drafter for another target: vocab_size {conf['vocab_size']}, this "
                            f"target's vocabulary has {identity['vocab_size']} tokens")
    ids = published.layer_ids(conf)
    ids_from = "its config.json"
    if ids is None:
        ids, ids_from = default_layer_ids(int(identity["num_layers"])), "vLLM's default for this target"
    if list(ids) != list(cfg.layer_ids):
        raise ArtifactError(f"{where}: trained on aux layer ids {ids} ({ids_from}), this run's hidden states are "
                            f"at {list(cfg.layer_ids)}: set extract.layer_ids: {ids} to continue it")
    init = published.drafter_config(conf, d, ids)
    if init.hidden_act != "silu":
        raise ArtifactError(f"{where}: hidden_act {init.hidden_act!r}; the drafter's MLP is silu (vLLM's Llama MLP)")
    keys = [k for k in VARIANT_KEYS if getattr(init, k) != getattr(cfg, k)]
    if keys:
        diff = "; ".join(f"train.{k}: the drafter has {getattr(init, k)}, this run {getattr(cfg, k)}" for k in keys)
        fix = ", ".join(f"train.{k}: {str(getattr(init, k)).lower()}" for k in keys)
        raise ArtifactError(f"{where}: another architecture variant ({diff}): set {fix} to continue it")
    adopted = {k: {"drafter": getattr(init, k), "fresh": getattr(cfg, k)} for k in ADOPTED
               if getattr(init, k) != getattr(cfg, k)}
    run_cfg = dataclasses.replace(cfg, **{k: getattr(init, k) for k in ADOPTED})
    weights, d2t, _t2d, embed = published.read_tensors(d, init)
    if init.target_digest and init.target_digest != identity.get("digest"):
        log.info("%s: exported for target %s, this target is %s (same shapes): continued", where,
                 init.target_digest[:12], str(identity.get("digest"))[:12])
    if adopted:
        log.info("%s: the drafter's own layer differs from a fresh drafter's, continued as it is: %s", where,
                 ", ".join(f"{k} {v['drafter']} (fresh {v['fresh']})" for k, v in adopted.items()))
    record = {"path": str(d), "digest": dig, "layer_ids_from": ids_from, "draft_vocab_size": init.draft_vocab_size,
              "exported_for_target": init.target_digest or None, "adopted": adopted}
    return Published(d, run_cfg, weights, d2t, embed, record)


def load_into(drafter: Eagle3Drafter, src: Published, d2t: torch.Tensor, min_overlap: float) -> dict:
    """Copy the checked drafter's weights into this run's ``drafter`` (built with ``src.cfg``, its head
    already at its fresh init), its lm_head as is (same vocabulary map) or remapped by token id;
    returns ``src.record`` with what was done. Refuses an embedding that is not the target's and a
    draft vocabulary sharing fewer than ``min_overlap`` of this run's draft tokens."""
    where = f"train.init_from {src.path}"
    if src.embed is not None:
        mine = drafter.embed_tokens.weight.detach()
        if not torch.equal(src.embed.float(), mine.to(src.embed.dtype).float()):
            raise ArtifactError(f"{where}: tensor {published.EMBED} is not this target's embedding (vLLM would "
                                "run the drafter with that copy; eaglet's drafter shares the target's)")
    V = drafter.cfg.vocab_size
    have = torch.arange(len(src.d2t)) + src.d2t.long()  # the drafter's draft tokens, as target ids
    want = torch.arange(len(d2t)) + d2t.long().cpu()  # this run's
    head = src.weights["lm_head.weight"]
    rec = dict(src.record)
    if torch.equal(have, want):
        rows = head
        rec["vocab"] = {"map": "same", "shared": len(want), "new": 0, "dropped": 0}
        log.info("%s: the same draft vocabulary (%d tokens): its lm_head is used as is", where, len(want))
    else:
        row_of = torch.full((V,), -1, dtype=torch.long)
        row_of[have] = torch.arange(len(have))
        src_row = row_of[want]  # for each of this run's draft tokens: its row in the drafter's head, or -1
        shared = src_row >= 0
        n = int(shared.sum())
        new_ids = want[~shared]
        rec["vocab"] = {"map": "remapped by token id", "shared": n, "new": len(want) - n,
                        "dropped": len(have) - n, "overlap": n / len(want), "min_overlap": float(min_overlap),
                        "new_token_ids_first": new_ids[:20].tolist(),
                        "new_rows": "kept at their fresh init (train.lm_head_init)"}
        if n < min_overlap * len(want):
            raise ArtifactError(
                f"{where}: its draft vocabulary ({len(have)} tokens) holds {n} of this run's {len(want)} draft "
                f"tokens ({n / len(want):.1%}), under train.init_min_overlap {min_overlap}: a drafter for other "
                "text or another tokenizer; refused rather than continued on a mostly fresh head")
        rows = drafter.lm_head.weight.detach().cpu().clone()
        rows[shared] = head[src_row[shared]]
        log.warning("%s: another draft vocabulary: lm_head remapped by token id: %d of this run's %d draft tokens "
                    "copied from the drafter, %d new ones keep their fresh init (e.g. ids %s), %d of the "
                    "drafter's dropped", where, n, len(want), len(want) - n, new_ids[:8].tolist(), len(have) - n)
    state = {**src.weights, "lm_head.weight": rows, "embed_tokens.weight": drafter.embed_tokens.weight}
    with torch.no_grad():
        drafter.load_state_dict(state, strict=True)
    return rec
