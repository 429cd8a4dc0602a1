"""token_freq and vocab_map: counts over assistant tokens only, d2t/t2d per docs/eagle3.md §4,
pinned tokens, padding, coverage."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import write_parquet
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.data import freq, vocab
from eaglet.target.load import load_identity, load_tokenizer


def tokens_table(rows):
    return pa.table({
        "id": [f"s{i}" for i in range(len(rows))],
        "source": [r[2] for r in rows],
        "input_ids": pa.array([r[0] for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([r[1] for r in rows], pa.list_(pa.int8())),
        "num_tokens": [len(r[0]) for r in rows],
    })


def test_counts_only_loss_masked_tokens_per_source():
    t = tokens_table([([5, 6, 7, 7], [0, 1, 1, 1], "a"), ([7, 9], [1, 0], "b")])
    c = freq.count_tokens(t, 10)
    assert c["counts"].tolist() == [0, 0, 0, 0, 0, 0, 1, 3, 0, 0]
    assert c["counts/a"][7] == 2 and c["counts/b"][7] == 1 and c["counts/b"][9] == 0
    with pytest.raises(ArtifactError, match="outside"):
        freq.count_tokens(tokens_table([([12], [1], "a")]), 10)


def test_mapping_matches_the_eagle3_convention():
    counts = np.array([0, 50, 3, 0, 40, 7, 0, 9, 1, 0], dtype=np.int64)
    used = vocab.build_mapping(counts, 4, pins={})
    assert used.tolist() == [1, 4, 5, 7]                     # top-4 by count, ascending
    d2t, t2d = vocab.mapping_tensors(used, 10)
    assert d2t.dtype == np.int64 and (np.arange(4) + d2t).tolist() == used.tolist()
    assert np.flatnonzero(t2d).tolist() == used.tolist()


def test_pins_are_kept_and_padding_uses_unused_low_ids():
    counts = np.array([0, 0, 5, 0, 9, 0, 0, 0], dtype=np.int64)
    used = vocab.build_mapping(counts, 5, pins={6: "special"})
    # 2 counted ids + 1 pinned; 2 more needed: the lowest unused ids 0 and 1.
    assert used.tolist() == [0, 1, 2, 4, 6]
    # A pin displaces the least frequent token, never a more frequent one.
    used = vocab.build_mapping(np.array([1, 9, 8, 7, 0], dtype=np.int64), 3, pins={4: "special"})
    assert used.tolist() == [1, 2, 4]
    with pytest.raises(ValueError, match="pinned"):
        vocab.build_mapping(counts, 1, pins={1: "a", 2: "b"})
    with pytest.raises(ValueError, match="exceeds"):
        vocab.build_mapping(counts, 9, pins={})


def test_pinned_ids_cover_special_and_template_markers(tiny_target):
    tok = load_tokenizer(tiny_target["path"])
    pins = vocab.pinned_ids(tok, pin_special=True, extra=["<|im_end|>", "Zebra"])
    names = {tok.convert_ids_to_tokens(i) for i in pins}
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= names
    assert "Zebra" in tok.decode([i for i, why in pins.items() if why == "config:Zebra"])
    # The default system prompt's words are content, not scaffolding.
    assert "Hugging" not in tok.decode(list(pins))
    # SmolLM2's template reads no reasoning and has no think tokens: no reasoning frame is pinned.
    assert "reasoning" not in pins.values()


# The tokens each family's template frames the latest turn's reasoning with.
FRAME = {"qwen3": ["<think>", "</think>"],
         "gpt_oss": ["<|start|>", "<|channel|>", "analysis", "<|message|>", "<|end|>", "final"],
         "deepseek_v3": ["<think>", "</think>"]}  # reads no field: its own think tokens wrap it


@pytest.mark.parametrize("family", sorted(FRAME))
def test_the_reasoning_frame_is_pinned_even_unseen(family, tiny_family, tmp_path):
    """The frame the template writes around reasoning is in the draft vocabulary though the data
    never has it: every other id is more frequent, and the frame's own count is zero."""
    ident = tiny_family(family)
    tok = load_tokenizer(load_identity(ident)["path"])
    frame = tok.convert_tokens_to_ids(FRAME[family])
    V = len(tok)
    counts = np.arange(V, 0, -1, dtype=np.int64)
    counts[frame] = 0
    save_tensors(tmp_path / "freq.safetensors", {"counts": torch.from_numpy(counts)})
    s = vocab.run(tmp_path / "freq.safetensors", ident, tmp_path / "vocab", draft_vocab_size=256)
    pinned = {p["token"]: p for p in s["pinned"]}
    for t in FRAME[family]:
        assert t in pinned and pinned[t]["count"] == 0 and not pinned[t]["would_be_in_without_pin"], t
    # Qwen3's last turn always has a think block: its markers are template scaffolding already.
    assert pinned["analysis" if family == "gpt_oss" else "</think>"]["why"] == ("template" if family == "qwen3"
                                                                                else "reasoning")
    assert s["reasoning"]["field"] == {"qwen3": "reasoning_content", "gpt_oss": "thinking"}.get(family)
    d2t = load_tensors(tmp_path / "vocab" / "vocab.safetensors")["d2t"].numpy()
    assert set(frame) <= set((np.arange(256) + d2t).tolist())


def test_run_end_to_end_reports_coverage(tiny_target, tmp_path):
    from pathlib import Path

    ident = Path(tiny_target["path"]).parent / "identity.json"
    V = tiny_target["vocab_size"]
    rng = np.random.default_rng(0)
    rows = [(rng.zipf(1.5, 200).clip(3, V - 1).astype(int).tolist(), [1] * 200, "zipf") for _ in range(5)]
    write_parquet(tmp_path / "tokens.parquet", tokens_table(rows))
    freq.run(tmp_path / "tokens.parquet", ident, tmp_path / "freq")
    s = vocab.run(tmp_path / "freq" / "freq.safetensors", ident, tmp_path / "vocab", draft_vocab_size=64)
    m = load_tensors(tmp_path / "vocab" / "vocab.safetensors")
    d2t, t2d = m["d2t"].numpy(), m["t2d"].numpy()
    assert d2t.shape == (64,) and t2d.shape == (V,) and t2d.dtype == bool
    assert np.array_equal(np.flatnonzero(t2d), np.arange(64) + d2t)
    counts = load_tensors(tmp_path / "freq" / "freq.safetensors")["counts"].numpy()
    assert s["coverage"] == pytest.approx(counts[t2d].sum() / counts.sum())
    assert s["coverage_by_source"]["zipf"] == pytest.approx(s["coverage"])
    assert any(p["token"] == "<|im_end|>" for p in s["pinned"])
    curve = [p["coverage"] for p in s["coverage_curve"]]
    assert curve == sorted(curve) and curve[-1] == pytest.approx(1.0)

