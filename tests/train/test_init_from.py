"""train.init_from: continuing a published drafter (a directory as vLLM loads it, written here by the
export's own writer, eaglet.export.vllm_format) on real hidden states of the tiny target: the weights
loaded (its validation before any step is the exported drafter's own), the run no worse than from
scratch, another draft vocabulary remapped by token id (the shared tokens' first drafts unchanged)
or refused, a drafter for another target or a broken directory refused by name before any step, and
resume from the run's own checkpoints first."""

import json
import shutil

import pytest
import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import read_json
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.drafter import published
from eaglet.export.contract.reference import load_exported
from eaglet.export.vllm_format import export_tensors, read_trained, vllm_config, write_dir
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.train.data import is_val
from eaglet.train.setup import setup
from eaglet.train.train import resolve_params, train
from eaglet.workflow.resolve import init_from_key
from train_common import PARAMS, VD, hidden_data

N = 30  # optimizer steps of each run at most
P = {**PARAMS, "max_steps": N, "val_every": 5, "checkpoint_every": 12, "keep_checkpoints": 2}


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory):
    return hidden_data(tiny_target, tmp_path_factory.mktemp("hidden"))


@pytest.fixture(scope="module")
def scratch(tiny_target, data, tmp_path_factory):
    """N steps from scratch, and the kept drafter exported as vLLM loads it (the export's writer,
    without the contract's engine runs): (summary, the drafter directory)."""
    run = tmp_path_factory.mktemp("scratch")
    s = train(data["index"], data["vocab"], tiny_target, run / "train", P)
    tensors, cfg = read_trained(run / "train/drafter.safetensors", tiny_target)
    conf = vllm_config(cfg, tiny_target, read_json(f"{tiny_target['path']}/config.json"))
    write_dir(run / "drafter", conf, export_tensors(tensors, cfg))
    return s, run / "drafter"


def _vocab(path, ids, V):
    """A vocab map holding the target ids ``ids`` (as vocab_map writes one)."""
    ids = torch.tensor(sorted(ids), dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    save_tensors(path, {"d2t": ids - torch.arange(len(ids)), "t2d": t2d})
    return str(path)


def _draft_ids(vocab):
    t = load_tensors(vocab, ["d2t"])["d2t"]
    return (torch.arange(len(t)) + t).tolist()


def _copy(src, dst, conf=None, tensors=None):
    """A copy of a drafter directory with config.json or tensors edited (functions of the originals)."""
    dst.mkdir(parents=True)
    c = read_json(src / "config.json")
    (dst / "config.json").write_text(json.dumps(conf(c) if conf else c))
    if tensors:
        save_tensors(dst / "model.safetensors", tensors(load_tensors(src / "model.safetensors")),
                     metadata={"format": "pt"})
    else:
        shutil.copyfile(src / "model.safetensors", dst / "model.safetensors")
    return dst


def test_continuing_starts_from_the_exported_drafter_and_is_no_worse_than_scratch(tiny_target, data, scratch,
                                                                                 tmp_path):
    """Compared: the validation (loss, exact greedy-chain τ) of the continued run before any step with
    the from-scratch run's kept pass (the exported weights): equal, so the weights were loaded and
    read right (a fresh drafter scores τ ~1); and after N more steps the kept validation chain τ is no
    worse than the from-scratch run's after its N."""
    a, drafter = scratch
    b = train(data["index"], data["vocab"], tiny_target, tmp_path / "train", {**P, "init_from": str(drafter)})
    init = b["init_from"]
    assert init["digest"] == published.digest(drafter) and init["vocab"]["map"] == "same"
    assert init["layer_ids_from"] == "its config.json" and init["adopted"] == {}
    start, kept = init["val_before_training"], a["best_val"]
    assert kept["chain_tau"] > 1.05  # the scratch drafter learned something to carry over
    assert start["chain_tau"] == pytest.approx(kept["chain_tau"], abs=1e-12)
    assert start["loss"] == pytest.approx(kept["loss"], rel=1e-5)
    assert start["exp_tau"] == pytest.approx(kept["exp_tau"], rel=1e-5)
    assert b["best_val"]["chain_tau"] >= a["best_val"]["chain_tau"]
    assert b["steps"] == a["steps"] >= 20


def test_resume_takes_precedence_and_a_changed_drafter_discards_the_checkpoints(tiny_target, data, scratch,
                                                                               tmp_path, caplog):
    """A run of init_from restarted on its own folder resumes from its checkpoint (the same trace);
    the same settings with a drafter of other content start over from that drafter."""
    _, drafter = scratch
    p = {**P, "init_from": str(drafter)}
    first = train(data["index"], data["vocab"], tiny_target, tmp_path / "train", p)
    again = train(data["index"], data["vocab"], tiny_target, tmp_path / "train", p)
    last_ckpt = (first["steps"] - 1) // 12 * 12  # checkpoint_every 12; none at the last step
    assert first["resumed_from"] == 0 and again["resumed_from"] == last_ckpt >= 12
    assert again["final_val"]["loss"] == pytest.approx(first["final_val"]["loss"], rel=1e-6)
    assert again["init_from"]["val_before_training"] == first["init_from"]["val_before_training"]
    other = _copy(drafter, tmp_path / "other", tensors=lambda t: {**t, "norm.weight": t["norm.weight"] * 1.5})
    third = train(data["index"], data["vocab"], tiny_target, tmp_path / "train", {**p, "init_from": str(other)})
    assert third["resumed_from"] == 0 and third["init_from"]["digest"] == published.digest(other)
    assert third["init_from"]["val_before_training"] != first["init_from"]["val_before_training"]


def _first_drafts(model, d2t, ds, idx):
    """Step-1 draft logits at every position of the samples ``idx`` ([N, V_d]) and the target's token
    there (x_{t+2}: the data is the target's greedy continuation)."""
    out, tgt = [], []
    with torch.no_grad():
        for i in idx:
            s = ds.sample(i)
            x = s["input_ids"][None]
            _, logits, _ = next(model.ttt_unroll(x, model.project(s["aux"][None]), 1))
            out.append(logits[0, :-2])
            tgt.append(x[0, 2:])
    return torch.cat(out), torch.cat(tgt)


def test_another_draft_vocabulary_is_remapped_by_token_id(tiny_target, data, scratch, tmp_path):
    """12 of the exported drafter's 96 draft tokens left out of this run's vocab map, 12 others in:
    before any step, the remapped drafter's logits of every shared token equal the exported drafter's,
    so its greedy first draft among the shared tokens, and its first-draft agreement with the target
    on positions whose target token both vocabularies hold, are unchanged; reading the head by row
    index instead (ignoring d2t) changes them."""
    _, drafter = scratch
    V = tiny_target["vocab_size"]
    old = _draft_ids(data["vocab"])
    extra = [t for t in range(V) if t not in set(old)][-12:]  # the highest ids: every shared row moves up 12
    new = sorted(old[12:] + extra)
    vocab = _vocab(tmp_path / "vocab.safetensors", new, V)
    r = setup(data["index"], vocab, tiny_target, tmp_path / "train",
              resolve_params({**P, "init_from": str(drafter)}), None)
    rec = r.init["vocab"]
    assert rec["map"] == "remapped by token id" and (rec["shared"], rec["new"], rec["dropped"]) == (84, 12, 12)
    exported, _, d2t_a = load_exported(drafter, tiny_target)
    ds = HiddenStateDataset(data["index"])
    idx = [i for i, sid in enumerate(ds.ids) if not is_val(sid, P["val_fraction"])][:8]  # trained on
    la, tgt = _first_drafts(exported, d2t_a, ds, idx)
    lb, _ = _first_drafts(r.drafter.eval(), r.d2t, ds, idx)
    ids_a = (torch.arange(VD) + d2t_a).tolist()
    shared = sorted(set(ids_a) & set(new))
    col_a = torch.tensor([ids_a.index(t) for t in shared])
    col_b = torch.tensor([new.index(t) for t in shared])
    assert torch.allclose(la[:, col_a], lb[:, col_b], atol=1e-5, rtol=0)
    pick_a = torch.tensor(shared)[la[:, col_a].argmax(-1)]
    pick_b = torch.tensor(shared)[lb[:, col_b].argmax(-1)]
    assert torch.equal(pick_a, pick_b)
    on = torch.isin(tgt, torch.tensor(shared))
    agree = float((pick_a[on] == tgt[on]).float().mean())
    assert on.sum() > 50 and agree > 0.2  # a drafter that drafts something on these positions
    # the misread a remap prevents: the head's rows taken by index under this run's d2t
    naive = r.drafter.lm_head.weight.detach().clone()
    with torch.no_grad():
        r.drafter.lm_head.weight.copy_(exported.lm_head.weight)
    ln, _ = _first_drafts(r.drafter, r.d2t, ds, idx)
    with torch.no_grad():
        r.drafter.lm_head.weight.copy_(naive)
    pick_n = torch.tensor(shared)[ln[:, col_b].argmax(-1)]
    assert float((pick_n[on] == tgt[on]).float().mean()) < agree - 0.1


def test_too_small_an_overlap_is_refused_and_a_lower_gate_lets_it_through(tiny_target, data, scratch, tmp_path):
    _, drafter = scratch
    V = tiny_target["vocab_size"]
    old = _draft_ids(data["vocab"])
    vocab = _vocab(tmp_path / "vocab.safetensors", old[:40] + [t for t in range(V) if t not in set(old)][:56], V)
    with pytest.raises(ArtifactError, match=r"holds 40 of this run's 96 draft tokens \(41.7%\), under "
                                            r"train.init_min_overlap 0.5"):
        train(data["index"], vocab, tiny_target, tmp_path / "refused", {**P, "init_from": str(drafter)})
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").rglob("*.parquet"))
    r = setup(data["index"], vocab, tiny_target, tmp_path / "low",
              resolve_params({**P, "init_from": str(drafter), "init_min_overlap": 0.4}), None)
    assert r.init["vocab"]["shared"] == 40 and r.init["vocab"]["overlap"] == pytest.approx(40 / 96)


@pytest.mark.parametrize("case, match", [
    ("hidden_size", r"a drafter for another target: hidden_size 64, this target's hidden size is 128"),
    ("vocab_size", r"a drafter for another target: vocab_size 49153, this target's vocabulary has 49152"),
    ("layer_ids", r"trained on aux layer ids \[1, 3, 6\] \(its config.json\), this run's hidden states are at "
                  r"\[2, 4, 5\]: set extract.layer_ids: \[1, 3, 6\]"),
    ("layers", r"num_hidden_layers 2; eaglet's drafter has one decoder layer"),
    ("variant", r"train.norm_before_residual: the drafter has True, this run False\): set "
                r"train.norm_before_residual: true to continue it"),
    ("missing_tensor", r"tensors missing \['midlayer.mlp.up_proj.weight'\]"),
    ("wrong_shape", r"tensor fc.weight has shape \[128, 383\], its config.json says \[128, 384\]"),
    ("embedding", r"tensor embed_tokens.weight is not this target's embedding"),
    ("d2t", r"d2t maps 1 draft tokens onto a target token taken"),
    ("not_a_drafter", r"not an EAGLE-3 drafter directory as vLLM loads it \(no model.safetensors\)"),
    ("speculators", r"format B \(speculators"),
])
def test_a_drafter_for_another_target_or_a_broken_one_is_refused_before_any_step(tiny_target, data, scratch,
                                                                                tmp_path, case, match):
    _, drafter = scratch
    conf = {"hidden_size": lambda c: {**c, "hidden_size": 64},
            "vocab_size": lambda c: {**c, "vocab_size": c["vocab_size"] + 1},
            "layer_ids": lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
            "layers": lambda c: {**c, "num_hidden_layers": 2},
            "variant": lambda c: {**c, "norm_before_residual": True},
            "speculators": lambda c: {**c, "speculators_model_type": "eagle3"}}.get(case)
    tensors = {"missing_tensor": lambda t: {k: v for k, v in t.items() if k != "midlayer.mlp.up_proj.weight"},
               "wrong_shape": lambda t: {**t, "fc.weight": t["fc.weight"][:, 1:].contiguous()},
               "embedding": lambda t: {**t, "embed_tokens.weight": torch.randn(49152, 128)},
               "d2t": lambda t: {**t, "d2t": torch.cat([t["d2t"][1:2] + 1, t["d2t"][1:]])}}.get(case)  # 0 -> 1's id
    d = _copy(drafter, tmp_path / "d", conf, tensors)
    if case == "not_a_drafter":
        (d / "model.safetensors").unlink()
    out = tmp_path / "train"
    with pytest.raises(ArtifactError, match=match):
        train(data["index"], data["vocab"], tiny_target, out, {**P, "init_from": str(d)})
    assert not (out / "checkpoints").exists() and not (out / "metrics.parquet").exists()  # no step ran


def test_a_peer_drafter_without_layer_ids_is_read_at_vllms_default_and_the_key_is_its_content(tiny_target, data,
                                                                                             scratch, tmp_path):
    """A config.json with no aux layer ids: vLLM taps its default for the target ([2, 4, 5] for 8
    layers, this run's): continued, saying where the ids came from. The workflow's key is the
    directory's content: a copy elsewhere has the same, an edit another, a folder without the
    drafter stops the parse naming the key."""
    _, drafter = scratch

    def strip(c):
        c = {k: v for k, v in c.items() if k != "eagle_aux_hidden_state_layer_ids"}
        c["eagle_config"] = {k: v for k, v in c["eagle_config"].items() if k != "eagle_aux_hidden_state_layer_ids"}
        return c

    d = _copy(drafter, tmp_path / "peer", strip)
    r = setup(data["index"], data["vocab"], tiny_target, tmp_path / "train",
              resolve_params({**P, "init_from": str(d)}), None)
    assert r.init["layer_ids_from"] == "vLLM's default for this target" and r.cfg.layer_ids == [2, 4, 5]
    same = _copy(drafter, tmp_path / "elsewhere")
    assert init_from_key(str(same)) == init_from_key(str(drafter)) != init_from_key(str(d))
    assert init_from_key(None) == {}
    with pytest.raises(ValueError, match=r"train.init_from: .*no config.json or model.safetensors"):
        init_from_key(str(tmp_path / "train"))
