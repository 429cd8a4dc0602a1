"""The GPU-slot launcher, with real processes and real flocks."""

import json
import os
import re
import subprocess
import sys

# The child records which slots it got and when it held them.
CHILD = ("import json, os, sys, time; t0 = time.time(); time.sleep(0.4); "
         "open(sys.argv[1], 'w').write(json.dumps({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), "
         "'start': t0, 'end': time.time()}))")


def launch(args, out, env_extra=None, env_drop=("CUDA_VISIBLE_DEVICES",)):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "eaglet.planner.gpu_slots", *args, "--",
                             sys.executable, "-c", CHILD, str(out)], env=env,
                            stderr=subprocess.PIPE, text=True)


def test_preset_cuda_visible_devices_is_left_alone(tmp_path):
    p = launch(["--gpus", "2", "--total", "4", "--lock-dir", str(tmp_path / "locks")], tmp_path / "o.json",
               env_extra={"CUDA_VISIBLE_DEVICES": "5,7"}, env_drop=())
    assert p.wait(30) == 0, p.stderr.read()
    assert json.loads((tmp_path / "o.json").read_text())["cvd"] == "5,7"
    assert not (tmp_path / "locks").exists()  # no slot was taken


def test_zero_gpus_just_runs(tmp_path):
    p = launch(["--gpus", "0", "--lock-dir", str(tmp_path / "locks")], tmp_path / "o.json")
    assert p.wait(30) == 0, p.stderr.read()
    assert json.loads((tmp_path / "o.json").read_text())["cvd"] is None


def _check_no_overlap(records, total):
    held = []  # (slot, start, end)
    for r in records:
        slots = [int(s) for s in r["cvd"].split(",")]
        assert all(0 <= s < total for s in slots) and len(set(slots)) == len(slots)
        held += [(s, r["start"], r["end"]) for s in slots]
    for i, (s1, a1, b1) in enumerate(held):
        for s2, a2, b2 in held[i + 1:]:
            if s1 == s2:
                assert b1 <= a2 or b2 <= a1, f"slot {s1} held twice at once"


def test_n_slots_n_plus_one_jobs_never_share(tmp_path):
    total = 3
    procs = [launch(["--gpus", "1", "--total", str(total), "--lock-dir", str(tmp_path / "locks")],
                    tmp_path / f"o{k}.json") for k in range(total + 1)]
    for p in procs:
        assert p.wait(60) == 0, p.stderr.read()
    records = [json.loads((tmp_path / f"o{k}.json").read_text()) for k in range(total + 1)]
    _check_no_overlap(records, total)
    # Four 0.4 s jobs on three slots: one job must have waited for another to finish.
    starts = sorted(r["start"] for r in records)
    assert starts[-1] - starts[0] >= 0.35


def test_multi_gpu_jobs_take_disjoint_sets(tmp_path):
    total = 4
    procs = [launch(["--gpus", "2", "--total", str(total), "--lock-dir", str(tmp_path / "locks")],
                    tmp_path / f"o{k}.json") for k in range(3)]
    for p in procs:
        assert p.wait(60) == 0, p.stderr.read()
    records = [json.loads((tmp_path / f"o{k}.json").read_text()) for k in range(3)]
    assert all(len(r["cvd"].split(",")) == 2 for r in records)
    _check_no_overlap(records, total)


def test_too_many_gpus_is_refused(tmp_path):
    p = launch(["--gpus", "3", "--total", "2", "--lock-dir", str(tmp_path / "locks")], tmp_path / "o.json")
    assert p.wait(30) != 0
    assert "3 GPUs wanted" in p.stderr.read()


# A stage that starts a server (eaglet.generate.generate -> vllm_server.start): the server is a child in
# its own session that inherits the environment; the stage waits for it, as serve() does.
SERVER_PARENT = ("import subprocess, sys; "
                 "sys.exit(subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                 "start_new_session=True).wait())")


def test_a_server_started_by_a_job_stays_on_the_jobs_gpus(tmp_path):
    """Issue 14: generate's vLLM server next to extraction shards. The server runs on the GPUs
    its job took, and no other job gets them while it runs."""
    total, locks = 4, str(tmp_path / "locks")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    server = subprocess.Popen([sys.executable, "-m", "eaglet.planner.gpu_slots", "--gpus", "2", "--total", str(total),
                               "--lock-dir", locks, "--", sys.executable, "-c", SERVER_PARENT, CHILD,
                               str(tmp_path / "server.json")], env=env, stderr=subprocess.PIPE, text=True)
    shards = [launch(["--gpus", "1", "--total", str(total), "--lock-dir", locks], tmp_path / f"shard{k}.json")
              for k in range(3)]
    assert server.wait(60) == 0, server.stderr.read()
    granted = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)", server.stderr.read()).group(1)
    for p in shards:
        assert p.wait(60) == 0, p.stderr.read()
    records = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("server", "shard0", "shard1", "shard2")]
    assert records[0]["cvd"] == granted  # the server sees exactly its job's GPUs
    _check_no_overlap(records, total)
    # Five GPUs wanted of four: a shard waited for the server (or another shard) to let go.
    starts = sorted(r["start"] for r in records)
    assert starts[-1] - starts[0] >= 0.35
