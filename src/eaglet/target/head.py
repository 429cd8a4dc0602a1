"""The target's logits over chosen vocabulary rows from pre-norm final states, computed by the
target's own code: its final norm, its head, its logit post-processing.

Extraction stores the last decoder layer's output *before* the final norm; turning that into logits
is family-specific (Llama ``w·rmsnorm(x)``, Gemma ``(1+w)·rmsnorm(x)`` and a final logit soft-cap,
Granite/Cohere logit scaling, biased heads, ...). A hand copy of one family's maths trained a
Gemma-family drafter toward the wrong labels (37 % top-1 agreement) without a word, so here nothing
is re-implemented: the target's ``*ForCausalLM`` class is built on the meta device from its config,
its decoder is replaced by a stub that returns ``final_norm(x)`` (the target's own norm module with
its real weights), its head by the needed rows of the real head, and the class's own ``forward``
turns that into logits — soft-capping, scaling and all.

    head = TargetHead(model_dir, rows=t2d.nonzero().squeeze(1), device="cpu")
    logits_BTVd = head.logits(final_BTH)            # over the given rows, target's own forward
    lse_N, top1_N = head.full_stats(final_NH)       # over the whole vocab: extraction's statistics
    top1_N, margin_N = head.full_top1(final_NH)     # over the whole vocab, with the top-2 margin

Read by extraction (eaglet.features.extract: the full-vocabulary statistics stored with the states),
online training (eaglet.train.online: the same, in its own forward) and the trainer
(eaglet.train.setup: the draft rows; eaglet.train.labels: the proof against the real model).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from eaglet.base.artifacts import ArtifactError
from eaglet.target.load import read_target_tensor

# Positions per block in full_stats (bounds its memory: a block's logits over one row chunk).
STATS_BLOCK = 4096


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

    def full_head(self) -> list[nn.Linear]:
        """The whole head as row_chunks in row order, in the dtype the statistics are computed in:
        float32 on a CPU, bfloat16 on a GPU (its matmul units; a logit moves by < 0.05)."""
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return self.row_chunks(torch.arange(self.vocab_size), dtype)

    @torch.no_grad()
    def full_stats(self, final_NH: torch.Tensor, chunks: list[nn.Linear] | None = None,
                   block: int = STATS_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """(logsumexp [N] float32, argmax id [N] int64) of the target's logits over the whole
        vocabulary at each pre-norm final state of ``final_NH``: all the trainer needs from the
        head's rows outside a draft vocabulary (the draft vocabulary's probability is
        exp(lse_draft - lse), the greedy token is draftable when t2d[argmax]). Extraction stores
        them with the states. ``chunks``: full_head(), built once by a caller that calls this often;
        positions run in blocks of ``block`` (one block's logits over one chunk in memory)."""
        chunks = self.full_head() if chunks is None else chunks
        N = len(final_NH)
        lse = torch.empty(N, device=self.device)
        top = torch.empty(N, dtype=torch.long, device=self.device)
        for lo in range(0, N, block):
            x = self.normed(final_NH[lo:lo + block].to(self.device))[None]
            b_lse = torch.full(x.shape[1:2], float("-inf"), device=self.device)
            b_max, b_top = b_lse.clone(), torch.zeros(x.shape[1], dtype=torch.long, device=self.device)
            row0 = 0
            for lin in chunks:
                lg = self._forward(x.to(lin.weight.dtype), lin, normed=True)[0]
                v, i = lg.max(-1)
                better = v > b_max  # the first of equal maxima, as argmax over the whole row
                b_top = torch.where(better, i + row0, b_top)
                b_max = torch.maximum(b_max, v)
                b_lse = torch.logaddexp(b_lse, torch.logsumexp(lg, -1))
                row0 += lin.out_features
            if row0 != self.vocab_size:
                raise ValueError(f"full_stats: the chunks hold {row0} rows, the vocabulary {self.vocab_size}")
            lse[lo:lo + block], top[lo:lo + block] = b_lse, b_top
        return lse, top

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
