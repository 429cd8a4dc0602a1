"""Print the headline figures of a finished run (what `make run` ends with).

    python -m eaglet.summary results/smollm2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _f(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def train_line(t: dict) -> str:
    """The training figures train_summary.json holds (eaglet.train): steps, the last train and
    validation loss, and the validation chain τ of the kept weights (teacher-forced τ beside it)."""
    tr, va = t.get("final_train") or {}, t.get("final_val") or {}
    best = t.get("best_val") or va
    k = (t.get("params") or {}).get("ttt_steps")
    parts = [f"{t.get('steps')} steps", f"loss {_f(tr.get('loss'))} (validation {_f(va.get('loss'))})"]
    if best:
        parts.append(f"validation chain tau {_f(best.get('chain_tau'))} at k={k} "
                     f"(teacher-forced {_f(best.get('tf_tau'))})")
    if t.get("selected"):
        parts.append(f"kept step {t['selected']['step']}")
    return ", ".join(parts)


def lines(run_dir: Path) -> list[str]:
    out = [f"eaglet run {run_dir.name}:"]

    def load(rel):
        p = run_dir / rel
        return json.loads(p.read_text()) if p.exists() else None

    if (m := load("tokenize/metadata.json")):
        out.append(f"  tokenize   {m['samples_processed']} samples ({m['samples_skipped']} skipped), "
                   f"{m['total_tokens']:,} tokens, {m['total_assistant_tokens']:,} assistant tokens")
    if (v := load("vocab_map/vocab.json")):
        out.append(f"  vocab_map  coverage {100 * v['coverage']:.2f}% at draft vocab {v['draft_vocab_size']:,}"
                   f" of {v['vocab_size']:,} ({len(v['pinned'])} pinned tokens)")
    if (t := load("train/train_summary.json")):
        out.append("  train      " + train_line(t))
    if (e := load("eval/summary.json")):
        out.append("  evaluate   " + json.dumps(e.get("headline", e))[:300])
    report = run_dir / "report.html"
    if report.exists():
        out.append(f"  report     {report}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    print("\n".join(lines(Path(a.run_dir))))


if __name__ == "__main__":
    main()
