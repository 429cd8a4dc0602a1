"""A stage's logging set-up (eaglet.base.logs.setup_logging) quiets transformers without importing it:
the DAG's small stages (counts, vocabulary map, summaries, plots, provenance, card) never load a model
or a tokenizer, and each paid transformers' import (~1 s of CPU, ~2 s on a busy machine) for this alone."""

import subprocess
import sys

SNIPPET = """
import sys
from eaglet.base.logs import setup_logging
setup_logging(None)
print("imported_by_setup", "transformers" in sys.modules)
import transformers
from transformers.utils import logging as hf_logging
print("verbosity", hf_logging.get_verbosity())
print("progress_bars", hf_logging.is_progress_bar_enabled())
hf_logging.get_logger("transformers.tokenization_utils_base").warning("must not show")
"""


def _run(env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "HF_HUB_DISABLE"))}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=120)


def test_setup_logging_quiets_transformers_without_importing_it():
    p = _run()
    assert p.returncode == 0, p.stderr
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert out["imported_by_setup"] == "False"
    # once imported, transformers is as quiet as when setup_logging called its own functions
    assert int(out["verbosity"]) == 40 and out["progress_bars"] == "False", out
    assert "must not show" not in p.stderr


def test_a_users_verbosity_is_overridden_as_before():
    # setup_logging always forced transformers to errors only: a stage's log is not the place for its warnings
    p = _run({"TRANSFORMERS_VERBOSITY": "info"})
    assert p.returncode == 0, p.stderr
    assert "verbosity 40" in p.stdout
