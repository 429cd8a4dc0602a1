"""target: materialisation and identity."""

import pytest

from eaglet.target import default_layer_ids, load_tokenizer, validate_layer_ids


def test_local_checkpoint_is_linked_not_copied(tiny_target, tmp_path):
    """target.path: a local safetensors checkpoint is linked (a 1T target cannot be re-saved),
    and its identity digest equals that of the same weights materialised."""
    from pathlib import Path

    from eaglet.target import load_identity, materialise

    ident = materialise({"name": "linked", "path": tiny_target["path"]}, tmp_path / "t")
    model = Path(load_identity(tmp_path / "t" / "identity.json")["path"])
    weights = model / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (Path(tiny_target["path"]) / "model.safetensors").resolve()
    assert ident["digest"] == tiny_target["digest"] and ident["num_layers"] == tiny_target["num_layers"]
    assert load_tokenizer(model).chat_template


def test_layer_ids_default_and_validation():
    assert default_layer_ids(30) == [2, 15, 27]      # SmolLM2-135M (eagle3.md §5)
    assert default_layer_ids(61) == [2, 30, 58]      # Kimi-K2
    with pytest.raises(ValueError, match="outside"):
        validate_layer_ids([2, 15, 31], 30)
    # id N is the final state: vLLM records aux states only entering layers 0..N-1, never serves it
    with pytest.raises(ValueError, match=r"extract.layer_ids: \[2, 15, 30\] outside \[1, 29\]"):
        validate_layer_ids([2, 15, 30], 30)
    assert validate_layer_ids([2, 15, 29], 30) == [2, 15, 29]
    with pytest.raises(ValueError, match="ascending"):
        validate_layer_ids([15, 2, 27], 30)
