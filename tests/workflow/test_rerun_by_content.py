"""Reruns by content (issue 46): every user file and folder a stage reads is in the reading rule's
params by its content digest (eaglet.workflow.inputs.user_digest; a saved `datasets` data set by
its fingerprint, issue 45), so a rewrite that sets the old
mtime back (cp -p, rsync -a, touch -d, an unpacked archive) reruns exactly the stage that reads it
and what follows, and the same bytes with a new mtime rerun nothing.

On a copy of the finished smoke run: the config is changed to read the user's own files (a prompts
file, an evaluation set and a regenerated set as .parquet paths; then a prompts folder; then a
local target.path folder), that config's finished state is recorded with Snakemake's touch executor
(tests/dag_preview.record_finished: metadata and params as a run would store them, no job run), and
each file is rewritten with its mtime set back before an in-process preview (tests/dag_preview.py).
"""

import json
import os
import shutil
import time

import pytest
import yaml
from test_rerun_table import after, changed

from dag_preview import own_reasons, preview, record_finished
from eaglet.base.conversations import write_conversations

PARAMS = "Params have changed since last execution"


def _rows(n: int, tag: str) -> list[dict]:
    return [{"id": f"{tag}{i}", "messages": [{"role": "user", "content": f"{tag}: what is {i} plus {i}?"},
                                             {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)]


def _jsonl(n: int, tag: str) -> str:
    return "".join(json.dumps({"id": f"{tag}{i}", "conversations": [
        {"from": "human", "value": f"{tag}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n" for i in range(n))


def _rewrite_keeping_mtime(path, write) -> None:
    """Write new content into ``path`` and set its mtime back to what it was (as cp -p does)."""
    st = path.stat()
    time.sleep(0.02)  # past the tick of the file's ctime
    write(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns


def _expect(jobs: dict, stages: set[str], what: str) -> None:
    want = after(stages)
    assert set(jobs) == want, f"{what}: planned {sorted(jobs)}, expected {sorted(want)}"
    # the first reader reruns for its params (the digest, before and now); the rest follow from it
    # (evaluate_speculative runs after evaluate_offline, an input of its own)
    own = own_reasons(jobs)
    assert own and own <= stages, f"{what}: {jobs}"
    for stage in own:
        assert PARAMS in jobs[stage] and "sha256:" in jobs[stage], (what, jobs[stage])


@pytest.fixture(scope="module")
def content_run(finished_run, tmp_path_factory):
    """A copy of the finished smoke run, its config reading the user's own files, recorded finished."""
    a, cache = finished_run
    wf = tmp_path_factory.mktemp("content") / "wf"
    shutil.copytree(a, wf, symlinks=True)
    (wf / "prompts.jsonl").write_text(_jsonl(60, "p"))
    write_conversations(wf / "myset.parquet", _rows(4, "s"))
    write_conversations(wf / "regen.parquet", _rows(4, "r"))
    base = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    conf = changed(base, {
        "prompts.source": "file", "prompts.path": str(wf / "prompts.jsonl"),
        # one relative path (from the workflow folder), one absolute
        "evaluate.sets": ["mtbench", "math", "heldout", "myset.parquet"],
        "evaluate.num_prompts": {"mtbench": 2, "math": 1, "heldout": 3, "myset": 2},
        "evaluate.regenerate.sets": ["mtbench", "heldout", str(wf / "regen.parquet")],
        "evaluate.regenerate.num_prompts": {"mtbench": 2, "heldout": 2, "regen": 2},
    })
    (wf / "config/files.yaml").write_text(yaml.safe_dump(conf))
    record_finished(wf, wf / "config/files.yaml", cache)
    assert preview(wf, wf / "config/files.yaml", cache) == {}, "the recorded run is not up to date"
    return wf, cache, conf


@pytest.mark.parametrize("name, stages, write", [
    ("prompts.jsonl", {"prompts"}, lambda p: p.write_text(_jsonl(60, "q"))),
    ("myset.parquet", {"evaluate_offline", "evaluate_speculative"},
     lambda p: write_conversations(p, _rows(4, "t"))),
    ("regen.parquet", {"eval_prompts"}, lambda p: write_conversations(p, _rows(4, "u"))),
], ids=["prompts.path", "evaluate.sets", "evaluate.regenerate.sets"])
def test_a_rewrite_with_an_older_mtime_reruns_its_reader(content_run, name, stages, write):
    wf, cache, _ = content_run
    path = wf / name
    old = path.read_bytes()
    _rewrite_keeping_mtime(path, write)
    assert path.read_bytes() != old
    _expect(preview(wf, wf / "config/files.yaml", cache), stages, name)
    # the old bytes back (their mtime kept too): the recorded digest again, nothing to do
    _rewrite_keeping_mtime(path, lambda p: p.write_bytes(old))
    assert preview(wf, wf / "config/files.yaml", cache) == {}


def test_the_same_bytes_with_a_new_mtime_rerun_nothing(content_run):
    """The same bytes with a new mtime rerun nothing. Snakemake's own mtime trigger would rerun a
    stage whose input file is newer than its outputs, unless the file is at most 1 MB and its
    recorded checksum still matches (max_checksum_file_size): the user's files are no inputs, so
    only their content (the digest param) counts."""
    wf, cache, _ = content_run
    future = time.time_ns() + 3600 * 10**9
    for name in ("prompts.jsonl", "myset.parquet", "regen.parquet"):
        os.utime(wf / name, ns=(future, future))
    assert preview(wf, wf / "config/files.yaml", cache) == {}


def test_a_prompts_folder_reruns_prompts_on_a_files_new_content(content_run):
    wf, cache, conf = content_run
    folder = wf / "prompts_dir"
    folder.mkdir()
    (folder / "a.jsonl").write_text(_jsonl(30, "a"))
    (folder / "b.jsonl").write_text(_jsonl(30, "b"))
    (folder / ".hidden").write_text("not read")
    (wf / "config/dir.yaml").write_text(yaml.safe_dump(changed(conf, {"prompts.source": "datasets",
                                                                      "prompts.path": str(folder)})))
    record_finished(wf, wf / "config/dir.yaml", cache)
    assert preview(wf, wf / "config/dir.yaml", cache) == {}
    (folder / ".hidden").write_text("dot-names are not the data")
    assert preview(wf, wf / "config/dir.yaml", cache) == {}
    _rewrite_keeping_mtime(folder / "b.jsonl", lambda p: p.write_text(_jsonl(30, "c")))
    _expect(preview(wf, wf / "config/dir.yaml", cache), {"prompts"}, "a file of prompts.path's folder")


def test_prompts_rerun_on_new_content_never_on_a_new_name(content_run):
    """prompts.path is keyed by what it holds (issue 45): a renamed copy of the prompts file, or of a
    data set saved with `datasets`' save_to_disk (keyed by the fingerprint datasets recorded),
    reruns nothing but provenance (which records the config as written); the same name with new
    rows reruns prompts and everything after it."""
    datasets = pytest.importorskip("datasets")
    wf, cache, conf = content_run
    # the files config as the recorded state again: another test of this module may have recorded its own
    record_finished(wf, wf / "config/files.yaml", cache)
    assert preview(wf, wf / "config/files.yaml", cache) == {}
    shutil.copyfile(wf / "prompts.jsonl", wf / "renamed.jsonl")
    (wf / "config/renamed.yaml").write_text(yaml.safe_dump(changed(conf, {"prompts.path": str(wf / "renamed.jsonl")})))
    assert set(preview(wf, wf / "config/renamed.yaml", cache)) <= {"provenance"}
    rows = [json.loads(line) for line in _jsonl(60, "d").splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(wf / "saved"))
    shutil.copytree(wf / "saved", wf / "moved")
    saved, moved = ({"prompts.source": "datasets", "prompts.path": str(wf / name)} for name in ("saved", "moved"))
    (wf / "config/saved.yaml").write_text(yaml.safe_dump(changed(conf, saved)))
    (wf / "config/moved.yaml").write_text(yaml.safe_dump(changed(conf, moved)))
    record_finished(wf, wf / "config/saved.yaml", cache)
    assert preview(wf, wf / "config/saved.yaml", cache) == {}
    assert set(preview(wf, wf / "config/moved.yaml", cache)) <= {"provenance"}
    shutil.rmtree(wf / "saved")
    datasets.Dataset.from_list(rows[:50]).save_to_disk(str(wf / "saved"))
    jobs = preview(wf, wf / "config/saved.yaml", cache)
    assert set(jobs) == after({"prompts"}) and own_reasons(jobs) == {"prompts"}, jobs
    assert PARAMS in jobs["prompts"] and "datasets:" in jobs["prompts"], jobs["prompts"]


def test_a_local_target_folder_reruns_everything_on_a_files_new_content(content_run):
    """A file of a local target.path folder rewritten with its old mtime reruns target_model and
    everything after it (keyed by names, sizes and mtimes, its stale cached target was served)."""
    wf, cache, conf = content_run
    model = wf / "local_target"
    shutil.copytree(wf / "resources/targets/tiny-llama/model", model, symlinks=False)
    (wf / "config/target.yaml").write_text(yaml.safe_dump(changed(conf, {"target.path": str(model),
                                                                         "target.tiny": None})))
    record_finished(wf, wf / "config/target.yaml", cache)
    assert preview(wf, wf / "config/target.yaml", cache) == {}
    conf_file = model / "config.json"
    text = conf_file.read_text()
    _rewrite_keeping_mtime(conf_file, lambda p: p.write_text(text + "\n"))
    jobs = preview(wf, wf / "config/target.yaml", cache)
    _expect(jobs, {"target_model"}, "target.path's config.json")
