"""The real default model end to end (marker ``slow``; CI runs it): SmolLM2-135M-Instruct from its
PyPI GGUF through every stage — generation, tokenize, vocab, hidden states, training, export with
the real vLLM-CPU contract (known-answer drafter, lossless, acceptance against eaglet's exact chain),
evaluation (offline chain, the timed HF loop, real vLLM) and the HTML report — on config/config.yaml
with only the sizes shrunk to minutes (a few dozen prompts). Then the artifacts' invariants, each of
which a wrong stage breaks: sample and token accounting from one stage to the next, the draft
vocabulary's coverage recomputed from the counts, proven labels, a contract with every check run
and passed, lossless decoding, τ of the real loop equal to the offline chain, and the table that
``python -m eaglet.summary`` prints (the README's measured table) made of these very figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import VLLM_ENV, clone

REPO = Path(__file__).resolve().parents[1]
RUN = "e2e"

pytestmark = pytest.mark.slow


def _config() -> dict:
    """config/config.yaml, sizes only: 36 prompts of 48 new tokens (local backend: no server start
    for so few), two epochs, four evaluation prompts of 32 tokens (MT-Bench two categories, held-out),
    vLLM evaluation without the Intel OpenMP variant. ~12 min on 2 quiet cores."""
    c = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    c["run"] = RUN
    c["prompts"].update(n=36, heldout=6)
    c["generate"].update(backend="local", max_tokens=48)
    c["tokenize"]["max_length"] = 512
    c["vocab"]["draft_vocab_size"] = 2048
    c["train"].update(epochs=2, checkpoint_every=20, val_every=20)
    c["evaluate"].update(sets=["mtbench", "heldout"], num_prompts={"mtbench": 2, "heldout": 2}, max_new_tokens=32,
                         k_values=[1, 3], repeats=2)
    c["evaluate"]["vllm"]["iomp"] = False  # two engine starts fewer
    assert c["export"]["vllm_check"] is True and c["evaluate"]["vllm"].get("enabled", True) is not False
    return c


def smk(cwd: Path, cache: Path, *args, timeout=2400):
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", *args, "--cores", "2", "--configfile", "config/e2e.yaml"]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"snakemake {' '.join(args)} failed:\n{(p.stdout + p.stderr)[-8000:]}"
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # Not a skip: `make test` installs the engine; without it the default run is unproven.
    assert (VLLM_ENV / "bin" / "python").exists(), f"{VLLM_ENV} absent: run envs/vllm/setup.sh"
    root = tmp_path_factory.mktemp("e2e")
    a = clone(root / "wf")
    (a / "envs" / "vllm" / ".venv").symlink_to(VLLM_ENV)
    cache = root / "cache"
    cache.mkdir(mode=0o700)
    (a / "config" / "e2e.yaml").write_text(yaml.safe_dump(_config(), sort_keys=False))
    smk(a, cache, "--cache")
    smk(a, cache, "--report", f"results/{RUN}/report.html")
    return a, a / "results" / RUN


def _json(run_dir: Path, rel: str) -> dict:
    return json.loads((run_dir / rel).read_text())


def test_accounting_from_stage_to_stage(run):
    import pyarrow.parquet as pq

    a, r = run
    prompts = pq.read_table(r / "prompts" / "train.parquet").num_rows
    gen = _json(r, "generate/generate_summary.json")
    # every prompt is a sample written (ok), an error, or filtered before generating: a prompt that
    # would leave no room for an answer under tokenize.max_length (issue 15)
    assert gen["input"] == prompts, (gen["input"], prompts)
    assert gen["samples"] + gen["errors"] + gen["filtered"] == prompts, gen
    assert gen["filtered"] == sum(gen["filtered_by_reason"].values())
    assert gen["errors"] == sum(gen["errors_by_kind"].values())
    tok = _json(r, "tokenize/metadata.json")
    assert tok["samples_in"] == gen["samples"], (tok["samples_in"], gen["samples"])
    assert tok["samples_processed"] + tok["samples_skipped"] == tok["samples_in"]
    assert tok["samples_skipped"] == sum(tok["skipped_by_reason"].values())
    assert tok["skipped_by_reason"].get("truncated_no_answer", 0) == 0  # the filter's point
    assert pq.read_table(r / "tokenize" / "tokens.parquet").num_rows == tok["samples_processed"]
    vocab = _json(r, "vocab_map/vocab.json")
    assert vocab["assistant_tokens"] == tok["total_assistant_tokens"]
    idx = _json(r, "extract/shard_0/index.json")
    assert idx["complete"] is True
    assert sum(c["num_tokens"] for c in idx["chunks"]) == tok["total_tokens"]
    assert len(idx["samples"]) == tok["samples_processed"]


def test_draft_vocab_coverage_recomputed_from_the_counts(run):
    from safetensors.numpy import load_file

    _, r = run
    vocab = _json(r, "vocab_map/vocab.json")
    counts = load_file(r / "token_freq" / "freq.safetensors")["counts"]
    maps = load_file(r / "vocab_map" / "vocab.safetensors")
    t2d = maps["t2d"].astype(bool)
    assert t2d.sum() == vocab["draft_vocab_size"] == len(maps["d2t"])
    assert counts.sum() == vocab["assistant_tokens"]
    assert vocab["coverage"] == pytest.approx(counts[t2d].sum() / counts.sum(), abs=1e-9)
    assert 0.9 < vocab["coverage"] <= 1.0


def test_labels_proven_and_contract_passed_with_every_check_run(run):
    _, r = run
    train = _json(r, "train/train_summary.json")
    lc = train["label_check"]
    assert lc["ok"] is True and lc["agreement"] >= 0.99 and lc["judged"] >= 16, lc
    c = _json(r, "drafter/contract.json")
    assert c["ok"] is True and c["failed"] == [] and c["not_run"] == [], {k: c[k] for k in ("failed", "not_run")}
    checks = {x["name"]: x for x in c["checks"]}
    assert all(x["status"] == "pass" for x in checks.values()), [n for n, x in checks.items() if x["status"] != "pass"]
    ka = checks["vllm.known_answer"]["details"]
    assert ka["first_draft_rate"] >= 0.9 and ka["output_is_known_chain"] is True, ka
    assert checks["vllm.lossless"]["details"]["differing_prompts"] == []
    assert checks["vllm.aux_layers"]["details"]["reported"] == train["layer_ids"]


def test_evaluation_is_lossless_and_the_real_loop_matches_the_offline_chain(run):
    _, r = run
    h = _json(r, "eval/summary.json")["headline"]
    assert h["lossless_hf_loop"] is True and h["lossless_vllm"] is True
    assert h["offline_matches_real_loop"] is True and h["vllm_agrees_with_offline"] is True
    # the HF loop's accepted tokens per round are the offline chain's, token for token
    assert h["tau_hf_loop"] == pytest.approx(h["tau_offline_chain"]), (h["tau_hf_loop"], h["tau_offline_chain"])
    assert set(h["tau_hf_loop"]) == {"mtbench", "heldout"}
    for tau in [*h["tau_hf_loop"].values(), *h["tau_vllm"].values()]:
        assert 1.0 <= tau <= 1 + h["k"]
    assert {d.split("/")[0] for d in h["tau_by_domain"]} == {"mtbench", "heldout"}
    assert h["recommendation"] and h["recommended_k"] in (None, 1, 3)


def test_report_and_summary_table_are_made_of_the_artifacts(run):
    a, r = run
    html = (r / "report.html").read_text(errors="replace")
    assert len(html) > 50_000 and "contract.json" in html and "provenance" in html
    p = subprocess.run([sys.executable, "-m", "eaglet.summary", f"results/{RUN}"], cwd=a, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert p.returncode == 0, p.stderr
    rows = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if line.startswith("| ")}
    assert {"generate", "tokenize / vocab", "extract", "train", "export", "evaluate", "**total**"} <= set(rows)
    tok, vocab = _json(r, "tokenize/metadata.json"), _json(r, "vocab_map/vocab.json")
    assert f"{tok['total_tokens']:,} tokens" in rows["tokenize / vocab"]
    assert f"covers {100 * vocab['coverage']:.2f} %" in rows["tokenize / vocab"]
    assert f"{tok['total_tokens']:,} tokens" in rows["extract"]
    assert "contract passed" in rows["export"] and "output = plain greedy" in rows["export"]
    best = _json(r, "train/train_summary.json")["best_val"]
    assert f"validation chain tau {best['chain_tau']:.3f}" in rows["train"]
    assert "lossless: HF loop yes, vLLM yes" in rows["evaluate"]
    # every stage row carries its wall time from provenance.json, and the total is a time too
    assert all(row.rstrip(" |").split("|")[-1].strip() not in ("", "—") for row in rows.values()), rows
