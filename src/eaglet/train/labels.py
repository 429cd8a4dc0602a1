"""Training labels from the target's own code: its final norm, its head, its logit post-processing.

The trainer needs the target's next-token distribution at every stored position. Extraction stores
the last decoder layer's output *before* the final norm; turning that into logits is
family-specific (Llama ``w·rmsnorm(x)``, Gemma ``(1+w)·rmsnorm(x)`` and a final logit soft-cap,
Granite/Cohere logit scaling, biased heads, ...). A hand copy of one family's maths trained a
Gemma-family drafter toward the wrong labels (37 % top-1 agreement) without a word, so here
nothing is re-implemented: the target's ``*ForCausalLM`` class is built on the meta device from
its config, its decoder is replaced by a stub that returns ``final_norm(x)`` (the target's own
norm module with its real weights), its head by the needed rows of the real head, and the
class's own ``forward`` turns that into logits — soft-capping, scaling and all.

    head = TargetHead(model_dir, rows=t2d.nonzero().squeeze(1), device="cpu")
    logits_BTVd = head.logits(final_BTH)            # over the given rows, target's own forward
    top1_N, margin_N = head.full_top1(final_NH)      # over the whole vocab, in row chunks

:func:`check_against_reference` compares the reconstruction with the real model's top-1 tokens
recorded during extraction (``eaglet.features.extract`` runs the full model's head at a few positions per
batch) and raises :class:`LabelMismatch` when they disagree.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from eaglet.base import schema
from eaglet.base.artifacts import ArtifactError
from eaglet.target.load import read_target_tensor

log = logging.getLogger("eaglet.train.labels")

# Largest logit change rounding of the stored final state can cause, per storage dtype (measured on
# SmolLM2 and the tiny family models: bf16 moves a logit by < 0.1, fp8 e4m3 by < 1).
STORAGE_MARGIN = {"float32": 1e-3, "bfloat16": 0.25, "float8_e4m3fn": 2.0}
MIN_POSITIONS = 8


class LabelMismatch(ArtifactError):
    """The reconstructed target distribution does not match the real model's."""


class _Decoder(nn.Module):
    """Stands in for the target's decoder: returns ``fn(inputs_embeds)`` as its last hidden state."""

    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return _DecoderOutput(last_hidden_state=self.fn(inputs_embeds))


class _DecoderOutput(BaseModelOutputWithPast):
    """A decoder output whose other fields (MoE ``router_logits``, ...) read as None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _module_name(root: nn.Module, mod: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is mod:
            return name
    raise LookupError(f"{type(mod).__name__} not found in {type(root).__name__}")


def _skeleton(model_dir: Path, trust_remote_code: bool):
    """The target's CausalLM class on the meta device (no memory), with one decoder layer where
    the config allows it (the decoder is replaced anyway)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    small = copy.deepcopy(conf)
    text = getattr(small, "text_config", None) or small
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(getattr(text, key, None), list):
            setattr(text, key, getattr(text, key)[:1])
    text.num_hidden_layers = 1
    for c in (small, conf):
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(c, trust_remote_code=trust_remote_code), conf
        except Exception as e:  # noqa: BLE001 - a one-layer variant may not validate; try the real one
            err = e
    raise ArtifactError(f"{model_dir}: cannot build the target's CausalLM class from its config: {err}")


class TargetHead:
    """The target's logits over chosen vocabulary rows from stored pre-norm final states."""

    def __init__(self, model_dir: str | Path, rows: torch.Tensor | None = None, device="cpu",
                 trust_remote_code: bool = False, chunk_rows: int = 16384):
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.chunk_rows = chunk_rows
        lm, conf = _skeleton(self.model_dir, trust_remote_code)
        self.config = conf
        decoder = lm.get_decoder()
        norm = getattr(decoder, "norm", None)
        if norm is None:
            raise ArtifactError(f"{model_dir}: the target's decoder ({type(decoder).__name__}) has no final "
                                "`norm` module; eaglet cannot place its pre-norm capture")
        self.norm_class = type(norm).__name__
        prefix = _module_name(lm, norm)
        norm = norm.to_empty(device="cpu")
        with torch.no_grad():
            for pname, p in norm.named_parameters(recurse=True):
                p.copy_(read_target_tensor(self.model_dir, f"{prefix}.{pname}").to(p.dtype))
        self.norm = norm.float().to(self.device).eval()
        head = lm.get_output_embeddings()
        self.head_bias = getattr(head, "bias", None) is not None
        self.tied = bool(getattr(conf.get_text_config(), "tie_word_embeddings", False)) or \
            bool(getattr(conf, "tie_word_embeddings", False))
        self.head_name = f"{_module_name(lm, head)}.weight"
        self.embed_name = f"{_module_name(lm, lm.get_input_embeddings())}.weight"
        self.vocab_size = int(head.out_features)
        self.hidden_size = int(head.in_features)
        # the class's own forward, with the decoder and the head swapped for the real pieces
        self.lm = lm
        self._swap_decoder(self.norm)
        self.rows = None
        self.row_linear = None
        if rows is not None:
            self.rows = rows.long()
            self.row_linear = self._rows_linear(self.rows)

    # ----------------------------------------------------------------- pieces
    def _swap_decoder(self, fn: nn.Module) -> None:
        setattr(self.lm, self.lm.base_model_prefix, _Decoder(fn))

    def _head_rows(self, rows: torch.Tensor, name_suffix: str) -> torch.Tensor:
        name = self.head_name.removesuffix(".weight") + name_suffix
        try:
            return read_target_tensor(self.model_dir, name, rows=rows)
        except ArtifactError:
            if self.tied and name_suffix == ".weight":  # tied heads are often not saved
                return read_target_tensor(self.model_dir, self.embed_name, rows=rows)
            raise

    def _rows_linear(self, rows: torch.Tensor) -> nn.Linear:
        lin = nn.Linear(self.hidden_size, len(rows), bias=self.head_bias)
        with torch.no_grad():
            lin.weight.copy_(self._head_rows(rows, ".weight").float())
            if self.head_bias:
                lin.bias.copy_(self._head_rows(rows, ".bias").float())
        return lin.to(self.device).eval()

    @torch.no_grad()
    def _forward(self, x_BTH: torch.Tensor, head: nn.Linear, normed: bool = False) -> torch.Tensor:
        self.lm.set_output_embeddings(head)
        if normed:
            self._swap_decoder(nn.Identity())
        try:
            out = self.lm(inputs_embeds=x_BTH.float(), use_cache=False, return_dict=True)
        finally:
            if normed:
                self._swap_decoder(self.norm)
        return out.logits.float()

    # ----------------------------------------------------------------- API
    @torch.no_grad()
    def normed(self, final_BTH: torch.Tensor) -> torch.Tensor:
        return self.norm(final_BTH.float())

    @torch.no_grad()
    def logits(self, final_BTH: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """Target logits over ``rows`` (the draft vocab) at every position."""
        if self.row_linear is None:
            raise ValueError("TargetHead built without rows")
        return self._forward(final_BTH.to(self.device), self.row_linear, normed)

    def row_chunks(self, rows: torch.Tensor, dtype=torch.float32) -> list[nn.Linear]:
        """The head restricted to ``rows``, as Linear pieces of at most ``chunk_rows`` rows."""
        return [self._rows_linear(rows[lo:lo + self.chunk_rows]).to(dtype)
                for lo in range(0, len(rows), self.chunk_rows)]

    @torch.no_grad()
    def max_over(self, final_BTH: torch.Tensor, chunks: list[nn.Linear], normed: bool = False) -> torch.Tensor:
        """Largest target logit over the rows of ``chunks`` (see row_chunks) at every position."""
        best = torch.full(final_BTH.shape[:-1], float("-inf"), device=self.device)
        for lin in chunks:
            x = final_BTH.to(self.device, lin.weight.dtype)
            best = torch.maximum(best, self._forward(x, lin, normed).amax(-1))
        return best

    @torch.no_grad()
    def max_lse_over(self, final_BTH: torch.Tensor, chunks: list[nn.Linear],
                     normed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(largest logit, logsumexp of the logits) over the rows of ``chunks`` at every position:
        with the draft rows' logsumexp, the target's probability mass on the draft vocabulary."""
        best = torch.full(final_BTH.shape[:-1], float("-inf"), device=self.device)
        lse = best.clone()
        for lin in chunks:
            x = final_BTH.to(self.device, lin.weight.dtype)
            lg = self._forward(x, lin, normed)
            best = torch.maximum(best, lg.amax(-1))
            lse = torch.logaddexp(lse, torch.logsumexp(lg, -1))
        return best, lse

    @torch.no_grad()
    def full_top1(self, final_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-1 id, top-1 minus top-2 logit) over the whole vocabulary."""
        x = self.normed(final_NH.to(self.device))
        top2_v = torch.full((len(x), 2), float("-inf"), device=self.device)
        top2_i = torch.zeros((len(x), 2), dtype=torch.long, device=self.device)
        for lo in range(0, self.vocab_size, self.chunk_rows):
            rows = torch.arange(lo, min(self.vocab_size, lo + self.chunk_rows))
            lg = self._forward(x[None], self._rows_linear(rows), normed=True)[0]
            v, i = lg.topk(min(2, lg.shape[-1]), -1)
            cat_v, cat_i = torch.cat([top2_v, v], -1), torch.cat([top2_i, i + lo], -1)
            top2_v, idx = cat_v.topk(2, -1)
            top2_i = cat_i.gather(-1, idx)
        return top2_i[:, 0], top2_v[:, 0] - top2_v[:, 1]


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
