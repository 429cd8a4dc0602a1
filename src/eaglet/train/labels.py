"""Training labels from the target's own code, proven against the real model.

The trainer's labels are the target's next-token distribution at every stored position, rebuilt
from the stored pre-norm final states by the target's own norm, head and logit post-processing
(eaglet.target.head.TargetHead). :func:`check_against_reference` compares that reconstruction with
the real model's top-1 tokens recorded during extraction (``eaglet.features.extract`` runs the full
model's head at a few positions per batch) and raises :class:`LabelMismatch` when they disagree.
"""

from __future__ import annotations

import logging

import torch

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.target.head import TargetHead

log = logging.getLogger("eaglet.train.labels")

# Largest logit change rounding of the stored final state can cause, per storage dtype (measured on
# SmolLM2 and the tiny family models: bf16 moves a logit by < 0.1, fp8 e4m3 by < 1).
STORAGE_MARGIN = {"float32": 1e-3, "bfloat16": 0.25, "float8_e4m3fn": 2.0}
MIN_POSITIONS = 8


class LabelMismatch(ArtifactError):
    """The reconstructed target distribution does not match the real model's."""


# --------------------------------------------------------------------------- the proof
def reference_rows(refs: list[list], limit: int = 512) -> list[list]:
    """A deterministic sample of the recorded references (sample id, position, top-1, margin)."""
    refs = sorted(refs, key=lambda r: (str(r[0]), int(r[1])))
    if len(refs) <= limit:
        return refs
    step = len(refs) / limit
    return [refs[int(i * step)] for i in range(limit)]


def check_against_reference(head: TargetHead, refs: list[list], final_of, storage_dtype: str,
                            min_agreement: float | None = None) -> dict:
    """Compare the reconstructed top-1 with the real model's on recorded positions.

    ``refs``: rows ``[sample_id, position, real_top1, real_margin]`` (eaglet.features.extract);
    ``final_of(sample_id) -> final_TH`` reads a stored sample. Positions whose real margin is
    within what storage rounding can move are reported but not judged. Returns the record; raises
    LabelMismatch when the agreement is below ``min_agreement`` (None: train.label_min_agreement's
    default); ``ok`` is None (not run) when fewer than MIN_POSITIONS positions could be judged."""
    if min_agreement is None:
        min_agreement = schema.default("train.label_min_agreement")
    margin_min = STORAGE_MARGIN.get(storage_dtype, 2.0)
    by_id: dict[str, list] = {}
    for r in reference_rows(refs):
        by_id.setdefault(str(r[0]), []).append(r)
    real, margins, states = [], [], []
    for sid, rs in by_id.items():
        f = final_of(sid)
        states.append(f[torch.tensor([int(r[1]) for r in rs])].float())
        real += [int(r[2]) for r in rs]
        margins += [float(r[3]) for r in rs]
    mine_t = head.full_top1(torch.cat(states))[0].cpu() if states else torch.zeros(0, dtype=torch.long)
    real_t, marg = torch.tensor(real, dtype=torch.long), torch.tensor(margins)
    judged = marg > margin_min
    n = int(judged.sum())
    agree = float((real_t[judged] == mine_t[judged]).float().mean()) if n else float("nan")
    rec = {"name": "labels.top1_agreement", "positions": len(real), "judged": n, "margin_min": margin_min,
           "agreement": agree, "agreement_all": float((real_t == mine_t).float().mean()) if real else float("nan"),
           "min_agreement": min_agreement, "norm_class": head.norm_class,
           "softcapping": getattr(head.config.get_text_config(), "final_logit_softcapping", None)}
    if n < MIN_POSITIONS:
        rec["ok"] = None
        rec["reason"] = f"only {n} recorded positions with a real top-1 margin > {margin_min}"
        return rec
    rec["ok"] = agree >= min_agreement
    if not rec["ok"]:
        raise LabelMismatch(
            f"training labels do not match the target: top-1 agreement {agree:.3f} < {min_agreement} on {n} "
            f"positions (norm {head.norm_class}); the reconstruction from stored final states is not what "
            f"the target computes — refusing to train toward wrong labels. Record: {rec}")
    return rec
