"""The TTT objective and its acceptance figures (eaglet.train.train; alignment in its docstring).

Shape legend: B batch, T padded tokens, V_d draft vocab, K TTT steps.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.base import schema
from eaglet.drafter import chain
from eaglet.drafter.eagle3 import Eagle3Drafter
from eaglet.drafter.ttt_attention import ttt_attention

# The recipe's options (train params; their defaults and allowed values: the config schema, read
# through eaglet.base.schema: schema.allowed("train.loss") are the losses step_loss computes).
DRAFTER_OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")  # DrafterConfig fields
LK = ("lk_lambda", "lk_alpha")  # the acceptance-targeted losses (arXiv 2602.23881): need the target's mass


def check_recipe(p: dict) -> None:
    """Refuse recipe settings that make no sense (ValueError naming the key)."""
    for key in DRAFTER_OPTIONS + ("freeze_lm_head",):
        if not isinstance(p[key], bool):
            raise ValueError(f"train.{key}: {p[key]!r} is not true or false")
    if p["loss"] not in schema.allowed("train.loss"):
        raise ValueError(f"train.loss: {p['loss']!r} not one of {schema.allowed('train.loss')}")
    if not 0 <= float(p["kl_scale"]) <= 1 or float(p["kl_decay"]) < 0:
        raise ValueError(f"train.kl_scale must be in [0, 1] and train.kl_decay >= 0, got {p['kl_scale']}, "
                         f"{p['kl_decay']}")
    if float(p["select_temperature"]) not in (0.0, 1.0):
        raise ValueError(f"train.select_temperature: {p['select_temperature']!r} not 0 (exact greedy chain) "
                         "or 1 (expected acceptance)")
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


def acceptance(q_BNV: torch.Tensor, p_BNV: torch.Tensor, mass_BN: torch.Tensor | None) -> torch.Tensor:
    """α = Σ_x min(p(x), q(x)) over the draft vocab, as vLLM's rejection sampler sees it: p is the
    target's distribution over its whole vocab (``p_BNV`` renormalised over the draft vocab times
    ``mass_BN``, the target's probability of the draft vocab; None = 1) and a target token outside
    the draft vocab has draft probability 0 (it adds min(p, 0) = 0)."""
    if mass_BN is not None:
        p_BNV = p_BNV * mass_BN[..., None]
    return torch.minimum(p_BNV, q_BNV).sum(-1)


def step_loss(lp_BNV: torch.Tensor, p_BNV: torch.Tensor, valid_BN: torch.Tensor, loss: str,
              mass_BN: torch.Tensor | None = None, kl_scale: float = 1.0, kl_decay: float = 3.0):
    """One TTT step's loss over its counted positions -> (L, α_BN or None).

    soft_ce    mean over positions of -Σ p log q (p renormalised over the draft vocab)
    kl         the same plus Σ p log p (no gradient): the same gradient, the loss value is KL(p || q)
    lk_alpha   -mean log α: the negative log-acceptance; its gradient is TV's rescaled by 1/α, so it
               does not vanish where acceptance is low (LK losses, arXiv 2602.23881)
    lk_lambda  w KL + (1 - w)(1 - mean α), w = kl_scale exp(-kl_decay mean α) with mean α detached:
               KL leads while acceptance is low, the acceptance (1 - TV) term takes over as it rises
    α (the acceptance-targeted losses only) is returned for the caller's figures."""
    cnt = valid_BN.sum().clamp(min=1)
    ce_BN = -(p_BNV * lp_BNV).sum(-1)
    if loss in ("kl", "lk_lambda"):
        with torch.no_grad():
            neg_entropy_BN = torch.xlogy(p_BNV, p_BNV).sum(-1)  # - H(p): no gradient
        ce_BN = ce_BN + neg_entropy_BN
    L = (ce_BN * valid_BN).sum() / cnt
    if loss not in LK:
        return L, None
    a_BN = acceptance(lp_BNV.exp(), p_BNV, mass_BN)
    if loss == "lk_alpha":
        return -(torch.log(a_BN.clamp(min=1e-12)) * valid_BN).sum() / cnt, a_BN
    a = (a_BN * valid_BN).sum() / cnt
    w = kl_scale * torch.exp(-kl_decay * a.detach())
    return w * L + (1 - w) * (1 - a), a_BN


class TTTObjective(nn.Module):
    """Drafter + TTT loss in one module, so DDP sees one forward per micro-batch (``loss``: see
    :func:`step_loss`; ``kl_scale``/``kl_decay``: lk_lambda's weight; ``recompute``: the TTT attention
    recomputes each query chunk in backward (True) or keeps its softmax weights (False, faster, more
    memory: ``ttt_attention``'s ``recompute``, chosen by the memory plan))."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, gamma: float, loss: str = "soft_ce",
                 kl_scale: float = 1.0, kl_decay: float = 3.0, recompute: bool = True):
        super().__init__()
        if loss not in schema.allowed("train.loss"):
            raise ValueError(f"loss {loss!r} not one of {schema.allowed('train.loss')}")
        self.drafter, self.steps, self.gamma, self.loss = drafter, steps, gamma, loss
        self.kl_scale, self.kl_decay = kl_scale, kl_decay
        self.attention = partial(ttt_attention, recompute=recompute)

    def forward(self, x_BT, aux_BT3H, p_BTVd, valid_BT, noise=None, chain_BT=None, mass_BT=None,
                counted_only: bool = False):
        """valid_BT[s] = target position s counts (its next token x_{s+1} is an assistant token
        whose greedy target prediction is in the draft vocab). -> (loss, stats [3, K], hits, alpha).
        ``chain_BT`` (validation): chain_BT[s] = x_{s+1} is the target's greedy pick at s; then
        hits [B, T, K] bool: step k at index t drafts the target's greedy token x_{t+2+k}
        (None without chain_BT). ``mass_BT``: the target's probability of the draft vocab at each
        position (TargetHead with mass): then alpha [B, T, K] = step k's acceptance α at index t
        (0 past the sequence), else None. The LK losses need it. ``counted_only`` (a training step):
        the drafter's head, softmax and loss run at the counted positions only; loss and stats are
        the same (positions that do not count add nothing to either), hits and alpha are None."""
        if noise is not None:
            aux_BT3H = aux_BT3H + noise
        if self.loss in LK and mass_BT is None:
            raise ValueError(f"loss {self.loss}: the target's mass on the draft vocab (mass_BT) is needed")
        if counted_only and chain_BT is not None:
            raise ValueError("TTTObjective: counted_only computes no chain hits (validation needs every position)")
        g = self.drafter.project(aux_BT3H)
        B, T = x_BT.shape
        loss = g.new_zeros((), dtype=torch.float32)
        stats = torch.zeros(3, self.steps, device=x_BT.device)  # L_k, correct_k, count_k
        hits = None if chain_BT is None else torch.zeros(*x_BT.shape, self.steps, dtype=torch.bool,
                                                         device=x_BT.device)
        alpha = None if mass_BT is None or counted_only else torch.zeros(*x_BT.shape, self.steps,
                                                                         device=x_BT.device)
        counted = None
        if counted_only:  # step k's index t counts iff target position t + 1 + k does
            counted = torch.zeros(self.steps, B, T, dtype=torch.bool, device=x_BT.device)
            for k in range(self.steps):
                if T - 2 - k > 0:
                    counted[k, :, :T - 2 - k] = valid_BT[:, 1 + k:T - 1]
        at = None if counted is None else counted.__getitem__
        for k, logits, _ in self.drafter.ttt_unroll(x_BT, g, self.steps, self.attention, logits_at=at):
            n = T - 2 - k  # indices t whose drafted token x_{t+2+k} exists
            if n <= 0:
                loss = loss + 0.0 * logits.sum()  # keep every parameter in the graph (DDP)
                continue
            if counted is None:
                lp = F.log_softmax(logits[:, :n].float(), -1)
                tgt = p_BTVd[:, 1 + k:1 + k + n]
                valid = valid_BT[:, 1 + k:1 + k + n]
                mass = None if mass_BT is None else mass_BT[:, 1 + k:1 + k + n]
            else:  # [N] rows of the counted positions, in the order the head returned them
                lp = F.log_softmax(logits.float(), -1)
                sel = counted[k, :, :n]
                tgt = p_BTVd[:, 1 + k:1 + k + n][sel]
                valid = torch.ones(len(lp), dtype=torch.bool, device=lp.device)
                mass = None if mass_BT is None else mass_BT[:, 1 + k:1 + k + n][sel]
            L, a = step_loss(lp, tgt, valid, self.loss, mass, self.kl_scale, self.kl_decay)
            loss = loss + self.gamma ** k * L
            with torch.no_grad():
                if alpha is not None:
                    alpha[:, :n, k] = a.detach() if a is not None else acceptance(lp.exp(), tgt, mass)
                agree = lp.argmax(-1) == tgt.argmax(-1)
                stats[0, k] = L.detach()
                stats[1, k] = (agree & valid).sum()
                stats[2, k] = valid.sum()
                if hits is not None:
                    hits[:, :n, k] = agree & chain_BT[:, 1 + k:1 + k + n]
        return loss, stats, hits, alpha


def expected_counts_BT(alpha_BTK: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[K, 2]: for k = 1..K, Σ expected accepted drafts and the starts counted, at T = 1 along the
    validation sequences' unroll, the standard way: from every start t whose k drafted tokens
    x_{t+2..t+1+k} are assistant tokens, expected accepted = Σ_{j<k} Π_{i<=j} α_{t,i}
    (eaglet.drafter.chain.expected_counts over the same starts; τ = 1 + Σ / starts)."""
    B, T, K = alpha_BTK.shape
    run = torch.cumprod(alpha_BTK.double(), -1)  # drafts 1..j all accepted
    out = torch.zeros(K, 2, dtype=torch.float64, device=alpha_BTK.device)
    m = mask_BT.bool()
    for k in range(1, K + 1):
        n = T - 1 - k  # starts t with x_{t+1+k} inside the sequence
        if n <= 0:
            continue
        ok = torch.ones(B, n, dtype=torch.bool, device=m.device)
        for i in range(k):
            ok &= m[:, 2 + i:2 + i + n]
        out[k - 1, 0] = (run[:, :n, :k].sum(-1) * ok).sum()
        out[k - 1, 1] = ok.sum()
    return out


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


def is_better(val_row: dict, best: dict | None, key: str = "chain_tau") -> bool:
    """Checkpoint selection on the validation τ named ``key`` (``chain_tau``: the exact greedy chain,
    T = 0; ``exp_tau``: the expected chain at T = 1); a tie goes to the later pass (more training at
    the same acceptance), and a pass without that τ (no rounds) never replaces one."""
    tau = val_row.get(key)
    if best is None:
        return True
    if tau is None:
        return best["tau"] is None
    return best["tau"] is None or tau >= best["tau"]


def tf_tau(acc: list[float]) -> float:
    """Teacher-forced acceptance estimate 1 + sum_k prod_{i<=k} acc_i (optimistic; see the module
    docstring: the exact figure is the chain τ)."""
    t, p = 1.0, 1.0
    for a in acc:
        p *= a
        t += p
    return t
