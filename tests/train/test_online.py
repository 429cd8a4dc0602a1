"""Online training (train.hidden_states: online, eaglet.train.online) on the tiny target: the same loss
trace and weights as offline training on extracted shards of the same storage dtype, step for
step; a killed online run resumes and still reproduces it; settings that make no sense are refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import kill_when_written, slowed_trainer, snakemake_cmd
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.files import write_json
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.features.extract import extract
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.hidden.store import storage_round
from eaglet.train.train import train
from train_common import write_tokens
from workflow_common import flag_json, planned

N_SAMPLES = 40
VD = 256
# Small: several micro-batches of several samples per epoch; checkpoints every 2 steps. The comparison
# counts greedy agreements exactly, and on the random tiny target's near-flat distributions a last-bit
# input difference can flip an argmax: so fp32 (train.autocast auto trains in bf16 where the CPU has
# bf16 units, and on an AMX CPU that flipped counts) and soft_ce (the default -log α amplifies such
# differences; tests/train_common.py).
PARAMS = dict(ttt_steps=2, lr=3e-3, token_budget=160, epochs=2, max_steps=10, val_fraction=0.15, val_every=5,
              checkpoint_every=2, keep_checkpoints=5, warmup_ratio=0.1, seed=5, oov_rule="label",
              noise_std=0.05, loss="soft_ce", autocast="float32")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread, as tests/features/test_extract.py: the tiny model's matmuls run faster, and the same
    thread count in the test process and in the CLI runs it compares with."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def run_inputs(tiny_target, tmp_path_factory):
    """A tokens file (with tokenize's digest record) and a vocab map over its tokens."""
    out = tmp_path_factory.mktemp("online")
    rows = write_tokens(out / "tokens.parquet", N_SAMPLES, seed=1, lo=6, hi=40)
    write_json(out / "metadata.json", {DIGESTS_KEY: record_digests(out, ["tokens.parquet"])})
    V = tiny_target["vocab_size"]
    counts = torch.zeros(V, dtype=torch.long)
    for r in rows:
        counts.index_add_(0, torch.tensor(r["input_ids"]), torch.ones(len(r["input_ids"]), dtype=torch.long))
    used = counts.argsort(descending=True, stable=True)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    save_tensors(out / "vocab.safetensors", {"d2t": used - torch.arange(VD), "t2d": t2d})
    write_json(out / "vocab.json", {DIGESTS_KEY: record_digests(out, ["vocab.safetensors"])})
    ident_path = Path(tiny_target["path"]).parent / "identity.json"
    return {"dir": out, "tokens": str(out / "tokens.parquet"), "vocab": str(out / "vocab.safetensors"),
            "identity": ident_path}


def _online(run_inputs, dtype):
    return {"tokens": run_inputs["tokens"], "layer_ids": None, "dtype": dtype,
            "target_load": {"dtype": "float32", "device": "auto", "trust_remote_code": False}}


def _params(dtype):
    # the random tiny target's top-1 margins are mostly below what fp8 rounding can move (2.0): too
    # few positions to judge, offline and online alike (the bf16 run checks its labels)
    return {**PARAMS, "accept_unchecked_labels": dtype == "fp8"}


def _offline(tiny_target, run_inputs, dtype, out):
    shard = out / "shard_0"
    # extraction's own batches (longest first, budget 400) differ from the trainer's micro-batches
    extract(run_inputs["tokens"], run_inputs["identity"], shard, dtype=dtype, token_budget=400, progress=False)
    return train([str(shard / "index.json")], run_inputs["vocab"], tiny_target, out / "train", _params(dtype))


# Tolerances of the comparison (measured: losses <= 3e-6 relative, weights <= 2e-5 after 10 steps).
LOSS_RTOL, WEIGHT_ATOL = 2e-5, 1e-4


def _same_run(a_dir: Path, b_dir: Path) -> None:
    """The same metrics rows (train and validation): counts exactly, losses to LOSS_RTOL; the same
    drafter tensors to WEIGHT_ATOL."""
    a, b = pd.read_parquet(a_dir / "metrics.parquet"), pd.read_parquet(b_dir / "metrics.parquet")
    assert list(a.step) == list(b.step) and list(a.split) == list(b.split)
    assert (a.split == "val").sum() >= 2 and (a.split == "train").sum() == PARAMS["max_steps"]
    for col in ["tf_acc_0", "positions", "tokens", "lr", "chain_tau", "chain_rounds"]:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        assert ((x == y) | (pd.isna(x) & pd.isna(y))).all(), (col, x, y)
    for col in ["loss", "loss_0", "loss_1", "grad_norm"]:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        assert np.nanmax(abs(x - y)) <= LOSS_RTOL * np.nanmax(abs(x)), (col, x, y)
    ta, tb = load_tensors(a_dir / "drafter.safetensors"), load_tensors(b_dir / "drafter.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]) if not ta[k].is_floating_point() else \
            float((ta[k] - tb[k]).abs().max()) <= WEIGHT_ATOL, k
    # not vacuous: training moved the loss far beyond the tolerance
    tr = a[a.split == "train"]
    assert tr.loss.iloc[-3:].mean() < 0.9 * tr.loss.iloc[:3].mean()


def _inputs_agree(shard, tiny_target, run_inputs, dtype):
    """The trainer's inputs, micro-batch by micro-batch: tokens and masks equal; the states equal
    but for a few elements one storage step apart (returns the fraction that differ)."""
    from eaglet.train.data import collate, plan_micro_batches
    from eaglet.train.online import OnlineHiddenStates
    from eaglet.train.train import resolve_params

    ds = HiddenStateDataset([shard / "index.json"])
    on = OnlineHiddenStates(run_inputs["tokens"], tiny_target, None, dtype, "cpu")
    p = resolve_params(PARAMS)
    m_off, _, _ = plan_micro_batches(ds.ids, ds.num_tokens, p)
    m_on, _, _ = plan_micro_batches(on.ids, on.num_tokens, p)
    assert [[ds.ids[i] for i in b] for b in m_off] == [[on.ids[i] for i in b] for b in m_on]
    differ = total = 0
    step = {"bfloat16": 2.0 ** -7, "fp8": 2.0 ** -3}[dtype]  # one step of the mantissa, relative
    for bo, bn in zip(m_off[:6], m_on[:6]):
        a, b = collate([ds.sample(i) for i in bo], "cpu"), on.collate(bn)
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["mask"], b["mask"])
        for key in ("aux", "final"):
            d = (a[key] - b[key]).abs()
            assert (d <= step * torch.maximum(a[key].abs(), b[key].abs()) + 1e-6).all(), key
            differ += int((d > 0).sum())
            total += d.numel()
    on.close()
    return differ / total


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_online_equals_offline_step_for_step(tiny_target, run_inputs, tmp_path, dtype):
    """A tight tolerance, not bit equality, and why: the fresh states are rounded exactly as a shard
    write + read rounds them (hidden_store.storage_round), the micro-batches hold the same samples
    in the same order, tokens, masks and counts are equal; but the target's float32 forward of a
    sample differs in the last bit with the batch around it (extraction batches longest-first at
    its own budget, training at the trainer's; the kernels depend on the shapes), and where that
    straddles a rounding boundary the stored value moves by one bf16/fp8 step. A batch of the same
    shapes is bit-identical. So: inputs equal but for a few elements one storage step apart
    (asserted), and losses/weights within LOSS_RTOL/WEIGHT_ATOL of the offline run, step for step."""
    off = _offline(tiny_target, run_inputs, dtype, tmp_path / "off")
    on = train([], run_inputs["vocab"], tiny_target, tmp_path / "on", {**_params(dtype), "hidden_states": "online"},
               online=_online(run_inputs, dtype))
    assert on["steps"] == off["steps"] == PARAMS["max_steps"] and on["params"]["hidden_states"] == "online"
    # the label check ran online too, against the real model's top-1 from the same forward
    assert on["label_check"]["ok"] is (True if dtype == "bfloat16" else None)
    _same_run(tmp_path / "off" / "train", tmp_path / "on")
    frac = _inputs_agree(tmp_path / "off" / "shard_0", tiny_target, run_inputs, dtype)
    print(f"{dtype}: {frac:.2e} of the state elements differ by one storage step")
    # bf16: single elements (3e-5 measured); fp8: a per-token scale that moves by one float32 ulp
    # moves that token's whole row (8e-2 measured)
    assert frac < {"bfloat16": 1e-3, "fp8": 0.2}[dtype]
    # the rounding is real: the stored states are not the float32 ones
    ds = HiddenStateDataset([tmp_path / "off" / "shard_0" / "index.json"])
    s = ds.sample(0)
    assert torch.equal(storage_round(s["final"], dtype), s["final"])
    assert ds.meta["dtype"] == {"bfloat16": "bfloat16", "fp8": "float8_e4m3fn"}[dtype]


def _cli(run_inputs, out, params):
    return [sys.executable, "-m", "eaglet.train.train", "--vocab", run_inputs["vocab"],
            "--target-identity", str(run_inputs["identity"]), "--out-dir", str(out),
            "--params", json.dumps(params), "--online", json.dumps(_online(run_inputs, "bfloat16"))]


def _env():
    # one thread, as the in-process reference run (the module fixture)
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.faults
def test_online_resume_after_kill_reproduces_offline(tiny_target, run_inputs, tmp_path):
    """kill -9 of an online run after its step-4 checkpoint; the rerun resumes there and ends
    with the offline run's loss trace and weights (the data plan and batches are the same, so the
    target recomputes the same states)."""
    _offline(tiny_target, run_inputs, "bfloat16", tmp_path / "off")
    params = {**PARAMS, "hidden_states": "online"}
    run = tmp_path / "run"
    cmd = _cli(run_inputs, run, params)
    kill_when_written(slowed_trainer(cmd, 0.5), run / "checkpoints" / "step_00000004.pt", 180, env=_env())
    assert not (run / "drafter.safetensors").exists()
    # the workflow's storage statement is the job's first log line
    r = subprocess.run([*cmd, "--note", json.dumps(["storage: the statement"]), "--log", str(tmp_path / "t.log")],
                       capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "t.log").read_text().splitlines()[0].endswith("storage: the statement")
    summary = json.loads((run / "train_summary.json").read_text())
    assert 4 <= summary["resumed_from"] < PARAMS["max_steps"]
    _same_run(tmp_path / "off" / "train", run)


def test_online_settings_that_make_no_sense_are_refused(tiny_target, run_inputs, tmp_path):
    with pytest.raises(ValueError, match="train.hidden_states: online needs"):
        train([], run_inputs["vocab"], tiny_target, tmp_path / "a", {"hidden_states": "online"})
    with pytest.raises(ValueError, match="train.hidden_states: offline, but online settings"):
        train([], run_inputs["vocab"], tiny_target, tmp_path / "b", {}, online=_online(run_inputs, "bfloat16"))
    with pytest.raises(ValueError, match="train.hidden_states: 'both' not"):
        train([], run_inputs["vocab"], tiny_target, tmp_path / "c", {"hidden_states": "both"})
    with pytest.raises(ValueError, match="target.device: cuda, but train.gpus is 0"):
        train([], run_inputs["vocab"], tiny_target, tmp_path / "d", {"hidden_states": "online"},
              online={**_online(run_inputs, "bfloat16"), "target_load": {"device": "cuda"}})


# --------------------------------------------------------------------------- the workflow
def _dry_run(tmp_path, tiny_target, extra: dict):
    """`snakemake -n -p` of the smoke config with ``extra`` keys, in a clone where the tiny target's
    config.json is where target_model writes it (so the storage figures know its hidden size)."""
    import shutil

    import yaml

    from conftest import clone

    a = tmp_path / "wf"
    if not a.exists():
        clone(a)
        model = a / "resources/targets/tiny-llama/model"
        model.mkdir(parents=True)
        shutil.copy(Path(tiny_target["path"]) / "config.json", model / "config.json")
    # The clone's jobs import its own eaglet (PYTHONPATH below), so the separate environments they would
    # use are the clone's, absent (a clone has no .venv): SGLang's loader, the one the smoke config's
    # export needs (eaglet.workflow.environments), is left out by name, as a run without SGLang does;
    # the storage choice this previews does not depend on it.
    smoke = yaml.safe_load((a / "config/smoke.yaml").read_text())
    no_sglang = {"export": {"accept_not_run": [*smoke["export"]["accept_not_run"], "loader.sglang"]}}
    assert "export" not in extra
    (a / "config/extra.yaml").write_text(yaml.safe_dump({**no_sglang, **extra}))
    env = {**os.environ, "PYTHONPATH": str(a / "src"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([*snakemake_cmd(), "-n", "-p", "--cores", "2", "--configfile",
                        "config/smoke.yaml", "config/extra.yaml"], cwd=a, env=env, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def test_dry_run_shows_the_storage_choice(tiny_target, tmp_path):
    """One key changes the mode; storage.budget_gb picks bf16 offline, fp8 offline or online, in that
    order, states the sizes and costs, and refuses a budget nothing fits, all on `snakemake -n`."""
    import re

    def jobs(out):
        return {ln.split()[1].rstrip(":") for ln in out.splitlines() if ln.startswith(("rule ", "localrule "))}

    code, out = _dry_run(tmp_path, tiny_target, {"train": {"hidden_states": "online"}})
    assert code == 0, out[-3000:]
    assert "train" in jobs(out) and "extract_hidden_states" not in jobs(out)
    assert re.search(r"eaglet\.train\.train --online '\{", out), out[-3000:]  # its settings inline
    assert "hidden states: none stored (train.hidden_states online" in out  # the memory plan counts the target

    code, out = _dry_run(tmp_path, tiny_target, {})
    assert code == 0 and "extract_hidden_states" in jobs(out) and "eaglet.train.train --hidden " in out
    sizes = re.search(r"storage: hidden states of <= ([\d,]+) tokens: bf16 ([\d.]+) MB, fp8 ([\d.]+) MB; .*"
                      r"offline bf16 = ([\d.]+) MB disk .* offline fp8 = ([\d.]+) MB .* online = ([\d.]+) MB disk "
                      r"\+ 3 target forwards", out)
    assert sizes, out[-3000:]
    tokens, bf16, fp8, d_bf16, d_fp8, d_on = (float(x.replace(",", "")) for x in sizes.groups())
    # the training job logs the same statement first (eaglet.train.train --note)
    train = next(j for j in planned(out) if j["rule"] == "train")
    note = flag_json(train["shell"], "--note")
    assert note["lines"][0].startswith("storage: hidden states of <= 12,288 tokens") and note["lines"][0] in out
    # a job parsed before its target was built (no lines) states the same from the target itself
    from eaglet.planner.storage import job_lines

    assert job_lines({**note, "lines": []}, tiny_target["path"])[0] == note["lines"][0]
    assert tokens == 48 * 256 and bf16 > 1.9 * fp8 and d_bf16 > d_fp8 > d_on > 0
    for budget, want in ((d_bf16 * 1.01e-3, "offline (bfloat16)"), (d_fp8 * 1.01e-3, "offline (fp8)"),
                         (d_on * 1.01e-3, "online (states rounded to bfloat16)")):
        code, out = _dry_run(tmp_path, tiny_target, {"storage": {"budget_gb": budget}})
        assert code == 0 and f"storage: chose {want}" in out, (budget, out[-3000:])
        assert ("extract_hidden_states" in jobs(out)) == want.startswith("offline"), budget
        if "fp8" in want:
            assert "extract.dtype=\"fp8\"" in out or "--dtype fp8" in out
        # the trainer gets the choice; the config stays as written (provenance records it so, with
        # what was resolved and why beside it: eaglet.workflow.resolve)
        by_rule = {j["rule"]: j for j in planned(out)}
        mode = want.split()[0]
        assert flag_json(by_rule["train"]["shell"], "--params")["hidden_states"] == mode
        written = flag_json(by_rule["provenance"]["shell"], "--config-json")
        resolved = flag_json(by_rule["provenance"]["shell"], "--resolved-json")
        assert (written["train"]["hidden_states"], written["extract"]["dtype"]) == ("offline", "bfloat16"), budget
        assert written["storage"]["budget_gb"] == budget
        assert resolved["storage"]["hidden_states"] == mode
        assert resolved["storage"]["why"].startswith(f"storage: chose {want}: "), resolved["storage"]
    assert not (tmp_path / "wf/logs/smoke/resolved.json").exists()  # written when a run starts, never by -n
    code, out = _dry_run(tmp_path, tiny_target, {"storage": {"budget_gb": d_on * 0.9e-3}})
    assert code != 0 and "storage.budget_gb" in out and "fits no storage choice" in out
    assert "rule " not in out  # refused before any job is planned
    code, out = _dry_run(tmp_path, tiny_target, {"train": {"hidden_states": "online"}, "extract": {"shards": 2}})
    assert code != 0 and "extract.shards: 2 has no effect with train.hidden_states: online" in out


def test_kimi_storage_choice_and_the_online_training_rank(tmp_path):
    """At Kimi-K2.5's shapes: 57,357 B per token in bf16; the budget picks bf16, fp8 or online;
    online, the memory plan puts the whole target (547 GB) in each training rank and refuses it on
    a 140 GiB GPU, saying to train offline."""
    from eaglet.planner import plan, shapes, storage
    from kimi_common import make_config_only_checkpoint

    config = plan.load_config(Path(__file__).resolve().parents[2] / "config/kimi-k2.5.yaml")
    config["target"]["path"] = str(make_config_only_checkpoint(tmp_path / "Kimi-K2.5"))
    s = shapes.target_shapes(config, target_bytes=547e9)
    f = storage.figures(config, s)
    assert f["tokens"] == 10_000 * 4096 and f["hidden"]["bfloat16"] == f["tokens"] * 57_357
    assert 0.49 < f["hidden"]["fp8"] / f["hidden"]["bfloat16"] < 0.51
    for budget, want in ((2500, ("offline", "bfloat16")), (1500, ("offline", "fp8")), (100, ("online", "bfloat16"))):
        mode, dtype, lines = storage.decide({**config, "storage": {"budget_gb": budget}}, s)
        assert (mode, dtype) == want and "bf16 2,349.3 GB, fp8 1,175.6 GB" in lines[0], (budget, lines)
    with pytest.raises(ValueError, match=r"storage\.budget_gb: 0\.1 GB fits no storage choice"):
        storage.decide({**config, "storage": {"budget_gb": 0.1}}, s)
    with pytest.raises(ValueError, match=r"storage\.budget_gb: the target's hidden size is not known"):
        storage.decide({**config, "storage": {"budget_gb": 100}}, None)

    online = {**config, "train": {**config["train"], "hidden_states": "online"}}
    off, on = plan.make_plan(config, target_bytes=547e9), plan.make_plan(online, target_bytes=547e9)
    assert on["train"]["parts"]["target_weights"] == 547e9
    assert on["train"]["peak"] - off["train"]["peak"] > 547e9  # weights + the forward's activations
    with pytest.raises(ValueError, match=r"largest: target_weights .*train offline"):
        plan.check(on, online)
    assert not plan.refusals(off, config)
