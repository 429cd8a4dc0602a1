"""Progress of a stage's long loop, in its log: done of total, the share, the time so far and the
time left at the rate so far, at most every ``every_s`` seconds and always at the end.

Generate, extract and train show their progress (tqdm bars, step lines); the evaluation stages,
regeneration scoring, tokenisation and vLLM's evaluation loop over prompts, answers or blocks for
minutes to hours at scale (80 MT-Bench questions of 512 tokens on a 1T target) and said nothing
until the end (issue 45). Each calls ``Progress.step`` once per item. A line reads
``evaluate_offline: 12/80 prompts (15 %), 2.1 min so far, ~11.8 min left``.
"""

from __future__ import annotations

import logging
import time

# A line at most this often (seconds): a log a person reads, not one line per prompt of thousands
EVERY_S = 30.0


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class Progress:
    """``what``: the stage (or its part) named in each line; ``total``: items expected; ``unit``:
    their name. ``clock``: time.monotonic, replaceable in tests."""

    def __init__(self, log: logging.Logger, what: str, total: int, unit: str, every_s: float = EVERY_S,
                 clock=time.monotonic):
        if total < 0:
            raise ValueError(f"{what}: a negative total ({total})")
        self.log, self.what, self.total, self.unit, self.every_s, self.clock = log, what, total, unit, every_s, clock
        self.done = 0
        self.t0 = self.last = clock()
        self.lines: list[str] = []

    def line(self) -> str:
        """The progress line as it stands."""
        spent = self.clock() - self.t0
        share = f" ({100 * self.done / self.total:.0f} %)" if self.total else ""
        text = f"{self.what}: {self.done}/{self.total} {self.unit}{share}, {_minutes(spent)} so far"
        if 0 < self.done < self.total:
            text += f", ~{_minutes(spent / self.done * (self.total - self.done))} left"
        return text

    def step(self, n: int = 1, note: str = "") -> None:
        """``n`` more items done; logged when ``every_s`` has passed since the last line, or at the end."""
        self.done += n
        now = self.clock()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            text = self.line() + (f"; {note}" if note else "")
            self.lines.append(text)
            self.log.info("%s", text)
