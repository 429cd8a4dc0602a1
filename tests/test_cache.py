"""The between-workflow output cache as a shared machine sees it: the target keyed on its folder's
content, the user's own checkpoint never re-permissioned, the cache folder closed to other users,
and every stage refusing an artifact altered inside the cache, naming the file."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from conftest import REPO, clone, make_random_drafter
from eaglet import io
from eaglet.target_model import materialise
from workflow_common import planned_jobs


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def smk(cwd: Path, cache: Path, target: str, *opts: str, check=True, configfile: str):
    """Snakemake on one target (placed first: `--cache` and `--forcerun` take the words after
    them as rule names), with a private output cache."""
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", target, *opts, "--cores", "2", "--configfile", configfile, "--cache"]
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
    """A smoke clone run through tokenize (generation off: tokenize reads the prompts) with a
    private cache; the cache now serves target_model, prompts and tokenize to any other clone."""
    root = tmp_path_factory.mktemp("cached")
    cache = root / "cache"
    cache.mkdir()
    a = clone(root / "a")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    conf["generate"]["enabled"] = False
    (a / "config/nogen.yaml").write_text(yaml.safe_dump(conf))
    smk(a, cache, "results/smoke/tokenize/tokens.parquet", configfile="config/nogen.yaml")
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
        rows = io.read_parquet(cached).to_pylist()
        rows[0]["input_ids"] = [1] * len(rows[0]["input_ids"])
        table = io.read_parquet(cached)
        io.write_parquet(cached, pa.Table.from_pylist(rows, schema=table.schema))
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


# --------------------------------------------------------------------------- consumers' checks
def test_vocab_and_drafter_are_checked_against_their_producers_record(tiny_target, tmp_path):
    """train refuses a vocab.safetensors, export and evaluate a drafter.safetensors, whose sha256
    is not the one its producing stage recorded (vocab.json, train_summary.json)."""
    from eaglet import evaluate, export, freq, tokenize, train, vocab

    ident = Path(tiny_target["path"]).parent / "identity.json"
    conv = tmp_path / "conv.parquet"
    io.write_conversations(conv, [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} " * 5}]}
        for i in range(4)])
    tokenize.run(conv, ident, tmp_path / "tok")
    freq.run(tmp_path / "tok" / "tokens.parquet", ident, tmp_path / "freq")
    vocab.run(tmp_path / "freq" / "freq.safetensors", ident, tmp_path / "vocab", draft_vocab_size=64)
    v = tmp_path / "vocab" / "vocab.safetensors"
    flip_last_byte(v)
    with pytest.raises(io.ArtifactError, match=r"vocab\.safetensors: sha256 differs.*vocab\.json"):
        train.main(["--hidden", "none/index.json", "--vocab", str(v), "--target-identity", str(ident),
                    "--out-dir", str(tmp_path / "train")])

    d = make_random_drafter(tiny_target, tmp_path / "train" / "drafter.safetensors")
    io.write_json(d.with_name("train_summary.json"), {io.DIGESTS_KEY: io.record_digests(d.parent, [d.name])})
    flip_last_byte(d)
    with pytest.raises(io.ArtifactError, match=r"drafter\.safetensors: sha256 differs"):
        evaluate.main(["offline", "--drafter", str(d), "--identity", str(ident), "--out-dir", str(tmp_path / "e")])
    with pytest.raises(SystemExit):
        export.main(["--drafter", str(d), "--identity", str(ident), "--out", str(tmp_path / "x"),
                     "--train-summary", str(d.with_name("train_summary.json")), "--log", str(tmp_path / "x.log")])
    assert "drafter.safetensors: sha256 differs" in (tmp_path / "x.log").read_text()
    assert not (tmp_path / "x").exists()


def test_tokens_without_a_record_are_refused(tiny_target, tmp_path):
    from eaglet import freq

    ident = Path(tiny_target["path"]).parent / "identity.json"
    tokens = tmp_path / "tokens.parquet"
    tokens.write_bytes(b"whatever")
    io.write_json(tmp_path / "metadata.json", {"samples_processed": 1})
    with pytest.raises(io.ArtifactError, match=r"tokens\.parquet: no sha256 recorded"):
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

