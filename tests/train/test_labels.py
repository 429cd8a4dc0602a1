"""Training labels come from the target's own modules, and the trainer proves them against the
real model's top-1 tokens recorded at extraction — on a Gemma-family target, where a hand-written
Llama norm (w·rmsnorm) trained toward wrong labels before."""

import pytest
import torch

from eaglet.features.extract import Capture, reference_positions
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.hidden.store import ShardWriter
from eaglet.target.head import TargetHead
from eaglet.train import labels


def _gemma3(tmp_path, softcap=30.0):
    """A tiny random Gemma 3 text model saved as a checkpoint: (1+w) norms with w far from 0,
    tied and scaled embeddings, sliding window, final logit soft-capping."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    conf = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            final_logit_softcapping=softcap, tie_word_embeddings=True,
                            max_position_embeddings=256)
    m = Gemma3ForCausalLM(conf).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight.normal_(0, 0.5)
        for mod in m.modules():
            if type(mod).__name__ == "Gemma3RMSNorm":
                mod.weight.normal_(0.0, 1.0)  # (1 + w) and w differ a lot
    path = tmp_path / "gemma3"
    m.save_pretrained(path)
    return m, path


def test_head_is_the_targets_own_computation(tmp_path):
    model, path = _gemma3(tmp_path)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    cap = Capture(model, [1, 2, 3])
    with torch.no_grad():
        _, final, _ = cap(ids, torch.ones_like(ids))
        real = model(input_ids=ids).logits
    rows = torch.arange(0, 512, 2)
    head = TargetHead(path, rows=rows)
    assert head.norm_class == "Gemma3RMSNorm" and head.tied
    assert torch.allclose(head.logits(final), real[..., rows], atol=1e-4)
    assert real.abs().max() <= 30.0 + 1e-4  # soft-capped, and so is the reconstruction
    top1, margin = head.full_top1(final.reshape(-1, 128))
    assert torch.equal(top1, real.argmax(-1).reshape(-1))
    assert (margin >= 0).all()
    # extraction's statistics over the whole (soft-capped) vocabulary, in small row chunks and position
    # blocks that do not divide it: the target's own log-sum-exp and argmax
    head.chunk_rows = 100
    lse, top = head.full_stats(final.reshape(-1, 128), block=7)
    assert torch.allclose(lse, torch.logsumexp(real.float(), -1).reshape(-1), atol=1e-4)
    assert torch.equal(top, top1)


class _HandWrittenLlamaNorm(torch.nn.Module):
    """The old trainer's reconstruction: w·rmsnorm(x), right for Llama, wrong for Gemma."""

    def __init__(self, w, eps=1e-6):
        super().__init__()
        self.w, self.eps = w, eps

    def forward(self, x):
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _store(tmp_path, model, n=6, T=20):
    """A real shard: states and real-model references recorded by eaglet.features.extract's Capture."""
    w = ShardWriter(tmp_path / "shard_0", 0, 1, [1, 2, 3], True, "float32", 128, "d", 1 << 20)
    cap = Capture(model, [1, 2, 3])
    g = torch.Generator().manual_seed(2)
    for i in range(n):
        ids = torch.randint(0, 512, (1, T), generator=g)
        pos = reference_positions([T], 6)
        with torch.no_grad():
            aux, final, lg = cap(ids, torch.ones_like(ids), pos)
        v, top = lg.float().topk(2, -1)
        with torch.no_grad():
            full = model(input_ids=ids).logits[0].float()  # the target's own full-vocabulary statistics
        w.add(f"s{i}", ids[0], torch.ones(T, dtype=torch.int8), torch.stack(aux, 2)[0], final[0],
              torch.logsumexp(full, -1), full.argmax(-1))
        w.add_references([[f"s{i}", int(p), int(top[0, j, 0]), float(v[0, j, 0] - v[0, j, 1])]
                          for j, p in enumerate(pos.tolist())])
    w.finish()
    return HiddenStateDataset([tmp_path / "shard_0" / "index.json"])


def test_check_passes_on_the_real_head_and_refuses_a_hand_written_norm(tmp_path):
    model, path = _gemma3(tmp_path)
    ds = _store(tmp_path, model)
    assert len(ds.label_references) == 36
    where = {s: i for i, s in enumerate(ds.ids)}

    def final_of(sid):
        return ds.sample(where[sid])["final"]

    head = TargetHead(path, rows=torch.arange(512))
    rec = labels.check_against_reference(head, ds.label_references, final_of, "float32")
    assert rec["ok"] is True and rec["agreement"] == 1.0 and rec["judged"] >= 30
    # the defect: Llama's norm formula on a Gemma target
    head.norm = _HandWrittenLlamaNorm(model.model.norm.weight.detach().clone())
    head._swap_decoder(head.norm)
    with pytest.raises(labels.LabelMismatch, match="top-1 agreement"):
        labels.check_against_reference(head, ds.label_references, final_of, "float32")


def test_check_does_not_pass_without_references(tmp_path):
    """No recorded references: the check is 'not run' (ok None), never a pass."""
    model, path = _gemma3(tmp_path)
    head = TargetHead(path, rows=torch.arange(512))
    rec = labels.check_against_reference(head, [], lambda sid: None, "bfloat16")
    assert rec["ok"] is None and "only 0" in rec["reason"]


def test_trainer_refuses_unproven_labels(tiny_target, tmp_path):
    """eaglet.train.setup.prove_labels: a store without references fails unless accepted explicitly."""
    from eaglet.train.setup import DraftLabels, prove_labels
    from eaglet.train.train import resolve_params

    w = ShardWriter(tmp_path / "s", 0, 1, [2, 4, 5], True, "float32", 128, tiny_target["digest"], 1 << 20)
    w.add("a", torch.arange(10), torch.ones(10, dtype=torch.int8), torch.randn(10, 3, 128), torch.randn(10, 128),
          torch.zeros(10), torch.zeros(10, dtype=torch.long))
    w.finish()
    ds = HiddenStateDataset([tmp_path / "s" / "index.json"])
    t2d = torch.zeros(tiny_target["vocab_size"], dtype=torch.bool)
    t2d[:64] = True
    head = DraftLabels(tiny_target, t2d, True, False, "cpu")
    with pytest.raises(labels.LabelMismatch, match="accept_unchecked_labels"):
        prove_labels(head, ds, resolve_params({}))
    rec = prove_labels(head, ds, resolve_params({"accept_unchecked_labels": True}))
    assert rec["ok"] is None
