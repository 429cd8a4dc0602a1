"""extract.target_dtype and train.autocast: auto picks bf16 only where the machine computes it fast
(a GPU job, or a CPU with AMX or avx512_bf16), decided at parse time with its reason, recorded in
the extraction artifact and handed to the trainer resolved."""

import json
import os
import subprocess
from pathlib import Path

import yaml

from conftest import clone, snakemake_cmd
from eaglet.base import capability
from workflow_common import flag_json, planned

CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {model}
flags\t\t: fpu sse2 avx2 {extra}

processor\t: 1
flags\t\t: fpu sse2 avx2 {extra}
"""


def cpuinfo(model="Some CPU", vendor="X", extra=""):
    return CPUINFO.format(model=model, vendor=vendor, extra=extra)


def test_flags_and_model_are_read_from_cpuinfo():
    text = cpuinfo("AMD EPYC 9B14", extra="avx512f avx512_bf16")
    assert {"avx2", "avx512_bf16", "avx512f"} <= capability.cpu_flags(text)
    assert "amx_tile" not in capability.cpu_flags(text)
    assert capability.cpu_model(text) == "AMD EPYC 9B14"
    assert capability.cpu_flags("") == set() and capability.cpu_model("") == "unknown CPU"


def test_auto_is_bf16_only_with_bf16_units_or_a_gpu():
    amx = capability.cpu_flags(cpuinfo(extra="avx512_bf16 amx_bf16 amx_tile amx_int8"))
    epyc = capability.cpu_flags(cpuinfo(extra="avx512f avx512_bf16"))
    avx2 = capability.cpu_flags(cpuinfo())
    assert capability.resolve_target_dtype("auto", False, amx)[0] == "bfloat16"
    dtype, why = capability.resolve_target_dtype("auto", False, epyc)
    assert dtype == "bfloat16" and "avx512_bf16 (no AMX)" in why
    dtype, why = capability.resolve_target_dtype("auto", False, avx2)
    assert dtype == "float32" and "no bf16 matrix units" in why
    # amx_tile alone (no bf16 on the tiles) is not enough
    assert capability.resolve_target_dtype("auto", False, avx2 | {"amx_tile"})[0] == "float32"
    assert capability.resolve_target_dtype("auto", True, avx2) == ("bfloat16", "GPU job")
    # an explicit value is kept, whatever the machine
    assert capability.resolve_target_dtype("bfloat16", False, avx2)[0] == "bfloat16"
    assert capability.resolve_target_dtype("float32", True, amx)[0] == "float32"


def test_extraction_records_the_dtype_it_ran_in(tiny_target, tmp_path):
    import torch

    from eaglet.features.extract import extract
    from eaglet.hidden.reader import HiddenStateDataset
    from train_common import write_tokens

    ident = Path(tiny_target["path"]).parent / "identity.json"
    write_tokens(tmp_path / "tokens.parquet", 4)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for dt in ("float32", "bfloat16"):
            extract(tmp_path / "tokens.parquet", ident, tmp_path / dt, dtype="float32", model_dtype=dt,
                    device="cpu", progress=False, dtype_reason=f"reason {dt}")
            rec = json.loads((tmp_path / dt / "target_load.json").read_text())
            assert rec == {"dtype": dt, "reason": f"reason {dt}", "device": "cpu"}
            ds = HiddenStateDataset([tmp_path / dt / "index.json"])
            out[dt] = ds.sample(0)
    finally:
        torch.set_num_threads(n)
    # the forward really ran in that dtype: the states differ by bf16 rounding, not more
    a, b = out["float32"]["final"], out["bfloat16"]["final"]
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_parse_time_decision_is_logged_and_reaches_extraction(tmp_path):
    a = clone(tmp_path / "wf")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    want, why = capability.resolve_target_dtype("auto", False)
    out, load = {}, {}
    for setting in ("auto", "bfloat16"):
        conf.setdefault("extract", {})["target_dtype"] = setting
        (a / "config/t.yaml").write_text(yaml.safe_dump(conf))
        # the job's settings file (written by a run when it starts; by a preview only where asked)
        env = {**os.environ, "EAGLET_PREVIEW_SETTINGS": str(tmp_path / setting)}
        # the target first: --configfile takes several values
        p = subprocess.run([*snakemake_cmd(), "results/smoke/extract/shard_0", "-n", "-p",
                            "--cores", "1", "--configfile", "config/t.yaml"], cwd=a, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        out[setting] = p.stdout + p.stderr
        assert "--target-load @logs/smoke/config/extract_load.json" in out[setting]
        load[setting] = json.loads((tmp_path / setting / "logs/smoke/config/extract_load.json").read_text())
    assert f"extraction target forward: {want} ({why})" in out["auto"]
    assert (load["auto"]["dtype"], load["auto"]["dtype_reason"]) == (want, why)
    assert "extraction target forward: bfloat16 (set in the config" in out["bfloat16"]
    assert load["bfloat16"]["dtype"] == "bfloat16"


def test_train_autocast_auto_follows_the_same_bf16_units():
    """train.autocast: auto = bf16 autocast on a GPU and on a CPU with bf16 units (AMX or
    avx512_bf16, as extraction's forward), fp32 on AVX2-only CPUs; an explicit value is kept."""
    from eaglet.planner.plan import bf16_autocast

    amx = capability.cpu_flags(cpuinfo(extra="avx512_bf16 amx_bf16 amx_tile"))
    epyc = capability.cpu_flags(cpuinfo(extra="avx512f avx512_bf16"))
    avx2 = capability.cpu_flags(cpuinfo())
    for flags in (amx, epyc):
        dtype, why = capability.resolve_autocast("auto", False, flags)
        assert dtype == "bfloat16" and "training under bf16 autocast" in why
        assert bf16_autocast("auto", False, flags)
    dtype, why = capability.resolve_autocast("auto", False, avx2)
    assert dtype == "float32" and "no bf16 matrix units" in why and not bf16_autocast("auto", False, avx2)
    assert capability.resolve_autocast("auto", True, avx2) == ("bfloat16", "GPU job")
    assert capability.resolve_autocast("float32", True, amx)[0] == "float32"
    assert capability.resolve_autocast("bfloat16", False, avx2)[0] == "bfloat16"
    assert not bf16_autocast("float32", True, amx) and bf16_autocast("bfloat16", False, avx2)


def test_train_autocast_is_decided_at_parse_time_and_is_the_trainers_param(tmp_path):
    """The workflow resolves train.autocast: auto for this machine, logs why, and hands the trainer
    the resolved value (a param: a drafter trained in bf16 is no cache hit on an fp32 CPU)."""
    a = clone(tmp_path / "wf")
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    want, why = capability.resolve_autocast("auto", False)
    for setting, expect in (("auto", want), ("float32", "float32")):
        conf.setdefault("train", {})["autocast"] = setting
        (a / "config/t.yaml").write_text(yaml.safe_dump(conf))
        p = subprocess.run([*snakemake_cmd(), "results/smoke/train/train_summary.json", "-n", "-p",
                            "--cores", "1", "--configfile", "config/t.yaml"], cwd=a, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        if setting == "auto":
            assert f"training autocast: {want} ({why})" in p.stdout + p.stderr
        train = next(j for j in planned(p.stdout + p.stderr) if j["rule"] == "train")
        staged = flag_json(train["shell"], "--params")
        assert staged["autocast"] == expect
