"""The P-EAGLE trainer's pieces (eaglet.train.p_eagle_train) on a tiny random drafter: collate aligns the
store's greedy top-1 and loss mask with the objective's labels (labels[s] = the top-1 after s, valid[s] =
position s + 1 is an assistant token), and the validation's parallel_tau counts exactly what one round
from each start accepts (the one-forward round, judged against the labels)."""

import torch

from eaglet.drafter.chain import accepted_prefix
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter
from eaglet.train.p_eagle_train import collate, parallel_acceptance, resolve_settings

V, H, K = 50, 16, 3


def test_collate_aligns_labels_and_the_loss_mask():
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (7, 5):
        samples.append(
            {
                "input_ids": torch.randint(0, V, (n,), generator=g),
                "aux": torch.randn(n, 3, H, generator=g),
                "target_top1": torch.randint(0, V, (n,), generator=g),
                "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1, 1][:n]),
            }
        )
    b = collate(samples, "cpu")
    assert b["x"].shape == (2, 7) and b["aux"].shape == (2, 7, 3, H) and b["tokens"] == 12
    assert b["labels"][0].tolist() == samples[0]["target_top1"].tolist()
    assert b["valid"][0].tolist() == [False, True, True, True, True, True, False]  # loss_mask shifted by one
    assert b["valid"][1].tolist() == [False, True, True, True, False, False, False]  # nothing past the sample


def test_parallel_tau_counts_the_rounds_one_forward_accepts():
    torch.manual_seed(0)
    cfg = PEagleConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=V,
        draft_vocab_size=V,
        layer_ids=[1, 2, 3],
        mask_token_id=V - 1,
        parallel_k=K,
    )
    m = PEagleDrafter(cfg, torch.randn(V, H)).eval()
    g = torch.Generator().manual_seed(1)
    T = 12
    x = torch.randint(0, V - 1, (1, T), generator=g)
    aux = torch.randn(1, T, 3, H, generator=g)
    with torch.no_grad():
        gg = m.project(aux)[0]
        labels = torch.randint(0, V - 1, (1, T), generator=g)
        for t in range(0, T - K, 2):  # make some drafts right: the labels are the round's own drafts there
            labels[0, t + 1 : t + 1 + K] = torch.tensor(m.draft_parallel(x[0, : t + 2], gg[: t + 1]))
    valid = torch.ones(1, T, dtype=torch.bool)
    valid[0, 5] = False
    d2t = torch.zeros(V, dtype=torch.long)
    acc, rounds = parallel_acceptance(m, {"x": x, "aux": aux, "labels": labels, "valid": valid}, d2t)
    want_acc = want_rounds = 0
    for t in range(T - K):
        if not bool(valid[0, t + 1 : t + 1 + K].all()):
            continue
        want_rounds += 1
        want_acc += accepted_prefix(m.draft_parallel(x[0, : t + 2], gg[: t + 1]), labels[0, t + 1 : t + 1 + K].tolist())
    assert (acc, rounds) == (want_acc, want_rounds) and 0 < acc and rounds < T - K


def test_what_the_trainer_cannot_do_is_refused_naming_the_key():
    import pytest

    for params, key in (
        ({"hidden_states": "online"}, "train.hidden_states"),
        ({"init_from": "d"}, "train.init_from"),
        ({"gpus": 2}, "train.gpus"),
    ):
        with pytest.raises(ValueError, match=key):
            resolve_settings(params, {})
    p, d = resolve_settings({}, {"parallel_k": 4})
    assert d == {"parallel_k": 4, "mask_token_id": None} and p["hidden_states"] == "offline"


def test_the_trainer_reads_the_architecture_variants_and_the_frozen_head(tiny_target, tmp_path):
    """train.norm_before_fc / norm_output reach the P-EAGLE drafter as EAGLE-3's (input_norm.weight
    trained and saved, the flags in its config); train.freeze_lm_head keeps the head at the target's
    draft rows, which the default trains away from; without the flags neither norm is there."""
    import json

    from eaglet.base.tensors import load_tensors, tensor_metadata
    from eaglet.drafter.p_eagle import META_KEY
    from eaglet.target.head import TargetHead
    from eaglet.train.p_eagle_train import train
    from train_common import hidden_data

    data = hidden_data(tiny_target, tmp_path / "data")
    hidden, vocab = data["index"], data["vocab"]
    base = {"max_steps": 2, "val_every": 2, "token_budget": 256, "lr": 3e-3}
    runs = {"plain": {"norm_before_fc": False, "norm_output": False},
            "variants": {"norm_before_fc": True, "norm_output": True, "freeze_lm_head": True}}
    out = {}
    for name, extra in runs.items():
        train(hidden, vocab, tiny_target, tmp_path / name, {**base, **extra}, {"parallel_k": 3})
        f = tmp_path / name / "drafter.safetensors"
        out[name] = (load_tensors(f), json.loads(tensor_metadata(f)[META_KEY]))
    (t0, c0), (t1, c1) = out["plain"], out["variants"]
    assert "input_norm.weight" not in t0 and not c0["norm_before_fc"] and not c0["norm_output"]
    assert "input_norm.weight" in t1 and c1["norm_before_fc"] and c1["norm_output"] and not c1["norm_before_residual"]
    assert not torch.equal(t1["input_norm.weight"], torch.ones_like(t1["input_norm.weight"]))  # trained
    rows = TargetHead(tiny_target["path"], rows=data["t2d"].nonzero().flatten()).row_linear.weight.detach().float()
    assert torch.equal(t1["lm_head.weight"].float(), rows)  # frozen: the target's draft rows
    assert not torch.equal(t0["lm_head.weight"].float(), rows)  # trained by default
