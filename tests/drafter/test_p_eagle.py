"""The P-EAGLE drafter (eaglet.drafter.p_eagle) on a tiny random model: the training forward at every
depth equals vLLM's one-forward round rebuilt slot by slot through a KV cache; a slot never sees a
later real token; the objective's labels and counted positions by hand; a few steps reduce the loss
and train mask_hidden; the offline chain is the round walked start by start; the file round trip."""

import math

import pytest
import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.drafter.chain import accepted_prefix
from eaglet.drafter.p_eagle import (
    PEagleConfig,
    PEagleDrafter,
    PEagleObjective,
    depth_keep_ratio,
    depth_targets,
    load_p_eagle,
    save_p_eagle,
)

V, H, K = 97, 32, 4


def tiny_config(**kw) -> PEagleConfig:
    return PEagleConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        draft_vocab_size=V,
        layer_ids=[1, 2, 3],
        mask_token_id=V - 1,
        parallel_k=K,
        **kw,
    )


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    m = PEagleDrafter(cfg, torch.randn(V, H))
    with torch.no_grad():  # larger than the training init, so every path moves the output
        for n, p in m.named_parameters():
            if n != "embed_tokens.weight":
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1 + 0.3 * torch.randn_like(p))
    return cfg, m.eval()


def data(B=2, T=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 1, (B, T), generator=g), torch.randn(B, T, 3, H, generator=g)


def unroll_logits(m, x, aux):
    with torch.no_grad():
        return [lg for _, lg, _ in m.parallel_unroll(x, m.project(aux))]


@pytest.mark.parametrize("variant", [{}, {"norm_before_fc": True, "norm_output": True}])
def test_training_forward_equals_the_served_round_built_slot_by_slot(variant):
    """Depth d at index t of the training forward = slot 1 + d of vLLM's round from t (the one causal
    forward over real slots 0..t and mask slots t+1..t+K-1), itself = the same round built one slot at
    a time through a KV cache; depth 0 = EAGLE-3's step 0 (ttt_unroll)."""
    cfg, m = tiny(**variant)
    x, aux = data()
    lg = unroll_logits(m, x, aux)
    with torch.no_grad():
        g = m.project(aux)
        step0 = next(iter(m.ttt_unroll(x, g, 1)))[1]
    torch.testing.assert_close(lg[0], step0)
    for b in range(2):
        for t in (0, 4, x.shape[1] - 2) if b else range(x.shape[1] - 1):
            fast = m.parallel_logits(x[b, : t + 2], g[b, : t + 1])
            slow = m.parallel_logits_slow(x[b, : t + 2], g[b, : t + 1])
            torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(torch.stack([lg[d][b, t] for d in range(K)]), fast, atol=1e-5, rtol=1e-4)
    assert m.draft_parallel(x[0, :5], g[0, :4]) == m.parallel_logits(x[0, :5], g[0, :4]).argmax(-1).tolist()


def test_a_slot_never_sees_a_later_real_token_and_reads_the_mask():
    """Changing real tokens after x_{t+1} or aux states after t leaves every depth at index t unchanged;
    changing x_{t+1}, an earlier aux state, mask_hidden or the mask token's id moves the masked slots."""
    cfg, m = tiny()
    x, aux = data(B=1, T=12)
    t = 5
    base = unroll_logits(m, x, aux)
    x2, aux2 = x.clone(), aux.clone()
    x2[0, t + 2 :] = (x2[0, t + 2 :] + 7) % (V - 1)
    aux2[0, t + 1 :] += 3.0
    later = unroll_logits(m, x2, aux2)
    for d in range(K):
        torch.testing.assert_close(later[d][0, t], base[d][0, t])
    x3 = x.clone()
    x3[0, t + 1] = (x3[0, t + 1] + 1) % (V - 1)
    aux3 = aux.clone()
    aux3[0, t - 2] += 1.0
    for xx, aa in ((x3, aux), (x, aux3)):
        moved = unroll_logits(m, xx, aa)
        assert all((moved[d][0, t] - base[d][0, t]).abs().max() > 1e-3 for d in range(K))
    with torch.no_grad():
        m.mask_hidden.mul_(-1)
    flipped = unroll_logits(m, x, aux)
    torch.testing.assert_close(flipped[0], base[0])  # depth 0 never reads mask_hidden
    assert all((flipped[d][0, t] - base[d][0, t]).abs().max() > 1e-3 for d in range(1, K))
    with torch.no_grad():
        m.mask_hidden.mul_(-1)
    m.cfg.mask_token_id = 3
    other = unroll_logits(m, x, aux)
    assert all((other[d][0, t] - base[d][0, t]).abs().max() > 1e-3 for d in range(1, K))


def test_objective_labels_counted_positions_and_sampling():
    """Depth d at index t is labelled with labels[t+1+d] and counts where valid[t+1+d]; the depth
    sampling ratio is SpecForge's; the loss is the sum of per-depth CE means computed by hand."""
    lab = torch.arange(10)[None]
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    for d in range(3):
        L, ok = depth_targets(lab, valid, d)
        n = 10 - 1 - d
        assert L[0, :n].tolist() == list(range(1 + d, 10)) and not ok[0, n:].any()
        assert ok[0, :n].tolist() == valid[0, 1 + d :].tolist()
    assert [depth_keep_ratio(d) for d in range(6)] == [1.0, 0.7, 0.7**2, 0.7**3, 0.7**4, 0.2]

    cfg, m = tiny()
    x, aux = data()
    labels = torch.randint(0, V, x.shape)
    valid = torch.rand(x.shape) < 0.7
    t2d = torch.ones(V, dtype=torch.bool)
    t2d[5] = False
    labels[0, 3] = 5  # outside the draft vocab: never counted
    loss, stats = PEagleObjective(m)(x, aux, labels, valid, t2d)
    lg = unroll_logits(m, x, aux)
    want = 0.0
    for d in range(K):
        lb, ok = depth_targets(labels, valid, d)
        ok &= lb != 5
        di = lb - (lb > 5).long()  # the draft index of a target id (the draft vocab lacks id 5)
        want += torch.nn.functional.cross_entropy(lg[d][ok], di[ok]).item()
        assert int(stats[2, d]) == int(ok.sum())
    assert abs(loss.item() - want) < 1e-4
    # with a generator, deeper depths count a random subset (fewer positions), depth 0 all of them
    _, st = PEagleObjective(m)(x, aux, labels, valid, t2d, generator=torch.Generator().manual_seed(0))
    assert st[2, 0] == stats[2, 0] and st[2, K - 1] < stats[2, K - 1]


def test_a_few_steps_reduce_the_loss_and_train_mask_hidden():
    """Adam on one tiny batch: the loss falls by half in 20 steps, mask_hidden moves, the shared
    embedding does not."""
    torch.manual_seed(0)
    cfg = tiny_config()
    m = PEagleDrafter(cfg, torch.randn(V, H))
    x, aux = data(B=2, T=8)
    labels = torch.roll(x, -1, 1)
    valid = torch.ones_like(x, dtype=torch.bool)
    obj = PEagleObjective(m)
    emb0, mh0 = m.embed_tokens.weight.clone(), m.mask_hidden.detach().clone()
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(20):
        loss, _ = obj(x, aux, labels, valid, torch.ones(V, dtype=torch.bool))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert not torch.equal(m.mask_hidden.detach(), mh0)
    assert torch.equal(m.embed_tokens.weight, emb0)


def test_the_offline_chain_walks_the_served_rounds():
    """parallel_chain_along's rounds are the one-forward round at each visited start, accepted = the
    prefix agreeing with the continuation, the next start after accepted + 1 tokens; its counters count
    them (and a bad continuation length is refused)."""
    cfg, m = tiny()
    P, N = 4, 9
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V - 1, (P + N + K - 1,), generator=g).tolist()
    aux = torch.randn(len(x), 3 * H, generator=g)
    # make some drafts right: replace the continuation by the drafter's own drafts where it can
    with torch.no_grad():
        for s in range(P, len(x) - K):
            x[s + 1] = (
                m.draft_parallel(x[: s + 1], m.project(aux[None, :s].reshape(1, s, -1))[0])[0] if s % 3 else x[s + 1]
            )
    res = m.parallel_chain_along(aux, x, P, N)
    gg, seen = 1, []
    for r in res["rounds"]:
        assert r["g"] == gg
        t = P + gg - 2
        with torch.no_grad():
            dr = m.draft_parallel(x[: t + 2], m.project(aux[None, : t + 1].reshape(1, t + 1, -1))[0])
        assert r["drafts"] == dr and r["accepted"] == accepted_prefix(dr, x[P + gg : P + gg + K])
        seen.append(r["accepted"])
        gg += r["accepted"] + 1
    assert gg >= N and res["counts"]["drafts"] == len(res["rounds"])
    assert res["counts"]["accepted_per_pos"][0] == sum(a > 0 for a in seen) and any(a > 0 for a in seen)
    with pytest.raises(ValueError, match="continuation tokens"):
        m.parallel_chain_along(aux, x[: P + N], P, N)


def test_file_round_trip_and_config_refusals(tmp_path):
    cfg, m = tiny()
    d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    save_p_eagle(tmp_path / "d.safetensors", m, cfg, d2t, t2d)
    m2, cfg2, _, _ = load_p_eagle(tmp_path / "d.safetensors", m.embed_tokens.weight.detach())
    assert cfg2 == cfg and torch.equal(m2.mask_hidden, m.mask_hidden)
    x, aux = data()
    torch.testing.assert_close(unroll_logits(m2, x, aux)[K - 1], unroll_logits(m, x, aux)[K - 1])
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleConfig(**{**cfg.__dict__, "mask_token_id": V})
    from eaglet.drafter.eagle3 import Eagle3Drafter, save_drafter

    save_drafter(tmp_path / "e3.safetensors", Eagle3Drafter(cfg), cfg, d2t, t2d)
    with pytest.raises(ArtifactError, match="not a P-EAGLE"):
        load_p_eagle(tmp_path / "e3.safetensors", m.embed_tokens.weight.detach())
