"""The P-EAGLE export (eaglet.export.p_eagle_format) for the tiny target: EAGLE-3's format A plus
mask_hidden, mask_token_id and parallel_drafting, passing every static check; each broken copy (no
mask_hidden, a mis-shaped one, a mask id outside the vocabulary or missing, no parallel flag, layer ids
off by one) is refused by the check that names it."""

import json
import shutil

import pytest
import torch

from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter, save_p_eagle
from eaglet.export.p_eagle_format import export_p_eagle, p_eagle_static_checks, p_eagle_static_problems
from eaglet.target.load import load_target_embedding


def make_p_eagle(identity: dict, path, layer_ids=(2, 4, 5), k: int = 3, seed: int = 0, mask_token_id=None):
    """A random P-EAGLE drafter file (eaglet.drafter.p_eagle.save_p_eagle) for the tiny target, full
    vocabulary; returns (model, cfg)."""
    torch.manual_seed(seed)
    V = int(identity["vocab_size"])
    cfg = PEagleConfig.from_identity(
        identity,
        draft_vocab_size=V,
        layer_ids=list(layer_ids),
        mask_token_id=V - 1 if mask_token_id is None else mask_token_id,
        parallel_k=k,
    )
    m = PEagleDrafter(cfg, load_target_embedding(identity["path"]))
    save_p_eagle(path, m, cfg, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return m, cfg


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("p_eagle_export")
    m, cfg = make_p_eagle(tiny_target, tmp / "drafter.safetensors")
    d = export_p_eagle(tmp / "drafter", load_tensors(tmp / "drafter.safetensors"), cfg, tiny_target)
    return {"dir": d, "cfg": cfg, "model": m, "tmp": tmp}


def test_the_export_is_format_a_plus_the_mask(exported, tiny_target):
    import dataclasses

    d, cfg, m = exported["dir"], exported["cfg"], exported["model"]
    conf = json.loads((d / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["mask_token_id"] == tiny_target["vocab_size"] - 1 and conf["parallel_drafting"] is True
    assert conf["eaglet"]["kind"] == "p_eagle" and conf["eaglet"]["num_speculative_tokens"] == 3
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    t = load_tensors(d / "model.safetensors")
    assert torch.equal(t["mask_hidden"], m.mask_hidden.detach()) and t["mask_hidden"].dtype == torch.float32
    assert "embed_tokens.weight" not in t and "d2t" not in t  # full vocabulary: no d2t (vLLM refuses one)
    checks = p_eagle_static_checks(d, tiny_target, dataclasses.asdict(cfg))
    assert [c["name"] for c in checks] == [
        "static.config_fields",
        "static.key_set",
        "static.shapes_dtypes",
        "static.vocab_map",
        "static.layer_ids",
        "p_eagle.static",
    ]
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


def _broken(src, dst, conf_edit=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if conf_edit:
        conf = json.loads((dst / "config.json").read_text())
        conf_edit(conf)
        (dst / "config.json").write_text(json.dumps(conf))
    if tensor_edit:
        t = load_tensors(dst / "model.safetensors")
        tensor_edit(t)
        save_tensors(dst / "model.safetensors", t, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "name, conf_edit, tensor_edit, check, words",
    [
        ("no_mask_hidden", None, lambda t: t.pop("mask_hidden"), "p_eagle.static", "mask_hidden missing"),
        (
            "short_mask_hidden",
            None,
            lambda t: t.__setitem__("mask_hidden", t["mask_hidden"][:-1].clone()),
            "static.shapes_dtypes",
            "mask_hidden",
        ),
        (
            "mask_id_past_vocab",
            lambda c: c.__setitem__("mask_token_id", c["vocab_size"]),
            None,
            "p_eagle.static",
            "mask_token_id",
        ),
        ("mask_id_missing", lambda c: c.pop("mask_token_id"), None, "p_eagle.static", "mask_token_id None"),
        ("no_parallel_flag", lambda c: c.pop("parallel_drafting"), None, "p_eagle.static", "parallel_drafting"),
        (
            "layer_ids_minus_one",
            lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, 4]),
            None,
            "static.layer_ids",
            "[1, 3, 4]",
        ),
    ],
)
def test_broken_exports_are_refused(exported, tiny_target, name, conf_edit, tensor_edit, check, words):
    import dataclasses

    d = _broken(exported["dir"], exported["tmp"] / name, conf_edit, tensor_edit)
    checks = {c["name"]: c for c in p_eagle_static_checks(d, tiny_target, dataclasses.asdict(exported["cfg"]))}
    assert checks[check]["ok"] is False and words in json.dumps(checks[check]["details"]), checks[check]
    assert any(p.startswith(check) for p in p_eagle_static_problems(d, tiny_target))


def test_an_eagle3_drafter_file_is_not_exported_as_p_eagle(tiny_target, tmp_path):
    from conftest import make_random_drafter

    path = make_random_drafter(tiny_target, tmp_path / "e3.safetensors", draft_vocab_size=tiny_target["vocab_size"])
    with pytest.raises(ValueError, match="without mask_hidden"):
        export_p_eagle(tmp_path / "out", load_tensors(path), {}, tiny_target)
