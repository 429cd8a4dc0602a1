"""The TTT objective and its acceptance figures (eaglet.train.train; alignment in its docstring).

Shape legend: B batch, T padded tokens, V_d draft vocab, K TTT steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.drafter import chain
from eaglet.drafter.model import Eagle3Drafter

# The recipe's options (train params; eaglet.train.train DEFAULTS holds their defaults).
DRAFTER_OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")  # DrafterConfig fields
LOSSES = ("soft_ce", "kl")


def check_recipe(p: dict) -> None:
    """Refuse recipe settings that make no sense (ValueError naming the key)."""
    for key in DRAFTER_OPTIONS + ("freeze_lm_head",):
        if not isinstance(p[key], bool):
            raise ValueError(f"train.{key}: {p[key]!r} is not true or false")
    if p["loss"] not in LOSSES:
        raise ValueError(f"train.loss: {p['loss']!r} not one of {LOSSES}")
    if p["freeze_lm_head"] and p["lm_head_init"] != "target":
        raise ValueError("train.freeze_lm_head needs lm_head_init: target (a frozen random head "
                         "cannot learn anything)")


def drafter_options(p: dict) -> dict:
    """The DrafterConfig overrides of the train params (architecture variants)."""
    return {k: bool(p[k]) for k in DRAFTER_OPTIONS}


def freeze_head(drafter: Eagle3Drafter, p: dict) -> None:
    """``freeze_lm_head``: the head stays the target's rows (speculators); the optimizer and the
    gradient clip see only parameters that require grad."""
    if p["freeze_lm_head"]:
        drafter.lm_head.weight.requires_grad_(False)


class TTTObjective(nn.Module):
    """Drafter + TTT loss in one module, so DDP sees one forward per micro-batch.

    ``loss``: "soft_ce" = -sum p log q; "kl" = sum p (log p - log q) = soft_ce - H(p). The target
    entropy H(p) does not depend on the drafter, so both have the same gradient (bit-equal here:
    the entropy is computed without grad); only the reported loss value differs."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, gamma: float, loss: str = "soft_ce"):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} not one of {LOSSES}")
        self.drafter, self.steps, self.gamma, self.loss = drafter, steps, gamma, loss

    def forward(self, x_BT, aux_BT3H, p_BTVd, valid_BT, noise=None, chain_BT=None):
        """valid_BT[s] = target position s counts (its next token x_{s+1} is an assistant token
        whose greedy target prediction is in the draft vocab). -> (loss, stats [3, K], hits).
        ``chain_BT`` (validation): chain_BT[s] = x_{s+1} is the target's greedy pick at s; then
        hits [B, T, K] bool: step k at index t drafts the target's greedy token x_{t+2+k}
        (None without chain_BT)."""
        if noise is not None:
            aux_BT3H = aux_BT3H + noise
        g = self.drafter.project(aux_BT3H)
        T = x_BT.shape[1]
        loss = g.new_zeros((), dtype=torch.float32)
        stats = torch.zeros(3, self.steps, device=x_BT.device)  # L_k, correct_k, count_k
        hits = None if chain_BT is None else torch.zeros(*x_BT.shape, self.steps, dtype=torch.bool,
                                                         device=x_BT.device)
        for k, logits, _ in self.drafter.ttt_unroll(x_BT, g, self.steps):
            n = T - 2 - k  # indices t whose drafted token x_{t+2+k} exists
            if n <= 0:
                loss = loss + 0.0 * logits.sum()  # keep every parameter in the graph (DDP)
                continue
            lp = F.log_softmax(logits[:, :n].float(), -1)
            tgt = p_BTVd[:, 1 + k:1 + k + n]
            valid = valid_BT[:, 1 + k:1 + k + n]
            cnt = valid.sum()
            ce = -(tgt * lp).sum(-1)
            if self.loss == "kl":
                with torch.no_grad():
                    neg_entropy = torch.xlogy(tgt, tgt).sum(-1)  # - H(p): no gradient
                ce = ce + neg_entropy
            L = (ce * valid).sum() / cnt.clamp(min=1)
            loss = loss + self.gamma ** k * L
            with torch.no_grad():
                agree = lp.argmax(-1) == tgt.argmax(-1)
                stats[0, k] = L.detach()
                stats[1, k] = (agree & valid).sum()
                stats[2, k] = cnt
                if hits is not None:
                    hits[:, :n, k] = agree & chain_BT[:, 1 + k:1 + k + n]
        return loss, stats, hits


def valid_positions(batch: dict, t2d: torch.Tensor, inv_BT) -> torch.Tensor:
    """valid[s]: x_{s+1} is an assistant token and the target's greedy pick at s is draftable."""
    x, m = batch["x"], batch["mask"]
    v = torch.zeros_like(m)
    v[:, :-1] = m[:, 1:]
    if inv_BT is not None:
        v &= inv_BT
    else:  # oov_rule "label": the next token itself must be draftable
        nxt = torch.zeros_like(x)
        nxt[:, :-1] = x[:, 1:]
        v &= t2d[nxt]
    return v


def chain_positions(batch: dict, valid_BT: torch.Tensor, p_BTVd: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """chain[s]: position s counts (valid) and the data's next token x_{s+1} is the target's greedy
    pick there (its draft-vocab argmax, in the draft vocab): the greedy chain runs on through s."""
    i = p_BTVd.argmax(-1)
    ok = torch.zeros_like(valid_BT)
    ok[:, :-1] = (i + d2t[i])[:, :-1] == batch["x"][:, 1:]
    return valid_BT & ok


def chain_counts(hits_BTK: torch.Tensor, mask_BT: torch.Tensor,
                 per_sequence: list | None = None) -> torch.Tensor:
    """[K, 2]: for k = 1..K, accepted drafts and rounds with drafts of the replayed greedy chain
    (eaglet.drafter.chain) over every assistant span of the batch. ``per_sequence`` receives each row's
    (accepted, rounds) at k = K (the learning curve resamples sequences)."""
    K = hits_BTK.shape[-1]
    acc_BT = chain.accepted_runs(hits_BTK).tolist()
    out = torch.zeros(K, 2, dtype=torch.float64)
    for b, m in enumerate(mask_BT.tolist()):
        for k in range(1, K + 1):
            drafted = [r for r in chain.sequence_rounds(acc_BT[b], m, k) if r[1] > 0]
            out[k - 1, 0] += sum(r[2] for r in drafted)
            out[k - 1, 1] += len(drafted)
        if per_sequence is not None:  # drafted is k = K's
            per_sequence.append((sum(r[2] for r in drafted), len(drafted)))
    return out


def is_better(val_row: dict, best: dict | None) -> bool:
    """Checkpoint selection on the validation chain τ; a tie goes to the later pass (more training
    at the same acceptance), and a pass without a chain τ (no rounds) never replaces one."""
    tau = val_row.get("chain_tau")
    if best is None:
        return True
    if tau is None:
        return best["chain_tau"] is None
    return best["chain_tau"] is None or tau >= best["chain_tau"]


def tf_tau(acc: list[float]) -> float:
    """Teacher-forced acceptance estimate 1 + sum_k prod_{i<=k} acc_i (optimistic; see the module
    docstring: the exact figure is the chain τ)."""
    t, p = 1.0, 1.0
    for a in acc:
        p *= a
        t += p
    return t
