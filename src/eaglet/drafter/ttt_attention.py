"""The TTT attention of draft steps j >= 1 (docs/eagle3.md §3), linear in T (issue 14); used by
eaglet.drafter.eagle3's ``Eagle3Drafter.ttt_unroll`` and re-exported there.

Shape suffixes: B batch, h heads, T tokens, C queries per chunk, L keys, d head dim.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

# Queries per chunk of the TTT attention. Scores of one chunk are [B, h, C, <=T]: at the Kimi
# config (B*T = 16k, h = 64, T = 4096) C = 256 is ~1 GB fp32 transient, 1/16 of the dense form's
# per-step tensor; smaller chunks only add Python loop overhead (T/C iterations per step).
TTT_QUERY_CHUNK = 256


def ttt_attention(q_BhTd: torch.Tensor, k0_BhTd: torch.Tensor, v0_BhTd: torch.Tensor,
                  diag_k: list[torch.Tensor], diag_v: list[torch.Tensor], recompute: bool = True) -> torch.Tensor:
    """TTT attention of step j >= 1: query t over step-0 keys 0..t plus its own diagonal keys
    ``diag_k[i][:, :, t]`` of steps 1..j, one softmax over all of them -> [B, h, T, d].

    Memory grows linearly in T (issue 14). The dense form built [B, h, T, T + j] scores and kept
    their fp32 softmax for backward: at the Kimi config, tens of GB per step. Here the queries go
    in chunks of ``TTT_QUERY_CHUNK``, each under ``torch.utils.checkpoint``: forward keeps only the
    chunk's output, and backward recomputes one chunk's [B, h, C, hi] scores at a time, so the
    largest tensor is O(C * T) and nothing quadratic outlives a chunk. A chunk ending at query hi
    reads keys 0..hi-1 only, so the causal part costs half the dense FLOPs; forward + recompute
    together cost about what the dense forward did. Each query row is computed by the very
    formula of the dense form (masked keys get exactly zero weight), so values and gradients
    equal it to rounding (tests/drafter/test_eagle3.py compares both at 1e-5 in fp32).

    Why not SDPA or flex attention: the diagonal keys differ per query, so SDPA can take them only
    as extra keys under a [T, (j+1)T] mask, which is O(T^2) again and sends CPU to the math path;
    merging an SDPA causal output with the diagonal terms by log-sum-exp needs the gradient of the
    LSE, which public SDPA does not return and the fused aten kernels return as a
    non-differentiable output; flex attention's block mask needs torch.compile to be
    memory-efficient and materialises the scores in eager mode (the CPU tests, the CPU default run).
    Measured (tests/drafter/test_eagle3.py, tiny target, B=1, 2 heads, 3 steps, forward + backward): the
    largest allocation was 8.4 MB at T=1024 and 33.6 MB at T=2048 dense, 2.1 MB and 4.2 MB here.

    ``recompute=False`` (issue 43, ``train.ttt_attention: saved``): the same chunks without the
    checkpoint, so autograd keeps every chunk's softmax weights (half the dense form's [B, h, T, T + j]:
    only keys 0..hi-1) and backward recomputes nothing. The same values and gradients; faster where
    the scores are small, and the memory plan (eaglet.planner.plan) counts both and picks this one only
    where it fits.
    """
    T = q_BhTd.shape[2]
    outs = []
    for lo in range(0, T, TTT_QUERY_CHUNK):
        hi = min(T, lo + TTT_QUERY_CHUNK)
        chunk = [d[:, :, lo:hi] for d in (*diag_k, *diag_v)]  # views: no copies are saved
        args = (lo, q_BhTd[:, :, lo:hi], k0_BhTd[:, :, :hi], v0_BhTd[:, :, :hi], *chunk)
        outs.append(checkpoint(ttt_attention_chunk, *args, use_reentrant=False) if recompute
                    else ttt_attention_chunk(*args))
    return torch.cat(outs, dim=2)


def ttt_attention_chunk(lo: int, q_BhCd: torch.Tensor, k0_BhLd: torch.Tensor,
                         v0_BhLd: torch.Tensor, *diag: torch.Tensor) -> torch.Tensor:
    """Queries lo..lo+C-1 of ``ttt_attention`` over step-0 keys 0..L-1 (L = lo + C) and their
    diagonal keys/values ``diag`` (j keys then j values, each [B, h, C, d]): the dense formula."""
    j = len(diag) // 2
    C, L = q_BhCd.shape[2], k0_BhLd.shape[2]
    scale = 1.0 / math.sqrt(q_BhCd.shape[-1])
    dev = q_BhCd.device
    causal_CL = torch.arange(L, device=dev) <= torch.arange(lo, lo + C, device=dev)[:, None]
    s0 = ((q_BhCd @ k0_BhLd.transpose(-1, -2)) * scale).masked_fill(~causal_CL, float("-inf"))
    sd = torch.stack([(q_BhCd * dk).sum(-1) for dk in diag[:j]], -1) * scale   # [B, h, C, j]
    p = torch.softmax(torch.cat([s0, sd], -1).float(), -1).to(q_BhCd.dtype)  # fp32 softmax as before
    return p[..., :L] @ v0_BhLd + (p[..., L:, None] * torch.stack(diag[j:], -2)).sum(-2)
