"""TTT training on real hidden states of the tiny target: target logits, alignment, learning,
resume after kill -9 (same loss trace), and 2-process gloo DDP == single process."""

import json
import subprocess

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from conftest import kill_when_written, slowed_trainer
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.tensors import load_tensors, save_tensors, tensor_metadata
from eaglet.drafter.eagle3 import load_drafter
from eaglet.drafter.ttt import TTTObjective, is_better, tf_tau, valid_positions
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.target.head import TargetHead
from eaglet.train.data import collate, is_val, plan_batches
from eaglet.train.setup import DraftLabels
from eaglet.train.train import resolve_params, train
from train_common import LAYERS, PARAMS, VD, hidden_data, train_cmd


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory):
    return hidden_data(tiny_target, tmp_path_factory.mktemp("hidden"))


def test_draft_labels_match_the_target(tiny_target, data):
    ds = HiddenStateDataset(data["index"])
    s = ds.sample(3)
    head = DraftLabels(tiny_target, data["t2d"], True, True, "cpu")
    p, inv, mass = head(s["final"][None], s["target_lse"][None], s["target_top1"][None], mass=True)
    with torch.no_grad():
        full = data["model"](s["input_ids"][None]).logits[0]
    assert torch.allclose(p[0], torch.softmax(full[:, data["t2d"]], -1), atol=1e-5)
    assert torch.equal(inv[0], data["t2d"][full.argmax(-1)])
    assert 0 < int(inv.sum()) < inv.numel()  # the fixture exercises both sides of the drop rule
    assert torch.allclose(mass[0], torch.softmax(full, -1)[:, data["t2d"]].sum(-1), atol=1e-5)
    with pytest.raises(ValueError, match="full-vocabulary statistics"):
        head(s["final"][None], mass=True)  # a caller without the statistics is refused, not guessed


def test_stored_statistics_give_what_the_other_head_rows_gave(tiny_target, data):
    """The draft vocab's mass and the greedy flag from the statistics extraction stores (log-sum-exp
    and argmax over the whole vocabulary) equal what the trainer computed before from the head's
    other V - V_d rows on the same stored states (TargetHead.max_lse_over), at every real position,
    and the stored figures are the target's own (its forward, by hand)."""
    ds = HiddenStateDataset(data["index"])
    rows = (0, 5, 7)
    b = collate([ds.sample(i) for i in rows], "cpu")
    labels = DraftLabels(tiny_target, data["t2d"], True, True, "cpu")
    p, inv, mass = labels(b["final"], b["target_lse"], b["target_top1"], mass=True)
    head = TargetHead(tiny_target["path"], rows=data["t2d"].nonzero().squeeze(1))
    x = head.normed(b["final"])
    lg = head.logits(x, normed=True)
    top_rest, lse_rest = head.max_lse_over(x, head.row_chunks((~data["t2d"]).nonzero().squeeze(1)), normed=True)
    lse_d = torch.logsumexp(lg, -1)
    real = b["mask"].new_zeros(b["mask"].shape)
    for r, i in enumerate(rows):
        real[r, :ds.num_tokens[i]] = True
    before_mass = torch.exp(lse_d - torch.logaddexp(lse_d, lse_rest))
    before_inv = lg.amax(-1) >= top_rest
    assert torch.allclose(mass[real], before_mass[real], atol=1e-6)
    assert torch.equal(inv[real], before_inv[real])
    assert 0 < int(inv[real].sum()) < int(real.sum())
    assert torch.equal(p, torch.softmax(lg, -1))
    r, t = 1, int(ds.num_tokens[rows[1]]) - 1  # the last position of a sample, against the target's forward
    with torch.no_grad():
        logits = data["model"](b["x"][r:r + 1, :t + 1]).logits[0, -1].float()
    assert float(b["target_lse"][r, t]) == pytest.approx(float(torch.logsumexp(logits, -1)), abs=1e-4)
    assert int(b["target_top1"][r, t]) == int(logits.argmax())
    assert float(mass[r, t]) == pytest.approx(float(torch.softmax(logits, -1)[data["t2d"]].sum()), abs=1e-5)


def test_loss_alignment_by_hand(tiny_target, data):
    """Step-0 loss of the objective == soft CE written out from the definition: position t reads
    (g_t, x_{t+1}), matches the target's distribution at t+1, counts iff x_{t+2} is an assistant
    token whose greedy target token is draftable; normalised by the number of counted positions."""
    ds = HiddenStateDataset(data["index"])
    samples = [ds.sample(i) for i in (0, 7)]
    b = collate(samples, "cpu")
    head = DraftLabels(tiny_target, data["t2d"], True, True, "cpu")
    p, inv, _ = head(b["final"], b["target_lse"], b["target_top1"])
    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
    from eaglet.target.load import load_target_embedding

    torch.manual_seed(0)
    m = Eagle3Drafter(DrafterConfig.from_identity(tiny_target, VD, LAYERS), load_target_embedding(tiny_target["path"]))
    obj = TTTObjective(m, steps=2, gamma=0.8)
    with torch.no_grad():
        loss, st, hits, _ = obj(b["x"], b["aux"], p, valid_positions(b, data["t2d"], inv))
        num = den = 0.0
        for s in samples:
            x, T = s["input_ids"], len(s["input_ids"])
            lg, _ = m.forward_step(x[None, 1:], m.project(s["aux"][None, :-1]), torch.arange(T - 1)[None])
            ps, invs, _ = head(s["final"][None], s["target_lse"][None], s["target_top1"][None])
            for t in range(T - 2):
                if s["loss_mask"][t + 2] and invs[0, t + 1]:
                    num += float(-(ps[0, t + 1] * F.log_softmax(lg[0, t], -1)).sum())
                    den += 1
    assert den > 10 and hits is None  # no chain mask given: no hits computed
    assert abs(float(st[0, 0]) - num / den) < 1e-4
    assert int(st[2, 0]) == den
    assert 0 < float(st[2, 1]) <= den  # step 1 drafts x_{t+3}: never more positions


@pytest.mark.parametrize(("loss", "norm_output"), [("soft_ce", False), ("kl", True), ("lk_alpha", False),
                                                 ("lk_lambda", True)])
def test_the_head_at_counted_positions_only_gives_the_same_loss_stats_and_gradients(tiny_target, data, loss,
                                                                                  norm_output):
    """A training step runs the drafter's head and softmax at the counted positions only
    (TTTObjective counted_only): the loss, the per-step stats and every parameter's gradient equal
    the every-position computation's, for each loss, on padded batches with prompt positions."""
    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
    from eaglet.target.load import load_target_embedding

    ds = HiddenStateDataset(data["index"])
    b = collate([ds.sample(i) for i in (0, 7, 12)], "cpu")
    head = DraftLabels(tiny_target, data["t2d"], True, True, "cpu")
    p, inv, mass = head(b["final"], b["target_lse"], b["target_top1"], mass=True)
    valid = valid_positions(b, data["t2d"], inv)
    assert 0 < int(valid.sum()) < valid.numel()  # prompt, padding and dropped positions present
    torch.manual_seed(0)
    cfg = DrafterConfig.from_identity(tiny_target, VD, LAYERS, norm_output=norm_output)
    m = Eagle3Drafter(cfg, load_target_embedding(tiny_target["path"]))
    obj = TTTObjective(m, steps=3, gamma=0.8, loss=loss)
    out = {}
    for counted_only in (False, True):
        m.zero_grad(set_to_none=True)
        L, st, _, alpha = obj(b["x"], b["aux"], p, valid, mass_BT=mass, counted_only=counted_only)
        L.backward()
        out[counted_only] = (L.detach(), st, {n: q.grad.clone() for n, q in m.named_parameters()
                                              if q.grad is not None}, alpha)
    (l0, s0, g0, a0), (l1, s1, g1, a1) = out[False], out[True]
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-6) and torch.allclose(s0, s1, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 5
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-6), n
    assert a1 is None and a0 is not None  # alpha is the validation's, every position
    with pytest.raises(ValueError, match="counted_only"):
        obj(b["x"], b["aux"], p, valid, chain_BT=valid, mass_BT=mass, counted_only=True)


def test_plan_and_split_are_deterministic():
    lengths = [5, 50, 7, 30, 12, 40, 8, 9, 60, 3] * 3
    a = plan_batches(list(range(30)), lengths, 100, seed=1, epoch=0)
    assert a == plan_batches(list(range(30)), lengths, 100, seed=1, epoch=0)
    assert a != plan_batches(list(range(30)), lengths, 100, seed=1, epoch=1)
    assert sorted(i for bt in a for i in bt) == list(range(30))
    assert all(len(bt) * max(lengths[i] for i in bt) <= 100 for bt in a)
    assert [is_val(f"id{i}", 0.3) for i in range(50)] == [is_val(f"id{i}", 0.3) for i in range(50)]
    assert 5 < sum(is_val(f"id{i}", 0.3) for i in range(100)) < 50
    assert tf_tau([1.0, 1.0]) == 3.0 and abs(tf_tau([0.5, 0.5]) - 1.75) < 1e-12
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_params({"learning_rate": 1})


@pytest.fixture(scope="module")
def trained(tiny_target, data, tmp_path_factory):
    """One training on the fixture's data (validation every 5 steps), read by the two tests after:
    its summary and the run folder holding it as ``train/``."""
    run = tmp_path_factory.mktemp("trained")
    return train(data["index"], data["vocab"], tiny_target, run / "train", {**PARAMS, "val_every": 5}), run


def test_training_learns_and_writes_outputs(tiny_target, data, trained):
    s, run = trained
    tmp_path = run / "train"
    m = pd.read_parquet(tmp_path / "metrics.parquet")
    tr, va = m[m.split == "train"], m[m.split == "val"]
    assert len(tr) == s["steps"] >= 20 and len(va) >= 2
    assert {"loss", "loss_0", "loss_2", "tf_acc_0", "tf_acc_2", "tf_tau", "lr", "tok_s"} <= set(m.columns)
    assert {"chain_tau", "chain_tau_1", "chain_tau_3", "chain_rounds"} <= set(va.columns)
    assert tr.loss.iloc[-5:].mean() < 0.7 * tr.loss.iloc[:3].mean()
    assert tr.tf_acc_0.iloc[-5:].mean() > 0.5 and tr.tf_tau.iloc[-5:].mean() > 1.5
    assert va.loss.iloc[-1] < va.loss.iloc[0]  # 30 samples memorise more than they generalise
    assert tr.lr.max() <= PARAMS["lr"] and tr.lr.iloc[-1] < 0.2 * PARAMS["lr"]  # warmup + cosine
    model, cfg, d2t, t2d = load_drafter(tmp_path / "drafter.safetensors", tiny_target)
    assert cfg.layer_ids == LAYERS and cfg.ttt_steps == 3 and cfg.draft_vocab_size == VD
    assert cfg.target_digest == tiny_target["digest"] and torch.equal(t2d, data["t2d"])
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["val_samples"] > 0 and summary["final_val"]["split"] == "val"
    # the digests export, evaluate (drafter) and plots (metrics) check the files against
    assert summary[DIGESTS_KEY] == record_digests(tmp_path, ["drafter.safetensors", "metrics.parquet"])


def test_validation_chain_tau_is_the_offline_chain_tau_of_the_kept_weights(tiny_target, data, trained):
    """The trainer's validation ``chain_tau_k`` is the exact greedy-chain τ: eaglet.eval.evaluate_offline's
    offline simulator (the target's greedy continuation of each held-out prompt, K drafts from
    every position, the rounds replayed) with the saved drafter gives the same counts. The saved
    weights are those of the best validation chain τ, and that is what the summary reports."""
    from eaglet.drafter.chain import chain_replay, rounds_tau
    from eaglet.engines.hf_loop import EagleProposer, Target, offline_prompt
    from eaglet.workflow.summary import lines as summary_lines

    K = PARAMS["ttt_steps"]
    s, tmp_path = trained
    va = pd.read_parquet(tmp_path / "train" / "metrics.parquet").query("split == 'val'")
    assert len(va) >= 4 and va.chain_rounds.min() > 0
    best = va.loc[va.chain_tau == va.chain_tau.max()].iloc[-1]  # the last of the best on a tie
    assert s["selected"]["step"] == best.step and s["best_val"]["chain_tau"] == best.chain_tau
    assert s["selected"]["val_chain_tau"] == best.chain_tau
    # the teacher-forced estimate is kept under its own name beside it
    assert s["best_val"]["tf_tau"] == best.tf_tau and "tau" not in s["best_val"]

    drafter, _, d2t, _ = load_drafter(tmp_path / "train" / "drafter.safetensors", tiny_target)
    target = Target(data["model"], LAYERS, eos_ids=set())
    proposer = EagleProposer(drafter, d2t)
    ds = HiddenStateDataset(data["index"])
    rounds = {k: [] for k in range(1, K + 1)}
    P = 4  # the fixture's prompt length; the rest of each sample is the greedy continuation
    for i in (i for i, sid in enumerate(ds.ids) if is_val(sid, PARAMS["val_fraction"])):
        x = ds.sample(i)["input_ids"].tolist()
        r = offline_prompt(target, proposer, x[:P], K, len(x) - P)
        assert r["tokens"] == x[P:]  # the stored data is the target's greedy continuation
        accepted = [0] + [st["accepted"] for st in r["starts"]]
        for k in rounds:
            rounds[k] += chain_replay(accepted, len(r["tokens"]), len(r["tokens"]), k)
    for k in rounds:
        assert s["best_val"][f"chain_tau_{k}"] == pytest.approx(rounds_tau(rounds[k]), abs=1e-9), k
    assert s["best_val"]["chain_rounds"] == sum(1 for r in rounds[K] if r[1] > 0)
    # 30 samples: the held-out chain gains little, but some drafts are accepted (a random drafter: none)
    assert s["best_val"]["chain_tau"] == s["best_val"][f"chain_tau_{K}"] > 1.0

    # what `make run` ends with (eaglet.workflow.summary) reads these very figures from train_summary.json
    line = next(ln for ln in summary_lines(tmp_path) if ln.strip().startswith("train"))
    assert f"{s['steps']} steps" in line and f"loss {s['final_train']['loss']:.3f}" in line, line
    assert f"validation {s['final_val']['loss']:.3f}" in line, line
    assert f"validation chain tau {s['best_val']['chain_tau']:.3f} at k={K}" in line, line
    assert f"teacher-forced {s['best_val']['tf_tau']:.3f}" in line and f"kept step {best.step}" in line, line
    # the report's training plot reads the renamed columns (teacher-forced and chain τ)
    from eaglet.report.plots import training_plot

    training_plot(tmp_path / "train" / "metrics.parquet", tmp_path / "training.png")
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_selection_rule():
    assert is_better({"chain_tau": 1.1}, None)
    assert is_better({"chain_tau": 1.3}, {"tau": 1.3})  # a tie goes to the later pass
    assert not is_better({"chain_tau": 1.2}, {"tau": 1.3})
    assert not is_better({"chain_tau": None}, {"tau": 1.0})
    assert is_better({"chain_tau": 1.0}, {"tau": None})
    # by the expected τ at T = 1 (train.select_temperature: 1): the other τ does not count
    assert not is_better({"chain_tau": 2.0, "exp_tau": 1.2}, {"tau": 1.3}, "exp_tau")
    assert is_better({"chain_tau": 1.0, "exp_tau": 1.4}, {"tau": 1.3}, "exp_tau")


@pytest.mark.faults
def test_resume_after_kill_reproduces_the_loss_trace(tiny_target, data, tmp_path):
    # oov_rule "label" skips the 49k-row greedy check: the test is about resuming, and is faster
    params = {**PARAMS, "epochs": 2, "checkpoint_every": 3, "keep_checkpoints": 2, "oov_rule": "label",
              "noise_std": 0.05}
    ref = tmp_path / "ref"
    subprocess.run(train_cmd(data, tiny_target, ref, params), check=True, capture_output=True)

    run = tmp_path / "run"
    kill_when_written(slowed_trainer(train_cmd(data, tiny_target, run, params), 0.25),
                      run / "checkpoints" / "step_00000006.pt", 120)
    assert not (run / "drafter.safetensors").exists()
    subprocess.run(train_cmd(data, tiny_target, run, params), check=True, capture_output=True)

    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["resumed_from"] >= 6
    a, b = pd.read_parquet(ref / "metrics.parquet"), pd.read_parquet(run / "metrics.parquet")
    assert list(a.step) == list(b.step) and list(a.split) == list(b.split)
    for col in ["loss", "loss_0", "loss_2", "tf_acc_1", "grad_norm", "lr"]:
        assert (a[col] - b[col]).abs().max() <= 1e-6 * max(1.0, a[col].abs().max()), col
    ta, tb = load_tensors(ref / "drafter.safetensors"), load_tensors(run / "drafter.safetensors")
    assert all(torch.equal(ta[k], tb[k]) if not ta[k].is_floating_point() else
               torch.allclose(ta[k], tb[k], atol=1e-6) for k in ta)


@pytest.mark.faults
def test_corrupt_checkpoint_is_refused_naming_the_file(tiny_target, data, tmp_path, caplog):
    """A killed run's newest checkpoint is truncated (or overwritten): the resume refuses it,
    naming the file, falls back to the one before (or to step 0), and still reproduces the
    uninterrupted run's loss trace and weights."""
    import logging
    import shutil

    params = {**PARAMS, "epochs": 2, "checkpoint_every": 3, "keep_checkpoints": 3, "oov_rule": "label"}
    ref = tmp_path / "ref"
    s = train(data["index"], data["vocab"], tiny_target, ref, params)
    ckpts = sorted((ref / "checkpoints").glob("step_*.pt"))
    assert s["steps"] > 6 and len(ckpts) >= 2  # kept after the run: the state a kill leaves behind
    want = pd.read_parquet(ref / "metrics.parquet")
    for case in ("newest_truncated", "all_garbage"):
        run = tmp_path / case
        shutil.copytree(ref / "checkpoints", run / "checkpoints")
        bad = sorted((run / "checkpoints").glob("step_*.pt"))
        if case == "newest_truncated":
            bad = bad[-1:]
            bad[0].write_bytes(bad[0].read_bytes()[: bad[0].stat().st_size // 2])
        else:
            for f in bad:
                f.write_bytes(b"garbage, not a checkpoint")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="eaglet"):
            got = train(data["index"], data["vocab"], tiny_target, run, params)
        for f in bad:
            assert f"{f}: unreadable checkpoint" in caplog.text
        assert got["resumed_from"] == (int(ckpts[-2].stem.split("_")[1]) if case == "newest_truncated" else 0)
        m = pd.read_parquet(run / "metrics.parquet")
        assert list(m.step) == list(want.step) and list(m.split) == list(want.split)
        for col in ["loss", "loss_0", "tf_acc_1", "grad_norm", "lr"]:
            assert (m[col] - want[col]).abs().max() <= 1e-6 * max(1.0, want[col].abs().max()), (case, col)


def test_ddp_gloo_matches_single_process(tiny_target, data, tmp_path):
    params = {**PARAMS, "max_steps": 4, "val_every": 4, "oov_rule": "label", "noise_std": 0.05}
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    subprocess.run(train_cmd(data, tiny_target, single, {**params, "grad_accum": 2}), check=True, capture_output=True)
    r = subprocess.run(train_cmd(data, tiny_target, ddp, params, nproc=2), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((ddp / "train_summary.json").read_text())
    assert s["world_size"] == 2 and s["micro_batches_per_step"] == 2
    a, b = pd.read_parquet(single / "metrics.parquet"), pd.read_parquet(ddp / "metrics.parquet")
    assert len(a) == len(b) == 5  # 4 steps, one validation pass
    # validation is split over the ranks and summed: the same chain counts as one process
    va, vb = a[a.split == "val"].iloc[0], b[b.split == "val"].iloc[0]
    assert va.chain_rounds == vb.chain_rounds > 0 and va.chain_tau == pytest.approx(vb.chain_tau, abs=1e-12)
    a, b = a[a.split == "train"], b[b.split == "train"]
    assert (a.loss - b.loss).abs().max() < 1e-4 and (a.tokens == b.tokens).all()
    ta, tb = load_tensors(single / "drafter.safetensors"), load_tensors(ddp / "drafter.safetensors")
    assert torch.equal(ta["d2t"], tb["d2t"]) and torch.equal(ta["t2d"], tb["t2d"])
    # gloo's all-reduce sums in another order; Adam's division by sqrt(v) amplifies that in
    # near-zero gradient entries (1.2e-5 seen with transformers' rotary; weights are ~0.02)
    assert max(float((ta[k] - tb[k]).abs().max()) for k in ta if ta[k].is_floating_point()) < 5e-5
    # steps 2.. see updated weights, so equal losses there mean equal updates (not vacuous)
    assert a.loss.iloc[-1] < a.loss.iloc[0]


def test_every_trainer_setting_is_a_config_key():
    """What the trainer's messages tell a user to set (train.accept_unchecked_labels, ...) must be
    settable: each of its settings is a key of the workflow's train section, with the same default
    (the trainer reads them from the schema: eaglet.base.schema), and every key of the section is the
    trainer's but the launcher's (nodes, rdzv_port)."""
    from pathlib import Path

    import yaml

    from eaglet.train.train import LAUNCH_KEYS

    schema = yaml.safe_load((Path(__file__).resolve().parents[2] / "workflow/schemas/config.schema.yaml").read_text())
    props = schema["properties"]["train"]["properties"]
    p = resolve_params({})
    assert set(p) <= set(props), sorted(set(p) - set(props))
    assert set(props) - set(p) == set(LAUNCH_KEYS) == {"nodes", "rdzv_port"}
    for k, v in p.items():
        assert props[k].get("default") == v, (k, props[k].get("default"), v)
    with pytest.raises(ValueError, match="unknown keys.*nodes"):
        resolve_params({"nodes": 2})  # the launcher's, not the trainer's


def test_a_data_fraction_trains_on_fewer_samples_and_records_its_validation_chain(tiny_target, data, tmp_path):
    """The learning curve's inputs: data_fraction 0.5 keeps about half the training samples (the
    validation split unchanged), and the per-sequence chain counts recorded for the kept weights
    pool to the validation chain τ the trainer selected them by."""
    full = train(data["index"], data["vocab"], tiny_target, tmp_path / "full", dict(PARAMS, max_steps=4))
    half = train(data["index"], data["vocab"], tiny_target, tmp_path / "half",
                 dict(PARAMS, max_steps=4, data_fraction=0.5))
    assert half["val_samples"] == full["val_samples"] > 0
    assert 0 < half["train_samples"] < full["train_samples"] and half["train_tokens"] < full["train_tokens"]
    for s in (full, half):
        groups = s["best_val_chain_by_sequence"]
        assert len(groups) == s["val_samples"]
        rounds = sum(r for _, r in groups)
        assert rounds == s["best_val"]["chain_rounds"] > 0
        assert 1 + sum(a for a, _ in groups) / rounds == pytest.approx(s["selected"]["val_chain_tau"])


def _copy_store(ds, indices, out, digest, prefix=""):
    """The samples ``indices`` of ``ds`` in a new store (ids prefixed), with their label references."""
    from eaglet.hidden.store import ShardWriter

    w = ShardWriter(out / "shard_0", 0, 1, LAYERS, True, "float32", 128, digest, 1 << 16)
    keep = {ds.ids[i] for i in indices}
    for i in indices:
        s = ds.sample(i)
        w.add(prefix + s["id"], s["input_ids"], s["loss_mask"], s["aux"].view(-1, 3, s["aux"].shape[-1]), s["final"],
              s["target_lse"], s["target_top1"])
    w.add_references([[prefix + r[0], *r[1:]] for r in ds.label_references if r[0] in keep])
    w.finish()
    return str(out / "shard_0" / "index.json")


def test_validation_stores_replace_the_split_and_score_the_same(tiny_target, data, tmp_path):
    """train(val_hidden=...): the held-out samples moved to a store of their own (ids renamed) and
    the rest as the training store train the same drafter and score the same validation chain
    as the val_fraction split of the whole store; a validation store that repeats a training id
    is refused, naming it."""
    ds = HiddenStateDataset(data["index"])
    held = [i for i, sid in enumerate(ds.ids) if is_val(sid, PARAMS["val_fraction"])]
    rest = [i for i in range(len(ds.ids)) if i not in held]
    assert held and rest
    digest = tiny_target["digest"]
    train_store = _copy_store(ds, rest, tmp_path / "train_store", digest)
    val_store = _copy_store(ds, held, tmp_path / "val_store", digest, prefix="v-")
    p = dict(PARAMS, max_steps=6, val_every=3)
    a = train(data["index"], data["vocab"], tiny_target, tmp_path / "split", p)
    b = train([train_store], data["vocab"], tiny_target, tmp_path / "stores", p, val_hidden=[val_store])
    assert b["val_stores"] == "validation-only stores" and a["val_stores"] != b["val_stores"]
    assert (b["train_samples"], b["val_samples"]) == (a["train_samples"], a["val_samples"]) == (len(rest), len(held))
    assert b["best_val"]["chain_rounds"] == a["best_val"]["chain_rounds"] > 0
    assert b["best_val"]["chain_tau"] == pytest.approx(a["best_val"]["chain_tau"], abs=1e-6)
    assert b["best_val_chain_by_sequence"] == a["best_val_chain_by_sequence"]
    dup = _copy_store(ds, rest[:2], tmp_path / "dup_store", digest)
    with pytest.raises(ArtifactError, match=ds.ids[rest[0]]):
        train([train_store], data["vocab"], tiny_target, tmp_path / "dup", p, val_hidden=[dup])


def test_score_drafter_reproduces_the_trainers_validation_of_the_kept_weights(tiny_target, data, tmp_path):
    """benchmarks/score_drafter.py scores a finished run's kept weights on a validation store
    without retraining: on the store the run validated on, it gives the run's own best validation
    row (the kept weights' chain τ and rounds); other weights score otherwise."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from score_drafter import score

    ds = HiddenStateDataset(data["index"])
    held = [i for i, sid in enumerate(ds.ids) if is_val(sid, PARAMS["val_fraction"])]
    rest = [i for i in range(len(ds.ids)) if i not in held]
    train_store = _copy_store(ds, rest, tmp_path / "train_store", tiny_target["digest"])
    val_store = _copy_store(ds, held, tmp_path / "val_store", tiny_target["digest"], prefix="v-")
    p = dict(PARAMS, val_every=5)
    b = train([train_store], data["vocab"], tiny_target, tmp_path / "run/train", p, val_hidden=[val_store])
    (tmp_path / "run/extract").mkdir()
    (tmp_path / "run/extract/shard_0").symlink_to(Path(train_store).parent)
    row = score(tmp_path / "run", [val_store], tiny_target, p)
    assert row["chain_rounds"] == b["best_val"]["chain_rounds"] > 0 and b["best_val"]["chain_tau"] > 1
    assert row["chain_tau"] == pytest.approx(b["best_val"]["chain_tau"], abs=1e-6)
    assert row["loss"] == pytest.approx(b["best_val"]["loss"], rel=1e-5)
    f = tmp_path / "run/train/drafter.safetensors"
    t = load_tensors(f)
    meta = tensor_metadata(f)
    name = next(k for k in t if k.endswith("weight") and t[k].dim() == 2 and k not in ("d2t", "t2d"))
    t[name] = torch.randn_like(t[name])  # other weights: another score
    save_tensors(f, t, metadata=meta)
    other = score(tmp_path / "run", [val_store], tiny_target, p)
    assert other["loss"] != pytest.approx(row["loss"], rel=1e-3) and other["chain_tau"] != row["chain_tau"]


def test_bf16_autocast_on_the_cpu_takes_effect_is_recorded_and_learns(tiny_target, data, tmp_path):
    """train.autocast: "float32" keeps the CPU in fp32; "bfloat16" runs the drafter's forward under
    bf16 autocast there (the losses differ from fp32 from the first step, so it took effect), says
    so in train_summary.json, and still learns; "auto" follows this CPU's bf16 units (as the
    workflow resolves it); an unknown value is refused by name."""
    from eaglet.base.capability import cpu_target_dtype

    p = dict(PARAMS, max_steps=12, val_every=10**6)
    fp32 = train(data["index"], data["vocab"], tiny_target, tmp_path / "fp32", p)
    bf16 = train(data["index"], data["vocab"], tiny_target, tmp_path / "bf16", dict(p, autocast="bfloat16"))
    auto = train(data["index"], data["vocab"], tiny_target, tmp_path / "auto", dict(p, autocast="auto", max_steps=1))
    assert fp32["bf16_autocast"] is False and bf16["bf16_autocast"] is True
    assert auto["bf16_autocast"] is (cpu_target_dtype()[0] == "bfloat16")
    a = pd.read_parquet(tmp_path / "fp32/metrics.parquet").query("split == 'train'").loss.to_numpy()
    b = pd.read_parquet(tmp_path / "bf16/metrics.parquet").query("split == 'train'").loss.to_numpy()
    assert len(a) == len(b) == 12 and a[0] != b[0]
    assert abs(b[0] - a[0]) < 0.02 * a[0]  # same data, same initial weights: bf16 rounding only
    assert b[-3:].mean() < 0.8 * b[:3].mean()
    with pytest.raises(ValueError, match="train.autocast"):
        resolve_params({"autocast": "fp16"})


def test_the_ttt_attention_the_plan_chose_trains_the_same_and_resumes_the_other(tiny_target, data, tmp_path,
                                                                               monkeypatch):
    """train.ttt_attention (issue 43, the memory plan's choice at parse time): the trainer's objective
    keeps the attention weights with ``saved`` and recomputes them otherwise (``auto`` called directly:
    recompute, the plan's choice without a memory figure); the loss trace is the same either way, and a
    checkpoint written with one resumes under the other (the path is not in the run's identity)."""
    import shutil

    from eaglet.train import setup

    made = []

    class Recording(TTTObjective):
        def __init__(self, *a, recompute=True, **kw):
            made.append(recompute)
            super().__init__(*a, recompute=recompute, **kw)

    monkeypatch.setattr(setup, "TTTObjective", Recording)
    p = dict(PARAMS, max_steps=6, val_every=10**6, checkpoint_every=3, oov_rule="label")
    rec = train(data["index"], data["vocab"], tiny_target, tmp_path / "recompute", dict(p, ttt_attention="recompute"))
    saved = train(data["index"], data["vocab"], tiny_target, tmp_path / "saved", dict(p, ttt_attention="saved"))
    train(data["index"], data["vocab"], tiny_target, tmp_path / "auto", dict(p, ttt_attention="auto", max_steps=1))
    assert made == [True, False, True]
    assert rec["params"]["ttt_attention"] == "recompute" and saved["params"]["ttt_attention"] == "saved"
    a = pd.read_parquet(tmp_path / "recompute/metrics.parquet").query("split == 'train'")
    b = pd.read_parquet(tmp_path / "saved/metrics.parquet").query("split == 'train'")
    assert len(a) == len(b) == 6
    for col in ["loss", "loss_0", "loss_2", "grad_norm"]:
        assert (a[col] - b[col]).abs().max() <= 1e-6 * max(1.0, a[col].abs().max()), col
    # the recompute run's step-3 checkpoint, resumed with the saved weights: the same last steps
    shutil.copytree(tmp_path / "recompute/checkpoints", tmp_path / "mixed/checkpoints")
    for f in sorted((tmp_path / "mixed/checkpoints").glob("step_*.pt"))[1:]:
        f.unlink()
    mixed = train(data["index"], data["vocab"], tiny_target, tmp_path / "mixed", dict(p, ttt_attention="saved"))
    assert mixed["resumed_from"] == 3, mixed["resumed_from"]
    c = pd.read_parquet(tmp_path / "mixed/metrics.parquet").query("split == 'train'")
    assert abs(c.loss.to_numpy() - a.loss.to_numpy()).max() <= 1e-6 * max(1.0, a.loss.abs().max())
    with pytest.raises(ValueError, match="train.ttt_attention"):
        resolve_params({"ttt_attention": "dense"})
