"""Resume only what is the same: a training checkpoint, extraction's saved chunks and generation's
finished rows are picked up again only when everything that defines them is unchanged; otherwise
they are discarded, with a log line naming each difference (before -> after).

The workflow-level case (layer ids changed after a finished smoke run) is tests/workflow/test_workflow_resume.py.
"""

import json
import logging
import shutil
from importlib import metadata
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from canned_server import make_conversations
from conftest import VLLM_ENV, clone
from eaglet.base.digests import file_digest
from eaglet.base.files import read_json, write_json
from eaglet.base.library_versions import libraries
from eaglet.base.settings_files import setting_changes
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.features.extract import extract
from eaglet.generate.generate import generate, parts_key, resolve_config
from eaglet.generate.parts import prepare_parts
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.hidden.store import ShardWriter
from eaglet.target.capture import REF_PER_BATCH
from eaglet.target.engine_key import ENGINE_KEYS, engine_key
from eaglet.train.train import train
from train_common import LAYERS, PARAMS, hidden_data, write_tokens

DISCARD = "checkpoint of another run, discarding it (not resuming)"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_setting_changes_names_each_difference():
    old = {"a": 1, "b": {"c": [2, 4, 5], "d": "x" * 64}, "gone": True}
    new = {"a": 1, "b": {"c": [1, 3, 6], "d": "y" * 64}, "new": None}
    assert setting_changes(old, new) == [
        "b.c: [2, 4, 5] -> [1, 3, 6]", f'b.d: "{"x" * 64}" -> "{"y" * 64}"', "new: (absent) -> null",
        "gone: true -> (absent)"]
    hexa, hexb = "a" * 64, "b" * 64  # digests are cut to 12 digits
    assert setting_changes({"s": [hexa]}, {"s": [hexb]}) == [f's: ["{hexa[:12]}"] -> ["{hexb[:12]}"]']
    assert setting_changes({"a": 1}, {"a": 1}) == []


# =========================================================================== training checkpoints
P = {**PARAMS, "max_steps": 6, "checkpoint_every": 4, "val_every": 3, "oov_rule": "label"}


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory):
    return hidden_data(tiny_target, tmp_path_factory.mktemp("hidden"))


@pytest.fixture(scope="module")
def finished(tiny_target, data, tmp_path_factory):
    """A finished run: its step-4 checkpoint is kept (a checkpoint is written before the last step)."""
    out = tmp_path_factory.mktemp("run") / "train"
    s = train(data["index"], data["vocab"], tiny_target, out, P)
    assert s["resumed_from"] == 0 and [f.name for f in (out / "checkpoints").iterdir()] == ["step_00000004.pt"]
    return out, pd.read_parquet(out / "metrics.parquet")


def _rerun(tiny_target, data, finished, tmp_path, params, caplog, index=None):
    """The finished run's folder (its checkpoint) trained again with ``params``; (summary, log)."""
    out = tmp_path / "train"
    shutil.copytree(finished[0] / "checkpoints", out / "checkpoints")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eaglet"):
        s = train(index or data["index"], data["vocab"], tiny_target, out, params)
    return s, caplog.text


def _same_trace(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.step) == list(b.step) and list(a.split) == list(b.split)
    for col in ["loss", "loss_0", "tf_acc_1", "lr", "grad_norm"]:
        assert (a[col] - b[col]).abs().max() <= 1e-6 * max(1.0, a[col].abs().max()), col


def test_unchanged_run_resumes_its_checkpoint(tiny_target, data, finished, tmp_path, caplog):
    """The positive control: same data, vocab, target and settings: resumed, same trace. Settings
    that do not change the result (checkpoint_every, keep_checkpoints, the label check's gate) do
    not stop the resume."""
    params = {**P, "checkpoint_every": 5, "keep_checkpoints": 3, "accept_unchecked_labels": True}
    s, text = _rerun(tiny_target, data, finished, tmp_path, params, caplog)
    assert s["resumed_from"] == 4 and "resuming from" in text and DISCARD not in text
    _same_trace(finished[1], pd.read_parquet(tmp_path / "train" / "metrics.parquet"))


@pytest.mark.parametrize(("change", "line"), [
    ({"lr": 1e-3}, "params.lr: 0.003 -> 0.001"),
    # a longer run is another run: the cosine schedule spans the total steps
    ({"max_steps": 8}, "params.max_steps: 6 -> 8"),
    ({"val_every": 2}, "params.val_every: 3 -> 2"),
])
def test_changed_train_setting_discards_the_checkpoint(tiny_target, data, finished, tmp_path, caplog, change, line):
    s, text = _rerun(tiny_target, data, finished, tmp_path, {**P, **change}, caplog)
    assert s["resumed_from"] == 0 and "resuming from" not in text
    assert f"step_00000004.pt: {DISCARD}: {line}" in text, text


def test_other_layers_in_the_store_discard_the_checkpoint(tiny_target, data, finished, tmp_path, caplog):
    """The issue's case at the trainer: the store now holds other aux layers (re-extracted), all else
    equal. The same chunk bytes under an index that says layers [1, 3, 6] stand in for it."""
    store = tmp_path / "store" / "shard_0"
    shutil.copytree(Path(data["index"][0]).parent, store)
    idx = read_json(store / "index.json")
    write_json(store / "index.json", {**idx, "layer_ids": [1, 3, 6]})
    s, text = _rerun(tiny_target, data, finished, tmp_path, P, caplog, index=[str(store / "index.json")])
    assert s["resumed_from"] == 0 and "resuming from" not in text and s["layer_ids"] == [1, 3, 6]
    assert f"{DISCARD}: layer_ids: {LAYERS} -> [1, 3, 6]" in text, text
    assert "hidden_states.stores: [" in text  # the store's index digest differs too


def test_other_vocab_discards_the_checkpoint(tiny_target, data, finished, tmp_path, caplog):
    vocab = tmp_path / "vocab" / "vocab.safetensors"
    vocab.parent.mkdir()
    t = load_tensors(data["vocab"])
    used = t["t2d"].nonzero().squeeze(1)
    free = int((~t["t2d"]).nonzero()[0])  # swap the last draft token for the first unused one
    used = torch.cat([used[:-1], torch.tensor([free])]).sort().values
    t2d = torch.zeros_like(t["t2d"])
    t2d[used] = True
    save_tensors(vocab, {"d2t": used - torch.arange(len(used)), "t2d": t2d})
    out = tmp_path / "train"
    shutil.copytree(finished[0] / "checkpoints", out / "checkpoints")
    with caplog.at_level(logging.INFO, logger="eaglet"):
        s = train(data["index"], str(vocab), tiny_target, out, P)
    assert s["resumed_from"] == 0 and f"{DISCARD}: vocab: " in caplog.text, caplog.text


def test_checkpoint_without_an_identity_is_discarded(tiny_target, data, finished, tmp_path, caplog):
    """Written by an older eaglet (no recorded identity): not trusted."""
    ckpt = tmp_path / "train" / "checkpoints" / "step_00000004.pt"
    ckpt.parent.mkdir(parents=True)
    state = torch.load(finished[0] / "checkpoints" / ckpt.name, weights_only=True)
    del state["identity"]
    torch.save(state, ckpt)
    with caplog.at_level(logging.INFO, logger="eaglet"):
        s = train(data["index"], data["vocab"], tiny_target, tmp_path / "train", P)
    assert s["resumed_from"] == 0
    assert f"{ckpt}: {DISCARD}: it records no identity of its run (written by an older eaglet)" in caplog.text
    _same_trace(finished[1], pd.read_parquet(tmp_path / "train" / "metrics.parquet"))


# =========================================================================== extraction's saved chunks
H = 16


def _samples(n=8):
    g = torch.Generator().manual_seed(0)
    return [(f"s{i}", torch.randint(0, 99, (6 + i,), generator=g), torch.ones(6 + i, dtype=torch.int8),
             torch.randn(6 + i, 3, H, generator=g), torch.randn(6 + i, H, generator=g),
             torch.randn(6 + i, generator=g), torch.randint(0, 99, (6 + i,), generator=g)) for i in range(n)]


def _partial(path, samples, layers=(1, 2, 3), chunk=1500, settings=None, **kw):
    w = ShardWriter(path, 0, 1, list(layers), True, "float32", H, "digest", chunk, final_layer=4,
                    source_digest="tokens", settings=settings, **kw)
    for s in samples:
        w.add(*s)
    w.close()  # as a kill leaves it: the saved chunks and progress.json
    assert len(read_json(path / "progress.json")["chunks"]) >= 2


SETTINGS = {"token_budget": 96, "target_dtype": "float32"}


@pytest.mark.parametrize(("change", "line"), [
    ({}, None),  # unchanged: resumed
    ({"settings": {**SETTINGS, "token_budget": 48}}, "settings.token_budget: 96 -> 48"),
    ({"settings": {**SETTINGS, "target_dtype": "bfloat16"}}, 'settings.target_dtype: "float32" -> "bfloat16"'),
    ({"chunk": 3000}, "chunk_bytes: 1500 -> 3000"),
    ({"layers": (1, 2, 4)}, "layer_ids: [1, 2, 3] -> [1, 2, 4]"),
])
def test_shard_writer_resumes_only_the_same_shard(tmp_path, caplog, change, line):
    samples = _samples()
    _partial(tmp_path / "s", samples, settings=SETTINGS)
    kept = read_json(tmp_path / "s" / "progress.json")
    args = {"layers": (1, 2, 3), "chunk": 1500, "settings": SETTINGS, **change}
    with caplog.at_level(logging.INFO, logger="eaglet"):
        w = ShardWriter(tmp_path / "s", 0, 1, list(args["layers"]), True, "float32", H, "digest", args["chunk"],
                        final_layer=4, source_digest="tokens", settings=args["settings"])
    if line is None:
        assert w.done_ids == {s["id"] for s in kept["samples"]} and "resuming after" in caplog.text
        assert "written with other settings" not in caplog.text
    else:
        assert w.done_ids == set() and not list((tmp_path / "s").glob("chunk_*"))
        assert f"written with other settings ({line}); discarding its {len(kept['chunks'])} chunks" in caplog.text
    w.close()


def test_progress_of_an_older_writer_is_discarded(tmp_path, caplog):
    """progress.json from before the chunk size and settings were recorded: not trusted."""
    _partial(tmp_path / "s", _samples())
    prog = read_json(tmp_path / "s" / "progress.json")
    write_json(tmp_path / "s" / "progress.json",
               {k: v for k, v in prog.items() if k not in ("chunk_bytes", "settings")})
    with caplog.at_level(logging.INFO, logger="eaglet"):
        w = ShardWriter(tmp_path / "s", 0, 1, [1, 2, 3], True, "float32", H, "digest", 1500, final_layer=4,
                        source_digest="tokens")
    assert w.done_ids == set() and "chunk_bytes: (absent) -> 1500; settings: (absent) -> {}" in caplog.text
    w.close()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokens.parquet"
    return path, write_tokens(path, 6, seed=4, lo=5, hi=12)


def _extract_partial(tiny_target, tokens, work, token_budget=96, layers=(2, 4, 5)):
    """What a killed ``extract(..., token_budget, chunk_mb=0.001)`` on the CPU leaves in its work
    folder: the first samples' chunks (random states: a resume that keeps them shows in the result)."""
    rows = tokens[1]
    settings = {"token_budget": token_budget, "reference_per_batch": REF_PER_BATCH, "target_dtype": "float32",
                "target_device": "cpu", "trust_remote_code": False}
    w = ShardWriter(work, 0, 1, list(layers), True, "float32", tiny_target["hidden_size"], tiny_target["digest"],
                    int(0.001 * (1 << 20)), final_layer=tiny_target["num_layers"],
                    source_digest=file_digest(tokens[0]), settings=settings)
    g = torch.Generator().manual_seed(1)
    for r in rows[:3]:
        T = len(r["input_ids"])
        w.add(r["id"], r["input_ids"], r["loss_mask"], torch.randn(T, 3, tiny_target["hidden_size"], generator=g),
              torch.randn(T, tiny_target["hidden_size"], generator=g), torch.randn(T, generator=g),
              torch.randint(0, tiny_target["vocab_size"], (T,), generator=g))
    w.close()
    return {r["id"] for r in rows[:3]} & {s["id"] for s in read_json(work / "progress.json")["samples"]}


@pytest.mark.parametrize(("change", "line"), [
    ({}, None),
    ({"token_budget": 48}, "settings.token_budget: 96 -> 48"),
    ({"layer_ids": [1, 3, 6]}, "layer_ids: [2, 4, 5] -> [1, 3, 6]"),
])
def test_extract_resumes_only_the_same_partial_shard(tiny_target, tokens, tmp_path, caplog, change, line):
    """eaglet.features.extract records what changes its bytes (token budget, the target forward's dtype and
    device) beside the writer's own fields: a .partial folder of other settings is redone whole."""
    ident = Path(tiny_target["path"]).parent / "identity.json"
    work = tmp_path / "shard_0.partial"
    saved = _extract_partial(tiny_target, tokens, work)
    assert saved
    kw = {"token_budget": 96, "layer_ids": None, **change}
    with caplog.at_level(logging.INFO, logger="eaglet"):
        extract(tokens[0], ident, tmp_path / "shard_0", work_dir=work, dtype="float32", chunk_mb=0.001,
                progress=False, device="cpu", **kw)
    ds = HiddenStateDataset([tmp_path / "shard_0"])
    extract(tokens[0], ident, tmp_path / "clean", dtype="float32", chunk_mb=0.001, progress=False, device="cpu", **kw)
    clean = HiddenStateDataset([tmp_path / "clean"])
    pos = {sid: i for i, sid in enumerate(clean.ids)}
    # other batch mates may move the last float bit; the saved states are random
    same = {sid for i, sid in enumerate(ds.ids)
            if torch.allclose(ds.sample(i)["aux"], clean.sample(pos[sid])["aux"], atol=1e-5, rtol=1e-5)}
    if line is None:  # resumed: the saved (random) states were kept, the rest computed
        assert "resuming after" in caplog.text and "written with other settings" not in caplog.text
        assert same == set(ds.ids) - saved
    else:
        assert f"written with other settings ({line}); discarding" in caplog.text, caplog.text
        assert same == set(ds.ids)  # every sample computed anew


# =========================================================================== generation's finished rows
def test_parts_key_holds_what_defines_a_row(tiny_target):
    cfg = resolve_config({"backend": "openai", "base_urls": ["http://a/v1"], "model": "m"})
    base = parts_key(cfg, tiny_target, None)
    # the engine: backend and model asked for (the servers are only where it is asked)
    assert engine_key(cfg) == {"backend": "openai", "settings": {"model": "m"},
                               # the prompt limit renders and counts the prompts here
                               "libraries": {n: metadata.version(n) for n in ("jinja2", "tokenizers", "transformers")}}
    same = {**cfg, "base_urls": ["http://b/v1"], "concurrency": 99, "timeout_s": 1}
    assert parts_key(same, tiny_target, None) == base
    assert parts_key({**cfg, "model": "other"}, tiny_target, None) != base
    for k, v in [("temperature", 0.7), ("top_p", 0.9), ("max_tokens", 5), ("seed", 1), ("turns", "all"),
                 ("chat_template_kwargs", {"enable_thinking": False}), ("backend", "local")]:
        assert parts_key({**cfg, k: v}, tiny_target, None) != base, k
    assert parts_key(cfg, tiny_target, "{{ messages }}") != base
    assert parts_key(cfg, {**tiny_target, "digest": "0" * 64}, None) != base
    vl = resolve_config({"backend": "vllm"})
    vkey = parts_key(vl, tiny_target, None)
    assert parts_key({**vl, "vllm": {**vl["vllm"], "dtype": "bfloat16"}}, tiny_target, None) != vkey
    assert parts_key({**vl, "vllm": {**vl["vllm"], "kv_cache_gb": 9}}, tiny_target, None) == vkey


def _other(value):
    """Another value of a setting's kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return [*value, "--other"]
    return f"{value}-other" if value is not None else "other"


@pytest.mark.parametrize(("backend", "key"), [(b, k) for b, keys in ENGINE_KEYS.items() for k in keys])
def test_a_row_made_under_another_engine_setting_is_made_anew(tiny_target, tmp_path, caplog, backend, key):
    """Every setting of the one definition of what defines the text (eaglet.target.engine_key, which
    the workflow's cache key reads too): rows written under another value are discarded, naming it."""
    cfg = resolve_config({"backend": backend, "model": "m"})
    *parents, leaf = key.split(".")
    other = json.loads(json.dumps(cfg))
    d = other
    for p in parents:
        d = d[p]
    d[leaf] = _other(d[leaf])
    parts = prepare_parts(tmp_path, parts_key(cfg, tiny_target, None))
    (parts / "part_000000.parquet").write_bytes(b"x")
    assert prepare_parts(tmp_path, parts_key(cfg, tiny_target, None)) == parts
    assert (parts / "part_000000.parquet").exists()  # the same settings: kept
    with caplog.at_level(logging.WARNING, logger="eaglet"):
        prepare_parts(tmp_path, parts_key(other, tiny_target, None))
    assert not (parts / "part_000000.parquet").exists()
    assert f"engine.settings.{key}: " in caplog.text and "discarding 1 part files" in caplog.text, caplog.text


@pytest.mark.parametrize("backend", sorted(ENGINE_KEYS))
def test_the_cache_key_and_the_resumed_rows_hold_one_engine_definition(tmp_path, monkeypatch, backend):
    """The generate and generate_eval jobs' params, as Snakemake expands them for the cache key, hold
    exactly the engine key the stage computes for its resumed rows from the settings file it is
    handed: one definition (eaglet.target.engine_key), each of its settings one param."""
    from dag_preview import job_params
    from eaglet.workflow.params import key_params

    wf = clone(tmp_path / "wf")
    conf = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    conf["generate"] |= {"backend": backend, **({"base_urls": ["http://127.0.0.1:9/v1"], "model": "m"}
                                                 if backend == "openai" else {})}
    (wf / "config/b.yaml").write_text(yaml.safe_dump(conf))
    monkeypatch.setenv("EAGLET_PREVIEW_SETTINGS", str(tmp_path / "preview"))
    if VLLM_ENV.is_dir():  # vLLM's version is read from the venv the jobs would serve with
        (wf / "envs/vllm/.venv").symlink_to(VLLM_ENV)
    jobs = job_params(wf, wf / "config/b.yaml", tmp_path / "cache", ["generate", "generate_eval"])
    monkeypatch.chdir(wf)  # where the jobs run
    for rule, params in jobs.items():
        handed = json.loads((tmp_path / f"preview/logs/smoke/config/{rule}.json").read_text())
        want = {name: value(None) for name, value in key_params("engine", engine_key(resolve_config(handed))).items()}
        assert {k: v for k, v in params.items() if k.startswith("engine_")} == want, rule
        assert len(want) == 1 + len(ENGINE_KEYS[backend]) + len(libraries("generate", backend))
        if backend == "vllm" and VLLM_ENV.is_dir():
            assert params["engine_libraries_vllm"].startswith('libraries.vllm="vllm'), params


def test_prepare_parts_discards_other_settings_naming_them(tmp_path, caplog):
    parts = prepare_parts(tmp_path, {"temperature": 0.0, "engine": {"backend": "local"}})
    (parts / "part_000000.parquet").write_bytes(b"x")
    assert prepare_parts(tmp_path, {"temperature": 0.0, "engine": {"backend": "local"}}) == parts
    assert (parts / "part_000000.parquet").exists()  # same key: kept
    with caplog.at_level(logging.WARNING, logger="eaglet"):
        prepare_parts(tmp_path, {"temperature": 0.5, "engine": {"backend": "vllm"}})
    assert not (parts / "part_000000.parquet").exists()
    assert 'temperature: 0.0 -> 0.5; engine.backend: "local" -> "vllm"); discarding 1 part files' in caplog.text
    # parts with no manifest (an older eaglet's, or an edited folder): not trusted
    (parts / "manifest.json").unlink()
    (parts / "part_000001.parquet").write_bytes(b"x")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eaglet"):
        prepare_parts(tmp_path, {"temperature": 0.5})
    assert not (parts / "part_000001.parquet").exists() and "no manifest.json records" in caplog.text


def test_generate_redoes_rows_of_another_engine_and_resumes_its_own(tiny_target, tmp_path, caplog):
    """The local backend: a rerun as is generates nothing; another batch size (the padding changes
    the arithmetic) or another chat template discards the rows, naming the difference."""
    ident = Path(tiny_target["path"]).parent / "identity.json"
    make_conversations(tmp_path / "in.parquet", 3, multi_every=0)
    cfg = {"backend": "local", "max_tokens": 3, "chunk_size": 1, "concurrency": 2}
    generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eaglet"):
        s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", cfg)
    assert s["this_run"]["skipped"] == 3 and "discarding" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eaglet"):
        s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", {**cfg, "concurrency": 3})
    assert s["this_run"]["skipped"] == 0 and s["this_run"]["success"] == 3
    assert "engine.settings.concurrency: 2 -> 3); discarding 3 part files" in caplog.text, caplog.text
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eaglet"):
        s = generate(tmp_path / "in.parquet", ident, tmp_path / "out", {**cfg, "concurrency": 3},
                     chat_template=str(template))
    # all three made anew (the random tiny target may answer one with nothing: a failure, still made)
    assert s["this_run"]["success"] + s["this_run"]["error"] == 3 and s["this_run"]["skipped"] == 0
    assert "chat_template: null -> " in caplog.text, caplog.text
    assert json.loads((tmp_path / "out" / "parts" / "manifest.json").read_text())["chat_template"]
