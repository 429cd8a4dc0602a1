"""The DFlash drafter (eaglet.drafter.dflash) on a tiny random model: export names, the block mask
(context strictly before the anchor, the own block bidirectional, blocks independent), the one-block
inference helper, the anchors, the weighted loss by hand, a toy overfit, the file round trip."""

import math

import pytest
import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.tensors import load_tensors, save_tensors, tensor_metadata
from eaglet.drafter.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_chain_along,
    default_loss_gamma,
    dflash_default_layer_ids,
    dflash_loss,
    dflash_loss_from_hidden,
    load_dflash,
    param_count,
    sample_anchors,
    save_dflash,
    train_dflash_step,
)

V, H, K = 101, 64, 4


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=H, target_hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=32,
                intermediate_size=128, num_layers=2, vocab_size=V, target_layer_ids=[2, 3],
                num_target_layers=4, mask_token_id=V - 1, block_size=K, rope_theta=10000.0)
    return DFlashConfig(**{**base, **kw})


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_cfg()
    m = DFlashDrafter(cfg)
    with torch.no_grad():  # larger than the training init, so every path moves the output
        for p in m.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1 + 0.2 * torch.randn_like(p))
    emb, head = torch.randn(V, H), torch.randn(V, H) / math.sqrt(H)
    return cfg, m.eval(), emb, head


def data(B=2, S=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, 2 * H, generator=g), torch.randint(0, V - 1, (B, S), generator=g)


def test_export_names_and_shapes():
    """The parameters are exactly the export's tensor names and shapes (no embedding, no head)."""
    cfg, m, _, _ = tiny()
    want = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for j in range(2):
        p = f"layers.{j}."
        want.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                     p + "self_attn.q_proj.weight": (64, H), p + "self_attn.k_proj.weight": (32, H),
                     p + "self_attn.v_proj.weight": (32, H), p + "self_attn.o_proj.weight": (H, 64),
                     p + "self_attn.q_norm.weight": (32,), p + "self_attn.k_norm.weight": (32,),
                     p + "mlp.gate_proj.weight": (128, H), p + "mlp.up_proj.weight": (128, H),
                     p + "mlp.down_proj.weight": (H, 128)})
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == want
    assert sum(p.numel() for p in m.parameters()) == param_count(cfg)
    assert cfg.dflash_layer_ids == [1, 2]


def test_block_sees_context_before_anchor_only():
    """A block's logits move with the taps at positions before its anchor and its anchor token, never with
    later taps, tokens or other blocks."""
    cfg, m, emb, head = tiny()
    taps, ids = data()
    anchors = torch.tensor([[5, 2], [3, -1]])
    with torch.no_grad():
        base = m.block_logits(taps, ids, anchors, emb, head)
        for s, changes in ((5, False), (7, False), (11, False), (4, True), (0, True)):
            t2 = taps.clone()
            t2[0, s] += 3.0
            out = m.block_logits(t2, ids, anchors, emb, head)
            assert torch.equal(out[1], base[1])  # another sequence: untouched
            moved = not torch.allclose(out[0, 0], base[0, 0], atol=1e-6)
            assert moved == changes, (s, moved)
            # block at anchor 2 sees positions 0, 1 only
            assert (not torch.allclose(out[0, 1], base[0, 1], atol=1e-6)) == (s < 2), s
        # the anchor's own token enters through the embedding, the token after it does not
        i2 = ids.clone()
        i2[0, 5] = (ids[0, 5] + 1) % (V - 1)
        assert not torch.allclose(m.block_logits(taps, i2, anchors, emb, head)[0, 0], base[0, 0])
        i3 = ids.clone()
        i3[0, 6] = (ids[0, 6] + 1) % (V - 1)
        assert torch.allclose(m.block_logits(taps, i3, anchors, emb, head)[0, 0], base[0, 0], atol=1e-6)
        # blocks are independent: the anchor-5 block alone gives the same logits
        alone = m.block_logits(taps[:1], ids[:1], anchors[:1, :1], emb, head)
        assert torch.allclose(alone[0, 0], base[0, 0], atol=1e-5)


def test_block_is_bidirectional():
    """Query 1 reads the key of query K−1 (non-causal, as vLLM's DFlash layers)."""
    cfg, m, emb, head = tiny()
    taps, ids = data(B=1)
    q_ids, q_pos, mask = m.block_inputs(ids, torch.tensor([[6]]))
    assert q_ids[0].tolist() == [ids[0, 6].item()] + [cfg.mask_token_id] * (K - 1)
    assert q_pos[0].tolist() == [6, 7, 8, 9]
    with torch.no_grad():
        ctx_kv = m.context_kv(m.context(taps), torch.arange(12)[None])
        x = torch.nn.functional.embedding(q_ids, emb)
        h = m.run_block(x, q_pos, ctx_kv, mask)
        x2 = x.clone()
        x2[0, K - 1] += 1.0
        h2 = m.run_block(x2, q_pos, ctx_kv, mask)
    assert not torch.allclose(h[0, 1], h2[0, 1], atol=1e-5)


def test_draft_block_is_the_block_at_the_bonus_position():
    """The one-round helper drafts the argmax of the training forward's block at the bonus position."""
    cfg, m, emb, head = tiny()
    taps, ids = data(B=1, S=12)
    P = 7
    drafts = m.draft_block(taps[:, :P], ids[:, P], emb, head)
    with torch.no_grad():
        logits = m.block_logits(taps, ids, torch.tensor([[P]]), emb, head)
    assert drafts.shape == (1, K - 1)
    assert torch.equal(drafts, logits[:, 0, 1:].argmax(-1))


def test_block_chain_is_draft_block_at_each_round():
    """Each round of the offline chain drafts what draft_block drafts at its bonus position, accepts
    the agreeing prefix, and the next round starts accepted + 1 tokens later."""
    cfg, m, emb, head = tiny()
    taps, ids = data(B=1, S=20)
    x, P, n = ids[0].tolist(), 5, 10
    # make some drafts right: the continuation is the drafter's own block at start 4 (g = 4 → bonus at 8)
    own = m.draft_block(taps[:, :8], ids[:, 8], emb, head)[0].tolist()
    x[9:9 + K - 1] = own
    chain = block_chain_along(m, taps[0, :len(x) - 1], x, P, n, emb, head)
    gs = [r["g"] for r in chain["rounds"]]
    assert gs[0] == 1 and all(b == a["g"] + a["accepted"] + 1 for a, b in zip(chain["rounds"], gs[1:]))
    for r in chain["rounds"]:
        p = P + r["g"] - 1
        want = m.draft_block(taps[:, :p], torch.tensor([x[p]]), emb, head)[0].tolist()
        assert r["drafts"] == want
        agree = 0
        while agree < K - 1 and want[agree] == x[p + 1 + agree]:
            agree += 1
        assert r["accepted"] == agree
    if 4 in gs:
        assert chain["rounds"][gs.index(4)]["accepted"] == K - 1
    c = chain["counts"]
    assert c["drafts"] == len(gs) and c["accepted_per_pos"][0] == sum(r["accepted"] > 0 for r in chain["rounds"])


def test_anchors_supervised_room_for_a_block_and_seeded():
    """Anchors are distinct supervised positions with room for a block, at most num_anchors, the same for the
    same seed."""
    S = 20
    mask = torch.zeros(3, S, dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 10:14] = True
    mask[2, :2] = True
    mask[2, S - 2:] = True  # no room for a block there
    a = sample_anchors(mask, K, 5, torch.Generator().manual_seed(7))
    b = sample_anchors(mask, K, 5, torch.Generator().manual_seed(7))
    c = sample_anchors(mask, K, 5, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (3, 5)
    for row, m in zip(a, mask):
        got = row[row >= 0]
        assert len(set(got.tolist())) == len(got) <= 5
        assert all(m[x] and x <= S - K for x in got.tolist())
        assert torch.equal(got, got.sort().values)
    assert (a[1] >= 0).sum() == 4 and set(a[2][a[2] >= 0].tolist()) == {0, 1}


def test_loss_weights_and_drops_by_hand():
    """The loss is the exp(-(k-1)/gamma)-weighted CE of positions 1..K-1, without unsupervised or past-the-end
    targets, as computed by hand."""
    B, A, S = 1, 2, 8
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, A, K, V, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    lm = torch.ones(B, S, dtype=torch.bool)
    lm[0, 3] = False
    anchors = torch.tensor([[1, 6]])  # block 1 runs past the end at 6 + 2, 6 + 3
    loss, stats = dflash_loss(logits, labels, lm, anchors, gamma=2.0)
    num = den = 0.0
    for j, a in enumerate([1, 6]):
        for k in range(1, K):
            t = a + k
            if t >= S or not lm[0, t]:
                continue
            w = math.exp(-(k - 1) / 2.0)
            num += w * float(torch.nn.functional.cross_entropy(logits[0, j, k][None], labels[0, t][None]))
            den += w
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    h, head = torch.randn(B, A, K, 16, generator=g), torch.randn(V, 16, generator=g)  # the head at counted positions
    l1, s1 = dflash_loss(h @ head.T, labels, lm, anchors, gamma=2.0)
    l2, s2 = dflash_loss_from_hidden(h, head, labels, lm, anchors, gamma=2.0)
    assert l2.item() == pytest.approx(l1.item(), rel=1e-5) and s1 == {**s2, "loss": s1["loss"]}
    # k=1: positions 2, 7; k=2: 3 unsupervised, 8 past the end; k=3: 4 (9 past the end)
    assert stats["n_k"] == [2, 0, 1]


def test_gamma_rule():
    """The default gamma is SpecForge's rule of thumb (16 -> 7, 10 -> 5, 8 -> 4, 4 below 8) and the default
    taps are DFlash's rule plus one."""
    assert [default_loss_gamma(b) for b in (4, 8, 10, 16)] == [4.0, 4.0, 5.0, 7.0]
    assert 5.0 < default_loss_gamma(12) < 7.0 and default_loss_gamma(32) == 14.0
    assert dflash_default_layer_ids(30, 3) == [2, 15, 28]  # the spike's DFlash ids [1, 14, 27], + 1


def test_toy_overfit_and_round_trip(tmp_path):
    """Training steps overfit a toy batch (loss halves) with the embedding and head untouched, and the saved
    file reloads to the same logits."""
    cfg, m, emb, head = tiny()
    torch.manual_seed(0)
    for p in m.parameters():  # back to a trainable init
        torch.nn.init.normal_(p, std=0.05) if p.dim() == 2 else torch.nn.init.ones_(p)
    taps, ids = data(B=2, S=16)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    batch = {"taps": taps, "input_ids": ids, "loss_mask": lm}
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    emb0, head0 = emb.clone(), head.clone()
    losses = [train_dflash_step(m, batch, emb, head, opt, g, num_anchors=8)["loss"] for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert torch.equal(emb, emb0) and torch.equal(head, head0)
    save_dflash(tmp_path / "d.safetensors", m, cfg)
    m2, cfg2 = load_dflash(tmp_path / "d.safetensors")
    assert cfg2 == cfg
    a = torch.tensor([[4, 9], [5, -1]])
    with torch.no_grad():
        assert torch.equal(m.eval().block_logits(taps, ids, a, emb, head), m2.block_logits(taps, ids, a, emb, head))


def test_k_norm_tied_across_layers(tmp_path):
    """By default every layer shares one k_norm weight, saved as equal copies, and a file whose copies differ
    is refused."""
    cfg, m, _, _ = tiny()
    assert m.layers[1].self_attn.k_norm.weight is m.layers[0].self_attn.k_norm.weight
    assert m.layers[1].self_attn.q_norm.weight is not m.layers[0].self_attn.q_norm.weight
    save_dflash(tmp_path / "d.safetensors", m, cfg)  # tied tensors are written as copies
    m2, _ = load_dflash(tmp_path / "d.safetensors")
    assert m2.layers[1].self_attn.k_norm.weight is m2.layers[0].self_attn.k_norm.weight
    t = load_tensors(tmp_path / "d.safetensors")
    t["layers.1.self_attn.k_norm.weight"] = t["layers.1.self_attn.k_norm.weight"] + 1
    save_tensors(tmp_path / "e.safetensors", t, metadata=tensor_metadata(tmp_path / "d.safetensors"))
    with pytest.raises(ArtifactError, match="k_norm"):
        load_dflash(tmp_path / "e.safetensors")
    untied = DFlashDrafter(tiny_cfg(tie_k_norm=False))
    assert untied.layers[1].self_attn.k_norm.weight is not untied.layers[0].self_attn.k_norm.weight
    assert sum(p.numel() for p in untied.parameters()) == param_count(untied.cfg) == param_count(cfg) + 32


def test_config_refuses_bad_values():
    """The config refuses taps outside the target, a mask id outside the vocabulary and a block of one token."""
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_cfg(target_layer_ids=[0, 2])
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_cfg(mask_token_id=V)
    with pytest.raises(ValueError, match="block_size"):
        tiny_cfg(block_size=1)
