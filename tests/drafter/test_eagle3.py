"""The drafter: export names/shapes, the step forward against a naive reference, the TTT
attention pattern against real incremental drafting with a KV cache and against the dense
O(T^2) form it replaced (values, gradients, memory), and the file round trip."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from eaglet.base.artifacts import ArtifactError
from eaglet.base.tensors import load_tensors, save_tensors, tensor_metadata
from eaglet.drafter.eagle3 import (
    DrafterConfig,
    Eagle3Drafter,
    KVCache,
    load_drafter,
    save_drafter,
)
from eaglet.target.load import load_target_embedding, read_target_tensor

VD = 256


def make(identity, seed=0, std=0.2):
    cfg = DrafterConfig.from_identity(identity, VD, [2, 4, 5], ttt_steps=3)
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg, load_target_embedding(identity["path"]))
    with torch.no_grad():  # larger than the training init so that every path moves the output
        for p in m.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std / math.sqrt(p.shape[1]) * 4)
            elif p.requires_grad:
                p.uniform_(0.5, 1.5)
    return cfg, m.eval()


def test_export_names_and_shapes(tiny_target):
    cfg, m = make(tiny_target)
    H, d, h, g, inter, V = 128, 64, 2, 1, 256, tiny_target["vocab_size"]
    want = {"fc.weight": (H, 3 * H),
            "midlayer.self_attn.q_proj.weight": (h * d, 2 * H),
            "midlayer.self_attn.k_proj.weight": (g * d, 2 * H),
            "midlayer.self_attn.v_proj.weight": (g * d, 2 * H),
            "midlayer.self_attn.o_proj.weight": (H, h * d),
            "midlayer.mlp.gate_proj.weight": (inter, H), "midlayer.mlp.up_proj.weight": (inter, H),
            "midlayer.mlp.down_proj.weight": (H, inter),
            "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
            "midlayer.post_attention_layernorm.weight": (H,), "norm.weight": (H,),
            "lm_head.weight": (VD, H)}
    got = {k: tuple(v.shape) for k, v in m.trainable_state_dict().items()}
    assert got == want
    assert tuple(m.embed_tokens.weight.shape) == (V, H) and not m.embed_tokens.weight.requires_grad
    assert {n for n, p in m.named_parameters() if p.requires_grad} == set(want)
    assert torch.equal(m.embed_tokens.weight, read_target_tensor(tiny_target["path"], "model.embed_tokens.weight"))


def naive_step(m, ids, hidden):
    """Reference from the vLLM semantics (docs/eagle3.md §2), one sequence, loops, no model methods."""
    sd, c = m.state_dict(), m.cfg
    W = lambda n: sd[n]  # noqa: E731

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps))

    T = len(ids)
    e = sd["embed_tokens.weight"][ids]
    x = torch.cat([rms(e, W("midlayer.input_layernorm.weight")), rms(hidden, W("midlayer.hidden_norm.weight"))], -1)
    q = (x @ W("midlayer.self_attn.q_proj.weight").T).view(T, c.num_heads, c.head_dim)
    k = (x @ W("midlayer.self_attn.k_proj.weight").T).view(T, c.num_kv_heads, c.head_dim)
    v = (x @ W("midlayer.self_attn.v_proj.weight").T).view(T, c.num_kv_heads, c.head_dim)
    half = c.head_dim // 2
    out = torch.zeros(T, c.num_heads, c.head_dim)
    for t in range(T):
        def rot(vec, pos):
            fr = pos / c.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
            a, b = vec[..., :half], vec[..., half:]
            cs, sn = torch.cos(fr).float(), torch.sin(fr).float()
            return torch.cat([a * cs - b * sn, b * cs + a * sn], -1)
        for hh in range(c.num_heads):
            kvh = hh // (c.num_heads // c.num_kv_heads)
            qs = rot(q[t, hh], t)
            sc = torch.stack([qs @ rot(k[s, kvh], s) for s in range(t + 1)]) / math.sqrt(c.head_dim)
            out[t, hh] = torch.softmax(sc, 0) @ v[: t + 1, kvh]
    h = hidden + out.reshape(T, -1) @ W("midlayer.self_attn.o_proj.weight").T
    y = rms(h, W("midlayer.post_attention_layernorm.weight"))
    h = h + (F.silu(y @ W("midlayer.mlp.gate_proj.weight").T) * (y @ W("midlayer.mlp.up_proj.weight").T)) \
        @ W("midlayer.mlp.down_proj.weight").T
    return rms(h, W("norm.weight")) @ W("lm_head.weight").T, h


def test_step_matches_naive_reference(tiny_target):
    cfg, m = make(tiny_target)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (7,))
    hid = torch.randn(7, cfg.hidden_size)
    with torch.no_grad():
        logits, h = m.forward_step(ids[None], hid[None], torch.arange(7)[None])
    ref_logits, ref_h = naive_step(m, ids, hid)
    assert torch.allclose(h[0], ref_h, atol=1e-4)
    assert torch.allclose(logits[0], ref_logits, atol=1e-4)
    # embedding block first: swapping the halves of q/k/v input changes the result
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj"):
            w = getattr(m.midlayer.self_attn, n).weight
            w.copy_(torch.cat([w[:, cfg.hidden_size:], w[:, :cfg.hidden_size]], 1))
        swapped, _ = m.forward_step(ids[None], hid[None], torch.arange(7)[None])
    assert not torch.allclose(swapped, logits, atol=1e-3)


def test_project_concatenates_in_layer_order(tiny_target):
    cfg, m = make(tiny_target)
    aux = torch.randn(2, 5, 3, cfg.target_hidden_size)
    with torch.no_grad():
        g = m.project(aux)
        ref = torch.cat([aux[..., 0, :], aux[..., 1, :], aux[..., 2, :]], -1) @ m.fc.weight.T
    assert torch.allclose(g, ref, atol=1e-5)


def test_ttt_unroll_equals_incremental_drafting(tiny_target):
    """Step k at index t of the TTT unroll == a real draft chain from position t with a cache:
    prefill positions 0..t from target states, then k own-hidden steps at positions t+1..t+k."""
    cfg, m = make(tiny_target)
    torch.manual_seed(2)
    B, T, K = 2, 9, 4
    x = torch.randint(0, cfg.vocab_size, (B, T))
    g = torch.randn(B, T, cfg.hidden_size)
    with torch.no_grad():
        unrolled = [lg for _, lg, _ in m.ttt_unroll(x, g, K)]
        for b in range(B):
            for t in range(T - K - 1):
                cache = KVCache()
                lg, h = m.forward_step(x[b:b + 1, 1:t + 2], g[b:b + 1, :t + 1], torch.arange(t + 1)[None], cache)
                assert torch.allclose(lg[0, -1], unrolled[0][b, t], atol=1e-4)
                hid = h[:, -1:]
                for k in range(1, K):
                    lg, hid = m.forward_step(x[b:b + 1, t + 1 + k:t + 2 + k], hid, torch.tensor([[t + k]]), cache)
                    assert torch.allclose(lg[0, 0], unrolled[k][b, t], atol=1e-4), (b, t, k)
                assert len(cache) == t + K
                cache.truncate(t + 1)
                assert len(cache) == t + 1


def dense_attention(q, k0, v0, diag_k, diag_v):
    """TTT attention as it was written before issue 14: one dense [B, h, T, T + k] score tensor per
    step (O(T^2) memory), kept here only as the value reference for the chunked attention."""
    T = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal_TT = torch.ones(T, T, dtype=torch.bool).tril()
    s0 = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal_TT, float("-inf"))
    sd = torch.stack([(q * dk).sum(-1) for dk in diag_k], -1) * scale
    p = torch.softmax(torch.cat([s0, sd], -1).float(), -1).to(q.dtype)
    return p[..., :T] @ v0 + (p[..., T:, None] * torch.stack(diag_v, -2)).sum(-2)


def ttt_unroll_dense(m, x_BT, g_BTH, steps):
    """The TTT unroll with the dense reference attention."""
    return m.ttt_unroll(x_BT, g_BTH, steps, attention=dense_attention)


def _unroll_loss_and_grads(m, unroll, x, g, steps):
    """Forward values and the gradients of a fixed random functional of every step's outputs."""
    g = g.clone().requires_grad_(True)
    m.zero_grad()
    outs = [(lg, h) for _, lg, h in unroll(x, g, steps)]
    gen = torch.Generator().manual_seed(5)
    loss = sum((lg * torch.randn(lg.shape, generator=gen)).sum() + (h * torch.randn(h.shape, generator=gen)).sum()
               for lg, h in outs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}  # fc: unused
    return outs, {**grads, "g": g.grad}


def test_ttt_attention_equals_the_dense_reference(tiny_target):
    """Issue 14: the chunked TTT attention gives today's values and gradients (fp32, 1e-5), over
    several query chunks, the last one partial, with GQA (2 heads on 1 kv head)."""
    from eaglet.drafter.ttt_attention import TTT_QUERY_CHUNK

    cfg, m = make(tiny_target)
    torch.manual_seed(3)
    B, T, K = 2, 2 * TTT_QUERY_CHUNK + 37, 4
    x = torch.randint(0, cfg.vocab_size, (B, T))
    g = torch.randn(B, T, cfg.hidden_size)
    got, got_grads = _unroll_loss_and_grads(m, m.ttt_unroll, x, g, K)
    ref, ref_grads = _unroll_loss_and_grads(m, lambda *a: ttt_unroll_dense(m, *a), x, g, K)
    for k, ((lg, h), (rlg, rh)) in enumerate(zip(got, ref)):
        assert torch.allclose(lg, rlg, atol=1e-5, rtol=0), (k, (lg - rlg).abs().max())
        assert torch.allclose(h, rh, atol=1e-5, rtol=0), (k, (h - rh).abs().max())
    assert got_grads.keys() == ref_grads.keys()
    for n, gr in ref_grads.items():
        tol = 1e-5 * max(1.0, gr.abs().max().item())  # large parameter gradients: relative to their scale
        assert torch.allclose(got_grads[n], gr, atol=tol, rtol=0), (n, (got_grads[n] - gr).abs().max())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_ttt_attention_without_recompute_gives_the_same_loss_and_gradients(tiny_target, bf16):
    """Issue 43: the TTT objective with its attention's softmax weights kept for backward
    (``recompute=False``, train.ttt_attention: saved) against the per-chunk recompute: the same loss,
    statistics and gradients of every parameter and of the input, over several query chunks (the
    last partial), fp32 and under bf16 autocast (what the trainer runs on a GPU and on bf16 CPUs)."""
    from eaglet.drafter.ttt import TTTObjective
    from eaglet.drafter.ttt_attention import TTT_QUERY_CHUNK

    cfg, m = make(tiny_target)
    m.train()
    torch.manual_seed(6)
    B, T, K = 2, TTT_QUERY_CHUNK + 37, 4
    x = torch.randint(0, cfg.vocab_size, (B, T))
    aux = torch.randn(B, T, 3, cfg.target_hidden_size)
    p_BTVd = torch.softmax(torch.randn(B, T, VD), -1)
    valid = torch.rand(B, T) < 0.8

    def run(recompute):
        obj = TTTObjective(m, K, 0.8, "soft_ce", recompute=recompute)
        a = aux.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, stats, _, _ = obj(x, a, p_BTVd, valid)
        loss.backward()
        return loss.detach(), stats, {"aux": a.grad, **{n: q.grad.clone() for n, q in m.named_parameters()
                                                         if q.grad is not None}}

    loss, stats, grads = run(True)
    loss2, stats2, grads2 = run(False)
    assert torch.equal(loss, loss2) and torch.equal(stats, stats2), (loss, loss2)
    assert grads.keys() == grads2.keys() and "aux" in grads
    for n, gr in grads.items():
        tol = 1e-6 * max(1.0, gr.abs().max().item())
        assert torch.allclose(grads2[n], gr, atol=tol, rtol=0), (n, (grads2[n] - gr).abs().max())


class LargestAllocation(TorchDispatchMode):
    """The largest storage (bytes) any aten op returns while active, forward and backward."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.where = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.where = t.untyped_storage().nbytes(), f"{func} {tuple(t.shape)}"
        return out


def largest_ttt_allocation(m, T, steps=3, B=1):
    """LargestAllocation over one training-like forward + backward of the unroll at length T."""
    torch.manual_seed(4)
    x = torch.randint(0, m.cfg.vocab_size, (B, T))
    g = torch.randn(B, T, m.cfg.hidden_size, requires_grad=True)
    with LargestAllocation() as rec:
        sum(lg.float().square().mean() for _, lg, _ in m.ttt_unroll(x, g, steps)).backward()
    return rec


def test_ttt_attention_memory_is_linear_in_T(tiny_target):
    """Issue 14: no tensor of the TTT unroll (forward + backward) grows as T^2. The dense form
    allocated [B, h, T, T + k] fp32 scores per step (33.6 MB here at T=2048, 16 GB per step at the
    Kimi config); doubling T must at most double the largest allocation, and at T=2048 it must stay
    well below one [B, h, T, T] fp32 score tensor."""
    cfg, m = make(tiny_target)
    m.train()
    small, big = largest_ttt_allocation(m, 1024), largest_ttt_allocation(m, 2048)
    dense = 1 * cfg.num_heads * 2048 * 2048 * 4
    assert big.nbytes < dense / 4, (big.nbytes, big.where)
    assert big.nbytes <= 2.2 * small.nbytes, (small.nbytes, small.where, big.nbytes, big.where)


def test_save_load_round_trip(tiny_target, tmp_path):
    cfg, m = make(tiny_target)
    d2t = torch.zeros(VD, dtype=torch.int64)
    d2t[200:] = 1000  # ids 0..199 and 1200..1255
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(VD) + d2t] = True
    path = tmp_path / "drafter.safetensors"
    save_drafter(path, m, cfg, d2t, t2d)
    raw = load_tensors(path)
    assert "embed_tokens.weight" not in raw and raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
    # relocatable: the file names no path (only the target's digest); moved elsewhere, it loads
    # against the target given explicitly
    assert str(tiny_target["path"]) not in json.dumps(tensor_metadata(path))
    moved = tmp_path / "elsewhere" / "copy.safetensors"
    moved.parent.mkdir()
    path.rename(moved)
    m2, cfg2, d2t2, t2d2 = load_drafter(moved, tiny_target)
    assert cfg2 == cfg and torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    # the digest is the check that the given target is the one it was trained for
    with pytest.raises(ArtifactError, match="trained for target"):
        load_drafter(moved, {**tiny_target, "digest": "f" * 64})
    # without the target checkpoint the embedding is unknown: refuse clearly, naming the folder
    with pytest.raises(ArtifactError, match="nowhere"):
        load_drafter(moved, {**tiny_target, "path": str(tmp_path / "nowhere")})
    # a file written when the config still held the target's path loads (the key is ignored)
    meta = json.loads(tensor_metadata(moved)["eaglet"])
    save_tensors(tmp_path / "old.safetensors", load_tensors(moved),
                 metadata={"eaglet": json.dumps({**meta, "target_path": "/gone/away"})})
    assert load_drafter(tmp_path / "old.safetensors", tiny_target)[1] == cfg


def test_read_target_rows(tiny_target):
    rows = torch.tensor([0, 5, 17000, 40000, 49151])
    full = read_target_tensor(Path(tiny_target["path"]), "lm_head.weight")
    part = read_target_tensor(tiny_target["path"], "lm_head.weight", rows=rows, chunk_rows=1000)
    assert torch.equal(part, full[rows])
    with pytest.raises(ArtifactError, match="no tensor"):
        read_target_tensor(tiny_target["path"], "model.nothing.weight")


def test_drafter_is_silu_whatever_the_target_activation(tiny_target):
    """The drafter layer is a Llama layer in vLLM and SGLang (their LlamaMLP supports silu only); the
    target's activation is not the drafter's. A Gemma 3 target (gelu_pytorch_tanh) made the trainer
    fail after generation and extraction: "hidden_act 'gelu_pytorch_tanh': only silu is implemented"."""
    gemma_like = {**tiny_target, "hidden_act": "gelu_pytorch_tanh", "activation": "gelu_pytorch_tanh"}
    cfg = DrafterConfig.from_identity(gemma_like, VD, [2, 4, 5], ttt_steps=3)
    assert cfg.hidden_act == "silu"
    Eagle3Drafter(cfg, load_target_embedding(tiny_target["path"]))  # builds
