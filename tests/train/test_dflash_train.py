"""The DFlash trainer (eaglet.train.dflash_train) on a real store of the tiny target's own greedy
continuations: it learns the target's greedy blocks (accepted where the untrained drafter's are not), a run resumed
from a checkpoint equals the uninterrupted one step for step and weight for weight, the mask token
rule picks an unused special token, and what it cannot do is refused naming the key."""

import json
import shutil

import pandas as pd
import pytest
import torch

from eaglet.base.tensors import load_tensors
from eaglet.drafter.dflash import DFlashDrafter, load_dflash
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.target.load import load_target_embedding, load_tokenizer
from eaglet.train.dflash_train import block_acceptance, collate, mask_token_rule, resolve_settings, train
from train_common import LAYERS, hidden_data

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = dict(lr=3e-3, token_budget=256, epochs=4, val_fraction=0.15, val_every=6, val_max_batches=1,
              checkpoint_every=6, keep_checkpoints=10, warmup_ratio=0.05, seed=3)
DRAFTER = dict(block_size=4, num_layers=1, num_anchors=16)


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory):
    return hidden_data(tiny_target, tmp_path_factory.mktemp("dflash_data"))


def test_trains_resumes_exactly_and_records_the_kind(tiny_target, data, tmp_path, caplog):
    """It learns the greedy blocks of its data and says how far it is (issue 45's progress lines);
    resumed from its step-6 checkpoint, a run ends with the same rows and weights."""
    import logging

    ref = tmp_path / "ref"
    with caplog.at_level(logging.INFO, logger="eaglet.train.dflash_train"):
        s = train(data["index"], tiny_target, ref, PARAMS, DRAFTER)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train (dflash): ")]
    assert done and done[-1].startswith(f"train (dflash): {s['steps']}/{s['steps']} steps (100 %)"), done
    assert s["kind"] == "dflash" and s["layer_ids"] == LAYERS and s["resumed_from"] == 0
    assert s["num_speculative_tokens"] == 3 and s["params"]["lr"] == PARAMS["lr"]
    model, cfg = load_dflash(ref / "drafter.safetensors")
    assert cfg.target_layer_ids == LAYERS and cfg.block_size == 4 and cfg.mask_token_id == s["mask_token_id"]
    m = pd.read_parquet(ref / "metrics.parquet")
    val = m[m.split == "val"]
    assert len(val) >= 2 and (val.blocks > 0).all() and (val.block_tau >= 1).all()
    tr = m[m.split == "train"]
    assert tr.loss.iloc[-1] < tr.loss.iloc[0] / 2 and len(tr) == s["steps"]
    # it learned the target's greedy choices: blocks accepted on training samples (random prompts
    # of a random target do not generalise to held-out ones, which the val rows score)
    ds = HiddenStateDataset(data["index"])
    batch = collate([ds.sample(i) for i in range(6)], "cpu")
    embed = load_target_embedding(tiny_target["path"]).float()
    head = data["model"].get_output_embeddings().weight.detach().float()
    acc, blocks = block_acceptance(model, batch, embed, head)
    acc0, _ = block_acceptance(DFlashDrafter(cfg), batch, embed, head)
    assert blocks > 20 and acc / blocks > 1.0 and acc0 / blocks < 0.1
    # a run whose only state is the step-6 checkpoint (as a run killed after it) ends where ref ends
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ref / "checkpoints" / "step_00000006.pt", run / "checkpoints")
    r = train(data["index"], tiny_target, run, PARAMS, DRAFTER)
    assert r["resumed_from"] == 6
    b = pd.read_parquet(run / "metrics.parquet")
    pd.testing.assert_frame_equal(m.drop(columns="seconds"), b.drop(columns="seconds"))
    ta, tb = load_tensors(ref / "drafter.safetensors"), load_tensors(run / "drafter.safetensors")
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert json.loads((run / "train_summary.json").read_text())["selected"] == s["selected"]


def test_mask_token_rule_and_refusals(tiny_target):
    tok = load_tokenizer(tiny_target["path"])
    mid, why = mask_token_rule(tok, set(), tiny_target["vocab_size"])
    assert mid in tok.all_special_ids or tok.added_tokens_decoder[mid].special
    assert mid not in {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    assert tok.convert_ids_to_tokens(mid) not in (tok.chat_template or "") and "rule" in why
    # a token of the data is never the mask
    assert mask_token_rule(tok, {mid}, tiny_target["vocab_size"])[0] != mid
    with pytest.raises(ValueError, match="drafter.dflash.mask_token_id"):
        mask_token_rule(tok, set(range(tiny_target["vocab_size"])), tiny_target["vocab_size"])
    for params, key in [({"hidden_states": "online"}, "train.hidden_states"), ({"init_from": "x"}, "train.init_from")]:
        with pytest.raises(ValueError, match=key):
            resolve_settings(params, {})
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_settings({}, {"block": 4})


def test_ddp_gloo_trains_as_one_process_with_the_larger_accumulation(tiny_target, data, tmp_path):
    """Two gloo ranks (torchrun, as the workflow launches train.gpus > 1) with grad_accum 1 train as one
    process with grad_accum 2: the same anchors (each rank draws the other's from its loss masks), the
    same rows, weights equal up to the all-reduce's summation order; rank 0 alone writes."""
    import subprocess
    import sys

    params = {**PARAMS, "max_steps": 4, "val_every": 4, "checkpoint_every": 100}
    ident = tmp_path / "identity.json"
    ident.write_text(json.dumps(tiny_target))

    def cmd(out, params, nproc=1):
        args = ["-m", "eaglet.train.dflash_train", "--hidden", *data["index"], "--target-identity", str(ident),
                "--out-dir", str(out), "--params", json.dumps(params), "--drafter", json.dumps(DRAFTER)]
        if nproc > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                    *args]
        return [sys.executable, *args]

    single, ddp = tmp_path / "single", tmp_path / "ddp"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd(single, {**params, "grad_accum": 2}), capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(cmd(ddp, params, nproc=2), capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    s, o = (json.loads((x / "train_summary.json").read_text()) for x in (ddp, single))
    assert (s["world_size"], s["micro_batches_per_step"]) == (2, 2) and (o["world_size"], o["steps"]) == (1, 4)
    assert s["steps"] == 4 and s["mask_token_id"] == o["mask_token_id"]
    a, b = pd.read_parquet(single / "metrics.parquet"), pd.read_parquet(ddp / "metrics.parquet")
    assert list(a.split) == list(b.split) == ["train"] * 4 + ["val"]
    ta_, tb_ = a[a.split == "train"], b[b.split == "train"]
    assert (ta_.tokens.values == tb_.tokens.values).all() and (ta_.blocks.values == tb_.blocks.values).all()
    assert (ta_.loss - tb_.loss).abs().max() < 1e-4
    assert ta_.loss.iloc[-1] < ta_.loss.iloc[0]  # steps 2.. read updated weights: equal losses, equal updates
    va, vb = a[a.split == "val"].iloc[0], b[b.split == "val"].iloc[0]
    assert va.blocks == vb.blocks > 0 and va.block_tau == pytest.approx(vb.block_tau, abs=1e-9)
    ta, tb = load_tensors(single / "drafter.safetensors"), load_tensors(ddp / "drafter.safetensors")
    assert ta.keys() == tb.keys()
    assert max(float((ta[k] - tb[k]).abs().max()) for k in ta if ta[k].is_floating_point()) < 5e-5
