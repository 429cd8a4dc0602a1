"""A target named by its hub id (issue 45): ``target.path: org/tiny`` read through huggingface_hub's
own cache, offline. The tiny random Llama (SmolLM2's tokenizer) is laid out in a real hub cache
folder, the cache's own layout (``models--org--tiny/{blobs,refs,snapshots/<commit>}``, snapshot
files linked to blobs named by their content hash), checked with ``huggingface_hub.scan_cache_dir``;
HF_HUB_CACHE points at it and HF_HUB_OFFLINE=1. The workflow plans the run by the id, target_model
reads the snapshot in place and records the commit, the cache key is the commit's content (another
revision: another key; another ref naming the same commit: the same key), and a model missing from
the cache stops the parse with one message naming the repo, the revision, the cache and the command
that fills it, before any job."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import clone
from dag_preview import cache_keys, job_params, preview
from eaglet.data.target_model import materialise
from eaglet.target import hub
from workflow_common import planned_jobs, smk

REPO_ID = "org/tiny"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def blob_name(f: Path) -> str:
    """The name the hub cache stores a file's blob under: the sha256 of an LFS file (weights), the
    git blob id (sha1 of ``blob <size>\\0`` + content) of any other."""
    data = f.read_bytes()
    if f.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_revision(cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """Put ``model_dir``'s files in the hub cache ``cache`` as commit ``commit`` of ``repo_id``, named
    by ``refs``, the way huggingface_hub's downloads leave them: each file once as a blob named by its
    hash, the snapshot a folder of relative links to the blobs, each ref a file holding the commit.
    (huggingface_hub writes a cache entry only while downloading: no public function lays one out
    offline, so the layout is written here and checked with its scan_cache_dir.)"""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        blob = repo / "blobs" / blob_name(f)
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the file whole
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tiny_target, tmp_path_factory):
    """A hub cache holding org/tiny: commit A (the tiny target; refs main and alias) and commit B
    (the same model with other weights, seed 1; ref v2)."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hub"
    add_revision(cache, REPO_ID, Path(tiny_target["path"]), COMMIT_A, ("main", "alias"))
    other = root / "other"
    materialise({"name": "other", "tiny": {"seed": 1}}, other)
    add_revision(cache, REPO_ID, other / "model", COMMIT_B, ("v2",))
    return cache


@pytest.fixture()
def offline_hub(hub_cache, monkeypatch):
    """HF_HUB_CACHE at the test cache, HF_HUB_OFFLINE=1 (this process and the Snakemake ones)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HOME", raising=False)
    return hub_cache


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """A clone of the workflow whose smoke config names the target by its hub id, and a private
    output cache."""
    root = tmp_path_factory.mktemp("hubwf")
    wf = clone(root / "wf")
    out_cache = root / "cache"
    out_cache.mkdir()
    return wf, out_cache


def hub_config(wf: Path, name: str, **target) -> str:
    conf = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    # target.tiny removed; hub_id null over config.yaml's (SmolLM2's): the card names the repo id
    conf["target"] = {"name": "hub-tiny", "path": REPO_ID, "hub_id": None, **target}
    (wf / "config" / name).write_text(yaml.safe_dump(conf))
    return f"config/{name}"


def test_the_layout_is_the_hub_cache_s_own(offline_hub):
    """huggingface_hub's own scan lists the repo with both commits and their refs; snapshot_download
    (offline) finds each ref's commit."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(offline_hub)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO_ID and repo.repo_type == "model"
    revs = {r.commit_hash: set(r.refs) for r in repo.revisions}
    assert revs == {COMMIT_A: {"main", "alias"}, COMMIT_B: {"v2"}}
    a, alias, b, by_commit = (hub.resolve(REPO_ID, r) for r in ("main", "alias", "v2", COMMIT_A))
    assert a.commit == alias.commit == by_commit.commit == COMMIT_A and b.commit == COMMIT_B
    assert a.folder == offline_hub / "models--org--tiny" / "snapshots" / COMMIT_A
    # the key is the content: the same commit under any name, another commit another key
    assert a.key() == alias.key() == by_commit.key() != b.key()
    assert {"config.json", "model.safetensors"} <= {name for name, _, _ in a.files}


def test_dry_run_plans_the_run_by_the_hub_id(offline_hub, workflow):
    """`snakemake -n` with `target.path: org/tiny` (no target.tiny) resolves main to its commit in the
    offline cache, reads the snapshot's config.json and plans the whole run."""
    wf, out_cache = workflow
    code, out = smk(wf, out_cache, "-n", configfile=hub_config(wf, "hub.yaml"))
    assert code == 0
    assert f"target {REPO_ID} revision 'main': commit {COMMIT_A} in the hub cache {offline_hub}" in out, out[-3000:]
    assert {"target_model", "train", "export"} <= planned_jobs(out), out[-3000:]
    assert "aux layer ids: [2, 4, 5]" in out  # read from the snapshot's config.json at parse time


def test_target_model_reads_the_snapshot_and_records_the_commit(offline_hub, workflow, tiny_target):
    """target_model reads the cache's snapshot in place and records the repo and the commit in
    identity.json; another revision reruns it, another ref to the same commit does not."""
    wf, out_cache = workflow
    smk(wf, out_cache, "resources/targets/hub-tiny/identity.json", configfile=hub_config(wf, "hub.yaml"))
    ident = json.loads((wf / "resources/targets/hub-tiny/identity.json").read_text())
    snapshot = offline_hub / "models--org--tiny" / "snapshots" / COMMIT_A
    assert ident["hub"] == {"repo_id": REPO_ID, "revision": COMMIT_A, "commit": COMMIT_A,
                            "folder": str(snapshot), "cache": str(offline_hub)}
    assert ident["path"] == str(snapshot) and ident["source"] == f"hub:{REPO_ID}@{COMMIT_A}"
    assert ident["digest"] == tiny_target["digest"]  # the same weights as the local tiny target
    # read in place: the run holds no link into the hub cache, the cache is left as it was
    links = [p for p in (wf / "resources").rglob("*") if p.is_symlink()
             and Path(os.path.realpath(p)).is_relative_to(offline_hub)]
    assert not links, links
    # another revision with other weights: target_model runs again, its params naming the commit
    jobs = preview(wf, wf / hub_config(wf, "v2.yaml", revision="v2"), out_cache)
    assert "target_model" in jobs and "Params have changed" in jobs["target_model"], jobs
    # another ref naming the same commit: nothing to redo
    assert "target_model" not in preview(wf, wf / hub_config(wf, "alias.yaml", revision="alias"), out_cache)


def test_the_cache_key_is_the_commit_s_content_not_its_name(offline_hub, workflow):
    """target_model's output-cache key is the same for main, another ref and the commit hash that
    name one commit, and another for a revision with other weights; the card names the repo id."""
    wf, out_cache = workflow
    keys = {rev: cache_keys(wf, wf / hub_config(wf, f"k-{rev}.yaml", revision=rev), out_cache,
                            ["target_model"])["target_model"]["key"]
            for rev in ("main", "alias", COMMIT_A, "v2")}
    assert keys["main"] == keys["alias"] == keys[COMMIT_A] != keys["v2"], keys
    card = job_params(wf, wf / "config/k-main.yaml", out_cache, ["drafter_card"])["drafter_card"]
    assert card["card_base_model"] == f'base_model="{REPO_ID}"', card


def test_a_model_missing_from_the_cache_offline_stops_the_parse(offline_hub, workflow):
    """A repo id missing from the cache offline stops `snakemake -n` before any job, naming the repo,
    the revision, the cache folder and the command that fills it."""
    wf, out_cache = workflow
    code, out = smk(wf, out_cache, "-n", check=False, configfile=hub_config(wf, "absent.yaml", path="org/absent",
                                                                             revision="v1"))
    assert code != 0
    for part in ("target.path 'org/absent'", "revision 'v1'", f"hub cache {offline_hub}",
                 "HF_HUB_OFFLINE=0 hf download org/absent --revision v1"):
        assert part in out, (part, out[-3000:])
    assert not planned_jobs(out) and "Traceback" not in out, out[-3000:]
