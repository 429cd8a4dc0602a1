"""A stage that reads a user's own file or folder checks it against the content digest the
workflow's parse put in its params (eaglet.base.content_digests.verify_content): a file changed
between the parse and the job is refused, naming the config key and the file, instead of read
under the cache key of the content it had."""

import json
import shutil
import time

import pytest

from eaglet.base import content_digests
from eaglet.base.artifacts import ArtifactError
from eaglet.base.content_digests import DigestCache, content_digest
from eaglet.data import prompts, target_model


def _jsonl(n, tag):
    return "".join(json.dumps({"id": f"{tag}{i}", "conversations": [
        {"from": "human", "value": f"{tag} {i}?"}, {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
        for i in range(n))


def test_prompts_refuses_a_file_changed_since_the_parse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "p.jsonl"
    f.write_text(_jsonl(12, "a"))
    want = content_digest(f, DigestCache())
    argv = ["--source", "file", "--path", str(f), "--path-digest", want, "--n", "8", "--heldout", "2",
            "--out-dir", str(tmp_path / "out")]
    prompts.main(argv)
    assert json.loads((tmp_path / "out/summary.json").read_text())["train"] == 8
    f.write_text(_jsonl(12, "b"))
    with pytest.raises(ArtifactError, match=r"prompts\.path: .*p\.jsonl changed after the workflow was parsed"):
        prompts.main(argv)


def test_target_model_refuses_a_local_folder_changed_since_the_parse(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(content_digests, "RACY_NS", -1)  # files copied now are cached at once (weights are old)
    model = tmp_path / "model"
    shutil.copytree(tiny_target["path"], model)
    want = content_digest(model, DigestCache())
    cfg = {"name": "local", "path": str(model), "tiny": None, "content_digest": want}
    ident = target_model.materialise(cfg, tmp_path / "a")
    assert ident["digest"] == tiny_target["digest"]  # the weights hashed once, at the "parse", reused
    time.sleep(0.02)  # past the tick of the files' ctime
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + "\n")
    with pytest.raises(ArtifactError, match=r"target\.path: .*model changed after the workflow was parsed "
                                            r"\(changed since it was last hashed: .*tokenizer_config\.json\)"):
        target_model.materialise(cfg, tmp_path / "b")
