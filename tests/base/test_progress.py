"""Progress lines of the long stages (eaglet.base.progress; issue 45): done of total, share, time so far
and left, at most every ``every_s`` and always at the end; and evaluate_vllm's reading of its runner's
block marks while the runner runs."""

import logging
import subprocess
import sys

import pytest

from eaglet.base.progress import Progress
from eaglet.engines.vllm_eval_runner import PROGRESS_MARK
from eaglet.eval import evaluate_vllm


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_at_most_every_interval_and_at_the_end_with_time_left():
    clock = Clock()
    p = Progress(logging.getLogger("t"), "evaluate_offline", 80, "prompts", every_s=30, clock=clock)
    for _ in range(80):
        clock.t += 6.0  # 6 s a prompt: a line every 5 prompts, and the last
        p.step()
    assert len(p.lines) == 80 // 5
    assert p.lines[0] == "evaluate_offline: 5/80 prompts (6 %), 30 s so far, ~7.5 min left"
    assert p.lines[-1] == "evaluate_offline: 80/80 prompts (100 %), 8.0 min so far"


def test_the_end_is_said_even_when_fast_and_a_note_is_kept():
    clock = Clock()
    p = Progress(logging.getLogger("t"), "tokenize", 3, "conversations", clock=clock)
    p.step()
    p.step()
    assert p.lines == []
    p.step(note="2 skipped")
    assert p.lines == ["tokenize: 3/3 conversations (100 %), 0 s so far; 2 skipped"]


def test_a_negative_total_is_refused():
    with pytest.raises(ValueError, match="negative total"):
        Progress(logging.getLogger("t"), "x", -1, "items")


def test_evaluate_vllm_follows_the_runners_block_marks_as_they_come(tmp_path, caplog):
    # a stand-in runner process printing the marks as vllm_eval_runner does, with engine chatter between
    code = ("import time\n"
            f"for i in range(1, 4):\n    print('INFO engine step', flush=True)\n"
            f"    print('{PROGRESS_MARK} %d/3' % i, flush=True)\n    time.sleep(0.3)\n")
    logf = tmp_path / "run.log"
    progress = Progress(logging.getLogger("eaglet.eval.evaluate_vllm"), "evaluate_vllm paired", 3, "timing blocks",
                        every_s=0)
    with open(logf, "w") as fh, caplog.at_level(logging.INFO):
        rc = evaluate_vllm._follow(subprocess.Popen([sys.executable, "-c", code], stdout=fh), logf, 60, progress,
                                   poll_s=0.1)
    assert rc == 0 and progress.done == 3
    assert [line.split(",")[0] for line in progress.lines] == [
        "evaluate_vllm paired: 1/3 timing blocks (33 %)", "evaluate_vllm paired: 2/3 timing blocks (67 %)",
        "evaluate_vllm paired: 3/3 timing blocks (100 %)"]


def test_evaluate_vllm_kills_a_runner_past_its_time_limit(tmp_path):
    logf = tmp_path / "run.log"
    progress = Progress(logging.getLogger("t"), "evaluate_vllm paired", 3, "timing blocks")
    with open(logf, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=fh)
        rc = evaluate_vllm._follow(proc, logf, 0.5, progress, poll_s=0.1)
    assert rc == "timeout" and proc.poll() is not None
