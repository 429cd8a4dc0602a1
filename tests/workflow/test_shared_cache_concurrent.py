"""Two clones sharing one output cache, run at the same moment (issue 46): both finish, the
artifacts the cache stores are byte-identical between them, every cache entry reads back intact
against the checksums the workflow records, and the cache holds exactly one entry per cached
output (no stage's work stored twice, nothing half-stored or left behind)."""

import json
import os
import subprocess
from pathlib import Path

import yaml

from conftest import clone, job_path, snakemake_cmd
from eaglet.base.digests import DIGESTS_KEY, verify_recorded, visible_files
from eaglet.hidden.reader import HiddenStateDataset
from eaglet.target.load import load_identity
from eaglet.workflow import shared_cache

# Through extraction (generation off: tokenize reads the prompts): every cached rule of the data
# path, file and folder outputs both (target_model's model folder, the extraction shard).
TARGETS = ("results/smoke/extract/shard_0", "results/smoke/vocab_map/vocab.json")


def cached_outputs(wf: Path, cache: Path) -> dict[Path, Path]:
    """``{output path in the clone: the cache entry it is served from}``: a file output or a stored
    folder output is a link to its entry; a restored folder output is a folder of links into it."""
    out = {}
    for top in ("results", "resources"):
        for root, dirs, files in os.walk(wf / top):
            for name in dirs + files:
                p = Path(root) / name
                if not p.is_symlink():
                    continue
                real = Path(os.path.realpath(p))
                if not real.is_relative_to(cache):
                    continue
                inside = real.relative_to(cache).parts
                entry = cache / inside[0]
                output = p.relative_to(wf)
                for _ in inside[1:]:  # a link to a file inside a folder entry: the folder is the output
                    output = output.parent
                assert out.setdefault(output, entry) == entry, (output, out[output], entry)
    return out


def contents(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
                if f.is_file() and not f.name.startswith(".")}
    return {"": path.read_bytes()}


def test_two_clones_at_the_same_moment_share_one_cache(tmp_path):
    """Two clones run through extraction on one cache at the same moment: both finish, with the same
    bytes, every entry intact and stored once (eaglet.workflow.shared_cache)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    clones = [clone(tmp_path / name) for name in ("a", "b")]
    conf = yaml.safe_load((clones[0] / "config/smoke.yaml").read_text())
    conf["generate"]["enabled"] = False
    conf["prompts"] |= {"n": 16, "heldout": 4}  # the cache's claim needs no more
    conf["tokenize"]["max_length"] = 128
    for wf in clones:
        (wf / "config/nogen.yaml").write_text(yaml.safe_dump(conf))
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": job_path()}
    runs = [subprocess.Popen([*snakemake_cmd(), *TARGETS, "--cores", "1", "--configfile",
                              "config/nogen.yaml", "--cache"], cwd=wf, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for wf in clones]
    outs = [p.communicate(timeout=900)[0] for p in runs]
    for p, out in zip(runs, outs):
        assert p.returncode == 0, out[-6000:]
    # Started together, both computed some of the same stages before either had stored them (a job
    # logs when it runs, not when it is restored): both stored the same entries, the case this is about.
    ran = [{str(f.relative_to(wf / "logs")) for f in (wf / "logs").rglob("*.log") if f.stat().st_size}
           for wf in clones]
    assert ran[0] & ran[1], ran

    # One entry per cached output, the same in both clones; nothing else in the cache (a second copy
    # of a stage's work, or a temporary folder a store left behind).
    a, b = (cached_outputs(wf, cache) for wf in clones)
    assert a == b, (sorted(set(a.items()) ^ set(b.items())))
    assert len(set(a.values())) == len(a), "two outputs served from one entry"
    stored = sorted(p for p in cache.iterdir() if p.name != shared_cache.LOCK_FILE)
    assert stored == sorted(a.values()), [p.name for p in stored]
    want = {"resources/targets/tiny-llama/model", "resources/targets/tiny-llama/identity.json",
            "results/smoke/prompts/train.parquet", "results/smoke/tokenize/tokens.parquet",
            "results/smoke/token_freq/freq.safetensors", "results/smoke/vocab_map/vocab.safetensors",
            "results/smoke/extract/shard_0"}
    assert want <= {str(p) for p in a}, sorted(map(str, a))

    # Byte-identical artifacts in both clones
    for output in a:
        assert contents(clones[0] / output) == contents(clones[1] / output), output

    # Every entry read back against what its producer recorded, in each clone
    for wf in clones:
        for output in a:
            p = wf / output
            if p.suffix == ".json" and isinstance(recorded := json.loads(p.read_text()).get(DIGESTS_KEY), dict):
                for name in recorded:
                    verify_recorded(p.parent / name, p)
        # the target's folder holds exactly the files of its manifest (sha256 each: a tiny target)
        load_identity(wf / "resources/targets/tiny-llama/identity.json")
        # the shard: exactly its index, its load record and its chunks (no second copy of the work in
        # a subfolder), every chunk hashed against the index
        shard = wf / "results/smoke/extract/shard_0"
        index = json.loads((shard / "index.json").read_text())
        assert {str(f.relative_to(shard)) for f in visible_files(shard)} == \
            {"index.json", "target_load.json", *(c["file"] for c in index["chunks"])}
        data = HiddenStateDataset(shard)
        assert len(data) > 0
        for i in range(len(data)):
            data[i]
