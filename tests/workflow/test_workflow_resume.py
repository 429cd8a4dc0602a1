"""A rerun of training resumes only its own run (the issue: after a finished smoke run, the aux
layer ids changed and extraction forced to rerun, training resumed the old run's checkpoint,
trained on other layers' states).

On a clone with config/smoke.yaml, on the output cache of the session's finished smoke run
(conftest.finished_run: its data stages and extraction are served from it, so the first run trains
only): a finished run; the same training forced again resumes its kept checkpoint and ends with the
same metrics (the positive control); then extract.layer_ids [1, 3, 6] (the default is [2, 4, 5]) with extraction and
training forced: training starts at step 0, its log naming the layer ids as the reason the
checkpoint was discarded, and ends with the metrics of a clean run with those layers.
"""

import json
from pathlib import Path

import pandas as pd
import yaml

from conftest import clone
from workflow_common import smk

SUMMARY = "results/smoke/train/train_summary.json"
LOG = "logs/smoke/train.log"


def _config(wf: Path, **extract) -> str:
    conf = yaml.safe_load((wf / "config" / "smoke.yaml").read_text())
    conf["extract"].update(extract)
    (wf / "config" / "resume.yaml").write_text(yaml.safe_dump(conf))
    return "config/resume.yaml"


def _run(wf: Path, cache: Path, *args, configfile: str) -> tuple[dict, str, pd.DataFrame]:
    """Snakemake up to training; (train summary, what this run added to the train log, metrics)."""
    log = wf / LOG
    before = log.read_text() if log.exists() else ""
    smk(wf, cache, SUMMARY, *args, configfile=configfile)
    text = log.read_text()
    text = text[len(before):] if text.startswith(before) else text
    return (json.loads((wf / SUMMARY).read_text()), text,
            pd.read_parquet(wf / "results/smoke/train/metrics.parquet"))


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.step) == list(b.step) and list(a.split) == list(b.split)
    for col in ["loss", "loss_0", "tf_acc_0", "lr", "grad_norm"]:
        assert (a[col] - b[col]).abs().max() <= 1e-6 * max(1.0, a[col].abs().max()), col


def test_changed_layer_ids_do_not_resume_the_old_checkpoint(finished_run, tmp_path):
    _, cache = finished_run  # the smoke run's cache: only train runs first (train is not a cached rule)
    a = clone(tmp_path / "a")
    conf = _config(a)
    first, _, m_first = _run(a, cache, configfile=conf)
    ckpts = sorted(p.name for p in (a / "results/smoke/train/checkpoints").glob("step_*.pt"))
    assert first["resumed_from"] == 0 and first["layer_ids"] == [2, 4, 5] and ckpts, ckpts
    kept = int(ckpts[-1].split("_")[1].split(".")[0])

    # The positive control: the same run forced again resumes its kept checkpoint, same result.
    again, text, m_again = _run(a, cache, "--forcerun", "train", configfile=conf)
    assert again["resumed_from"] == kept and f"checkpoints/step_{kept:08d}.pt" in text, text
    assert "resuming from" in text, text
    assert "discarding" not in text, text
    _same(m_first, m_again)

    # The issue: other aux layers, extraction and training forced.
    conf = _config(a, layer_ids=[1, 3, 6])
    changed, text, m_changed = _run(a, cache, "--forcerun", "extract_hidden_states", "train", configfile=conf)
    assert changed["layer_ids"] == [1, 3, 6] and changed["resumed_from"] == 0
    assert "resum" not in text.replace("(not resuming)", ""), text
    assert (f"{ckpts[-1]}: checkpoint of another run, discarding it (not resuming): "
            "layer_ids: [2, 4, 5] -> [1, 3, 6]; hidden_states.stores: ") in text, text

    # ... and it is the drafter a clean run with those layers trains (extraction from the cache).
    b = clone(tmp_path / "b")
    clean, text, m_clean = _run(b, cache, configfile=_config(b, layer_ids=[1, 3, 6]))
    assert clean["resumed_from"] == 0 and clean["layer_ids"] == [1, 3, 6]
    _same(m_clean, m_changed)
    assert changed["final_train"]["loss"] == clean["final_train"]["loss"] != first["final_train"]["loss"]
